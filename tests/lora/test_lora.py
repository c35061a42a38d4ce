"""LoRA adapter runs: adapter versions through a real bucket into real engines, bit-exact.

A real PEFT model on the tiny base takes real AdamW steps; every step is published as an
adapter version; replicas (embedded, vLLM) serve base + adapter and must hold the trainer's
adapter bit for bit and generate what a fresh engine with the same base and adapter generates.
An adapter run and a full-weight run are never confused; a wrong base is rejected; a PEFT
folder pushed and pulled through the CLI round-trips and loads with PEFT.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="adapter runs need peft (pip install -e '.[lora]')")

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from inference_space.engines import SamplingParams  # noqa: E402
from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.engines.embedded_adapter import EmbeddedAdapterEngine  # noqa: E402
from sparsesync.cli import app  # noqa: E402
from sparsesync.codec import tensor_digests  # noqa: E402
from sparsesync.errors import BaseModelMismatchError, ConfigError, OutputError, RunKindError  # noqa: E402
from sparsesync.lora.bridge import adapter_tensors  # noqa: E402
from sparsesync.lora.meta import AdapterMeta  # noqa: E402
from sparsesync.lora.state import meta_from_peft  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.support.generation import greedy  # noqa: E402
from tests.support.model_steps import PROMPTS  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ONE = SamplingParams(max_tokens=1, temperature=0.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("bases")
    return {arch: build_tiny_model(root / arch, arch=arch) for arch in ("qwen3", "qwen3-tied")}


class LoraTrainer:
    """A real PEFT model on a tiny base taking real AdamW steps on a language-modelling loss."""

    def __init__(self, base: Path, dtype: torch.dtype = torch.float32, seed: int = 0, lr: float = 1e-2,
                 targets: list[str] = TARGETS) -> None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        self.model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0),
                                    autocast_adapter_dtype=False)
        for n, p in self.model.named_parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.g = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(1, 200, (2, 12), generator=self.g)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def adapter(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in adapter_tensors(self.model).items()}


def _assert_same_generation(a, b) -> None:  # type: ignore[no-untyped-def]
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) <= 1e-3


@pytest.mark.parametrize("arch,dtype", [("qwen3", torch.float32), ("qwen3-tied", torch.bfloat16)])
def test_embedded_replica_follows_adapter_versions(bases, tmp_path, arch, dtype):  # type: ignore[no-untyped-def]
    base, bucket = bases[arch], str(tmp_path / "bucket")
    trainer = LoraTrainer(base, dtype)
    with Publisher(bucket, anchor_every=4, anchor_fraction=100.0) as pub:  # adapters: dense deltas
        pub.publish(trainer.model, 0)
        pub.flush()
        meta = Run(bucket).newest().adapter
        assert (
            meta is not None and meta.rank == 8 and meta.alpha == 16 and sorted(meta.target_modules) == sorted(TARGETS)
        )
        assert meta.dtype == str(dtype).removeprefix("torch.")
        engine = EmbeddedAdapterEngine(base, adapter=meta)
        follower = Follower(bucket, hook=engine, poll_interval=0.05, adapter=meta)
        assert engine.weight_version is None and follower.sync_once() == 0
        kinds = []
        for step in range(1, 7):
            trainer.step()
            pub.publish(trainer.model, step)
            pub.flush()
            kinds.append(pub.metrics[-1]["kind"])
            assert follower.sync_once() == step == engine.weight_version
            assert tensor_digests(engine.state_dict()) == tensor_digests(trainer.adapter())
            assert [c.weight_version for c in engine.generate(PROMPTS[0], ONE)] == [step]
    assert "delta" in kinds and any("anchor" in k for k in kinds)
    got = greedy(engine, GREEDY)
    fresh = EmbeddedAdapterEngine(base, adapter=meta)  # same base, the final adapter loaded whole
    fresh.load_full(6, trainer.adapter())
    _assert_same_generation(got, greedy(fresh, GREEDY))
    assert got != greedy(EmbeddedEngine(base), GREEDY), "the adapter must change what the base generates"


def test_wrong_base_is_rejected(bases, tmp_path):  # type: ignore[no-untyped-def]
    trainer = LoraTrainer(bases["qwen3"])
    meta = meta_from_peft(trainer.model)
    other = build_tiny_model(tmp_path / "other", seed=1)
    with pytest.raises(BaseModelMismatchError, match="trained on .* with digest"):
        EmbeddedAdapterEngine(other, adapter=meta)
    EmbeddedAdapterEngine(bases["qwen3"], adapter=meta)  # the right base passes


def test_adapter_and_full_weight_runs_are_never_confused(bases, tmp_path):  # type: ignore[no-untyped-def]
    trainer = LoraTrainer(bases["qwen3"])
    full, lora = str(tmp_path / "full"), str(tmp_path / "lora")
    weights = load_file(str(bases["qwen3"] / "model.safetensors"))
    with Publisher(full) as pub:
        pub.publish(weights, 1)
    with Publisher(lora) as pub:
        pub.publish(trainer.model, 1)
    meta = Run(lora).newest().adapter
    # publishers
    with Publisher(full) as pub, pytest.raises(RunKindError, match="full-weight run.*LoRA adapter"):
        pub.publish(trainer.model, 2)
    with Publisher(lora) as pub, pytest.raises(RunKindError, match="LoRA adapter .* run.*full-weight"):
        pub.publish(weights, 2)
    with Publisher(str(tmp_path / "new")) as pub, pytest.raises(RunKindError, match="LoRA adapter tensors"):
        pub.publish(trainer.adapter(), 1)  # an adapter state dict without adapter=...: not full weights
    with (
        Publisher(str(tmp_path / "new2"), adapter=meta) as pub,
        pytest.raises(RunKindError, match="not a LoRA adapter tensor"),
    ):
        pub.publish(weights, 1)
    # r must fit the tensors
    other = AdapterMeta(meta.base_model, meta.base_digest, {**meta.config, "lora_alpha": 32}, meta.dtype)
    with Publisher(lora, adapter=other) as pub, pytest.raises(RunKindError, match="configuration"):
        pub.publish({k: v for k, v in trainer.adapter().items()}, 2)
    # followers and engines
    with pytest.raises(RunKindError, match="is a LoRA adapter .* version; this replica serves a full-weight run"):
        Follower(lora, hook=EmbeddedEngine(bases["qwen3"])).sync_once()
    with pytest.raises(RunKindError, match="is a full-weight version; this replica serves a LoRA adapter"):
        Follower(full, hook=EmbeddedAdapterEngine(bases["qwen3"], adapter=meta), adapter=meta).sync_once()
    # pull: an adapter run becomes a PEFT folder, never a model file
    with pytest.raises(OutputError, match="pulled into a folder"):
        CliRunner().invoke(app, ["pull", lora, str(tmp_path / "x.safetensors")], catch_exceptions=False)


def test_cli_push_pull_peft_folder_round_trips(bases, tmp_path):  # type: ignore[no-untyped-def]
    trainer = LoraTrainer(bases["qwen3-tied"], torch.bfloat16)
    run, runner = str(tmp_path / "run"), CliRunner()
    folders = []
    for i in range(3):
        trainer.step()
        folders.append(tmp_path / f"adapter{i}")
        trainer.model.save_pretrained(folders[-1])
        args = ["push", str(folders[-1]), run] + (["--base", str(bases["qwen3-tied"])] if i == 0 else [])
        res = runner.invoke(app, args, catch_exceptions=False)
        assert res.exit_code == 0, res.output
    cfg = json.loads((folders[0] / "adapter_config.json").read_text())
    (folders[0] / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
    with pytest.raises(ConfigError, match="--base"):  # the base is not a local folder: it must be named
        runner.invoke(app, ["push", str(folders[0]), str(tmp_path / "run2")], catch_exceptions=False)
    out = tmp_path / "pulled"
    res = runner.invoke(app, ["pull", run, str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (folders[-1] / "adapter_config.json").read_text()
    )
    want = load_file(str(folders[-1] / "adapter_model.safetensors"))
    assert tensor_digests(load_file(str(out / "adapter_model.safetensors"))) == tensor_digests(want)
    # a new run starts at 0
    res = runner.invoke(app, ["pull", run, str(tmp_path / "v0"), "--version", "0"], catch_exceptions=False)
    assert tensor_digests(load_file(str(tmp_path / "v0" / "adapter_model.safetensors"))) == tensor_digests(
        load_file(str(folders[0] / "adapter_model.safetensors")))
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(bases["qwen3-tied"], dtype=torch.bfloat16),
        out,
        autocast_adapter_dtype=False,
    )
    assert tensor_digests(get_peft_model_state_dict(loaded)) == tensor_digests(want)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(loaded.generate(input_ids=ids, max_new_tokens=6, do_sample=False),
                           trainer.model.generate(input_ids=ids, max_new_tokens=6, do_sample=False))


def test_replica_of_an_adapter_run_serves_base_plus_adapter(bases, tmp_path):  # type: ignore[no-untyped-def]
    from inference_space.replica import ReplicaConfig, build_replica

    trainer, bucket = LoraTrainer(bases["qwen3"], torch.bfloat16), str(tmp_path / "bucket")
    with Publisher(bucket) as pub:
        trainer.step()
        pub.publish(trainer.model, 1)
    replica = build_replica(ReplicaConfig(model=str(bases["qwen3"]), bucket=bucket))
    assert replica.engine.name == "embedded-lora" and replica.follower is not None
    assert replica.follower.sync_once() == 1
    assert tensor_digests(replica.engine.state_dict()) == tensor_digests(trainer.adapter())
    other = build_tiny_model(tmp_path / "other", seed=2)
    with pytest.raises(BaseModelMismatchError):
        build_replica(ReplicaConfig(model=str(other), bucket=bucket))


@pytest.mark.vllm
def test_vllm_replica_switches_adapter_slots(bases, tmp_path):  # type: ignore[no-untyped-def]
    """vLLM with LoRA: each version in a new slot, equal to a fresh vLLM engine with that adapter."""
    pytest.importorskip("vllm")
    from inference_space.engines.vllm_adapter import VllmAdapterEngine

    base, bucket = bases["qwen3"], str(tmp_path / "bucket")
    trainer = LoraTrainer(base, torch.bfloat16, targets=[*TARGETS, "lm_head"])  # vLLM wraps the head's LoRA apart
    engine = None
    try:
        with Publisher(bucket, anchor_every=3, anchor_fraction=100.0) as pub:
            pub.publish(trainer.model, 0)
            pub.flush()
            meta = Run(bucket).newest().adapter
            with pytest.raises(BaseModelMismatchError):  # checked before vLLM starts
                VllmAdapterEngine(build_tiny_model(tmp_path / "other", seed=1), adapter=meta)
            engine = VllmAdapterEngine(base, adapter=meta, kv_cache_memory_bytes=128 << 20)
            follower = Follower(bucket, hook=engine, adapter=meta)
            assert follower.sync_once() == 0
            for step in range(1, 6):
                trainer.step()
                pub.publish(trainer.model, step)
                pub.flush()
                assert follower.sync_once() == step == engine.weight_version
                assert tensor_digests(engine.state_dict()) == tensor_digests(trainer.adapter())
                assert [c.weight_version for c in engine.generate(PROMPTS[0], ONE)] == [step]
                assert engine.llm.llm_engine.list_loras() == {engine._lora_request.lora_int_id}  # old slot retired
        got = greedy(engine, GREEDY)
        embedded = EmbeddedAdapterEngine(base, adapter=meta)
        embedded.load_full(5, trainer.adapter())
        for (tv, lv), (te, le) in zip(got, greedy(embedded, GREEDY), strict=True):
            # vLLM's CPU kernels and PEFT round bf16 differently: on this tiny model's near-flat
            # distributions greedy paths may split at a near-tie; up to there they agree closely
            same = next((i for i, (a, b) in enumerate(zip(tv, te)) if a != b), len(tv))
            assert same >= 1 and max(abs(a - b) for a, b in zip(lv[:same], le[:same])) < 0.05
        engine._swap(5, trainer.adapter())  # a fresh slot with the final adapter loaded whole
        _assert_same_generation(got, greedy(engine, GREEDY))
    finally:
        if engine is not None:
            engine.close()


def test_trl_grpo_with_peft_config_publishes_the_adapter(bases, tmp_path):  # type: ignore[no-untyped-def]
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from sparsesync.integrations.trl import SparsesyncCallback, model_state

    def reward(completions: list[str], **_: object) -> list[float]:
        return [len(set(s)) / 16 for s in completions]

    bucket, base = str(tmp_path / "bucket"), bases["qwen3"]
    cb = SparsesyncCallback(bucket, anchor_every=0)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-2, use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True, seed=0,
    )
    trainer = GRPOTrainer(model=str(base), reward_funcs=reward, args=args, callbacks=[cb],
                          peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
                          train_dataset=Dataset.from_dict({"prompt": ["Repeat the letter a:"] * 8}))
    trainer.train()
    commits = Run(bucket).commits()
    assert [c.version for c in commits] == [0, 1, 2] and all(c.adapter is not None for c in commits)
    meta = commits[-1].adapter
    assert meta.rank == 8 and meta.dtype == "bfloat16"
    _rec, final, _ = Run(bucket).reconstruct(None)
    assert all(".lora_" in k for k in final) and len(final) == 2 * 2 * len(TARGETS)  # the adapter, not merged weights
    assert tensor_digests(final) == tensor_digests(model_state(trainer.model))
    engine = EmbeddedAdapterEngine(base, adapter=meta)  # the fp32 trainer's base, digested in bf16, is the model folder
    assert Follower(bucket, hook=engine, adapter=meta).sync_once() == 2
    assert tensor_digests(engine.state_dict()) == tensor_digests(final)


def test_trainer_lora_section_is_validated() -> None:
    from trainer.config import TrainerConfig

    base = {"model": {"path": "m"}, "rollout": {"replicas": ["http://127.0.0.1:1"], "env_url": "http://127.0.0.1:2"},
            "sync": {"bucket": "/tmp/b"}}
    cfg = TrainerConfig.from_dict(
        {**base, "lora": {"enabled": True, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}}
    )
    peft_cfg = cfg.lora.peft()
    assert (
        cfg.lora.enabled and peft_cfg.r == 4 and peft_cfg.lora_alpha == 8 and set(peft_cfg.target_modules) == {"q_proj"}
    )
    assert TrainerConfig.from_dict(base).lora.enabled is False
    with pytest.raises(ConfigError, match=r"\[lora\] r = 0"):
        TrainerConfig.from_dict({**base, "lora": {"enabled": True, "r": 0}})
    with pytest.raises(ConfigError, match="unknown key"):
        TrainerConfig.from_dict({**base, "lora": {"rank": 4}})


def test_a_commit_with_a_malformed_adapter_field_is_not_a_commit(bases, tmp_path):  # type: ignore[no-untyped-def]
    from sparsesync.errors import MalformedCommitError
    from sparsesync.protocol.records import CommitRecord

    bucket = str(tmp_path / "bucket")
    with Publisher(bucket) as pub:
        pub.publish(LoraTrainer(bases["qwen3"], torch.bfloat16).model, 1)
    key = next(p for p in (tmp_path / "bucket" / "commits").iterdir()).relative_to(tmp_path / "bucket").as_posix()
    raw = json.loads((tmp_path / "bucket" / key).read_bytes())
    assert CommitRecord.from_json(json.dumps(raw).encode(), key).adapter == Run(bucket).newest().adapter
    for bad, reason in [({**raw["adapter"], "dtype": "int8"}, "adapter.dtype"),
                        ({**raw["adapter"], "base_digest": "xyz"}, "base_digest"),
                        ({**raw["adapter"], "config": {**raw["adapter"]["config"], "peft_type": "IA3"}}, "peft_type"),
                        ({**raw["adapter"], "extra": 1}, "exactly"), ([], "exactly")]:
        with pytest.raises(MalformedCommitError, match=reason):
            CommitRecord.from_json(json.dumps({**raw, "adapter": bad}).encode(), key)


@pytest.mark.slow
def test_demo_lora_replicas_end_bit_exact_to_the_trainers_adapter(tmp_path):  # type: ignore[no-untyped-def]
    """`sparsesync demo --lora`, short: real env, replica and trainer processes; the run is an adapter
    run and every replica serves the trainer's final adapter. It checks the plumbing, not the reward:
    learning `repeat` with an adapter takes ~200 steps, minutes on 2 cores (`sparsesync demo --lora`)."""
    pytest.importorskip("openenv")
    from trainer.demo import DemoOptions, run_demo

    opts = DemoOptions(steps=12, lr=2e-2, lora=True, workdir=tmp_path, progress=False, min_reward_gain=-1.0, replicas=1)
    report = run_demo(opts)  # raises DemoCheckError when a check fails
    assert {"bit_exact", "replica_outputs"} <= report.checks.keys()  # and these two ran on the adapter run
    commits = Run(report.bucket).commits()
    assert commits[-1].version == 12 and all(c.adapter is not None for c in commits)
    assert commits[-1].adapter.base_model == str(tmp_path / "model") and "lm_head" in commits[-1].adapter.target_modules
    assert [st["engine"] for st in report.replicas.values()] == ["embedded-lora"]
    # the adapter
    assert report.full_bytes == sum(t.numel() * 2 for t in Run(report.bucket).reconstruct(None)[1].values())


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-tied"])
def test_adapter_saved_with_peft_defaults_targeting_lm_head_round_trips(bases, tmp_path, arch):
    """What `sparsesync demo --lora` trains, saved with PEFT's defaults: a bf16 adapter on an fp32
    base whose target_modules include lm_head. PEFT then also saves the head's frozen base weight
    (`save_embedding_layers="auto"`), in the base's dtype. push checks it against the base and
    leaves it out; pull writes a folder PeftModel loads as it loads the pushed one, bit for bit."""
    from transformers import AutoTokenizer

    base = bases[arch]
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS + ["lm_head"], lora_dropout=0.0),
                           autocast_adapter_dtype=False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    with torch.no_grad():  # a trained adapter: lora_B is no longer zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.02)
    folder = tmp_path / "checkpoint-3"
    model.save_pretrained(folder)  # PEFT's defaults
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    head = "base_model.model.lm_head.base_layer.weight"
    assert (
        saved[head].dtype == torch.float32 and saved["base_model.model.lm_head.lora_A.weight"].dtype == torch.bfloat16
    )

    run, out, runner = str(tmp_path / "run"), tmp_path / "pulled", CliRunner()
    res = runner.invoke(app, ["push", str(folder), run], catch_exceptions=False)  # base: base_model_name_or_path
    assert res.exit_code == 0 and "pushed version 3" in res.output, res.output
    assert Run(run).newest().adapter.dtype == "bfloat16"
    res = runner.invoke(app, ["pull", run, str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "config.json").exists()  # an adapter folder loads with its base's config
    pulled = load_file(str(out / "adapter_model.safetensors"))
    assert set(pulled) == set(saved) - {head}
    assert tensor_digests(pulled) == tensor_digests({k: v for k, v in saved.items() if k != head})
    def peft_logits(adapter_dir: Path) -> torch.Tensor:
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir)
        with torch.no_grad():
            return loaded(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits

    assert torch.equal(peft_logits(out), peft_logits(folder))  # the pulled folder loads as the pushed one
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(base).chat_template

    # the saved head that is not the base's is refused, naming the tensor
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    from safetensors.torch import save_file

    save_file({**saved, head: saved[head] + 1}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=r"lm_head\.base_layer\.weight.*is not the base"):
        runner.invoke(app, ["push", str(bad), str(tmp_path / "run2")], catch_exceptions=False)
    # with no base at hand to check it against, the PEFT option to use is named
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
    with pytest.raises(ConfigError, match="save_embedding_layers=False"):
        runner.invoke(app, ["push", str(bad), run], catch_exceptions=False)


def test_adapter_run_follower_moves_across_a_rewind_bit_exact(bases, tmp_path):  # type: ignore[no-untyped-def]
    """A replica of an adapter run follows the first attempt to version 5; the trainer resumes
    from its step-3 adapter (a rewind) and trains on other data to 6: the replica never serves an
    abandoned version after the rewind and ends on the resumed trainer's adapter, bit-exact."""
    base, bucket = bases["qwen3"], str(tmp_path / "bucket")
    first = LoraTrainer(base)
    with Publisher(bucket, anchor_every=4, anchor_fraction=100.0) as pub:  # the first attempt: 0..5, then a crash
        pub.publish(first.model, 0)
        pub.flush()
        meta = Run(bucket).newest().adapter
        engine = EmbeddedAdapterEngine(base, adapter=meta)
        follower = Follower(bucket, hook=engine, poll_interval=0.05, adapter=meta)
        for step in range(1, 6):
            first.step()
            if step == 3:
                checkpoint = first.adapter()
            pub.publish(first.model, step)
            pub.flush()
        assert follower.sync_once() == 5
        abandoned = tensor_digests(engine.state_dict())
    second = LoraTrainer(base)  # resumed at checkpoint 3 (the same three steps), on other data from then on
    for _ in range(3):
        second.step()
    second.g = torch.Generator().manual_seed(99)
    assert tensor_digests(second.adapter()) == tensor_digests(checkpoint)
    with Publisher(bucket, anchor_every=4, anchor_fraction=100.0) as pub:
        pub.resume(second.model, version=3)
        assert follower.sync_once() == 3 == engine.weight_version
        assert tensor_digests(engine.state_dict()) == tensor_digests(checkpoint) != abandoned
        assert [c.state_digest for c in engine.generate(PROMPTS[0], ONE)] == [pub.state_digest]
        for step in (4, 5, 6):
            second.step()
            pub.publish(second.model, step)
            pub.flush()
            assert follower.sync_once() == step == engine.weight_version
            assert tensor_digests(engine.state_dict()) == tensor_digests(second.adapter())
            # each completion names the commit that made it, not only its number (3..5 were committed twice)
            assert [(c.weight_version, c.state_digest) for c in engine.generate(PROMPTS[0], ONE)] == [
                (step, pub.state_digest)
            ]
    fresh = EmbeddedAdapterEngine(base, adapter=meta)  # the resumed trainer's final adapter, loaded whole
    fresh.load_full(6, second.adapter())
    assert greedy(engine, GREEDY) == greedy(fresh, GREEDY)
