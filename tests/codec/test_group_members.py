"""A group's members read and written where they lie (issue 51): the native calls over member
addresses (`members_take`, `members_copy`, `members_put`) against numpy's own gather, concatenation
and writes, for members of 0, 1 and odd element counts and across 64 KiB hash blocks, every bad
argument refused before the first write; `write_group`'s digests, undo and per-member updates;
and an apply of a sparse LoRA-shaped version that reads the base only at the changed positions
(no copy of the members end to end) with no Python per member."""

from __future__ import annotations

import cProfile
import pstats

import numpy as np
import pytest
import torch

from sparsesync.codec import _native, apply_patch, read_patch
from sparsesync.codec._group_read import member_ptrs
from sparsesync.codec._group_write import write_group
from sparsesync.codec.blocks_digest import BLOCK, combine_many, n_blocks
from sparsesync.codec.digest import LEGACY_ALGO, put_and_digests, tensor_digest
from sparsesync.codec.snapshot import Snapshot

WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _members(w: int, seed: int = 0) -> list[np.ndarray]:
    """Members of 0, 1 and odd sizes, one ending exactly on a hash block, one crossing two."""
    sizes = [0, 1, 7, BLOCK // w, BLOCK // w + 1, 0, 3 * BLOCK // (2 * w) + 3, 40_001]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << (8 * w) - 1, size=n, dtype=WIDTHS[w]) for n in sizes]


def _ptrs(arrs: list[np.ndarray]) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrs], dtype=np.int64)


def _offsets(arrs: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(len(arrs) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrs], out=out[1:])
    return out


