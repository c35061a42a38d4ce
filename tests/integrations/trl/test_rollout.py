"""TRL's async GRPO rollout worker on real sparsesync replicas (sparsesync/integrations/trl/rollout.py).

Two embedded-engine replicas (inference_space over uvicorn on 127.0.0.1) follow a local bucket
that a real `AsyncGRPOTrainer` publishes to through `SparsesyncWeightTransfer` (fleet wait: one
replica serves version k before `send_weights` returns; the other polls slowly and lags, so
TRL's own counter would tag its old-version samples with the new version). TRL's own `AsyncRolloutWorker`, pointed
at both replicas by `follow_replicas`, runs in its spawned child and fills the trainer's rollout
queue. Generation is greedy, so each version has one completion for the prompt: every sample's
completion must be the one its tagged version produces (asked of a replica directly).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("aiohttp")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from sparsesync.errors import ConfigError  # noqa: E402
from sparsesync.integrations.trl import SparsesyncWeightTransfer, follow_replicas, parse_replica_urls  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.apps.inference.test_server import Server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
PROMPT = [{"role": "user", "content": "Repeat the letter a:"}]


def distinct_letters(completions: list, **_: object) -> list[float]:
    """Module-level: TRL's worker pickles its reward functions into a spawned child."""
    return [len(set(str(c))) / 10 for c in completions]


def test_replica_urls_are_checked() -> None:
    assert parse_replica_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="http"):
        parse_replica_urls(["a:1"])
    with pytest.raises(ConfigError):
        parse_replica_urls("")


def _greedy(url: str, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    return reply["choices"][0]["token_ids"], reply["choices"][0]["weight_version"]


def _samples(q, n: int, timeout: float = 120.0) -> list:  # noqa: ANN001
    out = []
    while len(out) < n:
        try:
            out.append(q.get(timeout=timeout))
        except queue.Empty:
            pytest.fail(f"the rollout worker produced {len(out)} of {n} samples in {timeout} s")
    return out


@pytest.mark.slow
def test_async_rollout_worker_tags_samples_with_the_replicas_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerControl, TrainerState
    from trl import chat_template_utils
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    monkeypatch.setattr(trl_async, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    # the spawned child imports this checkout
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[3]))
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    bucket = str(tmp_path / "bucket")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # the tiny model's chat template is Qwen-style but not one TRL recognises by its text
    tok.response_template = chat_template_utils.qwen3_template
    prompt_ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    n_tokens = 6

    replicas = []
    for i, poll in enumerate((0.2, 3.0)):  # the second replica lags behind the first by up to 3 s
        monkeypatch.setenv("SPARSESYNC_REPLICA_ID", f"replica-{i}")  # two replicas in one process: two heartbeat ids
        replicas.append(Replica(EmbeddedEngine(model_dir), bucket, poll_interval=poll))
    with Server(replicas[0]) as r1, Server(replicas[1]) as r2:
        # send_weights returns once one replica serves the new version: the other still serves the old one
        transfer = SparsesyncWeightTransfer(bucket, fleet_min_replicas=1, fleet_timeout_s=60.0, anchor_every=0)
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
            max_completion_length=n_tokens, temperature=0.0, max_inflight_tasks=2, queue_maxsize=8,
            vllm_server_base_url=r1.url, use_cpu=True, bf16=False, report_to="none", dtype="float32",
        )
        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=distinct_letters, args=args, processing_class=tok,
                                   train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 8}), weight_transfer=transfer)
        transfer.bind(trainer)
        follow_replicas(trainer, [r1.url, r2.url])
        expected = {0: _greedy(r2.url, prompt_ids, n_tokens)}  # the model folder, before any version (null: 0)
        assert expected[0][1] is None
        try:
            # TRL's train-begin: cold sync (version 1, served by the first replica on return), the worker starts
            trainer.callback_handler.on_train_begin(trainer.args, TrainerState(), TrainerControl())
            expected[1] = _greedy(r1.url, prompt_ids, n_tokens)
            assert expected[1] == (expected[0][0], 1)  # version 1 is the folder's weights, bit for bit
            first = _samples(trainer.rollout_queue, 4)

            with torch.no_grad():  # an update large enough to change the greedy completion
                g = torch.Generator().manual_seed(1)
                for name, p in trainer.model.named_parameters():
                    if "layers." in name:
                        p.add_(torch.randn(p.shape, generator=g) * 0.5)
            trainer._sync_weight()  # version 2: returns once one replica serves it
            assert trainer.model_version == 2
            deadline = time.monotonic() + 30  # the replica that reported first may be the lagging one
            while (got := _greedy(r1.url, prompt_ids, n_tokens))[1] != 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            expected[2] = got
            assert expected[2][1] == 2 and expected[2][0] != expected[1][0]
            later = []  # samples queued before the sync, then the new version's
            while sum(s.model_version == 2 for s in later) < 4:
                assert len(later) < 100, f"no version-2 samples among {len(later)}"
                later += _samples(trainer.rollout_queue, 1)
        finally:
            trainer.rollout_worker.stop()
            transfer.destroy()

    samples = first + later
    assert {s.model_version for s in first} <= {0, 1} and 2 in {s.model_version for s in later}
    for s in samples:
        completion = s.input_ids[s.completion_mask.astype(bool)].tolist()
        assert s.input_ids[: len(prompt_ids)].tolist() == prompt_ids
        assert completion == expected[s.model_version][0], (s.model_version, completion)


