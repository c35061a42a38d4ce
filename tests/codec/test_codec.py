"""The codec end to end: bitwise diff, every encoding, golden bytes, round trips, anchors."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load

from sparsesync.codec import (
    Snapshot,
    apply_patch,
    compose_changes,
    decode_patch,
    diff_state,
    encode_changes,
    header_length,
    load_anchor,
    parse_header,
    read_patch,
    state_digest,
    tensor_digest,
    tensor_digests,
    verify_digests,
    write_anchor,
)
from sparsesync.codec import _container, _table
from sparsesync.codec import _encodings as E
from sparsesync.codec.diff import TensorChange, bits_view, np_uint_dtype, to_np_bits
from sparsesync.codec import patch as patch_module
from sparsesync.codec import snapshot as snapshot_module
from sparsesync.codec.patch import HEADER_PREFIX, EncodedTensor, assemble_patch, fetch_header, header_span
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError, SparsesyncError

DTYPES = [torch.bfloat16, torch.float16, torch.float32] + [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SPECIAL16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x8001, 0x7F7F]  # bf16: +-0, +-inf, NaNs, subnormals, max


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k


def make_pair(seed: int, dtype: torch.dtype, shape: tuple[int, ...], density: float, special: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.empty((), dtype=dtype).element_size()
    base = (torch.randn(shape, generator=g) * 0.02).to(dtype) if dtype.is_floating_point and w > 1 else torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    ib = bits(base).reshape(-1).clone()
    n = ib.numel()
    k = int(round(density * n))
    tgt = ib.clone()
    if k:
        idx = torch.randperm(n, generator=g)[:k]
        step = torch.randint(1, 4, (k,), generator=g) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
        if w == 1:
            tgt[idx] = (tgt[idx].to(torch.int32) + step).remainder(256).to(torch.uint8)
        else:
            tgt[idx] = (tgt[idx].to(torch.int64) + step).to(tgt.dtype)
        big = torch.rand(k, generator=g) < 0.05  # some large jumps (escapes)
        tgt[idx[big]] = torch.randint(0, 1 << min(8 * w - 1, 15), (int(big.sum()),), generator=g).to(tgt.dtype)
    if special and w == 2 and n:
        sp = torch.tensor([x - 65536 if x >= 32768 else x for x in SPECIAL16], dtype=torch.int16)
        m = min(n, sp.numel())
        ib[:m] = sp[:m]
        tgt[:m] = sp.roll(1)[:m]
    return ib.view(dtype).reshape(shape), tgt.view(dtype).reshape(shape)


def roundtrip(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *, with_base: bool = True) -> bytes:
    changes = diff_state(base, target)
    bd, td = tensor_digests(base), tensor_digests(target)
    data = encode_changes(
        changes, base_version=3, target_version=4, base_digests=bd, target_digests=td,
        base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base if with_base else None,
    )
    work = {k: v.clone() for k, v in base.items()}
    apply_patch(read_patch(data), work)
    assert_bit_equal(work, target)
    return data


# ---------------------------------------------------------------------------- diff
def test_diff_is_bitwise():
    b = torch.tensor([0.0, float("nan"), 1.0, -0.0, 2.0], dtype=torch.bfloat16)
    t = b.clone()
    t[0] = -0.0  # 0.0 -> -0.0 counts
    tb = bits(t)
    tb[1] = tb[1] | 1  # NaN payload change counts
    ch = diff_state({"x": b}, {"x": t})["x"]
    assert ch.indices.tolist() == [0, 1]
    assert diff_state({"x": b}, {"x": b.clone()}) == {}  # an unchanged NaN is unchanged


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_diff_matches_naive_for_any_chunking(dtype):
    b, t = make_pair(1, dtype, (37, 29), 0.2, special=True)
    naive = torch.nonzero(bits(b).reshape(-1) != bits(t).reshape(-1)).squeeze(1).numpy()
    for chunk in (8, 24, 1 << 20):
        ch = diff_state({"x": b}, {"x": t}, chunk_bytes=chunk)["x"]
        assert np.array_equal(ch.indices, naive)
        assert np.array_equal(ch.target_bits, to_np_bits(bits_view(t))[naive])
        assert np.array_equal(ch.base_bits, to_np_bits(bits_view(b))[naive])


def test_diff_of_non_contiguous_tensors():
    b, t = make_pair(4, torch.bfloat16, (48, 40), 0.1)
    bt, tt = b.t(), t.t()  # non-contiguous views
    naive = torch.nonzero(bits(bt).reshape(-1) != bits(tt).reshape(-1)).squeeze(1).numpy()
    ch = diff_state({"x": bt}, {"x": tt}, chunk_bytes=1000)["x"]
    assert np.array_equal(ch.indices, naive)


def test_encoding_is_deterministic_serial_or_threaded(monkeypatch):
    base, target = _classed_case()
    base = {**base, **{f"t{i}": make_pair(i, torch.bfloat16, (70, 90), 0.03)[0] for i in range(4)}}
    target = {**target, **{f"t{i}": make_pair(i, torch.bfloat16, (70, 90), 0.03)[1] for i in range(4)}}
    threaded = _encode(base, target)
    monkeypatch.setenv("SPARSESYNC_CODEC_THREADS", "1")
    assert _encode(base, target) == threaded


def test_diff_names_every_layout_difference():
    a = {"x": torch.zeros(3, dtype=torch.bfloat16), "y": torch.zeros(2), "z": torch.zeros(1)}
    b = {"x": torch.zeros(4, dtype=torch.bfloat16), "y": torch.zeros(2, dtype=torch.float16), "w": torch.zeros(1)}
    with pytest.raises(PatchMismatchError) as e:
        diff_state(a, b)
    for needle in ("'x'", "'y'", "'z'", "'w'", "shape (4,)", "float16"):
        assert needle in str(e.value)


def test_compose_changes_equals_direct_diff():
    b0, b1 = make_pair(2, torch.bfloat16, (64, 33), 0.1)
    _, b2 = make_pair(3, torch.bfloat16, (64, 33), 0.1)
    b2 = b2.clone()
    bits(b2).reshape(-1)[:50] = bits(b0).reshape(-1)[:50]  # some elements return to base
    c = compose_changes(diff_state({"x": b0}, {"x": b1}), diff_state({"x": b1}, {"x": b2}))
    d = diff_state({"x": b0}, {"x": b2})
    for f in ("indices", "base_bits", "target_bits"):
        assert np.array_equal(getattr(c["x"], f), getattr(d["x"], f))


# ---------------------------------------------------------------------------- round trips
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 70), min_size=0, max_size=3).map(tuple),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 1.0]) | st.floats(0, 1),
    special=st.booleans(),
    with_base=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_roundtrip_property(dtype, shape, density, special, with_base, seed):
    b, t = make_pair(seed, dtype, shape, density, special)
    b2, t2 = make_pair(seed + 1, torch.bfloat16, (5000,), density / 10, special)  # enough elements for class coding
    roundtrip({"a": b, "b": b2}, {"a": t, "b": t2}, with_base=with_base)


def test_empty_patch_roundtrip():
    b, _ = make_pair(0, torch.bfloat16, (10, 10), 0.0)
    data = roundtrip({"x": b}, {"x": b.clone()})
    assert read_patch(data).header.tensors == {}


def test_snapshot_chain_with_specials_and_all_dtypes():
    base = {f"t{i}": make_pair(i, d, (41, 13), 0.0, special=True)[0] for i, d in enumerate(DTYPES)}
    snap = Snapshot(base, 0)
    follower = {k: v.clone() for k, v in base.items()}
    state = base
    for v in range(1, 4):
        state = {k: make_pair(v * 10 + i, x.dtype, tuple(x.shape), 0.05 * v, special=True)[1] if False else _perturb(x, v) for i, (k, x) in enumerate(state.items())}
        p = snap.diff_encode(state, v)
        assert p.stats.n_changed == sum(c.n_changed for c in p.changes.values())
        apply_patch(read_patch(p.data), follower)
        assert_bit_equal(follower, state)
        assert p.target_state_digest == state_digest(tensor_digests(state)) == snap.state_digest


def test_snapshot_fused_and_phased_paths_write_the_same_patch():
    """Contiguous CPU tensors take the per-tensor fused path; a strided view takes the
    phase-by-phase one. Both give the same bytes and the same advanced snapshot."""
    base = {"a": make_pair(1, torch.bfloat16, (300, 70), 0.0)[0], "b": make_pair(2, torch.float32, (5000,), 0.0)[0], "c": make_pair(3, torch.float16, (9,), 0.0)[0]}
    target = {k: _perturb(v, i) for i, (k, v) in enumerate(base.items())}
    strided = {**target, "a": target["a"].t().contiguous().t()}
    assert not strided["a"].is_contiguous()
    fused, phased = Snapshot(base, 0), Snapshot(base, 0)
    p1, p2 = fused.diff_encode(target, 1), phased.diff_encode(strided, 1)
    assert p1.data == p2.data and fused.digests == phased.digests and fused.state_digest == phased.state_digest
    assert_bit_equal(fused.state, target)


def test_snapshot_left_as_it_was_when_one_tensor_fails_to_encode(monkeypatch):
    base = {f"t{i}": make_pair(i, torch.bfloat16, (64, 64 * (i + 1)), 0.0)[0] for i in range(4)}
    target = {k: _perturb(v, i) for i, (k, v) in enumerate(base.items())}
    snap = Snapshot(base, 0)
    before = (dict(snap.digests), snap.state_digest)
    real = snapshot_module.encode_tensor

    def failing(name, change, b=None, **kw):  # the fault: one tensor's encoder runs out of memory
        if name == "t1":
            raise MemoryError("injected")
        return real(name, change, b, **kw)

    monkeypatch.setattr(snapshot_module, "encode_tensor", failing)
    with pytest.raises(MemoryError):
        snap.diff_encode(target, 1)
    assert_bit_equal(snap.state, base)  # the tensors already advanced were put back
    assert (snap.digests, snap.state_digest, snap.version) == (*before, 0)
    monkeypatch.setattr(snapshot_module, "encode_tensor", real)
    follower = {k: v.clone() for k, v in base.items()}
    apply_patch(read_patch(snap.diff_encode(target, 1).data), follower)
    assert_bit_equal(follower, target)


def _perturb(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = bits(x).reshape(-1).clone()
    idx = torch.randperm(y.numel(), generator=g)[: max(1, y.numel() // 20)]
    y[idx] = y[idx] ^ 1
    return y.view(x.dtype).reshape(x.shape)


# ---------------------------------------------------------------------------- every encoding
def _forced(change: TensorChange, base: torch.Tensor, pos: str, val: str, thresholds: list[int]) -> bytes:
    st_name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[change.dtype]
    ctx = E.Ctx("x", st_name, np_uint_dtype(change.dtype), change.numel, change.n_changed, None)
    base_full = to_np_bits(bits_view(base))
    idx = change.indices
    if pos == "gaps":
        pp, ps = E._gaps_enc(idx, ctx, thresholds, change.base_bits, base_full)
    else:
        pp, ps = E.POSITIONS[pos][0](idx, ctx)
    if pos == "dense":
        tgt = base_full.copy()
        tgt[idx] = change.target_bits
        vp, vs = (E._delta_enc(base_full, tgt, ctx, thresholds) if val == "delta" else E._raw_val_enc(base_full, tgt, ctx))
    else:
        vp, vs = E._delta_enc(change.base_bits, change.target_bits, ctx, thresholds) if val == "delta" else E._raw_val_enc(change.base_bits, change.target_bits, ctx)
    enc = {"x": EncodedTensor(st_name, change.shape, change.n_changed, pos, pp, val, vp, {**ps, **vs})}
    d = tensor_digest(base)
    return assemble_patch(enc, base_version=0, target_version=1, base_digests={"x": d}, target_digests={"x": "0" * 16}, base_state_digest=d, target_state_digest=d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("pos", ["raw_i32", "raw_i64", "gaps", "gaps_classed", "bitmap", "dense"])
@pytest.mark.parametrize("val", ["raw", "delta", "delta_classed"])
def test_every_encoding_decodes(dtype, pos, val):
    b, t = make_pair(7, dtype, (50, 100), 0.08, special=True)
    ch = diff_state({"x": b}, {"x": t})["x"]
    thresholds = [118, 120] if "classed" in pos + val else []
    if pos == "gaps_classed" and val == "delta":
        thresholds = [119]
    data = _forced(ch, b, pos.replace("_classed", ""), val.replace("_classed", ""), thresholds)
    upd = decode_patch(read_patch(data), {"x": b})["x"]
    assert np.array_equal(upd.indices.numpy(), ch.indices)
    assert torch.equal(bits(upd.values), bits(t).reshape(-1)[ch.indices])


def test_encoder_picks_compact_encodings_for_realistic_deltas():
    g = torch.Generator().manual_seed(0)
    b = (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16)
    t = (b.float() - torch.randn(b.shape, generator=g).clamp(-1, 1) * 2e-5).to(torch.bfloat16)  # pure bf16 step
    data = roundtrip({"w": b}, {"w": t})
    e = read_patch(data).header.tensors["w"]
    assert (e.positions, e.values) == ("gaps", "delta") and e.position_params["thresholds"]
    assert e.nbytes / e.n_changed < 1.0


def test_effort_speed_leaves_out_the_class_codings_and_stays_bit_exact():
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16) for i in range(2)}
    target = {k: (b.float() - torch.randn(b.shape, generator=g).clamp(-1, 1) * 2e-5).to(torch.bfloat16) for k, b in base.items()}
    sizes = {}
    for effort in ("size", "speed"):
        snap = Snapshot(base, 0, effort=effort)
        data = snap.diff_encode(target, 1).data
        entries = read_patch(data).header.tensors.values()
        classed = [bool(e.position_params.get("thresholds") or e.value_params.get("thresholds")) for e in entries]
        assert all(classed) if effort == "size" else not any(classed)
        work = {k: v.clone() for k, v in base.items()}
        apply_patch(read_patch(data), work)
        assert_bit_equal(work, target)
        assert_bit_equal(snap.state, target)
        sizes[effort] = len(data)
    assert sizes["speed"] > sizes["size"]
    with pytest.raises(ValueError, match="effort='fast'"):
        Snapshot(base, 0, effort="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [50, 300, 2000, 5000])
def test_perfectly_predictable_changes_roundtrip(n):
    """A run of identical +1 steps: the ANS streams of gaps and deltas encode to zero bytes,
    and the file must still carry (empty) streams that decode."""
    b = torch.full((5000,), 0.02, dtype=torch.bfloat16)
    t = b.clone()
    bits(t)[:n] += 1
    for with_base in (True, False):
        data = roundtrip({"x": b}, {"x": t}, with_base=with_base)
        assert read_patch(data).nbytes < 1000


def test_patch_is_a_plain_safetensors_file():
    """safetensors' own loader opens a patch: two U8 tensors, the table, then every stream."""
    b, t = make_pair(1, torch.bfloat16, (16, 16), 0.02)
    data = roundtrip({"m.w": b}, {"m.w": t}, with_base=False)
    loaded = st_load(data)
    assert sorted(loaded) == ["streams", "table"] and {v.dtype for v in loaded.values()} == {torch.uint8}
    n = header_length(data[:8])
    assert loaded["table"].numpy().tobytes() + loaded["streams"].numpy().tobytes() == data[8 + n :]


