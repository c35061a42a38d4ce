"""The device apply and the mirror-less follower on each device: the CPU case runs in CI (the same
torch code on CPU tensors), the CUDA case is marked `gpu` (scripts/gpu_check.sh runs it).
Covered: `device_apply.apply_on_device` bit-equal to the C path over the edge cases of
tests/codec/test_device_apply.py, undone on a target mismatch; the embedded engine on the device
with no host mirror reaching the run's bits version by version (on CUDA by default)."""

from __future__ import annotations

import pytest
import torch

from sparsesync.codec import apply_patch, read_patch
from sparsesync.codec import device_apply as D
from sparsesync.errors import DigestMismatchError
from tests.codec.test_device_apply import _edge_state, _patch
from tests.gpu.test_paths import DEVICES
from tests.support.patches import _case, _clone, _raw_patch, _span, assert_bit_equal


def _on(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in state.items()}


def _host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in state.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_apply_is_bit_equal_to_the_c_path_and_all_or_nothing(device):
    base, target = _edge_state()
    data = _patch(base, target)
    c_path = _clone(base)
    apply_patch(read_patch(data), c_path)
    work = _on(base, device)
    D.apply_on_device(read_patch(data), work)
    assert_bit_equal(_host(work), c_path)
    base, target = _case()
    raw = _raw_patch(base, target)
    s, _ = _span(raw, "x::values")
    work = _on(base, device)
    with pytest.raises(DigestMismatchError, match="undone"):
        D.apply_on_device(read_patch(raw[:s] + bytes([raw[s] ^ 1]) + raw[s + 1 :]), work)
    assert_bit_equal(_host(work), base)


@pytest.mark.parametrize("device", DEVICES)
def test_an_embedded_engine_with_no_host_mirror_follows_a_run_on_its_device(device, tiny, tmp_path):
    pytest.importorskip("transformers")
    from inference_space.engines.embedded import EmbeddedEngine
    from sparsesync.protocol.follower.engine_held import HeldEngine
    from sparsesync.protocol.follower.follower import Follower
    from tests.protocol.follower.test_engine import Versions

    engine = EmbeddedEngine(tiny, device=device, device_state=None if device == "cuda" else True)
    assert engine.holds_device_state  # on CUDA by default
    run = Versions(str(tmp_path / "run"), engine.state_dict())
    try:
        f = Follower(str(tmp_path / "run"), engine)
        assert isinstance(f._held, HeldEngine) and f.mirror == {}
        for v in (1, 2, 3, 4):
            run.publish(v)
            assert f.sync_once() == v and engine.weight_version == v
            assert_bit_equal(engine.state_dict(), run.states[v])
        assert f.status().anchor_loads == 1
    finally:
        run.pub.close()
