"""Position and value encodings of one tensor's changes (spec: docs/format.md, "Positions" and "Values").

Guarantee: for every encoding, `decode_*(encode_*(x)) == x` exactly, and every decoder either
returns arrays of exactly the size the header implies or raises PatchFormatError; compressed
streams are never inflated past that size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from sparsesync.codec import _native
from sparsesync.codec._classes import class_of, class_ranks, class_select, class_sizes, key_counts, key_of, offsets  # noqa: F401 - key_of re-exported
from sparsesync.errors import PatchFormatError

_MAX_WINDOW = 1 << 27  # zstd window a hostile frame may ask for (our frames use far less)
MAX_CLASSES = 8  # classes of the base magnitude a patch may condition on
MAX_ALPHABET = 64  # direct symbols of an entropy-coded stream; larger values escape to a raw stream
_MAX_K = 48  # Rice-style remainder bits

StreamOut = tuple[str, tuple[int, ...], bytes]  # (safetensors dtype, shape, bytes)


@dataclass
class Ctx:
    """What encoders/decoders of one tensor may use."""

    name: str  # tensor name, for messages
    st_dtype: str  # the tensor's safetensors dtype name
    np_bits: np.dtype  # unsigned dtype of one element's bits
    numel: int
    n_changed: int
    base_bits: Callable[[np.ndarray | None], np.ndarray] | None  # base bits at indices (None: whole tensor); None: no base (encoding)
    format_version: int = 2  # of the patch being read: picks the entropy decoder
    # (positions, the base bits there) when the positions decoder read them on its way (class-
    # conditioned gaps): `base_bits` of that same array returns them without a second gather
    base_at_positions: tuple[np.ndarray, np.ndarray] | None = None

    def base(self, idx: np.ndarray | None) -> np.ndarray:
        """The base bits at `idx` (None: the whole tensor); only a decoder reading against a base asks."""
        if self.base_bits is None:
            raise _bad(self, "its coding is conditioned on the base, and no base was given")
        return self.base_bits(idx)


# ---------------------------------------------------------------------------- helpers
def zstd_compress(data: bytes | np.ndarray, level: int = 3) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data if isinstance(data, bytes) else data.tobytes())


def zstd_decompress(ctx: Ctx, role: str, data: bytes, expected: int) -> bytes:
    """Inflate one zstd frame of exactly `expected` bytes; anything else is PatchFormatError."""
    where = f"tensor '{ctx.name}': stream '{role}'"
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise PatchFormatError(f"{where}: not a zstd frame ({e})", hint="the patch is corrupt; fetch it again") from None
    if params.content_size != expected:
        raise PatchFormatError(f"{where}: declares {params.content_size} decompressed bytes, expected {expected}", hint="the patch is corrupt; fetch it again")
    try:
        out = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW).decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise PatchFormatError(f"{where}: zstd frame does not decode ({e})", hint="the patch is corrupt; fetch it again") from None
    if len(out) != expected:
        raise PatchFormatError(f"{where}: decompressed to {len(out)} bytes, expected {expected}", hint="the patch is corrupt; fetch it again")
    return out


def _bad(ctx: Ctx, msg: str) -> PatchFormatError:
    return PatchFormatError(f"tensor '{ctx.name}': {msg}", hint="the patch is corrupt or was written by a buggy encoder; fetch it again")


def check_indices(ctx: Ctx, idx: np.ndarray) -> np.ndarray:
    """Require `n_changed` strictly increasing indices in [0, numel)."""
    if idx.size != ctx.n_changed:
        raise _bad(ctx, f"{idx.size} positions decoded, expected n_changed={ctx.n_changed}")
    if idx.size:
        if idx[0] < 0 or idx[-1] >= ctx.numel:
            bad = int(idx[0]) if idx[0] < 0 else int(idx[-1])
            raise _bad(ctx, f"index {bad} out of range, expected 0 <= index < {ctx.numel}")
        d = np.diff(idx)
        if d.size and d.min() <= 0:
            k = int(np.argmax(d <= 0))
            raise _bad(ctx, f"indices not strictly increasing: {int(idx[k])} then {int(idx[k + 1])} at position {k + 1}")
    return idx


# ---------------------------------------------------------------------------- entropy coding
# Format 2: rANS in C (`_native.rans_encode` / `rans_decode`, GIL released, 4 interleaved
# states); format 1 (read only): constriction's AnsCoder. Spec: docs/format.md, "Entropy coding".
_RANS_STATUS = {
    1: "has {n} bytes, expected 0, or 32 plus a multiple of 4",
    2: "starts with an invalid coder state",
    3: "ends before its last symbol",
    4: "has data left after the last symbol",
    5: "has no model (all counts 0) for symbols it codes",
}


def _check_counts(ctx: Ctx, counts: object, what: str) -> list[int]:
    if (
        not isinstance(counts, list)
        or not 2 <= len(counts) <= MAX_ALPHABET + 1
        or not all(type(c) is int and 0 <= c < 1 << 40 for c in counts)
    ):
        raise _bad(ctx, f"{what} symbol counts {counts!r:.80}, expected 2..{MAX_ALPHABET + 1} non-negative integers")
    return counts


def _escape_costs(hists: np.ndarray, raw_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `hists` (histograms of values clipped at MAX_ALPHABET, shape (rows, 65)):
    (estimated bits, alphabet size E in {1, 2, 4, ..., 64}) minimizing entropy + raw escapes +
    header (one C pass, `_native.escape_costs`)."""
    hists = np.ascontiguousarray(hists, dtype=np.int64)
    bits, es = np.empty(hists.shape[0]), np.empty(hists.shape[0], dtype=np.int64)
    _native.escape_costs(hists, float(raw_bits), bits, es)
    return bits, es


