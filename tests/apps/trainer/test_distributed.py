"""The trainer under real `torchrun` (2 gloo ranks on CPU, FSDP2), publishing through the distributed publisher.

Real processes, as `sparsesync demo` runs them: the env server, one embedded-engine replica
following the local bucket, and `python -m torch.distributed.run --nproc-per-node 2 -m trainer`
(loopback rendezvous on a free port). Every committed version must rebuild bit for bit: a chain
of anchor + parts reproduces each commit's state digest (recomputed from the tensors), and the
last one is the trainer's gathered full weights (the digest rank 0 prints).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

pytest.importorskip("transformers")
pytest.importorskip("openenv")

from sparsesync.codec import state_digest, tensor_digests  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.protocol.verify import verify_run  # noqa: E402
from tests.support.stack import start_env_and_replica
from trainer.config import TrainerConfig  # noqa: E402
from trainer.processes import ProcessSet, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@contextmanager
def _job(tmp_path: Path, arch: str, steps: int, effort: str = "size") -> Iterator[tuple[Path, str, str]]:
    """A tiny model of `arch`, the env server and one replica following a fresh bucket; yields
    (config path, bucket, replica URL). `effort`: the publisher's codec effort (`[sync] effort`)."""
    from sparsesync.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, arch=arch)
    bucket = str(tmp_path / "bucket")
    with ProcessSet(tmp_path / "logs", env=ENV) as procs:
        env, replica = start_env_and_replica(procs, model, bucket)
        cfg = TrainerConfig.from_dict({
            "model": {"path": str(model), "device": "cpu", "master_dtype": "float32"},
            "rollout": {"replicas": [replica.url], "env_url": env.url, "group_size": 4, "max_tokens": 16, "workers": 2},
            "optim": {"steps": steps, "groups_per_step": 4, "buffer_groups": 8, "lr": 2e-3, "max_staleness": 4},
            "sync": {"bucket": bucket, "anchor_every": 0, "anchor_fraction": 4.0, "effort": effort},
            "log": {"progress": False},
            "distributed": {"timeout_s": 60.0},
        })
        path = tmp_path / "trainer.toml"
        path.write_text(cfg.to_toml())
        yield path, bucket, replica.url


def _torchrun(config: Path, nproc: int = 2) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "trainer", "--config", str(config)],
        cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _replay(url: str) -> dict[int, str]:
    """Apply every committed version in order (anchor, then parts, each checked by the reader
    against its commit); the digest of each version's full tensors. {version: digest}."""
    run = Run(url)
    commits = run.commits()
    _rec, state, digests = run.reconstruct(commits[0].version)
    out = {commits[0].version: state_digest(tensor_digests(state))}
    for rec in commits[1:]:
        if rec.has_anchor and not rec.parts:  # a new writer's first version
            state, digests = run.fetch_anchor(rec)
        else:
            assert rec.parts and rec.base_version == rec.version - 1, rec
            run.apply_delta(rec, state, digests)
        # a sharded version's record digest is over its row units (docs/protocol.md, "Units")
        assert state_digest(digests) == rec.state_digest
        out[rec.version] = state_digest(tensor_digests(state))
    return out


@pytest.mark.slow
def test_torchrun_fsdp2_trainer_publishes_every_version_bit_exact_with_tied_embeddings(tmp_path: Path) -> None:
    # [sync] effort reaches every rank
    with _job(tmp_path, "qwen3-tied", steps=3, effort="speed") as (config, bucket, replica):
        proc = _torchrun(config)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        m = re.search(r"published version (\d+) \(state digest ([\w:]+)\)", out)
        assert m and int(m.group(1)) == 3, out[-3000:]
        assert out.count("trained 3 steps") == 1  # rank 0 reports for the job
        commit = re.search(r"commit record of version 3: state digest ([\w:]+)", out)
        assert commit and commit.group(1) == Run(bucket).commit(3).state_digest != m.group(2)
        digests = _replay(bucket)
        assert sorted(digests) == [0, 1, 2, 3] and digests[3] == m.group(2)  # the gathered full weights
        commits = Run(bucket).commits()
        assert commits[0].has_anchor and not commits[0].parts
        for c in commits[1:]:  # each rank stored its own rows, in global coordinates
            assert len({p.key.rsplit("-", 2)[-2] for p in c.parts}) == 2
            assert any(u.rows is not None and u.rows[0] > 0 for p in c.parts for u in p.units)
        f = Follower(bucket)
        assert f.sync_once() == 3 and state_digest(tensor_digests(f.mirror)) == m.group(2)
        # tied: the head is the embedding, published once under the checkpoint's name (as one process does)
        assert "lm_head.weight" not in f.mirror
        emb = "model.embed_tokens.weight"
        assert not f.mirror[emb].equal(Run(bucket).reconstruct(0)[1][emb])  # it trained
        deadline = time.monotonic() + 60  # the replica applied the sharded parts too
        while (st := httpx.get(replica + "/sync", timeout=5).json()).get("current_version") != 3:
            assert time.monotonic() < deadline, st
            time.sleep(0.3)
        assert st["state"] == "following"
        # what the replica's engine computes: its greedy completions scored by the rebuilt version 3
        from trainer.demo import _outputs_check

        served = {**f.mirror, "lm_head.weight": f.mirror[emb]}  # transformers' state dict names the tied head too
        check = _outputs_check([replica], Path(TrainerConfig.load(config).model.path), served)
        assert check["ok"], check
        _continue(tmp_path, config, bucket, digests[3])
    assert verify_run(bucket).ok


