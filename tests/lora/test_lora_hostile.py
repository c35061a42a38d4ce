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
import logging
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
from sparsesync.protocol.records import CommitRecord  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from tests.lora.test_lora import LoraTrainer, bases  # noqa: E402,F401  (bases: the module's fixture)

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
def test_an_out_of_bounds_config_is_not_a_commit_and_not_pushed(bases, tmp_path, change):
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


def test_a_rank_the_tensors_do_not_have_is_refused_at_push_follow_and_pull(bases, tmp_path):
    trainer = LoraTrainer(bases["qwen3"], torch.bfloat16)
    # push: the folder's config says r=4096 (in bounds), its tensors have rank 8
    trainer.model.save_pretrained(tmp_path / "adapter")
    res, _ = _push(tmp_path / "adapter", tmp_path / "run", bases["qwen3"], r=4096)
    assert isinstance(res.exception, ConfigError) and "rank 4096" in str(res.exception), res.output
    res, _ = _push(tmp_path / "adapter", tmp_path / "run", bases["qwen3"], r=8, rank_pattern={"q_proj": 64})
    assert isinstance(res.exception, ConfigError) and "q_proj" in str(res.exception), res.output
    assert not (tmp_path / "run" / "commits").exists()
    # publish: the same through the library
    from sparsesync.lora.state import meta_from_peft

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


# -- a replica says why it serves nothing (issue 53) ----------------------------------------------
def _heartbeat_error(bucket: Path, replica: str) -> str:
    from sparsesync.protocol.fleet import read_fleet
    from sparsesync.store import open_store

    return next((s.record.last_error or "" for s in read_fleet(open_store(str(bucket))).replicas
                 if s.record.replica == replica), "")


@pytest.mark.parametrize("change", [{"r": 10**9}, {"target_modules": "(.+)+Z"}], ids=["rank", "regex"])
def test_a_replica_of_a_run_whose_commits_it_refuses_says_why_once(bases, tmp_path, monkeypatch, caplog, change):
    import httpx

    from inference_space.replica import ReplicaConfig, build_replica
    from tests.apps.inference.test_server import Server, wait_sync
    from tests.protocol.test_fleet import _status
    from tests.support.waiting import until

    bucket = tmp_path / "bucket"
    key = _run_with_config(LoraTrainer(bases["qwen3"], torch.bfloat16), bucket, **change)  # the run's only commit
    monkeypatch.setenv("SPARSESYNC_REPLICA_ID", "refusing")
    monkeypatch.setenv("SPARSESYNC_HEARTBEAT_S", "0.1")
    caplog.set_level(logging.WARNING, logger="sparsesync.protocol.follower.follower")
    replica = build_replica(ReplicaConfig(model=str(bases["qwen3"]), bucket=str(bucket), poll_interval=0.05))
    try:
        with Server(replica) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            st = wait_sync(client, lambda s: s["last_error"] is not None, timeout=20)  # was None for as long as it ran
            err = st["last_error"]
            assert st["state"] == "degraded" and st["serving_version"] is None and st["current_version"] is None
            assert key in err and f"adapter.config.{next(iter(change))}" in err and "\n" not in err, err
            assert st["refused"] == [{"key": key, "reason": st["refused"][0]["reason"]}]
            assert "adapter.config" in st["refused"][0]["reason"]
            assert client.get("/health").json()["state"] == "degraded"
            until(lambda: key in _heartbeat_error(bucket, "refusing"), 10, "the heartbeat naming the refused commit")
            code, report = _status(str(bucket))
            assert code == 3 and report["newest_version"] is None and report["refused"][0]["key"] == key
            assert any(p.startswith("refusing is degraded") and key in p for p in report["problems"]), report[
                "problems"
            ]
            assert any(p.startswith(f"commit {key} is not a commit record") for p in report["problems"]), report[
                "problems"
            ]
            time.sleep(1.0)
            assert client.get("/sync").json()["last_error"] == err
    finally:
        replica.close()
    logged = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(logged) == 1 and "refusing commit" in logged[0], logged  # once, not once per poll


def test_an_adapter_naming_a_module_the_base_lacks_is_one_line_refused_or_fatal(bases, tmp_path, monkeypatch, caplog):
    import os
    import subprocess
    import sys

    import httpx

    from inference_space.replica import ReplicaConfig, build_replica
    from sparsesync.errors import AdapterTargetError
    from tests.apps.inference.test_server import Server, free_port, wait_sync

    base, bucket = bases["qwen3"], tmp_path / "bucket"
    trainer = LoraTrainer(base, torch.bfloat16)
    with Publisher(str(bucket)) as pub:
        for version in (1, 2):
            pub.publish(trainer.model, version)
            trainer.step()
    v2 = sorted((bucket / "commits").iterdir())[-1]
    raw = json.loads(v2.read_text())
    raw["adapter"]["config"]["target_modules"] = ["does_not_exist"]  # what a trainer on another model would write
    v2.write_text(json.dumps(raw))
    key = v2.relative_to(bucket).as_posix()
    hidden = v2.rename(tmp_path / v2.name)  # the replica starts on version 1

    monkeypatch.setenv("SPARSESYNC_HEARTBEAT_S", "0.1")
    caplog.set_level(logging.WARNING, logger="sparsesync.protocol.follower.follower")
    replica = build_replica(ReplicaConfig(model=str(base), bucket=str(bucket), poll_interval=0.05))
    try:
        with Server(replica) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            wait_sync(client, lambda s: s["serving_version"] == 1)
            hidden.rename(v2)  # version 2 lands: the replica keeps serving 1 and says why
            st = wait_sync(client, lambda s: s["last_error"] is not None, timeout=20)
            err = st["last_error"]
            assert st["state"] == "degraded" and st["serving_version"] == 1 and st["newest_version"] == 2
            assert (
                key in str(st["refused"]) and "does_not_exist" in err and "target_modules" in err and "\n" not in err
            ), st
            out = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 0}).json()
            assert out["choices"][0]["weight_version"] == 1
            time.sleep(1.0)  # >= 20 polls
    finally:
        replica.close()
    logged = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(logged) == 1 and "does_not_exist" in logged[0], logged

    # the engine itself: one line naming the module, the base and the fix, before PEFT allocates anything
    meta = Run(str(bucket)).newest().adapter
    with pytest.raises(AdapterTargetError, match=r'target_modules=\["does_not_exist"\].*targets no module') as info:
        EmbeddedAdapterEngine(base, adapter=meta)
    assert str(base) in str(info.value) and "q_proj" in str(info.value) and info.value.hint

    # a replica started on that run never served: it exits with that line (no traceback)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inference_space",
            "--model",
            str(base),
            "--bucket",
            str(bucket),
            "--port",
            str(free_port()),
            "--device",
            "cpu",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: the adapter of") and "does_not_exist" in lines[0] and str(base) in lines[0], (
        lines
    )
    assert "start the replica with the base model the adapter was trained on" in lines[0]
