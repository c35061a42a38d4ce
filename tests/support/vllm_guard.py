"""The marks of a test module that starts vLLM's engine in-process: `vllm`, and a skip naming why
when vLLM cannot be imported here. Importing this module sets VLLM_ENABLE_V1_MULTIPROCESSING=0
(unless set), before vLLM is first imported, so the engine runs in the test's process."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
try:
    import vllm  # noqa: F401

    VLLM_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    VLLM_ERROR = f"{type(e).__name__}: {e}"

VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        VLLM_ERROR is not None, reason=f"vLLM cannot be imported here ({VLLM_ERROR}); see scripts/setup.sh"
    ),
]
