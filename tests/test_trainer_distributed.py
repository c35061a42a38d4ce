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
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("openenv")
psutil = pytest.importorskip("psutil")

from sparsesync.codec import state_digest, tensor_digests  # noqa: E402
from sparsesync.protocol.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from sparsesync.protocol.verify import verify_run  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.processes import ProcessSet, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@contextmanager
def _job(tmp_path: Path, arch: str, steps: int) -> Iterator[tuple[Path, str, str]]:
    """A tiny model of `arch`, the env server and one replica following a fresh bucket; yields
    (config path, bucket, replica URL)."""
    from sparsesync.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, arch=arch)
    bucket = str(tmp_path / "bucket")
    py = sys.executable
    with ProcessSet(tmp_path / "logs", env=ENV) as procs:
        port = free_port()
        env = procs.start("env", [py, "-m", "env_space", "--host", "127.0.0.1", "--port", str(port), "--task", "repeat"],
                          url=f"http://127.0.0.1:{port}")
        port = free_port()
        replica = procs.start("replica", [py, "-m", "inference_space", "--model", str(model), "--bucket", bucket,
                                          "--engine", "embedded", "--host", "127.0.0.1", "--port", str(port),
                                          "--poll-interval", "0.2", "--log-level", "WARNING"],
                              url=f"http://127.0.0.1:{port}")
        procs.wait_healthy([env, replica], 120)
        cfg = TrainerConfig.from_dict({
            "model": {"path": str(model), "device": "cpu", "master_dtype": "float32"},
            "rollout": {"replicas": [replica.url], "env_url": env.url, "group_size": 4, "max_tokens": 4, "workers": 2},
            "optim": {"steps": steps, "groups_per_step": 2, "buffer_groups": 4, "lr": 2e-3, "max_staleness": 4},
            "sync": {"bucket": bucket, "anchor_every": 0, "anchor_fraction": 4.0},
            "log": {"progress": False},
            "distributed": {"timeout_s": 60.0},
        })
        path = tmp_path / "trainer.toml"
        path.write_text(cfg.to_toml())
        yield path, bucket, replica.url


def _torchrun(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
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
        assert rec.parts and rec.base_version == rec.version - 1, rec
        run.apply_delta(rec, state, digests)
        # a sharded version's record digest is over its row units (docs/protocol.md, "Units")
        assert state_digest(digests) == rec.state_digest
        out[rec.version] = state_digest(tensor_digests(state))
    return out


@pytest.mark.slow
def test_torchrun_fsdp2_trainer_publishes_every_version_bit_exact_with_tied_embeddings(tmp_path: Path) -> None:
    with _job(tmp_path, "qwen3-tied", steps=3) as (config, bucket, replica):
        proc = _torchrun(config)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        m = re.search(r"published version (\d+) \(state digest (\w+)\)", out)
        assert m and int(m.group(1)) == 3, out[-3000:]
        assert out.count("trained 3 steps") == 1  # rank 0 reports for the job
        digests = _replay(bucket)
        assert sorted(digests) == [0, 1, 2, 3] and digests[3] == m.group(2)  # the gathered full weights
        commits = Run(bucket).commits()
        assert commits[0].has_anchor and not commits[0].parts
        for c in commits[1:]:  # each rank stored its own rows, in global coordinates
            assert len({p.key.rsplit("-", 2)[-2] for p in c.parts}) == 2
            assert any(u.rows is not None and u.rows[0] > 0 for p in c.parts for u in p.units)
        f = Follower(bucket)
        assert f.sync_once() == 3 and state_digest(tensor_digests(f.mirror)) == m.group(2)
        # tied: the LM head is published under its checkpoint name too, equal to the embedding
        assert f.mirror["lm_head.weight"].equal(f.mirror["model.embed_tokens.weight"])
        assert not f.mirror["lm_head.weight"].equal(Run(bucket).reconstruct(0)[1]["lm_head.weight"])  # it trained
        deadline = time.monotonic() + 60  # the replica applied the sharded parts too
        while (st := httpx.get(replica + "/sync", timeout=5).json()).get("current_version") != 3:
            assert time.monotonic() < deadline, st
            time.sleep(0.3)
        assert st["state"] == "following"
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
