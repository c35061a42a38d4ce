"""The writer side of an adapter run, below the protocol: what a publisher publishes for a PEFT
model, an adapter state dict or an adapter folder, and the `AdapterMeta` it publishes it with.

The protocol's `Publisher` (and `push`) calls down into this module once per publish
(`adapter_state`, `meta_for_folder`); everything here builds on the PEFT bridge
(`sparsesync.lora.bridge`) and the config bounds (`sparsesync.lora.config`), and nothing reads
a run: checking what the run already holds is `sparsesync.protocol.adapter_runs`.

Guarantees:
- A mapping with LoRA tensor names is never published as full weights, nor a tensor that is not
  a LoRA tensor as part of an adapter (`adapter_state`); a PEFT model whose adapter config
  differs from the publisher's is refused.
- Every `AdapterMeta` built here (`meta_from_peft`, `adapter_state`, `meta_for_folder`) has its
  config bounded (`sparsesync.lora.config`), its one dtype filled in, and its ranks checked
  against the adapter tensors it is published with.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from sparsesync.checkpoint import load_checkpoint
from sparsesync.errors import ConfigError, RunKindError
from sparsesync.lora.bridge import (
    adapter_tensors,
    base_digest,
    check_supported,
    drop_saved_base_layers,
    is_adapter_key,
    is_peft_model,
    peft_base_state,
    peft_config_json,
    saved_base_layers,
)
from sparsesync.lora.config import check_config as _check_config
from sparsesync.lora.config import check_state_ranks
from sparsesync.lora.meta import ADAPTER_DTYPES as _DTYPES
from sparsesync.lora.meta import AdapterMeta


def meta_from_peft(model: Any, adapter_name: str = "default", base_model: str | None = None, *,
                   dtype: torch.dtype | None = None) -> AdapterMeta:
    """The `AdapterMeta` of a PEFT model (hashes its base weights once). `dtype`: the dtype
    replicas receive (base and adapter), when the trainer holds them in another (fp32 master)."""
    config = peft_config_json(model, adapter_name)
    check_supported(config, f"adapter {adapter_name!r}")
    base = peft_base_state(model)
    if dtype is not None:
        base = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in base.items()}
    meta = AdapterMeta(base_model or str(config.get("base_model_name_or_path") or ""), base_digest(base), config)
    state = adapter_tensors(model, adapter_name)
    return _with_dtype({k: v.to(dtype) for k, v in state.items()} if dtype is not None else state, meta)[1]


class AdapterState(dict[str, torch.Tensor]):
    """An adapter version's tensors (PEFT names) carrying the `AdapterMeta` of their run, so a
    publisher handed it publishes an adapter run (what `peft_publish_state` returns)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], meta: AdapterMeta) -> None:
        super().__init__(tensors)
        self.meta = meta


_META_CACHE: weakref.WeakKeyDictionary[Any, dict[torch.dtype, AdapterMeta]] = weakref.WeakKeyDictionary()


def peft_publish_state(model: Any, dtype: torch.dtype) -> AdapterState | None:
    """For a PEFT model: its adapter tensors cast to `dtype` (contiguous, CPU) with its
    `AdapterMeta` (the base is hashed once per model and dtype); None for any other model.
    Integrations call this so that a LoRA trainer publishes the adapter, not merged weights."""
    if not is_peft_model(model):
        return None
    metas = _META_CACHE.setdefault(model, {})
    if dtype not in metas:
        metas[dtype] = meta_from_peft(model, dtype=dtype)
    state = {k: v.detach().to(device="cpu", dtype=dtype).contiguous() for k, v in adapter_tensors(model).items()}
    return AdapterState(state, metas[dtype])


