"""`AdapterMeta`: what every commit of an adapter run says about its adapter, as a plain dataclass.

The commit record's `adapter` field (docs/protocol.md, "LoRA adapter runs") carries one: the
base model's id and digest, the adapter's `adapter_config.json` and the adapter tensors' one
dtype. This module holds the value only; reading it from a commit (bounded, field by field) is
the protocol's (`sparsesync.protocol.records`), building one from a PEFT model or an adapter
folder is `sparsesync.lora.state`'s.

Guarantees: `to_dict()` gives the commit field's JSON object, with exactly the four fields a
reader requires; the dataclass is frozen (a publisher replaces it, never edits it in place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ADAPTER_DTYPES = ("float32", "bfloat16", "float16")  # the dtypes an adapter run's tensors may have


@dataclass(frozen=True)
class AdapterMeta:
    """What every commit of an adapter run says about the adapter (the commit's `adapter` field;
    `sparsesync.lora.bridge` is the PEFT side)."""

    base_model: str  # the base model's id or path, as the trainer named it
    base_digest: str  # state digest of the base weights, checkpoint key set (codec.state_digest)
    config: dict[str, Any] = field(default_factory=dict)  # the adapter_config.json content
    dtype: str = ""  # the adapter tensors' dtype ("float32", "bfloat16"); "" until the first publish fills it

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def alpha(self) -> float:
        return float(self.config["lora_alpha"])

    @property
    def target_modules(self) -> list[str] | str:
        return self.config["target_modules"]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "base_digest": self.base_digest,
            "config": self.config,
            "dtype": self.dtype,
        }
