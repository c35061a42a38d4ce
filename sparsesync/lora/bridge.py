"""The PEFT bridge: PEFT models and adapter folders in, PEFT models and adapter folders out.

An adapter run (docs/protocol.md, "Adapter runs") is an ordinary run whose tensors are what
PEFT writes into `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`, ...)
and whose every commit record carries an `AdapterMeta` (`sparsesync.lora.meta`): the base
model's id and digest and the adapter's `adapter_config.json`. This module knows PEFT and the
adapter files, not runs: the adapter state a publisher publishes is `sparsesync.lora.state`
(built on this one), and what a run's `adapter` field means to a publisher or a follower is
`sparsesync.protocol.adapter_runs`, above this package.

Guarantees:
- The base weights a replica serves the adapter on are checked against the run's base digest
  (`check_base`) before any adapter version is applied: a mismatch is `BaseModelMismatchError`.
- `write_adapter_folder` writes a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)
  that `PeftModel.from_pretrained` loads; `read_adapter_folder` reads one back (no pickle).
- An adapter config is bounded before PEFT sees it (`sparsesync.lora.config`, `check_supported`):
  its numbers and regexes on every read (a pushed folder, an engine), its ranks against the
  adapter tensors before a folder is written, and an engine refuses an adapter larger than its
  base before allocating it (`adapter_layout`).
- What PEFT saves by default is accepted: the frozen base weight of a targeted LM head or
  embedding that it saves beside the adapter is checked to equal the base's and left out
  (`drop_saved_base_layers`); when it differs, or no base is at hand, ConfigError names the
  tensor and the PEFT option (`save_embedding_layers=False`).
"""

from __future__ import annotations

import json
import math
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparsesync.checkpoint import checkpoint_digest, load_checkpoint, read_in_folder
from sparsesync.codec.digest import algo_of, state_digest, tensor_digests
from sparsesync.errors import AdapterTargetError, BaseModelMismatchError, ConfigError
from sparsesync.lora.config import check_config as _check_config
from sparsesync.lora.config import check_state_ranks
from sparsesync.lora.meta import AdapterMeta

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_LORA_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)")
_MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json larger than this is not one


# -- the writer side --------------------------------------------------------------------------
def is_peft_model(obj: object) -> bool:
    """True for a `peft.PeftModel` (without importing peft when it is not loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(obj, peft.PeftModel)


def is_adapter_key(name: str) -> bool:
    """True for a LoRA tensor name (what PEFT saves: `...q_proj.lora_A.weight`)."""
    return _LORA_KEY.search(name) is not None


def base_digest(state: Mapping[str, torch.Tensor]) -> str:
    """The digest an adapter run records for its base: the state digest of `state` (a model's
    `state_dict()` or a loaded checkpoint) in the checkpoint's own key set."""
    return checkpoint_digest(state)


def peft_base_state(model: Any) -> dict[str, torch.Tensor]:
    """The base weights of a PEFT model under the base checkpoint's names (LoRA tensors left out,
    `.base_layer` removed); views, no copies."""
    out = {}
    for name, t in model.get_base_model().state_dict().items():
        if not is_adapter_key(name):
            out[name.replace(".base_layer.", ".")] = t
    return out