def _models(models: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts of every segment concatenated, their offsets, the segments' symbol offsets)."""
    counts = np.array([c for cs, _ in models for c in cs], dtype=np.int64)
    return counts, offsets([len(cs) for cs, _ in models]), offsets([n for _, n in models])


def ans_encode(sym: np.ndarray, models: list[tuple[list[int], int]]) -> bytes:
    """Entropy-code the int32 symbols `sym`: consecutive segments of n symbols, each with its
    own model `counts` (its exact symbol counts), per (counts, n) of `models`; `ans_decode`
    returns the segments in this order."""
    counts, cofs, sofs = _models(models)
    return _native.rans_encode(np.ascontiguousarray(sym, dtype=np.int32), sofs, counts, cofs)


def ans_decode(ctx: Ctx, role: str, data: bytes, models: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray]:
    """The symbols of stream `role`, as `ans_encode` took them: (every segment's int32 symbols
    end to end, segment offsets), one segment per (counts, n) of `models`, in order.
    Anything that does not decode exactly (and to the end) is PatchFormatError."""
    counts, cofs, sofs = _models(models)
    if ctx.format_version == 1:
        return _ans_decode_v1(ctx, role, data, models), sofs
    out = np.empty(int(sofs[-1]), dtype=np.int32)
    status = _native.rans_decode(data, counts, cofs, sofs, out)
    if status:
        raise _bad(ctx, f"stream '{role}' " + _RANS_STATUS[status].format(n=len(data)))
    return out, sofs


def _ans_decode_v1(ctx: Ctx, role: str, data: bytes, models: list[tuple[list[int], int]]) -> np.ndarray:
    """Format 1: constriction's AnsCoder (32-bit words) with its leaky 24-bit Categorical models."""
    import constriction

    if len(data) % 4:
        raise _bad(ctx, f"stream '{role}' has {len(data)} bytes, expected a multiple of 4")
    try:
        # an empty stream is the coder's initial state: certain symbols encode to nothing
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(data, dtype="<u4").astype(np.uint32))
    except Exception as e:  # constriction rejects malformed data with ValueError
        raise _bad(ctx, f"stream '{role}' is not valid ANS data ({e})") from None
    out = []
    for counts, n in models:
        if n == 0:
            out.append(np.zeros(0, dtype=np.int32))
            continue
        if sum(counts) == 0:
            raise _bad(ctx, f"stream '{role}' has no model or data for {n} coded symbols")
        c = np.asarray(counts, dtype=np.float64)
        try:
            sym = np.asarray(coder.decode(constriction.stream.model.Categorical(c / c.sum(), perfect=False), n), dtype=np.int32)
        except Exception as e:
            raise _bad(ctx, f"stream '{role}' does not decode ({e})") from None
        if sym.size != n or (sym.size and (sym.min() < 0 or sym.max() >= len(counts))):
            raise _bad(ctx, f"stream '{role}' decoded to symbols outside the model")
        out.append(sym)
    if not coder.is_empty():
        raise _bad(ctx, f"stream '{role}' has data left after the last symbol")
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


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
    if not isinstance(t, list) or len(t) >= MAX_CLASSES or not all(type(x) is int and 1 <= x <= 127 for x in t) or any(a >= b for a, b in zip(t, t[1:])):
        raise _bad(ctx, f"class thresholds {t!r:.80}, expected fewer than {MAX_CLASSES} increasing integers in [1, 127]")
    return t


