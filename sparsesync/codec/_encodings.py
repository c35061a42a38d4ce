"""Position and value encodings of one tensor's changes (spec: docs/format.md, "Positions" and "Values").

Guarantee: for every encoding, `decode_*(encode_*(x)) == x` exactly, and every decoder either
returns arrays of exactly the size the header implies or raises PatchFormatError; compressed
streams are never inflated past that size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sparsesync.codec import _native
from sparsesync.codec._classes import (  # noqa: F401 - key_of re-exported
    class_of,
    class_ranks,
    class_select,
    class_sizes,
    key_counts,
    key_of,
    offsets,
)
from sparsesync.codec._streams import (  # noqa: F401 - Ctx, check_indices: the codings' callers use them from here
    MAX_ALPHABET,
    MAX_CLASSES,
    MAX_K,
    Ctx,
    StreamOut,
    ans_decode,
    ans_encode,
    check_counts,
    check_indices,
    escape_costs,
    format_error,
    zstd_compress,
    zstd_decompress,
)
from sparsesync.codec.prepared_base import PreparedBase

# ---------------------------------------------------------------------------- positions
# Each: encode(indices, ctx) -> (params, {role: StreamOut}); decode(params, streams, ctx) -> int64 indices
# `layout(params, ctx)` -> {role: (dtype, shape or None for any 1-D)} checked when the file is read.


def _raw_i32_enc(idx: np.ndarray, ctx: Ctx) -> tuple[dict, dict[str, StreamOut]]:
    return {}, {"indices": ("I32", (idx.size,), idx.astype("<i4").tobytes())}


def _raw_i64_enc(idx: np.ndarray, ctx: Ctx) -> tuple[dict, dict[str, StreamOut]]:
    return {}, {"indices": ("I64", (idx.size,), idx.astype("<i8").tobytes())}


def _raw_dec(params: dict, streams: dict[str, bytes], ctx: Ctx) -> np.ndarray:
    raw = streams["indices"]
    dt = "<i4" if len(raw) == 4 * ctx.n_changed else "<i8"
    return np.frombuffer(raw, dtype=dt).astype(np.int64)


def _dense_enc(idx: np.ndarray, ctx: Ctx) -> tuple[dict, dict[str, StreamOut]]:
    return {}, {}


def _dense_dec(params: dict, streams: dict[str, bytes], ctx: Ctx) -> np.ndarray:
    return np.arange(ctx.numel, dtype=np.int64)


def _check_thresholds(ctx: Ctx, t: object) -> list[int]:
    if (
        not isinstance(t, list)
        or len(t) >= MAX_CLASSES
        or not all(type(x) is int and 1 <= x <= 127 for x in t)
        or any(a >= b for a, b in zip(t, t[1:]))
    ):
        raise format_error(
            ctx, f"class thresholds {t!r:.80}, expected fewer than {MAX_CLASSES} increasing integers in [1, 127]"
        )
    return t


def _gaps_enc(
    idx: np.ndarray,
    ctx: Ctx,
    thresholds: list[int],
    base_at_idx: np.ndarray | None,
    base_full: np.ndarray | PreparedBase | None,
    sizes: list[int] | None = None,
) -> tuple[dict, dict[str, StreamOut]]:
    """Gap coding, optionally per class of the base magnitude: within each class, the ranks of
    the changed elements among the class members are gap coded; gap = q * 2^k + low, q entropy
    coded (ANS, escapes raw), low as k raw bits. `sizes`: `class_sizes` of the base at `idx`
    when the caller has them."""
    if thresholds:
        if base_at_idx is None or base_full is None:
            raise ValueError("class-conditioned gaps need the base")
        sizes = class_sizes(key_counts(base_at_idx), thresholds) if sizes is None else sizes
        ranks = (base_full.class_ranks(thresholds, sizes) if isinstance(base_full, PreparedBase)
                 else class_ranks(base_full, thresholds, idx, sizes))
    else:
        ranks = [idx]
    ranks = [np.ascontiguousarray(r, dtype=np.int64) for r in ranks]
    params = _gap_params(ranks)
    classes, models, escapes = [], [], []
    # + 8: room for 64-bit writes
    low = np.zeros((sum(r.size * k for r, (k, _) in zip(ranks, params)) + 7) // 8 + 8, dtype=np.uint8)
    sym_all = np.empty(sum(r.size for r in ranks), dtype=np.int32)  # every class's symbols, in class order
    off, s0 = 0, 0
    for r, (k, e) in zip(ranks, params):
        sym, esc, hist = sym_all[s0 : s0 + r.size], np.empty(r.size, dtype=np.uint64), np.empty(e + 1, dtype=np.int64)
        n_esc = _native.gap_symbols(r, k, e, sym, esc, hist, low, off)
        off, s0 = off + r.size * k, s0 + r.size
        counts = [int(c) for c in hist] if r.size else [1, 0]  # an empty class: any valid model
        classes.append({"n": int(r.size), "k": k, "counts": counts})
        models.append((counts, r.size))
        escapes.append(esc[:n_esc])
    streams = {
        "gaps": ans_encode(sym_all, models),
        "gaps_escape": b"".join(e.astype("<u8").tobytes() for e in escapes),
        "gaps_low": low[: (off + 7) // 8].tobytes(),
    }
    # the ANS stream is always present (empty when the symbols are certain); the others only when non-empty
    return {"thresholds": thresholds, "classes": classes}, {
        k: ("U8", (len(b),), b) for k, b in streams.items() if b or k == "gaps"
    }


def _gap_params(ranks: list[np.ndarray]) -> list[tuple[int, int]]:
    """Per class (its sorted ranks; gap i = r[i] - r[i - 1] - 1): (remainder bits k near log2
    of the mean gap, alphabet size e of the quotients) minimizing the coded size. Each class's
    candidate histograms come from one C pass over its gaps; the costs of
    all classes' candidates are evaluated together. Both are chosen on every step-th gap of
    large classes (about 2^16 of them: size only, never correctness)."""
    rows: list[np.ndarray] = []
    plans: list[tuple[int, int, int, int] | None] = []  # per class: (k0, gaps sampled, first row, rows), None: no gaps
    for r in ranks:
        if r.size == 0:
            plans.append(None)
            continue
        mean = float(int(r[-1]) + 1 - r.size) / r.size  # the gaps sum to r[-1] + 1 - n
        base = int(np.floor(np.log2(mean + 1.0)))
        step = max(1, r.size >> 16)
        n_sample = (r.size + step - 1) // step
        k0, k1 = max(0, base - 3), min(MAX_K, base)
        # row j: the quotients' histogram for k = k0 + j
        hists = np.empty((k1 - k0 + 1, MAX_ALPHABET + 1), dtype=np.int64)
        _native.gap_khist(r, step, k0, hists)
        plans.append((k0, n_sample, sum(len(h) for h in rows), len(hists)))
        rows.append(hists)
    bits, es = escape_costs(np.concatenate(rows), 64) if rows else (None, None)
    out: list[tuple[int, int]] = []
    for plan in plans:
        if plan is None:
            out.append((0, 1))
            continue
        assert bits is not None and es is not None  # a plan has rows
        k0, n_sample, r0, nk = plan
        j = int(np.argmin(bits[r0 : r0 + nk] + (k0 + np.arange(nk)) * n_sample))  # first of equal costs: smallest k
        out.append((k0 + j, int(es[r0 + j])))
    return out


def _gaps_dec(params: dict, streams: dict[str, bytes], ctx: Ctx) -> np.ndarray:
    thresholds = _check_thresholds(ctx, params.get("thresholds"))
    classes = params.get("classes")
    if set(params) != {"thresholds", "classes"} or not isinstance(classes, list) or len(classes) != len(thresholds) + 1:
        raise format_error(
            ctx, f"gaps parameters {params!r:.120}, expected thresholds and {len(thresholds) + 1} classes"
        )
    ns, ks, cs = [], [], []
    for c in classes:
        if (
            not isinstance(c, dict)
            or set(c) != {"n", "k", "counts"}
            or type(c["n"]) is not int
            or type(c["k"]) is not int
        ):
            raise format_error(ctx, f"gaps class {c!r:.80}, expected {{n, k, counts}}")
        if not 0 <= c["n"] <= ctx.numel or not 0 <= c["k"] <= MAX_K:
            raise format_error(
                ctx, f"gaps class n={c['n']} k={c['k']}, expected 0 <= n <= {ctx.numel} and 0 <= k <= {MAX_K}"
            )
        ns.append(c["n"])
        ks.append(c["k"])
        cs.append(check_counts(ctx, c["counts"], "gap quotient"))
    if sum(ns) != ctx.n_changed:
        raise format_error(ctx, f"gap classes hold {sum(ns)} positions, expected n_changed={ctx.n_changed}")
    n_low = sum(n * k for n, k in zip(ns, ks))
    low_data = streams.get("gaps_low", b"")
    if len(low_data) != (n_low + 7) // 8:
        raise format_error(ctx, f"stream 'gaps_low' has {len(low_data)} bytes, expected {(n_low + 7) // 8}")
    low_padded = bytes(low_data) + b"\0" * 8  # gap_ranks reads 64-bit windows
    sym_all, sofs = ans_decode(ctx, "gaps", streams["gaps"], list(zip(cs, ns)))
    raw_esc = streams.get("gaps_escape", b"")
    if len(raw_esc) % 8:
        raise format_error(ctx, f"stream 'gaps_escape' has {len(raw_esc)} bytes, expected a multiple of 8")
    esc_data = np.frombuffer(raw_esc, dtype="<u8")
    ranks = np.empty(sum(ns), dtype=np.int64)  # class 0's ranks, then class 1's, ... (laid out as the symbols)
    off_e, off_l = 0, 0
    for c, (counts, n, k) in enumerate(zip(cs, ns, ks)):
        sym, r = sym_all[sofs[c] : sofs[c + 1]], ranks[sofs[c] : sofs[c + 1]]
        status, off_e = _native.gap_ranks(sym, len(counts) - 1, esc_data, off_e, k, low_padded, off_l, ctx.numel, r)
        if status:
            raise format_error(ctx, {
                1: f"stream 'gaps_escape' has {esc_data.size * 8} bytes, too few for the escape symbols of class {c}",
                2: f"stream 'gaps_escape' escapes a value below the alphabet size {len(counts) - 1} in class {c}",
                3: f"a gap quotient in class {c} exceeds the tensor's {ctx.numel} elements",
                4: f"gaps in class {c} run past the tensor's {ctx.numel} elements",
            }[status])
        off_l += n * k
    if off_e != esc_data.size:
        raise format_error(ctx, f"stream 'gaps_escape' has {esc_data.size * 8} bytes, expected {off_e * 8}")
    if not thresholds:
        return ranks
    base = ctx.base(None)
    at_idx = np.empty(ranks.size, dtype=base.dtype)
    idx, bad = class_select(base, thresholds, ranks, ns, out_bits=at_idx)
    if bad >= 0:
        members = int((class_of(base, thresholds) == bad).sum())
        raise format_error(
            ctx,
            f"rank {int(ranks[sofs[bad + 1] - 1])} in class {bad}, expected < {members} (the class's members in the "
            "base)",
        )
    ctx.base_at_positions = (idx, at_idx)
    return idx


def _gaps_layout(p: dict, c: Ctx) -> dict:
    classes = p["classes"]
    out = {"gaps": ("U8", None)}
    if any(cl["counts"][-1] for cl in classes):
        out["gaps_escape"] = ("U8", None)
    if any(cl["n"] * cl["k"] for cl in classes):
        out["gaps_low"] = ("U8", None)
    return out


def _bitmap_enc(idx: np.ndarray, ctx: Ctx) -> tuple[dict, dict[str, StreamOut]]:
    mask = np.zeros(ctx.numel, dtype=bool)
    mask[idx] = True
    z = zstd_compress(np.packbits(mask, bitorder="little"))
    return {}, {"bitmap": ("U8", (len(z),), z)}


def _bitmap_dec(params: dict, streams: dict[str, bytes], ctx: Ctx) -> np.ndarray:
    raw = zstd_decompress(ctx, "bitmap", streams["bitmap"], (ctx.numel + 7) // 8)
    return np.flatnonzero(np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=ctx.numel, bitorder="little"))


POSITIONS: dict[str, tuple[Callable, Callable, Callable[[dict, Ctx], dict]]] = {
    "raw_i32": (_raw_i32_enc, _raw_dec, lambda p, c: {"indices": ("I32", (c.n_changed,))}),
    "raw_i64": (_raw_i64_enc, _raw_dec, lambda p, c: {"indices": ("I64", (c.n_changed,))}),
    "gaps": (_gaps_enc, _gaps_dec, _gaps_layout),
    "bitmap": (_bitmap_enc, _bitmap_dec, lambda p, c: {"bitmap": ("U8", None)}),
    "dense": (_dense_enc, _dense_dec, lambda p, c: {}),
}


# ---------------------------------------------------------------------------- values
# encode(base_bits, target_bits, ctx) -> (params, streams); decode(params, streams, idx, ctx) -> bits (idx None:
# every element, for `dense` positions)


def _raw_val_enc(base: np.ndarray, target: np.ndarray, ctx: Ctx) -> tuple[dict, dict[str, StreamOut]]:
    return {}, {"values": (ctx.st_dtype, (target.size,), target.astype(ctx.np_bits.newbyteorder("<")).tobytes())}


def _raw_val_dec(params: dict, streams: dict[str, bytes], idx: np.ndarray | None, ctx: Ctx) -> np.ndarray:
    return np.frombuffer(streams["values"], dtype=ctx.np_bits.newbyteorder("<")).astype(ctx.np_bits)


def _delta_enc(
    base: np.ndarray, target: np.ndarray, ctx: Ctx, thresholds: list[int] | None = None, sizes: list[int] | None = None
) -> tuple[dict, dict[str, StreamOut]]:
    """Wrapped, zigzagged difference of the bit patterns, ANS coded per class of the base
    magnitude (escapes raw); classes in order, position order inside each class. `sizes`:
    `class_sizes` of `base` when the caller has them. Each class's alphabet size comes from
    every step-th value (about 2^14 of them: size only); its counts are exact."""
    thresholds = thresholds or []
    w, n_cls = ctx.np_bits.itemsize, len(thresholds) + 1
    base, target = np.ascontiguousarray(base), np.ascontiguousarray(target)
    if sizes is None:
        sizes = class_sizes(key_counts(base), thresholds) if thresholds else [base.size]
    hist = np.empty((n_cls, MAX_ALPHABET + 1), dtype=np.int64)
    t = bytes(thresholds)
    _native.delta_hist(base, target, w, t, hist, max(1, base.size >> 14))
    es = escape_costs(hist, 8 * w)[1].astype(np.int64)
    off = offsets(sizes)
    sym, esc = np.empty(base.size, dtype=np.int32), np.empty(base.size, dtype=ctx.np_bits.newbyteorder("<"))
    n_esc = _native.delta_symbols(base, target, w, t, es, off, sym, esc, hist)
    counts_all = [[int(c) for c in h[: e + 1]] for h, e in zip(hist, es)]
    escapes = b"".join(esc[off[c] : off[c] + n_esc[c]].tobytes() for c in range(n_cls))
    streams = {
        "delta": ans_encode(sym, [(counts_all[c], int(off[c + 1] - off[c])) for c in range(n_cls)]),
        "delta_escape": escapes,
    }
    return {"thresholds": thresholds, "counts": counts_all}, {
        k: ("U8", (len(b),), b) for k, b in streams.items() if b or k == "delta"
    }


def _delta_dec(params: dict, streams: dict[str, bytes], idx: np.ndarray | None, ctx: Ctx) -> np.ndarray:
    if set(params) != {"thresholds", "counts"}:
        raise format_error(ctx, f"delta parameters {sorted(params)}, expected ['counts', 'thresholds']")
    thresholds = _check_thresholds(ctx, params["thresholds"])
    counts_all = params["counts"]
    if not isinstance(counts_all, list) or len(counts_all) != len(thresholds) + 1:
        raise format_error(
            ctx,
            f"delta counts for {len(counts_all) if isinstance(counts_all, list) else '?'} classes, expected "
            f"{len(thresholds) + 1}",
        )
    counts_all = [check_counts(ctx, c, "delta") for c in counts_all]
    base = np.ascontiguousarray(
        ctx.base(None if idx is None or (idx.size == ctx.numel and idx.size and idx[-1] == ctx.numel - 1) else idx)
    )
    n_cls, w = len(thresholds) + 1, ctx.np_bits.itemsize
    cls = class_of(base, thresholds) if thresholds else np.zeros(0, dtype=np.uint8)
    sizes = key_counts(cls)[:n_cls].tolist() if thresholds else [base.size]
    sym, sofs = ans_decode(ctx, "delta", streams.get("delta", b""), list(zip(counts_all, sizes)))
    es = np.array([len(c) - 1 for c in counts_all], dtype=np.int64)
    esc_data = streams.get("delta_escape", b"")
    out = np.empty(base.size, dtype=base.dtype)
    status = _native.delta_values(base, w, cls, n_cls, sym, sofs, es, esc_data, out)
    if status == 100:
        n_esc = sum(int((sym[sofs[c] : sofs[c + 1]] == e).sum()) for c, e in enumerate(es))
        raise format_error(
            ctx, f"stream 'delta_escape' has {len(esc_data)} bytes, expected {n_esc * w} for {n_esc} escaped values"
        )
    if status >= 200:
        raise format_error(
            ctx,
            f"stream 'delta_escape' escapes a value below the alphabet size {int(es[status - 200])} in class "
            f"{status - 200}",
        )
    return out


def _delta_layout(p: dict, c: Ctx, n: int) -> dict:
    out = {"delta": ("U8", None)} if n else {}
    if any(cl[-1] for cl in p["counts"]):
        out["delta_escape"] = ("U8", None)
    return out


VALUES: dict[str, tuple[Callable, Callable, Callable[[dict, Ctx, int], dict]]] = {
    "raw": (_raw_val_enc, _raw_val_dec, lambda p, c, n: {"values": (c.st_dtype, (n,))}),
    "delta": (_delta_enc, _delta_dec, _delta_layout),
}
