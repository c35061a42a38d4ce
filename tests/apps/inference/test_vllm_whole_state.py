"""Issue 48, section 1, vLLM engine: a replica labels a completion N only when every checkpoint
tensor its forward pass reads holds version N's bits, not only the layers version N touched.

A real vLLM engine follows version 1 of a run; then something in the worker changes the final
norm's weight, which version 2 leaves as it is (in place, or a new Parameter object). The replica
must end at version 2 (its live layers read back bit for bit equal to version 2, and greedy output
equal to a fresh engine of version 2) or refuse loudly: never report version 2 over the edit.
The read-back compares bit patterns: -0.0 is not 0.0. Skipped only where vLLM cannot be imported.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.vllm_guard import VLLM_MARKS

pytestmark = VLLM_MARKS

from tests.apps.inference.test_vllm import _read_back  # noqa: E402
from tests.apps.inference.test_whole_state import NORM, follow_edit_follow  # noqa: E402
from tests.support.generation import greedy  # noqa: E402

_KEEP: list[object] = []  # single-process vLLM engines stay alive until the module ends (see test_vllm)


def _zero_norm_in_place(worker):  # type: ignore[no-untyped-def]
    worker.model_runner.get_model().model.norm.weight.data.zero_()


def _replace_norm(worker):  # type: ignore[no-untyped-def]
    norm = worker.model_runner.get_model().model.norm
    norm.weight = torch.nn.Parameter(torch.zeros_like(norm.weight), requires_grad=False)


@pytest.mark.parametrize("edit", [_zero_norm_in_place, _replace_norm], ids=["in-place", "replaced-parameter"])
def test_vllm_replica_never_reports_a_version_over_an_edited_parameter(tiny, tmp_path, caplog, edit):
    from inference_space.engines.vllm_engine import VllmEngine
    from sparsesync.codec import tensor_digests

    engine = VllmEngine(tiny, kv_cache_memory_bytes=16 << 20)
    _KEEP.append(engine)
    with caplog.at_level("ERROR"):
        follower, trainer = follow_edit_follow(
            engine, tiny, str(tmp_path / "b"), lambda: engine.llm.collective_rpc(edit)
        )
    # refusing loudly (no version, degraded) would also keep the promise; these engines recover
    assert engine.check_error is None, f"refused instead of reloading: {engine.check_error}"
    assert engine.weight_version == 2 and follower.status().current_version == 2
    live = _read_back(engine)  # from vLLM's own layers, not the mirror
    assert not torch.equal(live[NORM], torch.zeros_like(live[NORM])), "labels v2 over the zeroed norm"
    assert tensor_digests(live) == tensor_digests(trainer.state), "the replica labels v2 but its layers hold other bits"
    fresh = VllmEngine(trainer.save_version(tmp_path / "v2"), kv_cache_memory_bytes=16 << 20)
    _KEEP.append(fresh)
    assert greedy(engine) == greedy(fresh), "labels v2, computes otherwise"
    assert any("reloading all weights" in r.getMessage() for r in caplog.records), "the edit went unseen"


def test_read_back_compares_bit_patterns():
    """-0.0 and 0.0 differ, and so do a subnormal and zero, read from a parameter; through a
    packed kernel's product (which cannot show them) both read as +0.0, as documented."""
    from sparsesync.integrations.vllm import readback

    got = torch.tensor([0.0, 1.0, 0.0, 2.0], dtype=torch.bfloat16)
    want = torch.tensor([-0.0, 1.0, torch.finfo(torch.bfloat16).tiny / 4, 2.0], dtype=torch.bfloat16)
    assert readback.count_differing(got, want) == 2
    assert readback.count_differing(got, want, through_kernel=True) == 0
    nan_a = torch.tensor([0x7FC0, 0x7FC1], dtype=torch.int16).view(torch.bfloat16)  # two NaN payloads
    assert readback.count_differing(nan_a[:1], nan_a[1:]) == 1
    assert readback.count_differing(got.float(), got) == 0  # a wider copy (an fp32 bias) compares exactly
    assert readback.count_differing(got.float(), want) == 2
