"""The sparse patch file: one safetensors file taking a model from version B to version B+k.

Guarantee: `read_patch` accepts only files whose whole structure is valid (safetensors layout,
metadata schema, format version, per-tensor encodings, stream names, dtypes, shapes and sizes);
anything else raises PatchFormatError naming the bad field, and nothing is decompressed or
allocated beyond the file itself. `encode_changes` output is deterministic (same changes, same
bytes) and is a plain safetensors file any safetensors reader loads. Spec: docs/format.md.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from sparsesync.codec import _container, _encodings, _parallel, _table
from sparsesync.codec._container import Stream
from sparsesync.codec.diff import TensorChange, bits_view, np_uint_dtype, to_np_bits
from sparsesync.errors import PatchFormatError, PatchMismatchError

FORMAT_NAME = "sparsesync.patch"
FORMAT_VERSION = 3  # what the encoder writes
READABLE_VERSIONS = (1, 2, 3)  # 1 differs from 2 only in its entropy coder; 3 moves the entries into a binary table (docs/format.md)
_DIGEST_RE = re.compile(r"^[0-9a-f]{16}$")

# What an encoder favors when it has the base. "size" (the default): the smallest patches, with
# positions and values coded per class of the base's magnitude, which costs the encoder and every
# reader one more pass over each changed tensor (finding each change's rank in its class).
# "speed": no class-conditioned codings: at 0.6B and 1.6% density, patches 26-29% larger,
# diff+encode about 30% and decode about 50% faster (benchmarks/codec_bench.py --effort);
# the better trade where the link moves a patch's extra bytes faster than the passes take
# (above about 50 Mbit/s at that size). Readers need nothing: a patch says how it is coded.
Effort = Literal["size", "speed"]


def check_effort(effort: str) -> Effort:
    """`effort` if it is one of `Effort`'s values, else ValueError naming them."""
    if effort not in get_args(Effort):
        raise ValueError(f"effort={effort!r}, expected one of {list(get_args(Effort))}")
    return effort  # type: ignore[return-value]


_META_KEYS_V3 = {"format", "format_version", "base_version", "target_version", "base_state_digest", "target_state_digest"}
_META_KEYS = _META_KEYS_V3 | {"tensors"}  # formats 1 and 2
TABLE_KEY, STREAMS_KEY = "table", "streams"  # format 3's two safetensors tensors
HEADER_PREFIX = 64 << 10  # bytes a reader fetches first: header and table of any patch of up to ~2,000 tensors


@dataclass(frozen=True)
class TensorEntry:
    """The header's record of one tensor the patch touches."""

    name: str
    dtype: str  # safetensors dtype name of the tensor ("BF16", "F16", "F32", "F8_E4M3", ...)
    shape: tuple[int, ...]
    n_changed: int  # elements whose bits differ between base and target
    positions: str  # position encoding ("raw_i32", "dense", ...; docs/format.md)
    values: str  # value encoding ("raw", "delta", ...)
    base_digest: str  # xxh3_64 hex of the tensor's bytes at the base version
    target_digest: str  # same at the target version
    position_params: dict[str, object] = field(default_factory=dict)
    value_params: dict[str, object] = field(default_factory=dict)
    streams: dict[str, str] = field(default_factory=dict)  # role -> safetensors key
    stream_sizes: dict[str, int] = field(default_factory=dict)  # role -> bytes in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_values(self) -> int:
        """How many values the value streams hold: every element for `dense`, else n_changed."""
        return self.numel if self.positions == "dense" else self.n_changed

    @property
    def nbytes(self) -> int:
        return sum(self.stream_sizes.values())


