"""The codec end to end: bitwise diff, every encoding, golden bytes, round trips, anchors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xxhash
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
    write_anchor,
)
from sparsesync.codec import _encodings as E
from sparsesync.codec.diff import TensorChange, bits_view, np_uint_dtype, to_np_bits
from sparsesync.codec.patch import EncodedTensor, assemble_patch
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError

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


def test_interop_raw_streams_are_plain_int32_and_dtype():
    b, t = make_pair(1, torch.bfloat16, (16, 16), 0.02)
    data = roundtrip({"m.w": b}, {"m.w": t}, with_base=False)
    loaded = st_load(data)
    e = read_patch(data).header.tensors["m.w"]
    if e.positions == "raw_i32":
        assert loaded["m.w::indices"].dtype == torch.int32
    if e.values == "raw":
        assert loaded["m.w::values"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------- golden bytes
def _golden_patch() -> bytes:
    base = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 4, 5]] += torch.tensor([1, -1, 1], dtype=torch.int16)
    ch = diff_state({"w": base}, {"w": tgt})
    bd, td = tensor_digests({"w": base}), tensor_digests({"w": tgt})
    return encode_changes(ch, base_version=7, target_version=8, base_digests=bd, target_digests=td, base_state_digest=state_digest(bd), target_state_digest=state_digest(td))


def test_golden_bytes_pin_the_format():
    data = _golden_patch()
    n = header_length(data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    assert meta["format"] == "sparsesync.patch" and meta["format_version"] == "1"
    assert (meta["base_version"], meta["target_version"]) == ("7", "8")
    entry = json.loads(meta["tensors"])["w"]
    assert (entry["positions"], entry["values"], entry["n_changed"]) == ("bitmap", "raw", 3)
    assert header["w::values"] == {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}
    # bf16 -2.0+1ulp, 3.0-1ulp, -0.0+1ulp little-endian, then the zstd-framed bitmap 0b00110010
    assert data[8 + n :] == bytes.fromhex("01c03f400180" "28b52ffd200109000032")
    assert (len(data), xxhash.xxh3_64_hexdigest(data)) == GOLDEN


def test_golden_bytes_raw_interop_form():
    base = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 3]] += 1
    ch = diff_state({"w": base}, {"w": tgt})["w"]
    data = _forced(ch, base, "raw_i32", "raw", [])
    n = header_length(data[:8])
    assert data[8 + n :] == bytes.fromhex("01000000" "03000000" "01c0" "0100")
    assert (len(data), xxhash.xxh3_64_hexdigest(data)) == GOLDEN_RAW


GOLDEN = (640, "261bf33defb75a75")
GOLDEN_RAW = (636, "8ea0d392426a61d5")


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


def test_parse_header_from_range_reads():
    data = _golden_patch()
    n = header_length(data[:8])
    assert parse_header(data[8 : 8 + n]) == read_patch(data).header
