"""sparsesync's endpoint in vLLM's server: `/sync` takes vLLM's API key, and following a run on
an open address needs a key or an explicit opt-in.

The endpoint's routes are attached to a FastAPI app carrying vLLM's parsed arguments
(`app.state.args`, where vLLM's server keeps them) and served by uvicorn on 127.0.0.1. A wrong
key in every header form a client might try is a 401 (vLLM's guard takes only
`Authorization: Bearer`, so an `X-API-Key`, right or wrong, opens nothing). No vLLM engine
needed; tests/apps/deploy/test_vllm_space.py boots the real server.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace

import httpx
import pytest
from fastapi import FastAPI

from sparsesync.errors import ConfigError
from sparsesync.integrations.vllm.server import SparsesyncEndpoint, api_keys
from tests.apps.inference.test_server import free_port

KEY = "sk-vllm-key-0123456789"


class _Uvicorn:
    def __init__(self, app: FastAPI) -> None:
        import threading

        import uvicorn

        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        import time

        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _app(api_key: list[str] | None) -> FastAPI:
    app = FastAPI()
    app.state.args = Namespace(api_key=api_key, host="127.0.0.1")
    SparsesyncEndpoint().attach_router(app)
    return app


def test_sync_needs_the_key_vllm_needs(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    wrongs = [KEY[:-1] + "x", KEY[:-1], KEY + "0", "sk-wrong-key-123"]
    with _Uvicorn(_app([KEY, "sk-other-key-98765"])) as url, httpx.Client(base_url=url) as c:
        assert c.get("/sync", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # any of vLLM's keys
        assert c.get("/sync", headers={"Authorization": "Bearer sk-other-key-98765"}).status_code == 200
        for wrong in wrongs:
            for headers in ({"Authorization": f"Bearer {wrong}"}, {"X-API-Key": wrong}, {"X-API-Key": KEY},
                            {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {wrong}", "X-API-Key": KEY}):
                r = c.get("/sync", headers=headers)
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (headers, r.text)
        assert c.get("/sync").status_code == 401
    monkeypatch.setenv("VLLM_API_KEY", KEY)  # vLLM's rule: --api-key, else VLLM_API_KEY
    with _Uvicorn(_app(None)) as url, httpx.Client(base_url=url) as c:
        assert (
            c.get("/sync").status_code == 401
            and c.get("/sync", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        )
    monkeypatch.delenv("VLLM_API_KEY")
    with _Uvicorn(_app(None)) as url:  # no key anywhere: open, as vLLM's /v1
        assert httpx.get(f"{url}/sync").status_code == 200


@pytest.mark.parametrize("host", [None, "0.0.0.0", "::", "10.1.2.3"])
def test_following_on_an_open_address_needs_a_key(monkeypatch, host):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPARSESYNC_BUCKET", "hf://buckets/me/b/run")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("SPARSESYNC_ALLOW_NO_KEY", raising=False)
    engine = Namespace(vllm_config=Namespace(weight_transfer_config=None))  # never reached: refused first
    with pytest.raises(ConfigError, match="with no API key") as e:
        asyncio.run(SparsesyncEndpoint().init_state(engine, Namespace(), Namespace(host=host, api_key=None)))
    assert "--api-key" in e.value.hint and "SPARSESYNC_ALLOW_NO_KEY=1" in e.value.hint
    with pytest.raises(ConfigError, match="shorter than 8"):
        asyncio.run(SparsesyncEndpoint().init_state(engine, Namespace(), Namespace(host=host, api_key=["short"])))
    # with a key, or the opt-in, the check passes (and the next one, the backend, speaks)
    for args, env in (
        (Namespace(host=host, api_key=[KEY]), {}),
        (Namespace(host=host, api_key=None), {"SPARSESYNC_ALLOW_NO_KEY": "1"}),
    ):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(ConfigError, match="weight-transfer backend"):
            asyncio.run(SparsesyncEndpoint().init_state(engine, Namespace(), args))
    assert api_keys(Namespace(api_key=None)) == []
