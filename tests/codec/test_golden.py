"""Golden bytes pin the patch format (docs/format.md), and patches of the older formats
(tests/data/format_v1, format_v2) still apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash

from sparsesync.codec import (
    _container,
    _table,
    apply_patch,
    decode_patch,
    diff_state,
    header_length,
    read_patch,
)
from sparsesync.errors import SparsesyncError
from tests.support.patches import _clone, _forced, _golden_patch, _span, assert_bit_equal, bits


def test_golden_bytes_pin_the_format():
    """The worked example of docs/format.md, byte for byte."""
    data = _golden_patch()
    n = header_length(data[:8])
    assert data[8 : 8 + n] == GOLDEN_HEADER.encode() + b" " * 6
    meta, table = _container.parse_container(memoryview(data))
    t, s = table["table"], table["streams"]
    assert (t.start, t.end, s.end) == (8 + n, 8 + n + 35, len(data))
    # count 1; name "w" (shared 0, 1 byte); dtype 6 = BF16; shape [8]; positions bitmap (2) | values raw (0 << 4);
    # n_changed 3; bitmap 10 B; base digest 435a492afd86f993, target digest ea4fa02af92e67dc (u64 little-endian)
    assert _table.inflate(data[t.start : t.end]) == bytes.fromhex(
        "0100017706010802030a93f986fd2a495a43dc672ef92aa04fea"
    )
    assert data[t.start : t.start + 4] == bytes.fromhex("28b52ffd")  # the table is one zstd frame
    # the zstd-framed bitmap 0b00110010 (elements 1, 4, 5), then bf16 -2.0+1ulp, 3.0-1ulp, -0.0+1ulp little-endian
    assert data[s.start :] == bytes.fromhex("28b52ffd200109000032" "01c03f400180")
    assert (len(data), xxhash.xxh3_64_hexdigest(data)) == GOLDEN


GOLDEN_HEADER = (
    '{"__metadata__":{"format":"sparsesync.patch","format_version":"3","base_version":"7","target_version":"8",'
    '"base_state_digest":"323480d7f4240df9","target_state_digest":"c268f5f00aa0fd73"},'
    '"table":{"dtype":"U8","shape":[35],"data_offsets":[0,35]},'
    '"streams":{"dtype":"U8","shape":[16],"data_offsets":[35,51]}}'
)


def test_golden_bytes_raw_form():
    base = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 3]] += 1
    ch = diff_state({"w": base}, {"w": tgt})["w"]
    data = _forced(ch, base, "raw_i32", "raw", [], algo="xxh3")  # format 3, as pinned
    meta, table = _container.parse_container(memoryview(data))
    t, s = table["table"], table["streams"]
    # positions raw_i32 (0) | values raw: n_changed 2, no explicit sizes (8 B of indices, 4 B of values follow from it)
    assert _table.inflate(data[t.start : t.end])[:9] == bytes.fromhex("01" "000178" "06" "0104" "00" "02")
    assert data[s.start :] == bytes.fromhex("01000000" "03000000" "01c0" "0100")
    assert (len(data), xxhash.xxh3_64_hexdigest(data)) == GOLDEN_RAW


GOLDEN = (371, "61d9b4c1a7b9abd7")


GOLDEN_RAW = (366, "924c0dacbd7b5961")


def test_golden_bytes_entropy_coded_streams():
    """Pins format 2's rANS streams (`gaps` and `delta`): 4 states then the words."""
    base = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25] * 4, dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 4, 5, 9, 10, 17, 30]] += torch.tensor([1, -1, 1, 1, 2, -1, 1], dtype=torch.int16)
    ch = diff_state({"w": base}, {"w": tgt})["w"]
    data = _forced(ch, base, "gaps", "delta", [])
    patch = read_patch(data)
    assert patch.stream("x", "gaps").hex() == GOLDEN_GAPS
    assert patch.stream("x", "delta").hex() == GOLDEN_DELTA
    upd = decode_patch(patch, {"x": base})["x"]
    assert torch.equal(bits(upd.values), bits(tgt)[ch.indices])


GOLDEN_GAPS = "609bd4fa0000000068a295e6040000008cab95e60400000050a82eb300000000"  # 7 symbols: 4 states, no words yet


GOLDEN_DELTA = "9bb6432006000000108018200600000082b2f087010000009fa4fbdf00000000"


@pytest.mark.parametrize(
    "version, encodings, flip",
    [
        (1, {("gaps", "delta"), ("dense", "delta")}, ("w::gaps", 2)),  # constriction's ANS
        # rANS, JSON entries
        (2, {("gaps", "delta"), ("dense", "delta"), ("bitmap", "delta"), ("bitmap", "raw")}, ("w::delta", 40)),
    ],
)
def test_older_format_patches_still_apply(version, encodings, flip):
    """Patches written by the format 1 and format 2 encoders (tests/data/format_v1, format_v2; the
    latter written before format 3 by the recipe make_fixture.py there) apply bit-exactly, and a
    flipped byte in a coded stream is still caught."""
    from safetensors.torch import load_file

    d = Path(__file__).parents[1] / "data" / f"format_v{version}"
    base, target = load_file(d / "base.safetensors"), load_file(d / "target.safetensors")
    data = (d / "patch.safetensors").read_bytes()
    assert version == 1 or xxhash.xxh3_64_hexdigest(data) == "89a90bda3f91c5a4"  # today's bytes of format 2
    patch = read_patch(data)
    assert patch.header.format_version == version
    assert {(e.positions, e.values) for e in patch.header.tensors.values()} == encodings
    assert any(e.position_params.get("thresholds") for e in patch.header.tensors.values())
    work = _clone(base)
    apply_patch(patch, work)
    assert_bit_equal(work, target)
    s, _ = _span(patch.data, flip[0])
    bad = bytearray(patch.data)
    bad[s + flip[1]] ^= 0x10
    with pytest.raises(SparsesyncError):
        apply_patch(read_patch(bytes(bad)), _clone(base))
