"""The model matrix: every architecture x every engine serves exactly version N, started as users start.

For each tiny model (Qwen3 tied, Qwen3 untied, Llama-style, and three Qwen3-MoE configurations:
4 experts top-2; 8 experts top-2 with `norm_topk_prob` false; 6 experts top-3 with
`norm_topk_prob` true and dense MLP layers from `decoder_sparse_step`/`mlp_only_layers`) and each
engine (embedded transformers, vLLM CPU), a replica is started from the base model folder and
follows a run through a local bucket: version 1 is an anchor whose every tensor differs from
that base, then 5 versions of ~1% patches, each touching a random half of the tensors (parts
of fused layers, some experts). Before each update the replica answers a ~300-token prompt (so
vLLM's prefix cache holds that prompt's KV from the old weights); after it, the same prompt
must give the token ids of, and logprobs within 1e-3 of, a fresh engine started from that
version's weights. At the end the replica also answers a cold ~300-token prompt (never sent
before; both 300 tokens) and both are compared with the fresh engine of the final version. One replica engine
per model and engine kind; the fresh vLLM engines stay alive to the end of the cell (dropping a
single-process vLLM engine tears down vLLM's process-global state).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the engines need transformers (pip install -e '.[embedded]')")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from inference_space.engines import SamplingParams, make_engine  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from sparsesync.tiny_model import ARCHS, build_tiny_model  # noqa: E402
from tests.support.model_steps import Trainer  # noqa: E402

try:
    import vllm  # noqa: F401

    _VLLM_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    _VLLM_ERROR = f"{type(e).__name__}: {e}"

# cut to 300 tokens each: several full KV blocks (the prefix cache matters); the cold one shares
# no block with the warm one
WARM = " ".join(f"Repeat the letter {c}: {c} {c} {c}. Count to 5: 0 1 2 3 4 5." for c in "abcdefghijklmnopqrst")
COLD = (
    " ".join(
        f"Count to {d}: {' '.join('0123456789'[: d + 1])}. Write a word that starts with the letter {c}."
        for d, c in zip(range(10), "zyxwvutsrq", strict=True)
    )
    * 2
)
PROMPT_TOKENS = 300
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
VERSIONS = 5  # deltas after the anchor
_KEEP: list[object] = []

ENGINES = [
    pytest.param("embedded", id="embedded"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(_VLLM_ERROR is not None, reason=f"vLLM cannot be imported here ({_VLLM_ERROR})"),
        ],
    ),
]


def _engine(kind: str, model_dir):  # type: ignore[no-untyped-def]
    if kind == "vllm":
        return make_engine("vllm", model_dir, kv_cache_memory_bytes=16 << 20, max_model_len=512)
    return make_engine("embedded", model_dir)


def _answer(engine, prompt: str):  # type: ignore[no-untyped-def]
    ids = engine.tokenize(prompt)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    (c,) = engine.generate(ids, GREEDY)
    return c.token_ids, c.logprobs, c.weight_version


def _same(arch: str, kind: str, what: str, got, ref) -> None:  # type: ignore[no-untyped-def]
    assert got[0] == ref[0], f"{arch}/{kind} {what}: token ids differ from a fresh engine"
    worst = max(abs(a - b) for a, b in zip(got[1], ref[1], strict=True))
    assert worst <= 1e-3, f"{arch}/{kind} {what}: logprobs differ from a fresh engine by {worst:.4f}"


def _anchor_differing_everywhere(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The run's first version: the base with noise on every element, so no tensor (norms and
    routers included) equals the base the replica was started from."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for name, t in sorted(trainer.state.items()):
        new = (t.float() + torch.randn(t.shape, generator=g) * 0.02).to(t.dtype)
        assert not torch.equal(new, t), name
        out[name] = new
    trainer.state = out
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("arch", ARCHS)
def test_replica_serves_exactly_version_n(arch, kind, tmp_path):
    if kind == "embedded":
        follow_and_compare(arch, kind, tmp_path)
        return
    # each vLLM cell in its own process: single-process vLLM keeps process-global parallel
    # state, and an MoE engine cannot start where a dense one set it up (no expert-parallel group)
    code = (
        f"from tests.apps.inference.test_matrix import follow_and_compare; follow_and_compare({arch!r}, 'vllm', "
        f"{str(tmp_path)!r})"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    tail = [ln for ln in (proc.stdout + proc.stderr).splitlines() if " INFO " not in ln and " WARNING " not in ln][-25:]
    assert proc.returncode == 0, "\n".join(tail)


def follow_and_compare(arch: str, kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The matrix cell (see module docstring); raises AssertionError on a mismatch."""
    tmp_path = Path(tmp_path)
    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch=arch)  # the base the user downloaded
    replica = _engine(kind, model_dir)
    _KEEP.append(replica)
    bucket = str(tmp_path / "bucket")
    trainer = Trainer(model_dir, seed=11)
    follower = Follower(bucket, hook=replica, poll_interval=0.05)
    answers = []
    with Publisher(bucket, anchor_every=0) as pub:
        for step in range(1, VERSIONS + 2):  # version 1 is the anchor; then the deltas
            _answer(replica, WARM)  # warms the prefix cache with the old weights
            state = (
                _anchor_differing_everywhere(trainer)
                if step == 1
                else trainer.step(density=0.01, scale=0.05, tensor_fraction=0.5)
            )
            version = pub.publish(state, step)
            pub.flush()
            assert follower.sync_once() == version, follower.status().last_error
            assert follower.status().state == "following", follower.status().last_error
            got = _answer(replica, WARM)
            assert got[2] == version
            fresh = _engine(kind, trainer.save_version(tmp_path / f"v{version}"))
            _KEEP.append(fresh)
            _same(arch, kind, f"version {version} (warm prompt)", got, _answer(fresh, WARM))
            answers.append(got[:2])
    _same(arch, kind, f"version {version} (cold prompt)", _answer(replica, COLD), _answer(fresh, COLD))
    st = follower.status()
    assert st.versions_applied == VERSIONS + 1 and st.anchor_loads == 1, st
    assert len({str(a) for a in answers}) > 1, "the updates never changed an answer: the test proves nothing"
