"""Old home of the vLLM plugin, kept for installs whose entry-point metadata predates the move
(`pip install -e .` rewrites it to `sparsesync.integrations.vllm.plugin:register`)."""

from sparsesync.integrations.vllm.plugin import BACKEND, register

__all__ = ["BACKEND", "register"]
