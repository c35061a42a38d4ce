"""Adapter runs as the protocol sees them: what a commit's `adapter` field (`AdapterMeta`) means
to a publisher, a follower and a push (docs/protocol.md, "Adapter runs").

`sparsesync.adapter` is the PEFT bridge (PEFT models and adapter folders, no runs); this module
turns what it reads into `AdapterMeta` records and checks them against a run's commits.

Guarantees:
- An adapter run and a full-weight run are never confused: a publisher refuses to add adapter
  versions to a full-weight run and the reverse, and to change the base, the configuration or
  the dtype of an adapter run (`check_publish`); a follower built for one kind refuses the
  other, and an adapter follower refuses versions of another base or configuration
  (`check_follow`); a mapping with LoRA tensor names is never published as full weights
  (`adapter_state`).
- Every `AdapterMeta` built here (`meta_from_peft`, `adapter_state`, `meta_for_folder`) has its
  config bounded (`sparsesync.adapter_config`), its one dtype filled in, and its ranks checked
  against the adapter tensors it is published with.
- `read_run_adapter` never raises on an unreadable run: None (a follower then refuses adapter
  versions by name).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from sparsesync.adapter import (
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
from sparsesync.adapter_config import check_config as _check_config
from sparsesync.adapter_config import check_state_ranks
from sparsesync.checkpoint import load_checkpoint
from sparsesync.errors import ConfigError, RunKindError, SparsesyncError
from sparsesync.protocol.records import ADAPTER_DTYPES as _DTYPES
from sparsesync.protocol.records import AdapterMeta, CommitRecord
from sparsesync.protocol.run import Run


# -- the writer side --------------------------------------------------------------------------
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
            hint="publish the PeftModel itself, or pass Publisher(url, adapter=AdapterMeta(...)) for an adapter state dict",
        )
    if meta is not None and len(lora) != len(obj):
        other = next(n for n in obj if not is_adapter_key(n))
        saved = (" (PEFT saves the targeted LM head's or embedding's base weight beside the adapter unless "
                 "save_pretrained(..., save_embedding_layers=False))") if saved_base_layers({other: obj[other]}) else ""
        raise RunKindError(f"tensor {other!r} is not a LoRA adapter tensor, but this publisher writes an adapter run{saved}",
                           hint="publish sparsesync.adapter.adapter_tensors(model) (or push the adapter folder with the "
                                "CLI, which checks such base copies against --base and leaves them out), or full weights "
                                "to a full-weight run")
    return (obj, meta) if meta is None else _with_dtype(obj, meta)


def _with_dtype(state: Mapping[str, torch.Tensor], meta: AdapterMeta) -> tuple[Mapping[str, torch.Tensor], AdapterMeta]:
    """`meta` with the adapter tensors' one dtype filled in; RunKindError on a mixed or changed dtype."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    want = meta.dtype or (dtypes[0] if dtypes else "")
    if dtypes != [want] or want not in _DTYPES:
        raise RunKindError(f"the adapter tensors are {', '.join(dtypes)}, expected all {want or 'one of ' + ', '.join(_DTYPES)}",
                           hint="cast the adapter to one dtype for the whole run (e.g. model.to(torch.bfloat16))")
    try:
        _check_config(meta.config, "adapter_config")
    except ValueError as e:
        raise ConfigError(str(e), hint="adapter runs carry LoRA adapters (peft.LoraConfig) within these bounds") from None
    check_state_ranks(state, meta.config, f"the adapter of {meta.base_model!r}")
    return state, replace(meta, dtype=want)


def check_publish(newest: CommitRecord | None, meta: AdapterMeta | None, url: str) -> None:
    """Refuse to publish `meta`'s kind of version into a run whose newest commit is of another
    kind, base or adapter configuration."""
    if newest is None:
        return
    have = newest.adapter
    if (have is None) != (meta is None):
        raise RunKindError(
            f"{url} is a {_kind(have)} run (version {newest.version}); this publisher writes a {_kind(meta)} run",
            hint="publish to a new run URL",
        )
    if have is not None and meta is not None and _identity(have) != _identity(meta):
        raise RunKindError(f"{url} carries an adapter of another {_what_differs(have, meta)} (version {newest.version})",
                           hint="publish this adapter to a new run URL")


