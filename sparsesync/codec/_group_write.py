"""Writing a decoded group (formats 4 and 5: small tensors coded as one) into its members.

Guarantee: `write_group` writes each member's changes into it and hashes every member just
before and just after its writes: for "xxh3b" all in one native pass over the members' addresses
(`_native.members_put`, no Python per member; every index is checked before the first write, so
a failure writes nothing), for the legacy "xxh3" member by member (a failure puts back what was
written). The `GroupWrite` it returns holds the group's changes once (positions, new and
overwritten bits, one element each) and the members' digests after and before the writes (None
where not asked); `undo` puts the overwritten bits back in one native call, `updates` cuts the
changes into each member's (views, no copies). Memory: the overwritten bits, 8 bytes per 64 KiB
block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparsesync.codec import _native
from sparsesync.codec.blocks_digest import BLOCK, combine_many
from sparsesync.codec.diff import bits_view, np_uint_dtype, to_np_bits
from sparsesync.codec.digest import BLOCKS_ALGO, tensor_digest

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_NONE = np.empty(0, dtype=np.uint64)


@dataclass
class GroupWrite:
    """A group's writes into its members (positions in their concatenation, member i owning
    [offsets[i], offsets[i + 1])): what `undo` and `updates` need, and the members' digests."""

    members: Sequence[str]
    dtype: torch.dtype
    ptrs: np.ndarray  # the members' addresses (`_group_read.member_ptrs`)
    offsets: np.ndarray  # int64, one more than members
    idx: np.ndarray  # int64, sorted
    vals: np.ndarray  # the new bits (unsigned, the members' width)
    old: np.ndarray  # the overwritten bits
    cuts: np.ndarray  # where each member's changes start in idx, then idx.size
    after: list[str] | None  # each member's digest after the writes
    before: list[str] | None  # and before them

    def undo(self) -> None:
        """Put the overwritten bits back (one native call; the members must still be where they were)."""
        _native.members_put(self.ptrs, self.old.itemsize, self.idx, self.offsets, self.old, np.empty_like(self.old),
                            _NONE, _NONE)

    def updates(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """`member_updates` of the new bits; the last use of this write (`undo` is no longer possible)."""
        return member_updates(self.idx, self.vals, self.offsets, self.cuts, self.dtype)


def member_updates(
    idx: np.ndarray, vals: np.ndarray, offsets: np.ndarray, cuts: np.ndarray, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per member of a group: its changed elements' indices (int64, member-local) and new values
    (`dtype`) from the group's `idx` (int64, made member-local in place) and `vals` (bits), as
    views of one tensor each."""
    counts = np.diff(cuts)
    local = np.asarray(idx, dtype=np.int64)
    local -= np.repeat(np.asarray(offsets[:-1], dtype=np.int64), counts)
    sizes = counts.tolist()
    new = torch.from_numpy(np.ascontiguousarray(vals).view(_SIGNED[vals.itemsize])).view(dtype)
    return torch.from_numpy(local).split(sizes), new.split(sizes)


def write_group(
    tensors: Mapping[str, torch.Tensor],
    members: Sequence[str],
    ptrs: np.ndarray,
    offsets: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    cuts: np.ndarray,
    *,
    digest: bool,
    before: bool,
    algo: str = BLOCKS_ALGO,
) -> GroupWrite:
    """Write `vals` at `idx` (sorted positions in the members' concatenation, member i owning
    [offsets[i], offsets[i + 1]); `cuts`: where each member's start in `idx`) into the CPU,
    contiguous `tensors[members[i]]` (one dtype) at addresses `ptrs`; digests after if `digest`,
    before if `before`, in `algo`."""
    dtype = tensors[members[0]].dtype
    bits = np_uint_dtype(dtype)
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    vals = np.ascontiguousarray(vals).view(bits)
    old = np.empty_like(vals)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if algo == BLOCKS_ALGO:
        nbytes = np.diff(offsets) * bits.itemsize
        nblk = int((-(-nbytes // BLOCK)).sum())
        h_before = np.empty(nblk if before else 0, dtype=np.uint64)
        h_after = np.empty(nblk if digest else 0, dtype=np.uint64)
        _native.members_put(ptrs, bits.itemsize, idx, offsets, vals, old, h_before, h_after)
        d_before = combine_many(h_before, nbytes) if before else None
        d_after = combine_many(h_after, nbytes) if digest else None
    else:
        d_before, d_after = _legacy(
            [tensors[n] for n in members], offsets, cuts.tolist(), idx, vals, old, digest=digest, before=before,
            algo=algo,
        )
    return GroupWrite(members, dtype, ptrs, offsets, idx, vals, old, cuts, d_after, d_before)


def _legacy(
    ts: list[torch.Tensor],
    offsets: np.ndarray,
    cuts: list[int],
    idx: np.ndarray,
    vals: np.ndarray,
    old: np.ndarray,
    *,
    digest: bool,
    before: bool,
    algo: str,
) -> tuple[list[str] | None, list[str] | None]:
    """`write_group`'s writes member by member, each hashed whole in `algo` before and after;
    on a failure the members written are put back before it is raised."""
    d_before: list[str] = []
    d_after: list[str] = []
    written: list[int] = []
    dsts = [to_np_bits(bits_view(t)) for t in ts]
    w = vals.itemsize
    try:
        for i, (t, d) in enumerate(zip(ts, dsts)):
            a, b = cuts[i], cuts[i + 1]
            if before:
                d_before.append(tensor_digest(t, algo))
            _native.put(d, w, idx[a:b] - offsets[i], vals[a:b], old[a:b])
            written.append(i)
            if digest:
                d_after.append(tensor_digest(t, algo))
    except BaseException:
        for i in written:
            a, b = cuts[i], cuts[i + 1]
            _native.put(dsts[i], w, idx[a:b] - offsets[i], old[a:b], np.empty(0, dtype=old.dtype))
        raise
    return (d_before if before else None), (d_after if digest else None)
