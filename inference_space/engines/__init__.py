"""Inference engines behind a replica: one small interface (`base.Engine`), two implementations,
each with a LoRA variant serving base + adapter for an adapter run.

`make_engine("embedded" | "vllm", model_dir, ..., adapter=None)` picks the engine from one table
(`_TABLE`: engine kind x adapter run or not) and imports only the engine asked for, so the
embedded engine works without vLLM installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference_space.engines.base import Engine, PauseStats
from inference_space.engines.sampling import Completion, SamplingParams
from sparsesync.errors import ConfigError
from sparsesync.lora.meta import AdapterMeta

ENGINES = ("embedded", "vllm")

# (kind, serves a LoRA adapter run) -> "module:class" of the engine; imported only when asked for
_TABLE: dict[tuple[str, bool], str] = {
    ("embedded", False): "inference_space.engines.embedded:EmbeddedEngine",
    ("embedded", True): "inference_space.engines.embedded_adapter:EmbeddedAdapterEngine",
    ("vllm", False): "inference_space.engines.vllm_engine:VllmEngine",
    ("vllm", True): "inference_space.engines.vllm_adapter:VllmAdapterEngine",
}

__all__ = ["ENGINES", "Completion", "Engine", "PauseStats", "SamplingParams", "make_engine"]


def make_engine(kind: str, model_dir: str | Path, *, adapter: AdapterMeta | None = None, **kwargs: Any) -> Engine:
    """Build the engine `kind` serving the model in `model_dir` (with `adapter=AdapterMeta`: the
    base model plus that LoRA run's adapter versions)."""
    home = _TABLE.get((kind, adapter is not None))
    if home is None:
        raise ConfigError(f"engine '{kind}': unknown, expected one of {', '.join(ENGINES)}")
    module, name = home.split(":")
    engine: Callable[..., Engine] = getattr(importlib.import_module(module), name)  # an Engine subclass
    return engine(model_dir, **kwargs) if adapter is None else engine(model_dir, adapter=adapter, **kwargs)
