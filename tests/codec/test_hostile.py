"""Hostile patches: a real safetensors patch forged (bytes or header edited), handed to `read_patch` +
`apply_patch`. Each test checks two things: the error names the tensor, the bad value and what was
expected; and not one bit of any tensor changed (all-or-nothing)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as st_load

from sparsesync.codec import (
    _container,
    _table,
    apply_patch,
    diff_state,
    header_length,
    parse_header,
    read_patch,
)
from sparsesync.codec.patch_reader import HEADER_PREFIX, fetch_header, header_span
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError, SparsesyncError
from tests.support.patches import (
    _case,
    _classed_case,
    _clone,
    _encode,
    _forced,
    _golden_patch,
    _raw_patch,
    _rejects,
    _span,
    assert_bit_equal,
)


def _header(data: bytes) -> tuple[int, dict]:
    n = header_length(data[:8])
    return n, json.loads(data[8 : 8 + n])


def _unpack(data: bytes) -> tuple[dict, list[_table.Row], dict[str, dict[str, bytes]]]:
    """A format 3 patch as (metadata, table rows, tensor -> role -> stream bytes)."""
    patch = read_patch(data)
    meta, table = _container.parse_container(memoryview(data))
    t = table["table"]
    rows = _table.parse_table(_table.inflate(data[t.start : t.end]))
    return meta, rows, {n: {role: patch.stream(n, role) for role in e.streams} for n, e in patch.header.tensors.items()}


def _pack(
    meta: dict, rows: list[_table.Row], streams: dict[str, dict[str, bytes]], *, table: bytes | None = None
) -> bytes:
    """The file of `_unpack`'s parts (explicit stream sizes taken from the streams' bytes), or
    with the compressed `table` given as is."""
    for r in rows:
        r.sizes = {
            role: len(streams[r.name][role])
            for role in _table.explicit_roles(r.positions, r.position_params, r.values, r.value_params)
            if role in streams[r.name]
        }
    table = _table.build_table(rows) if table is None else table
    blob = b"".join(streams[r.name][role] for r in rows for role in _table.ROLE_ORDER if role in streams[r.name])
    return _container.write_container(
        meta, [("table", "U8", (len(table),), table), ("streams", "U8", (len(blob),), blob)]
    )


def _edit_table(data: bytes, fn) -> bytes:  # noqa: ANN001 - fn(inflated table bytes) -> new inflated bytes
    meta, rows, streams = _unpack(data)
    t = _container.parse_container(memoryview(data))[1]["table"]
    raw = fn(bytearray(_table.inflate(data[t.start : t.end])))
    return _pack(meta, rows, streams, table=zstandard.ZstdCompressor(write_content_size=True).compress(bytes(raw)))


def _edit_header(data: bytes, fn) -> bytes:  # noqa: ANN001 - fn(header dict) edits in place
    n, h = _header(data)
    fn(h)
    hb = json.dumps(h, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data[8 + n :]


# fn(vars of the tensor's table row) edits in place
def _edit_entry(data: bytes, name: str, fn) -> bytes:  # noqa: ANN001
    meta, rows, streams = _unpack(data)
    fn(vars(next(r for r in rows if r.name == name)))
    return _pack(meta, rows, streams)


def _restream(data: bytes, key: str, new: bytes) -> bytes:
    """The same patch with stream `key` replaced by `new` (table sizes and container rebuilt)."""
    meta, rows, streams = _unpack(data)
    name, role = key.split("::")
    streams[name][role] = new
    return _pack(meta, rows, streams)


def _i32(data: bytes, key: str) -> np.ndarray:
    s, e = _span(data, key)
    return np.frombuffer(data[s:e], dtype="<i4").copy()


def _put_i32(data: bytes, key: str, arr: np.ndarray) -> bytes:
    s, e = _span(data, key)
    return data[:s] + arr.astype("<i4").tobytes() + data[e:]


def test_reject_index_out_of_range():
    base, target = _case()
    data = _raw_patch(base, target)
    idx = _i32(data, "x::indices")
    idx[-1] = 4200  # numel of 'x' is 60 * 70 = 4200
    _rejects(
        _put_i32(data, "x::indices", idx),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "index 4200 out of range",
        "0 <= index < 4200",
    )
    idx = _i32(data, "x::indices")
    idx[0] = -1
    _rejects(_put_i32(data, "x::indices", idx), _clone(base), PatchFormatError, "tensor 'x'", "index -1 out of range")


def test_reject_duplicate_and_unsorted_indices():
    base, target = _case()
    data = _raw_patch(base, target)
    idx = _i32(data, "x::indices")
    dup = idx.copy()
    dup[3] = dup[2]
    _rejects(
        _put_i32(data, "x::indices", dup),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        f"not strictly increasing: {idx[2]} then {idx[2]}",
    )
    swapped = idx.copy()
    swapped[[2, 3]] = swapped[[3, 2]]
    _rejects(
        _put_i32(data, "x::indices", swapped), _clone(base), PatchFormatError, "tensor 'x'", f"{idx[3]} then {idx[2]}"
    )


def test_reject_stream_length_mismatch():
    base, target = _case()
    n = diff_state(base, target)["x"].n_changed
    # raw values sized by n_changed: one value short leaves the table's sizes past the streams
    _rejects(
        _raw_patch(base, target, short_values="x"),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "stream 'values' ends at byte",
    )
    # a compressed stream one byte too long
    ch = diff_state({"x": base["x"]}, {"x": target["x"]})["x"]
    data = _forced(ch, base["x"], "gaps", "delta", [])
    s, e = _span(data, "x::gaps_low")  # its size follows from the classes' n and k: the streams tensor is then too long
    _rejects(
        _restream(data, "x::gaps_low", data[s:e] + b"\0"),
        {"x": base["x"].clone()},
        PatchFormatError,
        "the table's streams cover",
        "the 'streams' tensor has",
    )
    s, e = _span(data, "x::gaps")  # an explicit size: the ANS decoder sees the odd length
    _rejects(
        _restream(data, "x::gaps", data[s:e] + b"\0"),
        {"x": base["x"].clone()},
        PatchFormatError,
        "tensor 'x'",
        "multiple of 4",
    )
    # a table that promises more (or fewer) changes than the streams hold
    real = _encode(base, target)
    assert read_patch(real).header.tensors["x"].positions == "gaps"
    for d in (-1, 1):
        _rejects(
            _edit_entry(
                real,
                "x",
                lambda e, d=d: e["position_params"]["classes"][0].update(n=e["position_params"]["classes"][0]["n"] + d),
            ),
            _clone(base),
            PatchFormatError,
        )
    raw = _raw_patch(base, target)
    for wrong in (n - 1, n + 1):
        _rejects(
            _edit_entry(raw, "x", lambda e, w=wrong: e.update(n_changed=w)), _clone(base), PatchFormatError, "streams"
        )


def _small_patches() -> list[bytes]:
    base, target = _case()
    return [_golden_patch(), _encode(base, target), _raw_patch(base, target)]


def test_reject_every_truncation():
    for data in _small_patches():
        for cut in range(len(data)):
            with pytest.raises(PatchFormatError):
                read_patch(data[:cut])
        with pytest.raises(PatchFormatError, match="trailing bytes"):
            read_patch(data + b"\0")


@pytest.mark.parametrize("case", [_case, _classed_case], ids=["plain", "classed"])
def test_corrupt_bytes_are_rejected_or_undone_never_crash(case):
    """Flip every byte of a compressed patch's data section (and some of its header): apply
    either raises a sparsesync error leaving the tensors untouched, or yields the target."""
    base, target = case()
    data = _encode(base, target)
    n = header_length(data[:8])
    entries = read_patch(data).header.tensors.values()
    assert all((e.positions, e.values) == ("gaps", "delta") for e in entries)
    assert any(e.position_params["thresholds"] for e in entries) == (case is _classed_case)
    for pos in list(range(8 + n, len(data))) + list(range(0, 8 + n, 7)):
        bad = bytearray(data)
        bad[pos] ^= 0xA5
        work = _clone(base)
        try:
            apply_patch(read_patch(bytes(bad)), work)
        except SparsesyncError:
            assert_bit_equal(work, base)
        else:
            assert_bit_equal(work, target)


def test_reject_bad_header_json():
    base, target = _case()
    data = _encode(base, target)
    n = header_length(data[:8])
    for junk, needle in [
        (b"{" + b" " * (n - 1), "not UTF-8 JSON"),
        (b"\xff" * n, "not UTF-8 JSON"),
        (b"[]" + b" " * (n - 2), "expected an object"),
        (b"[" * n, "not UTF-8 JSON"),  # nesting deeper than the JSON parser's recursion limit
    ]:
        _rejects(data[:8] + junk + data[8 + n :], _clone(base), PatchFormatError, needle)
    # format 2's entries in a format 3 file
    _rejects(
        _edit_header(data, lambda h: h["__metadata__"].update(tensors="{}")),
        _clone(base),
        PatchFormatError,
        "metadata keys",
    )
    _rejects(
        _edit_header(data, lambda h: h.update(extra=h.pop("streams"))),
        _clone(base),
        PatchFormatError,
        "expected exactly 'table' then 'streams'",
    )
    swapped = _edit_header(data, lambda h: h.update(table=h["streams"], streams=h["table"]))
    _rejects(swapped, _clone(base), PatchFormatError, "expected exactly 'table' then 'streams'")


def test_reject_hostile_tables():
    """Every malformed table (zstd frame, counts, names, codes, shapes, models, sizes) is a
    PatchFormatError naming the field, found within bounded time and memory; nothing applied."""
    import time
    import tracemalloc

    base, target = _case()
    data = _encode(base, target)
    raw = _raw_patch(base, target)
    meta, rows, streams = _unpack(data)

    def edit_rows(d: bytes, fn) -> bytes:  # noqa: ANN001 - fn(rows) edits in place
        m, r, st = _unpack(d)
        fn(r)
        return _pack(m, r, st)

    def bytes_at(i: int, value: bytes):  # noqa: ANN202 - replaces inflated table bytes [i, i + len(value))
        return lambda t: t[:i] + value + t[i + len(value) :]

    # the raw patch's inflated table: count (byte 0); names "a" (00 01 61) and "x" (00 01 78) at 1-6;
    # dtypes at 7-8; shapes [40, 50] and [60, 70] at 9-14; encodings at 15-16; then n_changed, digests
    assert _table.inflate(
        raw[
            _span(raw, "a::indices")[0] - _container.parse_container(memoryview(raw))[1]["table"].nbytes : _span(
                raw, "a::indices"
            )[0]
        ]
    )[:17] == bytes.fromhex("020001610001780606022832023c460000")
    cases = [
        (_pack(meta, rows, streams, table=b"not zstd"), ("patch table", "not a zstd frame")),
        (
            _pack(meta, rows, streams, table=zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)),
            ("patch table", "unknown number of"),
        ),
        (
            _pack(
                meta,
                rows,
                streams,
                table=bytes.fromhex("28b52ffd") + bytes([0xE0]) + (1 << 40).to_bytes(8, "little") + bytes([1, 0, 0]),
            ),
            ("patch table", "declares 1099511627776 inflated bytes"),
        ),
        (_edit_table(data, lambda t: t + b"\0"), ("patch table", "1 bytes left after the last field")),
        (_edit_table(data, lambda t: t[:-1]), ("patch table", "ends inside target digests")),
        (_edit_table(data, bytes_at(0, b"\xff\xff\xff\x7f")), ("patch table", "declares 268435455 records")),
        (_edit_table(data, bytes_at(0, b"\x82\x00")), ("patch table", "overlong varint")),
        (_edit_table(raw, bytes_at(4, b"\x02")), ("patch table", "name 1: shared prefix length is over 1")),
        (_edit_table(raw, bytes_at(6, b"a")), ("patch table", "does not sort after name 0", "unique and sorted")),
        (_edit_table(raw, bytes_at(6, b"\xff")), ("patch table", "name 1 is not UTF-8")),
        (_edit_table(raw, bytes_at(5, b"\xff\xff\x7f")), ("patch table", "name 1: suffix length is over 65536")),
        (_edit_table(raw, bytes_at(8, b"\x63")), ("patch table", "tensor 'x': dtype code 99")),
        (_edit_table(raw, bytes_at(12, b"\x11")), ("patch table", "tensor 'x': 17 dims")),
        (_edit_table(raw, bytes_at(16, b"\x0f")), ("patch table", "tensor 'x': encoding code 0x0f")),
        (_edit_table(raw, bytes_at(16, b"\x20")), ("patch table", "tensor 'x': encoding code 0x20")),
        (
            edit_rows(
                data,
                lambda r: r[1].position_params.update(thresholds=[3, 2], classes=r[1].position_params["classes"] * 3),
            ),
            ("patch table", "tensor 'x': gaps thresholds [3, 2]"),
        ),
        (
            edit_rows(data, lambda r: r[1].position_params["classes"][0].update(k=49)),
            ("patch table", "tensor 'x': gaps k=49", "at most 48"),
        ),
        (
            edit_rows(data, lambda r: r[1].position_params["classes"][0].update(counts=[1] * 70)),
            ("patch table", "quotient model alphabet size 69"),
        ),
        (
            edit_rows(data, lambda r: r[1].position_params["classes"][0].update(counts=[1 << 14, 5, 0])),
            ("patch table", "frequencies sum to 16389"),
        ),
        (
            edit_rows(data, lambda r: r[1].value_params.update(counts=[[1 << 15, 0]])),
            ("patch table", "tensor 'x': delta model frequency is over 16384"),
        ),
        (
            edit_rows(data, lambda r: r[1].value_params.update(thresholds=[0], counts=[[1, 1]] * 2)),
            ("patch table", "tensor 'x': delta thresholds [0]"),
        ),
        (
            edit_rows(
                data,
                lambda r: r[1].position_params.update(
                    thresholds=list(range(1, 9)), classes=r[1].position_params["classes"] * 9
                ),
            ),
            ("patch table", "gaps thresholds [1, 2, 3, 4, 5, 6, 7, 8]"),
        ),
        (
            _pack(
                meta,
                rows,
                {**streams, "x": {**streams["x"], "gaps": streams["x"]["gaps"] + b"\0" * 4}},
                table=_table.build_table(rows),
            ),
            ("the table's streams cover",),
        ),
        (edit_rows(raw, lambda r: r[1].__dict__.update(n_changed=0)), ("tensor 'x'", "n_changed is 0")),
        (
            edit_rows(raw, lambda r: r[1].__dict__.update(n_changed=1 << 40)),
            ("tensor 'x'", "n_changed is 1099511627776"),
        ),
        (
            edit_rows(raw, lambda r: r[1].__dict__.update(shape=(1 << 30, 1 << 30))),
            ("patch table", "tensor 'x': shape", "more than 2^48 elements"),
        ),
        # a duplicate name
        (edit_rows(raw, lambda r: r[0].__dict__.update(name="x")), ("patch table", "does not sort after name 0")),
    ]
    for bad, needles in cases:
        tracemalloc.start()
        t0 = time.perf_counter()
        _rejects(bad, _clone(base), PatchFormatError, *needles)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert time.perf_counter() - t0 < 1.0 and peak < 16 << 20, (needles, peak)
    # explicit sizes past the streams tensor: the rows as written, one size made larger
    rows[1].sizes["gaps"] += 1 << 47
    table = _table.build_table(rows)
    blob = b"".join(streams[r.name][role] for r in rows for role in _table.ROLE_ORDER if role in streams[r.name])
    bad = _container.write_container(
        meta, [("table", "U8", (len(table),), table), ("streams", "U8", (len(blob),), blob)]
    )
    _rejects(bad, _clone(base), PatchFormatError, "tensor 'x'", "stream 'gaps' ends at byte 140737488")


def test_reject_header_length_beyond_file():
    data = _golden_patch()
    for declared in (len(data), len(data) - 8 - 1 + 2, 2**64 - 1):
        bad = struct.pack("<Q", declared) + data[8:]
        with pytest.raises(PatchFormatError, match="declared header length"):
            read_patch(bad)


def test_a_hostile_header_length_is_refused_before_it_sizes_a_read():
    """A follower reads a patch's header by range (`fetch_header`): a declared header length of
    2^62 bytes is refused from the first request's bytes, never asked for."""
    bad = struct.pack("<Q", 2**62) + _golden_patch()[8:]
    asked: list[int] = []

    def read_range(start: int, length: int) -> bytes:
        asked.append(length)
        return bad[start : start + length]

    with pytest.raises(PatchFormatError, match="declared header length"):
        fetch_header(read_range)
    assert asked == [HEADER_PREFIX]


