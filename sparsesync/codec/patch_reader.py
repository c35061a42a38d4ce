"""Reading a patch file (docs/format.md): the side of the codec that faces untrusted bytes.

Guarantee: `read_patch` accepts only files whose whole structure is valid (safetensors layout,
metadata schema, format version, per-tensor encodings, stream names, dtypes, shapes and sizes);
anything else raises PatchFormatError naming the bad field, and nothing is decompressed or
allocated beyond the file itself. `parse_header`/`fetch_header` apply the same checks to a
patch's header read alone (by range, `HEADER_PREFIX` bytes first). What a patch is:
`sparsesync.codec.patch`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable

from sparsesync.codec import _container, _encodings, _groups, _table
from sparsesync.codec._container import Stream
from sparsesync.codec.digest import is_digest
from sparsesync.codec.patch import (
    DIGEST_RE,
    FORMAT_NAME,
    GROUPED,
    GROUPS_KEY,
    READABLE_VERSIONS,
    STREAMS_KEY,
    TABLE_KEY,
    Group,
    Patch,
    PatchHeader,
    TensorEntry,
    ctx_for,
    digest_prefix,
    has_groups,
    stream_key,
)
from sparsesync.errors import PatchFormatError

_META_KEYS_V3 = {
    "format",
    "format_version",
    "base_version",
    "target_version",
    "base_state_digest",
    "target_state_digest",
}
_META_KEYS = _META_KEYS_V3 | {"tensors"}  # formats 1 and 2
HEADER_PREFIX = 64 << 10  # bytes a reader fetches first: header and table of any patch of up to ~2,000 tensors


def _fmt(msg: str) -> PatchFormatError:
    return PatchFormatError(
        msg, hint="the file is not a sparsesync patch of a supported format version, or is corrupt; fetch it again"
    )


def _int_field(v: object, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fmt(f"{what} is {v!r:.80}, expected an integer in [{lo}, {hi}]")
    return v


# one check per field of a header entry, in docs/format.md's order
def _entry(name: str, raw: object, table: dict[str, Stream]) -> TensorEntry:  # noqa: C901
    where = f"tensor '{name}'"
    if not isinstance(raw, dict):
        raise _fmt(f"{where}: entry is {type(raw).__name__}, expected an object")
    need = {
        "dtype",
        "shape",
        "n_changed",
        "positions",
        "position_params",
        "values",
        "value_params",
        "base_digest",
        "target_digest",
        "streams",
    }
    if set(raw) != need:
        raise _fmt(f"{where}: entry fields {sorted(raw)}, expected {sorted(need)}")
    dtype = raw["dtype"]
    if dtype not in _container.ST_DTYPES or dtype in ("BOOL",):
        raise _fmt(
            f"{where}: dtype {dtype!r}, expected one of {sorted(k for k in _container.ST_DTYPES if k != 'BOOL')}"
        )
    shape = raw["shape"]
    if (
        not isinstance(shape, list)
        or len(shape) > _container.MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise _fmt(
            f"{where}: shape {shape!r:.80}, expected a list of at most {_container.MAX_NDIM} non-negative integers"
        )
    numel = 1
    for d in shape:
        numel *= d
    if numel > _container.MAX_NUMEL:
        raise _fmt(f"{where}: shape {shape} has {numel} elements, expected at most {_container.MAX_NUMEL}")
    n_changed = _int_field(raw["n_changed"], f"{where}: n_changed", 1, max(numel, 1))
    for key in ("base_digest", "target_digest"):
        if not is_digest(raw[key]):
            raise _fmt(f"{where}: {key} {raw[key]!r:.40}, expected 16 lowercase hex digits, optionally after 'xxh3b:'")
    pos, val = raw["positions"], raw["values"]
    if pos not in _encodings.POSITIONS:
        raise _fmt(f"{where}: position encoding {pos!r:.40}, expected one of {sorted(_encodings.POSITIONS)}")
    if val not in _encodings.VALUES:
        raise _fmt(f"{where}: value encoding {val!r:.40}, expected one of {sorted(_encodings.VALUES)}")
    pparams, vparams, sroles = raw["position_params"], raw["value_params"], raw["streams"]
    for what, p in (("position_params", pparams), ("value_params", vparams)):
        if not isinstance(p, dict):
            raise _fmt(f"{where}: {what} is {type(p).__name__}, expected an object")
    if not isinstance(sroles, dict) or not all(isinstance(v, str) for v in sroles.values()):
        raise _fmt(f"{where}: streams is {sroles!r:.80}, expected an object of role -> key")
    entry = TensorEntry(
        name,
        dtype,
        tuple(shape),
        n_changed,
        pos,
        val,
        raw["base_digest"],
        raw["target_digest"],
        pparams,
        vparams,
        dict(sroles),
    )
    ctx = ctx_for(entry)
    try:
        layout = {
            **_encodings.POSITIONS[pos][2](pparams, ctx),
            **_encodings.VALUES[val][2](vparams, ctx, entry.n_values),
        }
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # hostile params (e.g. counts [])
        raise _fmt(f"{where}: bad encoding parameters {pparams!r:.80} / {vparams!r:.80} ({e})") from None
    if set(sroles) != set(layout):
        raise _fmt(f"{where}: streams {sorted(sroles)}, expected {sorted(layout)} for encodings {pos}/{val}")
    sizes = {}
    for role, (sdt, sshape) in layout.items():
        key = sroles[role]
        if key != stream_key(name, role):
            raise _fmt(f"{where}: stream '{role}' is named {key!r:.80}, expected {stream_key(name, role)!r}")
        s = table.get(key)
        if s is None:
            raise _fmt(f"{where}: stream '{key}' is missing from the file")
        if s.dtype != sdt or (sshape is not None and s.shape != sshape) or (sshape is None and len(s.shape) != 1):
            raise _fmt(
                f"{where}: stream '{key}' is {s.dtype} {list(s.shape)}, expected {sdt} "
                f"{list(sshape) if sshape is not None else '[n]'}"
            )
        sizes[role] = s.nbytes
    return TensorEntry(
        name,
        dtype,
        tuple(shape),
        n_changed,
        pos,
        val,
        raw["base_digest"],
        raw["target_digest"],
        pparams,
        vparams,
        dict(sroles),
        sizes,
    )


def _header(meta: dict[str, str], table: dict[str, Stream], buf: bytes) -> tuple[PatchHeader, dict[str, Stream]]:
    """The header and every tensor's streams (format 3: located through the table, which `buf`,
    the file or a prefix of it, must hold)."""
    if meta.get("format") != FORMAT_NAME:
        raise _fmt(f"metadata format {meta.get('format')!r:.40}, expected {FORMAT_NAME!r}")
    if meta.get("format_version") not in [str(v) for v in READABLE_VERSIONS]:
        raise PatchFormatError(
            f"patch format_version {meta.get('format_version')!r:.20}, expected one of "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
            hint="upgrade sparsesync to read newer patches",
        )
    version = int(meta["format_version"])
    keys = _META_KEYS_V3 if version >= 3 else _META_KEYS
    if set(meta) != keys:
        raise _fmt(f"metadata keys {sorted(meta)}, expected {sorted(keys)}")
    versions = []
    for key in ("base_version", "target_version"):
        if not re.fullmatch(r"0|[1-9][0-9]{0,17}", meta[key]):
            raise _fmt(f"metadata {key} {meta[key]!r:.40}, expected a non-negative decimal integer")
        versions.append(int(meta[key]))
    if versions[0] >= versions[1]:
        raise _fmt(f"base_version {versions[0]} >= target_version {versions[1]}, expected base < target")
    prefix = digest_prefix(version)
    for key in ("base_state_digest", "target_state_digest"):
        if not (meta[key].startswith(prefix) and DIGEST_RE.match(meta[key][len(prefix):])):
            raise _fmt(
                f"metadata {key} {meta[key]!r:.40}, expected {prefix!r} and 16 lowercase hex digits (format {version})"
            )
    start = 0
    groups: tuple[Group, ...] = ()
    if version >= 3:
        tensors, streams, groups = _table_entries(table, buf, version)
        start = table[STREAMS_KEY].start
    else:
        try:
            raw = json.loads(meta["tensors"])
        except (ValueError, RecursionError) as e:  # ValueError: JSON syntax, ints over 4300 digits
            raise _fmt(f"metadata tensors is not JSON ({type(e).__name__}: {str(e):.200})") from None
        if not isinstance(raw, dict):
            raise _fmt(f"metadata tensors is a JSON {type(raw).__name__}, expected an object")
        tensors, streams = {name: _entry(name, raw[name], table) for name in sorted(raw)}, table
        used = {k for e in tensors.values() for k in e.streams.values()}
        extra = sorted(set(table) - used)
        if extra:
            raise _fmt(f"streams {extra[:5]} belong to no tensor entry")
    return PatchHeader(
        version,
        versions[0],
        versions[1],
        meta["base_state_digest"],
        meta["target_state_digest"],
        tensors,
        start,
        groups,
    ), streams


def _table_entries(
    table: dict[str, Stream], buf: bytes, version: int
) -> tuple[dict[str, TensorEntry], dict[str, Stream], tuple[Group, ...]]:
    """Formats 3 to 5: the entries of the binary table (and the groups of formats 4 and 5, whose
    members are entries too, positions GROUPED) and where each tensor's streams lie in `streams`
    (the digests of the table and the group section are stored as bare hex; from format 5 on
    they are "xxh3b" digests and the entries carry them with that prefix)."""
    grouped = has_groups(version, table)
    keys = [TABLE_KEY, GROUPS_KEY, STREAMS_KEY] if grouped else [TABLE_KEY, STREAMS_KEY]
    if set(table) != set(keys) or any(table[a].end != table[b].start for a, b in zip(keys, keys[1:])):
        raise _fmt(
            f"tensors {sorted(table)[:5]}, expected exactly {' then '.join(repr(k) for k in keys)} (format {version})"
        )
    t, d = table[TABLE_KEY], table[STREAMS_KEY]
    if any(table[k].dtype != "U8" for k in keys):
        raise _fmt(
            f"'{TABLE_KEY}' is {t.dtype}" + "".join(f" and '{k}' {table[k].dtype}" for k in keys[1:]) + ", expected U8"
        )
    end = table[keys[-2]].end
    if len(buf) < end:
        raise _fmt(f"{len(buf)} bytes hold the table only up to byte {len(buf)}, it ends at {end}")
    rows = _table.parse_table(_table.inflate(bytes(buf[t.start : t.end])))
    parsed = (
        _groups.parse_section(
            _table.inflate(bytes(buf[table[GROUPS_KEY].start : end]), "patch group section", version),
            {r.name for r in rows},
            version,
        )
        if grouped
        else []
    )
    prefix = digest_prefix(version)
    off = d.start
    located: dict[str, Stream] = {}
    tensors: dict[str, TensorEntry] = {}
    for r in rows:
        off, tensors[r.name] = _locate(r, off, d, located, f"tensor '{r.name}'", prefix)
    groups = []
    for g in parsed:
        off, coding = _locate(g.row, off, d, located, f"group '{g.row.name}'", prefix)
        groups.append(Group(coding, g.names, g.offsets, g.n_changed))
        dtype = g.row.dtype
        for name, shape, n, bd, td in zip(g.names, g.shapes, g.n_changed.tolist(), g.base_digests, g.target_digests):
            tensors[name] = TensorEntry(name, dtype, shape, n, GROUPED, GROUPED, prefix + bd, prefix + td)
    if off != d.end:
        raise _fmt(f"the table's streams cover {off - d.start} bytes, the '{STREAMS_KEY}' tensor has {d.nbytes}")
    if groups:
        tensors = dict(sorted(tensors.items()))
    return tensors, located, tuple(groups)


def _raw(r: _table.Row, roles: dict[str, str], prefix: str) -> dict:
    return {
        "dtype": r.dtype,
        "shape": list(r.shape),
        "n_changed": r.n_changed,
        "positions": r.positions,
        "position_params": r.position_params,
        "values": r.values,
        "value_params": r.value_params,
        "base_digest": prefix + r.base_digest,
        "target_digest": prefix + r.target_digest,
        "streams": roles,
    }


def _locate(
    r: _table.Row, off: int, d: Stream, located: dict[str, Stream], where: str, prefix: str
) -> tuple[int, TensorEntry]:
    """Place the streams of record `r` from data byte `off` on (into `located`); returns where
    the next record's streams start and `r`'s checked entry (its digests written with `prefix`)."""
    numel = math.prod(r.shape)
    if not 1 <= r.n_changed <= max(numel, 1):
        raise _fmt(f"{where}: n_changed is {r.n_changed}, expected an integer in [1, {max(numel, 1)}]")
    probe = TensorEntry(
        r.name,
        r.dtype,
        r.shape,
        r.n_changed,
        r.positions,
        r.values,
        prefix + r.base_digest,
        prefix + r.target_digest,
        r.position_params,
        r.value_params,
    )
    ctx = ctx_for(probe)
    layout = {
        **_encodings.POSITIONS[r.positions][2](r.position_params, ctx),
        **_encodings.VALUES[r.values][2](r.value_params, ctx, probe.n_values),
    }
    roles = {}
    for role in (x for x in _table.ROLE_ORDER if x in layout):
        sdt, sshape = layout[role]
        if sshape is not None:
            size = math.prod(sshape) * _container.ST_DTYPES[sdt][1]
        elif role == "gaps_low":
            size = (sum(c["n"] * c["k"] for c in r.position_params["classes"]) + 7) // 8
        else:
            size = r.sizes[role]
        key = stream_key(r.name, role)
        if key in located:
            raise _fmt(f"{where}: stream '{key}' is placed twice")
        located[key] = Stream(key, sdt, sshape if sshape is not None else (size,), off, off + size)
        roles[role] = key
        off += size
        if off > d.end:
            raise _fmt(
                f"{where}: stream '{role}' ends at byte {off - d.start} of the {d.nbytes}-byte '{STREAMS_KEY}' tensor"
            )
    return off, _entry(r.name, _raw(r, roles, prefix), located)


def header_length(first8: bytes) -> int:
    """The JSON header's length from a patch's first 8 bytes (see `header_span` for the table)."""
    return _container.header_length(first8)


def header_span(prefix: bytes) -> int:
    """How many bytes from the start of a patch file `parse_header` needs: the length prefix and
    JSON header, and for format 3 the table right after them. `prefix` (the file's first bytes)
    must hold the JSON header; if it does not, the answer is 8 + its length: fetch that, ask again."""
    n = 8 + _container.header_length(prefix[:8])
    if len(prefix) < n:
        return n
    meta, table = _container.parse_header_json(bytes(prefix[8:n]))
    info = table.get(TABLE_KEY)
    if meta.get("format_version") not in ("3", "4") or not isinstance(info, dict):
        return n
    if meta["format_version"] == "4":
        info = table.get(GROUPS_KEY)
        if not isinstance(info, dict):
            return n
    offs = info.get("data_offsets")
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(type(x) is int for x in offs)
        and 0 <= offs[0] <= offs[1] <= _table.MAX_TABLE_BYTES
    ):
        raise _fmt(
            f"'{TABLE_KEY}' data_offsets {offs!r:.80}, expected [start, end] with end at most {_table.MAX_TABLE_BYTES}"
        )
    return n + offs[1]


def parse_header(prefix: bytes) -> PatchHeader:
    """A patch's header from the file's first `header_span` bytes (or more; the streams are not
    needed): one range read of HEADER_PREFIX bytes holds it for patches of up to ~2,000 tensors."""
    n = 8 + _container.header_length(prefix[:8])
    if len(prefix) < n:
        raise _fmt(f"{len(prefix)} bytes given, the JSON header ends at byte {n}")
    meta, table = _container.parse_header_json(bytes(prefix[8:n]))
    ends = [
        info.get("data_offsets", [0, 0])[-1]
        for info in table.values()
        if isinstance(info, dict) and isinstance(info.get("data_offsets"), list) and info.get("data_offsets")
    ]
    data_len = max([e for e in ends if type(e) is int] or [0])
    return _header(meta, _container.parse_streams(table, n, data_len), prefix)[0]


def fetch_header(read_range: Callable[[int, int], bytes]) -> PatchHeader:
    """A patch's header through `read_range(start, length)` (e.g. a store's `get_range` of the
    patch's key): one request of HEADER_PREFIX bytes, a second only for a larger header + table."""
    prefix = read_range(0, HEADER_PREFIX)
    for _ in range(2):  # the JSON header's length, then the table's
        need = header_span(prefix)
        if need <= len(prefix) or len(prefix) < HEADER_PREFIX:
            break
        prefix += read_range(len(prefix), need - len(prefix))
    return parse_header(prefix)


def read_patch(data: bytes | bytearray | memoryview | os.PathLike | str) -> Patch:
    """Read and structurally validate a patch (bytes, or a path to the file). Needs no base."""
    if isinstance(data, (str, os.PathLike)):
        with open(data, "rb") as f:
            buf = f.read()
    else:
        buf = bytes(data)
    meta, table = _container.parse_container(memoryview(buf))
    header, streams = _header(meta, table, buf)
    return Patch(header, buf, streams)
