"""TRL's real trainers publishing through sparsesync (sparsesync/integrations/trl/callback.py), on CPU.

- `trl.GRPOTrainer` trains 2 steps on the tiny model with `SparsesyncCallback`; a Follower
  rebuilds every version bit for bit.
- `trl.experimental.async_grpo.AsyncGRPOTrainer` is built with `SparsesyncWeightTransfer`
  and driven through its own train-begin callback and `_sync_weight` (pause -> send_weights
  -> resume -> model_version bump). Its training step needs CUDA and a FlashAttention-3
  kernel, so the test does not train it; the one thing patched is TRL's peak-FLOPs probe,
  which calls `torch.cuda.get_device_name` unconditionally (it returns None, TRL's own
  "unknown device" answer).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("transformers")

from sparsesync.codec import state_digest, tensor_digests  # noqa: E402
from sparsesync.integrations.trl import (  # noqa: E402
    SparsesyncCallback,
    SparsesyncWeightTransfer,
    checkpoint_name,
    inference_state,
    model_state,
)
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from tests.support.served import ServedDigests  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sparsesync.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def test_checkpoint_names_strip_wrappers() -> None:
    assert checkpoint_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert checkpoint_name("lm_head.modules_to_save.default.weight") == "lm_head.weight"


def test_grpo_trainer_callback_publishes_bit_exact(tiny_model: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions: list[str], **_: object) -> list[float]:  # dense: random completions always differ
        return [len(set(s)) / 16 for s in completions]

    bucket = tmp_path / "bucket"
    cb = SparsesyncCallback(str(bucket), anchor_every=0)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, seed=0,
    )
    trainer = GRPOTrainer(model=str(tiny_model), reward_funcs=reward, args=args, callbacks=[cb],
                          train_dataset=Dataset.from_dict({"prompt": ["Repeat the letter a:"] * 8}))
    before = model_state(trainer.model)
    trainer.train()

    commits = Run(str(bucket)).commits()
    assert [c.version for c in commits] == [0, 1, 2]  # initial weights, then one version per step
    assert cb.version == 2
    # the model's config and the tokenizer travel with every version, byte for byte as saved
    names = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert all({f.name for f in c.files} == names for c in commits)
    pulled = tmp_path / "pulled"
    from typer.testing import CliRunner

    from sparsesync.cli import app

    assert CliRunner().invoke(app, ["pull", str(bucket), str(pulled)]).exit_code == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(pulled).chat_template == trainer.processing_class.chat_template
    loaded = AutoModelForCausalLM.from_pretrained(pulled, dtype=torch.bfloat16)
    assert _bits_equal(model_state(loaded), model_state(trainer.model))
    # version 0 is the weights as loaded; the trainer really trained (a delta with changes)
    _rec, v0, _ = Run(str(bucket)).reconstruct(0)
    assert _bits_equal(v0, before)
    assert all(m["n_changed"] > 0 for m in cb.metrics if m.get("kind", "").startswith("delta"))

    follower = Follower(str(bucket))
    assert follower.sync_once() == 2
    final = model_state(trainer.model)
    assert _bits_equal(follower.mirror, final)
    assert state_digest(follower.digests) == cb.state_digest == state_digest(tensor_digests(final))


def _grpo(model: Path, out: Path, callback: SparsesyncCallback, max_steps: int, reward=None):  # noqa: ANN202, ANN001
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def distinct(completions: list[str], **_: object) -> list[float]:
        return [len(set(s)) / 16 for s in completions]

    reward = reward or distinct

    args = GRPOConfig(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none",
        save_strategy="steps", save_steps=2, model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, seed=0,
    )
    return GRPOTrainer(model=str(model), reward_funcs=reward, args=args, callbacks=[callback],
                       train_dataset=Dataset.from_dict({"prompt": ["Repeat the letter a:"] * 16}))


def test_grpo_resume_continues_the_run_and_pull_is_bit_exact(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from sparsesync.cli import app

    bucket, out = tmp_path / "bucket", tmp_path / "out"
    _grpo(tiny_model, out, SparsesyncCallback(str(bucket), anchor_every=0), max_steps=4).train()
    assert [c.version for c in Run(str(bucket)).commits()] == [0, 1, 2, 3, 4]

    # a new process resumes from the newest checkpoint: the run goes on with deltas from version 4
    cb = SparsesyncCallback(str(bucket), anchor_every=0)
    trainer = _grpo(tiny_model, out, cb, max_steps=6)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    commits = Run(str(bucket)).commits()
    assert [c.version for c in commits] == [0, 1, 2, 3, 4, 5, 6]
    assert [c.base_version for c in commits[5:]] == [4, 5]  # deltas against the version it verified it holds
    final = model_state(trainer.model)
    assert cb.version == 6 and cb.state_digest == state_digest(tensor_digests(final))

    result = CliRunner().invoke(app, ["pull", str(bucket), str(tmp_path / "pulled.safetensors")])
    assert result.exit_code == 0, result.output
    assert _bits_equal(load_file(str(tmp_path / "pulled.safetensors")), final)


def test_grpo_crash_after_the_newest_checkpoint_rewinds_the_run_and_the_replica_follows(tiny_model: Path,
                                                                                       tmp_path: Path) -> None:
    """Publish every step, checkpoint every 2, crash after step 5, resume from checkpoint-4 to step 8:
    the same run goes on (a rewind, docs/protocol.md), and a replica that followed the first attempt
    ends serving the resumed trainer's weights, never an abandoned version after the rewind."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback
    from typer.testing import CliRunner

    from inference_space.engines.embedded import EmbeddedEngine
    from sparsesync.cli import app

    bucket, out = tmp_path / "bucket", tmp_path / "out"
    cb = SparsesyncCallback(str(bucket), anchor_every=0, queue_size=16)

    class _Crash(TrainerCallback):  # after step 5 is published, the process dies
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 5:
                cb._v.publisher.flush()
                raise KeyboardInterrupt("crash after step 5")

    replica = ServedDigests(EmbeddedEngine(tiny_model))
    follower = Follower(str(bucket), replica, poll_interval=0.05, max_poll_interval=0.05)
    follower.start()
    try:
        first = _grpo(tiny_model, out, cb, max_steps=8)
        first.add_callback(_Crash())
        with pytest.raises(KeyboardInterrupt):
            first.train()
        run = Run(str(bucket))
        assert [c.version for c in run.commits()] == [0, 1, 2, 3, 4, 5]
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
        abandoned = run.commit(5).state_digest
        deadline = time.monotonic() + 60
        while abandoned not in replica.served[-1:] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replica.served[-1] == abandoned  # the replica serves the first attempt's version 5
        n_before = len(replica.served)

        cb2 = SparsesyncCallback(str(bucket), anchor_every=0)
        # the restart also changes the reward (the fix the crash called for), so steps 5.. really differ
        trainer = _grpo(
            tiny_model, out, cb2, max_steps=8, reward=lambda completions, **_: [s.count("a") / 8 for s in completions]
        )
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
        final = model_state(trainer.model)
        deadline = time.monotonic() + 60
        while replica.served[-1] != cb2.state_digest and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        follower.stop()

    commits = Run(str(bucket)).commits()
    assert [(c.version, c.epoch) for c in commits] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
        (4, 2),
        (5, 2),
        (6, 2),
        (7, 2),
        (8, 2),
    ]
    assert commits[4].metrics["kind"] == "rewind" and [c.base_version for c in commits[5:]] == [4, 5, 6, 7]
    assert cb2.version == 8 and cb2.state_digest == state_digest(tensor_digests(final)) != abandoned
    # the replica served the resumed trainer's weights at the end, and never the abandoned version again
    assert replica.served[-1] == cb2.state_digest
    assert abandoned not in replica.served[n_before:]
    fresh = tmp_path / "final"
    trainer.save_model(str(fresh))
    saved = {k: v.to(torch.bfloat16) for k, v in load_file(str(fresh / "model.safetensors")).items()}
    assert _bits_equal(replica.engine.state_dict(), saved)
    # a fresh engine loaded from the final model (in the replica's dtype) generates what the replica does
    from inference_space.engines import SamplingParams
    from tests.support.model_steps import PROMPTS

    trainer.model.to(torch.bfloat16).save_pretrained(str(tmp_path / "final-bf16"))
    trainer.processing_class.save_pretrained(str(tmp_path / "final-bf16"))
    fresh_engine = EmbeddedEngine(tmp_path / "final-bf16")
    assert _bits_equal(fresh_engine.state_dict(), replica.engine.state_dict())
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    assert [[(c.token_ids, c.logprobs) for c in e.generate(p, greedy)] for p in PROMPTS for e in (replica.engine,)] == \
        [[(c.token_ids, c.logprobs) for c in fresh_engine.generate(p, greedy)] for p in PROMPTS]
    # `sparsesync pull` is the final model's own saved tensors, in bf16
    result = CliRunner().invoke(app, ["pull", str(bucket), str(tmp_path / "pulled.safetensors")])
    assert result.exit_code == 0, result.output
    assert _bits_equal(load_file(str(tmp_path / "pulled.safetensors")), saved)