def test_reject_data_offsets_outside_file():
    base, target = _case()
    data = _raw_patch(base, target)
    n_data = len(data) - 8 - header_length(data[:8])
    for offs, needle in [
        ([0, 10**12], f"within the {n_data}-byte data section"),
        ([n_data, n_data + 4], "within the"),
        ([8, 4], "expected [start, end]"),
        ([-4, 0], "data_offsets [-4, 0]"),
    ]:
        bad = _edit_header(data, lambda h, o=offs: h["streams"].update(data_offsets=o))
        _rejects(bad, _clone(base), PatchFormatError, "'streams'", needle)
    # the two tensors over the same bytes: they must tile the data section
    overlap = _edit_header(
        data, lambda h: h["table"].update(data_offsets=h["streams"]["data_offsets"], shape=h["streams"]["shape"])
    )
    _rejects(overlap, _clone(base), PatchFormatError, "tile")


def test_reject_huge_declared_sizes_quickly_without_allocating():
    import time
    import tracemalloc

    base, target = _case()
    data = _encode(base, target)
    raw = _raw_patch(base, target)
    ch = diff_state({"x": base["x"]}, {"x": target["x"]})["x"]
    bitmap = _forced(ch, base["x"], "bitmap", "raw", [])
    s, e = _span(bitmap, "x::bitmap")
    # declares 1 TiB
    bomb = bytes.fromhex("28b52ffd") + bytes([0xE0]) + (1 << 40).to_bytes(8, "little") + bytes([1, 0, 0])
    cases = [
        (
            _edit_header(raw, lambda h: h["streams"].update(shape=[2**40])),
            PatchFormatError,
            ("'streams'", "expected 1099511627776"),
        ),
        (
            _edit_header(raw, lambda h: h["streams"].update(shape=[2**30, 2**30])),
            PatchFormatError,
            ("'streams'", "more than"),
        ),
        (
            _edit_entry(raw, "x", lambda en: en.update(shape=(2**40,), positions="dense")),
            PatchFormatError,
            ("tensor 'x'", "stream 'values' ends at byte 21990232"),
        ),
        (
            _edit_entry(data, "x", lambda en: en.update(shape=(2**20, 2**20))),
            PatchMismatchError,
            ("tensor 'x'", "shape [60, 70]", "expected [1048576, 1048576]"),
        ),
        (_edit_entry(raw, "x", lambda en: en.update(n_changed=2**40)), PatchFormatError, ("tensor 'x'", "n_changed")),
        (
            _restream(bitmap, "x::bitmap", bomb),
            PatchFormatError,
            ("tensor 'x'", "declares 1099511627776 decompressed bytes", f"expected {(4200 + 7) // 8}"),
        ),
        (
            _restream(bitmap, "x::bitmap", zstandard.ZstdCompressor(write_content_size=False).compress(bitmap[s:e])),
            PatchFormatError,
            ("tensor 'x'", "decompressed bytes"),
        ),
        (
            _edit_entry(data, "x", lambda en: en["position_params"]["classes"][0].update(n=2**40)),
            PatchFormatError,
            ("tensor 'x'", "n_changed is 1099511627"),
        ),
    ]
    for bad, exc, needles in cases:
        tracemalloc.start()
        t0 = time.perf_counter()
        work = {"x": base["x"].clone()} if "decompressed" in str(needles) else _clone(base)
        _rejects(bad, work, exc, *needles)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert time.perf_counter() - t0 < 1.0 and peak < 16 << 20, (needles, peak)


