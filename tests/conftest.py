"""Shared fixtures. Store fixtures: every backend, fresh and empty per test, servers per session.

- `store_url` (parametrized: ids `local`, `s3`, `hf`): a fresh empty store URL, with the env
  that backend needs set for the test (credentials, endpoint). Open it with `open_store`.
- `store_backend`: which of the three this test runs on.
- `store_faults`: a `tests.support.store_faults.StoreFaults` for that backend (unavailable, failing
  requests, stale listings); healed after every test.
- `hub_server`: the session's `tests.support.hub_server.HubServer` (behind a `TcpProxy`).
- `s3_server`: the session's `tests.support.s3_server.S3Server` (moto behind a `TcpProxy`).
Servers start lazily: `-k local` starts none.
- `tiny`: the folder of `sparsesync.tiny_model`'s model (seed 0), built once per test module
  (a module may change its files; the next module gets a fresh one). Needs transformers: a
  module using it skips first when transformers is missing (`pytest.importorskip`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hub_server import HubServer
from tests.support.s3_server import CREDENTIALS, S3Server
from tests.support.store_faults import StoreFaults

# before any hf_xet session exists: no telemetry, no progress bars, in every test
os.environ["HF_XET_TELEMETRY_ENABLED"] = "false"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
# hf_xet retries its own HTTP calls (token refresh) from ~1 s up; the same logic, shorter sleeps
os.environ.setdefault("HF_XET_CLIENT_RETRY_BASE_DELAY", "50ms")
# The apps (trainer/, inference_space/, env_space/) are folders of this checkout, not installed (the
# wheel ships sparsesync only): the processes a test starts (`python -m inference_space`, torchrun's
# ranks) find them from any working folder, as from the checkout's root
_CHECKOUT = str(Path(__file__).resolve().parents[1])
if _CHECKOUT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_CHECKOUT, os.environ.get("PYTHONPATH", "")) if p)

HF_TEST_BUCKET = "sparsesync-test/store"  # pre-created on the session's hub_server
HF_TEST_TOKEN = "hf_sparsesyncTestToken000"  # what tests send as HF_TOKEN (the server accepts any)
S3_TEST_BUCKET = "sparsesync-test"


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """The Hub's bucket routes on 127.0.0.1 (real huggingface_hub + hf_xet talk to it)."""
    from huggingface_hub.utils import _http

    # huggingface_hub retries 5xx itself, sleeping 1, 2, 4, 8, 8 s; keep its logic, shrink the sleeps
    saved = dict(_http.http_backoff.__kwdefaults__)
    _http.http_backoff.__kwdefaults__.update(base_wait_time=0.02, max_wait_time=0.1)
    server = HubServer(tmp_path_factory.mktemp("hub")).start(proxy=True)
    server.add_bucket(HF_TEST_BUCKET, private=True)
    yield server
    server.stop()
    _http.http_backoff.__kwdefaults__.update(saved)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 with the test bucket created."""
    server = S3Server().start()
    server.create_bucket(S3_TEST_BUCKET)
    yield server
    server.stop()


@pytest.fixture(params=["local", "s3", "hf"])
def store_backend(request: pytest.FixtureRequest) -> str:
    """The backend of this test: "local", "s3" or "hf"."""
    return request.param


@pytest.fixture
def store_url(store_backend: str, request: pytest.FixtureRequest, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty store URL on `store_backend`, with its env set for this test."""
    run = f"t-{uuid.uuid4().hex[:12]}"
    if store_backend == "local":
        yield str(tmp_path / "store")
        return
    if store_backend == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(k, raising=False)
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("SPARSESYNC_S3_ENDPOINT", server.endpoint)
        yield f"s3://{S3_TEST_BUCKET}/{run}"
        server.proxy.restore()  # type: ignore[union-attr]
        return
    hub: HubServer = request.getfixturevalue("hub_server")
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", HF_TEST_TOKEN)
    yield f"hf://buckets/{HF_TEST_BUCKET}/{run}"
    hub.heal()
    hub.tokens = None


@pytest.fixture
def store_faults(store_backend: str, store_url: str, request: pytest.FixtureRequest) -> Iterator[StoreFaults]:
    """Fault switches for the store behind `store_url` (see tests/support/store_faults.py)."""
    hub = request.getfixturevalue("hub_server") if store_backend == "hf" else None
    s3 = request.getfixturevalue("s3_server") if store_backend == "s3" else None
    faults = StoreFaults(store_backend, hub=hub, s3=s3)
    yield faults
    faults.heal()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sparsesync.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