def _version_folder(model: str, bucket: str, version: int, dest: Path) -> Path:
    """A model folder holding `version` of the run (what `sparsesync pull --version` writes)."""
    from safetensors.torch import save_file

    shutil.copytree(model, dest)
    for f in dest.glob("*.safetensors"):
        f.unlink()
    save_file(
        {k: t.contiguous() for k, t in Run(bucket).reconstruct(version)[1].items()}, str(dest / "model.safetensors")
    )
    return dest


def _continue(tmp_path: Path, config: Path, bucket: str, newest_digest: str) -> None:
    """A new torchrun job on the same bucket: refused from weights that are no version of the run;
    from the newest (`sparsesync pull`-style folder) it continues with version 4, a delta."""
    from sparsesync.tiny_model import build_tiny_model

    cfg = TrainerConfig.load(config)
    cfg.optim.steps = 1
    again = tmp_path / "again.toml"
    start = cfg.model.path
    cfg.model.path = str(build_tiny_model(tmp_path / "stranger", seed=1, arch="qwen3-tied"))  # no version of the run
    again.write_text(cfg.to_toml())
    proc = _torchrun(again)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and out.count("is not the weights at [model] path") == 2, out[-3000:]
    cfg.model.path = str(_version_folder(start, bucket, 3, tmp_path / "newest"))
    again.write_text(cfg.to_toml())
    proc = _torchrun(again)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    run = Run(bucket)
    assert [c.version for c in run.commits()] == [0, 1, 2, 3, 4]
    v4 = run.commit(4)  # the same world size: the new writer resumes with a delta in parts from version 3
    assert v4.parts and v4.base_version == 3 and not v4.has_anchor
    digests = _replay(bucket)
    assert digests[3] == newest_digest and sorted(digests) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_torchrun_trainer_resumed_from_an_older_version_rewinds_the_run_and_replicas_follow(tmp_path: Path) -> None:
    """2 FSDP2 ranks train 3 steps (versions 0..3); the next job starts from an older version's weights
    (a checkpoint from before a crash): every rank checks them over the run's units, the run is rewound
    to it (a new epoch) and goes on with deltas; the replica and a follower that held the abandoned
    version 3 end with the second job's final weights, bit for bit."""
    with _job(tmp_path, "qwen3", steps=3) as (config, bucket, replica):
        proc = _torchrun(config)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        f = Follower(bucket)
        assert f.sync_once() == 3
        # the checkpoint: the newest version whose weights are not version 3's (a step with no reward changes nothing)
        full = _replay(bucket)
        older = max(v for v in full if full[v] != full[3])
        cfg = TrainerConfig.load(config)
        cfg.optim.steps = 2
        cfg.model.path = str(_version_folder(cfg.model.path, bucket, older, tmp_path / "ckpt"))
        again = tmp_path / "again.toml"
        again.write_text(cfg.to_toml())
        proc = _torchrun(again)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        assert out.count(f"[model] path holds version {older} of") == 2, out[-3000:]  # on every rank
        m = re.search(r"published version (\d+) \(state digest ([\w:]+)\)", out)
        assert m and int(m.group(1)) == older + 2, out[-3000:]
        run = Run(bucket)
        commits = run.commits()
        assert [c.version for c in commits] == list(range(older + 3)) and len({c.epoch for c in commits[older:]}) == 1
        rec = commits[older]
        assert rec.metrics["kind"] == "rewind" and rec.metrics["abandoned"] == list(range(older + 1, 4))
        assert rec.epoch > commits[0].epoch and rec.has_anchor
        assert all(c.parts and c.base_version == c.version - 1 for c in commits[older + 1:])
        assert f.sync_once() == older + 2 and state_digest(tensor_digests(f.mirror)) == m.group(2)  # bit-exact
        deadline = time.monotonic() + 60  # the replica too
        while httpx.get(replica + "/health", timeout=5).json().get("state_digest") != commits[-1].state_digest:
            assert time.monotonic() < deadline, httpx.get(replica + "/sync", timeout=5).json()
            time.sleep(0.3)
        assert _replay(bucket)[older + 2] == m.group(2)
    assert verify_run(bucket).ok


