"""Format 3's per-tensor table: a compact binary record of every tensor a patch touches, zstd
compressed (spec: docs/format.md, "The table").

Guarantee: `parse_table` either returns one `Row` per record, with every field in range and the
stream sizes summing exactly to the data section, or raises PatchFormatError naming the field;
it never allocates more than the declared (and capped) inflated size of the table plus one small
object per record. `build_table` is deterministic and `parse_table(build_table(rows)) == rows`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zstandard

from sparsesync.codec import _native
from sparsesync.errors import PatchFormatError

PROB_M = 1 << 14  # rANS probability scale (docs/format.md, "Entropy coding")
MAX_TABLE_BYTES = 64 << 20  # inflated table size a reader accepts
MAX_NAME_BYTES = 1 << 16
_MIN_RECORD = 21  # bytes every record takes at least (name 2, dtype 1, ndim 1, encodings 1, digests 16)
_MAX_K = 48
_MAX_ALPHABET = 64
_MAX_CLASSES = 8

# codes of the table (normative: docs/format.md)
DTYPE_CODES = ["U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"]
POS_CODES = ["raw_i32", "raw_i64", "bitmap", "dense", "gaps"]
VAL_CODES = ["raw", "delta"]
# sizes the table states (others follow from the fields)
EXPLICIT_ROLES = ("bitmap", "gaps", "gaps_escape", "delta", "delta_escape")
# order in the data section
ROLE_ORDER = ("indices", "bitmap", "gaps", "gaps_escape", "gaps_low", "values", "delta", "delta_escape")


@dataclass
class Row:
    """One tensor's record, as the format-2 entry fields it stands for."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    n_changed: int
    positions: str
    position_params: dict
    values: str
    value_params: dict
    base_digest: str  # 16 lowercase hex digits
    target_digest: str
    sizes: dict[str, int] = field(default_factory=dict)  # explicit role -> bytes (EXPLICIT_ROLES present)


