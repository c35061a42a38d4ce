"""Position and value encodings of one tensor's changes (spec: docs/format.md, "Positions" and "Values").

Guarantee: for every encoding, `decode_*(encode_*(x)) == x` exactly, and every decoder either
returns arrays of exactly the size the header implies or raises PatchFormatError; compressed
streams are never inflated past that size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import constriction
import numpy as np
import zstandard

from sparsesync.codec._classes import RankSelect, class_bitmaps, class_of, key_of  # noqa: F401 - key_of re-exported
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
    base_bits: Callable[[np.ndarray | None], np.ndarray]  # base bits at indices (None: whole tensor)


# ---------------------------------------------------------------------------- helpers
def zstd_compress(data: bytes | np.ndarray, level: int = 3) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(bytes(memoryview(data)))


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
def _model(counts: list[int]) -> constriction.stream.model.Categorical:
    c = np.asarray(counts, dtype=np.float64)
    return constriction.stream.model.Categorical(c / c.sum(), perfect=False)


def _check_counts(ctx: Ctx, counts: object, what: str) -> list[int]:
    if (
        not isinstance(counts, list)
        or not 2 <= len(counts) <= MAX_ALPHABET + 1
        or not all(type(c) is int and 0 <= c < 1 << 40 for c in counts)
    ):
        raise _bad(ctx, f"{what} symbol counts {counts!r:.80}, expected 2..{MAX_ALPHABET + 1} non-negative integers")
    return counts


def _entropy_bits(c: np.ndarray) -> float:
    c = c[c > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum()) if c.size else 0.0


_ESC_CHOICES = np.array([1, 2, 4, 8, 16, 32, 64])


def _escape_cost(hist: np.ndarray, raw_bits: int) -> tuple[float, int]:
    """(estimated bits, alphabet size E) minimizing entropy + raw escapes + header, from a
    histogram of values clipped at MAX_ALPHABET."""
    n = float(hist.sum())
    c = hist.astype(np.float64)
    clogc = c * np.log2(np.maximum(c, 1.0))  # 0 where c == 0
    cum_clogc = np.concatenate([[0.0], np.cumsum(clogc)])
    tail = n - np.concatenate([[0.0], np.cumsum(c)])
    esc = np.maximum(tail[_ESC_CHOICES], 0.0)
    ent = n * np.log2(max(n, 1.0)) - cum_clogc[_ESC_CHOICES] - esc * np.log2(np.maximum(esc, 1.0)) if n > 0 else np.zeros(esc.size)
    bits = ent + esc * raw_bits + 24.0 * (_ESC_CHOICES + 1)
    zero = np.flatnonzero(esc == 0)  # larger alphabets than the first without escapes cannot help
    last = int(zero[0]) if zero.size else esc.size - 1
    i = int(np.argmin(bits[: last + 1]))
    return float(bits[i]), int(_ESC_CHOICES[i])


def symbols_with_escape(x: np.ndarray, raw_bits: int, e: int | None = None) -> tuple[np.ndarray, list[int], np.ndarray, float]:
    """Map non-negative ints to symbols 0..E (E = escape: the value goes raw to an escape stream),
    E chosen to minimize the coded size. Returns (symbols int32, counts of length E + 1,
    escaped values, estimated bits including ~3 header bytes per count)."""
    hist = np.bincount(np.minimum(x, MAX_ALPHABET).astype(np.intp), minlength=MAX_ALPHABET + 1)
    bits, best_e = _escape_cost(hist, raw_bits)
    e = best_e if e is None else e
    big = x >= e
    sym = np.minimum(x, e).astype(np.int32)
    counts = [int(c) for c in hist[:e]] + [int(hist[e:].sum())]
    return sym, counts, x[big], bits


def ans_encode(segments: list[tuple[np.ndarray, list[int]]]) -> bytes:
    """ANS-code segments of symbols, each with its own categorical model (decoded in order)."""
    coder = constriction.stream.stack.AnsCoder()
    for sym, counts in reversed(segments):
        if sym.size:
            coder.encode_reverse(sym, _model(counts))
    return coder.get_compressed().astype("<u4").tobytes()


class AnsReader:
    """Decodes segments in the order `ans_encode` got them; errors become PatchFormatError."""

    def __init__(self, ctx: Ctx, role: str, data: bytes) -> None:
        self.ctx, self.role = ctx, role
        if len(data) % 4:
            raise _bad(ctx, f"stream '{role}' has {len(data)} bytes, expected a multiple of 4")
        try:
            # an empty stream is the coder's initial state: certain symbols encode to nothing
            self.coder = constriction.stream.stack.AnsCoder(np.frombuffer(data, dtype="<u4").astype(np.uint32))
        except Exception as e:  # constriction rejects malformed data with ValueError
            raise _bad(ctx, f"stream '{role}' is not valid ANS data ({e})") from None

    def decode(self, counts: list[int], n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        if sum(counts) == 0:
            raise _bad(self.ctx, f"stream '{self.role}' has no model or data for {n} coded symbols")
        try:
            out = np.asarray(self.coder.decode(_model(counts), n), dtype=np.int32)
        except Exception as e:
            raise _bad(self.ctx, f"stream '{self.role}' does not decode ({e})") from None
        if out.size != n or (out.size and (out.min() < 0 or out.max() >= len(counts))):
            raise _bad(self.ctx, f"stream '{self.role}' decoded to symbols outside the model")
        return out

    def finish(self) -> None:
        if not self.coder.is_empty():
            raise _bad(self.ctx, f"stream '{self.role}' has data left after the last symbol")


def _escapes(ctx: Ctx, role: str, data: bytes, sym: np.ndarray, counts: list[int], width: int) -> np.ndarray:
    """Replace escape symbols (the last symbol of the model) by the raw values in `data`
    (little-endian, `width` bytes each)."""
    e = len(counts) - 1
    out = sym.astype(np.uint64)
    esc = sym == e
    n_esc = int(esc.sum())
    if len(data) != n_esc * width:
        raise _bad(ctx, f"stream '{role}' holds {len(data)} bytes, expected {n_esc * width} for {n_esc} escaped values")
    if n_esc:
        raw = np.frombuffer(data, dtype=np.dtype(f"<u{width}")).astype(np.uint64)
        if raw.min() < e:
            raise _bad(ctx, f"stream '{role}' escapes value {int(raw.min())}, expected >= {e}")
        out[esc] = raw
    return out


def n_escapes(sym: np.ndarray, counts: list[int]) -> int:
    return int((sym == len(counts) - 1).sum())


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


def _gaps_enc(idx: np.ndarray, ctx: Ctx, thresholds: list[int], base_at_idx: np.ndarray | None, base_full: np.ndarray | None) -> tuple[dict, dict[str, StreamOut]]:
    """Gap coding, optionally per class of the base magnitude: within each class, the ranks of
    the changed elements among the class members are gap coded; gap = q * 2^k + low, q entropy
    coded (ANS, escapes raw), low as k raw bits."""
    if thresholds:
        if base_at_idx is None or base_full is None:
            raise ValueError("class-conditioned gaps need the base")
        cls = class_of(base_at_idx, thresholds)
        bitmaps = class_bitmaps(base_full, thresholds)
        ranks = [RankSelect(bitmaps[c]).rank(idx[cls == c]) for c in range(len(thresholds) + 1)]
    else:
        ranks = [idx]
    classes, segments, escapes, lows = [], [], [], []
    for r in ranks:
        g = np.diff(r, prepend=-1) - 1
        k, sym, counts, esc = _best_k(g)
        classes.append({"n": int(r.size), "k": k, "counts": counts})
        segments.append((sym, counts))
        escapes.append(esc.astype("<u8"))
        if k and r.size:
            lows.append(_low_bits(g, k))
    low_bits = np.concatenate(lows) if lows else np.zeros(0, dtype=np.uint8)
    streams = {"gaps": ans_encode(segments), "gaps_escape": b"".join(e.tobytes() for e in escapes), "gaps_low": np.packbits(low_bits, bitorder="little").tobytes()}
    # the ANS stream is always present (empty when the symbols are certain); the others only when non-empty
    return {"thresholds": thresholds, "classes": classes}, {k: ("U8", (len(b),), b) for k, b in streams.items() if b or k == "gaps"}


def _width(k: int) -> int:
    """Bytes of the smallest unsigned integer holding k bits (1, 2, 4 or 8)."""
    return 1 if k <= 8 else 2 if k <= 16 else 4 if k <= 32 else 8


def _low_bits(g: np.ndarray, k: int) -> np.ndarray:
    """The low k bits of each gap, least significant first, one bit per uint8 (flattened)."""
    w = _width(k)
    by = (g & ((1 << k) - 1)).astype(f"<u{w}").view(np.uint8).reshape(g.size, w)
    return np.unpackbits(by, axis=1, bitorder="little")[:, :k].ravel()


def _from_low_bits(packed: bytes, off: int, n: int, k: int) -> np.ndarray:
    """Inverse of `_low_bits`: n integers (int64) of k bits each, starting at bit `off` of the
    little-endian bit stream `packed`. Reads a 64-bit window at each value's first byte."""
    buf = np.frombuffer(bytes(packed) + b"\0" * 8, dtype=np.uint8)
    windows = np.ndarray((buf.size - 7,), dtype="<u8", buffer=buf.data, strides=(1,))  # unaligned u64 at every byte
    bit = off + np.arange(n, dtype=np.int64) * k
    v = windows[bit >> 3] >> (bit & 7).astype(np.uint64)
    return (v & np.uint64((1 << k) - 1)).astype(np.int64)