def test_fixed_cost_per_touched_tensor_is_at_most_24_bytes():
    """400 touched tensors of one changed element each: the JSON header stays the same size as
    for one tensor, and the table (names, digests, dtypes, shapes, encodings, sizes) costs at
    most 24 B per tensor (docs/format.md, "The table")."""
    sizes = {}
    for k in (1, 400):
        base = {f"model.layers.{i}.mlp.w{j}": make_pair(i * 7 + j, torch.bfloat16, (32, 64), 0.0)[0] for i in range(k // 4 or 1) for j in range(4 if k > 1 else 1)}
        target = _clone(base)
        for name, x in target.items():
            bits(x).reshape(-1)[hash(name) % x.numel()] += 1
        data = _encode(base, target)
        meta, table = _container.parse_container(memoryview(data))
        sizes[k] = (header_length(data[:8]), table["table"].nbytes)
        assert len(read_patch(data).header.tensors) == k
    assert sizes[400][0] <= sizes[1][0] + 8  # a digit or two of the two sizes, within the padding
    assert sizes[400][1] <= 24 * 400, sizes


# ---------------------------------------------------------------------------- golden bytes
def _golden_patch() -> bytes:
    base = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 4, 5]] += torch.tensor([1, -1, 1], dtype=torch.int16)
    ch = diff_state({"w": base}, {"w": tgt})
    bd, td = tensor_digests({"w": base}), tensor_digests({"w": tgt})
    return encode_changes(ch, base_version=7, target_version=8, base_digests=bd, target_digests=td, base_state_digest=state_digest(bd), target_state_digest=state_digest(td))


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
    assert _table.inflate(data[t.start : t.end]) == bytes.fromhex("01" "000177" "06" "0108" "02" "03" "0a" "93f986fd2a495a43" "dc672ef92aa04fea")
    assert data[t.start : t.start + 4] == bytes.fromhex("28b52ffd")  # the table is one zstd frame
    # the zstd-framed bitmap 0b00110010 (elements 1, 4, 5), then bf16 -2.0+1ulp, 3.0-1ulp, -0.0+1ulp little-endian
    assert data[s.start :] == bytes.fromhex("28b52ffd200109000032" "01c03f400180")
    assert (len(data), xxhash.xxh3_64_hexdigest(data)) == GOLDEN


