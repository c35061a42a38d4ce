"""Anchors (full-state files, sharded or not): round trip, corruption and missing shards detected;
headers and parts of a version read by range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparsesync.codec import (
    _table,
    header_length,
    load_anchor,
    parse_header,
    read_patch,
    state_digest,
    tensor_digests,
    write_anchor,
)
from sparsesync.codec import patch_reader as patch_module
from sparsesync.codec.patch_reader import HEADER_PREFIX, fetch_header, header_span
from sparsesync.errors import DigestMismatchError, PatchFormatError
from tests.support.patches import _case, _encode, _golden_patch, assert_bit_equal, make_pair


@pytest.mark.parametrize("max_shard", [1 << 30, 3000])
def test_anchor_roundtrip(tmp_path, max_shard):
    state = {f"layer{i}.w": make_pair(i, torch.bfloat16, (30, 40), 0.0, special=True)[0] for i in range(4)}
    files = write_anchor(state, tmp_path, version=5, max_shard_bytes=max_shard)
    assert (len(files) == 1) == (max_shard > 10000)
    loaded, info = load_anchor(files)
    assert_bit_equal(loaded, state)
    assert info.version == 5 and info.state_digest == state_digest(tensor_digests(state))


def test_anchor_corruption_is_detected(tmp_path):
    state = {"w": make_pair(0, torch.bfloat16, (30, 40), 0.0)[0]}
    (f,) = write_anchor(state, tmp_path, version=1)
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(DigestMismatchError, match="'w'"):
        load_anchor([f])
    f.write_bytes(bytes(raw[:100]))
    with pytest.raises(PatchFormatError):
        load_anchor([f])


def test_anchor_missing_shard(tmp_path):
    state = {f"l{i}": torch.zeros(1000, dtype=torch.bfloat16) for i in range(3)}
    files = write_anchor(state, tmp_path, version=2, max_shard_bytes=2000)
    with pytest.raises(PatchFormatError, match="weight_map"):
        load_anchor([files[0], files[-1]])


def test_parse_header_from_range_reads(monkeypatch):
    data = _golden_patch()
    n = header_length(data[:8])
    assert header_span(data[:8]) == 8 + n  # the JSON header first ...
    span = header_span(data[: 8 + n])  # ... which says where the table ends
    assert parse_header(data[:span]) == read_patch(data).header
    with pytest.raises(PatchFormatError, match="table"):
        parse_header(data[: span - 1])
    v2 = (Path(__file__).parents[1] / "data" / "format_v2" / "patch.safetensors").read_bytes()
    assert parse_header(v2[: header_span(v2)]) == read_patch(v2).header  # formats 1 and 2: the JSON header alone
    calls = []

    def reader(d: bytes):  # noqa: ANN202
        def read_range(start: int, length: int) -> bytes:
            calls.append((start, length))
            return d[start : start + length]

        return read_range

    base, target = _case()
    for d in (data, _encode(base, target), v2):
        calls.clear()
        assert fetch_header(reader(d)) == read_patch(d).header
        assert calls == [(0, HEADER_PREFIX)]  # one range request
    monkeypatch.setattr(patch_module, "HEADER_PREFIX", 16)  # a header + table larger than the first request
    calls.clear()
    assert fetch_header(reader(data)) == read_patch(data).header
    assert calls == [(0, 16), (16, 8 + n - 16), (8 + n, span - 8 - n)]


def test_a_part_of_a_version_is_read_by_range():
    """From the header and table alone (one range request), each tensor's streams are one byte
    range, and a run of consecutive tensors too: what a follower holding part of a model fetches."""
    base, target = _case()
    base["b"], target["b"] = make_pair(13, torch.float32, (30, 30), 0.3)
    data = _encode(base, target)
    header = fetch_header(lambda start, length: data[start : start + length])
    patch = read_patch(data)
    ranges = header.byte_ranges()
    assert list(ranges) == ["a", "b", "x"] and ranges["a"][1] == ranges["b"][0] and ranges["x"][1] == len(data)
    for name, (s, e) in ranges.items():
        assert data[s:e] == b"".join(
            patch.stream(name, role) for role in _table.ROLE_ORDER if role in patch.header.tensors[name].streams
        )
    assert header.byte_ranges(["b"]) == {"b": ranges["b"]}
    with pytest.raises(ValueError, match="format 2"):
        read_patch(
            (Path(__file__).parents[1] / "data" / "format_v2" / "patch.safetensors").read_bytes()
        ).header.byte_ranges()