def test_grpo_resume_with_other_weights_at_the_same_step_fails_before_training(
    tiny_model: Path, tmp_path: Path
) -> None:
    from sparsesync.errors import PatchMismatchError

    bucket = tmp_path / "bucket"
    _grpo(tiny_model, tmp_path / "a", SparsesyncCallback(str(bucket), anchor_every=0), max_steps=2).train()
    _grpo(tiny_model, tmp_path / "b", SparsesyncCallback(str(tmp_path / "other"), anchor_every=0), max_steps=4).train()
    trainer = _grpo(tiny_model, tmp_path / "b", SparsesyncCallback(str(bucket), anchor_every=0), max_steps=6)
    # step 2 of another run (its learning-rate schedule spans 4 steps): the same number, other weights
    with pytest.raises(PatchMismatchError, match="version 2 of"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    assert [c.version for c in Run(str(bucket)).commits()] == [0, 1, 2]


def test_trl_package_reexports_its_modules_and_the_old_paths_are_gone() -> None:
    """`sparsesync.integrations.trl` is a package shaped like `integrations.vllm`: its public names
    are its modules' own objects, and the old import paths (shims) no longer exist."""
    import sparsesync.integrations.trl as lib
    import trainer
    from sparsesync.integrations.trl import callback, client, rollout

    assert lib.SparsesyncCallback is callback.SparsesyncCallback
    assert lib.SparsesyncWeightTransfer is callback.SparsesyncWeightTransfer
    assert lib.sparsesync_server_mode is client.sparsesync_server_mode
    assert lib.follow_replicas is rollout.follow_replicas
    assert all(getattr(lib, name) is not None for name in lib.__all__)
    integrations = Path(lib.__file__).parents[1]
    gone = [Path(trainer.__file__).with_name("trl_integration.py"), integrations / "trl.py",
            integrations / "trl_client.py", integrations / "trl_rollout.py"]
    assert [p for p in gone if p.exists()] == []


class _IdleRolloutWorker:
    """A `RolloutWorkerProtocol` that produces nothing (this test checks weight sync only)."""

    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.versions: list[int] = []
        self.started = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        pass

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        pass


def test_async_grpo_weight_transfer_protocol(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datasets import Dataset
    from transformers import TrainerControl, TrainerState
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    monkeypatch.setattr(trl_async, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    bucket = tmp_path / "bucket"
    transfer = SparsesyncWeightTransfer(str(bucket))
    worker = _IdleRolloutWorker()
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                           use_cpu=True, bf16=False, report_to="none", dtype="float32")
    trainer = AsyncGRPOTrainer(
        model=str(tiny_model), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4}),
        rollout_worker=worker, weight_transfer=transfer,
    )
    assert trainer.weight_transfer is transfer
    transfer.bind(trainer)
    # TRL's own train-begin callback: init_weight_transfer, the cold sync, then the worker starts
    trainer.callback_handler.on_train_begin(trainer.args, TrainerState(), TrainerControl())
    assert worker.started and worker.versions == [1] and transfer.version == 1
    with torch.no_grad():  # an "optimizer step" touching one layer
        for name, p in trainer.model.named_parameters():
            if "layers.0.mlp" in name:
                p.add_(torch.randn_like(p) * 1e-2)
    trainer._sync_weight()
    transfer.destroy()

    assert worker.versions == [1, 2] and transfer.version == 2  # sparsesync versions == TRL model_version
    assert transfer.pauses == transfer.resumes == 2
    delta = transfer.metrics[-1]
    assert delta["kind"] == "delta" and 0 < delta["density"] < 0.5  # only layers.0.mlp moved
    follower = Follower(str(bucket))
    assert follower.sync_once() == 2
    expected = inference_state(trainer.model.named_parameters())
    assert _bits_equal(follower.mirror, expected)
    assert state_digest(follower.digests) == transfer.state_digest