GOLDEN_HEADER = (
    '{"__metadata__":{"format":"sparsesync.patch","format_version":"3","base_version":"7","target_version":"8",'
    '"base_state_digest":"323480d7f4240df9","target_state_digest":"c268f5f00aa0fd73"},'
    '"table":{"dtype":"U8","shape":[35],"data_offsets":[0,35]},"streams":{"dtype":"U8","shape":[16],"data_offsets":[35,51]}}'
)


def test_golden_bytes_raw_form():
    base = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 3]] += 1
    ch = diff_state({"w": base}, {"w": tgt})["w"]
    data = _forced(ch, base, "raw_i32", "raw", [])
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
        (2, {("gaps", "delta"), ("dense", "delta"), ("bitmap", "delta"), ("bitmap", "raw")}, ("w::delta", 40)),  # rANS, JSON entries
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


# ---------------------------------------------------------------------------- anchors
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
        assert data[s:e] == b"".join(patch.stream(name, role) for role in _table.ROLE_ORDER if role in patch.header.tensors[name].streams)
    assert header.byte_ranges(["b"]) == {"b": ranges["b"]}
    with pytest.raises(ValueError, match="format 2"):
        read_patch((Path(__file__).parents[1] / "data" / "format_v2" / "patch.safetensors").read_bytes()).header.byte_ranges()