def _gaps_enc(
    idx: np.ndarray, ctx: Ctx, thresholds: list[int], base_at_idx: np.ndarray | None, base_full: np.ndarray | None, sizes: list[int] | None = None
) -> tuple[dict, dict[str, StreamOut]]:
    """Gap coding, optionally per class of the base magnitude: within each class, the ranks of
    the changed elements among the class members are gap coded; gap = q * 2^k + low, q entropy
    coded (ANS, escapes raw), low as k raw bits. `sizes`: `class_sizes` of the base at `idx`
    when the caller has them."""
    if thresholds:
        if base_at_idx is None or base_full is None:
            raise ValueError("class-conditioned gaps need the base")
        ranks = class_ranks(base_full, thresholds, idx, class_sizes(key_counts(base_at_idx), thresholds) if sizes is None else sizes)
    else:
        ranks = [idx]
    ranks = [np.ascontiguousarray(r, dtype=np.int64) for r in ranks]
    params = _gap_params(ranks)
    classes, models, escapes = [], [], []
    low = np.zeros((sum(r.size * k for r, (k, _) in zip(ranks, params)) + 7) // 8 + 8, dtype=np.uint8)  # + 8: room for 64-bit writes
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
    streams = {"gaps": ans_encode(sym_all, models), "gaps_escape": b"".join(e.astype("<u8").tobytes() for e in escapes), "gaps_low": low[: (off + 7) // 8].tobytes()}
    # the ANS stream is always present (empty when the symbols are certain); the others only when non-empty
    return {"thresholds": thresholds, "classes": classes}, {k: ("U8", (len(b),), b) for k, b in streams.items() if b or k == "gaps"}


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
        k0, k1 = max(0, base - 3), min(_MAX_K, base)
        hists = np.empty((k1 - k0 + 1, MAX_ALPHABET + 1), dtype=np.int64)  # row j: the quotients' histogram for k = k0 + j
        _native.gap_khist(r, step, k0, hists)
        plans.append((k0, n_sample, sum(len(h) for h in rows), len(hists)))
        rows.append(hists)
    bits, es = _escape_costs(np.concatenate(rows), 64) if rows else (None, None)
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
        raise _bad(ctx, f"gaps parameters {params!r:.120}, expected thresholds and {len(thresholds) + 1} classes")
    ns, ks, cs = [], [], []
    for c in classes:
        if not isinstance(c, dict) or set(c) != {"n", "k", "counts"} or type(c["n"]) is not int or type(c["k"]) is not int:
            raise _bad(ctx, f"gaps class {c!r:.80}, expected {{n, k, counts}}")
        if not 0 <= c["n"] <= ctx.numel or not 0 <= c["k"] <= _MAX_K:
            raise _bad(ctx, f"gaps class n={c['n']} k={c['k']}, expected 0 <= n <= {ctx.numel} and 0 <= k <= {_MAX_K}")
        ns.append(c["n"])
        ks.append(c["k"])
        cs.append(_check_counts(ctx, c["counts"], "gap quotient"))
    if sum(ns) != ctx.n_changed:
        raise _bad(ctx, f"gap classes hold {sum(ns)} positions, expected n_changed={ctx.n_changed}")
    n_low = sum(n * k for n, k in zip(ns, ks))
    low_data = streams.get("gaps_low", b"")
    if len(low_data) != (n_low + 7) // 8:
        raise _bad(ctx, f"stream 'gaps_low' has {len(low_data)} bytes, expected {(n_low + 7) // 8}")
    low_padded = bytes(low_data) + b"\0" * 8  # gap_ranks reads 64-bit windows
    sym_all, sofs = ans_decode(ctx, "gaps", streams["gaps"], list(zip(cs, ns)))
    raw_esc = streams.get("gaps_escape", b"")
    if len(raw_esc) % 8:
        raise _bad(ctx, f"stream 'gaps_escape' has {len(raw_esc)} bytes, expected a multiple of 8")
    esc_data = np.frombuffer(raw_esc, dtype="<u8")
    ranks = np.empty(sum(ns), dtype=np.int64)  # class 0's ranks, then class 1's, ... (laid out as the symbols)
    off_e, off_l = 0, 0
    for c, (counts, n, k) in enumerate(zip(cs, ns, ks)):
        sym, r = sym_all[sofs[c] : sofs[c + 1]], ranks[sofs[c] : sofs[c + 1]]
        status, off_e = _native.gap_ranks(sym, len(counts) - 1, esc_data, off_e, k, low_padded, off_l, ctx.numel, r)
        if status:
            raise _bad(ctx, {
                1: f"stream 'gaps_escape' has {esc_data.size * 8} bytes, too few for the escape symbols of class {c}",
                2: f"stream 'gaps_escape' escapes a value below the alphabet size {len(counts) - 1} in class {c}",
                3: f"a gap quotient in class {c} exceeds the tensor's {ctx.numel} elements",
                4: f"gaps in class {c} run past the tensor's {ctx.numel} elements",
            }[status])
        off_l += n * k
    if off_e != esc_data.size:
        raise _bad(ctx, f"stream 'gaps_escape' has {esc_data.size * 8} bytes, expected {off_e * 8}")
    if not thresholds:
        return ranks
    base = ctx.base(None)
    at_idx = np.empty(ranks.size, dtype=base.dtype)
    idx, bad = class_select(base, thresholds, ranks, ns, out_bits=at_idx)
    if bad >= 0:
        members = int((class_of(base, thresholds) == bad).sum())
        raise _bad(ctx, f"rank {int(ranks[sofs[bad + 1] - 1])} in class {bad}, expected < {members} (the class's members in the base)")
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
# encode(base_bits, target_bits, ctx) -> (params, streams); decode(params, streams, idx, ctx) -> bits


def _raw_val_enc(base: np.ndarray, target: np.ndarray, ctx: Ctx) -> tuple[dict, dict[str, StreamOut]]:
    return {}, {"values": (ctx.st_dtype, (target.size,), target.astype(ctx.np_bits.newbyteorder("<")).tobytes())}


def _raw_val_dec(params: dict, streams: dict[str, bytes], idx: np.ndarray, ctx: Ctx) -> np.ndarray:
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
    es = _escape_costs(hist, 8 * w)[1].astype(np.int64)
    off = offsets(sizes)
    sym, esc = np.empty(base.size, dtype=np.int32), np.empty(base.size, dtype=ctx.np_bits.newbyteorder("<"))
    n_esc = _native.delta_symbols(base, target, w, t, es, off, sym, esc, hist)
    counts_all = [[int(c) for c in h[: e + 1]] for h, e in zip(hist, es)]
    escapes = b"".join(esc[off[c] : off[c] + n_esc[c]].tobytes() for c in range(n_cls))
    streams = {"delta": ans_encode(sym, [(counts_all[c], int(off[c + 1] - off[c])) for c in range(n_cls)]), "delta_escape": escapes}
    return {"thresholds": thresholds, "counts": counts_all}, {k: ("U8", (len(b),), b) for k, b in streams.items() if b or k == "delta"}


def _delta_dec(params: dict, streams: dict[str, bytes], idx: np.ndarray, ctx: Ctx) -> np.ndarray:
    if set(params) != {"thresholds", "counts"}:
        raise _bad(ctx, f"delta parameters {sorted(params)}, expected ['counts', 'thresholds']")
    thresholds = _check_thresholds(ctx, params["thresholds"])
    counts_all = params["counts"]
    if not isinstance(counts_all, list) or len(counts_all) != len(thresholds) + 1:
        raise _bad(ctx, f"delta counts for {len(counts_all) if isinstance(counts_all, list) else '?'} classes, expected {len(thresholds) + 1}")
    counts_all = [_check_counts(ctx, c, "delta") for c in counts_all]
    base = np.ascontiguousarray(ctx.base(None if idx.size == ctx.numel and idx.size and idx[-1] == ctx.numel - 1 else idx))
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
        raise _bad(ctx, f"stream 'delta_escape' has {len(esc_data)} bytes, expected {n_esc * w} for {n_esc} escaped values")
    if status >= 200:
        raise _bad(ctx, f"stream 'delta_escape' escapes a value below the alphabet size {int(es[status - 200])} in class {status - 200}")
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
