"""The model matrix: every architecture x every engine serves exactly version N.

For each tiny model (Qwen3 tied, Qwen3 untied, Llama-style, Qwen3-MoE top-2) and each engine
(embedded transformers, vLLM CPU), a replica follows 5 versions of ~1% patches (each touching a random
half of the tensors: parts of fused layers, some experts) through a local bucket. Before each update it answers a long prompt (so vLLM's prefix cache holds that
prompt's KV from the old weights); after it, the same prompt must give the token ids of, and
logprobs within 1e-3 of, a fresh engine started from that version's weights. One replica
engine per model and engine kind; the fresh vLLM engines stay alive to the end of the module
(dropping a single-process vLLM engine tears down vLLM's process-global state).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the engines need transformers (pip install -e '.[embedded]')")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from inference_space.engines import SamplingParams, make_engine  # noqa: E402
from inference_space.testing import Trainer  # noqa: E402
from sparsesync.protocol.follower import Follower  # noqa: E402
from sparsesync.protocol.publisher import Publisher  # noqa: E402
from sparsesync.tiny_model import ARCHS, build_tiny_model  # noqa: E402

try:
    import vllm  # noqa: F401

    _VLLM_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    _VLLM_ERROR = f"{type(e).__name__}: {e}"

# ~240 tokens: long enough for several full KV blocks, so the prefix cache matters
LONG_PROMPT = " ".join(f"Repeat the letter {c}: {c} {c} {c}. Count to 5: 0 1 2 3 4 5." for c in "abcdefghijklmnop")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
VERSIONS = 5
_KEEP: list[object] = []

ENGINES = [
    pytest.param("embedded", id="embedded"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vLLM cannot be imported here ({_VLLM_ERROR})")],
    ),
]


def _engine(kind: str, model_dir):  # type: ignore[no-untyped-def]
    if kind == "vllm":
        return make_engine("vllm", model_dir, kv_cache_memory_bytes=16 << 20, max_model_len=512)
    return make_engine("embedded", model_dir)


def _answer(engine):  # type: ignore[no-untyped-def]
    (c,) = engine.generate(LONG_PROMPT, GREEDY)
    return c.token_ids, c.logprobs, c.weight_version


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("arch", ARCHS)
def test_replica_serves_exactly_version_n(arch, kind, tmp_path):
    if kind == "embedded":
        follow_and_compare(arch, kind, tmp_path)
        return
    # each vLLM cell in its own process: single-process vLLM keeps process-global parallel
    # state, and an MoE engine cannot start where a dense one set it up (no expert-parallel group)
    code = f"from tests.test_inference_matrix import follow_and_compare; follow_and_compare({arch!r}, 'vllm', {str(tmp_path)!r})"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    tail = [ln for ln in (proc.stdout + proc.stderr).splitlines() if " INFO " not in ln and " WARNING " not in ln][-25:]
    assert proc.returncode == 0, "\n".join(tail)


def follow_and_compare(arch: str, kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The matrix cell (see module docstring); raises AssertionError on a mismatch."""
    tmp_path = Path(tmp_path)
    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch=arch)
    replica = _engine(kind, model_dir)
    _KEEP.append(replica)
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(model_dir, seed=11)
    follower = Follower(bucket, hook=replica, poll_interval=0.05)
    answers = []
    with Publisher(bucket, anchor_every=0) as pub:
        for step in range(1, VERSIONS + 2):  # version 1 is the anchor; then 5 deltas
            _answer(replica)  # warms the prefix cache with the old weights
            version = pub.publish(trainer.step(density=0.01, scale=0.05, tensor_fraction=0.5), step)
            pub.flush()
            assert follower.sync_once() == version
            assert follower.status().state == "following", follower.status().last_error
            ids, logps, served = _answer(replica)
            assert served == version
            if step == 1:
                continue  # the anchor: a full load; the deltas below are what is under test
            fresh = _engine(kind, trainer.save_version(tmp_path / f"v{version}"))
            _KEEP.append(fresh)
            ref_ids, ref_logps, _ = _answer(fresh)
            assert ids == ref_ids, f"{arch}/{kind} version {version}: token ids differ from a fresh engine"
            worst = max(abs(a - b) for a, b in zip(logps, ref_logps, strict=True))
            assert worst <= 1e-3, f"{arch}/{kind} version {version}: logprobs differ from a fresh engine by {worst:.4f}"
            answers.append((ids, logps))
    assert follower.status().versions_applied == VERSIONS + 1
    assert len({str(a) for a in answers}) > 1, "the updates never changed an answer: the test proves nothing"
