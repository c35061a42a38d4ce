"""Realistic RL weight deltas for the codec benchmark (imported by benchmarks/codec_bench.py).

A Qwen3-like layout scaled to a parameter budget; bf16 weights drawn per tensor with a per-layer
scale and heavy tails; one AdamW step at an RL learning rate, either with fp32 master weights
(master = bf16 weight + a sub-ulp residual, uniform in the rounding interval, as after many
steps) or with pure bf16 parameters (the update is rounded into bf16 directly). The Adam
direction m/sqrt(v) is drawn per element (|u| mostly 0.1-1, as in steady-state Adam).
"""

from __future__ import annotations

import math

import torch


def qwen_like_shapes(n_params: float) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a Qwen3-style decoder with about `n_params` parameters (0.6e9: Qwen3-0.6B)."""
    scale = (n_params / 0.6e9) ** 0.5
    hidden = max(64, int(1024 * scale) // 64 * 64)
    inter = 3 * hidden
    heads_dim = 2 * hidden
    kv_dim = hidden
    vocab = max(256, int(151936 * min(1.0, scale)) // 64 * 64)
    per_layer = hidden * heads_dim * 2 + hidden * kv_dim * 2 + 3 * hidden * inter
    layers = max(1, round((n_params - vocab * hidden) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (heads_dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, heads_dim)
        shapes[p + "self_attn.q_norm.weight"] = (128,)
        shapes[p + "self_attn.k_norm.weight"] = (128,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def make_weights(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights: norms near 1 (0.3-2), matrices ~ t-distributed with a per-layer std of
    0.01-0.05 (embeddings 0.03), the way pretrained checkpoints look."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.empty(shape).uniform_(-1, 1, generator=g).mul_(1.0).exp_().mul_(0.8)
        else:
            std = (
                0.03
                if "embed" in name
                else math.exp(torch.empty(()).uniform_(math.log(0.01), math.log(0.05), generator=g).item())
            )
            t = torch.randn(shape, generator=g)
            # heavy tails: scale a random 2% of elements up by 3-6x
            tail = torch.rand(shape, generator=g) < 0.02
            t[tail] *= torch.empty(int(tail.sum()), dtype=torch.float32).uniform_(3, 6, generator=g)
            t.mul_(std)
        out[name] = t.to(torch.bfloat16)
    return out


def adam_direction(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Steady-state Adam direction m/sqrt(v): per element |u| mostly in 0.1-1, random sign."""
    u = torch.randn(shape, generator=g).mul_(0.4)
    return u.clamp_(-1.0, 1.0)


def step(
    weights: dict[str, torch.Tensor], lr: float, *, master: bool, seed: int = 1, wd: float = 0.0
) -> dict[str, torch.Tensor]:
    """The bf16 weights after one AdamW step (fp32 master weights if `master`, else pure bf16)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        u = adam_direction(tuple(w.shape), g)
        if wd:
            u.add_(w.float(), alpha=wd)
        if master:
            w32 = w.float()
            # sub-ulp residual of the master weight: uniform in the bf16 rounding interval
            ulp = (w32.abs().clamp_min(1e-30).log2().floor() - 7).exp2()
            w32.add_(torch.rand(w.shape, generator=g).sub_(0.5).mul_(ulp))
            del ulp
            w32.sub_(u.mul_(lr))
            out[name] = w32.to(torch.bfloat16)
        else:
            out[name] = (w.float() - u.mul_(lr)).to(torch.bfloat16)
    return out


def provenance() -> dict[str, str]:
    """What a results file records about its run: the exact command and the commit of this tree
    (`git describe --dirty`: "-dirty" when it had uncommitted changes)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # refresh the index's file times first: without it a file touched but unchanged reads as "-dirty"
    subprocess.run(["git", "-C", str(root), "update-index", "-q", "--refresh"], capture_output=True)
    commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=40"],
                            capture_output=True, text=True).stdout.strip()
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit or "unknown"}
