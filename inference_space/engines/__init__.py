"""Inference engines behind a replica: one small interface (`base.Engine`), two implementations.

`make_engine("embedded" | "vllm", model_dir, ...)` imports only the engine asked for, so the
embedded engine works without vLLM installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference_space.engines.base import Completion, Engine, PauseStats, SamplingParams
from sparsesync.errors import ConfigError

ENGINES = ("embedded", "vllm")

__all__ = ["ENGINES", "Completion", "Engine", "PauseStats", "SamplingParams", "make_engine"]


def make_engine(kind: str, model_dir: str | Path, **kwargs: Any) -> Engine:
    """Build the engine `kind` serving the model in `model_dir` (with `adapter=AdapterMeta`: the
    base model plus that LoRA run's adapter versions)."""
    if kwargs.get("adapter") is not None:
        from inference_space.engines.adapters import make_adapter_engine

        return make_adapter_engine(kind, model_dir, **kwargs)
    kwargs.pop("adapter", None)
    if kind == "embedded":
        from inference_space.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(model_dir, **kwargs)
    if kind == "vllm":
        from inference_space.engines.vllm_engine import VllmEngine

        return VllmEngine(model_dir, **kwargs)
    raise ConfigError(f"engine '{kind}': unknown, expected one of {', '.join(ENGINES)}")
