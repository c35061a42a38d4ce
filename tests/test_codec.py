"""The codec end to end: bitwise diff, every encoding, golden bytes, round trips, anchors."""

from __future__ import annotations

import json
import struct
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
from sparsesync.codec import _container
from sparsesync.codec import _encodings as E
from sparsesync.codec.diff import TensorChange, bits_view, np_uint_dtype, to_np_bits
from sparsesync.codec.patch import EncodedTensor, assemble_patch
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
    assert meta["format"] == "sparsesync.patch" and meta["format_version"] == "2"
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


GOLDEN = (640, "58ab88c91a764d75")
GOLDEN_RAW = (636, "2a0c0b2a3a0f66ca")


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


def test_format_1_patches_still_apply():
    """A patch written by format 1's encoder (constriction's ANS; tests/data/format_v1) applies bit-exactly."""
    from safetensors.torch import load_file

    d = Path(__file__).parent / "data" / "format_v1"
    base, target = load_file(d / "base.safetensors"), load_file(d / "target.safetensors")
    patch = read_patch(d / "patch.safetensors")
    assert patch.header.format_version == 1
    assert {(e.positions, e.values) for e in patch.header.tensors.values()} == {("gaps", "delta"), ("dense", "delta")}
    assert any(e.position_params.get("thresholds") for e in patch.header.tensors.values())
    work = _clone(base)
    apply_patch(patch, work)
    assert_bit_equal(work, target)
    s, e = _span(patch.data, "w::gaps")  # a flipped word in a format 1 stream is still caught
    bad = bytearray(patch.data)
    bad[s + 2] ^= 0x10
    with pytest.raises(SparsesyncError):
        apply_patch(read_patch(bytes(bad)), _clone(base))


def test_format_2_patches_still_apply():
    """A patch written by format 2's encoder (tests/data/format_v2, written before format 3; its
    recipe is make_fixture.py there) applies bit-exactly: classed gaps, rANS deltas, bitmap, dense."""
    from safetensors.torch import load_file

    d = Path(__file__).parent / "data" / "format_v2"
    base, target = load_file(d / "base.safetensors"), load_file(d / "target.safetensors")
    data = (d / "patch.safetensors").read_bytes()
    assert xxhash.xxh3_64_hexdigest(data) == "89a90bda3f91c5a4"
    patch = read_patch(data)
    assert patch.header.format_version == 2
    assert {(e.positions, e.values) for e in patch.header.tensors.values()} == {("gaps", "delta"), ("dense", "delta"), ("bitmap", "delta"), ("bitmap", "raw")}
    assert any(e.position_params.get("thresholds") for e in patch.header.tensors.values())
    work = _clone(base)
    apply_patch(patch, work)
    assert_bit_equal(work, target)
    s, e = _span(patch.data, "w::delta")  # a flipped byte in a format 2 stream is still caught
    bad = bytearray(patch.data)
    bad[s + 40] ^= 0x10
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


def test_parse_header_from_range_reads():
    data = _golden_patch()
    n = header_length(data[:8])
    assert parse_header(data[8 : 8 + n]) == read_patch(data).header


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
    """Absolute byte range of stream `key` in the file."""
    n, h = _header(data)
    s, e = h[key]["data_offsets"]
    return 8 + n + s, 8 + n + e