def _rank_pid(launcher: subprocess.Popen[str], rank: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "trainer" in child.cmdline():
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} under torchrun")


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_on_rank_0_in_bounded_time_without_a_torn_version(tmp_path: Path) -> None:
    with _job(tmp_path, "qwen3", steps=200) as (config, bucket, _replica):
        proc = _torchrun(config)
        try:
            victim = _rank_pid(proc, 1)
            deadline = time.monotonic() + 180
            while not ((tmp_path / "bucket").is_dir() and len(Run(bucket).commits()) >= 3):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            out, _ = proc.communicate(timeout=90)
            ended_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode != 0 and ended_s < 60, (proc.returncode, ended_s, out[-3000:])
        assert re.search(r"rank 0: error: .*(another rank|a rank)", out), out[-3000:]  # rank 0 says why, loudly
        assert "trained 200 steps" not in out
    digests = _replay(bucket)  # whatever was committed is whole: contiguous versions, every one bit-exact
    assert len(digests) >= 3 and sorted(digests) == list(range(len(digests)))
    assert verify_run(bucket).ok


@pytest.mark.slow
def test_rank_0_failing_alone_stops_every_rank_with_its_error(tmp_path: Path) -> None:
    """Rank 0 waits for a fleet that never reports (its own failure, while the other rank waits
    for the first batch): every rank ends with rank 0's error, in bounded time."""
    from sparsesync.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, arch="qwen3")
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    cfg = TrainerConfig.from_dict({
        "model": {"path": str(model), "device": "cpu", "master_dtype": "float32"},
        "rollout": {"replicas": [dead[0]], "env_url": dead[1]},
        "optim": {"steps": 5, "groups_per_step": 2},
        "sync": {"bucket": str(tmp_path / "bucket"), "fleet_min_replicas": 1, "fleet_timeout_s": 3.0},
        "log": {"progress": False},
        "distributed": {"timeout_s": 60.0},
    })
    (tmp_path / "trainer.toml").write_text(cfg.to_toml())
    proc = _torchrun(tmp_path / "trainer.toml")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert re.search(r"rank 0: error: .*replica", out), out[-3000:]
    assert re.search(r"rank 1: error: rank 0 stopped the run at step 1: FleetTimeoutError", out), out[-3000:]
    assert [c.version for c in Run(str(tmp_path / "bucket")).commits()] == [0]  # the gathered first version only


def test_the_ranks_shares_of_a_step_average_to_the_whole_steps_gradient() -> None:
    """Data parallel GRPO: with token_norm = the step's tokens / world, the mean of the ranks'
    gradients (what FSDP's reduce-scatter computes) is the gradient of the whole step's loss."""
    import torch

    from trainer.buffer import Group, Sample
    from trainer.distributed import my_groups
    from trainer.grpo import Batch, grpo_loss

    g = torch.Generator().manual_seed(0)
    groups = [Group(i, "p", [Sample((1, 2, 3)[: 1 + (i + j) % 3], tuple(range(1 + (i * j) % 4)),
                                    tuple(-1.0 - 0.1 * k for k in range(1 + (i * j) % 4)), 0.1 * j, 0.5 - 0.25 * j, 0)
                             for j in range(4)]) for i in range(5)]
    weight = torch.randn(8, 8, generator=g, dtype=torch.float64)

    def grad(gs: list[Group], token_norm: float | None) -> torch.Tensor:
        s = [x for grp in gs for x in grp.samples]
        b = Batch.build([x.prompt_ids for x in s], [x.completion_ids for x in s], [x.logprobs for x in s],
                        [x.advantage for x in s])
        w = weight.clone().requires_grad_(True)
        logits = w[b.input_ids[:, :-1]].sum(-1).float()  # a tiny differentiable "policy"
        logp = torch.log_softmax(torch.stack([logits, -logits], -1), -1)[..., 0]
        loss, _ = grpo_loss(logp, b, token_norm=token_norm)
        loss.backward()
        return w.grad  # type: ignore[return-value]

    whole = grad(groups, None)
    tokens = sum(len(x.completion_ids) for grp in groups for x in grp.samples)
    for world in (2, 3):
        shares = [grad(my_groups(groups, r, world), tokens / world) for r in range(world)]
        assert sorted(grp.group_id for r in range(world) for grp in my_groups(groups, r, world)) == list(range(5))
        assert torch.allclose(sum(shares) / world, whole, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(grad(my_groups(groups, 0, world), None), whole)  # its own share alone is not


def test_sigterm_from_the_launcher_becomes_a_one_line_rank_failure() -> None:
    """torchrun stops the surviving ranks with SIGTERM when one fails: the rank unwinds (its
    cleanup runs) and says why, instead of dying silently."""
    code = ("import sys, time\n"
            "from trainer.distributed import stop_on_sigterm\n"
            "stop_on_sigterm(3)\n"
            "try:\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(60)\n"
            "finally:\n"
            "    print('cleanup ran', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "cleanup ran" in out
    assert "RankFailedError: rank 3: stopped by the launcher (signal 15): another rank of the trainer failed" in err
