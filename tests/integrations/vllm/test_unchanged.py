"""The check of the tensors a vLLM update did not send (issue 48, section 1), on vLLM-shaped
modules built here (no engine start): a parameter the forward pass reads is judged by its digest,
a packed CPU kernel by the identity of the module and kernel object its last read-back verified."""

from __future__ import annotations

import pytest
import torch

from sparsesync.codec import tensor_digest
from sparsesync.integrations.vllm import unchanged
from sparsesync.integrations.vllm.layout import Layout
from tests.integrations.vllm.test_update_memory import DOWN, NORM, _model

pytestmark = pytest.mark.vllm


def test_untouched_tensors_are_checked_by_digest_and_packed_kernels_by_identity():
    pytest.importorskip("vllm", reason="the read-back runs inside vLLM")
    g = torch.Generator().manual_seed(0)
    down = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    norm = torch.randn(32, generator=g).to(torch.bfloat16)
    model = _model(down, norm)
    layout = Layout({DOWN: (64, 32), NORM: (32,)})
    verify = {DOWN: [tensor_digest(down), "bfloat16"], NORM: [tensor_digest(norm), "bfloat16"]}
    kernels: unchanged.Kernels = {}

    problems = unchanged.check(model, layout, verify, kernels)  # the packed layer was never verified
    assert problems == [
        f"tensor '{DOWN}': the packed CPU kernel of 'model.layers.0.mlp.down_proj' is not the one last read back and "
        "verified"
    ]
    unchanged.remember(model, layout.locate(DOWN), kernels)
    assert unchanged.check(model, layout, verify, kernels) == []

    model.model.norm.weight.data[3] = -model.model.norm.weight.data[3]  # in place, behind the engine's back
    assert [p.split(":")[0] for p in unchanged.check(model, layout, verify, kernels)] == [f"tensor '{NORM}'"]
    # a new Parameter, the version's bits
    model.model.norm.weight = torch.nn.Parameter(norm.clone(), requires_grad=False)
    assert unchanged.check(model, layout, verify, kernels) == []
    zero = norm.clone()
    zero[zero == 0] = 1
    zero[5] = 0.0
    model.model.norm.weight = torch.nn.Parameter(zero, requires_grad=False)
    verify[NORM] = [
        tensor_digest(torch.where(torch.arange(32) == 5, torch.tensor(-0.0, dtype=torch.bfloat16), zero)),
        "bfloat16",
    ]
    assert len(unchanged.check(model, layout, verify, kernels)) == 1, "-0.0 in the version, +0.0 in the engine: differ"

    packed = model.model.layers[0].mlp.down_proj
    frozen = down.clone()
    packed.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, frozen, bias)  # re-packed behind its back
    assert any("down_proj" in p for p in unchanged.check(model, layout, verify, kernels))