def adapter_tensors(model: Any, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """A PEFT model's adapter tensors under the names `adapter_model.safetensors` holds (views of
    the live parameters). Only the adapter: never the base's embedding or LM head, which PEFT
    would otherwise add when they are targeted (`save_embedding_layers=False`)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False))


_CONFIG_TEXT: dict[tuple[str, str], str] = {}  # adapter_config.json as PEFT writes it, by the config's content


def peft_config_json(model: Any, adapter_name: str = "default") -> dict[str, Any]:
    """The adapter_config.json PEFT writes for `adapter_name` of `model`, as a dict (a new one
    each call). PEFT writes it once per config content (`to_dict()`, all it writes from); a
    publisher calls this on every publish of a PeftModel."""
    config = model.peft_config[adapter_name]
    key = (type(config).__qualname__, repr(config.to_dict()))
    if key not in _CONFIG_TEXT:
        with tempfile.TemporaryDirectory(prefix="sparsesync-adapter-") as tmp:
            config.save_pretrained(tmp)
            if len(_CONFIG_TEXT) >= 64:  # bounded: a config changed in place many times
                _CONFIG_TEXT.clear()
            _CONFIG_TEXT[key] = (Path(tmp) / CONFIG_FILE).read_text()
    return json.loads(_CONFIG_TEXT[key])


def check_supported(config: dict[str, Any], what: str) -> None:
    """ConfigError (naming `what`) unless `config` is an adapter_config.json that adapter runs carry:
    a LoRA config within `sparsesync.lora.config`'s bounds, without `modules_to_save`."""
    try:
        _check_config(config, what)
    except ValueError as e:
        raise ConfigError(f"{e}", hint="adapter runs carry LoRA adapters (peft.LoraConfig)") from None
    if config.get("modules_to_save"):
        raise ConfigError(f"{what}: modules_to_save={config['modules_to_save']!r} is not supported in adapter runs",
                          hint="train those modules as part of a full-weight run, or leave modules_to_save unset")


# -- the reader side --------------------------------------------------------------------------
def check_base(base_state: Mapping[str, torch.Tensor], meta: AdapterMeta, where: str) -> None:
    """Raise BaseModelMismatchError unless `base_state` (checkpoint key set) is the run's base."""
    got = state_digest(tensor_digests(base_state, algo_of(meta.base_digest)))  # in the algorithm the run recorded
    if got != meta.base_digest:
        raise BaseModelMismatchError(
            f"the base weights in {where} have digest {got}, but the adapter run was trained on "
            f"{meta.base_model!r} with digest {meta.base_digest}",
            hint=f"start the replica with the run's base model ({meta.base_model})",
        )


def peft_config(meta: AdapterMeta) -> Any:
    """The `peft.LoraConfig` of an adapter run (for building the engine's PEFT model)."""
    from peft import PeftConfig

    config = {k: v for k, v in meta.config.items() if k not in ("peft_version",)}
    cfg = PeftConfig.from_peft_type(**config)
    cfg.inference_mode = True
    return cfg


def attach_adapter(base: Any, meta: AdapterMeta, state: Mapping[str, torch.Tensor] | None = None) -> Any:
    """`base` (a transformers model) wrapped as a PEFT model with `meta`'s adapter, its LoRA
    parameters in the run's dtype, loaded with `state` when given (bit for bit)."""
    from peft import set_peft_model_state_dict

    model = _peft_model(base, meta, "the model")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.data = p.data.to(meta.torch_dtype)
    if state is not None:
        # torch's _IncompatibleKeys (PEFT annotates `-> namedtuple`)
        result: Any = set_peft_model_state_dict(model, dict(state))
        missing = [k for k in result.missing_keys if is_adapter_key(k)]
        if missing or result.unexpected_keys:
            raise ConfigError(f"the adapter state does not fit {meta.base_model!r}: missing {missing[:3]}, "
                              f"unexpected {list(result.unexpected_keys)[:3]}")
    return model


def _peft_model(base: Any, meta: AdapterMeta, where: str) -> Any:
    """`get_peft_model` with `meta`'s adapter; AdapterTargetError (one line: the modules asked for, the
    model, the modules it has, the fix) instead of PEFT's error when they select no module of `base`."""
    from peft import get_peft_model

    no_match: type[Exception] = ValueError  # older PEFT: a ValueError "Target modules ... not found in the base model"
    try:
        from peft.utils.error import NoMatchingPeftModuleError

        no_match = NoMatchingPeftModuleError
    except ImportError:
        pass
    try:
        return get_peft_model(base, peft_config(meta), autocast_adapter_dtype=False)
    except no_match as e:
        if type(e) is ValueError and "not found in the base model" not in str(e):
            raise
        asked = ", ".join(
            f"{k}={json.dumps(meta.config[k])[:120]}" for k in _SELECTORS if meta.config.get(k) is not None
        )
        have = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in base.named_modules()
                if isinstance(m, torch.nn.Linear | torch.nn.Embedding)
            }
        )
        raise AdapterTargetError(
            f"the adapter of {meta.base_model!r} ({asked}) targets no module of {where} "
            f"(its layers: {', '.join(have[:12])}{', ...' if len(have) > 12 else ''})",
            hint=f"start the replica with the base model the adapter was trained on ({meta.base_model}), or publish "
                 "the "
            "adapter to a new run with target_modules naming this model's layers",
        ) from None


_SELECTORS = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")  # what picks PEFT's modules


