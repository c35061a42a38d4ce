"""Many small tensors at the cost of few (issue 51): a group's members hashed in one native call
(`members_blocks`; read and written: tests/codec/test_group_members.py), digest checks of a whole
version in one pass (`all_blocks`), group names prefix-coded without a Python step per byte; and a budget of
Python calls per member for encode, read and apply, which fails when per-member Python comes
back on any of them."""

from __future__ import annotations

import cProfile
import dataclasses
import pstats

import numpy as np
import pytest
import torch

from sparsesync.codec import _groups, _native, apply_patch, read_patch, state_digest
from sparsesync.codec.blocks_digest import BLOCK, digest_bytes, digests_many
from sparsesync.codec.digest import all_blocks
from sparsesync.codec.snapshot import Snapshot
from sparsesync.errors import DigestMismatchError

READ_BUDGET = 4  # measured 1.6 (26.6 with a Python step per member field, 34.5 with a numpy product and a slice too)
SIZES = [0, 1, 7, BLOCK // 2, BLOCK // 2 + 1, 3 * BLOCK // 2 + 3, 40_000]  # uint16 elements


def _bufs(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=n, dtype=np.uint16) for n in SIZES]


def test_members_blocks_equal_each_buffers_own_digest():
    bufs = _bufs()
    assert digests_many(bufs) == [digest_bytes(b) for b in bufs]


def test_members_blocks_reject_a_wrong_output_size():
    with pytest.raises(ValueError, match="8 per 65536-byte block"):
        _native.members_blocks([np.zeros(BLOCK + 1, np.uint8)], np.zeros(1, np.uint64))
    with pytest.raises(TypeError, match="list"):
        _native.members_blocks((np.zeros(1, np.uint8),), np.zeros(1, np.uint64))


def test_all_blocks_checks_each_digest_not_just_their_concatenation():
    d = "xxh3b:0123456789abcdef"
    assert all_blocks([d, d]) and all_blocks([])
    assert all_blocks([d + "x", d[1:]]) is False  # end to end they read as two digests, but neither is one
    assert not all_blocks([d, "0123456789abcdef"]) and not all_blocks([d, d.upper()]) and not all_blocks([d, 5])


def test_state_digest_is_the_hash_of_the_sorted_lines_and_refuses_mixed_algorithms():
    import xxhash

    digests = {"b": "xxh3b:0123456789abcdef", "a": "xxh3b:fedcba9876543210"}
    h = xxhash.xxh3_64()
    for n in sorted(digests):
        h.update(f"{n}\0{digests[n]}\n".encode())
    assert state_digest(digests) == "xxh3b:" + h.hexdigest()
    with pytest.raises(ValueError, match="mix|one algorithm"):
        state_digest({**digests, "c": "0123456789abcdef"})


def test_shared_prefix_is_the_longest_common_prefix():
    rng = np.random.default_rng(6)
    for _ in range(3000):
        a, b = (bytes(rng.choice([97, 98], size=rng.integers(0, 9)).tolist()) for _ in range(2))
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        assert _groups._shared_prefix(a, b) == k, (a, b)


def _calls(fn):
    pr = cProfile.Profile()
    pr.enable()
    try:
        r = fn()
    finally:
        pr.disable()
    return r, pstats.Stats(pr).total_calls


def test_a_version_of_400_small_tensors_costs_few_python_calls_per_tensor():
    """Encode and apply of a version touching 400 small tensors (one group) stay within a budget
    of Python calls per tensor (measured: 55 and 45; before issue 51's native group passes, 100
    and 97), and the result is still bit-exact and checked."""
    g = torch.Generator().manual_seed(0)
    st = {f"m.{i:03d}.weight": torch.randn(4, 64, generator=g).to(torch.bfloat16) for i in range(400)}
    snap, replica = Snapshot(st, 0), {k: v.clone() for k, v in st.items()}
    cur = {k: (v.float() + 1).to(torch.bfloat16) for k, v in st.items()}
    patch, n_enc = _calls(lambda: snap.diff_encode(cur, 1))
    parsed, n_read = _calls(lambda: read_patch(patch.data))
    assert len(parsed.header.groups) == 1
    _, n_apply = _calls(lambda: apply_patch(parsed, replica))
    assert all(torch.equal(replica[k], cur[k]) for k in cur)
    # encode measured 23.3 once the members were diffed in place (tests/codec/test_members_diff.py)
    assert n_enc / 400 <= 26, f"diff_encode made {n_enc} Python calls for 400 small tensors"
    assert n_read / 400 <= READ_BUDGET, f"read_patch made {n_read} Python calls for 400 small tensors"
    # apply measured 4.6 (41.7 with a numpy view, a result tuple and three slices per member, at 8021c27)
    assert n_apply / 400 <= 8, f"apply_patch made {n_apply} Python calls for 400 small tensors"


