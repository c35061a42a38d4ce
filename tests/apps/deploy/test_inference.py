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

from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from tests.apps.inference.test_server import free_port  # noqa: E402
from tests.support.model_steps import PROMPTS, Trainer  # noqa: E402


def test_specs_private_by_default_token_only_as_secret(tiny):
    specs = inference_space_specs("me/rep", bucket="hf://buckets/me/b/run1", model=str(tiny), replicas=3,
                                  regions=["us", "eu"], token="hf_secretTokenValue123")
    assert [s.space_id for s in specs] == ["me/rep-1", "me/rep-2", "me/rep-3"]
    assert [s.region for s in specs] == ["us", "eu", "us"]
    assert all(
        s.private and s.hardware == "l4x1" and s.secrets == {"HF_TOKEN": "hf_secretTokenValue123"} for s in specs
    )
    assert "hf_secret" not in repr(specs[0]) and "HF_TOKEN" not in specs[0].variables
    assert specs[0].variables["SPARSESYNC_ENGINE"] == "vllm" and specs[0].variables["SPARSESYNC_MODEL"] == "model"
    with pytest.raises(DeployError, match="local folder"):
        inference_space_specs("me/rep", bucket="/tmp/bucket", model=str(tiny))
    with pytest.raises(DeployError, match="engine"):
        inference_space_specs("me/rep", bucket="s3://b/p", model=str(tiny), engine="tgi")


def test_dry_run_renders_a_space_that_boots_and_follows_a_local_bucket(tiny, tmp_path):
    bucket = tmp_path / "bucket"
    out = tmp_path / "space"
    res = CliRunner().invoke(
        app,
        [
            "deploy",
            "inference",
            "--space",
            "me/replica",
            "--bucket",
            str(bucket),
            "--model",
            str(tiny),
            "--engine",
            "embedded",
            "--dry-run",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert (
        "private" in res.output
        and "dry run: nothing sent" in res.output
        and "request hardware cpu-upgrade" in res.output
    )
    for f in (
        "Dockerfile",
        "README.md",
        "requirements.txt",
        "inference_space/server.py",
        "sparsesync/protocol/follower/follower.py",
        "model/model.safetensors",
    ):
        assert (out / f).is_file(), f
    card = (out / "README.md").read_text()
    assert "sdk: docker" in card and "app_port: 7860" in card and "replica (sparsesync replica)" in card
    assert "transformers==" in (out / "requirements.txt").read_text()

    assert not list(out.rglob("*.so")), "compiled files must not travel: the image compiles the codec itself"
    # as the Dockerfile does
    subprocess.run([sys.executable, "sparsesync/codec/_build.py"], cwd=out, check=True, capture_output=True)
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
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}, timeout=30
        )
        assert r.status_code == 200 and r.json()["weight_version"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _boot_line(output: str) -> str:
    line = next(line for line in output.splitlines() if "Boot one locally" in line)
    return "cd " + line.split(": cd ", 1)[1]


def test_dry_run_boot_line_runs_as_printed(tiny, tmp_path):
    """The plan's "boot one locally" line, pasted into a shell where the user set the secrets it
    names ($SPARSESYNC_API_KEY), starts the replica (only the port is swapped for a free one)."""
    bucket = tmp_path / "bucket"
    res = CliRunner().invoke(
        app,
        [
            "deploy",
            "inference",
            "--space",
            "me/replica",
            "--bucket",
            str(bucket),
            "--model",
            str(tiny),
            "--engine",
            "embedded",
            "--api-key",
            "sk-local-key-123456",
            "--dry-run",
        ],
    )
    assert res.exit_code == 0, res.output
    line = _boot_line(res.output)
    assert (
        "***" not in line and "sk-local-key-123456" not in line and 'SPARSESYNC_API_KEY="$SPARSESYNC_API_KEY"' in line
    )
    assert "set secret HF_TOKEN (value hidden)" in res.output  # as the real plan has it
    rendered = res.output.split("rendered into ", 1)[1].split(" ", 1)[0]
    assert line.startswith(f"cd {rendered} && ") and "temporary folder" in res.output
    port = free_port()
    assert line.count("PORT=7860") == 1
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_TOKEN")}
    env.update(
        SPARSESYNC_API_KEY="sk-local-key-123456", PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    )
    proc = subprocess.Popen(["bash", "-c", line.replace("PORT=7860", f"PORT={port}")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the printed boot line did not start the replica"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sk-local-key-123456"}, timeout=5)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "replica"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "local"])
def test_vllm_boot_line_serves_the_model_the_space_serves(tiny, tmp_path, model):
    """--engine vllm: the line serves the Hub id or the rendered model/ folder, on the Space's port."""
    import shlex

    res = CliRunner().invoke(app, ["deploy", "inference", "--space", "me/replica", "--bucket", "hf://buckets/me/b/run",
                                   "--model", str(tiny) if model == "local" else model, "--dry-run",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    words = shlex.split(_boot_line(res.output).split(" && ")[-1])
    i = words.index("serve")
    assert words[i - 2:i] == ["-m", "sparsesync.integrations.vllm"]
    assert words[i + 1] == ("model" if model == "local" else model)
    assert words[words.index("--port") + 1] == "7860" and "PORT=7860" in words
    assert words[words.index("--weight-transfer-config") + 1] == '{"backend": "sparsesync"}'
    assert "VLLM_PLUGINS=sparsesync" in words and 'HF_TOKEN=$HF_TOKEN' in words and "***" not in res.output
    assert "set secret HF_TOKEN (value hidden)" in res.output
    assert (tmp_path / "out" / "model").is_dir() == (model == "local")