# ---------------------------------------------------------------------------- rejections
# Every test below forges a real safetensors patch (by editing bytes or the header), hands it
# to `read_patch` + `apply_patch`, and checks two things: the error names the tensor, the bad
# value and what was expected; and not one bit of any tensor changed (all-or-nothing).
def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _encode(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *, with_base: bool = True) -> bytes:
    bd, td = tensor_digests(base), tensor_digests(target)
    return encode_changes(
        diff_state(base, target), base_version=3, target_version=4, base_digests=bd, target_digests=td,
        base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base if with_base else None,
    )


def _case() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two tensors: 'a' (valid everywhere, sorted first: it would be written first) and 'x'
    (the one the tests break)."""
    ba, ta = make_pair(11, torch.bfloat16, (40, 50), 0.05)
    bx, tx = make_pair(12, torch.bfloat16, (60, 70), 0.05)
    return {"a": ba, "x": bx}, {"a": ta, "x": tx}


def _raw_patch(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *, short_values: str = "") -> bytes:
    """Every tensor as raw_i32 positions + raw values (the TRL/vLLM form), with true digests.
    `short_values` names a tensor whose values stream loses its last element."""
    enc = {}
    for name, ch in diff_state(base, target).items():
        st_name = _container.st_dtype_name(ch.dtype)
        vals = ch.target_bits[:-1] if name == short_values else ch.target_bits
        enc[name] = EncodedTensor(st_name, ch.shape, ch.n_changed, "raw_i32", {}, "raw", {}, {
            "indices": ("I32", (ch.n_changed,), ch.indices.astype("<i4").tobytes()),
            "values": (st_name, (vals.size,), vals.tobytes()),
        })
    bd, td = tensor_digests(base), tensor_digests(target)
    return assemble_patch(enc, base_version=3, target_version=4, base_digests=bd, target_digests=td, base_state_digest=state_digest(bd), target_state_digest=state_digest(td))


def _header(data: bytes) -> tuple[int, dict]:
    n = header_length(data[:8])
    return n, json.loads(data[8 : 8 + n])


def _span(data: bytes, key: str) -> tuple[int, int]:
    """Absolute byte range of stream `key` ('<tensor>::<role>') in the file."""
    s = read_patch(data)._streams[key]
    return s.start, s.end


def _unpack(data: bytes) -> tuple[dict, list[_table.Row], dict[str, dict[str, bytes]]]:
    """A format 3 patch as (metadata, table rows, tensor -> role -> stream bytes)."""
    patch = read_patch(data)
    meta, table = _container.parse_container(memoryview(data))
    t = table["table"]
    rows = _table.parse_table(_table.inflate(data[t.start : t.end]))
    return meta, rows, {n: {role: patch.stream(n, role) for role in e.streams} for n, e in patch.header.tensors.items()}


def _pack(meta: dict, rows: list[_table.Row], streams: dict[str, dict[str, bytes]], *, table: bytes | None = None) -> bytes:
    """The file of `_unpack`'s parts (explicit stream sizes taken from the streams' bytes), or
    with the compressed `table` given as is."""
    for r in rows:
        r.sizes = {role: len(streams[r.name][role]) for role in _table.explicit_roles(r.positions, r.position_params, r.values, r.value_params) if role in streams[r.name]}
    table = _table.build_table(rows) if table is None else table
    blob = b"".join(streams[r.name][role] for r in rows for role in _table.ROLE_ORDER if role in streams[r.name])
    return _container.write_container(meta, [("table", "U8", (len(table),), table), ("streams", "U8", (len(blob),), blob)])


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


def _edit_entry(data: bytes, name: str, fn) -> bytes:  # noqa: ANN001 - fn(vars of the tensor's table row) edits in place
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


def _rejects(data: bytes, tensors: dict[str, torch.Tensor], exc: type[Exception], *needles: str) -> Exception:
    """read + apply `data` raises `exc` whose message holds every needle; tensors keep every bit."""
    before = _clone(tensors)
    with pytest.raises(exc) as e:
        apply_patch(read_patch(data), tensors)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    assert_bit_equal(tensors, before)
    return e.value


def test_reject_wrong_shape():
    base, target = _case()
    work = _clone(base)
    work["x"] = work["x"].reshape(70, 60)
    err = _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "shape [70, 60]", "expected [60, 70]")
    assert "'a'" not in err.message  # only the bad tensor is named


def test_reject_wrong_dtype():
    base, target = _case()
    work = _clone(base)
    work["x"] = work["x"].to(torch.float16)
    _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "dtype F16", "expected BF16")


def test_reject_missing_tensor():
    base, target = _case()
    work = _clone(base)
    del work["x"]
    _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "missing", "expected BF16 [60, 70]")


def test_reject_non_contiguous_tensor():
    base, target = _case()
    work = _clone(base)
    work["x"] = torch.empty(70, 60, dtype=torch.bfloat16).t().copy_(base["x"])
    _rejects(_encode(base, target), work, PatchMismatchError, "tensor 'x'", "not contiguous", "`.contiguous()`")


def test_reject_wrong_base():
    base, target = _case()
    work = _clone(base)
    bits(work["x"]).reshape(-1)[5] ^= 1  # one bit away from the base
    _rejects(
        _encode(base, target), work, PatchMismatchError,
        "tensor 'x'", f"digest {tensor_digest(work['x'])}", f"expected {tensor_digest(base['x'])}", "not at base version 3",
    )
    _rejects(_encode(base, target), _clone(target), PatchMismatchError, "tensor 'a'", "tensor 'x'")  # applied twice


def test_wrong_base_is_reported_as_such_even_where_the_patch_cannot_decode_against_it():
    """Class-coded positions decode from the base's magnitudes: against other weights they may
    not decode at all. apply_patch hashes the base in its write pass, so it decodes first; it
    must still say the weights are not at the base (the fix), not that the patch is corrupt."""
    base, target = _classed_case()
    data = _encode(base, target)
    assert read_patch(data).header.tensors["w"].position_params["thresholds"], "the case needs class-coded positions"
    work = _clone(base)
    work["w"].zero_()  # every element in the lowest class: the other classes' ranks run past their members
    with pytest.raises(PatchFormatError):
        decode_patch(read_patch(data), work, check_base_digest=False)
    _rejects(data, work, PatchMismatchError, "tensor 'w'", "not at base version 3", "load version 3")


def test_a_ctrl_c_during_apply_is_raised_after_the_undo_never_between_versions():
    """Ctrl-C (SIGINT) while the codec's threads write a patch whose base check then fails (one
    bit of one tensor is off): the KeyboardInterrupt comes once every write is undone. Before, the
    waiting thread stopped at once while the pool went on writing, and no undo ran."""
    import signal
    import threading
    import time

    from sparsesync.codec import _parallel

    if _parallel.workers() == 1:
        pytest.skip("needs the codec's thread pool (one CPU here)")
    g = torch.Generator().manual_seed(1)
    base = {f"t{i}": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16) for i in range(6)}
    target = {k: (v.float() + torch.randn(v.shape, generator=g) * 1e-3).to(torch.bfloat16) for k, v in base.items()}
    data = _encode(base, target)

    class CtrlC(dict):  # a user's mapping; the first access from a codec thread sends SIGINT to the process
        fired = False

        def __getitem__(self, key):  # type: ignore[no-untyped-def]
            if not CtrlC.fired and threading.current_thread() is not threading.main_thread():
                CtrlC.fired = True
                signal.raise_signal(signal.SIGINT)
            return super().__getitem__(key)

    work = CtrlC(_clone(base))
    bits(work["t5"]).reshape(-1)[3] ^= 1  # not at the base: found in the write pass, after the writes
    before = _clone(dict(work))
    with pytest.raises(KeyboardInterrupt):
        apply_patch(read_patch(data), work)
    assert CtrlC.fired and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    time.sleep(0.5)  # the pool's threads, had they gone on writing
    assert_bit_equal(dict(work), before)


def test_light_items_share_one_task_and_results_and_errors_keep_input_order():
    """The codec's pools: items lighter than SMALL_ITEM (small tensors, whose work is mostly
    Python) run one after another on one thread; results come back in input order either way,
    and map_ordered raises the first failing item's error in input order."""
    import threading

    from sparsesync.codec import _parallel

    if _parallel.workers() == 1:
        pytest.skip("needs the codec's thread pool (one CPU here)")
    heavy = _parallel.SMALL_ITEM
    weights = [heavy if x % 3 == 0 else 10 for x in range(12)]  # 0, 3, 6, 9 heavy
    thread_of: dict[int, int] = {}

    def fn(x: int) -> object:
        thread_of[x] = threading.get_ident()
        if x in (7, 9):
            raise ValueError(f"item {x}")
        return KeyError("a result, not an error") if x == 4 else x * x

    got = _parallel.map_settled(fn, list(range(12)), weights=weights)
    assert [str(r) if isinstance(r, Exception) else r for r in got] == [0, 1, 4, 9, "'a result, not an error'", 25, 36, "item 7", 64, "item 9", 100, 121]
    assert len({thread_of[x] for x in range(12) if weights[x] < heavy}) == 1
    with pytest.raises(ValueError, match="item 7"):  # 7 (light) comes before 9 (heavy) in input order
        _parallel.map_ordered(fn, list(range(12)), weights=weights)
    ok = _parallel.map_ordered(fn, [1, 2, 4], weights=[1, 1, 1])
    assert ok[:2] == [1, 4] and isinstance(ok[2], KeyError)  # a returned exception is a result
    assert _parallel.map_ordered(lambda x: x + 1, list(range(50))) == list(range(1, 51))  # no weights: one task per item


