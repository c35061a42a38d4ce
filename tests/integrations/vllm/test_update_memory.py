"""A vLLM update's temporaries are bounded (issue 42): the read-back compares in blocks, never a
whole tensor's float copies at once, and the reload hands each decoder layer's temporaries back
to the OS before the next layer. vLLM-shaped modules built here (no engine start)."""

from __future__ import annotations

import pytest
import torch

from sparsesync.integrations.vllm import readback
from sparsesync.integrations.vllm.layout import Layout

pytestmark = pytest.mark.vllm

DOWN = "model.layers.0.mlp.down_proj.weight"
NORM = "model.norm.weight"


class _Packed(torch.nn.Module):
    """A linear layer whose CPU kernel computes with a packed copy of its weight (oneDNN-like)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        self.input_size = w.shape[1]
        packed = w.clone()
        self.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)


def _model(down: torch.Tensor, norm: torch.Tensor) -> torch.nn.Module:
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.norm = torch.nn.Module()
    root.model.norm.weight = torch.nn.Parameter(norm.clone(), requires_grad=False)
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.model.layers[0].mlp = torch.nn.Module()
    root.model.layers[0].mlp.down_proj = _Packed(down)
    return root


def test_read_back_compares_in_bounded_blocks_and_still_finds_every_difference(monkeypatch):
    monkeypatch.setattr(readback, "_COMPARE_ELEMS", 4096, raising=False)  # (main compared whole tensors)
    monkeypatch.setattr(readback, "_PROBE_ROWS", 64)
    seen: list[int] = []
    real = readback.bits
    monkeypatch.setattr(readback, "bits", lambda t, **kw: (seen.append(t.numel()), real(t, **kw))[1])
    g = torch.Generator().manual_seed(0)
    down = torch.randn(300, 200, generator=g).to(torch.bfloat16)
    norm = torch.randn(200, generator=g).to(torch.bfloat16)
    model = _model(down, norm)
    layout = Layout({DOWN: (300, 200), NORM: (200,)})
    expected = {DOWN: down.clone(), NORM: norm.clone()}
    expected[NORM][3] = -0.0 if norm[3] == 0 else expected[NORM][3]
    assert readback.check(model, layout, expected) == []
    assert seen and max(seen) <= 4096 + 200, f"compared {max(seen)} elements at once"

    expected[DOWN][7, 11] += 1  # one element of a probed (packed) layer
    expected[DOWN][299, 199] += 1  # and the last one
    expected[NORM][5] = torch.finfo(torch.bfloat16).tiny / 4 if norm[5] == 0 else norm[5] + 1
    got = readback.check(model, layout, expected)
    assert got == [
        f"tensor '{DOWN}': 2 of 60000 elements differ from the version (model.layers.0.mlp.down_proj.weight)",
        f"tensor '{NORM}': 1 of 200 elements differ from the version (model.norm.weight)",
    ]


def test_bit_patterns_compare_in_blocks(monkeypatch):
    """Signed zeros and subnormals differ (issue 48), block by block as whole; only through a
    packed kernel's product (`through_kernel`) do they all read as +0.0."""
    monkeypatch.setattr(readback, "_COMPARE_ELEMS", 8)
    a = torch.tensor([0.0, -0.0, 1e-40, 1.0, 2.0] * 5, dtype=torch.float32).view(5, 5)
    b = torch.tensor([-0.0, 0.0, 0.0, 1.0, 3.0] * 5, dtype=torch.float32).view(5, 5)
    assert readback.count_differing(a, b) == 20 == int((a.view(torch.int32) != b.view(torch.int32)).sum())
    assert readback.count_differing(a, b, through_kernel=True) == 5


def test_full_reload_hands_each_layers_temporaries_back_before_the_next():
    pytest.importorskip("vllm", reason="the backend runs inside vLLM")
    from sparsesync.integrations.vllm import backend

    names = [NORM, "lm_head.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.10.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"]
    tensors = {n: torch.zeros(2) for n in names}
    events: list[str] = []
    real = backend.release_freed_memory
    try:
        backend.release_freed_memory = lambda: events.append("trim")  # type: ignore[assignment]
        for name, _ in backend._layer_by_layer(tensors):
            events.append(name)
    finally:
        backend.release_freed_memory = real  # type: ignore[assignment]
    assert sorted(e for e in events if e != "trim") == sorted(names)
    layers = [e.split(".mlp")[0].split(".self_attn")[0] if ".layers." in e else e for e in events]
    # each decoder layer's tensors together, a trim between layers
    assert events == ["lm_head.weight", NORM, "trim",
                      "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "trim",
                      "model.layers.1.mlp.up_proj.weight", "trim", "model.layers.10.self_attn.q_proj.weight"], layers