def test_reject_wrong_stream_dtypes():
    base, target = _case()
    raw = _raw_patch(base, target)
    _rejects(
        _edit_header(raw, lambda h: h["table"].update(dtype="I8")),
        _clone(base),
        PatchFormatError,
        "'table' is I8",
        "expected U8",
    )
    _rejects(
        _edit_header(raw, lambda h: h["streams"].update(dtype="I8")),
        _clone(base),
        PatchFormatError,
        "'streams' I8",
        "expected U8",
    )
    _rejects(
        _edit_header(raw, lambda h: h["streams"].update(dtype="Q4")),
        _clone(base),
        PatchFormatError,
        "'streams'",
        "dtype 'Q4'",
    )


def test_reject_unknown_encodings():
    """Unknown codes in a format 3 table: test_reject_hostile_tables. A format 2 entry's are checked too."""
    d = Path(__file__).parents[1] / "data" / "format_v2"
    base = dict(st_load((d / "base.safetensors").read_bytes()))
    data = (d / "patch.safetensors").read_bytes()
    _rejects(
        _edit_v2_entry(data, "x", lambda e: e.update(positions="rle")),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "position encoding 'rle'",
        "'raw_i32'",
    )
    _rejects(
        _edit_v2_entry(data, "x", lambda e: e.update(values="xor")),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "value encoding 'xor'",
        "'delta'",
    )
    _rejects(
        _edit_v2_entry(data, "x", lambda e: e.update(dtype="F4")),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "dtype 'F4'",
    )
    _rejects(
        _edit_v2_entry(data, "x", lambda e: e.update(streams=5)),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "streams is 5",
    )
    _rejects(
        _edit_v2_entry(data, "x", lambda e: e.pop("base_digest")),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
        "entry fields",
    )
    _rejects(
        _edit_v2_entry(data, "x", lambda e: e.update(position_params={"thresholds": [3, 2], "classes": []})),
        _clone(base),
        PatchFormatError,
        "tensor 'x'",
    )


