"""An `hf://` store whose Hub cannot be reached at all fails at once, in one line, with no retries.

A host name that does not resolve (`.invalid` never does) and a port nothing listens on stand
for a machine with no network and a wrong HF_ENDPOINT; the real huggingface_hub client makes
the requests. A Hub that answered once and then refuses (a restart) is still retried: that
failure may pass.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsesync.errors import StoreUnavailableError
from sparsesync.store import open_store
from tests.conftest import HF_TEST_BUCKET, HF_TEST_TOKEN
from tests.support.hub_server import HubServer
from trainer.processes import free_port


@pytest.mark.parametrize("endpoint, why", [("http://hub.invalid", "does not resolve"),
                                           ("http://127.0.0.1:{port}", "refused")])
def test_an_unreachable_hub_fails_at_once_in_one_line(endpoint: str, why: str, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    endpoint = endpoint.format(port=free_port())
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    caplog.set_level(logging.INFO)
    store = open_store("hf://buckets/me/rl/run1")
    for call in (lambda: store.list("commits/"), lambda: store.get("commits/x.json"), lambda: store.put("x", b"1")):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError) as err:
            call()
        assert time.monotonic() - t0 < 5, "no retries on a Hub that cannot be reached at all"
        text = str(err.value)
        assert "\n" not in text and why in text and endpoint.split("//")[1] in text, text
        assert "HF_ENDPOINT" in err.value.hint and "network" in err.value.hint
    retries = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert retries == [], retries


def test_a_hub_that_answered_once_is_retried_when_it_refuses(hub_server: HubServer,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub_server.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TEST_TOKEN)
    store = open_store(f"hf://buckets/{HF_TEST_BUCKET}/first-contact")
    store.put("k", b"v")
    assert hub_server.proxy is not None
    hub_server.proxy.refuse(0.6)  # connections refused for a while: a restart, not a wrong address
    try:
        assert store.get("k") == b"v"
    finally:
        hub_server.proxy.restore()


def test_the_cli_offline_says_so_in_seconds(tmp_path: Path) -> None:
    """`sparsesync pull hf://...` with the Hub refusing: exit 1, the error and its fix, no retry lines."""
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from sparsesync.cli import main; sys.exit(main())",
            "pull",
            "hf://buckets/me/rl/run1",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 2, r.stderr
    assert lines[0].startswith("error: ") and "cannot reach 127.0.0.1:" in lines[0] and "refused" in lines[0]
    assert lines[1].startswith("fix: ") and "HF_ENDPOINT" in lines[1]
    assert time.monotonic() - t0 < 60  # a Python start and imports; no retries