def adapter_state(obj: Any, meta: AdapterMeta | None) -> tuple[Mapping[str, torch.Tensor], AdapterMeta | None]:
    """What `Publisher.publish` publishes for `obj`: a PEFT model becomes its adapter tensors
    (`adapter_tensors`) and its `AdapterMeta` (`meta` when given, so the base is hashed
    once); a mapping is published as is, and must hold adapter tensors exactly when `meta` is set."""
    if is_peft_model(obj):
        if meta is None:
            meta = meta_from_peft(obj)
        elif peft_config_json(obj) != meta.config:
            raise RunKindError("the PEFT model's adapter_config differs from the one this publisher's run carries",
                               hint="publish it to a new run URL")
        return _with_dtype(adapter_tensors(obj), meta)
    if isinstance(obj, AdapterState) and meta is None:
        meta = obj.meta
    if not isinstance(obj, Mapping):
        raise ConfigError(f"cannot publish a {type(obj).__name__}", hint="pass a state dict or a peft.PeftModel")
    lora = [n for n in obj if is_adapter_key(n)]
    if meta is None and lora:
        raise RunKindError(
            f"the state holds LoRA adapter tensors ({lora[0]!r}, ...), but this publisher writes full weights",
            hint="publish the PeftModel itself, or pass Publisher(url, adapter=AdapterMeta(...)) for an adapter state "
                 "dict",
        )
    if meta is not None and len(lora) != len(obj):
        other = next(n for n in obj if not is_adapter_key(n))
        saved = (" (PEFT saves the targeted LM head's or embedding's base weight beside the adapter unless "
                 "save_pretrained(..., save_embedding_layers=False))") if saved_base_layers({other: obj[other]}) else ""
        raise RunKindError(
            f"tensor {other!r} is not a LoRA adapter tensor, but this publisher writes an adapter run{saved}",
            hint="publish sparsesync.lora.bridge.adapter_tensors(model) (or push the adapter folder with the "
            "CLI, which checks such base copies against --base and leaves them out), or full weights "
            "to a full-weight run",
        )
    return (obj, meta) if meta is None else _with_dtype(obj, meta)


def _with_dtype(state: Mapping[str, torch.Tensor], meta: AdapterMeta) -> tuple[Mapping[str, torch.Tensor], AdapterMeta]:
    """`meta` with the adapter tensors' one dtype filled in; RunKindError on a mixed or changed dtype."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    want = meta.dtype or (dtypes[0] if dtypes else "")
    if dtypes != [want] or want not in _DTYPES:
        raise RunKindError(
            f"the adapter tensors are {', '.join(dtypes)}, expected all {want or 'one of ' + ', '.join(_DTYPES)}",
            hint="cast the adapter to one dtype for the whole run (e.g. model.to(torch.bfloat16))",
        )
    try:
        _check_config(meta.config, "adapter_config")
    except ValueError as e:
        raise ConfigError(
            str(e), hint="adapter runs carry LoRA adapters (peft.LoraConfig) within these bounds"
        ) from None
    check_state_ranks(state, meta.config, f"the adapter of {meta.base_model!r}")
    return state, replace(meta, dtype=want)


# -- push: a PEFT folder ---------------------------------------------------------------------
def meta_for_folder(config: dict[str, Any], state: Mapping[str, torch.Tensor], base: Path | None,
                    run_adapter: AdapterMeta | None, url: str) -> tuple[AdapterMeta, dict[str, torch.Tensor]]:
    """The `AdapterMeta` for pushing a PEFT folder with `config` to the run at `url`, and the
    adapter tensors of its `state` (`saved_base_layers` checked against the base and left out):
    the base digest is computed from `base` (a checkpoint folder), else from
    `base_model_name_or_path` when that is a local folder, else taken from `run_adapter` (the
    adapter the run's newest commit carries; same config only)."""
    named = str(config.get("base_model_name_or_path") or "")
    if base is None and named and Path(named).is_dir():
        base = Path(named)
    base_state = load_checkpoint(base) if base is not None else None
    state = drop_saved_base_layers(state, base_state, named or str(base or ""))
    if base_state is not None:
        return _with_dtype(state, AdapterMeta(named or str(base), base_digest(base_state), config))[1], state
    if run_adapter is not None and run_adapter.config == config:
        return _with_dtype(state, run_adapter)[1], state
    raise ConfigError(f"cannot tell which base weights the adapter for {url} belongs to "
                      f"(base_model_name_or_path {named!r} is not a local folder)",
                      hint="pass --base DIR, the base model's checkpoint folder, so the run records its digest")