def test_interrupts_deferred_holds_one_ctrl_c_to_the_end_and_a_second_stops_at_once():
    import signal

    from sparsesync.codec import interrupts_deferred

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
    assert reached == ["after the first"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
    assert reached == ["after the first"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_deferred():  # no Ctrl-C: nothing raised
        reached.append("quiet")
    assert reached[-1] == "quiet"


def test_reject_index_out_of_range():
    base, target = _case()
    data = _raw_patch(base, target)
    idx = _i32(data, "x::indices")
    idx[-1] = 4200  # numel of 'x' is 60 * 70 = 4200
    _rejects(_put_i32(data, "x::indices", idx), _clone(base), PatchFormatError, "tensor 'x'", "index 4200 out of range", "0 <= index < 4200")
    idx = _i32(data, "x::indices")
    idx[0] = -1
    _rejects(_put_i32(data, "x::indices", idx), _clone(base), PatchFormatError, "tensor 'x'", "index -1 out of range")


def test_reject_duplicate_and_unsorted_indices():
    base, target = _case()
    data = _raw_patch(base, target)
    idx = _i32(data, "x::indices")
    dup = idx.copy()
    dup[3] = dup[2]
    _rejects(_put_i32(data, "x::indices", dup), _clone(base), PatchFormatError, "tensor 'x'", f"not strictly increasing: {idx[2]} then {idx[2]}")
    swapped = idx.copy()
    swapped[[2, 3]] = swapped[[3, 2]]
    _rejects(_put_i32(data, "x::indices", swapped), _clone(base), PatchFormatError, "tensor 'x'", f"{idx[3]} then {idx[2]}")


def test_reject_stream_length_mismatch():
    base, target = _case()
    n = diff_state(base, target)["x"].n_changed
    # raw values sized by n_changed: one value short leaves the table's sizes past the streams
    _rejects(_raw_patch(base, target, short_values="x"), _clone(base), PatchFormatError, "tensor 'x'", "stream 'values' ends at byte")
    # a compressed stream one byte too long
    ch = diff_state({"x": base["x"]}, {"x": target["x"]})["x"]
    data = _forced(ch, base["x"], "gaps", "delta", [])
    s, e = _span(data, "x::gaps_low")  # its size follows from the classes' n and k: the streams tensor is then too long
    _rejects(_restream(data, "x::gaps_low", data[s:e] + b"\0"), {"x": base["x"].clone()}, PatchFormatError, "the table's streams cover", "the 'streams' tensor has")
    s, e = _span(data, "x::gaps")  # an explicit size: the ANS decoder sees the odd length
    _rejects(_restream(data, "x::gaps", data[s:e] + b"\0"), {"x": base["x"].clone()}, PatchFormatError, "tensor 'x'", "multiple of 4")
    # a table that promises more (or fewer) changes than the streams hold
    real = _encode(base, target)
    assert read_patch(real).header.tensors["x"].positions == "gaps"
    for d in (-1, 1):
        _rejects(_edit_entry(real, "x", lambda e, d=d: e["position_params"]["classes"][0].update(n=e["position_params"]["classes"][0]["n"] + d)), _clone(base), PatchFormatError)
    raw = _raw_patch(base, target)
    for wrong in (n - 1, n + 1):
        _rejects(_edit_entry(raw, "x", lambda e, w=wrong: e.update(n_changed=w)), _clone(base), PatchFormatError, "streams")


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


def _classed_case() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A pure-bf16 step: changes depend on the base magnitude, so the class-conditioned codes win."""
    g = torch.Generator().manual_seed(0)
    b = (torch.randn(64, 128, generator=g) * 0.02).to(torch.bfloat16)
    return {"w": b}, {"w": (b.float() - torch.randn(b.shape, generator=g).clamp(-1, 1) * 2e-5).to(torch.bfloat16)}


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
    _rejects(_edit_header(data, lambda h: h["__metadata__"].update(tensors="{}")), _clone(base), PatchFormatError, "metadata keys")  # format 2's entries in a format 3 file
    _rejects(_edit_header(data, lambda h: h.update(extra=h.pop("streams"))), _clone(base), PatchFormatError, "expected exactly 'table' then 'streams'")
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
    assert _table.inflate(raw[_span(raw, "a::indices")[0] - _container.parse_container(memoryview(raw))[1]["table"].nbytes : _span(raw, "a::indices")[0]])[:17] == bytes.fromhex("02" "000161" "000178" "0606" "022832" "023c46" "0000")
    cases = [
        (_pack(meta, rows, streams, table=b"not zstd"), ("patch table", "not a zstd frame")),
        (_pack(meta, rows, streams, table=zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)), ("patch table", "unknown number of")),
        (_pack(meta, rows, streams, table=bytes.fromhex("28b52ffd") + bytes([0xE0]) + (1 << 40).to_bytes(8, "little") + bytes([1, 0, 0])), ("patch table", "declares 1099511627776 inflated bytes")),
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
        (edit_rows(data, lambda r: r[1].position_params.update(thresholds=[3, 2], classes=r[1].position_params["classes"] * 3)), ("patch table", "tensor 'x': gaps thresholds [3, 2]")),
        (edit_rows(data, lambda r: r[1].position_params["classes"][0].update(k=49)), ("patch table", "tensor 'x': gaps k=49", "at most 48")),
        (edit_rows(data, lambda r: r[1].position_params["classes"][0].update(counts=[1] * 70)), ("patch table", "quotient model alphabet size 69")),
        (edit_rows(data, lambda r: r[1].position_params["classes"][0].update(counts=[1 << 14, 5, 0])), ("patch table", "frequencies sum to 16389")),
        (edit_rows(data, lambda r: r[1].value_params.update(counts=[[1 << 15, 0]])), ("patch table", "tensor 'x': delta model frequency is over 16384")),
        (edit_rows(data, lambda r: r[1].value_params.update(thresholds=[0], counts=[[1, 1]] * 2)), ("patch table", "tensor 'x': delta thresholds [0]")),
        (edit_rows(data, lambda r: r[1].position_params.update(thresholds=list(range(1, 9)), classes=r[1].position_params["classes"] * 9)), ("patch table", "gaps thresholds [1, 2, 3, 4, 5, 6, 7, 8]")),
        (_pack(meta, rows, {**streams, "x": {**streams["x"], "gaps": streams["x"]["gaps"] + b"\0" * 4}}, table=_table.build_table(rows)), ("the table's streams cover",)),
        (edit_rows(raw, lambda r: r[1].__dict__.update(n_changed=0)), ("tensor 'x'", "n_changed is 0")),
        (edit_rows(raw, lambda r: r[1].__dict__.update(n_changed=1 << 40)), ("tensor 'x'", "n_changed is 1099511627776")),
        (edit_rows(raw, lambda r: r[1].__dict__.update(shape=(1 << 30, 1 << 30))), ("patch table", "tensor 'x': shape", "more than 2^48 elements")),
        (edit_rows(raw, lambda r: r[0].__dict__.update(name="x")), ("patch table", "does not sort after name 0")),  # a duplicate name
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
    bad = _container.write_container(meta, [("table", "U8", (len(table),), table), ("streams", "U8", (len(blob),), blob)])
    _rejects(bad, _clone(base), PatchFormatError, "tensor 'x'", "stream 'gaps' ends at byte 140737488")


def test_reject_header_length_beyond_file():
    data = _golden_patch()
    for declared in (len(data), len(data) - 8 - 1 + 2, 2**64 - 1):
        bad = struct.pack("<Q", declared) + data[8:]
        with pytest.raises(PatchFormatError, match="declared header length"):
            read_patch(bad)


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
    overlap = _edit_header(data, lambda h: h["table"].update(data_offsets=h["streams"]["data_offsets"], shape=h["streams"]["shape"]))
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
    bomb = bytes.fromhex("28b52ffd") + bytes([0xE0]) + (1 << 40).to_bytes(8, "little") + bytes([1, 0, 0])  # declares 1 TiB
    cases = [
        (_edit_header(raw, lambda h: h["streams"].update(shape=[2**40])), PatchFormatError, ("'streams'", "expected 1099511627776")),
        (_edit_header(raw, lambda h: h["streams"].update(shape=[2**30, 2**30])), PatchFormatError, ("'streams'", "more than")),
        (_edit_entry(raw, "x", lambda en: en.update(shape=(2**40,), positions="dense")), PatchFormatError, ("tensor 'x'", "stream 'values' ends at byte 21990232")),
        (_edit_entry(data, "x", lambda en: en.update(shape=(2**20, 2**20))), PatchMismatchError, ("tensor 'x'", "shape [60, 70]", "expected [1048576, 1048576]")),
        (_edit_entry(raw, "x", lambda en: en.update(n_changed=2**40)), PatchFormatError, ("tensor 'x'", "n_changed")),
        (_restream(bitmap, "x::bitmap", bomb), PatchFormatError, ("tensor 'x'", "declares 1099511627776 decompressed bytes", f"expected {(4200 + 7) // 8}")),
        (_restream(bitmap, "x::bitmap", zstandard.ZstdCompressor(write_content_size=False).compress(bitmap[s:e])), PatchFormatError, ("tensor 'x'", "decompressed bytes")),
        (_edit_entry(data, "x", lambda en: en["position_params"]["classes"][0].update(n=2**40)), PatchFormatError, ("tensor 'x'", "n_changed is 1099511627")),
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
    _rejects(_edit_header(raw, lambda h: h["table"].update(dtype="I8")), _clone(base), PatchFormatError, "'table' is I8", "expected U8")
    _rejects(_edit_header(raw, lambda h: h["streams"].update(dtype="I8")), _clone(base), PatchFormatError, "'streams' I8", "expected U8")
    _rejects(_edit_header(raw, lambda h: h["streams"].update(dtype="Q4")), _clone(base), PatchFormatError, "'streams'", "dtype 'Q4'")


def test_reject_unknown_encodings():
    """Unknown codes in a format 3 table: test_reject_hostile_tables. A format 2 entry's are checked too."""
    d = Path(__file__).parents[1] / "data" / "format_v2"
    base = dict(st_load((d / "base.safetensors").read_bytes()))
    data = (d / "patch.safetensors").read_bytes()
    _rejects(_edit_v2_entry(data, "x", lambda e: e.update(positions="rle")), _clone(base), PatchFormatError, "tensor 'x'", "position encoding 'rle'", "'raw_i32'")
    _rejects(_edit_v2_entry(data, "x", lambda e: e.update(values="xor")), _clone(base), PatchFormatError, "tensor 'x'", "value encoding 'xor'", "'delta'")
    _rejects(_edit_v2_entry(data, "x", lambda e: e.update(dtype="F4")), _clone(base), PatchFormatError, "tensor 'x'", "dtype 'F4'")
    _rejects(_edit_v2_entry(data, "x", lambda e: e.update(streams=5)), _clone(base), PatchFormatError, "tensor 'x'", "streams is 5")
    _rejects(_edit_v2_entry(data, "x", lambda e: e.pop("base_digest")), _clone(base), PatchFormatError, "tensor 'x'", "entry fields")
    _rejects(_edit_v2_entry(data, "x", lambda e: e.update(position_params={"thresholds": [3, 2], "classes": []})), _clone(base), PatchFormatError, "tensor 'x'")


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
    hostile_p = [{"thresholds": [], "classes": [{"n": 1, "k": 0, "counts": [1 << 14, 0]}]},  # n_changed no longer matches the streams
                 {"thresholds": [], "classes": [{"n": e.n_changed, "k": 0, "counts": [1, (1 << 14) - 1]}]}]  # every quotient escapes
    for p in hostile_p:
        _rejects(_edit_entry(data, "x", lambda en, p=p: en.update(position_params=p)), _clone(base), PatchFormatError)
    for counts in ([[0, 0]], [[1, (1 << 14) - 1]], [[(1 << 14) - 1, 1]]):  # no model; models the stream was not coded with
        _rejects(_edit_entry(data, "x", lambda en, c=counts: en["value_params"].update(counts=c)), _clone(base), (PatchFormatError, DigestMismatchError))


def test_reject_unknown_format_version():
    data = _golden_patch()
    base = {"w": torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16)}
    for v in ("4", "0", "3.0", "3 ", ""):
        bad = _edit_header(data, lambda h, v=v: h["__metadata__"].update(format_version=v))
        err = _rejects(bad, _clone(base), PatchFormatError, f"format_version {v!r}", "expected one of 1, 2, 3")
        assert "upgrade sparsesync" in err.hint
        with pytest.raises(PatchFormatError, match="format_version"):
            parse_header(bad[: header_span(bad)])
    _rejects(_edit_header(data, lambda h: h["__metadata__"].update(format="other")), _clone(base), PatchFormatError, "format 'other'", "'sparsesync.patch'")
    _rejects(_edit_header(data, lambda h: h["__metadata__"].pop("base_version")), _clone(base), PatchFormatError, "metadata keys")
    _rejects(_edit_header(data, lambda h: h["__metadata__"].update(base_version="9")), _clone(base), PatchFormatError, "base_version 9 >= target_version 8")


def test_skipping_the_base_check_still_rejects_a_wrong_base():
    # a holder that vouches for its base (check_base_digest=False) gets the same guarantee from
    # the target digests: a drifted element is caught after writing and every bit is restored
    base, target = _case()
    data = _encode(base, target)
    work = _clone(base)
    same = np.flatnonzero(bits(base["x"]).reshape(-1).numpy() == bits(target["x"]).reshape(-1).numpy())
    bits(work["x"]).reshape(-1)[int(same[0])] ^= 1  # drifted where the patch writes nothing
    before = _clone(work)
    with pytest.raises(DigestMismatchError, match="tensor 'x'.*expected " + tensor_digest(target["x"])):
        apply_patch(read_patch(data), work, check_base_digest=False)
    assert_bit_equal(work, before)
    work = _clone(base)
    apply_patch(read_patch(data), work, check_base_digest=False)
    assert_bit_equal(work, target)
    with pytest.raises(ValueError, match="verify=True or check_base_digest=True"):
        apply_patch(read_patch(data), _clone(base), verify=False, check_base_digest=False)


def test_target_digest_is_verified_after_apply():
    base, target = _case()
    data = _raw_patch(base, target)
    s, _ = _span(data, "x::values")
    bad = data[:s] + bytes([data[s] ^ 1]) + data[s + 1 :]  # one value bit off: decodes, lands, wrong target
    work = _clone(base)
    err = _rejects(bad, work, DigestMismatchError, "tensor 'x'", f"expected {tensor_digest(target['x'])}", "(undone)")
    assert "'a'" not in err.message
    apply_patch(read_patch(bad), work, verify=False)  # without verification it lands ...
    assert torch.equal(bits(work["a"]), bits(target["a"])) and not torch.equal(bits(work["x"]), bits(target["x"]))
    with pytest.raises(DigestMismatchError, match="tensor 'x': digest [0-9a-f]{16}, expected " + tensor_digest(target["x"])):
        verify_digests(work, {n: e.target_digest for n, e in read_patch(bad).header.tensors.items()})  # ... and a later check catches it
    work = _clone(base)
    apply_patch(read_patch(data), work)
    assert_bit_equal(work, target)
    verify_digests(work, tensor_digests(target))



@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs CPU affinity and 2 CPUs")
def test_codec_threads_follow_the_cpu_affinity():
    """A process pinned to one core (taskset, a container's cpuset) runs the codec on one thread,
    not one per CPU of the machine fighting over that core."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from sparsesync.codec import _parallel; print(_parallel.workers())")
    env = {k: v for k, v in os.environ.items() if k != "SPARSESYNC_CODEC_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr[-2000:]


@pytest.mark.parametrize("numel", [0, 1, 1000, (2 << 20) // 2, 3 * (1 << 20) + 17])
def test_put_and_digest_writes_like_put_bits_and_hashes_like_tensor_digest(numel):
    """The digest of the written tensor, hashed block by block in the same pass as the writes
    (blocks of 2 MiB: the larger sizes cross block edges), equals tensor_digest of the result;
    the overwritten bits are saved."""
    from sparsesync.codec.diff import put_bits
    from sparsesync.codec.digest import put_and_digest, put_and_digests

    rng = np.random.default_rng(numel)
    t = torch.empty(numel, dtype=torch.bfloat16)
    to_np_bits(bits_view(t))[:] = rng.integers(0, 1 << 16, numel, dtype=np.uint16)
    want = t.clone()
    idx = np.sort(rng.choice(numel, min(numel, 5000), replace=False)).astype(np.int64) if numel else np.zeros(0, np.int64)
    vals = rng.integers(0, 1 << 16, idx.size, dtype=np.uint16)
    put_bits(to_np_bits(bits_view(want)), idx, vals)
    old = np.empty(idx.size, np.uint16)
    before = to_np_bits(bits_view(t)).copy()
    digest = put_and_digest(to_np_bits(bits_view(t)), idx, vals, old)
    assert torch.equal(t.view(torch.int16), want.view(torch.int16))
    assert digest == tensor_digest(want)
    assert np.array_equal(old, before[idx])
    # and with the digest of the bytes before the writes, hashed in the same pass
    t1 = torch.empty(numel, dtype=torch.bfloat16)
    to_np_bits(bits_view(t1))[:] = before
    want_before = tensor_digest(t1)
    old1 = np.empty(idx.size, np.uint16)
    assert put_and_digests(to_np_bits(bits_view(t1)), idx, vals, old1) == (want_before, tensor_digest(want))
    assert torch.equal(t1.view(torch.int16), want.view(torch.int16)) and np.array_equal(old1, before[idx])
    if idx.size > 1:  # unsorted: every write still done once (the digest may not match; callers check it)
        t2 = torch.empty(numel, dtype=torch.bfloat16)
        to_np_bits(bits_view(t2))[:] = before
        put_and_digest(to_np_bits(bits_view(t2)), idx[::-1].copy(), vals[::-1].copy())
        assert torch.equal(t2.view(torch.int16), want.view(torch.int16))
    with pytest.raises(IndexError):
        put_and_digest(to_np_bits(bits_view(t)), np.array([numel], np.int64), np.zeros(1, np.uint16))