def _best_k(g: np.ndarray) -> tuple[int, np.ndarray, list[int], np.ndarray]:
    """Remainder bits k (near log2 of the mean gap) minimizing the coded size; returns
    (k, quotient symbols, counts, escaped quotients). The candidates' histograms all come from
    one fine histogram (bins merge by shifting), so the search is a single pass."""
    if g.size == 0:
        return 0, np.zeros(0, dtype=np.int32), [1, 0], g
    base = int(np.floor(np.log2(float(g.mean()) + 1.0)))
    sampled = g.size >> 16 > 1
    gs = g[:: max(1, g.size >> 16)]  # k is chosen on a sample (size only, never correctness)
    k0, k1 = max(0, base - 3), min(_MAX_K, base)
    span = k1 - k0
    top = MAX_ALPHABET << span
    fine = np.bincount(np.minimum(gs >> k0, top), minlength=top + 1)
    best = None
    for k in range(k0, k1 + 1):
        j = k - k0
        hist = fine if j == 0 else np.bincount(np.minimum(np.arange(top + 1) >> j, MAX_ALPHABET), weights=fine, minlength=MAX_ALPHABET + 1)
        if j == 0 and span:
            hist = np.bincount(np.minimum(np.arange(top + 1), MAX_ALPHABET), weights=fine, minlength=MAX_ALPHABET + 1)
        hist = hist.astype(np.int64)
        bits, e = _escape_cost(hist, 64)
        bits += k * gs.size
        if best is None or bits < best[0]:
            best = (bits, k, e, hist)
    _, k, e, hist = best
    q = g >> k
    if sampled:
        return (k, *symbols_with_escape(q, 64)[:3])
    sym = np.minimum(q, e).astype(np.int32)
    counts = [int(c) for c in hist[:e]] + [int(hist[e:].sum())]
    esc = q[q >= e] if counts[-1] else q[:0]
    return k, sym, counts, esc


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
    reader = AnsReader(ctx, "gaps", streams["gaps"])
    syms = [reader.decode(c, n) for c, n in zip(cs, ns)]
    reader.finish()
    n_esc = [n_escapes(s, c) for s, c in zip(syms, cs)]
    esc_data = streams.get("gaps_escape", b"")
    if len(esc_data) != 8 * sum(n_esc):
        raise _bad(ctx, f"stream 'gaps_escape' has {len(esc_data)} bytes, expected {8 * sum(n_esc)}")
    bitmaps = class_bitmaps(ctx.base_bits(None), thresholds) if thresholds else None
    out, off_e, off_l = [], 0, 0
    for c, (sym, counts, n, k, ne) in enumerate(zip(syms, cs, ns, ks, n_esc)):
        q = _escapes(ctx, "gaps_escape", esc_data[off_e : off_e + 8 * ne], sym, counts, 8)
        off_e += 8 * ne
        if q.size and int(q.max()) >= (ctx.numel >> k) + 1:
            raise _bad(ctx, f"gap quotient {int(q.max())} in class {c} exceeds the tensor's {ctx.numel} elements")
        g = q.astype(np.int64) << k
        if k:
            g += _from_low_bits(low_data, off_l, n, k)
            off_l += n * k
        if g.size and float(g.astype(np.float64).sum()) + g.size >= ctx.numel + 1:
            raise _bad(ctx, f"gaps in class {c} run past the tensor's {ctx.numel} elements")
        r = np.cumsum(g + 1) - 1
        if bitmaps is not None:
            rs = RankSelect(bitmaps[c])
            if r.size and r[-1] >= rs.total:
                raise _bad(ctx, f"rank {int(r[-1])} in class {c}, expected < {rs.total} (the class's members in the base)")
            r = rs.select(r)
        out.append(r)
    idx = np.concatenate(out) if len(out) > 1 else out[0]
    return np.sort(idx, kind="stable") if len(out) > 1 else idx  # stable = timsort: merges the sorted runs


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