@dataclass(frozen=True)
class PatchHeader:
    """Everything a patch says about itself; readable from the file's header alone."""

    format_version: int
    base_version: int
    target_version: int
    base_state_digest: str
    target_state_digest: str
    tensors: dict[str, TensorEntry]
    streams_start: int = 0  # format 3: file offset of the `streams` tensor (each tensor's streams follow in table order)

    def byte_ranges(self, names: list[str] | None = None) -> dict[str, tuple[int, int]]:
        """Format 3: the file's [start, end) holding all streams of each tensor of `names`
        (default: every touched tensor), from the header alone: a part of a version is read by
        range. Formats 1 and 2 place streams by size, not by tensor: ValueError."""
        if self.format_version < 3:
            raise ValueError(f"patch format {self.format_version} does not place each tensor's streams together; read the whole file")
        out, off = {}, self.streams_start
        for name, e in self.tensors.items():
            out[name] = (off, off + e.nbytes)
            off += e.nbytes
        return out if names is None else {n: out[n] for n in names}


@dataclass(frozen=True)
class Patch:
    """A structurally valid patch file held in memory."""

    header: PatchHeader
    data: bytes
    _streams: dict[str, Stream]

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def stream(self, name: str, role: str) -> bytes:
        """The raw bytes of one of tensor `name`'s streams."""
        s = self._streams[self.header.tensors[name].streams[role]]
        return self.data[s.start : s.end]


def stream_key(name: str, role: str) -> str:
    """The safetensors key of a tensor's stream: '<tensor name>::<role>'."""
    return f"{name}::{role}"


def ctx_for(entry: TensorEntry, base_bits=None, format_version: int = FORMAT_VERSION) -> _encodings.Ctx:  # noqa: ANN001 - callable or None
    dtype = _container.ST_DTYPES[entry.dtype][0]
    return _encodings.Ctx(entry.name, entry.dtype, np_uint_dtype(dtype), entry.numel, entry.n_changed, base_bits, format_version)


# ---------------------------------------------------------------------------- writing
def _choose(change: TensorChange, ctx: _encodings.Ctx, base: torch.Tensor | None, classes: bool) -> tuple[str, dict, dict, str, dict, dict]:
    """Smallest (positions, values) encoding pair for one tensor's change."""
    from sparsesync.codec import _select

    base_full = None
    if base is not None:
        if tuple(base.shape) != tuple(change.shape) or base.dtype != change.dtype:
            raise PatchMismatchError(
                f"tensor '{ctx.name}': base is {base.dtype} {tuple(base.shape)}, expected {change.dtype} {change.shape}", hint="pass the base the changes were diffed against"
            )
        base_full = to_np_bits(bits_view(base))
    return _select.choose(change, ctx, base_full, classes=classes)


@dataclass
class EncodedTensor:
    """One tensor's chosen encodings and streams, before digests and versions are attached."""

    dtype: str
    shape: tuple[int, ...]
    n_changed: int
    positions: str
    position_params: dict
    values: str
    value_params: dict
    streams: dict[str, tuple[str, tuple[int, ...], bytes]]  # role -> (dtype, shape, bytes)


def encode_tensor(name: str, change: TensorChange, base: torch.Tensor | None = None, *, effort: Effort = "size") -> EncodedTensor:
    """Encode one non-empty change (the smallest encodings; see `encode_changes`); `base`: the
    tensor the change was diffed against, if the encoder has it. `effort` (`Effort`): "speed"
    leaves out the codings conditioned on the base's magnitude classes."""
    st = _container.st_dtype_name(change.dtype)
    ctx = _encodings.Ctx(name, st, np_uint_dtype(change.dtype), change.numel, change.n_changed, None)
    pos, pparams, pstreams, val, vparams, vstreams = _choose(change, ctx, base, check_effort(effort) == "size")
    return EncodedTensor(st, tuple(change.shape), change.n_changed, pos, pparams, val, vparams, {**pstreams, **vstreams})


def encode_tensors(changes: Mapping[str, TensorChange], *, base: Mapping[str, torch.Tensor] | None = None,
                   effort: Effort = "size") -> dict[str, EncodedTensor]:
    """Encode every non-empty change (`encode_tensor`). Tensors are encoded on the codec's
    thread pool; the result does not depend on it."""
    # biggest first keeps both threads busy to the end; the result is keyed by name (order-free)
    names = sorted((n for n in changes if changes[n].indices.size), key=lambda n: (-changes[n].numel, n))
    encoded = dict(zip(names, _parallel.map_ordered(lambda n: encode_tensor(n, changes[n], base.get(n) if base is not None else None, effort=effort), names,
                                                    weights=[changes[n].numel for n in names])))
    return {n: encoded[n] for n in sorted(encoded)}


