"""Helpers for tests and benchmarks of replicas: trainer-like weight updates of a model folder.

`Trainer(model_dir)` holds a model's state dict (checkpoint names, bf16), takes "optimizer
steps" that move a fraction of elements, and can write any version back out as a model folder
so a fresh engine can load exactly that version. Deterministic for a seed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

PROMPTS = ["Repeat the letter a:", "Repeat the letter x: x x", "Count to 5:"]


class Trainer:
    """A stand-in trainer over a real model folder (see module docstring)."""

    def __init__(self, model_dir: str | Path, seed: int = 0) -> None:
        from safetensors.torch import load_file

        self.model_dir = Path(model_dir)
        self.state: dict[str, torch.Tensor] = {}
        for f in sorted(self.model_dir.glob("*.safetensors")):
            self.state.update(load_file(str(f)))
        self.g = torch.Generator().manual_seed(seed)

    def step(self, density: float = 0.02, scale: float = 0.05, tensor_fraction: float = 1.0) -> dict[str, torch.Tensor]:
        """Move `density` of the elements of a random `tensor_fraction` of the tensors (at least
        one) by noise of std `scale` (new tensors). A fraction below 1 is what RL on a MoE
        model does (only the routed experts get gradients) and touches parts of fused layers."""
        names = sorted(self.state)
        keep = torch.rand(len(names), generator=self.g) < tensor_fraction
        keep[int(torch.randint(0, len(names), (1,), generator=self.g))] = True
        out = {}
        for name, move in zip(names, keep.tolist(), strict=True):
            t = self.state[name]
            if not move:
                out[name] = t
                continue
            t = t.clone()
            flat = t.view(-1)
            n = max(1, int(flat.numel() * density))
            idx = torch.randint(0, flat.numel(), (n,), generator=self.g)
            noise = torch.randn(n, generator=self.g) * scale
            flat[idx] = (flat[idx].float() + noise).to(t.dtype)
            out[name] = t
        self.state = out
        return out

    def save_version(self, out_dir: str | Path) -> Path:
        """The current state as a model folder (config and tokenizer copied from the base)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(self.model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(
            {k: v.contiguous() for k, v in self.state.items()},
            str(out / "model.safetensors"),
            metadata={"format": "pt"},
        )
        return out


def follow_then_break(engine, model_dir: str | Path, bucket: str, break_engine):  # type: ignore[no-untyped-def]
    """A replica of `engine` follows version 1 of a run, then `break_engine()` runs and version 2
    is published and synced. Returns the replica (for tests of what a broken engine reports)."""
    from inference_space.replica import Replica
    from sparsesync.protocol.writer.publisher import Publisher

    trainer = Trainer(model_dir, seed=4)
    replica = Replica(engine, bucket)
    assert replica.follower is not None
    with Publisher(bucket, anchor_every=0) as pub:
        pub.publish(trainer.step(), 1)
        pub.flush()
        assert replica.follower.sync_once() == 1 and replica.status()["state"] == "following"
        break_engine()
        pub.publish(trainer.step(), 2)
        pub.flush()
        replica.follower.sync_once()
    return replica