def test_a_grouped_apply_that_misses_a_target_digest_is_undone():
    g = torch.Generator().manual_seed(1)
    st = {f"m.{i:03d}.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16) for i in range(20)}
    snap, replica = Snapshot(st, 0), {k: v.clone() for k, v in st.items()}
    cur = {k: (v.float() * 1.5).to(torch.bfloat16) for k, v in st.items()}
    parsed = read_patch(snap.diff_encode(cur, 1).data)
    first = parsed.header.groups[0].members[3]
    e = parsed.header.tensors[first]
    parsed.header.tensors[first] = dataclasses.replace(e, target_digest="xxh3b:" + "0" * 16)
    with pytest.raises(DigestMismatchError, match=first):
        apply_patch(parsed, replica)
    assert all(torch.equal(replica[k], st[k]) for k in st)  # every member back at the base


def _adapter_layout() -> dict[str, tuple[int, int]]:
    """r=16 LoRA on the seven linear layers of 28 decoder layers of a Qwen3-0.6B-shaped model:
    392 tensors, 10.1M parameters (benchmarks/small_tensors.py's state)."""
    shapes = {"q": (2048, 1024), "k": (1024, 1024), "v": (1024, 1024), "o": (1024, 2048),
              "gate": (3072, 1024), "up": (3072, 1024), "down": (1024, 3072)}
    out = {}
    for layer in range(28):
        for m, (o, i) in shapes.items():
            out[f"model.layers.{layer:02d}.{m}.la.weight"] = (16, i)
            out[f"model.layers.{layer:02d}.{m}.lb.weight"] = (o, 16)
    return out


def test_an_adapter_sized_version_costs_few_python_calls_per_tensor():
    """A whole LoRA adapter (392 tensors, 10.1M parameters) is coded in a handful of groups, not
    one per 256K elements (40 groups, each with its own coding, tables and Python calls: issue 51
    measured 2x the encode and apply time): encode and apply stay within a budget of Python calls
    per tensor, and the result is bit-exact."""
    g = torch.Generator().manual_seed(0)
    st = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in _adapter_layout().items()}
    snap, replica = Snapshot(st, 0), {k: v.clone() for k, v in st.items()}
    cur = {}
    for k, v in st.items():
        u = v.clone()
        u.view(-1)[:: 97] = (u.view(-1)[:: 97].float() * 1.01 + 1e-3).to(torch.bfloat16)
        cur[k] = u
    patch, n_enc = _calls(lambda: snap.diff_encode(cur, 1))
    parsed, n_read = _calls(lambda: read_patch(patch.data))
    _, n_apply = _calls(lambda: apply_patch(parsed, replica))
    assert all(torch.equal(replica[k], cur[k]) for k in cur)
    assert len(parsed.header.groups) <= 12
    # measured 41, 29 and 7.1 per tensor (57, 50 and 8.6 in 40 groups); read and apply 3.5 and 3.5 since the
    # members are read in one native call and written through their addresses (apply's pool threads: not counted
    # here, tests/codec/test_group_members.py counts them)
    # encode measured 18.2 once the members were diffed in place (every thread's calls: test_members_diff.py);
    # with groups of 2^20 elements (10, not 5): encode, read and apply 20.6, 7.4 and 4.3
    assert n_enc / len(st) <= 24, f"diff_encode made {n_enc} Python calls for {len(st)} small tensors"
    assert n_read / len(st) <= 9, f"read_patch made {n_read} Python calls for {len(st)} small tensors"
    assert n_apply / len(st) <= 5, f"apply_patch made {n_apply} Python calls for {len(st)} small tensors"