def assemble_patch(
    encoded: Mapping[str, EncodedTensor],
    *,
    base_version: int,
    target_version: int,
    base_digests: Mapping[str, str],
    target_digests: Mapping[str, str],
    base_state_digest: str,
    target_state_digest: str,
) -> bytes:
    """The patch file from encoded tensors plus versions and digests."""
    if not (type(base_version) is int and type(target_version) is int and 0 <= base_version < target_version):
        raise PatchFormatError(f"versions {base_version} -> {target_version}, expected 0 <= base < target", hint="pass the published version numbers")
    missing = sorted(n for n in encoded if n not in base_digests or n not in target_digests)
    if missing:
        raise PatchFormatError(f"no base/target digest for tensors {missing}", hint="pass digests for every tensor in changes")
    for what, d in [("base_state_digest", base_state_digest), ("target_state_digest", target_state_digest)] + [
        (f"digest of '{n}'", dg) for n in encoded for dg in (base_digests[n], target_digests[n])
    ]:
        if not isinstance(d, str) or not _DIGEST_RE.match(d):
            raise PatchFormatError(f"{what} {d!r}, expected 16 lowercase hex digits", hint="use codec.tensor_digest / codec.state_digest")
    rows, blobs = [], []
    for name in sorted(encoded):
        e = encoded[name]
        pp, vp = e.position_params, e.value_params
        if e.positions == "gaps":  # the table carries the coder's quantized frequencies (format 3)
            pp = {"thresholds": pp["thresholds"], "classes": [{**c, "counts": _table.quantize(c["counts"])} for c in pp["classes"]]}
        if e.values == "delta":
            vp = {"thresholds": vp["thresholds"], "counts": [_table.quantize(c) for c in vp["counts"]]}
        explicit = _table.explicit_roles(e.positions, pp, e.values, vp)
        rows.append(_table.Row(name, e.dtype, tuple(e.shape), e.n_changed, e.positions, pp, e.values, vp, base_digests[name], target_digests[name],
                               {role: len(e.streams[role][2]) for role in explicit}))
        blobs += [e.streams[role][2] for role in _table.ROLE_ORDER if role in e.streams]
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "base_version": str(base_version),
        "target_version": str(target_version),
        "base_state_digest": base_state_digest,
        "target_state_digest": target_state_digest,
    }
    table = _table.build_table(rows)
    return _container.write_container(meta, [(TABLE_KEY, "U8", (len(table),), table), (STREAMS_KEY, "U8", (sum(len(b) for b in blobs),), blobs)])