def test_callback_refuses_an_fsdp_sharded_model_before_training(tiny_model: Path, tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, TrainerControl, TrainerState

    from sparsesync.errors import ConfigError

    ours = not dist.is_initialized()  # an earlier test in this process (vLLM, accelerate) may hold one
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
        cb = SparsesyncCallback(str(tmp_path / "bucket"))
        cb.on_train_begin(None, TrainerState(), TrainerControl(), model=model)  # unsharded: published
        assert cb.version == 0
        fully_shard(model, mesh=None)
        with pytest.raises(ConfigError, match="sharded model: the model is wrapped by FSDP"):
            SparsesyncCallback(str(tmp_path / "bucket2")).on_train_begin(
                None, TrainerState(), TrainerControl(), model=model
            )
        assert not (tmp_path / "bucket2" / "commits").exists()  # nothing published
        cb._v.close()
    finally:
        if ours:
            dist.destroy_process_group()


# -- AsyncGRPOTrainer: versions = TRL's model_version, resume, the checkpoint's key set ---------

def _async_trainer(model_dir: Path, out: Path, transfer: SparsesyncWeightTransfer, monkeypatch: pytest.MonkeyPatch,
                   worker: object | None = None):  # noqa: ANN202
    """A real AsyncGRPOTrainer built with `transfer` (bound to it) and an idle rollout worker."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    monkeypatch.setattr(trl_async, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    args = AsyncGRPOConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4,
                           use_cpu=True, bf16=False, report_to="none", dtype="float32")
    trainer = AsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 4}),
        rollout_worker=worker or _IdleRolloutWorker(), weight_transfer=transfer,
    )
    transfer.bind(trainer)
    return trainer


def _train_begin(trainer) -> None:  # noqa: ANN001
    """TRL's own train-begin callback: init_weight_transfer, the cold sync, the worker's start."""
    from transformers import TrainerControl, TrainerState

    trainer.callback_handler.on_train_begin(trainer.args, TrainerState(), TrainerControl())


def _optimizer_step(model: torch.nn.Module, where: str = "layers.0.mlp", seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if where in name and p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def test_weight_transfer_unbound_fails_before_publishing(tmp_path: Path) -> None:
    from sparsesync.errors import ConfigError

    transfer = SparsesyncWeightTransfer(str(tmp_path / "bucket"))
    with pytest.raises(ConfigError, match=r"not bound to its trainer.*transfer.bind\(trainer\)"):
        transfer.init_weight_transfer()
    assert not (tmp_path / "bucket" / "commits").exists()


def test_async_grpo_resume_continues_at_trls_model_version(tiny_model: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's `_inner_training_loop` restores `model_version` from the checkpoint's rollout_state.json
    (it cannot train on CPU, so the test sets the restored value as TRL does)."""
    bucket = tmp_path / "bucket"
    first = _async_trainer(
        tiny_model, tmp_path / "out", SparsesyncWeightTransfer(str(bucket), anchor_every=0), monkeypatch
    )
    _train_begin(first)
    _optimizer_step(first.model)
    first._sync_weight()
    first.weight_transfer.destroy()
    assert first.model_version == 2 and [c.version for c in Run(str(bucket)).commits()] == [1, 2]
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}  # the checkpoint at model_version 2

    # resumed with the checkpoint's weights: version 3 is a delta from the version 2 it verified it holds
    transfer = SparsesyncWeightTransfer(str(bucket), anchor_every=0)
    resumed = _async_trainer(tiny_model, tmp_path / "out", transfer, monkeypatch)
    resumed.model.load_state_dict(saved)
    resumed.model_version = 2
    _train_begin(resumed)
    _optimizer_step(resumed.model, seed=1)
    resumed._sync_weight()
    transfer.destroy()
    commits = Run(str(bucket)).commits()
    assert resumed.model_version == 4 and [c.version for c in commits] == [1, 2, 3, 4]
    assert [c.base_version for c in commits[2:]] == [2, 3] and not commits[2].has_anchor
    follower = Follower(str(bucket))
    assert follower.sync_once() == 4 and _bits_equal(follower.mirror, model_state(resumed.model))

    # resumed with other weights at the run's newest version (saved between two syncs): an anchor
    transfer = SparsesyncWeightTransfer(str(bucket), anchor_every=0)
    other = _async_trainer(tiny_model, tmp_path / "out", transfer, monkeypatch)
    other.model_version = 4
    _train_begin(other)
    transfer.destroy()
    commits = Run(str(bucket)).commits()
    assert [c.version for c in commits] == [1, 2, 3, 4, 5] and commits[-1].has_anchor
    assert follower.sync_once() == 5 and _bits_equal(follower.mirror, model_state(other.model))

    # resumed from an older checkpoint (model_version 3) with other weights: refused before anything is
    # published or trained, the hint naming what the run holds
    from sparsesync.errors import PatchMismatchError

    worker = _IdleRolloutWorker()
    old = _async_trainer(tiny_model, tmp_path / "out", SparsesyncWeightTransfer(str(bucket)), monkeypatch, worker)
    old.model_version = 3
    with pytest.raises(PatchMismatchError) as e:
        _train_begin(old)
    assert "version 3 of" in str(e.value) and "version 5 of the run" in e.value.hint, (str(e.value), e.value.hint)
    assert not worker.started and [c.version for c in Run(str(bucket)).commits()] == [1, 2, 3, 4, 5]
    old.weight_transfer.destroy()
    # ... with the checkpoint's own weights (version 3): the run is rewound to 3, TRL's cold sync is 4
    _rec, v3, _ = Run(str(bucket)).reconstruct(3)
    transfer = SparsesyncWeightTransfer(str(bucket), anchor_every=0)
    worker = _IdleRolloutWorker()
    old = _async_trainer(tiny_model, tmp_path / "out", transfer, monkeypatch, worker)
    old.model.load_state_dict({k: v.to(torch.float32) for k, v in v3.items()}, strict=False)  # a tied head follows
    old.model_version = 3
    _train_begin(old)
    transfer.destroy()
    commits = Run(str(bucket)).commits()
    assert [c.version for c in commits] == [1, 2, 3, 4] and commits[2].metrics["kind"] == "rewind"
    assert worker.started and worker.versions == [4] and transfer.version == 4
    assert follower.sync_once() == 4 and _bits_equal(follower.mirror, model_state(old.model))


