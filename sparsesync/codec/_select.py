"""Choosing the smallest encoding for one tensor's change.

Guarantee: the choice only affects size, never the decoded result: every candidate is exact.
Candidates: positions as raw int32/int64, gap codes (plain, or per class of the base magnitude
when the encoder has the base), a zstd bitmap (dense-ish tensors), or dense (all elements);
values as raw bits or as ANS-coded bit-pattern deltas (optionally per class).
"""

from __future__ import annotations

import numpy as np

from sparsesync.codec import _encodings as E
from sparsesync.codec.diff import TensorChange

MIN_CLASSED_NUMEL = 4096  # below this, class bitmaps cost more header than they save
_HIST_SAMPLE = 1 << 18  # base elements sampled for the class-threshold search


def _size(streams: dict) -> int:
    return sum(len(b) for _, _, b in streams.values())


def _sample(x: np.ndarray) -> np.ndarray:
    """About _HIST_SAMPLE elements of x in 64 evenly spaced contiguous blocks (cache friendly,
    deterministic)."""
    if x.size <= _HIST_SAMPLE:
        return x
    block = _HIST_SAMPLE // 64
    starts = np.linspace(0, x.size - block, 64).astype(np.int64)
    return np.concatenate([x[s : s + block] for s in starts])


def _xlogx_cost(t: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Bits to code c changes among t elements at their empirical rate (vectorized, t >= c)."""
    t = np.maximum(t, c).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(t > 0, c / t, 0.0)
        h = -(np.where(p > 0, p * np.log2(p), 0.0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0.0))
    return t * h


def choose_thresholds(base_full: np.ndarray, base_at_idx: np.ndarray, max_classes: int = 4, min_gain: float = 0.02) -> list[int]:
    """Class thresholds on the 7-bit magnitude key minimizing the position entropy (DP over
    contiguous key ranges); a class is added only when it saves more than `min_gain`."""
    tot = np.bincount(E.key_of(_sample(base_full)), minlength=128).astype(np.float64) * (base_full.size / max(1, min(base_full.size, _HIST_SAMPLE)))
    chg = np.bincount(E.key_of(base_at_idx), minlength=128).astype(np.float64)
    nz = np.flatnonzero(tot + chg)
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    ct = np.concatenate([[0.0], np.cumsum(tot[lo:hi])])
    cc = np.concatenate([[0.0], np.cumsum(chg[lo:hi])])
    B = hi - lo
    # cost[a, b]: one class over keys [lo + a, lo + b)
    a_idx, b_idx = np.meshgrid(np.arange(B + 1), np.arange(B + 1), indexing="ij")
    cost = np.where(b_idx > a_idx, _xlogx_cost(ct[b_idx] - ct[a_idx], cc[b_idx] - cc[a_idx]), np.inf)
    dp = [cost[0]]  # dp[k][b]: best cost of keys [lo, lo + b) in k + 1 classes
    back = []
    for _ in range(1, max_classes):
        tot_k = dp[-1][:, None] + cost  # split at a
        back.append(np.argmin(tot_k, axis=0))
        dp.append(np.min(tot_k, axis=0))
    best_k = 0
    for k in range(1, max_classes):
        if dp[k][B] < dp[best_k][B] * (1 - min_gain):
            best_k = k
    cuts, b = [], B
    for k in range(best_k, 0, -1):
        a = int(back[k - 1][b])
        cuts.append(lo + a)
        b = a
    return sorted(t for t in cuts if 1 <= t <= 127)


def choose(ch: TensorChange, ctx: E.Ctx, base_full: np.ndarray | None = None) -> tuple[str, dict, dict, str, dict, dict]:
    """(positions, position_params, position_streams, values, value_params, value_streams)."""
    n, numel, w = ch.n_changed, ch.numel, ctx.np_bits.itemsize
    idx = ch.indices
    raw_pos = "raw_i32" if numel <= np.iinfo(np.int32).max else "raw_i64"
    pos_cands: list[tuple[int, str, dict, dict]] = []
    pp, ps = E.POSITIONS[raw_pos][0](idx, ctx)
    pos_cands.append((_size(ps), raw_pos, pp, ps))
    thresholds: list[int] = []
    if n < numel:
        if base_full is not None and numel >= MIN_CLASSED_NUMEL and n >= 16:
            thresholds = choose_thresholds(base_full, ch.base_bits)
        pp, ps = E._gaps_enc(idx, ctx, thresholds, ch.base_bits, base_full)
        pos_cands.append((_size(ps) + 60 * (len(thresholds) + 1), "gaps", pp, ps))
        if n * 16 >= numel:  # a bitmap costs >= H(n/numel) bits per element: only dense tensors
            pp, ps = E._bitmap_enc(idx, ctx)
            pos_cands.append((_size(ps), "bitmap", pp, ps))
    psize, pname, pparams, pstreams = min(pos_cands, key=lambda c: c[0])

    val_cands: list[tuple[int, str, dict, dict]] = []
    vp, vs = E._raw_val_enc(ch.base_bits, ch.target_bits, ctx)
    val_cands.append((_size(vs), "raw", vp, vs))
    vp, vs = E._delta_enc(ch.base_bits, ch.target_bits, ctx, thresholds)
    val_cands.append((_size(vs) + 20 * (len(thresholds) + 1), "delta", vp, vs))
    vsize, vname, vparams, vstreams = min(val_cands, key=lambda c: c[0])
    best = (psize + vsize, pname, pparams, pstreams, vname, vparams, vstreams)

    if n * 4 >= numel:  # dense: every element's value, no positions
        if n == numel:
            vp, vs = E._raw_val_enc(ch.base_bits, ch.target_bits, ctx)
            if _size(vs) < best[0]:
                best = (_size(vs), "dense", {}, {}, "raw", vp, vs)
        if base_full is not None or n == numel:  # every element changed: the change carries the whole base
            if base_full is None:
                full, tgt = ch.base_bits, ch.target_bits
            else:
                full, tgt = base_full, base_full.copy()
                tgt[idx] = ch.target_bits
            vp, vs = E._delta_enc(full, tgt, ctx)
            if _size(vs) + 20 < best[0]:
                best = (_size(vs) + 20, "dense", {}, {}, "delta", vp, vs)
    return best[1:]
