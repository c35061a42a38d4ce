"""The sparse path's writes into the weights a vLLM worker holds as the checkpoint holds them.

Runs inside vLLM's worker. A checkpoint tensor is "held" when, on a single rank, the parameter
the forward pass reads contains it as one contiguous region in checkpoint layout: a plain
parameter (norms, biases), the rows of a fused linear (q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`), an expert's rows, the vocabulary rows of an embedding; and the layer is not
read through a packed copy (a CPU kernel's oneDNN/sgl handle, prepacked CPU experts: there the
parameter is not what the forward pass multiplies with). `held_views` finds them.

`write_held` writes a sparse update into those views with the codec's device apply
(`codec.device_apply.write_checked`): the compact updates in one transfer, the base digests
(where the caller knows them) and the target digests of each touched tensor computed on the
device in one synchronization, every old bit scattered back on a mismatch or error. Nothing of
these tensors is copied to the host: the check is the digest of the very bytes the forward pass
reads. Tensors that are not held (tensor parallel shards, packed CPU kernels, a digest in the
older "xxh3" form) keep vLLM's own loaders and the read-back of `backend._check_sparse`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sparsesync.codec import algo_of
from sparsesync.codec.apply import SparseUpdate
from sparsesync.codec.device_apply import CheckedWrite, write_checked
from sparsesync.codec.digest import BLOCKS_ALGO
from sparsesync.errors import DigestMismatchError, EngineCheckError, PatchMismatchError
from sparsesync.integrations.vllm import readback
from sparsesync.integrations.vllm.layout import Layout


def _reads_parameter(mod: Any, loc: Any) -> bool:
    """Whether the forward pass computes with the parameter itself (no packed copy of it)."""
    if readback.through_kernel(mod, loc):
        return False
    return not (loc.kind in ("expert_w13", "expert_w2") and readback.cpu_experts(mod) is not None)


def held_views(model: torch.nn.Module, layout: Layout, updates: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
               shapes: Mapping[str, Any], digests: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """name -> the region of the live parameter holding checkpoint tensor `name` (a contiguous
    view in checkpoint shape and dtype), for every updated tensor that is held (module docstring)
    and has an "xxh3b" target digest in `digests`. Single rank only (the caller's)."""
    out = {}
    for name, (_idx, values) in updates.items():
        d = digests.get(name)
        if d is None or algo_of(d) != BLOCKS_ALGO:
            continue
        try:
            loc = layout.locate(name)
            mod = readback.module_of(model, loc)
            p = getattr(mod, loc.param)
            if not _reads_parameter(mod, loc):
                continue
            shape = tuple(shapes[name])
            view, _ = readback.local_pair(model, loc, torch.empty(shape, dtype=values.dtype, device="meta"), 0, 1)
        except (KeyError, RuntimeError, IndexError, AttributeError):
            continue
        same_memory = view.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        if same_memory and view.is_contiguous() and tuple(view.shape) == shape and view.dtype == values.dtype:
            out[name] = view
    return out


def write_held(views: Mapping[str, torch.Tensor], updates: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
               base: Mapping[str, str], target: Mapping[str, str]) -> CheckedWrite:
    """Write the updates of `views`' tensors in place, all or nothing, digests checked on the
    device (module docstring); a mismatch is EngineCheckError naming each tensor (every bit back)."""
    ups = {n: SparseUpdate(updates[n][0].to(torch.int64), updates[n][1]) for n in views}
    try:
        with torch.no_grad():
            return write_checked(views, ups, base=base, target=target, what="vLLM sparse update")
    except (PatchMismatchError, DigestMismatchError) as e:
        raise EngineCheckError(f"vLLM worker: {e.message}", hint="the replica reloads the version in full") from None
