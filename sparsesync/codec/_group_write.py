"""Writing a decoded group (formats 4 and 5: small tensors coded as one) into its members.

Guarantee: `write_group` writes each member's changes into it and hashes every member just
before and just after its writes: for "xxh3b" all in one native pass (`_native.members_put`,
no Python per member; every index is checked before the first write, so a failure writes
nothing), for the legacy "xxh3" member by member (a failure puts back what was written). It
returns, per member, its member-local indices, new and overwritten values (torch, the members'
dtype; for the update and its undo) and the digests after and before the writes (None where
not asked). Memory: the overwritten bits (one element per change), 8 bytes per 64 KiB block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from sparsesync.codec import _native
from sparsesync.codec.blocks_digest import combine_many, n_blocks
from sparsesync.codec.diff import bits_view, to_np_bits
from sparsesync.codec.digest import BLOCKS_ALGO, tensor_digest

_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def write_group(
    tensors: Mapping[str, torch.Tensor],
    members: Sequence[str],
    offsets: np.ndarray,
    idx: np.ndarray,
    vals: np.ndarray,
    *,
    digest: bool,
    before: bool,
    algo: str = BLOCKS_ALGO,
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, str | None, str | None]]:
    """Write `vals` at `idx` (sorted positions in the members' concatenation, member i owning
    [offsets[i], offsets[i + 1])) into the CPU, contiguous `tensors[members[i]]` (one dtype);
    per member (its indices, int64, new values, old values, digest after if `digest`, digest
    before if `before`; in `algo`)."""
    ts = [tensors[n] for n in members]
    dsts = [to_np_bits(bits_view(t)) for t in ts]
    bits_dtype = dsts[0].dtype
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    vals = np.ascontiguousarray(vals).view(bits_dtype)
    old = np.empty_like(vals)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    cuts = np.searchsorted(idx, offsets).tolist()
    if algo == BLOCKS_ALGO:
        nbytes = [d.nbytes for d in dsts]
        nblk = sum(n_blocks(n) for n in nbytes)
        h_before = np.empty(nblk if before else 0, dtype=np.uint64)
        h_after = np.empty(nblk if digest else 0, dtype=np.uint64)
        _native.members_put(dsts, bits_dtype.itemsize, idx, offsets, vals, old, h_before, h_after)
        d_before: list[str | None] = [*combine_many(h_before, nbytes)] if before else [None] * len(ts)
        d_after: list[str | None] = [*combine_many(h_after, nbytes)] if digest else [None] * len(ts)
    else:
        d_before, d_after = _legacy(ts, dsts, offsets, cuts, idx, vals, old, digest=digest, before=before, algo=algo)
    counts = np.diff(cuts)
    local = torch.from_numpy(idx - np.repeat(np.asarray(offsets[:-1], dtype=np.int64), counts))
    signed = np.dtype(_SIGNED[bits_dtype.itemsize])
    dtype = ts[0].dtype
    new_t = torch.from_numpy(vals.view(signed)).view(dtype)
    old_t = torch.from_numpy(old.view(signed)).view(dtype)
    return {
        n: (local[cuts[i] : cuts[i + 1]], new_t[cuts[i] : cuts[i + 1]], old_t[cuts[i] : cuts[i + 1]], d_after[i],
            d_before[i])
        for i, n in enumerate(members)
    }


def _legacy(
    ts: list[torch.Tensor],
    dsts: list[np.ndarray],
    offsets: np.ndarray,
    cuts: list[int],
    idx: np.ndarray,
    vals: np.ndarray,
    old: np.ndarray,
    *,
    digest: bool,
    before: bool,
    algo: str,
) -> tuple[list[str | None], list[str | None]]:
    """`write_group`'s writes member by member, each hashed whole in `algo` before and after;
    on a failure the members written are put back before it is raised."""
    d_before: list[str | None] = []
    d_after: list[str | None] = []
    written: list[int] = []
    w = dsts[0].itemsize
    try:
        for i, (t, d) in enumerate(zip(ts, dsts)):
            a, b = cuts[i], cuts[i + 1]
            d_before.append(tensor_digest(t, algo) if before else None)
            _native.put(d, w, idx[a:b] - offsets[i], vals[a:b], old[a:b])
            written.append(i)
            d_after.append(tensor_digest(t, algo) if digest else None)
    except BaseException:
        for i in written:
            a, b = cuts[i], cuts[i + 1]
            _native.put(dsts[i], w, idx[a:b] - offsets[i], old[a:b], np.empty(0, dtype=old.dtype))
        raise
    return d_before, d_after
