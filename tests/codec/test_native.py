"""The codec's C passes (sparsesync/codec/_native.c) against plain numpy definitions of the
same results, on every element width, at the edges (empty input, partial 64-element blocks,
full outputs), and on their rejections: a bad argument raises, and nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparsesync.codec import _native
from sparsesync.codec._classes import class_of, class_select
from sparsesync.codec.diff import _changed_slice_np, put_bits, take_bits
from sparsesync.codec.digest import digest_after_put, put_and_digest, tensor_digest

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    return rng.integers(0, np.iinfo(UINT[width]).max, n, dtype=UINT[width], endpoint=True)


def _flip(rng: np.random.Generator, a: np.ndarray, density: float) -> np.ndarray:
    b = a.copy()
    pos = np.flatnonzero(rng.random(a.size) < density)
    b[pos] ^= (rng.integers(1, 256, pos.size)).astype(a.dtype)  # a non-zero low byte: always a change
    return b


# ---------------------------------------------------------------------------- diff
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 64, 1001])
@pytest.mark.parametrize("density", [0.0, 0.05, 1.0])
def test_diff_into_matches_numpy_and_resumes_when_outputs_fill(width, n, density):
    rng = np.random.default_rng(n * 10 + width)
    a = _bits(rng, n, width)
    b = _flip(rng, a, density)
    want = np.flatnonzero(a != b)
    got, start = [], 0
    while start < n:  # outputs of 3 elements: the pass stops and resumes many times
        oi, oa, ob = np.empty(3, np.int64), np.empty(3, a.dtype), np.empty(3, a.dtype)
        k, start = _native.diff_into(a, b, width, start, 1000, oi, oa, ob)
        assert 0 <= k <= 3
        assert np.array_equal(oa[:k], a[oi[:k] - 1000]) and np.array_equal(ob[:k], b[oi[:k] - 1000])
        got.append(oi[:k] - 1000)
    assert np.array_equal(np.concatenate(got) if got else np.zeros(0, np.int64), want)


@pytest.mark.parametrize("density", [0.001, 0.5, 1.0])
def test_changed_slice_grows_its_outputs(density):
    rng = np.random.default_rng(1)
    a = _bits(rng, 300_001, 2)
    b = _flip(rng, a, density)
    idx, va, vb = _changed_slice_np(a, b, 7)
    want = np.flatnonzero(a != b)
    assert np.array_equal(idx, want + 7) and np.array_equal(va, a[want]) and np.array_equal(vb, b[want])


def test_changed_slice_grows_again_when_the_density_rises():
    rng = np.random.default_rng(2)
    a = _bits(rng, 400_000, 2)
    # the first growth predicts too few
    b = np.concatenate([_flip(rng, a[:200_000], 0.01), _flip(rng, a[200_000:], 0.9)])
    idx, va, vb = _changed_slice_np(a, b, 0)
    want = np.flatnonzero(a != b)
    assert np.array_equal(idx, want) and np.array_equal(va, a[want]) and np.array_equal(vb, b[want])


@pytest.mark.parametrize("hw", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [0, 15, 16, 17, 1001, 5000])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_diff_into_gives_the_same_at_every_hw_level(hw, n, density):
    _need(hw)
    rng = np.random.default_rng(n + int(density * 100))
    a = _bits(rng, n, 2)
    b = _flip(rng, a, density)
    want = np.flatnonzero(a != b)
    got, start = [], 0
    while start < n:  # outputs of 40: the vector steps run, then the scalar ones as they fill
        oi, oa, ob = np.empty(40, np.int64), np.empty(40, a.dtype), np.empty(40, a.dtype)
        k, start = _native.diff_into(a, b, 2, start, 5, oi, oa, ob, hw)
        assert np.array_equal(oa[:k], a[oi[:k] - 5]) and np.array_equal(ob[:k], b[oi[:k] - 5])
        got.append(oi[:k] - 5)
    assert np.array_equal(np.concatenate(got) if got else np.zeros(0, np.int64), want)


@pytest.mark.parametrize("hw", [0, 1, 2, 3])
def test_diff_into_switches_between_sparse_and_dense_stretches(hw):
    """Stretches of very different density, outputs large enough that the AVX2 pass runs its
    dense way (picked per 64 steps) and its sparse way, and switches between them."""
    _need(hw)
    rng = np.random.default_rng(3)
    parts = [(20_000, 0.001), (30_000, 0.1), (5_000, 0.0), (30_000, 0.3), (20_000, 0.02), (4_000, 1.0), (7_001, 0.06)]
    a = _bits(rng, sum(n for n, _ in parts), 2)
    b = np.concatenate(
        [_flip(rng, a[s : s + n], d) for (n, d), s in zip(parts, np.cumsum([0] + [n for n, _ in parts]))]
    )
    want = np.flatnonzero(a != b)
    oi, oa, ob = np.empty(a.size, np.int64), np.empty(a.size, a.dtype), np.empty(a.size, a.dtype)
    k, nxt = _native.diff_into(a, b, 2, 0, 0, oi, oa, ob, hw)
    assert nxt == a.size
    assert np.array_equal(oi[:k], want) and np.array_equal(oa[:k], a[want]) and np.array_equal(ob[:k], b[want])


def test_diff_into_rejects_mismatched_sides():
    a = np.zeros(8, np.uint16)
    out = np.empty(8, np.int64), np.empty(8, np.uint16), np.empty(8, np.uint16)
    with pytest.raises(ValueError, match="expected equal multiples"):
        _native.diff_into(a, np.zeros(9, np.uint16), 2, 0, 0, *out)
    with pytest.raises(ValueError, match="element width 3"):
        _native.diff_into(a, a, 3, 0, 0, *out)
    with pytest.raises(ValueError, match="start 9"):
        _native.diff_into(a, a, 2, 9, 0, *out)


# ---------------------------------------------------------------------------- classes
def _ref_ranks(base: np.ndarray, thresholds: list[int], idx: np.ndarray) -> list[np.ndarray]:
    cls = class_of(base, thresholds)
    return [(np.cumsum(cls == c) - 1)[idx[cls[idx] == c]] for c in range(len(thresholds) + 1)]


HW = [0, 1, 2, 3]  # portable; BMI2's pdep; AVX2 class masks; AVX-512BW class masks (each run where the CPU has it)
HW_NAMES = {0: "portable", 1: "BMI2", 2: "AVX2", 3: "AVX-512"}
_HW_RAN: dict[int, int] = {}  # level -> tests that ran it (this session)
_HW_SKIPPED: dict[int, int] = {}  # level -> tests skipped for want of it


def _need(hw: int) -> None:
    """Skip where this CPU lacks the level (the kernels cannot be emulated in-process), counting
    both ways for the session summary; SPARSESYNC_REQUIRE_HW=3 (say) turns such a skip into a
    failure, for CI machines that must exercise that level."""
    if hw in _native.hw_levels():
        _HW_RAN[hw] = _HW_RAN.get(hw, 0) + 1
        return
    _HW_SKIPPED[hw] = _HW_SKIPPED.get(hw, 0) + 1
    required = int(os.environ.get("SPARSESYNC_REQUIRE_HW", "-1"))
    msg = f"this CPU lacks HW level {hw} ({HW_NAMES[hw]}; has {_native.hw_levels()})"
    if hw <= required:
        pytest.fail(msg + f": SPARSESYNC_REQUIRE_HW={required} asks for it")
    pytest.skip(msg)


def hw_summary() -> str:
    """One line for the end of the test run: which HW levels the native tests exercised here."""
    ran = ", ".join(f"{HW_NAMES[h]} ({_HW_RAN[h]} tests)" for h in sorted(_HW_RAN))
    line = f"native codec HW levels tested on this CPU: {ran or 'none'}"
    if _HW_SKIPPED:
        line += "; NOT tested (this CPU lacks them): " + ", ".join(
            f"{HW_NAMES[h]} ({_HW_SKIPPED[h]} tests skipped)" for h in sorted(_HW_SKIPPED))
    return line


class _HwSummary:
    """A plugin registered at run time (hooks in a test module are not collected)."""

    @staticmethod
    def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if _HW_RAN or _HW_SKIPPED:
            terminalreporter.write_line(hw_summary())


@pytest.fixture(autouse=True, scope="module")
def _report_hw_levels(request):  # type: ignore[no-untyped-def]
    pm = request.config.pluginmanager
    if not pm.has_plugin("sparsesync-hw-summary"):
        pm.register(_HwSummary(), "sparsesync-hw-summary")
    yield


@pytest.mark.parametrize("width", [1, 2, 4, 8])
# 20001: class_ranks' chunks of 8192 elements, and a partial last block
@pytest.mark.parametrize("n", [1, 63, 64, 65, 5000, 20001])
@pytest.mark.parametrize("hw", HW)
def test_class_ranks_and_select_match_numpy_and_invert(width, n, hw):
    _need(hw)
    rng = np.random.default_rng(width * 1000 + n)
    base = _bits(rng, n, width)
    # every class count the C passes specialize (1-3) and others
    for thresholds in ([], [64], [30, 90], [20, 40, 100], [1, 2, 3, 4, 5, 6, 127]):
        for density in (0.0, 0.02, 0.5, 1.0):
            idx = np.flatnonzero(rng.random(n) < density).astype(np.int64)
            want = _ref_ranks(base, thresholds, idx)
            off = np.concatenate([[0], np.cumsum([r.size for r in want])]).astype(np.int64)
            flat = np.empty(idx.size, np.int64)
            _native.class_ranks(base, width, bytes(thresholds), idx, off, flat, hw)
            ranks = np.split(flat, off[1:-1])
            for got, w in zip(ranks, want, strict=True):
                assert np.array_equal(got, w)
            out = np.empty(idx.size, np.int64)
            assert _native.class_select(base, width, bytes(thresholds), np.concatenate(ranks), off, out, hw) == -1
            assert np.array_equal(out, idx)
            # the base's bits too, in the same pass
            out, at = np.full(idx.size, -1, np.int64), np.empty(idx.size, base.dtype)
            assert _native.class_select(base, width, bytes(thresholds), np.concatenate(ranks), off, out, hw, at) == -1
            assert np.array_equal(out, idx) and np.array_equal(at, base[idx])


def _run_pytest_lacking_avx512(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """This file's per-level test of one pass, in a pytest run whose CPU lacks AVX-512 (the level
    list is cut to 0-2, as on such a machine)."""
    code = ("import sys, pytest; from sparsesync.codec import _native; _native.hw_levels = lambda: [0, 1, 2]; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/codec/test_native.py', '-k', "
            "'class_select_names_the_class']))")
    return subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_a_run_says_which_hw_levels_it_tested_and_ci_can_demand_one():
    run = _run_pytest_lacking_avx512({"SPARSESYNC_REQUIRE_HW": "-1"})
    assert run.returncode == 0, run.stdout[-2000:]
    assert ("native codec HW levels tested on this CPU: portable (1 tests), BMI2 (1 tests), AVX2 (1 tests); "
            "NOT tested (this CPU lacks them): AVX-512 (1 tests skipped)") in run.stdout
    run = _run_pytest_lacking_avx512({"SPARSESYNC_REQUIRE_HW": "3"})
    assert run.returncode == 1 and "SPARSESYNC_REQUIRE_HW=3 asks for it" in run.stdout, run.stdout[-2000:]


def test_hw_levels_start_portable_and_unknown_levels_are_refused():
    levels = _native.hw_levels()
    assert levels == list(range(len(levels))) and 1 <= len(levels) <= 4
    base, idx = np.zeros(64, np.uint16), np.array([1], np.int64)
    with pytest.raises(ValueError, match="hw level 7"):
        _native.class_ranks(base, 2, b"", idx, np.array([0, 1], np.int64), np.empty(1, np.int64), 7)
    with pytest.raises(ValueError, match="hw level -2"):
        _native.class_select(base, 2, b"", idx, np.array([0, 1], np.int64), np.empty(1, np.int64), -2)


@pytest.mark.parametrize("hw", HW)
def test_class_select_names_the_class_whose_ranks_run_past_its_members(hw):
    _need(hw)
    base = np.arange(1000, dtype=np.uint16) << 8  # keys 0..127 repeating: with threshold 64, about half in each class
    members = int((class_of(base, [64]) == 1).sum())
    off, out = np.array([0, 2, 4], np.int64), np.empty(4, np.int64)
    assert _native.class_select(base, 2, bytes([64]), np.array([0, 5, 3, members], np.int64), off, out, hw) == 1
    assert _native.class_select(base, 2, bytes([64]), np.array([0, 5, 3, members - 1], np.int64), off, out, hw) == -1
    idx, bad = class_select(base, [64], np.array([0, 5, 3, members - 1], np.int64), [2, 2])
    assert bad == -1 and np.array_equal(idx, out)


def test_class_passes_reject_bad_arguments():
    base = np.zeros(100, np.uint16)
    out = np.empty(2, np.int64)
    with pytest.raises(ValueError, match="thresholds must be increasing"):
        _native.class_select(base, 2, bytes([5, 5]), np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64), out)
    with pytest.raises(ValueError, match="negative or not increasing"):
        _native.class_select(base, 2, b"", np.array([1, 1], np.int64), np.array([0, 2], np.int64), out)
    with pytest.raises(ValueError, match="offsets must rise"):
        _native.class_select(base, 2, b"", np.array([0, 1], np.int64), np.array([0, 3], np.int64), out)
    with pytest.raises(ValueError, match="out_bits must hold one element"):
        _native.class_select(
            base, 2, b"", np.array([0, 1], np.int64), np.array([0, 2], np.int64), out, -1, np.empty(3, np.uint16)
        )
    with pytest.raises(ValueError, match="out_bits"):
        class_select(base, [], np.array([0, 1], np.int64), [2], out_bits=np.empty(2, np.uint32))
    with pytest.raises(ValueError, match="offsets do not match"):  # idx 3 is in class 0, offsets put it in class 1
        _native.class_ranks(
            base, 2, bytes([64]), np.array([3], np.int64), np.array([0, 0, 1], np.int64), np.empty(1, np.int64)
        )
    with pytest.raises(ValueError, match="out of range or order"):
        _native.class_ranks(base, 2, b"", np.array([100], np.int64), np.array([0, 1], np.int64), np.empty(1, np.int64))
    big = np.zeros(20000, np.uint16)  # past class_ranks' first chunk of 8192 elements
    for bad, at in (([-1, 5], 0), ([5, 5], 1), ([9000, 8999], 1), ([3, 19999, 20000], 2), ([10000, 9000, 12000], 1)):
        with pytest.raises(ValueError, match=f"index {bad[at]} at {at} out of range or order"):
            _native.class_ranks(
                big, 2, b"", np.array(bad, np.int64), np.array([0, len(bad)], np.int64), np.empty(len(bad), np.int64)
            )


def test_class_of_counts_the_thresholds_each_key_reaches():
    rng = np.random.default_rng(2)
    for width in (1, 2, 4, 8):
        bits = _bits(rng, 1000, width)
        keys = np.ascontiguousarray(bits).view(np.uint8)[width - 1 :: width] & 0x7F
        for thresholds in ([], [1], [30, 31, 120], [1, 2, 3, 4, 5, 6, 127]):
            assert np.array_equal(class_of(bits, thresholds), np.searchsorted(thresholds, keys, side="right"))


def test_key_hist_matches_numpy_over_the_blocks():
    rng = np.random.default_rng(3)
    for width in (1, 2, 4, 8):
        base = _bits(rng, 10_000, width)
        starts = np.array([0, 17, 9000], np.int64)
        hist = np.empty(128, np.int64)
        _native.key_hist(base, width, starts, 1000, hist)
        keys = np.concatenate([base[s : s + 1000] for s in starts]).view(np.uint8)[width - 1 :: width] & 0x7F
        assert np.array_equal(hist, np.bincount(keys, minlength=128))
        with pytest.raises(ValueError, match="runs past"):
            _native.key_hist(base, width, np.array([9500], np.int64), 1000, hist)


def _ref_thresholds(tot: np.ndarray, chg: np.ndarray, max_classes: int, min_gain: float) -> list[int]:
    """The DP over contiguous key ranges, in numpy (what `thresholds_dp` computes)."""

    def cost_of(t: np.ndarray, c: np.ndarray) -> np.ndarray:
        t = np.maximum(t, c)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.where(t > 0, c / t, 0.0)
            h = -(np.where(p > 0, p * np.log2(p), 0.0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0.0))
        return t * h

    nz = np.flatnonzero(tot + chg)
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    ct, cc = np.concatenate([[0.0], np.cumsum(tot[lo:hi])]), np.concatenate([[0.0], np.cumsum(chg[lo:hi])])
    a, b = np.meshgrid(np.arange(hi - lo + 1), np.arange(hi - lo + 1), indexing="ij")
    cost = np.where(b > a, cost_of(ct[b] - ct[a], cc[b] - cc[a]), np.inf)
    dp, back = [cost[0]], []
    for _ in range(1, max_classes):
        total = dp[-1][:, None] + cost
        back.append(np.argmin(total, axis=0))
        dp.append(np.min(total, axis=0))
    best = 0
    for k in range(1, max_classes):
        if dp[k][hi - lo] < dp[best][hi - lo] * (1 - min_gain):
            best = k
    cuts, j = [], hi - lo
    for k in range(best, 0, -1):
        j = int(back[k - 1][j])
        cuts.append(lo + j)
    return sorted(t for t in cuts if 1 <= t <= 127)


def test_thresholds_dp_matches_the_numpy_dp():
    rng = np.random.default_rng(4)
    for case in range(60):
        lo, hi = sorted(rng.integers(0, 128, 2))
        tot = np.zeros(128)
        tot[lo : hi + 1] = rng.integers(0, 10_000, hi - lo + 1) * (1.0 + case % 3)
        chg = np.minimum(tot, np.round(tot * rng.random(128) ** 3))
        for classes in (1, 2, 4, 8):
            assert _native.thresholds_dp(tot, chg, classes, 0.02) == _ref_thresholds(tot, chg, classes, 0.02)


# ---------------------------------------------------------------------------- gaps and deltas
def _ref_gap_symbols(r: np.ndarray, k: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = (np.diff(r, prepend=-1) - 1) >> k
    return (
        np.minimum(q, e).astype(np.int32),
        q[q >= e].astype(np.uint64),
        np.bincount(np.minimum(q, e), minlength=e + 1),
    )


@pytest.mark.parametrize("k,e", [(0, 1), (0, 64), (3, 4), (9, 2)])
def test_gap_symbols_match_numpy_and_gap_ranks_inverts_them(k, e):
    rng = np.random.default_rng(k * 100 + e)
    numel = 1 << 20
    r = np.sort(rng.choice(numel, 5000, replace=False)).astype(np.int64)
    sym, esc, hist = np.empty(r.size, np.int32), np.empty(r.size, np.uint64), np.empty(e + 1, np.int64)
    low = np.zeros((r.size * k + 7) // 8 + 8, np.uint8)
    if k:  # the low-bit stream needs 8 bytes of padding for the 64-bit writes
        with pytest.raises(ValueError, match="too short"):
            _native.gap_symbols(r, k, e, sym, esc, hist, low[:-1], 0)
    n_esc = _native.gap_symbols(r, k, e, sym, esc, hist, low, 0)
    want_sym, want_esc, want_hist = _ref_gap_symbols(r, k, e)
    assert np.array_equal(sym, want_sym) and np.array_equal(esc[:n_esc], want_esc) and np.array_equal(hist, want_hist)
    out = np.empty(r.size, np.int64)
    assert _native.gap_ranks(sym, e, esc[:n_esc], 0, k, low, 0, numel, out) == (0, n_esc)
    assert np.array_equal(out, r)
    if k:  # the low bits, least significant first, as a little-endian bit stream
        bits = np.unpackbits(low, bitorder="little")[: r.size * k].reshape(r.size, k)
        assert np.array_equal(bits @ (1 << np.arange(k)), (np.diff(r, prepend=-1) - 1) & ((1 << k) - 1))
    # rejections: the status names what is wrong, and the escape stream is read no further than needed
    if n_esc:
        assert _native.gap_ranks(sym, e, esc[: n_esc - 1], 0, k, low, 0, numel, out)[0] == 1  # escapes run out
        small = esc[:n_esc].copy()
        small[0] = e - 1
        assert _native.gap_ranks(sym, e, small, 0, k, low, 0, numel, out)[0] == 2  # an escape below e
    assert _native.gap_ranks(sym, e, esc[:n_esc], 0, k, low, 0, int(r[-1]), out)[0] in (3, 4)  # past a smaller tensor


@pytest.mark.parametrize("step,k0,rows", [(1, 0, 1), (1, 2, 4), (3, 5, 3), (7, 0, 4)])
def test_gap_khist_matches_numpy_for_every_candidate_width(step, k0, rows):
    rng = np.random.default_rng(step * 10 + k0)
    r = np.sort(rng.choice(1 << 22, 20000, replace=False)).astype(np.int64)
    gaps = (np.diff(r, prepend=-1) - 1)[::step]
    got = np.empty((rows, 65), np.int64)
    _native.gap_khist(r, step, k0, got)
    want = np.stack([np.bincount(np.minimum(gaps >> (k0 + j), 64), minlength=65) for j in range(rows)])
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="gap_khist"):
        _native.gap_khist(r, step, k0, np.empty((5, 65), np.int64))  # at most 4 candidate widths


def _ref_zigzag(b: np.ndarray, t: np.ndarray) -> np.ndarray:
    bits = 8 * b.itemsize
    d = (t - b).view(np.dtype(f"i{b.itemsize}"))
    return ((d << 1) ^ (d >> (bits - 1))).view(b.dtype).astype(np.uint64)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("thresholds", [[], [40, 90]])
def test_delta_passes_match_numpy_and_invert(width, thresholds):
    rng = np.random.default_rng(width)
    n = 3001
    base = _bits(rng, n, width)
    target = base + rng.integers(-3, 4, n).astype(base.dtype)  # small deltas (wrapping), some escapes below
    target[::97] = _bits(rng, target[::97].size, width)
    n_cls = len(thresholds) + 1
    cls = class_of(base, thresholds) if thresholds else np.zeros(0, np.uint8)
    zz = _ref_zigzag(base, target)
    hist = np.empty((n_cls, 65), np.int64)
    _native.delta_hist(base, target, width, bytes(thresholds), hist)
    full_cls = cls if thresholds else np.zeros(n, np.uint8)
    for c in range(n_cls):
        assert np.array_equal(hist[c], np.bincount(np.minimum(zz[full_cls == c], 64).astype(np.intp), minlength=65))
    step_hist = np.empty((n_cls, 65), np.int64)
    _native.delta_hist(base, target, width, bytes(thresholds), step_hist, 7)
    for c in range(n_cls):
        assert np.array_equal(
            step_hist[c], np.bincount(np.minimum(zz[::7][full_cls[::7] == c], 64).astype(np.intp), minlength=65)
        )
    es = np.array([5, 64, 1][:n_cls], np.int64)
    sizes = hist.sum(axis=1)
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    sym, esc_all, sym_hist = np.empty(n, np.int32), np.empty(n, base.dtype), np.empty((n_cls, 65), np.int64)
    n_esc = _native.delta_symbols(base, target, width, bytes(thresholds), es, off, sym, esc_all, sym_hist)
    assert n_esc == [int(hist[c, es[c]:].sum()) for c in range(n_cls)]
    esc = np.concatenate([esc_all[off[c] : off[c] + n_esc[c]] for c in range(n_cls)])
    grouped = zz[np.argsort(full_cls, kind="stable")]
    group_e = np.repeat(es, sizes)
    assert np.array_equal(sym, np.minimum(grouped, group_e).astype(np.int32))
    assert np.array_equal(esc.astype(np.uint64), grouped[grouped >= group_e])
    for c in range(n_cls):
        assert np.array_equal(sym_hist[c], np.bincount(sym[off[c] : off[c + 1]], minlength=65))
    out = np.empty_like(base)
    assert _native.delta_values(base, width, cls, n_cls, sym, off, es, esc.tobytes(), out) == -1
    assert np.array_equal(out, target)
    assert _native.delta_values(base, width, cls, n_cls, sym, off, es, esc.tobytes()[:-width], out) == 100
    if esc.size:
        bad = esc.copy()
        bad[0] = 0
        assert _native.delta_values(base, width, cls, n_cls, sym, off, es, bad.tobytes(), out) >= 200
    if n_cls > 1:  # class sizes that do not match the classes
        with pytest.raises(ValueError, match="offsets do not match"):
            _native.delta_symbols(
                base,
                target,
                width,
                bytes(thresholds),
                es,
                np.array([0] * n_cls + [n], np.int64),
                sym,
                esc_all,
                sym_hist,
            )


# ---------------------------------------------------------------------------- gather / scatter
_ESC_CHOICES = np.array([1, 2, 4, 8, 16, 32, 64])


def _ref_escape_costs(hists: np.ndarray, raw_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy definition of `_native.escape_costs`: per row, entropy of the values below E
    plus raw escapes plus 24 bits per model count, over E in _ESC_CHOICES up to the first E
    without escapes; the first minimum."""
    c = hists.astype(np.float64)
    rows = c.shape[0]
    n = c.sum(axis=1, keepdims=True)
    zero = np.zeros((rows, 1))
    cum_clogc = np.concatenate([zero, np.cumsum(c * np.log2(np.maximum(c, 1.0)), axis=1)], axis=1)
    tail = n - np.concatenate([zero, np.cumsum(c, axis=1)], axis=1)
    esc = np.maximum(tail[:, _ESC_CHOICES], 0.0)
    ent = np.where(
        n > 0, n * np.log2(np.maximum(n, 1.0)) - cum_clogc[:, _ESC_CHOICES] - esc * np.log2(np.maximum(esc, 1.0)), 0.0
    )
    bits = ent + esc * raw_bits + 24.0 * (_ESC_CHOICES + 1)
    no_esc = esc == 0
    last = np.where(no_esc.any(axis=1), np.argmax(no_esc, axis=1), esc.shape[1] - 1)
    bits = np.where(np.arange(esc.shape[1]) <= last[:, None], bits, np.inf)
    i = np.argmin(bits, axis=1)
    return bits[np.arange(rows), i], _ESC_CHOICES[i]


