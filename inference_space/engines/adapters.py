"""Which engine serves a LoRA adapter run: `make_adapter_engine(kind, model_dir, adapter=...)`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference_space.engines.base import Engine
from sparsesync.errors import ConfigError


def make_adapter_engine(kind: str, model_dir: str | Path, **kwargs: Any) -> Engine:
    """The `kind` engine serving the base in `model_dir` plus the adapter run `kwargs["adapter"]`."""
    if kind == "embedded":
        from inference_space.engines.embedded_adapter import EmbeddedAdapterEngine

        return EmbeddedAdapterEngine(model_dir, **kwargs)
    if kind == "vllm":
        from inference_space.engines.vllm_adapter import VllmAdapterEngine

        return VllmAdapterEngine(model_dir, **kwargs)
    raise ConfigError(f"engine '{kind}': unknown, expected embedded or vllm")