def quantize(counts: list[int]) -> list[int]:
    """The rANS frequencies of `counts` (sum PROB_M, or all 0 for an all-zero model), exactly as
    the C coder quantizes them; quantizing the result again returns it unchanged."""
    total = sum(counts)
    if total == 0:
        return [0] * len(counts)
    f = [0 if c == 0 else max(1, c * PROB_M // total) for c in counts]
    f[f.index(max(f))] += PROB_M - sum(f)
    return f


# ---------------------------------------------------------------------------- writing
def _varint(out: bytearray, v: int) -> None:
    if v < 0x80:  # most fields
        out.append(v)
        return
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def _put_thresholds(out: bytearray, t: list[int]) -> None:
    """Their count, then the thresholds as bytes (read back by `_thresholds`)."""
    out.append(len(t))
    out += bytes(t)


def _model(out: bytearray, f: list[int]) -> None:
    """E = len(f) - 1, then f[0 .. E-1] (f[E] = PROB_M - their sum); E = 0 for an all-zero model."""
    if not any(f):
        out.append(0)
        return
    out.append(len(f) - 1)
    _native.varints_put(out, f, len(f) - 1)


def build_table(rows: list[Row]) -> bytes:
    """The zstd-compressed table of `rows` (sorted by name, models already quantized)."""
    return compress(table_bytes(rows))


def compress(raw: bytes) -> bytes:
    """One zstd frame with its content size (what `inflate` reads)."""
    return zstandard.ZstdCompressor(level=12, write_content_size=True).compress(raw)


# writes the records field by field in their format's order (docs/format.md): one loop per column
def table_bytes(rows: list[Row]) -> bytes:  # noqa: C901
    """The records of `rows`, not compressed (the group section of formats 4 and 5 embeds them)."""
    out = bytearray()
    _varint(out, len(rows))
    prev = b""
    for r in rows:
        nb = r.name.encode("utf-8")
        shared = 0
        while shared < min(len(nb), len(prev)) and nb[shared] == prev[shared]:
            shared += 1
        _varint(out, shared)
        _varint(out, len(nb) - shared)
        out += nb[shared:]
        prev = nb
    out += bytes(DTYPE_CODES.index(r.dtype) for r in rows)
    for r in rows:
        out.append(len(r.shape))
        for d in r.shape:
            _varint(out, d)
    out += bytes(POS_CODES.index(r.positions) | VAL_CODES.index(r.values) << 4 for r in rows)
    for r in rows:
        if r.positions != "gaps":
            _varint(out, r.n_changed)
    for r in rows:
        if r.positions == "gaps":
            p = r.position_params
            _put_thresholds(out, p["thresholds"])
            for c in p["classes"]:
                _varint(out, c["n"])
                if c["n"]:
                    out.append(c["k"])
                    _model(out, c["counts"])
    for r in rows:
        if r.values == "delta":
            p = r.value_params
            _put_thresholds(out, p["thresholds"])
            for f in p["counts"]:
                _model(out, f)
    for r in rows:
        for role in EXPLICIT_ROLES:
            if role in r.sizes:
                _varint(out, r.sizes[role] // _unit(role, r.dtype))
    for r in rows:
        out += bytes.fromhex(r.base_digest)[::-1]
    for r in rows:
        out += bytes.fromhex(r.target_digest)[::-1]
    return bytes(out)


def _unit(role: str, dtype: str) -> int:
    """Bytes per unit of an explicit size: escapes are counted in values, the rest in bytes."""
    if role == "gaps_escape":
        return 8
    if role == "delta_escape":
        return _WIDTH[dtype]
    return 1


_WIDTH = {
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


# ---------------------------------------------------------------------------- reading
def _bad(msg: str) -> PatchFormatError:
    return PatchFormatError(
        f"patch table: {msg}", hint="the file is corrupt or not a sparsesync patch of format 3; fetch it again"
    )


class Reader:
    def __init__(self, data: bytes, what: str = "patch table", fmt: int = 3) -> None:
        self.data, self.pos, self.what, self.fmt = data, 0, what, fmt

    def bad(self, msg: str) -> PatchFormatError:
        return PatchFormatError(
            f"{self.what}: {msg}",
            hint=f"the file is corrupt or not a sparsesync patch of format {self.fmt}; fetch it again",
        )

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            raise self.bad(f"ends inside {what} (at byte {self.pos})")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self, what: str, hi: int = (1 << 63) - 1) -> int:
        return self.varints(what, 1, hi)[0]

    def varints(self, what: str, count: int, hi: int = (1 << 63) - 1) -> list[int]:
        """`count` varints (LEB128, at most 9 bytes, no overlong forms), each at most `hi`."""
        values, pos, v, status = _native.varints(self.data, self.pos, count, hi)
        if status == 1:
            raise self.bad(f"ends inside {what} (at byte {pos})")
        if status == 2:
            raise self.bad(f"{what} is {v} (overlong varint), expected at most {hi}")
        if status == 3:
            raise self.bad(f"{what} is over {hi}, expected at most {hi}")
        if status == 4:
            raise self.bad(f"{what}: varint longer than 9 bytes")
        self.pos = pos
        assert values is not None  # status 0
        return values

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise self.bad(
                f"ends inside {what} ({n} bytes needed at byte {self.pos}, {len(self.data) - self.pos} left)"
            )
        self.pos += n
        return self.data[self.pos - n : self.pos]


def inflate(data: bytes, what: str = "patch table", fmt: int = 3) -> bytes:
    """The table's single zstd frame, inflated; its declared size must be known and at most MAX_TABLE_BYTES
    (`what`, `fmt`: named in errors)."""
    _bad = Reader(b"", what, fmt).bad
    try:
        size = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        raise _bad(f"not a zstd frame ({e})") from None
    if size == zstandard.CONTENTSIZE_UNKNOWN or size > MAX_TABLE_BYTES:
        raise _bad(
            f"declares {size if size != zstandard.CONTENTSIZE_UNKNOWN else 'an unknown number of'} inflated bytes, "
            f"expected at most {MAX_TABLE_BYTES}"
        )
    try:
        out = zstandard.ZstdDecompressor(max_window_size=1 << 27).decompress(
            data, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise _bad(f"zstd frame does not decode ({e})") from None
    if len(out) != size:
        raise _bad(f"inflated to {len(out)} bytes, expected {size}")
    return out


def _thresholds(rd: Reader, what: str) -> list[int]:
    n = rd.byte(f"{what} threshold count")
    t = list(rd.take(n, f"{what} thresholds"))
    if n >= _MAX_CLASSES or not all(1 <= x <= 127 for x in t) or any(a >= b for a, b in zip(t, t[1:])):
        raise rd.bad(f"{what} thresholds {t}, expected fewer than {_MAX_CLASSES} increasing integers in [1, 127]")
    return t


def _read_model(rd: Reader, what: str) -> list[int]:
    e = rd.byte(f"{what} alphabet size")
    if e == 0:
        return [0, 0]
    if e > _MAX_ALPHABET:
        raise rd.bad(f"{what} alphabet size {e}, expected 1..{_MAX_ALPHABET}")
    f = rd.varints(f"{what} frequency", e, PROB_M)
    if sum(f) > PROB_M:
        raise rd.bad(f"{what} frequencies sum to {sum(f)}, expected at most {PROB_M}")
    return f + [PROB_M - sum(f)]


def parse_table(data: bytes) -> list[Row]:
    """The records of an inflated table (see the module docstring for what is checked here;
    stream sizes against the data section are checked by the caller)."""
    rd = Reader(data)
    rows = read_rows(rd)
    if rd.pos != len(data):
        raise rd.bad(f"{len(data) - rd.pos} bytes left after the last field")
    return rows


# reads and bounds-checks the records field by field in their format's order (docs/format.md); split, that order would
# be spread over functions
def read_rows(rd: Reader) -> list[Row]:  # noqa: C901, PLR0915
    """The records at `rd`'s position (a record count, then the columns); `rd` is left after them."""
    data = rd.data
    t = rd.varint("record count")
    if t * _MIN_RECORD > len(data):
        raise rd.bad(f"declares {t} records, but {len(data)} bytes hold at most {len(data) // _MIN_RECORD}")
    names, prev = [], b""
    for i in range(t):
        shared = rd.varint(f"name {i}: shared prefix length", len(prev))
        nb = prev[:shared] + rd.take(rd.varint(f"name {i}: suffix length", MAX_NAME_BYTES), f"name {i}")
        if i and nb <= prev:
            raise rd.bad(
                f"name {i} ({nb[:80]!r}) does not sort after name {i - 1} ({prev[:80]!r}); names must be unique and "
                "sorted"
            )
        if not nb or len(nb) > MAX_NAME_BYTES:
            raise rd.bad(f"name {i} has {len(nb)} bytes, expected 1..{MAX_NAME_BYTES}")
        try:
            names.append(nb.decode("utf-8"))
        except UnicodeDecodeError:
            raise rd.bad(f"name {i} is not UTF-8") from None
        prev = nb
    dts = []
    for i, c in enumerate(rd.take(t, "dtypes")):
        if c >= len(DTYPE_CODES):
            raise rd.bad(f"tensor '{names[i]}': dtype code {c}, expected 0..{len(DTYPE_CODES) - 1}")
        dts.append(DTYPE_CODES[c])
    shapes = []
    for i in range(t):
        nd = rd.byte(f"tensor '{names[i]}': ndim")
        if nd > 16:
            raise rd.bad(f"tensor '{names[i]}': {nd} dims, expected at most 16")
        shape, numel = [], 1
        for _ in range(nd):
            d = rd.varint(f"tensor '{names[i]}': dim", 1 << 48)
            shape.append(d)
            numel *= d
            if numel > 1 << 48:
                raise rd.bad(f"tensor '{names[i]}': shape {shape}... has more than 2^48 elements")
        shapes.append(tuple(shape))
    encs = []
    for i, c in enumerate(rd.take(t, "encodings")):
        if c & 15 >= len(POS_CODES) or c >> 4 >= len(VAL_CODES):
            raise rd.bad(
                f"tensor '{names[i]}': encoding code {c:#04x}, expected positions 0..{len(POS_CODES) - 1} | values "
                f"0..{len(VAL_CODES) - 1} << 4"
            )
        encs.append((POS_CODES[c & 15], VAL_CODES[c >> 4]))
    n_changed = [0] * t
    for i in range(t):
        if encs[i][0] != "gaps":
            n_changed[i] = rd.varint(f"tensor '{names[i]}': n_changed", 1 << 48)
    pparams: list[dict] = [{} for _ in range(t)]
    for i in range(t):
        if encs[i][0] == "gaps":
            what = f"tensor '{names[i]}': gaps"
            thr = _thresholds(rd, what)
            classes: list[dict[str, Any]] = []
            for _ in range(len(thr) + 1):
                n = rd.varint(f"{what} class size", 1 << 48)
                if n:
                    k = rd.byte(f"{what} k")
                    if k > _MAX_K:
                        raise rd.bad(f"{what} k={k}, expected at most {_MAX_K}")
                    counts = _read_model(rd, f"{what} quotient model")
                else:
                    k, counts = 0, [PROB_M, 0]
                classes.append({"n": n, "k": k, "counts": counts})
            pparams[i] = {"thresholds": thr, "classes": classes}
            n_changed[i] = sum(c["n"] for c in classes)
    vparams: list[dict] = [{} for _ in range(t)]
    for i in range(t):
        if encs[i][1] == "delta":
            what = f"tensor '{names[i]}': delta"
            thr = _thresholds(rd, what)
            vparams[i] = {"thresholds": thr, "counts": [_read_model(rd, f"{what} model") for _ in range(len(thr) + 1)]}
    sizes: list[dict[str, int]] = [{} for _ in range(t)]
    for i in range(t):
        for role in explicit_roles(encs[i][0], pparams[i], encs[i][1], vparams[i]):
            sizes[i][role] = rd.varint(f"tensor '{names[i]}': size of '{role}'", 1 << 48) * _unit(role, dts[i])
    base = rd.take(8 * t, "base digests")
    target = rd.take(8 * t, "target digests")
    return [
        Row(names[i], dts[i], shapes[i], n_changed[i], encs[i][0], pparams[i], encs[i][1], vparams[i],
            base[8 * i : 8 * i + 8][::-1].hex(), target[8 * i : 8 * i + 8][::-1].hex(), sizes[i])
        for i in range(t)
    ]


def explicit_roles(positions: str, pparams: dict, values: str, vparams: dict) -> list[str]:
    """The roles whose sizes the table states for these encodings, in table order."""
    out = []
    if positions == "bitmap":
        out.append("bitmap")
    if positions == "gaps":
        out.append("gaps")
        if any(c["counts"][-1] for c in pparams["classes"]):
            out.append("gaps_escape")
    if values == "delta":
        out.append("delta")
        if any(c[-1] for c in vparams["counts"]):
            out.append("delta_escape")
    return out
