"""Encode then apply gives the target bit for bit: a property test over dtypes, shapes and densities,
the empty patch, and Snapshot chains (specials, fused and phased paths, a failed encode left undone)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsesync.codec import (
    Snapshot,
    apply_patch,
    read_patch,
    state_digest,
    tensor_digests,
)
from sparsesync.codec import _flat_group as flat_group_module
from sparsesync.codec import snapshot as snapshot_module
from tests.support.patches import DTYPES, assert_bit_equal, bits, make_pair, roundtrip


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
        state = {
            k: make_pair(v * 10 + i, x.dtype, tuple(x.shape), 0.05 * v, special=True)[1] if False else _perturb(x, v)
            for i, (k, x) in enumerate(state.items())
        }
        p = snap.diff_encode(state, v)
        assert p.stats.n_changed == sum(c.n_changed for c in p.changes.values())
        apply_patch(read_patch(p.data), follower)
        assert_bit_equal(follower, state)
        assert p.target_state_digest == state_digest(tensor_digests(state)) == snap.state_digest


def test_snapshot_fused_and_phased_paths_write_the_same_patch():
    """Contiguous CPU tensors take the per-tensor fused path; a strided view takes the
    phase-by-phase one. Both give the same bytes and the same advanced snapshot."""
    base = {
        "a": make_pair(1, torch.bfloat16, (300, 70), 0.0)[0],
        "b": make_pair(2, torch.float32, (5000,), 0.0)[0],
        "c": make_pair(3, torch.float16, (9,), 0.0)[0],
    }
    target = {k: _perturb(v, i) for i, (k, v) in enumerate(base.items())}
    strided = {**target, "a": target["a"].t().contiguous().t()}
    assert not strided["a"].is_contiguous()
    fused, phased = Snapshot(base, 0), Snapshot(base, 0)
    p1, p2 = fused.diff_encode(target, 1), phased.diff_encode(strided, 1)
    assert p1.data == p2.data and fused.digests == phased.digests and fused.state_digest == phased.state_digest
    assert_bit_equal(fused.state, target)


@pytest.mark.parametrize("grouped", [False, True])
def test_snapshot_left_as_it_was_when_one_tensor_fails_to_encode(monkeypatch, grouped):
    # grouped: t0..t3 are small (one group, coded as one tensor named by its first member), "big"
    # is coded alone and advanced before the group's encoder fails
    shape = (lambda i: (64, 64 * (i + 1))) if grouped else (lambda i: (600, 512 * (i + 1)))
    base = {f"t{i}": make_pair(i, torch.bfloat16, shape(i), 0.0)[0] for i in range(4)}
    if grouped:
        base["big"] = make_pair(9, torch.bfloat16, (600, 512), 0.0)[0]
    target = {k: _perturb(v, i) for i, (k, v) in enumerate(base.items())}
    snap = Snapshot(base, 0)
    before = (dict(snap.digests), snap.state_digest)
    module = flat_group_module if grouped else snapshot_module
    real = module.encode_tensor

    def failing(name, change, b=None, **kw):  # the fault: one tensor's encoder runs out of memory
        if name == ("t0" if grouped else "t1"):
            raise MemoryError("injected")
        return real(name, change, b, **kw)

    monkeypatch.setattr(module, "encode_tensor", failing)
    with pytest.raises(MemoryError):
        snap.diff_encode(target, 1)
    assert_bit_equal(snap.state, base)  # the tensors already advanced were put back
    assert (snap.digests, snap.state_digest, snap.version) == (*before, 0)
    monkeypatch.setattr(module, "encode_tensor", real)
    follower = {k: v.clone() for k, v in base.items()}
    data = snap.diff_encode(target, 1).data
    assert len(read_patch(data).header.groups) == grouped
    apply_patch(read_patch(data), follower)
    assert_bit_equal(follower, target)


def _perturb(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = bits(x).reshape(-1).clone()
    idx = torch.randperm(y.numel(), generator=g)[: max(1, y.numel() // 20)]
    y[idx] = y[idx] ^ 1
    return y.view(x.dtype).reshape(x.shape)