def _edit_header(data: bytes, fn) -> bytes:  # noqa: ANN001 - fn(header dict) edits in place
    n, h = _header(data)
    fn(h)
    hb = json.dumps(h, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data[8 + n :]


def _edit_entry(data: bytes, name: str, fn) -> bytes:  # noqa: ANN001 - fn(entry dict) edits in place
    def edit(h: dict) -> None:
        tensors = json.loads(h["__metadata__"]["tensors"])
        fn(tensors[name])
        h["__metadata__"]["tensors"] = json.dumps(tensors)

    return _edit_header(data, edit)


def _restream(data: bytes, key: str, new: bytes) -> bytes:
    """The same patch with stream `key` (a 1-D stream) replaced by `new` (container rebuilt)."""
    meta, table = _container.parse_container(memoryview(data))
    streams = []
    for k, s in table.items():
        raw = data[s.start : s.end] if k != key else new
        size = _container.ST_DTYPES[s.dtype][1]
        streams.append((k, s.dtype, s.shape if k != key else (len(new) // size,), raw))
    return _container.write_container(meta, streams)


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
    _rejects(_raw_patch(base, target, short_values="x"), _clone(base), PatchFormatError, "x::values", f"BF16 [{n - 1}]", f"expected BF16 [{n}]")
    # a compressed stream one byte too long
    ch = diff_state({"x": base["x"]}, {"x": target["x"]})["x"]
    data = _forced(ch, base["x"], "gaps", "delta", [])
    s, e = _span(data, "x::gaps_low")
    _rejects(_restream(data, "x::gaps_low", data[s:e] + b"\0"), {"x": base["x"].clone()}, PatchFormatError, "tensor 'x'", f"'gaps_low' has {e - s + 1} bytes, expected {e - s}")
    s, e = _span(data, "x::gaps")
    _rejects(_restream(data, "x::gaps", data[s:e] + b"\0"), {"x": base["x"].clone()}, PatchFormatError, "tensor 'x'", "multiple of 4")
    # a header that promises more (or fewer) changes than the streams hold
    real = _encode(base, target)
    for wrong in (n - 1, n + 1):
        _rejects(_edit_entry(real, "x", lambda e, w=wrong: e.update(n_changed=w)), _clone(base), PatchFormatError, "tensor 'x'")


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
    deep = _edit_header(data, lambda h: h["__metadata__"].update(tensors="[" * 100_000))
    _rejects(deep, _clone(base), PatchFormatError, "metadata tensors is not JSON")
    huge_int = _edit_header(data, lambda h: h["__metadata__"].update(tensors='{"x": ' + "9" * 5000 + "}"))
    _rejects(huge_int, _clone(base), PatchFormatError, "metadata tensors is not JSON")
    _rejects(_edit_header(data, lambda h: h["__metadata__"].update(tensors="[1]")), _clone(base), PatchFormatError, "expected an object")
    _rejects(_edit_entry(data, "x", lambda e: e.update(streams=5)), _clone(base), PatchFormatError, "tensor 'x'", "streams is 5")
    _rejects(_edit_entry(data, "x", lambda e: e.pop("base_digest")), _clone(base), PatchFormatError, "tensor 'x'", "entry fields")


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
        bad = _edit_header(data, lambda h, o=offs: h["x::values"].update(data_offsets=o))
        _rejects(bad, _clone(base), PatchFormatError, "x::values", needle)
    # two streams over the same bytes: streams must tile the data section
    overlap = _edit_header(data, lambda h: h["a::values"].update(data_offsets=h["x::values"]["data_offsets"], shape=h["x::values"]["shape"]))
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
        (_edit_header(raw, lambda h: h["x::values"].update(shape=[2**40])), PatchFormatError, ("x::values", "expected 2199023255552")),
        (_edit_header(raw, lambda h: h["x::values"].update(shape=[2**30, 2**30])), PatchFormatError, ("x::values", "more than")),
        (_edit_entry(raw, "x", lambda en: en.update(shape=[2**40], positions="dense", streams={"values": "x::values"})), PatchFormatError, ("tensor 'x'", "expected BF16 [1099511627776]")),
        (_edit_entry(data, "x", lambda en: en.update(shape=[2**20, 2**20])), PatchMismatchError, ("tensor 'x'", "shape [60, 70]", "expected [1048576, 1048576]")),
        (_edit_entry(data, "x", lambda en: en.update(shape=[2**60])), PatchFormatError, ("tensor 'x'", "expected at most")),
        (_edit_entry(data, "x", lambda en: en.update(n_changed=2**40)), PatchFormatError, ("tensor 'x'", "n_changed")),
        (_restream(bitmap, "x::bitmap", bomb), PatchFormatError, ("tensor 'x'", "declares 1099511627776 decompressed bytes", f"expected {(4200 + 7) // 8}")),
        (_restream(bitmap, "x::bitmap", zstandard.ZstdCompressor(write_content_size=False).compress(bitmap[s:e])), PatchFormatError, ("tensor 'x'", "decompressed bytes")),
    ]
    if read_patch(data).header.tensors["x"].positions == "gaps":
        cases.append((
            _edit_entry(data, "x", lambda en: en["position_params"]["classes"][0].update(n=2**40)), PatchFormatError, ("tensor 'x'", "n=1099511627776"),
        ))
    for bad, exc, needles in cases:
        tracemalloc.start()
        t0 = time.perf_counter()
        work = {"x": base["x"].clone()} if bad is bitmap or "bitmap" in str(needles) else _clone(base)
        _rejects(bad, work, exc, *needles)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert time.perf_counter() - t0 < 1.0 and peak < 16 << 20, (needles, peak)


def test_reject_wrong_stream_dtypes():
    base, target = _case()
    raw = _raw_patch(base, target)
    n = diff_state(base, target)["x"].n_changed
    _rejects(_edit_header(raw, lambda h: h["x::indices"].update(dtype="F32")), _clone(base), PatchFormatError, "x::indices", f"is F32 [{n}]", f"expected I32 [{n}]")
    _rejects(_edit_header(raw, lambda h: h["x::values"].update(dtype="F16")), _clone(base), PatchFormatError, "x::values", "is F16", "expected BF16")
    _rejects(_edit_header(raw, lambda h: h["x::values"].update(dtype="Q4")), _clone(base), PatchFormatError, "x::values", "dtype 'Q4'")
    data = _encode(base, target)
    key = next(k for k in read_patch(data).header.tensors["x"].streams.values())
    _rejects(_edit_header(data, lambda h: h[key].update(dtype="I8")), _clone(base), PatchFormatError, key, "is I8", "expected U8")


def test_reject_unknown_encodings():
    base, target = _case()
    data = _encode(base, target)
    _rejects(_edit_entry(data, "x", lambda e: e.update(positions="rle")), _clone(base), PatchFormatError, "tensor 'x'", "position encoding 'rle'", "'raw_i32'")
    _rejects(_edit_entry(data, "x", lambda e: e.update(values="xor")), _clone(base), PatchFormatError, "tensor 'x'", "value encoding 'xor'", "'delta'")
    _rejects(_edit_entry(data, "x", lambda e: e.update(dtype="F4")), _clone(base), PatchFormatError, "tensor 'x'", "dtype 'F4'")


def test_reject_bad_encoding_parameters():
    """Hostile parameters of the compressed encodings: rejected, never an uncaught exception."""
    base, target = _case()
    data = _encode(base, target)
    e = read_patch(data).header.tensors["x"]
    assert (e.positions, e.values) == ("gaps", "delta")
    hostile = [{}, None, [], 5, "x", {"thresholds": [], "classes": [{"n": 1, "k": 0, "counts": []}]}, {"thresholds": [3, 2], "classes": []},
               {"thresholds": [], "classes": [{"n": 1, "k": 99, "counts": [1, 1]}]}, {"thresholds": [], "classes": [{"n": 1, "k": 0, "counts": ""}]},
               {"thresholds": [], "classes": [{"n": 1, "k": 0, "counts": [1, -1]}]}, {"thresholds": [], "classes": [5]}]
    for p in hostile:
        _rejects(_edit_entry(data, "x", lambda en, p=p: en.update(position_params=p)), _clone(base), PatchFormatError, "tensor 'x'")
        _rejects(_edit_entry(data, "x", lambda en, p=p: en.update(value_params=p)), _clone(base), PatchFormatError, "tensor 'x'")
    _rejects(_edit_entry(data, "x", lambda en: en["value_params"].update(counts=[[1, 0]] * 9)), _clone(base), PatchFormatError, "tensor 'x'")


def test_reject_unknown_format_version():
    data = _golden_patch()
    base = {"w": torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16)}
    for v in ("3", "0", "1.0", "2 ", ""):
        bad = _edit_header(data, lambda h, v=v: h["__metadata__"].update(format_version=v))
        err = _rejects(bad, _clone(base), PatchFormatError, f"format_version {v!r}", "expected one of 1, 2")
        assert "upgrade sparsesync" in err.hint
        with pytest.raises(PatchFormatError, match="format_version"):
            parse_header(bad[8 : 8 + header_length(bad[:8])])
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

