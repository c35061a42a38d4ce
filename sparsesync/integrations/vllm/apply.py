"""Apply sparsesync versions to a running vLLM `LLM`, and prove they reached the forward pass.

`WeightSync(llm, source)` drives one engine from any caller (the replica app's `VllmEngine`, a
user's own script). Guarantees:

- Weights reach vLLM only through its weight-transfer API (`start_weight_update` /
  `update_weights` / `finish_weight_update(weight_version=...)`, finish in a `finally`); vLLM's
  weight version moves only when the update succeeded and its read-back matched (the worker
  raises `EngineCheckError` otherwise, see `backend.py`).
- Every version switch, failed or not, resets vLLM's prefix cache, so no request is served
  with KV computed by another version's weights.
- "reload" mode (CPU): each update sends every checkpoint tensor of every vLLM layer it
  touches (`Layout.complete_groups`: q/k/v together, gate/up together, all experts of a MoE
  layer together) and nothing else; the values come from `self.source`: references to the served
  version's tensors in checkpoint coordinates, never a copy of its own (at start the checkpoint
  the engine loaded; then the tensors each `load` and `patch` was given, e.g. the follower's
  file-backed mirror). "sparse" mode (GPU): indices and values only, with the digests of the
  touched tensors before and after (the worker writes the tensors it holds in checkpoint layout
  with the device apply and checks both on the device, `device_sparse.py`).
- The whole state, not only what an update touched: a "reload" update also hands the worker
  the version's digest and dtype of every tensor it does not send (`verify`), which the worker
  checks against what its forward pass reads (`unchanged.py`) before the version moves. The
  digests are the caller's (`digests=`: the follower's, of the version) or, for a tensor the
  caller gave none for, hashed once from `self.source` and kept until that tensor changes.
- Staging: in memory for single-process engines; otherwise a file under /dev/shm that every
  worker reads (multi-process, tensor parallel), removed after the update.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from sparsesync.codec import tensor_digest
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import EngineError
from sparsesync.integrations.vllm.layout import DEFAULT_PACKED, Layout


def _packed_mapping(worker: Any) -> dict[str, list[str]]:
    """Runs in the worker (collective_rpc): the model's fused-module table."""
    model = worker.model_runner.get_model()
    return {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}


def _single_process(llm: Any) -> bool:
    pc = llm.llm_engine.vllm_config.parallel_config
    return (
        os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        and pc.distributed_executor_backend == "uni"
        and pc.world_size == 1
    )


class WeightSync:
    """Moves one vLLM engine from version to version (see module docstring)."""

    def __init__(
        self,
        llm: Any,
        source: Mapping[str, torch.Tensor],
        *,
        mode: str = "reload",
        check: bool = True,
        run_url: str = "",
    ) -> None:
        """`source`: the tensors vLLM serves now, in checkpoint coordinates (e.g. the checkpoint it
        loaded, `sparsesync.checkpoint.load_checkpoint`: a file map, read only where needed).
        Held by reference: the caller must not change them except through `load`/`patch`."""
        from sparsesync.integrations.vllm import plugin

        plugin.register()
        if mode not in ("reload", "sparse"):
            raise EngineError(f"vllm update mode '{mode}': expected 'reload' or 'sparse'")
        self.llm = llm
        self.mode = mode
        self.check = check
        self.source: dict[str, torch.Tensor] = dict(source)  # name -> the served version's tensor (references)
        self.in_memory = _single_process(llm)
        try:
            packed = llm.collective_rpc(_packed_mapping)[0] or DEFAULT_PACKED
        except Exception:  # noqa: BLE001 - engines may refuse callables over RPC
            packed = DEFAULT_PACKED
        self.digests: dict[str, str] = {}  # name -> digest of `source[name]` (filled as needed)
        self.layout = Layout({k: tuple(v.shape) for k, v in self.source.items()}, packed)
        shapes = {k: list(v.shape) for k, v in self.source.items()}
        llm.init_weight_transfer_engine({"init_info": {"run_url": run_url, "shapes": shapes, "check": check}})

    @torch.no_grad()
    def load(self, version: int, tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str] | None = None) -> None:
        """Replace every weight with `tensors` (checkpoint names, complete key set), which become
        the source (by reference, no copy). `digests`: theirs, where known."""
        self.source = dict(tensors)
        self.digests = {n: d for n, d in (digests or {}).items() if n in self.source}
        self._transfer(version, "dense", {"tensors": dict(self.source)})

    def _verify(self, sent: list[str], digests: Mapping[str, str] | None) -> dict[str, list[str]]:
        """[digest, dtype] of every source tensor not in `sent` (see module docstring)."""
        out = {}
        for name in sorted(set(self.source) - set(sent)):
            d = (digests or {}).get(name) or self.digests.get(name)
            if d is None:
                d = self.digests[name] = tensor_digest(self.source[name])
            out[name] = [d, str(self.source[name].dtype).removeprefix("torch.")]
        return out

    @torch.no_grad()
    def patch(self, version: int, updates: Mapping[str, SparseUpdate], digests: Mapping[str, str] | None = None,
              *, full: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """Write the changed elements of one version; returns the checkpoint tensors sent.

        `full`: the version's value of each touched tensor (the follower's mirror): they become
        the source's tensors for those names, by reference. A touched tensor not in `full` is
        written into the source's tensor in place (a caller that owns the source, e.g. a copy of
        the checkpoint)."""
        base = {n: self.digests[n] for n in updates if n in self.digests}  # what the engine holds now
        for name, upd in updates.items():
            if full is not None and name in full:
                self.source[name] = full[name]
            else:
                self.source[name].view(-1).index_put_((upd.indices,), upd.values)
            self.digests.pop(name, None)
        self.digests.update({n: d for n, d in (digests or {}).items() if n in self.source})
        if self.mode == "sparse":
            payload = {
                "updates": {n: (u.indices, u.values) for n, u in updates.items()},
                "shapes": {n: list(self.source[n].shape) for n in updates},
                "digests": dict(digests or {}),
                "base_digests": base,
            }
            self._transfer(version, "sparse", payload)
            return sorted(updates)
        names = self.layout.complete_groups(updates)
        verify = self._verify(names, digests) if self.check else {}
        self._transfer(version, "dense", {"tensors": {n: self.source[n] for n in names}, "verify": verify})
        return names

    def _transfer(self, version: int, kind: str, payload: dict[str, Any] | None) -> None:
        from sparsesync.integrations.vllm.backend import stage, stage_file, unstage

        handle = path = None
        if payload is not None:
            if self.in_memory:
                handle = stage(payload)
            else:
                path = stage_file(kind, payload)
        info: dict[str, Any] = {"kind": kind, "handle": handle, "path": path}
        if payload is None:
            info["handle"] = "sparsesync-missing"  # a handle that was never staged (failure tests)
        ok = False
        try:
            self.llm.start_weight_update()
            try:
                self.llm.update_weights({"update_info": info})
                ok = True
            finally:
                try:
                    self.llm.finish_weight_update(weight_version=str(version) if ok else None)
                except RuntimeError:
                    if ok:
                        raise  # a failed update already closed the session in the worker
        finally:
            if handle is not None:
                unstage(handle)
            if path is not None:
                os.unlink(path)
            if not self.llm.reset_prefix_cache():  # KV of the old weights must never be reused
                raise EngineError(
                    "vLLM refused to reset its prefix cache after a weight update",
                    hint="no request may run during an update",
                )