def _edges(offsets: np.ndarray) -> np.ndarray:
    """Every member's first and last element (the positions a walk over members gets wrong)."""
    lo, hi = offsets[:-1], offsets[1:]
    return np.unique(np.concatenate([lo[hi > lo], hi[hi > lo] - 1]))


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_members_take_and_copy_read_the_members_as_their_concatenation(w):
    arrs = _members(w, seed=w)
    cat, offs = np.concatenate(arrs), _offsets(arrs)
    rng = np.random.default_rng(1)
    idx = np.union1d(np.unique(rng.integers(0, cat.size, size=cat.size // 30)), _edges(offs)).astype(np.int64)
    out = np.empty(idx.size, dtype=cat.dtype)
    _native.members_take(_ptrs(arrs), w, offs, idx, out)
    assert np.array_equal(out, cat[idx])
    whole = np.empty_like(cat)
    _native.members_copy(_ptrs(arrs), w, offs, whole)
    assert np.array_equal(whole, cat)
    none = np.empty(0, dtype=cat.dtype)
    _native.members_take(_ptrs(arrs), w, offs, np.zeros(0, np.int64), none)  # no index: nothing read


BAD_IDX = {"unsorted": [0, 5, 3], "repeated": [0, 5, 5], "out of range": [0, 5, -1], "negative": [-1, 5, 6]}


@pytest.mark.parametrize("bad", sorted(BAD_IDX))
def test_members_take_and_put_refuse_bad_indices_before_the_first_write(bad):
    arrs = _members(2, seed=3)
    copies = [a.copy() for a in arrs]
    offs = _offsets(arrs)
    idx = np.array([int(offs[-1]) if i == -1 and bad == "out of range" else i for i in BAD_IDX[bad]], np.int64)
    out = np.zeros(3, np.uint16)
    with pytest.raises(IndexError, match="strictly increasing"):
        _native.members_take(_ptrs(arrs), 2, offs, idx, out)
    assert not out.any()
    with pytest.raises(IndexError, match="strictly increasing"):
        _put(arrs, idx, np.ones(3, np.uint16))
    assert all(np.array_equal(a, b) for a, b in zip(arrs, copies))  # nothing written


def test_members_calls_refuse_members_that_do_not_fit_their_offsets():
    arrs = _members(2)[1:4]
    p, offs, nothing = _ptrs(arrs), _offsets(arrs), np.zeros(0, np.int64)
    cases = {
        "offsets": (p, offs[1:]),  # one offset short
        "rise from 0": (p, offs + 1),
        "rise": (p, offs[::-1].copy()),
        "address 0": (np.zeros_like(p), offs),
    }
    for what, (ptrs, o) in cases.items():
        with pytest.raises(ValueError, match=what):
            _native.members_take(ptrs, 2, o, nothing, np.zeros(0, np.uint16))
        with pytest.raises(ValueError, match=what):
            _native.members_put(ptrs, 2, nothing, o, *[np.zeros(0, np.uint16)] * 2, *[np.zeros(0, np.uint64)] * 2)
    n = int(offs[-1])
    with pytest.raises(ValueError, match=f"expected {2 * n} "):
        _native.members_copy(p, 2, offs, np.zeros(n - 1, np.uint16))
    with pytest.raises(ValueError, match="width 3"):
        _native.members_copy(p, 3, offs, np.zeros(n, np.uint16))


def _put(arrs, idx, vals, *, hashes=True):
    nblk = sum(n_blocks(a.nbytes) for a in arrs)
    old = np.empty_like(vals)
    before, after = (np.empty(nblk if hashes else 0, np.uint64) for _ in range(2))
    _native.members_put(_ptrs(arrs), vals.itemsize, idx, _offsets(arrs), vals, old, before, after)
    return old, before, after


@pytest.mark.parametrize("w", [1, 2, 8])
def test_members_put_writes_and_hashes_like_put_and_digests_member_by_member(w):
    arrs, want = _members(w, seed=4), _members(w, seed=4)
    offs = _offsets(arrs)
    total = int(offs[-1])
    rng = np.random.default_rng(2)
    idx = np.union1d(np.unique(rng.integers(0, total, size=total // 50)), _edges(offs)).astype(np.int64)
    vals = rng.integers(0, 1 << (8 * w) - 1, size=idx.size, dtype=WIDTHS[w])
    old, before, after = _put(arrs, idx, vals)
    want_before, want_after, want_old = [], [], []
    for i, d in enumerate(want):
        sel = (idx >= offs[i]) & (idx < offs[i + 1])
        o = np.empty(int(sel.sum()), d.dtype)
        b, a = put_and_digests(d, idx[sel] - offs[i], vals[sel], o)
        want_before.append(b)
        want_after.append(a)
        want_old.append(o)
    assert all(np.array_equal(a, b) for a, b in zip(arrs, want))
    assert np.array_equal(old, np.concatenate(want_old))
    nbytes = [a.nbytes for a in arrs]
    assert combine_many(before, nbytes) == want_before and combine_many(after, nbytes) == want_after


@pytest.mark.parametrize("algo", ["xxh3b", LEGACY_ALGO])
def test_write_group_gives_digests_undo_and_each_members_update(algo):
    g = torch.Generator().manual_seed(5)
    ts = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate([3, 1, 40_000, 70_001])}
    before = [tensor_digest(t, algo) for t in ts.values()]
    orig = {n: t.clone() for n, t in ts.items()}
    offsets = np.array([0, 3, 4, 40_004, 110_005], np.int64)
    idx = np.array([1, 2, 3, 50_000, 110_004], np.int64)
    cuts = np.searchsorted(idx, offsets)
    vals = np.array([7, 8, 9, 10, 11], np.uint16)
    w = write_group(ts, list(ts), member_ptrs(list(ts.values())), offsets, idx, vals, cuts, digest=True, before=True,
                    algo=algo)
    assert w.before == before and w.after == [tensor_digest(t, algo) for t in ts.values()]
    flat = torch.cat([t.view(-1) for t in ts.values()]).view(torch.int16).numpy()
    was = torch.cat([t.view(-1) for t in orig.values()]).view(torch.int16).numpy()
    assert np.array_equal(flat[idx], vals.view(np.int16)) and np.array_equal(was[idx], w.old.view(np.int16))
    w.undo()
    assert all(torch.equal(ts[n], orig[n]) for n in ts)
    positions = idx.tolist()
    for i, (n, local, new) in enumerate(zip(ts, *w.updates())):  # the last use: makes idx member-local
        assert (local + int(offsets[i])).tolist() == [x for x in positions if offsets[i] <= x < offsets[i + 1]]
        assert new.dtype == torch.bfloat16 and np.array_equal(new.view(torch.int16).numpy(), vals[cuts[i]: cuts[i + 1]])


def _adapter(seed: int = 0) -> dict[str, torch.Tensor]:
    """A LoRA-shaped state: r=16 on seven linear layers of 8 decoder layers (112 tensors)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (2048, 1024), "k": (1024, 1024), "v": (1024, 1024), "o": (1024, 2048),
              "gate": (3072, 1024), "up": (3072, 1024), "down": (1024, 3072)}
    return {f"l.{layer}.{m}.{ab}": torch.randn(s, generator=g).to(torch.bfloat16)
            for layer in range(8) for m, (o, i) in shapes.items() for ab, s in (("a", (16, i)), ("b", (o, 16)))}


def test_a_sparse_grouped_apply_reads_the_base_only_at_the_changes(monkeypatch):
    """At 1% changed the groups' codings read the base only where it changes: an apply makes no
    copy of the members end to end (`members_copy`, `torch.cat`), few Python calls per member
    (counted on one thread, the pool's work included), and is bit-exact."""
    st = _adapter()
    g = torch.Generator().manual_seed(1)
    cur = {}
    for k, v in st.items():
        u = v.clone().view(-1)
        at = torch.randperm(u.numel(), generator=g)[: u.numel() // 100]
        u[at] = (u[at].float() * 1.01 + 1e-3).to(torch.bfloat16)
        cur[k] = u.view(v.shape)
    patch = read_patch(Snapshot(st, 0).diff_encode(cur, 1).data)
    assert patch.header.groups and all(g.coding.positions == "gaps" for g in patch.header.groups)
    replica = {k: v.clone() for k, v in st.items()}
    monkeypatch.setenv("SPARSESYNC_CODEC_THREADS", "1")  # every call in this thread, where cProfile counts
    pr = cProfile.Profile()
    pr.enable()
    apply_patch(patch, replica)
    pr.disable()
    assert all(torch.equal(replica[k], cur[k]) for k in cur)
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    called = {f"{fn}" for (_, _, fn), v in stats.items() if v[1]}
    copies = sorted(c for c in called if "members_copy" in c or "torch.cat" in c or "cat_into" in c)
    assert not copies, f"the apply copied the members end to end: {copies}"
    # per member: is_contiguous, data_ptr, its SparseUpdate, its two digests; the rest per group.
    # measured 10.5 in groups of 2^21, 12.7 in groups of 2^20 (45.5 with a numpy view of each member and
    # per-member results, at 8021c27)
    n = pstats.Stats(pr).total_calls  # type: ignore[attr-defined]
    assert n / len(st) <= 14, f"apply_patch made {n} Python calls for {len(st)} small tensors"


def test_a_group_coded_per_class_of_the_base_magnitude_reads_the_whole_base(monkeypatch):
    """Codings conditioned on the classes of the base magnitude read every base element: the
    members are copied end to end once (`members_copy`), and the apply is bit-exact."""
    g = torch.Generator().manual_seed(3)
    st = {f"m.{i:02d}": (torch.randn(64, 512, generator=g) * torch.exp2(
        torch.randint(-20, 4, (64, 512), generator=g).float())).to(torch.bfloat16) for i in range(20)}
    cur = {}
    for k, v in st.items():  # changes only among the large elements: classes pay
        u = v.clone().view(-1)
        at = (u.float().abs() > 1.0) & (torch.rand(u.shape, generator=g) < 0.3)
        u[at] = (u[at].float() * 1.01).to(torch.bfloat16)
        cur[k] = u.view(v.shape)
    patch = read_patch(Snapshot(st, 0).diff_encode(cur, 1).data)
    (group,) = patch.header.groups
    assert group.coding.position_params["thresholds"] and group.coding.value_params["thresholds"]
    replica = {k: v.clone() for k, v in st.items()}
    monkeypatch.setenv("SPARSESYNC_CODEC_THREADS", "1")
    pr = cProfile.Profile()
    pr.enable()
    apply_patch(patch, replica)
    pr.disable()
    assert all(torch.equal(replica[k], cur[k]) for k in cur)
    called = {fn: v[1] for (_, _, fn), v in pstats.Stats(pr).stats.items()}  # type: ignore[attr-defined]
    assert called.get("<built-in method sparsesync.codec._native.members_copy>") == 1
