"""Decoding one coding of a patch (a tensor's, or a group's concatenation) against base bits.

Guarantee: `decode_bits` returns (sorted, unique flat indices, their new bits), exactly the
elements whose bits change, or raises PatchFormatError naming the coding: every stream decodes
to exactly its declared size, positions are in range, strictly increasing and as many as
declared. It reads the base only through the `base_bits` callable it is given (the base bits
at given sorted indices, or, for None, every element's), and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sparsesync.codec import _encodings, _native
from sparsesync.codec.diff import take_bits, to_np_bits
from sparsesync.codec.patch import Patch, TensorEntry, ctx_for
from sparsesync.errors import PatchFormatError

BaseBits = Callable[[np.ndarray | None], np.ndarray]  # the base bits at sorted indices (None: all)


def tensor_base(flat: torch.Tensor) -> BaseBits:
    """`BaseBits` of a tensor's flat element bits (`diff.bits_view`), on any device."""

    def base_bits(idx: np.ndarray | None) -> np.ndarray:
        if idx is None:
            return to_np_bits(flat)
        if flat.device.type == "cpu":
            return take_bits(to_np_bits(flat), idx)
        return to_np_bits(flat[torch.from_numpy(idx).to(flat.device)])

    return base_bits


def decode_bits(patch: Patch, e: TensorEntry, base_bits: BaseBits) -> tuple[np.ndarray, np.ndarray]:
    """(sorted flat indices, their new bits) of coding `e`'s changes to the base `base_bits` reads."""
    ctx = ctx_for(e, base_bits, patch.header.format_version)
    streams = {role: patch.stream(e.name, role, e) for role in e.streams}
    dense = e.positions == "dense"  # every element: no positions to decode (nor to hold, 8 bytes each)
    try:
        idx = None if dense else _encodings.POSITIONS[e.positions][1](e.position_params, streams, ctx)
        # gaps decode to n_changed strictly increasing positions in range by construction
        if idx is not None and e.positions != "gaps":
            idx = _encodings.check_indices(ctx, idx)
        vals = _encodings.VALUES[e.values][1](e.value_params, streams, idx, ctx)
    except PatchFormatError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as err:
        raise PatchFormatError(
            f"tensor '{e.name}': {e.positions}/{e.values} streams do not decode ({type(err).__name__}: {err})",
            hint="the patch is corrupt; fetch it again",
        ) from None
    n = ctx.numel if idx is None else idx.size
    if vals.shape != (n,):
        raise PatchFormatError(
            f"tensor '{e.name}': {vals.size} values decoded, expected {n}",
            hint="the patch is corrupt; fetch it again",
        )
    if idx is None:  # report only what actually changes
        return _changed(ctx.base(None), vals)
    return idx, vals


def _changed(base: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, new bits) of the elements where `vals` differs from `base` (one native pass;
    copied to their size when they fill less than half the outputs)."""
    base, vals = np.ascontiguousarray(base), np.ascontiguousarray(vals, dtype=base.dtype)
    oi, oa, ob = np.empty(base.size, np.int64), np.empty_like(base), np.empty_like(base)
    k, _ = _native.diff_into(base, vals, base.itemsize, 0, 0, oi, oa, ob)
    return (oi[:k], ob[:k]) if 2 * k >= base.size else (oi[:k].copy(), ob[:k].copy())
