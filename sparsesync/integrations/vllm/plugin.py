"""vLLM general plugin: registers the `sparsesync` weight-transfer backend in every vLLM process.

Loaded by vLLM through the `vllm.general_plugins` entry point `sparsesync` (pyproject.toml), so
`vllm serve MODEL --weight-transfer-config '{"backend": "sparsesync"}'` finds the backend;
`sparsesync.integrations.vllm.VllmEngine` (and the replica app) also call `register()` itself. Safe to call any number of times, and it imports
only vLLM's factory (the backend module is loaded lazily when an engine is created).
"""

from __future__ import annotations

BACKEND = "sparsesync"


def register() -> None:
    """Register `sparsesync` with vLLM's `WeightTransferEngineFactory` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "sparsesync.integrations.vllm.backend", "SparsesyncWeightTransferEngine"
        )
