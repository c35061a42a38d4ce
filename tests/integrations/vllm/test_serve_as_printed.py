"""The README's vLLM server command, as printed, on this CPU machine: it starts, follows, stops cleanly.

The README's command, read from README.md (`VLLM_PLUGINS=sparsesync SPARSESYNC_BUCKET=RUN vllm
serve ./base-model --host 127.0.0.1 --weight-transfer-config ...`, run through `python -m
sparsesync.integrations.vllm`), with no KV-cache flag (vLLM's own default reserves 90% of the
machine's memory and refuses to start on a busy machine): our
entry point sizes the KV cache, says so in one line, and the server follows a run that a
publisher keeps writing to; SIGINT while versions keep arriving stops it with exit 0 and no
traceback (no `EngineDeadError` from an apply started on an engine being shut down). Only
`--port` is added (a free one). The fast tests need no vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from sparsesync.integrations.vllm import plugin
from sparsesync.integrations.vllm.__main__ import CPU_KV_CACHE_BYTES, cpu_serve_args
from tests.integrations.vllm.test_serve import ROOT, _free_port, _wait_up

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _readme_serve_args() -> list[str]:
    """vLLM's arguments in the README's command (`... vllm serve ./base-model ...`), as printed."""
    text = (ROOT / "README.md").read_text()
    line = next(line for line in text.replace("\\\n", " ").splitlines()
                if line.startswith("VLLM_PLUGINS=sparsesync SPARSESYNC_BUCKET=") and " vllm serve " in line)
    words = shlex.split(line)
    return words[words.index("vllm") + 1:]


README_ARGS = _readme_serve_args()


def test_cpu_serve_gets_a_kv_cache_size_only_when_none_was_given(capsys):
    assert README_ARGS[:2] == ["serve", "./base-model"] and "--weight-transfer-config" in README_ARGS
    cpu = cpu_serve_args(README_ARGS, is_cpu=lambda: True, environ={})
    assert cpu == [*README_ARGS, "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES), "--max-model-len", "auto"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-cache-memory-bytes" in err
    for given in (["--kv-cache-memory-bytes", "64M"], ["--gpu-memory-utilization=0.3"], ["--kv-cache-memory", "1G"]):
        assert cpu_serve_args([*README_ARGS, *given], is_cpu=lambda: True, environ={}) == [*README_ARGS, *given]
    assert cpu_serve_args([*README_ARGS, "--max-model-len", "256"], is_cpu=lambda: True, environ={})[-2:] == [
        "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    capsys.readouterr()
    assert cpu_serve_args(README_ARGS, is_cpu=lambda: True, environ={"VLLM_CPU_KVCACHE_SPACE": "2"}) == README_ARGS
    assert cpu_serve_args(README_ARGS, is_cpu=lambda: False, environ={}) == README_ARGS  # a GPU: vLLM's own default
    assert cpu_serve_args(["--version"], is_cpu=lambda: True, environ={}) == ["--version"]
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here; see scripts/setup.sh")
def test_readme_vllm_serve_command_starts_follows_and_stops_cleanly(tmp_path, monkeypatch):
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.tiny_model import build_tiny_model
    from tests.support.model_steps import Trainer

    monkeypatch.chdir(tmp_path)
    tiny = build_tiny_model(tmp_path / "base-model", seed=0)
    trainer = Trainer(tiny, seed=1)
    bucket = str(tmp_path / "bucket")
    plugins = tmp_path / "plugins"  # sparsesync's entry points, whether or not this install declares them yet
    for rel, text in plugin.dist_info_files().items():
        (plugins / rel).parent.mkdir(parents=True, exist_ok=True)
        (plugins / rel).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARSESYNC_", "VLLM_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(plugins)]),
        VLLM_PLUGINS="sparsesync",
        SPARSESYNC_BUCKET=bucket,
        SPARSESYNC_POLL_INTERVAL="0.1",
        OMP_NUM_THREADS="1",
    )
    port = _free_port()
    log = tmp_path / "server.log"
    pub = Publisher(bucket, anchor_every=0)
    pub.publish(trainer.step(), 0)
    pub.flush()
    proc = subprocess.Popen([sys.executable, "-m", "sparsesync.integrations.vllm", *README_ARGS, "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    published = []

    def keep_publishing() -> None:  # a trainer that goes on while the server is stopped
        while not stop.is_set():
            published.append(pub.publish(trainer.step(density=0.05, scale=0.1)))
            time.sleep(0.2)

    writer = threading.Thread(target=keep_publishing, daemon=True)
    try:
        _wait_up(proc, url, log)
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/sync").json().get("serving_version") is None:
            assert time.monotonic() < deadline, f"the server never served version 0: {httpx.get(f'{url}/sync').json()}"
            time.sleep(0.2)
        writer.start()
        while (httpx.get(f"{url}/sync").json().get("serving_version") or 0) < 3:
            assert time.monotonic() < deadline, f"the server did not follow: {httpx.get(f'{url}/sync').json()}"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C, while versions keep coming
        rc = proc.wait(timeout=60)
    finally:
        stop.set()
        if writer.is_alive():
            writer.join(timeout=30)
        pub.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert len(published) >= 2
    assert rc == 0, text[-3000:]
    notice = [line for line in text.splitlines() if line.startswith("sparsesync: a CPU machine")]
    assert len(notice) == 1 and "--kv-cache-memory-bytes" in notice[0], text[:2000]
    for bad in ("Traceback", "EngineDeadError", "Failed to load plugin"):
        assert bad not in text, f"{bad} in the server's log:\n" + text[text.find(bad) - 2000:text.find(bad) + 1500]