def zigzag_delta(base: np.ndarray, target: np.ndarray) -> np.ndarray:
    """zigzag((target - base) mod 2^w as a signed w-bit int), as unsigned w-bit ints."""
    ut = base.dtype
    d = (target - base).view(np.dtype(f"i{ut.itemsize}"))  # wraps mod 2^w
    bits = 8 * ut.itemsize
    return ((d << 1) ^ (d >> (bits - 1))).view(ut)


def unzigzag_add(base: np.ndarray, zz: np.ndarray) -> np.ndarray:
    ut = base.dtype
    zz = zz.astype(ut)
    d = (zz >> ut.type(1)) ^ (np.zeros_like(zz) - (zz & ut.type(1)))
    return base + d  # wraps mod 2^w


def _delta_enc(base: np.ndarray, target: np.ndarray, ctx: Ctx, thresholds: list[int] | None = None) -> tuple[dict, dict[str, StreamOut]]:
    """Wrapped, zigzagged difference of the bit patterns, ANS coded per class of the base
    magnitude (escapes raw)."""
    thresholds = thresholds or []
    zz = zigzag_delta(base, target)
    parts = [zz]
    if thresholds:  # one stable sort groups the elements by class, keeping position order inside
        cls = class_of(base, thresholds)
        bounds = np.cumsum(np.bincount(cls, minlength=len(thresholds) + 1))[:-1]
        parts = np.split(zz[np.argsort(cls, kind="stable")], bounds)
    segs, counts_all, escs = [], [], []
    for part in parts:
        sym, counts, esc, _ = symbols_with_escape(part.astype(np.uint64), 8 * ctx.np_bits.itemsize)
        segs.append((sym, counts))
        counts_all.append(counts)
        escs.append(esc.astype(np.dtype(f"<u{ctx.np_bits.itemsize}")))
    streams = {"delta": ans_encode(segs), "delta_escape": b"".join(e.tobytes() for e in escs)}
    return {"thresholds": thresholds, "counts": counts_all}, {k: ("U8", (len(b),), b) for k, b in streams.items() if b or k == "delta"}