def read_adapter_folder(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the adapter_config.json of a PEFT adapter folder."""
    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights.is_file():
        raise ConfigError(f"{path} is not a PEFT adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})",
                          hint="save the adapter with model.save_pretrained(DIR)")
    raw = read_in_folder(cfg_file, path, _MAX_CONFIG_BYTES + 1) or b""  # nothing outside the folder, no FIFO
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{cfg_file} is over {_MAX_CONFIG_BYTES} bytes: not an adapter config")
    try:
        config = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(f"{cfg_file} is not JSON: {e}") from None
    check_supported(config, str(cfg_file))
    return load_checkpoint(weights, folder=path), config


def is_adapter_folder(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def write_adapter_folder(state: Mapping[str, torch.Tensor], meta: AdapterMeta, dest: Path, *, version: int,
                         digest: str) -> list[Path]:
    """Write `state` as a PEFT adapter folder into `dest` (which must not hold another model)."""
    from safetensors.torch import save_file

    # before PEFT could load it
    check_state_ranks(state, meta.config, f"version {version} of the adapter of {meta.base_model!r}")
    dest.mkdir(parents=True, exist_ok=True)
    save_file(dict(state), str(dest / WEIGHTS_FILE), metadata={
        "format": "pt", "sparsesync_version": str(version), "sparsesync_state_digest": digest})
    (dest / CONFIG_FILE).write_text(json.dumps(meta.config, indent=2, sort_keys=True) + "\n")
    return [dest / CONFIG_FILE, dest / WEIGHTS_FILE]


def saved_base_layers(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{tensor name: base checkpoint name} of the base-model tensors PEFT saves beside an adapter
    by default: with `save_embedding_layers="auto"` (PEFT's default) an adapter whose
    `target_modules` names an embedding or the LM head (`lm_head`, `embed_tokens`) also holds that
    layer's frozen base weight (`base_model.model.lm_head.base_layer.weight`)."""
    out = {}
    for name in state:
        if not is_adapter_key(name) and name.startswith("base_model.model."):
            out[name] = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return out


def drop_saved_base_layers(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None,
                           base_name: str) -> dict[str, torch.Tensor]:
    """`state` without the base-model tensors PEFT saved beside the adapter (`saved_base_layers`),
    each first checked to equal the base's tensor exactly (in the saved tensor's dtype; a tied LM
    head against the embedding): an adapter run carries the adapter, the base is named by digest.
    ConfigError naming the tensor when it differs from the base or no base is at hand to check it."""
    extra = saved_base_layers(state)
    for name, ckpt in extra.items():
        if base is None:
            raise ConfigError(
                f"the adapter holds {name!r}, a copy of the base model's {ckpt!r} that PEFT saves by default "
                "when target_modules names lm_head or embed_tokens, and no base folder is at hand to check it",
                hint="pass --base DIR (the base model's folder), or save the adapter with "
                "save_pretrained(..., save_embedding_layers=False)",
            )
        want = base.get(ckpt, base.get(TIED_NAMES.get(ckpt, "")))
        got = state[name]
        if want is None or tuple(want.shape) != tuple(got.shape) or not torch.equal(got, want.to(got.dtype)):
            raise ConfigError(
                f"the adapter's {name!r} (saved by PEFT beside the adapter) is not the base {base_name!r}'s "
                f"{ckpt!r}: the adapter was trained on other base weights, or that layer was trained",
                hint="pass --base DIR with the base the adapter was trained on; a trained LM head or "
                "embedding (modules_to_save) belongs in a full-weight run",
            )
    return {k: v for k, v in state.items() if k not in extra}


TIED_NAMES = {"lm_head.weight": "model.embed_tokens.weight"}  # a tied head is saved once, as the embedding


def adapter_layout(model_dir: Path, meta: AdapterMeta) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor an adapter version of `meta` holds on the model in
    `model_dir` (built on the meta device: no weights are loaded, nothing is allocated).
    ConfigError when `meta`'s config is out of bounds, or when the adapter would hold more
    elements than the base model itself: an engine calls this before it allocates the adapter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        _check_config(meta.config, f"the adapter config of {meta.base_model!r}")
    except ValueError as e:
        raise ConfigError(
            str(e), hint="the run's adapter config is out of bounds: publish the adapter to a new run"
        ) from None
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = _peft_model(AutoModelForCausalLM.from_config(config), meta, f"the model in {model_dir}")
    layout = {k: (tuple(v.shape), meta.torch_dtype) for k, v in adapter_tensors(model).items()}
    base_n = sum(v.numel() for v in peft_base_state(model).values())
    adapter_n = sum(math.prod(shape) for shape, _ in layout.values())
    if adapter_n > base_n:
        raise ConfigError(
            f"the adapter config of {meta.base_model!r} (r={meta.rank}) makes an adapter of {adapter_n:,} "
            f"elements on the model in {model_dir}, more than the base model's {base_n:,}",
            hint="the run's adapter config asks for a rank its tensors cannot have: publish the adapter "
            "to a new run with its own adapter_config.json",
        )
    return layout