@pytest.mark.parametrize("raw_bits", [8, 16, 64])
def test_escape_costs_match_numpy(raw_bits):
    rng = np.random.default_rng(raw_bits)
    rows = [np.zeros(65, np.int64), np.eye(65, dtype=np.int64)[0] * 5, np.eye(65, dtype=np.int64)[64] * 3]
    for scale in (1, 10, 1000, 10**7):  # geometric-ish histograms, as gaps and deltas have, and noise
        rows += [
            np.round(scale * rng.random() * np.exp(-np.arange(65) * rng.uniform(0.05, 3))).astype(np.int64)
            for _ in range(40)
        ]
        rows += [rng.integers(0, scale + 1, 65) for _ in range(10)]
    hists = np.stack(rows)
    bits, es = np.empty(len(rows)), np.empty(len(rows), np.int64)
    _native.escape_costs(hists, float(raw_bits), bits, es)
    want_bits, want_es = _ref_escape_costs(hists, raw_bits)
    assert np.array_equal(es, want_es)
    assert np.allclose(bits, want_bits, rtol=1e-12, atol=1e-9)
    with pytest.raises(ValueError, match="rows of 65"):
        _native.escape_costs(hists[:, :64].copy(), 8.0, bits, es)
    with pytest.raises(ValueError, match=r"counts must be in \[0, 2\^52\)"):
        _native.escape_costs(-hists[1:2], 8.0, bits[:1], es[:1])


