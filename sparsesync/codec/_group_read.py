"""Decoding a group (formats 4 and 5: small tensors coded as one) against its members' base bits.

Guarantee: `decode_group` returns the group's changes (sorted positions in the members'
concatenation, their new bits, where each member's changes start) or raises PatchFormatError
(a stream that does not decode, a member without exactly the count of changes the group section
declares for it); it writes nothing. CPU members are read where they lie, through their
addresses (`member_ptrs`, `_native.members_take`): only the base bits at the changed positions
are read, with no copy of the members laid end to end and no Python per member; only a coding
that reads every base element (dense positions, classes of the base magnitude) copies the
members end to end, natively, into a buffer this thread reuses. Members on another device are
copied to the host end to end first.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from sparsesync.codec import _native
from sparsesync.codec._decode import decode_bits, tensor_base
from sparsesync.codec._scratch import cat_into
from sparsesync.codec.diff import bits_view, np_uint_dtype
from sparsesync.codec.patch import Group, Patch
from sparsesync.errors import PatchFormatError

_local = threading.local()


def member_ptrs(ts: Sequence[torch.Tensor]) -> np.ndarray:
    """The address of each tensor's first element (int64), for the `_native.members_*` calls.
    The caller guarantees what those calls cannot check: each tensor is a live, C-contiguous
    CPU tensor of the element count and width the calls are given (`apply._check_layout`)."""
    return np.array([t.data_ptr() for t in ts], dtype=np.int64)


class MemberBits:
    """The base bits of a group's CPU members, read where they lie (`_decode.BaseBits`): at
    sorted positions of their concatenation, or (None) the whole concatenation, copied once
    into this thread's reused buffer (valid until this thread's next group)."""

    def __init__(self, ptrs: np.ndarray, offsets: np.ndarray, bits: np.dtype) -> None:
        self.ptrs, self.offsets, self.bits = ptrs, offsets, bits
        self._whole: np.ndarray | None = None

    def __call__(self, idx: np.ndarray | None) -> np.ndarray:
        w = self.bits.itemsize
        if idx is not None:
            out = np.empty(idx.size, dtype=self.bits)
            _native.members_take(self.ptrs, w, self.offsets, np.ascontiguousarray(idx, dtype=np.int64), out)
            return out
        if self._whole is None:
            self._whole = _scratch(self.bits, int(self.offsets[-1]))
            _native.members_copy(self.ptrs, w, self.offsets, self._whole)
        return self._whole


def _scratch(dtype: np.dtype, n: int) -> np.ndarray:
    """A buffer of `n` elements owned by this thread (the largest asked for is kept: a fresh one
    each version would fault its pages in every time)."""
    bufs = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.size < n:
        buf = bufs[dtype] = np.empty(n, dtype=dtype)
    return buf[:n]


def decode_group(
    patch: Patch, g: Group, tensors: Mapping[str, torch.Tensor], ptrs: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A group's (positions in the members' concatenation, new bits, where each member's
    positions start, then their count); `ptrs`: the members' addresses when they are all on the
    CPU (`member_ptrs`), else None (read through host copies)."""
    if ptrs is not None:
        base = MemberBits(ptrs, g.offsets, np_uint_dtype(tensors[g.members[0]].dtype))
        idx, vals = decode_bits(patch, g.coding, base)
    else:
        host = cat_into("base", [bits_view(tensors[n]) for n in g.members])
        idx, vals = decode_bits(patch, g.coding, tensor_base(host))
    cuts = np.searchsorted(idx, g.offsets)
    got = np.diff(cuts)
    if not np.array_equal(got, g.n_changed):
        i = int(np.argmax(got != g.n_changed))
        raise PatchFormatError(
            f"group '{g.coding.name}': member '{g.members[i]}' decodes to {int(got[i])} changes, the group section "
            f"says {int(g.n_changed[i])}",
            hint="the patch is corrupt; fetch it again",
        )
    return idx, vals, cuts
