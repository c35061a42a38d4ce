"""Classes of the base magnitude, and ranks of elements inside their class (used by `gaps`/`delta`).

Guarantee: encoder and decoder compute the same classes from the same base bits, so the class
of an element costs nothing to send; with `r = class_ranks(base, t, idx, sizes)`,
`class_select(base, t, np.concatenate(r), [x.size for x in r])` gives back `idx` for every
sorted, unique `idx`. The full-tensor passes run in C (`_native.c`, one pass over
the base, the GIL released); the rest is vectorized numpy. See docs/format.md, "Classes of the
base magnitude".
"""

from __future__ import annotations

import itertools

import numpy as np

from sparsesync.codec import _native

# Elements are grouped by the magnitude of their base value: key = top 7 magnitude bits (for
# bf16/fp32 the top 7 exponent bits, for fp16 5 exponent + 2 mantissa bits, for fp8 all of it).
# Thresholds t_1 < ... < t_{K-1} in [1, 127] split keys into K classes: class c holds keys in
# [t_c, t_{c+1}). Both sides compute the classes from the base; the canonical order inside a
# class is the flat order.


def _top_byte(bits: np.ndarray) -> np.ndarray:
    """The most significant byte of each element's bits (uint8; sign bit included)."""
    w = bits.dtype.itemsize
    if w == 1:
        return bits.view(np.uint8)
    return np.ascontiguousarray(bits).view(np.uint8)[w - 1 :: w]  # little-endian: the last byte


def key_of(bits: np.ndarray) -> np.ndarray:
    """The 7-bit magnitude key of each element's bits (uint8)."""
    return _top_byte(bits) & np.uint8(0x7F)


def key_counts(bits: np.ndarray) -> np.ndarray:
    """How many elements of `bits` have each 7-bit magnitude key (int64[128]; one C pass, no
    temporaries). For uint8 class indices (< 128) that is how many elements each class has."""
    out = np.empty(128, dtype=np.int64)
    flat = np.ascontiguousarray(bits).reshape(-1)
    _native.key_hist(flat, flat.dtype.itemsize, np.zeros(1, dtype=np.int64), flat.size, out)
    return out


def class_of(bits: np.ndarray, thresholds: list[int]) -> np.ndarray:
    """Class index of each element (uint8) for the given thresholds (one C pass)."""
    out = np.empty(bits.size, dtype=np.uint8)
    _native.classes(np.ascontiguousarray(bits), bits.dtype.itemsize, bytes(thresholds), out)
    return out


def offsets(sizes: list[int] | np.ndarray) -> np.ndarray:
    """Start of each group and the total (int64, len(sizes) + 1) for groups of `sizes` laid end to end."""
    return np.fromiter(itertools.accumulate(sizes, initial=0), dtype=np.int64, count=len(sizes) + 1)


def class_sizes(key_hist: np.ndarray, thresholds: list[int]) -> list[int]:
    """How many elements each class holds, from the elements' key histogram (`key_counts`)."""
    edges = [0, *thresholds, 128]
    return [int(key_hist[a:b].sum()) for a, b in zip(edges, edges[1:])]


def class_ranks(base: np.ndarray, thresholds: list[int], idx: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Per class c: the rank of each changed element of class c among all members of class c in
    `base`, in index order. `idx`: sorted, unique; `sizes`: how many of `idx` each class holds
    (`class_sizes` of the base's keys at `idx`)."""
    off = offsets(sizes)
    out = np.empty(idx.size, dtype=np.int64)
    _native.class_ranks(
        np.ascontiguousarray(base),
        base.dtype.itemsize,
        bytes(thresholds),
        np.ascontiguousarray(idx, dtype=np.int64),
        off,
        out,
    )
    return np.split(out, off[1:-1])


def class_select(base: np.ndarray, thresholds: list[int], ranks: np.ndarray, sizes: list[int], *,
                 out_bits: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Inverse of `class_ranks`: `ranks` (int64) holds class 0's ranks, then class 1's, ...
    (`sizes[c]` of class c). Returns (sorted flat indices, -1), or (empty, c) when class c's
    ranks run past its members in `base`. Ranks must be non-negative and strictly increasing
    inside each class (ValueError otherwise). `out_bits` (base's dtype, one per rank): filled
    with `base` at the returned indices, read in the same pass (no second walk to gather them)."""
    off = offsets(sizes)
    flat = np.ascontiguousarray(ranks, dtype=np.int64)
    out = np.empty(flat.size, dtype=np.int64)
    base = np.ascontiguousarray(base)
    if out_bits is None:
        bad = _native.class_select(base, base.dtype.itemsize, bytes(thresholds), flat, off, out)
    else:
        if out_bits.dtype != base.dtype or out_bits.size != flat.size or not out_bits.flags.c_contiguous:
            raise ValueError(
                f"out_bits: {out_bits.dtype} x {out_bits.size}, expected contiguous {base.dtype} x {flat.size}"
            )
        bad = _native.class_select(base, base.dtype.itemsize, bytes(thresholds), flat, off, out, -1, out_bits)
    return (out, -1) if bad < 0 else (out[:0], bad)
