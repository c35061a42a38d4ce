"""vLLM's sparse path writes the tensors it holds as the checkpoint holds them with the device apply
(`integrations.vllm.device_sparse`), digests checked on the device, all or nothing. On this CPU
build of vLLM the linear layers are packed by their CPU kernels (not held: vLLM's loaders, GPU only)
while norms and embeddings are held, so a real CPU engine drives the held path."""

from __future__ import annotations

import pytest
import torch

from tests.support.vllm_guard import VLLM_MARKS

pytestmark = VLLM_MARKS

from sparsesync.codec import tensor_digest, tensor_digests  # noqa: E402
from sparsesync.codec.apply import SparseUpdate  # noqa: E402

NORM = "model.norm.weight"
LINEAR = "model.layers.0.mlp.down_proj.weight"


def _norm_of(worker):  # type: ignore[no-untyped-def]
    """Runs in the worker: the final norm's weight as the forward pass reads it."""
    return worker.model_runner.get_model().model.norm.weight.detach().clone()


def _bump_norm(worker):  # type: ignore[no-untyped-def]
    """Runs in the worker: one element of the final norm changed in place, behind the engine's back."""
    with torch.no_grad():
        worker.model_runner.get_model().model.norm.weight.view(-1)[1] += 1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _update(src: torch.Tensor, at: list[int], seed: int) -> tuple[SparseUpdate, torch.Tensor]:
    new = src.clone()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor(at, dtype=torch.int64)
    new.view(-1)[idx] = torch.randn(len(at), generator=g).to(src.dtype)
    new.view(-1)[idx[0]] = -0.0  # a signed zero must arrive as such
    return SparseUpdate(idx, new.view(-1)[idx].clone()), new


def test_held_tensors_are_written_and_checked_on_the_device_all_or_nothing(tiny):
    from inference_space.engines.vllm_engine import VllmEngine

    engine = VllmEngine(tiny, mode="auto")
    try:
        sync = engine.sync
        sync.mode = "sparse"  # the worker's sparse path (VllmEngine offers it on GPUs only)
        digests = tensor_digests(sync.source)
        upd, v1 = _update(sync.source[NORM], [0, 3, 17], seed=1)
        sent = sync.patch(1, {NORM: upd}, {**digests, NORM: tensor_digest(v1)}, full={NORM: v1})
        assert sent == [NORM]
        got = engine.llm.collective_rpc(_norm_of)[0]
        assert torch.equal(_bits(got), _bits(v1))

        upd2, v2 = _update(v1, [2, 5], seed=2)
        engine.llm.collective_rpc(_bump_norm)  # the engine no longer holds version 1's norm
        bumped = engine.llm.collective_rpc(_norm_of)[0]
        with pytest.raises(Exception, match="not at its base") as e:
            sync.patch(2, {NORM: upd2}, {**digests, NORM: tensor_digest(v2)}, full={NORM: v2})
        assert NORM in str(e.value)
        assert torch.equal(_bits(engine.llm.collective_rpc(_norm_of)[0]), _bits(bumped))  # every bit back

        # an update that also touches a layer held only in a packed CPU kernel: refused, the norm undone
        sync.digests[NORM] = tensor_digest(bumped)
        lin = sync.source[LINEAR]
        lin_upd, lin_new = _update(lin, [1], seed=3)
        upd3, v3 = _update(bumped, [4], seed=4)
        with pytest.raises(Exception, match="GPU-only"):
            sync.patch(3, {NORM: upd3, LINEAR: lin_upd},
                       {**digests, NORM: tensor_digest(v3), LINEAR: tensor_digest(lin_new)},
                       full={NORM: v3, LINEAR: lin_new})
        assert torch.equal(_bits(engine.llm.collective_rpc(_norm_of)[0]), _bits(bumped))
    finally:
        engine.close()