def _checkpoint_keys(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            keys |= set(sf.keys())
    return keys


def _publish_both_paths(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """Two versions each through SparsesyncWeightTransfer (one decoder layer frozen) and
    SparsesyncCallback (an fp32 model); returns [(bucket, trained model), ...]."""
    from transformers import AutoModelForCausalLM, TrainerControl, TrainerState

    keys = _checkpoint_keys(model_dir)
    # AsyncGRPOTrainer + SparsesyncWeightTransfer, one decoder layer frozen
    bucket = tmp_path / "async"
    trainer = _async_trainer(
        model_dir, tmp_path / "out", SparsesyncWeightTransfer(str(bucket), anchor_every=0), monkeypatch
    )
    for name, p in trainer.model.named_parameters():
        if "layers.1." in name:
            p.requires_grad_(False)
    streamed = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert keys - streamed  # TRL's stream really leaves tensors out
    _train_begin(trainer)
    _optimizer_step(trainer.model, where="layers.0")
    trainer._sync_weight()
    trainer.weight_transfer.destroy()

    # SparsesyncCallback on an fp32 model (what GRPOTrainer hands it)
    cb_bucket = tmp_path / "callback"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cb = SparsesyncCallback(str(cb_bucket), anchor_every=0)
    state = TrainerState()
    cb.on_train_begin(None, state, TrainerControl(), model=model)
    _optimizer_step(model, where="layers.1")
    state.global_step = 1
    cb.on_step_end(None, state, TrainerControl(), model=model)
    cb.on_train_end(None, state, TrainerControl(), model=model)
    runs = [(bucket, trainer.model), (cb_bucket, model)]
    for run, _trained in runs:
        for c in Run(str(run)).commits():
            assert set(Run(str(run)).reconstruct(c.version)[1]) == keys, (run, c.version)
    return runs


def _follow(engine, runs) -> None:  # noqa: ANN001
    """A replica of `engine` follows each run to its newest version: accepted, applied, bit-exact."""
    from inference_space.replica import Replica

    for run, trained in runs:
        newest = Run(str(run)).commits()[-1].version
        replica = Replica(engine, str(run))
        assert replica.follower is not None and replica.follower.sync_once() == newest
        status = replica.status()
        assert status["state"] == "following" and status["serving_version"] == newest, status
        assert _bits_equal(replica.follower.mirror, model_state(trained))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-tied"])
def test_every_path_publishes_the_checkpoint_key_set_the_embedded_engine_takes(
        arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's stream leaves frozen parameters (a VLM's vision tower: here a frozen decoder layer)
    and tied duplicates out; the callback reads state_dict() of an fp32 model, where the bf16 cast
    separates a tied head from its embedding. Both publish the checkpoint's own key set, which
    an embedded replica following the bucket loads and applies."""
    from inference_space.engines.embedded import EmbeddedEngine
    from sparsesync.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch=arch)
    assert ("lm_head.weight" in _checkpoint_keys(model_dir)) == (arch == "qwen3")
    runs = _publish_both_paths(model_dir, tmp_path, monkeypatch)
    for run in runs:
        _follow(EmbeddedEngine(model_dir), [run])


@pytest.mark.vllm
def test_vllm_engine_takes_the_key_set_of_every_path_for_a_tied_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from inference_space.engines.vllm_engine import VllmEngine
    from sparsesync.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=0, arch="qwen3-tied")
    runs = _publish_both_paths(model_dir, tmp_path, monkeypatch)
    engine = VllmEngine(model_dir, kv_cache_memory_bytes=16 << 20)
    try:
        _follow(engine, runs)  # one engine follows one run, then the other (an anchor replaces its weights)
    finally:
        engine.close()


def test_trls_vllm_version_warning_shows_at_most_once() -> None:
    """TRL warns about the vLLM version from every module that checks it (5-8 times per import);
    after sparsesync's integration is imported, importing TRL's trainers shows it at most once."""
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('default')\n"
            "from sparsesync.integrations.trl import sparsesync_server_mode\n"
            "from trl import GRPOConfig, GRPOTrainer\n"
            "import trl.generation.vllm_generation, trl.generation.vllm_client\n"
            "from trl.experimental.async_grpo import AsyncGRPOTrainer\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[3])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("TRL currently supports vLLM versions") <= 1, res.stderr
