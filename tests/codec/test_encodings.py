"""Every position x value encoding decodes; the encoder picks compact ones; the patch is a plain
safetensors file with a small fixed cost per touched tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from sparsesync.codec import (
    Snapshot,
    _container,
    apply_patch,
    decode_patch,
    diff_state,
    header_length,
    read_patch,
)
from tests.support.patches import _clone, _encode, _forced, assert_bit_equal, bits, make_pair, roundtrip


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
    target = {
        k: (b.float() - torch.randn(b.shape, generator=g).clamp(-1, 1) * 2e-5).to(torch.bfloat16)
        for k, b in base.items()
    }
    sizes = {}
    for effort in ("size", "speed"):
        snap = Snapshot(base, 0, effort=effort)
        data = snap.diff_encode(target, 1).data
        h = read_patch(data).header
        # the two are one group (format 4)
        entries = [e for e in h.tensors.values() if e.positions != "group"] + [g.coding for g in h.groups]
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
        base = {
            f"model.layers.{i}.mlp.w{j}": make_pair(i * 7 + j, torch.bfloat16, (32, 64), 0.0)[0]
            for i in range(k // 4 or 1)
            for j in range(4 if k > 1 else 1)
        }
        target = _clone(base)
        for name, x in target.items():
            bits(x).reshape(-1)[hash(name) % x.numel()] += 1
        data = _encode(base, target)
        meta, table = _container.parse_container(memoryview(data))
        sizes[k] = (header_length(data[:8]), table["table"].nbytes)
        assert len(read_patch(data).header.tensors) == k
    assert sizes[400][0] <= sizes[1][0] + 8  # a digit or two of the two sizes, within the padding
    assert sizes[400][1] <= 24 * 400, sizes
