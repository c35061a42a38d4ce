"""A group's members diffed where the caller holds them (issue 51): `_native.members_diff` and
`diff.diff_members` give what diffing the members' concatenation gives (numpy's definition),
element for element, on every width and HW level, at the edges (no members, empty members, one
element, sizes that are no multiple of a vector step, changes at each member's first and last
element, outputs that fill), bitwise (NaN payloads, -0.0); they refuse arguments that do not
fit before writing; and `Snapshot.diff_encode` of a plain state neither copies the members end
to end nor makes per-member objects it does not need, with the same patch bytes as the cast
path that does copy."""

from __future__ import annotations

import cProfile

import numpy as np
import pytest
import torch

from sparsesync.codec import _native, _scratch, apply_patch, read_patch
from sparsesync.codec.cast import CastState
from sparsesync.codec.diff import diff_members, diff_state
from sparsesync.codec.snapshot import Snapshot
from tests.codec.test_native import _bits, _flip, _need
from tests.codec.test_small_tensors import _adapter_layout

SIZES = {
    "none": [],
    "one element": [1],
    "empty members": [0, 5, 0, 0, 3, 0],
    "odd sizes": [3, 17, 31, 33, 1, 7, 65, 15, 100, 9],
    "a long one": [2, 5001, 1],
}


