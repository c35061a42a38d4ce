"""Reused buffers for laying a group's members end to end (`codec._groups`).

Guarantee: `cat_into(slot, tensors)` returns the concatenation of `tensors` (flattened, one
dtype) in a buffer owned by the calling thread and `slot`, valid until that thread's next call
with the same slot. Memory: per thread and slot, the largest concatenation asked for (at most a
group, `_groups.GROUP_NUMEL` elements); a fresh allocation of that size each version would
fault its pages in every time.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def cat_into(slot: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The flat concatenation of `tensors` in this thread's buffer `slot` (see the module docstring)."""
    n = sum(t.numel() for t in tensors)
    dtype = tensors[0].dtype
    bufs = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get((slot, dtype))
    if buf is None or buf.numel() < n:
        buf = bufs[(slot, dtype)] = torch.empty(n, dtype=dtype)
    out = buf[:n]
    torch.cat([t.reshape(-1).cpu() for t in tensors], out=out)  # device members: host copies (small)
    return out