# ---------------------------------------------------------------------------- rANS (format 2)
RANS_L, PROB_BITS, WAYS = 1 << 31, 14, 4


def _ref_quantize(counts: list[int]) -> tuple[list[int], list[int]]:
    """docs/format.md, "Entropy coding": frequencies summing to 2^14, zero exactly where the count is."""
    m, total = 1 << PROB_BITS, sum(counts)
    freq = [0 if c == 0 else max(1, c * m // total) for c in counts]
    big = max(range(len(freq)), key=lambda s: (freq[s], -s))  # the first largest
    freq[big] += m - sum(freq)
    return freq, [sum(freq[:s]) for s in range(len(freq))]


def _ref_rans_encode(segments: list[tuple[list[int], list[int]]]) -> bytes:
    syms = [(s, counts) for sym, counts in segments for s in sym]
    x, words = [RANS_L] * WAYS, []
    for i in reversed(range(len(syms))):
        s, counts = syms[i]
        freq, start = _ref_quantize(counts)
        j, f = i % WAYS, freq[s]
        if x[j] >= ((RANS_L >> PROB_BITS) << 32) * f:
            words.append(x[j] & 0xFFFFFFFF)
            x[j] >>= 32
        x[j] = (x[j] // f << PROB_BITS) + x[j] % f + start[s]
    if not words and x == [RANS_L] * WAYS:
        return b""
    return b"".join(v.to_bytes(8, "little") for v in x) + b"".join(w.to_bytes(4, "little") for w in reversed(words))


def _ref_rans_decode(data: bytes, models: list[tuple[list[int], int]]) -> list[list[int]]:
    x = [int.from_bytes(data[8 * j : 8 * j + 8], "little") for j in range(WAYS)] if data else [RANS_L] * WAYS
    pos, i, out = 8 * WAYS if data else 0, 0, []
    for counts, n in models:
        freq, start = _ref_quantize(counts) if n else ([], [])
        seg = []
        for _ in range(n):
            j, slot = i % WAYS, x[i % WAYS] & ((1 << PROB_BITS) - 1)
            s = max(t for t in range(len(freq)) if freq[t] and start[t] <= slot)
            x[j] = freq[s] * (x[j] >> PROB_BITS) + slot - start[s]
            if x[j] < RANS_L:
                x[j] = (x[j] << 32) | int.from_bytes(data[pos : pos + 4], "little")
                pos += 4
            seg.append(s)
            i += 1
        out.append(seg)
    assert pos == len(data) and x == [RANS_L] * WAYS
    return out


def _rans_case(rng: np.random.Generator, sizes: list[int]) -> list[tuple[np.ndarray, list[int]]]:
    segs = []
    for n in sizes:
        k = int(rng.integers(2, 66))
        p = rng.dirichlet(np.full(k, rng.choice([0.05, 1.0])))  # skewed or flat models
        sym = rng.choice(k, n, p=p).astype(np.int32)
        if 1 < n < 8:  # tiny streams with uncertain symbols: the 32 bytes of states dominate
            sym[:2] = [0, 1]
        counts = np.bincount(sym, minlength=k).tolist() if n else [1] + [0] * (k - 1)
        segs.append((sym, counts))
    return segs


def _rans(segs: list[tuple[np.ndarray, list[int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    counts = np.array([c for _, cs in segs for c in cs], np.int64)
    cofs = np.cumsum([0] + [len(cs) for _, cs in segs]).astype(np.int64)
    sofs = np.cumsum([0] + [s.size for s, _ in segs]).astype(np.int64)
    sym = np.concatenate([s for s, _ in segs]) if segs else np.zeros(0, np.int32)
    return sym, sofs, counts, cofs


@pytest.mark.parametrize(
    "sizes", [[], [0], [1], [2], [1, 1, 1], [5], [3, 0, 5], [2000], [7, 1, 0, 1500, 33], [4, 4, 4, 4]]
)
def test_rans_matches_the_reference_coder_and_inverts(sizes):
    rng = np.random.default_rng(sum(sizes) + len(sizes))
    for _ in range(3):
        segs = _rans_case(rng, sizes)
        sym, sofs, counts, cofs = _rans(segs)
        data = _native.rans_encode(sym, sofs, counts, cofs)
        assert data == _ref_rans_encode([(s.tolist(), cs) for s, cs in segs])
        out = np.full(sym.size, -1, np.int32)
        assert _native.rans_decode(data, counts, cofs, sofs, out) == 0
        assert np.array_equal(out, sym)
        assert [list(x) for x in _ref_rans_decode(data, [(cs, s.size) for s, cs in segs])] == [
            s.tolist() for s, _ in segs
        ]


def test_rans_size_is_near_the_entropy_and_certain_symbols_cost_nothing():
    rng = np.random.default_rng(5)
    segs = _rans_case(rng, [200_000, 50_000])
    sym, sofs, counts, cofs = _rans(segs)
    ent = sum(-(c * np.log2(c / c.sum())).sum() for c in (np.array(cs)[np.array(cs) > 0] for _, cs in segs)) / 8
    assert ent <= len(_native.rans_encode(sym, sofs, counts, cofs)) <= ent * 1.002 + 64
    certain = np.full(1000, 3, np.int32)
    assert (
        _native.rans_encode(
            certain, np.array([0, 1000], np.int64), np.array([0, 0, 0, 9, 0], np.int64), np.array([0, 5], np.int64)
        )
        == b""
    )


def test_rans_decode_rejects_every_damaged_stream():
    rng = np.random.default_rng(9)
    segs = _rans_case(rng, [300, 41])
    sym, sofs, counts, cofs = _rans(segs)
    data = _native.rans_encode(sym, sofs, counts, cofs)
    out = np.empty(sym.size, np.int32)

    def status(d: bytes) -> int:
        return _native.rans_decode(d, counts, cofs, sofs, out)

    assert status(data[:-1]) == 1 and status(data[:20]) == 1 and status(data + b"\0") == 1
    assert status(data[:-4]) == 3 and status(b"") == 3  # words run out
    assert status(data + b"\0" * 4) == 4  # a word left over
    assert status(b"\xff" * 8 + data[8:]) == 2  # state 0 past its range
    assert status((1).to_bytes(8, "little") + data[8:]) == 2  # state 0 below it
    for pos in range(0, len(data), 3):  # any flipped byte: never a crash, never a silent pass with the same symbols
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        out[:] = -1
        st = status(bytes(bad))
        assert st != 0 or not np.array_equal(out, sym)
        assert out.min() >= -1 and out.max() < 65
    empty = np.array([0, 0, 0], np.int64)
    assert (
        _native.rans_decode(
            data,
            np.zeros(4, np.int64),
            np.array([0, 2, 4], np.int64),
            np.array([0, 1, 1], np.int64),
            np.empty(1, np.int32),
        )
        == 5
    )
    assert _native.rans_decode(b"", counts, cofs, empty, np.empty(0, np.int32)) == 0


def test_rans_rejects_bad_arguments():
    sym, sofs, counts, cofs = _rans([(np.array([0, 1, 5], np.int32), [1, 1, 0, 0, 0, 0])])
    with pytest.raises(ValueError, match="outside its model or has a zero count"):
        _native.rans_encode(sym, sofs, counts, cofs)  # symbol 5 has count 0
    with pytest.raises(ValueError, match="outside its model"):
        _native.rans_encode(
            np.array([6], np.int32), np.array([0, 1], np.int64), np.ones(6, np.int64), np.array([0, 6], np.int64)
        )
    with pytest.raises(ValueError, match="malformed"):
        _native.rans_encode(sym, np.array([0, 2], np.int64), counts, cofs)  # offsets end before the symbols do
    with pytest.raises(ValueError, match="malformed"):
        _native.rans_encode(sym, sofs, np.ones(66, np.int64), np.array([0, 66], np.int64))  # 66 symbols
    with pytest.raises(ValueError, match="malformed"):
        _native.rans_decode(
            b"",
            np.array([1, -1], np.int64),
            np.array([0, 2], np.int64),
            np.array([0, 0], np.int64),
            np.empty(0, np.int32),
        )
    with pytest.raises(ValueError, match="malformed"):
        _native.rans_decode(
            b"",
            np.array([1, 1 << 40], np.int64),
            np.array([0, 2], np.int64),
            np.array([0, 0], np.int64),
            np.empty(0, np.int32),
        )


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 1000, (2 << 20) * 3 // 2 + 7])  # up to several of digest's blocks
def test_digest_after_put_is_the_digest_the_write_gives_and_writes_nothing(width, n):
    rng = np.random.default_rng(n + width)
    dst = _bits(rng, n, width)
    idx = np.flatnonzero(rng.random(n) < 0.03).astype(np.int64)
    if n:
        idx = np.union1d(idx, [0, n - 1])  # the first and last element of the array
    vals = _bits(rng, idx.size, width)
    held = dst.copy()
    predicted = digest_after_put(dst, idx, vals)
    assert np.array_equal(dst, held)
    assert put_and_digest(dst, idx, vals) == predicted == tensor_digest(torch.from_numpy(dst.view(np.uint8)))
    with pytest.raises(IndexError):
        digest_after_put(dst, np.array([n], np.int64), vals[:1] if n else np.zeros(1, dst.dtype))


def test_take_and_put_check_every_index_before_writing():
    dst = np.arange(100, dtype=np.uint16)
    before = dst.copy()
    assert np.array_equal(take_bits(dst, np.array([5, 99, 0])), [5, 99, 0])
    with pytest.raises(IndexError, match="index 100"):
        put_bits(dst, np.array([1, 2, 100]), np.array([7, 7, 7], np.uint16))
    assert np.array_equal(dst, before)  # nothing written
    with pytest.raises(IndexError, match="index -1"):
        take_bits(dst, np.array([-1]))
    old = put_bits(dst, np.array([1, 2]), np.array([7, 8], np.uint16), keep_old=True)
    assert np.array_equal(old, [1, 2]) and dst[1] == 7 and dst[2] == 8


def test_varints_put_writes_what_varints_reads():
    rng = np.random.default_rng(0)
    values = [0, 1, 127, 128, 16383, 16384, (1 << 63) - 1] + [int(x) for x in rng.integers(0, 1 << 40, 100)]
    out = bytearray(b"\x07")
    _native.varints_put(out, values, len(values))
    got, pos, _, status = _native.varints(bytes(out), 1, len(values), (1 << 63) - 1)
    assert (got, pos, status) == (values, len(out), 0)
    before = bytes(out)
    _native.varints_put(out, values, 2)  # a prefix only
    assert bytes(out) == before + b"\x00\x01"
    for bad, err in [([-1], ValueError), ([1 << 64], OverflowError), (["x"], TypeError)]:
        with pytest.raises(err):
            _native.varints_put(out, bad, 1)
    assert bytes(out) == before + b"\x00\x01"  # a failed call appends nothing
    with pytest.raises(ValueError, match="count"):
        _native.varints_put(out, [1], 2)


def test_join_is_bytes_join_for_every_buffer_kind_and_size():
    rng = np.random.default_rng(3)
    for sizes in ([], [0], [5, 0, 7], [3 << 20, 1 << 20, 5, 2 << 20]):  # the last is over 4 MiB: the huge-page advice
        pieces = [rng.bytes(n) for n in sizes]
        pieces = [p if i % 3 == 0 else bytearray(p) if i % 3 == 1 else memoryview(p) for i, p in enumerate(pieces)]
        got = _native.join(pieces)
        assert type(got) is bytes and got == b"".join(bytes(p) for p in pieces)
    assert _native.join([np.arange(4, dtype=np.int32)]) == np.arange(4, dtype=np.int32).tobytes()
    with pytest.raises(TypeError, match="bytes-like"):
        _native.join([b"a", 1])
    with pytest.raises(TypeError):
        _native.join(5)