def _members(sizes: list[int], width: int, density: float, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = _bits(rng, sum(sizes), width)
    cur = _flip(rng, base, density)
    offs = np.cumsum([0, *sizes])
    for a, b in zip(offs[:-1], offs[1:]):  # each member's first and last element change
        if b > a:
            cur[[a, b - 1]] = base[[a, b - 1]] ^ 1
    return base, [cur[a:b].copy() for a, b in zip(offs[:-1], offs[1:])]


def _offsets(members: list[np.ndarray]) -> np.ndarray:
    offs = np.zeros(len(members) + 1, dtype=np.int64)
    np.cumsum([m.size for m in members], out=offs[1:])
    return offs


def _cat(base: np.ndarray, members: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(members) if members else base[:0]


def _want(base: np.ndarray, members: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    cur = _cat(base, members)
    idx = np.flatnonzero(base != cur)
    offs = _offsets(members)
    return idx, np.diff(np.searchsorted(idx, offs))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("density", [0.0, 0.05, 1.0])
def test_members_diff_matches_numpy_over_the_concatenation_and_resumes_when_outputs_fill(width, case, density):
    base, members = _members(SIZES[case], width, density, seed=width + len(case))
    want, want_counts = _want(base, members)
    got, counts, m, e, cur = [], np.zeros(len(members), np.int64), 0, 0, _cat(base, members)
    for _ in range(10_000):  # outputs of 3 elements: the pass stops and resumes many times
        oi, oa, ob = np.empty(3, np.int64), np.empty(3, base.dtype), np.empty(3, base.dtype)
        k, m, e = _native.members_diff(base, members, width, m, e, oi, oa, ob, counts)
        assert 0 <= k <= 3 and np.array_equal(oa[:k], base[oi[:k]])
        assert np.array_equal(ob[:k], cur[oi[:k]])
        got.append(oi[:k])
        if m == len(members):
            break
    assert e == 0 and np.array_equal(np.concatenate(got), want) and np.array_equal(counts, want_counts)


@pytest.mark.parametrize("hw", [0, 1, 2, 3])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
def test_diff_members_gives_the_same_at_every_hw_level_and_grows_its_outputs(hw, case, density):
    _need(hw)
    base, members = _members([s * 97 for s in SIZES[case]], 2, density, seed=hw)  # sizes of 97 x: 1, 3, ... steps
    want, want_counts = _want(base, members)
    oi, oa, ob = np.empty(base.size, np.int64), np.empty(base.size, base.dtype), np.empty(base.size, base.dtype)
    counts = np.zeros(len(members), np.int64)
    k, m, e = _native.members_diff(base, members, 2, 0, 0, oi, oa, ob, counts, hw)
    assert (k, m, e) == (want.size, len(members), 0)
    assert np.array_equal(oi[:k], want) and np.array_equal(counts, want_counts)
    idx, a, b, counts = diff_members(base, members, _offsets(members))  # outputs grown from 1/32 of the group
    cur = _cat(base, members)
    assert np.array_equal(idx, want) and np.array_equal(a, base[want]) and np.array_equal(b, cur[want])
    assert np.array_equal(counts, want_counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_members_are_compared_bitwise(dtype):
    """A changed NaN payload and 0.0 -> -0.0 are changes, an unchanged NaN is not; fp32 and fp16
    members as well as bf16."""
    iv = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    old = [torch.tensor([float("nan"), 0.0, 1.0], dtype=dtype), torch.tensor([float("nan")] * 5, dtype=dtype)]
    new = [t.clone() for t in old]
    new[0][1] = -0.0
    new[1].view(iv)[4] += 1  # another NaN payload
    flat = torch.cat(old)
    idx, a, b, counts = diff_members(flat.view(iv).numpy(), [t.view(iv).numpy() for t in new], np.array([0, 3, 8]))
    assert idx.tolist() == [1, 7] and counts.tolist() == [1, 1]
    assert np.array_equal(a, flat.view(iv).numpy()[[1, 7]])
    assert np.array_equal(b, torch.cat(new).view(iv).numpy()[[1, 7]])


def test_members_diff_refuses_what_does_not_fit_before_writing():
    base = np.zeros(10, np.uint16)
    members = [np.zeros(4, np.uint16), np.zeros(6, np.uint16)]
    out = np.full(10, -1, np.int64), np.zeros(10, np.uint16), np.zeros(10, np.uint16)
    counts = np.zeros(2, np.int64)
    for args, match in [
        ((base[:9], members, 2, 0, 0, *out, counts), "the members hold 20 bytes, the base 18"),
        ((base, members, 2, 0, 0, *out, counts[:1]), "counts hold 8 bytes, expected 2 int64"),
        ((base, members, 2, 1, 7, *out, counts), "resume at member 1 element 7"),
        ((base, members, 2, 3, 0, *out, counts), "resume at member 3"),
        ((base, members, 2, 2, 1, *out, counts), "resume at member 2 element 1"),
        ((base, [members[0][:3], members[1], members[0][:1]], 4, 0, 0, *out, np.zeros(3, np.int64)),
         "member 0 holds 6 bytes, expected a multiple of 4"),
        ((base, members, 3, 0, 0, *out, counts), "element width 3"),
    ]:
        with pytest.raises(ValueError, match=match):
            _native.members_diff(*args)
    with pytest.raises(TypeError, match="list"):
        _native.members_diff(base, tuple(members), 2, 0, 0, *out, counts)
    assert (out[0] == -1).all() and not counts.any()  # nothing written


def _state(n: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"m.{i:02d}.weight": torch.randn(3 + i % 7, 33, generator=g).to(torch.bfloat16) for i in range(n)}


def _changed(st: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(st.items()):
        u = v.clone()
        if i % 3:  # some members untouched
            u.view(-1)[i % step :: step] += 1
        out[k] = u
    return out


def test_a_plain_state_is_diffed_without_copying_its_members_and_codes_as_the_cast_path(monkeypatch):
    """The members of a plain state are diffed where they are: this thread's buffer for the
    current members (`_scratch.cat_into("current", ...)`, a group's size per version) is never
    made; a `CastState` (fp32 master published as bf16) still goes through it, and both give
    the same patch bytes; the members' changes, made when read, are diff_state's."""
    monkeypatch.setenv("SPARSESYNC_CODEC_THREADS", "1")  # every group in this thread
    st = _state()
    cur = _changed(st, 5)
    bufs = _scratch._local.__dict__.setdefault("bufs", {})
    for key in [k for k in bufs if k[0] == "current"]:
        del bufs[key]
    plain = Snapshot(st, 0).diff_encode(cur, 1)
    assert not [k for k in bufs if k[0] == "current"], "the members were copied end to end to be diffed"
    assert read_patch(plain.data).header.groups
    cast = Snapshot(st, 0).diff_encode(CastState({k: v.float() for k, v in cur.items()}, torch.bfloat16), 1)
    assert ("current", torch.float32) in bufs  # the cast path: the fp32 members end to end, cast as diffed
    assert plain.data == cast.data
    want = diff_state(st, cur)
    assert list(plain.changes) == sorted(want) and plain.stats.n_changed == sum(c.n_changed for c in want.values())
    for n, c in want.items():
        got = plain.changes[n]
        assert got.shape == c.shape and got.dtype == c.dtype
        assert all(np.array_equal(x, y) for x, y in [(got.indices, c.indices), (got.base_bits, c.base_bits),
                                                     (got.target_bits, c.target_bits)])
    replica = {k: v.clone() for k, v in st.items()}
    apply_patch(read_patch(plain.data), replica)
    assert all(torch.equal(replica[k], cur[k]) for k in cur)


def test_a_members_grad_and_an_unchanged_version_are_handled():
    st = _state(12, seed=1)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in st.items()}  # requires grad: viewed after a detach
    snap = Snapshot(st, 0)
    assert snap.diff_encode(params, 1).stats.n_changed == 0  # nothing changed: no member touched
    with torch.no_grad():
        params["m.03.weight"][0, 0] = 7.0
    p = snap.diff_encode(params, 2)
    assert list(p.changes) == ["m.03.weight"] and p.changes["m.03.weight"].indices.tolist() == [0]
    assert "m.04.weight" not in p.changes


# What a writer's version may still call once per touched member (C, but the digests' module):
# its bit view (view, numpy), the layout check (is_contiguous), its digest (the members' blocks
# counted and combined in blocks_digest: the hash of each, its length packed, an append).
PER_MEMBER = ("'view' of", "'numpy' of", "'is_contiguous' of", "blocks_digest.py:", "xxh3_64_hexdigest",
              "'pack' of", "'append' of 'list'", "builtins.len")  # len: some 40 a group, 10 groups


def _label(code: object) -> str:
    return code if isinstance(code, str) else f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"  # type: ignore[attr-defined]


def test_a_writers_version_calls_nothing_else_per_member(monkeypatch):
    """An adapter-sized version (392 tensors in 10 groups), every group in this thread so that
    every call is counted: the functions called once per member or more are only PER_MEMBER's,
    and the whole costs at most 20 calls per tensor (measured 15.1 in 5 groups, 18.2 in 10; 57.5 before the members
    were diffed in place, made lazily, and written in bulk). A copy of the members end to end
    (`uncast`, `reshape` per member) or a `TensorChange` per member fails it."""
    monkeypatch.setenv("SPARSESYNC_CODEC_THREADS", "1")
    g = torch.Generator().manual_seed(0)
    st = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in _adapter_layout().items()}
    snap = Snapshot(st, 0)
    for v in (1, 2):  # version 1 fills the caches a run keeps (the group section's names)
        cur = {}
        for k, t in st.items():
            u = t.clone()
            u.view(-1)[v::97] += 1
            cur[k] = u
        pr = cProfile.Profile()
        pr.enable()
        p = snap.diff_encode(cur, v)
        pr.disable()
        st = cur
    assert len(p.changes) == len(st) and len(read_patch(p.data).header.groups) == 10
    calls = pr.getstats()  # per code object (pstats would merge the dataclasses' `<string>:2(__init__)`s)
    per_member = {_label(e.code) for e in calls if e.callcount >= len(st)}
    extra = sorted(k for k in per_member if not any(a in k for a in PER_MEMBER))
    assert not extra, f"called once per member or more: {extra}"
    total = sum(e.callcount for e in calls)
    assert total / len(st) <= 20, f"diff_encode made {total} Python calls for {len(st)} small tensors"
