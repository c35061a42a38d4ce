"""Many small tensors at the cost of few (issue 51): a group's members hashed and written in one
native call each (`members_blocks`, `members_put`), digest checks of a whole version in one
pass (`all_blocks`), group names prefix-coded without a Python step per byte; and a budget of
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
from sparsesync.codec._group_write import write_group
from sparsesync.codec.blocks_digest import BLOCK, combine_many, digest_bytes, digests_many, n_blocks
from sparsesync.codec.digest import LEGACY_ALGO, all_blocks, put_and_digests, tensor_digest
from sparsesync.codec.snapshot import Snapshot
from sparsesync.errors import DigestMismatchError

READ_BUDGET = 28  # measured 24.5 (34.5 with a numpy product and a slice per member)
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


def _members_put(dsts, idx, vals, *, hashes=True):
    offsets = np.zeros(len(dsts) + 1, dtype=np.int64)
    np.cumsum([d.size for d in dsts], out=offsets[1:])
    nblk = sum(n_blocks(d.nbytes) for d in dsts)
    old = np.empty_like(vals)
    before = np.empty(nblk if hashes else 0, np.uint64)
    after = np.empty(nblk if hashes else 0, np.uint64)
    _native.members_put(dsts, 2, idx, offsets, vals, old, before, after)
    return old, before, after, offsets


def test_members_put_writes_and_hashes_like_put_and_digests_member_by_member():
    dsts, want_dsts = _bufs(1), _bufs(1)
    total = sum(d.size for d in dsts)
    rng = np.random.default_rng(2)
    idx = np.unique(rng.integers(0, total, size=total // 50)).astype(np.int64)
    vals = rng.integers(0, 1 << 16, size=idx.size, dtype=np.uint16)
    old, before, after, offsets = _members_put(dsts, idx, vals)
    nbytes = [d.nbytes for d in dsts]
    want_before, want_after, want_old = [], [], []
    for i, d in enumerate(want_dsts):
        sel = (idx >= offsets[i]) & (idx < offsets[i + 1])
        o = np.empty(int(sel.sum()), np.uint16)
        b, a = put_and_digests(d, idx[sel] - offsets[i], vals[sel], o)
        want_before.append(b)
        want_after.append(a)
        want_old.append(o)
    assert all(np.array_equal(a, b) for a, b in zip(dsts, want_dsts))
    assert np.array_equal(old, np.concatenate(want_old))
    assert combine_many(before, nbytes) == want_before
    assert combine_many(after, nbytes) == want_after


@pytest.mark.parametrize("bad", ["unsorted", "repeated", "out of range", "negative"])
def test_members_put_checks_every_index_before_the_first_write(bad):
    dsts = _bufs(3)
    copies = [d.copy() for d in dsts]
    total = sum(d.size for d in dsts)
    idx = {
        "unsorted": [0, 5, 3],
        "repeated": [0, 5, 5],
        "out of range": [0, 5, total],
        "negative": [-1, 5, 6],
    }[bad]
    with pytest.raises(IndexError, match="strictly increasing"):
        _members_put(dsts, np.array(idx, np.int64), np.ones(3, np.uint16))
    assert all(np.array_equal(a, b) for a, b in zip(dsts, copies))  # nothing written


def test_members_put_rejects_offsets_that_do_not_fit_the_members():
    dsts = _bufs(4)[:3]
    with pytest.raises(ValueError, match="offsets"):
        _native.members_put(dsts, 2, np.zeros(0, np.int64), np.array([0, 1, 2, 3], np.int64), np.zeros(0, np.uint16),
                            np.zeros(0, np.uint16), np.zeros(0, np.uint64), np.zeros(0, np.uint64))


@pytest.mark.parametrize("algo", ["xxh3b", LEGACY_ALGO])
def test_write_group_gives_each_member_its_digests_and_old_bits(algo):
    g = torch.Generator().manual_seed(5)
    ts = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate([3, 40_000, 70_000])}
    before = {n: tensor_digest(t, algo) for n, t in ts.items()}
    orig = {n: t.clone() for n, t in ts.items()}
    offsets = np.array([0, 3, 40_003, 110_003], np.int64)
    idx = np.array([1, 2, 3, 50_000, 110_002], np.int64)
    vals = np.array([7, 8, 9, 10, 11], np.uint16)
    out = write_group(ts, list(ts), offsets, idx, vals, digest=True, before=True, algo=algo)
    for i, (n, (local, new, old, d_after, d_before)) in enumerate(out.items()):
        assert d_before == before[n] and d_after == tensor_digest(ts[n], algo)
        assert torch.equal(orig[n].view(-1)[local], old) and torch.equal(ts[n].view(-1)[local], new)
        assert (local + int(offsets[i])).tolist() == [x for x in idx.tolist() if offsets[i] <= x < offsets[i + 1]]


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
    assert n_apply / 400 <= 50, f"apply_patch made {n_apply} Python calls for 400 small tensors"


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
    assert len(parsed.header.groups) <= 8
    # measured 41, 29 and 7.1 per tensor (57, 50 and 8.6 in 40 groups)
    # encode measured 18.2 once the members were diffed in place (every thread's calls: test_members_diff.py)
    assert n_enc / len(st) <= 21, f"diff_encode made {n_enc} Python calls for {len(st)} small tensors"
    assert n_read / len(st) <= 35, f"read_patch made {n_read} Python calls for {len(st)} small tensors"
    assert n_apply / len(st) <= 8, f"apply_patch made {n_apply} Python calls for {len(st)} small tensors"
