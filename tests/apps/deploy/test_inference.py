"""`sparsesync deploy inference --dry-run`: the rendered Space folder, the plan, and a local boot.

The rendered folder is started as a plain process (`python -m inference_space`, with the
packages from the folder itself) and must follow a local bucket. No network beyond 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.deploy.errors import DeployError
from sparsesync.deploy.inference import inference_space_specs

pytest.importorskip("transformers", reason="the embedded engine needs transformers (pip install -e '.[embedded]')")

from inference_space.testing import PROMPTS, Trainer  # noqa: E402
from sparsesync.protocol.publisher import Publisher  # noqa: E402
from tests.apps.inference.test_server import free_port  # noqa: E402


def test_specs_private_by_default_token_only_as_secret(tiny):
    specs = inference_space_specs("me/rep", bucket="hf://buckets/me/b/run1", model=str(tiny), replicas=3,
                                  regions=["us", "eu"], token="hf_secretTokenValue123")
    assert [s.space_id for s in specs] == ["me/rep-1", "me/rep-2", "me/rep-3"]
    assert [s.region for s in specs] == ["us", "eu", "us"]
    assert all(s.private and s.hardware == "l4x1" and s.secrets == {"HF_TOKEN": "hf_secretTokenValue123"} for s in specs)
    assert "hf_secret" not in repr(specs[0]) and "HF_TOKEN" not in specs[0].variables
    assert specs[0].variables["SPARSESYNC_ENGINE"] == "vllm" and specs[0].variables["SPARSESYNC_MODEL"] == "model"
    with pytest.raises(DeployError, match="local folder"):
        inference_space_specs("me/rep", bucket="/tmp/bucket", model=str(tiny))
    with pytest.raises(DeployError, match="engine"):
        inference_space_specs("me/rep", bucket="s3://b/p", model=str(tiny), engine="tgi")


def test_dry_run_renders_a_space_that_boots_and_follows_a_local_bucket(tiny, tmp_path):
    bucket = tmp_path / "bucket"
    out = tmp_path / "space"
    res = CliRunner().invoke(app, ["deploy", "inference", "--space", "me/replica", "--bucket", str(bucket), "--model", str(tiny),
                                   "--engine", "embedded", "--dry-run", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "private" in res.output and "dry run: nothing sent" in res.output and "request hardware cpu-upgrade" in res.output
    for f in ("Dockerfile", "README.md", "requirements.txt", "inference_space/server.py", "sparsesync/protocol/follower.py", "model/model.safetensors"):
        assert (out / f).is_file(), f
    card = (out / "README.md").read_text()
    assert "sdk: docker" in card and "app_port: 7860" in card and "replica (sparsesync replica)" in card
    assert "transformers==" in (out / "requirements.txt").read_text()

    assert not list(out.rglob("*.so")), "compiled files must not travel: the image compiles the codec itself"
    subprocess.run([sys.executable, "sparsesync/codec/_build.py"], cwd=out, check=True, capture_output=True)  # as the Dockerfile does
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(SPARSESYNC_MODEL="model", SPARSESYNC_BUCKET=str(bucket), SPARSESYNC_ENGINE="embedded", PORT=str(port),
               SPARSESYNC_POLL_INTERVAL="0.05", SPARSESYNC_LOG_LEVEL="WARNING", SPARSESYNC_SERVED_MODEL_NAME="replica")
    proc = subprocess.Popen([sys.executable, "-m", "inference_space"], cwd=out, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the rendered Space did not start"
            time.sleep(0.1)
        where = httpx.get(f"{url}/sync", timeout=5).json()
        assert where["model"] == "replica" and where["serving_version"] is None
        trainer = Trainer(tiny, seed=9)
        with Publisher(str(bucket), anchor_every=0) as pub:
            for step in (1, 2, 3):
                pub.publish(trainer.step(), step)
                pub.flush()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/sync", timeout=5).json()["current_version"] != 3:
            assert time.monotonic() < deadline, httpx.get(f"{url}/sync", timeout=5).json()
            time.sleep(0.05)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
