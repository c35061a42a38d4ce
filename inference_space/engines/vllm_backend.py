"""The `sparsesync` weight-transfer backend for vLLM (runs inside vLLM's worker).

Registered from outside vLLM's tree (see `vllm_plugin.register`), so any vLLM entry point
with `weight_transfer_config={"backend": "sparsesync"}` (`LLM`, `AsyncLLM`, `vllm serve
--weight-transfer-config '{"backend": "sparsesync"}'`) accepts sparsesync updates through the
standard calls: `init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update(weight_version=...)`.

An update (`update_info`) names its payload instead of carrying it: `handle` is a key into this
process's staging table (single-process engines, the default of `VllmEngine`), or `path` is a
safetensors file (multi-process engines; tensors passed through vLLM's RPC do not arrive).
Two kinds, both in checkpoint (HF) coordinates:
- "dense": full tensors, loaded through vLLM's layerwise reload path
  (`initialize_layerwise_reload` -> `model.load_weights` -> `finalize_layerwise_reload`, the
  finalize in a `finally`), which handles CPU weight repacking. The caller sends every tensor
  of each touched vLLM layer (e.g. q, k and v for a fused qkv_proj), so no layer is left half
  loaded.
- "sparse": flat indices + values per tensor, written in place through
  `load_checkpoint_weight_patches` (fused qkv/gate_up and tensor-parallel shards handled by the
  model's own weight loaders). GPU only: on CPU that loader fails inside the reload path.
Payloads are validated by the caller before they are staged (names, shapes, dtypes, ranges,
finite values); this module checks shapes against the model's checkpoint layout once more.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "sparsesync"

# -- the in-process staging table (single-process engines) -----------------------------
_STAGED: dict[str, dict[str, Any]] = {}
_STAGED_LOCK = threading.Lock()
_COUNTER = itertools.count()


def stage(payload: dict[str, Any]) -> str:
    """Keep `payload` for the worker in this process; returns its handle."""
    handle = f"sparsesync-{next(_COUNTER)}"
    with _STAGED_LOCK:
        _STAGED[handle] = payload
    return handle


def unstage(handle: str) -> None:
    with _STAGED_LOCK:
        _STAGED.pop(handle, None)


def _take(handle: str) -> dict[str, Any]:
    with _STAGED_LOCK:
        payload = _STAGED.get(handle)
    if payload is None:
        raise ValueError(
            f"sparsesync update handle '{handle}' is not staged in this process "
            "(multi-process engines must pass `path` instead)"
        )
    return payload


@dataclass
class SparsesyncInitInfo(WeightTransferInitInfo):
    """Nothing to set up: payloads arrive through the staging table or files."""

    run_url: str = ""  # for logs only: the run the replica follows


@dataclass
class SparsesyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: where its tensors are, and their kind."""

    kind: str  # "dense" | "sparse"
    handle: str | None = None  # staging-table key (same process)
    path: str | None = None  # safetensors file (dense: name -> tensor; sparse: name.indices / name.values,
    # full shapes as JSON in the metadata key "shapes")

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "sparse"):
            raise ValueError(f"sparsesync update kind '{self.kind}': expected 'dense' or 'sparse'")
        if (self.handle is None) == (self.path is None):
            raise ValueError("sparsesync update: give exactly one of `handle` or `path`")


def _load_payload(info: SparsesyncUpdateInfo) -> dict[str, Any]:
    if info.handle is not None:
        return _take(info.handle)
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    flat = load_file(str(info.path))
    if info.kind == "dense":
        return {"tensors": flat}
    with safe_open(str(info.path), framework="pt") as f:
        shapes = json.loads((f.metadata() or {}).get("shapes", "{}"))  # name -> full checkpoint shape
    names = sorted({k.rsplit(".", 1)[0] for k in flat})
    return {"updates": {n: (flat[f"{n}.indices"], flat[f"{n}.values"]) for n in names}, "shapes": shapes}


class SparsesyncWeightTransferEngine(WeightTransferEngine[SparsesyncInitInfo, SparsesyncUpdateInfo]):
    """Applies sparsesync updates to the worker's model (see module docstring)."""

    init_info_cls = SparsesyncInitInfo
    update_info_cls = SparsesyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.run_url = ""
        self.updates_applied = 0

    def init_transfer_engine(self, init_info: SparsesyncInitInfo) -> None:
        self.run_url = init_info.run_url

    def start_weight_update(self) -> None:
        """No-op: each `update_weights` call runs its own complete load (see receive_weights)."""

    def finish_weight_update(self) -> None:
        """No-op: the layerwise reload was finalized inside `receive_weights`."""

    def receive_weights(self, update_info: SparsesyncUpdateInfo) -> None:
        payload = _load_payload(update_info)
        if update_info.kind == "dense":
            self._load_dense(payload["tensors"])
        else:
            self._load_sparse(payload["updates"], payload.get("shapes", {}))
        self.updates_applied += 1

    def _load_dense(self, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(list(tensors.items()))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def _load_sparse(self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> None:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        if self.device.type == "cpu":
            raise RuntimeError("sparse in-place patches are GPU-only in vLLM 0.32 (CPU: send kind='dense')")
        patches = []
        for name, (indices, values) in updates.items():
            shape = tuple(shapes[name])
            patches.append(
                CheckpointWeightPatch(
                    name=name,
                    shape=shape,
                    dtype=values.dtype,
                    values=values.to(self.device, non_blocking=True),
                    indices=indices.to(self.device, non_blocking=True),
                )
            )
        load_checkpoint_weight_patches(self.model, patches)

    def shutdown(self) -> None:
        pass
