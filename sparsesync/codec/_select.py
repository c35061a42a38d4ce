"""Choosing the smallest encoding for one tensor's change.

Guarantee: the choice only affects size, never the decoded result: every candidate is exact.
Candidates: positions as raw int32/int64, gap codes (plain, or per class of the base magnitude
when the encoder has the base), a zstd bitmap (dense-ish tensors), or dense (all elements);
values as raw bits or as ANS-coded bit-pattern deltas (optionally per class).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from sparsesync.codec import _encodings as E
from sparsesync.codec import _native
from sparsesync.codec.diff import TensorChange
from sparsesync.codec.prepared_base import PreparedBase, hist_sample, thresholds_from_hist

MIN_CLASSED_NUMEL = 4096  # below this, class bitmaps cost more header than they save
# base elements sampled for the class-threshold search (size only: 2^18 saved 0.1% of a patch for 4x the sampling)
_HIST_SAMPLE = 1 << 16
_BITMAP_PROBE, _BITMAP_PROBES, _BITMAP_MIN_PROBE = 1 << 19, 8, 1 << 13  # regions compressed to estimate a bitmap's size
# a bitmap whose first probes extrapolate to this many times the best size so far is not probed
# further (at 6-10% density the first probe says ~1.3x: the other seven were 9% of an encode)
_BITMAP_GIVE_UP = 1.2


def _size(streams: dict) -> int:
    return sum(len(b) for _, _, b in streams.values())


def _bitmap_estimate(idx: np.ndarray, numel: int, beat: float = math.inf) -> float:
    """Bytes of the `bitmap` encoding, extrapolated from _BITMAP_PROBES evenly spaced regions of
    at most _BITMAP_PROBE elements and at least 1/64 of the tensor (0 for tensors small enough
    to just encode). Stops early once the probes so far extrapolate to _BITMAP_GIVE_UP times
    `beat` (the size to beat): the bitmap is then not worth its remaining probes."""
    probe = min(_BITMAP_PROBE, max(_BITMAP_MIN_PROBE, numel // 64) // 64 * 64)
    if numel <= 2 * _BITMAP_PROBES * probe:
        return 0.0
    total = 0
    for i, s in enumerate(np.linspace(0, numel - probe, _BITMAP_PROBES).astype(np.int64)):
        lo, hi = np.searchsorted(idx, [s, s + probe])
        mask = np.zeros(probe, dtype=bool)
        mask[idx[lo:hi] - s] = True
        total += len(E.zstd_compress(np.packbits(mask, bitorder="little")))
        if total * numel / ((i + 1) * probe) > _BITMAP_GIVE_UP * beat:
            break
    return total * numel / ((i + 1) * probe)


def choose_thresholds(
    base_full: np.ndarray, changed_keys: np.ndarray, max_classes: int = 4, min_gain: float = 0.02
) -> list[int]:
    """Class thresholds on the 7-bit magnitude key minimizing the position entropy (DP over
    contiguous key ranges, in C); a class is added only when it saves more than `min_gain`.
    The base's key histogram comes from about _HIST_SAMPLE elements in 64 evenly spaced
    contiguous blocks (cache friendly, deterministic)."""
    starts, block = hist_sample(base_full.size, _HIST_SAMPLE)
    hist = np.empty(128, dtype=np.int64)
    _native.key_hist(np.ascontiguousarray(base_full), base_full.dtype.itemsize, starts, block, hist)
    return thresholds_from_hist(hist, base_full.size, changed_keys, _HIST_SAMPLE, max_classes, min_gain)


def choose(
    ch: TensorChange, ctx: E.Ctx, base_full: np.ndarray | PreparedBase | None = None, *, classes: bool = True
) -> tuple[str, dict, dict, str, dict, dict]:
    """(positions, position_params, position_streams, values, value_params, value_streams).
    `classes=False` leaves out the class-conditioned codings (and the pass over the whole base
    that finding each change's class rank takes, on both sides). `base_full`: the base's bits,
    or what the encoder reads of them prepared on a device (`prepared_base`: the same bytes)."""
    n, numel = ch.n_changed, ch.numel
    idx = ch.indices
    raw_pos = "raw_i32" if numel <= np.iinfo(np.int32).max else "raw_i64"
    w = ctx.np_bits.itemsize
    # candidates: (size, name, build() -> (params, streams)); raw forms are sized without building them
    pos_cands: list[tuple[int, str, Callable[[], tuple[dict, dict]]]] = [
        (n * (4 if raw_pos == "raw_i32" else 8), raw_pos, lambda: E.POSITIONS[raw_pos][0](idx, ctx))
    ]
    thresholds: list[int] = []
    sizes = None
    if n < numel:
        if classes and base_full is not None and numel >= MIN_CLASSED_NUMEL and n >= 16:
            changed_keys = E.key_counts(ch.base_bits)
            thresholds = (base_full.thresholds_for(changed_keys, _HIST_SAMPLE) if isinstance(base_full, PreparedBase)
                          else choose_thresholds(base_full, changed_keys))
            sizes = E.class_sizes(changed_keys, thresholds)  # shared by gaps and delta
        gp, gs = E._gaps_enc(idx, ctx, thresholds, ch.base_bits, base_full, sizes)
        pos_cands.append((_size(gs) + 60 * (len(thresholds) + 1), "gaps", lambda: (gp, gs)))
        # a bitmap costs >= H(n/numel) bits per element: only dense tensors, and only where
        # compressing a sample of it says it may beat the best so far
        best_pos = min(c[0] for c in pos_cands)
        if n * 16 >= numel and _bitmap_estimate(idx, numel, best_pos) < best_pos:
            bp, bs = E._bitmap_enc(idx, ctx)
            pos_cands.append((_size(bs), "bitmap", lambda: (bp, bs)))
    psize, pname, pbuild = min(pos_cands, key=lambda c: c[0])

    raw_values = lambda: E._raw_val_enc(ch.base_bits, ch.target_bits, ctx)  # noqa: E731
    val_cands: list[tuple[int, str, Callable[[], tuple[dict, dict]]]] = [(n * w, "raw", raw_values)]
    dp, ds = E._delta_enc(ch.base_bits, ch.target_bits, ctx, thresholds, sizes)
    val_cands.append((_size(ds) + 20 * (len(thresholds) + 1), "delta", lambda: (dp, ds)))
    vsize, vname, vbuild = min(val_cands, key=lambda c: c[0])
    best = (psize + vsize, pname, pbuild, vname, vbuild)

    if n * 4 >= numel:  # dense: every element's value, no positions
        if n == numel and n * w < best[0]:
            best = (n * w, "dense", lambda: ({}, {}), "raw", raw_values)
        if base_full is not None or n == numel:  # every element changed: the change carries the whole base
            if base_full is None:
                full, tgt = ch.base_bits, ch.target_bits
            else:
                full = base_full.whole() if isinstance(base_full, PreparedBase) else base_full
                tgt = full.copy()
                tgt[idx] = ch.target_bits
            fp, fs = E._delta_enc(full, tgt, ctx)
            if _size(fs) + 20 < best[0]:
                best = (_size(fs) + 20, "dense", lambda: ({}, {}), "delta", lambda: (fp, fs))
    _, pname, pbuild, vname, vbuild = best
    return (pname, *pbuild(), vname, *vbuild())
