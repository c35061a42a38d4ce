"""Small stand-ins for a model's weights and an optimizer step, for protocol tests.

A "model" is a dict of bf16 tensors (plus one fp32 tensor, as norms often are); a "training
step" moves a random fraction of elements by a few bf16 ulps, the way RL updates do.
"""

from __future__ import annotations

import torch

SHAPES = {
    "model.embed_tokens.weight": (256, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.input_layernorm.weight": (64,),
    "lm_head.weight": (256, 64),
}


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in SHAPES.items():
        dtype = torch.float32 if name.endswith("layernorm.weight") else torch.bfloat16
        state[name] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    return state


def train_step(state: dict[str, torch.Tensor], g: torch.Generator, density: float = 0.01) -> dict[str, torch.Tensor]:
    """A new state where about `density` of each tensor's elements changed by 1-2 ulps."""
    out = {}
    for name, t in state.items():
        t = t.clone()
        ints = t.view(torch.int16 if t.element_size() == 2 else torch.int32).view(-1)
        n = max(1, int(ints.numel() * density))
        idx = torch.randint(0, ints.numel(), (n,), generator=g)
        step = torch.randint(1, 3, (n,), generator=g, dtype=ints.dtype) * (
            torch.randint(0, 2, (n,), generator=g, dtype=ints.dtype) * 2 - 1
        )
        ints[idx] += step
        out[name] = t
    return out


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), f"{name} differs"