def _delta_dec(params: dict, streams: dict[str, bytes], idx: np.ndarray, ctx: Ctx) -> np.ndarray:
    if set(params) != {"thresholds", "counts"}:
        raise _bad(ctx, f"delta parameters {sorted(params)}, expected ['counts', 'thresholds']")
    thresholds = _check_thresholds(ctx, params["thresholds"])
    counts_all = params["counts"]
    if not isinstance(counts_all, list) or len(counts_all) != len(thresholds) + 1:
        raise _bad(ctx, f"delta counts for {len(counts_all) if isinstance(counts_all, list) else '?'} classes, expected {len(thresholds) + 1}")
    counts_all = [_check_counts(ctx, c, "delta") for c in counts_all]
    base = ctx.base_bits(None if idx.size == ctx.numel and idx.size and idx[-1] == ctx.numel - 1 else idx)
    order, sizes = None, [base.size]
    if thresholds:  # class segments come class by class, in position order inside each class
        cls = class_of(base, thresholds)
        sizes = np.bincount(cls, minlength=len(thresholds) + 1).tolist()
        order = np.argsort(cls, kind="stable")
    reader = AnsReader(ctx, "delta", streams.get("delta", b""))
    esc_data, off, w = streams.get("delta_escape", b""), 0, ctx.np_bits.itemsize
    parts = []
    for counts, n in zip(counts_all, sizes):
        sym = reader.decode(counts, n)
        ne = n_escapes(sym, counts)
        parts.append(_escapes(ctx, "delta_escape", esc_data[off : off + ne * w], sym, counts, w))
        off += ne * w
    reader.finish()
    if off != len(esc_data):
        raise _bad(ctx, f"stream 'delta_escape' has {len(esc_data)} bytes, expected {off}")
    grouped = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if order is None:
        out = grouped
    else:
        out = np.empty(base.size, dtype=np.uint64)
        out[order] = grouped
    if out.size and int(out.max()) >> (8 * w):
        raise _bad(ctx, f"delta value {int(out.max())} does not fit {8 * w} bits")
    return unzigzag_add(base, out)


def _delta_layout(p: dict, c: Ctx, n: int) -> dict:
    out = {"delta": ("U8", None)} if n else {}
    if any(cl[-1] for cl in p["counts"]):
        out["delta_escape"] = ("U8", None)
    return out


VALUES: dict[str, tuple[Callable, Callable, Callable[[dict, Ctx, int], dict]]] = {
    "raw": (_raw_val_enc, _raw_val_dec, lambda p, c, n: {"values": (c.st_dtype, (n,))}),
    "delta": (_delta_enc, _delta_dec, _delta_layout),
}
