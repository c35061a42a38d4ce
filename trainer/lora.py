"""LoRA training (`[lora] enabled = true`): the policy is the base model plus a PEFT adapter,
and what the trainer publishes is the adapter (an adapter run, sparsesync.lora.bridge), not the
merged weights.

Guarantee: `lora_policy` is deterministic for a seed (the adapter's init draws from torch's
global generator after `torch.manual_seed`), so `publish_initial_adapter` (the demo, before
its replicas start) and the trainer publish the same version 0, which the trainer then resumes
from with a digest check.
"""

from __future__ import annotations

from typing import Any

import torch

from sparsesync.lora.meta import AdapterMeta
from sparsesync.lora.state import meta_from_peft
from sparsesync.protocol.writer.publisher import Publisher
from trainer.config import TrainerConfig
from trainer.policy import load_policy, publish_state, resolve_precision


def lora_policy(model: torch.nn.Module, cfg: TrainerConfig, dtype: torch.dtype) -> Any:
    """`model` with a fresh LoRA adapter from `[lora]`; only the adapter is trainable, in `dtype`."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, cfg.lora.peft(), autocast_adapter_dtype=False)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    peft_model.train()
    return peft_model


def adapter_meta(model: Any, cfg: TrainerConfig, publish_dtype: torch.dtype) -> AdapterMeta:
    """The adapter run's metadata: base named as `[model] path`, digested as replicas load it."""
    return meta_from_peft(model, base_model=cfg.model.path, dtype=publish_dtype)


def publish_initial_adapter(cfg: TrainerConfig) -> None:
    """Publish version 0 (the adapter as initialised) of an adapter run before any replica
    starts, so replicas know the run's adapter and base; the trainer resumes from it."""
    device, master, publish = resolve_precision(cfg)
    torch.manual_seed(cfg.optim.seed)
    model = lora_policy(load_policy(cfg, device, master), cfg, master)
    with Publisher(cfg.sync.bucket, adapter=adapter_meta(model, cfg, publish), anchor_every=cfg.sync.anchor_every,
                   effort=cfg.sync.effort) as pub:
        pub.publish(publish_state(model, publish), 0)