def test_samples_of_a_version_a_rewind_abandoned_are_told_from_the_new_one(tmp_path: Path) -> None:
    """A replica (embedded engine, real HTTP server) returns with each completion the state digest
    of the weights that made it, read with its version; after a rewind to 2 and a new version 3,
    the rollout loop's check drops a sample of the abandoned 3 and keeps the new 3's."""
    from sparsesync.integrations.trl.rollout import SparsesyncRolloutLoop
    from sparsesync.protocol.lineage import TrustedCommits
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import open_store
    from tests.support.model_steps import PROMPTS, Trainer

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    bucket = str(tmp_path / "bucket")
    first = Trainer(model_dir, seed=4)
    states = {v: first.step(density=0.2, scale=0.5) for v in (1, 2, 3)}
    replica = Replica(EmbeddedEngine(model_dir), bucket, poll_interval=0.05)
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    def answer(c: httpx.Client, version: int) -> tuple[int, str]:
        deadline = time.monotonic() + 30
        while c.get("/health").json()["weight_version"] != version:
            assert time.monotonic() < deadline, f"the replica never served version {version}"
            time.sleep(0.02)
        out = c.post("/v1/completions", json=body).json()
        (ch,) = out["choices"]
        assert ch["state_digest"] == out["state_digest"] and ch["weight_version"] == out["weight_version"] == version
        stream = c.post("/v1/completions", json={**body, "stream": True}).text
        assert f'"state_digest":"{ch["state_digest"]}"' in stream
        return version, ch["state_digest"]

    with Server(replica) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        with Publisher(bucket, anchor_every=0) as pub:  # the first attempt: 1..3, then a crash
            for v, s in states.items():
                pub.publish(s, v)
                pub.flush()
                if v == 2:
                    kept = answer(c, 2)
            abandoned = answer(c, 3)
            assert abandoned[1] == pub.state_digest
        assert c.get("/health").json()["state_digest"] == abandoned[1]
        second = Trainer(model_dir, seed=9)
        second.state = dict(states[2])
        with Publisher(bucket, anchor_every=0) as pub:  # resumed from checkpoint 2: rewind, then a new 3
            pub.resume(states[2], version=2)
            assert answer(c, 2) == kept
            pub.publish(second.step(density=0.2, scale=0.5), 3)
            pub.flush()
            deadline = time.monotonic() + 30
            while c.get("/health").json()["state_digest"] != pub.state_digest:
                assert time.monotonic() < deadline, "the replica never served the new version 3"
                time.sleep(0.02)
            new = answer(c, 3)
            assert new == (3, pub.state_digest) != abandoned

    trusted = TrustedCommits(open_store(bucket))
    assert trusted.trusts(*new) and trusted.trusts(*kept)
    assert not trusted.trusts(None, None) and not trusted.trusts(2, None)  # names no commit: not trusted
    assert not trusted.trusts(*abandoned)
    assert not trusted.trusts(3, None)
    loop = SparsesyncRolloutLoop.__new__(SparsesyncRolloutLoop)  # its check alone, on the replica's answers
    loop.trusted = trusted
    assert loop.untrusted({new, kept}) == [] and set(loop.untrusted({new, abandoned, (None, None)})) == {
        (None, None),
        abandoned,
    }
