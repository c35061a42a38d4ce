"""The bitwise diff: exact against a naive definition for every dtype and chunking, non-contiguous
inputs, layout differences named, composed changes equal to the direct diff, deterministic encoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsesync.codec import (
    compose_changes,
    diff_state,
)
from sparsesync.codec.diff import bits_view, to_np_bits
from sparsesync.errors import PatchMismatchError
from tests.support.patches import DTYPES, _classed_case, _encode, bits, make_pair


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
