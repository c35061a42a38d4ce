"""Hostile adapter configs (issue 43, item 4): refused before anything is allocated or compiled.

A run's `adapter_config.json` is written by whoever can write the run. A rank far above the
tensors' (r = 2**20, or 4096 against tensors of rank 8), or a regex built for catastrophic
backtracking in `target_modules` / `exclude_modules` / `rank_pattern`, is refused at push (CLI
and Publisher), at follow (the commit record, the replica's engine) and at pull, each within
a second or two; a run mixing adapter and full-weight commits is not pulled. Every case here
checks a cheap refusal first, so that on code without the checks the test fails at that
assertion and never reaches a huge allocation or a hang.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="adapter runs need peft (pip install -e '.[lora]')")

from typer.testing import CliRunner  # noqa: E402

from inference_space.engines.embedded_adapter import EmbeddedAdapterEngine  # noqa: E402
from sparsesync.cli import app  # noqa: E402
from sparsesync.errors import ConfigError, MalformedCommitError, RunKindError  # noqa: E402
from sparsesync.protocol.publisher import Publisher  # noqa: E402
from sparsesync.protocol.records import CommitRecord  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from tests.protocol.test_lora import LoraTrainer, bases  # noqa: E402,F401  (bases: the module's fixture)

CATASTROPHIC = [("target_modules", "(.+)+Z"), ("target_modules", r"(\w+\.?)+x$"), ("exclude_modules", "(a|aa)+$"),
                ("rank_pattern", {"(.*q.*)+_nope": 8})]
HUGE = [{"r": 2**20}, {"rank_pattern": {"q_proj": 2**20}}, {"lora_alpha": float("inf")}, {"lora_alpha": 1e30}]


def _run_with_config(trainer: LoraTrainer, bucket: Path, **change: object) -> str:
    """An adapter run (one good version 1) whose commit record's adapter config then gets `change`."""
    with Publisher(str(bucket)) as pub:
        pub.publish(trainer.model, 1)
    commit = next((bucket / "commits").iterdir())
    raw = json.loads(commit.read_text())
    raw["adapter"]["config"] = {**raw["adapter"]["config"], **change}
    commit.write_text(json.dumps(raw))
    return commit.relative_to(bucket).as_posix()


def _push(folder: Path, run: Path, base: Path, **change: object):  # type: ignore[no-untyped-def]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, ["push", str(folder), str(run), "--base", str(base)])
    return res, time.perf_counter() - t0


@pytest.mark.parametrize("change", HUGE + [dict([c]) for c in CATASTROPHIC], ids=lambda c: next(iter(c)))
def test_an_out_of_bounds_config_is_not_a_commit_and_not_pushed(bases, tmp_path, change):  # type: ignore[no-untyped-def]
    trainer = LoraTrainer(bases["qwen3"], torch.bfloat16)
    key = _run_with_config(trainer, tmp_path / "bucket", **change)
    t0 = time.perf_counter()
    with pytest.raises(MalformedCommitError, match="adapter.config"):
        CommitRecord.from_json((tmp_path / "bucket" / key).read_bytes(), key)
    assert time.perf_counter() - t0 < 1.0
    # the replica of such a run sees no version (the record is rejected, with its reason): no allocation, no hang
    run = Run(str(tmp_path / "bucket"))
    assert run.commits() == [] and "adapter.config" in next(iter(run.rejected.values()))
    # push of a PEFT folder with that config: one ConfigError line, nothing published
    trainer.model.save_pretrained(tmp_path / "adapter")
    res, took = _push(tmp_path / "adapter", tmp_path / "run", bases["qwen3"], **change)
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError), res.output
    assert took < 2.0 and not (tmp_path / "run" / "commits").exists()


def test_a_rank_the_tensors_do_not_have_is_refused_at_push_follow_and_pull(bases, tmp_path):  # type: ignore[no-untyped-def]
    trainer = LoraTrainer(bases["qwen3"], torch.bfloat16)
    # push: the folder's config says r=4096 (in bounds), its tensors have rank 8
    trainer.model.save_pretrained(tmp_path / "adapter")
    res, _ = _push(tmp_path / "adapter", tmp_path / "run", bases["qwen3"], r=4096)
    assert isinstance(res.exception, ConfigError) and "rank 4096" in str(res.exception), res.output
    res, _ = _push(tmp_path / "adapter", tmp_path / "run", bases["qwen3"], r=8, rank_pattern={"q_proj": 64})
    assert isinstance(res.exception, ConfigError) and "q_proj" in str(res.exception), res.output
    assert not (tmp_path / "run" / "commits").exists()
    # publish: the same through the library
    from sparsesync.protocol.adapter_runs import meta_from_peft

    good = meta_from_peft(trainer.model)
    with Publisher(str(tmp_path / "lib"), adapter=replace(good, config={**good.config, "r": 4096})) as pub:
        with pytest.raises(ConfigError, match="rank 4096"):
            pub.publish(trainer.adapter(), 1)
    # follow and pull: a run whose record was rewritten to r=4096 after the fact
    bucket = tmp_path / "bucket"
    _run_with_config(trainer, bucket, r=4096)
    rewritten = Run(str(bucket)).newest().adapter
    assert rewritten is not None and rewritten.rank == 4096
    out = tmp_path / "pulled"
    res = CliRunner().invoke(app, ["pull", str(bucket), str(out)])
    assert isinstance(res.exception, ConfigError) and "rank 4096" in str(res.exception), res.output
    assert not out.exists()  # no folder PEFT would load (it would allocate the config's rank)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="more than the base model"):  # before PEFT allocates it
        EmbeddedAdapterEngine(bases["qwen3"], adapter=rewritten)
    from inference_space.replica import ReplicaConfig, build_replica

    with pytest.raises(ConfigError, match="more than the base model"):
        build_replica(ReplicaConfig(model=str(bases["qwen3"]), bucket=str(bucket)))
    assert time.perf_counter() - t0 < 20.0


def test_pull_refuses_a_run_mixing_adapter_and_full_weight_commits(bases, tmp_path):  # type: ignore[no-untyped-def]
    trainer = LoraTrainer(bases["qwen3"], torch.bfloat16)
    lora, full = tmp_path / "lora", tmp_path / "full"
    with Publisher(str(lora)) as pub:
        pub.publish(trainer.model, 1)
    with Publisher(str(full)) as pub:
        pub.publish({"w": torch.zeros(4, 4)}, 2)
    for sub in ("commits", "anchors"):  # a second publisher's version lands in the adapter run
        shutil.copytree(full / sub, lora / sub, dirs_exist_ok=True)
    for version in ("2", "1"):
        res = CliRunner().invoke(app, ["pull", str(lora), str(tmp_path / f"out{version}"), "--version", version])
        assert isinstance(res.exception, RunKindError), res.output
        assert "adapter versions (1)" in str(res.exception) and "full-weight versions (2)" in str(res.exception)
        assert not (tmp_path / f"out{version}").exists()
