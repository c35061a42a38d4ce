"""The project's trainer (`trainer.train.AsyncGRPOTrainer`, one process) across a rewind.

Real parts, as `sparsesync demo` runs them: the env server and an embedded-engine replica as
processes following a local bucket; the trainer in this process. The first attempt trains 5
steps (versions 0..5) and "crashes"; the second starts from version 4's weights (`sparsesync pull
--version 4`, what a checkpoint from before the crash holds) and trains 3 more: the run is
rewound to 4 and goes on to 7 at the same URL. A second replica (a follower driving an embedded
engine in this process) followed the first attempt: it ends serving the trainer's final weights,
bit-exact with a fresh engine, and never serves the abandoned version after the rewind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("openenv")

from typer.testing import CliRunner  # noqa: E402

from sparsesync.cli import app  # noqa: E402
from sparsesync.codec import state_digest, tensor_digests  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.run import Run  # noqa: E402
from tests.support.served import ServedDigests  # noqa: E402
from tests.support.stack import start_env_and_replica
from tests.support.waiting import until  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402
from trainer.processes import ProcessSet  # noqa: E402
from trainer.train import AsyncGRPOTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _config(model: Path, bucket: str, replica: str, env: str, steps: int) -> TrainerConfig:
    return TrainerConfig.from_dict({
        "model": {"path": str(model), "device": "cpu", "master_dtype": "float32"},
        "rollout": {"replicas": [replica], "env_url": env, "group_size": 4, "max_tokens": 16, "workers": 2},
        "optim": {"steps": steps, "groups_per_step": 2, "buffer_groups": 4, "lr": 2e-3, "max_staleness": 4},
        "sync": {"bucket": bucket, "anchor_every": 0, "anchor_fraction": 4.0, "fleet_timeout_s": 60.0},
        "log": {"progress": False},
    })



def test_the_trainer_resumed_from_an_older_version_rewinds_the_run(tmp_path: Path) -> None:
    from inference_space.engines.embedded import EmbeddedEngine
    from sparsesync.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0)
    bucket = str(tmp_path / "bucket")
    mine = ServedDigests(EmbeddedEngine(model))
    follower = Follower(bucket, mine, poll_interval=0.05, max_poll_interval=0.05)
    with ProcessSet(tmp_path / "logs", env=ENV) as procs:
        env, replica = start_env_and_replica(procs, model, bucket)
        follower.start()
        try:
            first = AsyncGRPOTrainer(_config(model, bucket, replica.url, env.url, steps=5)).run()
            assert first.final_version == 5
            abandoned = Run(bucket).commit(5).state_digest
            until(lambda: mine.served[-1:] == [abandoned], 60, "the replica to serve the first attempt's version 5")
            n_before = len(mine.served)
            # the checkpoint from before the crash: the model folder with version 4's weights (`sparsesync pull`)
            shutil.copytree(model, tmp_path / "ckpt4")
            res = CliRunner().invoke(app, ["pull", bucket, str(tmp_path / "ckpt4"), "--version", "4"])
            assert res.exit_code == 0, res.output
            second = AsyncGRPOTrainer(_config(tmp_path / "ckpt4", bucket, replica.url, env.url, steps=3)).run()
            until(lambda: mine.served[-1:] == [second.state_digest], 60, "the replica to serve the final weights")
            health = httpx.get(f"{replica.url}/health").json()
            until(lambda: httpx.get(f"{replica.url}/health").json()["state_digest"] == second.state_digest, 60,
                   "the replica process to serve the final weights")
        finally:
            follower.stop()

    assert second.final_version == 7 and second.state_digest != abandoned
    commits = Run(bucket).commits()
    assert [(c.version, c.epoch) for c in commits] == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2), (7, 2)]
    assert commits[4].metrics["kind"] == "rewind" and [c.base_version for c in commits[5:]] == [4, 5, 6]
    assert abandoned not in mine.served[n_before:]  # never the abandoned version after the rewind
    assert health["weight_version"] >= 4
    # the replica, a fresh engine loaded from the final version and `sparsesync pull` agree bit for bit
    shutil.copytree(model, tmp_path / "final")
    res = CliRunner().invoke(app, ["pull", bucket, str(tmp_path / "final")])
    assert res.exit_code == 0, res.output
    fresh = EmbeddedEngine(tmp_path / "final").state_dict()
    got = mine.engine.state_dict()
    assert fresh.keys() == got.keys()
    assert all(torch.equal(fresh[k].to(got[k].dtype).view(torch.uint8), got[k].view(torch.uint8)) for k in got)
    assert state_digest(tensor_digests(got)) == second.state_digest