def check_follow(rec: CommitRecord, expected: AdapterMeta | None, url: str) -> None:
    """Refuse a version of another kind (adapter vs full weights), base or adapter configuration
    than the engine following `url` was built for."""
    have = rec.adapter
    if (have is None) != (expected is None):
        fix = ("start the replica on the run's base model with the adapter engine (it reads the run's adapter config)"
               if have is not None else "follow it with a full-weight engine, not an adapter engine")
        raise RunKindError(f"version {rec.version} of {url} is a {_kind(have)} version; this replica serves a {_kind(expected)} run",
                           hint=fix)
    if have is not None and expected is not None and _identity(have) != _identity(expected):
        raise RunKindError(f"version {rec.version} of {url} carries an adapter of another {_what_differs(have, expected)}",
                           hint="restart the replica: it builds its adapter from the run's newest version")


def _identity(meta: AdapterMeta) -> tuple[str, dict[str, Any], str]:
    return meta.base_digest, meta.config, meta.dtype


def _kind(meta: AdapterMeta | None) -> str:
    return "full-weight" if meta is None else f"LoRA adapter (r={meta.rank})"


def _what_differs(a: AdapterMeta, b: AdapterMeta) -> str:
    """What `a` (the run's, the version's) has that `b` (the writer's, the replica's) has not, in a few words."""
    if a.base_digest != b.base_digest:
        return "base model"
    if a.config == b.config:
        return f"dtype ({a.dtype}, not {b.dtype})"
    diff = sorted(k for k in a.config.keys() | b.config.keys() if a.config.get(k) != b.config.get(k))
    shown = "; ".join(f"{k}={_json(a.config.get(k))}, not {_json(b.config.get(k))}" for k in diff[:3])
    return f"configuration (adapter_config.json: {shown}{'; ...' if len(diff) > 3 else ''})"


def _json(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True)  # control characters escaped: safe in one line
    return text if len(text) <= limit else text[:limit] + "..."



# -- the reader side --------------------------------------------------------------------------
def run_adapter(commits: list[CommitRecord]) -> AdapterMeta | None:
    """The adapter the newest of `commits` carries (None: a full-weight run, or no version yet)."""
    return commits[-1].adapter if commits else None


def read_run_adapter(url: str) -> AdapterMeta | None:
    """The adapter of the run at `url` as its newest commit says; None for a full-weight run, and
    when no version can be read yet (a follower then refuses adapter versions by name)."""
    try:
        return run_adapter(Run(url).commits())
    except SparsesyncError:
        return None



# -- push: a PEFT folder ---------------------------------------------------------------------
def meta_for_folder(config: dict[str, Any], state: Mapping[str, torch.Tensor], base: Path | None,
                    newest: CommitRecord | None, url: str) -> tuple[AdapterMeta, dict[str, torch.Tensor]]:
    """The `AdapterMeta` for pushing a PEFT folder with `config`, and the adapter tensors of its
    `state` (`saved_base_layers` checked against the base and left out): the base digest is
    computed from `base` (a checkpoint folder), else from `base_model_name_or_path` when that is
    a local folder, else taken from the run's newest adapter commit (same config only)."""
    named = str(config.get("base_model_name_or_path") or "")
    if base is None and named and Path(named).is_dir():
        base = Path(named)
    base_state = load_checkpoint(base) if base is not None else None
    state = drop_saved_base_layers(state, base_state, named or str(base or ""))
    if base_state is not None:
        return _with_dtype(state, AdapterMeta(named or str(base), base_digest(base_state), config))[1], state
    if newest is not None and newest.adapter is not None and newest.adapter.config == config:
        return _with_dtype(state, newest.adapter)[1], state
    raise ConfigError(f"cannot tell which base weights the adapter for {url} belongs to "
                      f"(base_model_name_or_path {named!r} is not a local folder)",
                      hint="pass --base DIR, the base model's checkpoint folder, so the run records its digest")