def _edit_v2_entry(data: bytes, name: str, fn) -> bytes:  # noqa: ANN001 - fn(format 2 JSON entry) edits in place
    def edit(h: dict) -> None:
        tensors = json.loads(h["__metadata__"]["tensors"])
        fn(tensors[name])
        h["__metadata__"]["tensors"] = json.dumps(tensors)

    return _edit_header(data, edit)


def test_reject_bad_encoding_parameters():
    """Well-formed but wrong models and class sizes: rejected or undone, never an uncaught exception."""
    base, target = _case()
    data = _encode(base, target)
    e = read_patch(data).header.tensors["x"]
    assert (e.positions, e.values) == ("gaps", "delta")
    # n_changed no longer matches the streams
    hostile_p = [{"thresholds": [], "classes": [{"n": 1, "k": 0, "counts": [1 << 14, 0]}]},
                 # every quotient escapes
                 {"thresholds": [], "classes": [{"n": e.n_changed, "k": 0, "counts": [1, (1 << 14) - 1]}]}]
    for p in hostile_p:
        _rejects(_edit_entry(data, "x", lambda en, p=p: en.update(position_params=p)), _clone(base), PatchFormatError)
    # no model; models the stream was not coded with
    for counts in ([[0, 0]], [[1, (1 << 14) - 1]], [[(1 << 14) - 1, 1]]):
        _rejects(
            _edit_entry(data, "x", lambda en, c=counts: en["value_params"].update(counts=c)),
            _clone(base),
            (PatchFormatError, DigestMismatchError),
        )


def test_reject_unknown_format_version():
    data = _golden_patch()
    base = {"w": torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16)}
    for v in ("6", "0", "3.0", "3 ", ""):
        bad = _edit_header(data, lambda h, v=v: h["__metadata__"].update(format_version=v))
        err = _rejects(bad, _clone(base), PatchFormatError, f"format_version {v!r}", "expected one of 1, 2, 3, 4, 5")
        assert "upgrade sparsesync" in err.hint
        with pytest.raises(PatchFormatError, match="format_version"):
            parse_header(bad[: header_span(bad)])
    _rejects(
        _edit_header(data, lambda h: h["__metadata__"].update(format="other")),
        _clone(base),
        PatchFormatError,
        "format 'other'",
        "'sparsesync.patch'",
    )
    _rejects(
        _edit_header(data, lambda h: h["__metadata__"].pop("base_version")),
        _clone(base),
        PatchFormatError,
        "metadata keys",
    )
    _rejects(
        _edit_header(data, lambda h: h["__metadata__"].update(base_version="9")),
        _clone(base),
        PatchFormatError,
        "base_version 9 >= target_version 8",
    )
