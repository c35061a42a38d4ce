"""TRL's GRPOTrainer in vLLM server mode on sparsesync (sparsesync/integrations/trl/client.py).

A real `GRPOTrainer(use_vllm=True, vllm_mode="server")` is built inside `sparsesync_server_mode`
and trains on CPU: its weight syncs publish to a local bucket (no NCCL communicator) and its
rollouts come from two embedded-engine replicas (inference_space over uvicorn on 127.0.0.1)
following that bucket. The bucket reconstructs the trainer's weights bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("trl")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from sparsesync.integrations.trl import SparsesyncVLLMClient, model_state, sparsesync_server_mode  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.apps.inference.test_server import Server  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("arch", ["qwen3-tied"])
def test_grpo_trainer_server_mode_publishes_and_generates_on_replicas(arch: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import trl.generation.vllm_generation as generation
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions: list[str], **_: object) -> list[float]:
        return [len(set(s)) / 16 for s in completions]

    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch=arch)
    bucket = str(tmp_path / "bucket")
    replicas = []
    for i in range(2):
        monkeypatch.setenv("SPARSESYNC_REPLICA_ID", f"replica-{i}")
        replicas.append(Replica(EmbeddedEngine(model_dir), bucket, poll_interval=0.1))
    with Server(replicas[0]) as r1, Server(replicas[1]) as r2:
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none",
            save_strategy="no", model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, seed=0,
            use_vllm=True, vllm_mode="server", vllm_server_base_url=f"{r1.url},{r2.url}",
            vllm_importance_sampling_correction=False,
        )
        original = generation.VLLMClient
        with sparsesync_server_mode(bucket, anchor_every=0):
            trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": ["Repeat the letter a:"] * 12}))
        assert generation.VLLMClient is original  # put back once the trainer is built
        client = trainer.vllm_generation.vllm_client
        assert isinstance(client, SparsesyncVLLMClient) and client.replicas == [r1.url, r2.url]
        before = model_state(trainer.model)
        trainer.train()  # publishes the trained weights when it ends
        trainer.vllm_generation.sync_weights()  # a sync at the same step publishes nothing new
        client.close()

    commits = Run(bucket).commits()
    assert [c.version for c in commits] == [0, 1, 2, 3]  # versions = global_step: before each step, and at the end
    assert client.served == [0, 1, 2]  # every step generated on exactly the version synced before it
    _rec, v0, _ = Run(bucket).reconstruct(0)
    assert _bits_equal(v0, before) and "lm_head.weight" not in v0  # tied: the checkpoint's key set
    follower = Follower(bucket)
    assert follower.sync_once() == 3
    final = model_state(trainer.model)
    assert not _bits_equal(final, before)  # it trained
    assert _bits_equal(follower.mirror, final)
    assert all(r.status()["serving_version"] == 3 for r in replicas)


def test_weight_update_fails_in_bounded_time_when_a_replica_does_not_follow_the_run(tmp_path: Path) -> None:
    from sparsesync.checkpoint import load_checkpoint
    from sparsesync.errors import ProtocolError

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    with Server(Replica(EmbeddedEngine(model_dir), None)) as lone:  # serves its folder, follows nothing
        client = SparsesyncVLLMClient(str(tmp_path / "bucket"), lone.url, sync_timeout_s=1.0)
        client.init_communicator()
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match=r"do not serve version 0 \(they report \[None\]\)"):
            client.update_named_params(None, iter(load_checkpoint(model_dir).items()))
        assert time.monotonic() - t0 < 10
        client.close()


def test_grpo_trainer_server_mode_resumed_continues_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed from its checkpoint at the run's newest version (the weights published when the
    first run ended), the trainer continues the run: its first sync publishes nothing (the
    weights are that version, checked by digest), the next versions are deltas; the replica follows."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions: list[str], **_: object) -> list[float]:
        return [len(set(s)) / 16 for s in completions]

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    bucket = str(tmp_path / "bucket")
    replica = Replica(EmbeddedEngine(model_dir), bucket, poll_interval=0.1)
    with Server(replica) as r1:
        def trainer(max_steps: int) -> GRPOTrainer:
            args = GRPOConfig(
                output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=4, learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none",
                save_strategy="steps", save_steps=2, model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True,
                seed=0, use_vllm=True, vllm_mode="server", vllm_server_base_url=r1.url,
                vllm_importance_sampling_correction=False,
            )
            with sparsesync_server_mode(bucket, anchor_every=0):
                return GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": ["Repeat the letter a:"] * 16}))

        first = trainer(2)
        first.train()
        first.vllm_generation.vllm_client.close()
        resumed = trainer(3)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        client = resumed.vllm_generation.vllm_client
        client.close()
    commits = Run(bucket).commits()
    assert [c.version for c in commits] == [0, 1, 2, 3] and client.served == [2]
    assert not commits[3].has_anchor and commits[3].base_version == 2  # continued: a delta
    from sparsesync.checkpoint import load_checkpoint

    saved = {k: v.to(torch.bfloat16) for k, v in load_checkpoint(tmp_path / "out" / "checkpoint-2").items()}
    assert _bits_equal(Run(bucket).reconstruct(2)[1], saved)  # version 2 is the checkpoint the run resumed from
    follower = Follower(bucket)
    assert follower.sync_once() == 3 and _bits_equal(follower.mirror, model_state(resumed.model))


def test_generation_from_another_version_is_refused(tmp_path: Path) -> None:
    """Another writer takes the run over after this trainer's sync: the replica follows it, and
    the next generation raises instead of handing TRL samples of weights it did not sync."""
    from sparsesync.checkpoint import load_checkpoint
    from sparsesync.errors import ProtocolError
    from sparsesync.protocol.writer.publisher import Publisher

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    bucket = str(tmp_path / "bucket")
    state = load_checkpoint(model_dir)
    with Server(Replica(EmbeddedEngine(model_dir), bucket, poll_interval=0.1)) as r1:
        client = SparsesyncVLLMClient(bucket, r1.url, sync_timeout_s=30.0)
        client.init_communicator()
        client.update_named_params(None, iter(state.items()))
        prompt = [[5, 6, 7]]
        assert len(client.generate(prompt, max_tokens=2)["completion_ids"]) == 1 and client.served == [0]
        with Publisher(bucket) as other:  # a newer writer: version 1
            other.publish({k: v.clone() for k, v in state.items()}, 1)
            other.flush()
        deadline = time.monotonic() + 30
        while httpx.get(f"{r1.url}/health").json()["weight_version"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ProtocolError, match=r"weight versions \[1\] after version 0 was published"):
            client.generate(prompt, max_tokens=2)
        client.close()


def test_the_client_waits_for_a_replica_that_is_still_starting(tmp_path: Path) -> None:
    """As TRL's `VLLMClient.check_server`: a replica that refuses connections for a while (still
    starting) is waited for, within `connection_timeout`."""
    from tests.support.tcp_proxy import TcpProxy

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    with Server(Replica(EmbeddedEngine(model_dir), None)) as r1:
        proxy = TcpProxy("127.0.0.1", r1.port).start()
        try:
            proxy.refuse(1.5)  # "connection refused" until it is up
            t0 = time.monotonic()
            client = SparsesyncVLLMClient(str(tmp_path / "bucket"), proxy.url, connection_timeout=30)
            assert 1.0 <= time.monotonic() - t0 < 30 and client.model
            client.close()
        finally:
            proxy.stop()