def encode_changes(
    changes: Mapping[str, TensorChange],
    *,
    base_version: int,
    target_version: int,
    base_digests: Mapping[str, str],
    target_digests: Mapping[str, str],
    base_state_digest: str,
    target_state_digest: str,
    base: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """The patch file's bytes for `changes` (from `diff_state` or `compose_changes`).

    `base_digests`/`target_digests` must name every tensor in `changes` (other names are
    ignored). Per tensor the smallest of the available encodings is chosen. With `base` (the
    state the changes were diffed against) positions and values can be coded conditioned on
    the base values, which is much smaller; without it only base-independent encodings are
    used (e.g. for changes coalesced with `compose_changes`).
    """
    return assemble_patch(
        encode_tensors(changes, base=base),
        base_version=base_version,
        target_version=target_version,
        base_digests=base_digests,
        target_digests=target_digests,
        base_state_digest=base_state_digest,
        target_state_digest=target_state_digest,
    )


# ---------------------------------------------------------------------------- reading
def _fmt(msg: str) -> PatchFormatError:
    return PatchFormatError(msg, hint="the file is not a sparsesync patch of a supported format version, or is corrupt; fetch it again")


def _int_field(v: object, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fmt(f"{what} is {v!r:.80}, expected an integer in [{lo}, {hi}]")
    return v


def _entry(name: str, raw: object, table: dict[str, Stream]) -> TensorEntry:
    where = f"tensor '{name}'"
    if not isinstance(raw, dict):
        raise _fmt(f"{where}: entry is {type(raw).__name__}, expected an object")
    need = {"dtype", "shape", "n_changed", "positions", "position_params", "values", "value_params", "base_digest", "target_digest", "streams"}
    if set(raw) != need:
        raise _fmt(f"{where}: entry fields {sorted(raw)}, expected {sorted(need)}")
    dtype = raw["dtype"]
    if dtype not in _container.ST_DTYPES or dtype in ("BOOL",):
        raise _fmt(f"{where}: dtype {dtype!r}, expected one of {sorted(k for k in _container.ST_DTYPES if k != 'BOOL')}")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > _container.MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise _fmt(f"{where}: shape {shape!r:.80}, expected a list of at most {_container.MAX_NDIM} non-negative integers")
    numel = 1
    for d in shape:
        numel *= d
    if numel > _container.MAX_NUMEL:
        raise _fmt(f"{where}: shape {shape} has {numel} elements, expected at most {_container.MAX_NUMEL}")
    n_changed = _int_field(raw["n_changed"], f"{where}: n_changed", 1, max(numel, 1))
    for key in ("base_digest", "target_digest"):
        if not isinstance(raw[key], str) or not _DIGEST_RE.match(raw[key]):
            raise _fmt(f"{where}: {key} {raw[key]!r:.40}, expected 16 lowercase hex digits")
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
    entry = TensorEntry(name, dtype, tuple(shape), n_changed, pos, val, raw["base_digest"], raw["target_digest"], pparams, vparams, dict(sroles))
    ctx = ctx_for(entry)
    try:
        layout = {**_encodings.POSITIONS[pos][2](pparams, ctx), **_encodings.VALUES[val][2](vparams, ctx, entry.n_values)}
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
            raise _fmt(f"{where}: stream '{key}' is {s.dtype} {list(s.shape)}, expected {sdt} {list(sshape) if sshape is not None else '[n]'}")
        sizes[role] = s.nbytes
    return TensorEntry(name, dtype, tuple(shape), n_changed, pos, val, raw["base_digest"], raw["target_digest"], pparams, vparams, dict(sroles), sizes)


def _header(meta: dict[str, str], table: dict[str, Stream], buf: bytes) -> tuple[PatchHeader, dict[str, Stream]]:
    """The header and every tensor's streams (format 3: located through the table, which `buf`,
    the file or a prefix of it, must hold)."""
    if meta.get("format") != FORMAT_NAME:
        raise _fmt(f"metadata format {meta.get('format')!r:.40}, expected {FORMAT_NAME!r}")
    if meta.get("format_version") not in [str(v) for v in READABLE_VERSIONS]:
        raise PatchFormatError(
            f"patch format_version {meta.get('format_version')!r:.20}, expected one of {', '.join(map(str, READABLE_VERSIONS))}",
            hint="upgrade sparsesync to read newer patches",
        )
    version = int(meta["format_version"])
    keys = _META_KEYS_V3 if version == 3 else _META_KEYS
    if set(meta) != keys:
        raise _fmt(f"metadata keys {sorted(meta)}, expected {sorted(keys)}")
    versions = []
    for key in ("base_version", "target_version"):
        if not re.fullmatch(r"0|[1-9][0-9]{0,17}", meta[key]):
            raise _fmt(f"metadata {key} {meta[key]!r:.40}, expected a non-negative decimal integer")
        versions.append(int(meta[key]))
    if versions[0] >= versions[1]:
        raise _fmt(f"base_version {versions[0]} >= target_version {versions[1]}, expected base < target")
    for key in ("base_state_digest", "target_state_digest"):
        if not _DIGEST_RE.match(meta[key]):
            raise _fmt(f"metadata {key} {meta[key]!r:.40}, expected 16 lowercase hex digits")
    start = 0
    if version == 3:
        tensors, streams = _table_entries(table, buf)
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
    return PatchHeader(version, versions[0], versions[1], meta["base_state_digest"], meta["target_state_digest"], tensors, start), streams


def _table_entries(table: dict[str, Stream], buf: bytes) -> tuple[dict[str, TensorEntry], dict[str, Stream]]:
    """Format 3: the entries of the binary table and where each tensor's streams lie in `streams`."""
    if set(table) != {TABLE_KEY, STREAMS_KEY} or table[TABLE_KEY].end != table[STREAMS_KEY].start:
        raise _fmt(f"tensors {sorted(table)[:5]}, expected exactly '{TABLE_KEY}' then '{STREAMS_KEY}' (format 3)")
    t, d = table[TABLE_KEY], table[STREAMS_KEY]
    if t.dtype != "U8" or d.dtype != "U8":
        raise _fmt(f"'{TABLE_KEY}' is {t.dtype} and '{STREAMS_KEY}' {d.dtype}, expected U8")
    if len(buf) < t.end:
        raise _fmt(f"{len(buf)} bytes hold the table only up to byte {len(buf)}, it ends at {t.end}")
    rows = _table.parse_table(_table.inflate(bytes(buf[t.start : t.end])))
    off, located, tensors = d.start, {}, {}
    for r in rows:
        where = f"tensor '{r.name}'"
        numel = math.prod(r.shape)
        if not 1 <= r.n_changed <= max(numel, 1):
            raise _fmt(f"{where}: n_changed is {r.n_changed}, expected an integer in [1, {max(numel, 1)}]")
        probe = TensorEntry(r.name, r.dtype, r.shape, r.n_changed, r.positions, r.values, r.base_digest, r.target_digest, r.position_params, r.value_params)
        ctx = ctx_for(probe)
        layout = {**_encodings.POSITIONS[r.positions][2](r.position_params, ctx), **_encodings.VALUES[r.values][2](r.value_params, ctx, probe.n_values)}
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
            located[key] = Stream(key, sdt, sshape if sshape is not None else (size,), off, off + size)
            roles[role] = key
            off += size
            if off > d.end:
                raise _fmt(f"{where}: stream '{role}' ends at byte {off - d.start} of the {d.nbytes}-byte '{STREAMS_KEY}' tensor")
        raw = {"dtype": r.dtype, "shape": list(r.shape), "n_changed": r.n_changed, "positions": r.positions, "position_params": r.position_params,
               "values": r.values, "value_params": r.value_params, "base_digest": r.base_digest, "target_digest": r.target_digest, "streams": roles}
        tensors[r.name] = _entry(r.name, raw, located)
    if off != d.end:
        raise _fmt(f"the table's streams cover {off - d.start} bytes, the '{STREAMS_KEY}' tensor has {d.nbytes}")
    return tensors, located


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
    if meta.get("format_version") != "3" or not isinstance(info, dict):
        return n
    offs = info.get("data_offsets")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs) and 0 <= offs[0] <= offs[1] <= _table.MAX_TABLE_BYTES):
        raise _fmt(f"'{TABLE_KEY}' data_offsets {offs!r:.80}, expected [start, end] with end at most {_table.MAX_TABLE_BYTES}")
    return n + offs[1]


def parse_header(prefix: bytes) -> PatchHeader:
    """A patch's header from the file's first `header_span` bytes (or more; the streams are not
    needed): one range read of HEADER_PREFIX bytes holds it for patches of up to ~2,000 tensors."""
    n = 8 + _container.header_length(prefix[:8])
    if len(prefix) < n:
        raise _fmt(f"{len(prefix)} bytes given, the JSON header ends at byte {n}")
    meta, table = _container.parse_header_json(bytes(prefix[8:n]))
    ends = [info.get("data_offsets", [0, 0])[-1] for info in table.values() if isinstance(info, dict) and isinstance(info.get("data_offsets"), list) and info.get("data_offsets")]
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


def patch_stream_arrays(patch: Patch, name: str) -> dict[str, bytes]:
    """All streams of tensor `name` by role (bytes)."""
    return {role: patch.stream(name, role) for role in patch.header.tensors[name].streams}

