"""The per-tensor fast paths for small tensors (issue 51) give exactly what the general paths give:
one-slice diffs (unchanged, and changes past the first output buffer), one-block writes with
their digests, table names front-coded by the shared-prefix search, format-3 entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsesync.codec import _table, digest
from sparsesync.codec.diff import diff_cpu_tensor
from sparsesync.codec.digest import digest_after_put, put_and_digest, put_and_digests, tensor_digest


def _bits_digest(a: np.ndarray) -> str:
    return tensor_digest(torch.from_numpy(a.view(np.int16).copy()).reshape(-1)) if a.size else tensor_digest(torch.empty(0, dtype=torch.int16))


@pytest.mark.parametrize("n_changed", [0, 1, 5000, 40_000])
def test_one_slice_diff_is_exact(n_changed: int) -> None:
    g = torch.Generator().manual_seed(n_changed)
    base = torch.randn(200, 256, generator=g).to(torch.bfloat16)  # 51,200 elements: one slice, first buffer 4,096
    target = base.clone()
    idx = torch.randperm(base.numel(), generator=g)[:n_changed].sort().values
    target.view(-1)[idx] = (target.view(-1)[idx].float() * 2 + 1).to(torch.bfloat16)
    ch = diff_cpu_tensor(base, target)
    want = np.flatnonzero(base.view(torch.int16).numpy().ravel() != target.view(torch.int16).numpy().ravel())
    if want.size == 0:
        assert ch is None
        return
    assert ch is not None and np.array_equal(ch.indices, want)
    assert np.array_equal(ch.base_bits, base.view(torch.int16).numpy().ravel()[want].view(np.uint16))
    assert np.array_equal(ch.target_bits, target.view(torch.int16).numpy().ravel()[want].view(np.uint16))


@pytest.mark.parametrize("size", [0, 1, 1000, (digest._PUT_BLOCK // 2) * 3 + 7])  # one block ... several blocks
def test_put_and_digest_one_block_and_block_walk_agree(size: int) -> None:
    rng = np.random.default_rng(size)
    src = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    idx = np.unique(rng.integers(0, max(size, 1), min(size, 300))) if size else np.empty(0, dtype=np.int64)
    vals = rng.integers(0, 1 << 16, idx.size, dtype=np.uint16)
    want = src.copy()
    want[idx] = vals
    kept = src.copy()
    assert digest_after_put(src, idx, vals) == _bits_digest(want)
    assert np.array_equal(src, kept)  # written aside
    dst, old = src.copy(), np.empty(idx.size, dtype=np.uint16)
    before, after = put_and_digests(dst, idx, vals, old)
    assert (before, after) == (_bits_digest(src), _bits_digest(want))
    assert np.array_equal(dst, want) and np.array_equal(old, src[idx])
    dst = src.copy()
    assert put_and_digest(dst, idx, vals) == _bits_digest(want) and np.array_equal(dst, want)
    if size:
        with pytest.raises(IndexError):
            put_and_digest(src.copy(), np.array([size], dtype=np.int64), vals[:1] if vals.size else np.zeros(1, np.uint16))


def test_shared_prefix_matches_a_bytewise_scan() -> None:
    rng = np.random.default_rng(0)
    for _ in range(3000):
        a, b = (bytes(rng.choice(list(b"ab."), rng.integers(0, 12))) for _ in range(2))
        scan = 0
        while scan < min(len(a), len(b)) and a[scan] == b[scan]:
            scan += 1
        assert _table._shared_prefix(a, b) == scan, (a, b)


def test_snapshot_diffs_against_the_tensor_it_holds_now() -> None:
    """The snapshot keeps each tensor's bits view between versions: a tensor replaced in it
    (not written in place) is diffed as it is now, not through the stale view."""
    from sparsesync.codec.snapshot import Snapshot

    state = {f"t{i}": torch.arange(64, dtype=torch.float32).reshape(8, 8) + i for i in range(3)}
    snap = Snapshot(state, 0)
    snap.diff_encode({n: t.clone() for n, t in state.items()}, 1)  # the views are taken here
    snap.state["t1"] = state["t1"] * 2  # replaced
    target = {n: t.clone() for n, t in snap.state.items()}
    target["t1"].view(-1)[5] = -1.0
    enc = snap.diff_encode(target, 2)
    assert list(enc.changes) == ["t1"] and enc.changes["t1"].indices.tolist() == [5]
    assert torch.equal(snap.state["t1"], target["t1"]) and torch.equal(state["t1"], torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1)
