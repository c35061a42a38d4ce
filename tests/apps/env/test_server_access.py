"""env_space's access rules over real HTTP on 127.0.0.1: the API key and the cap per client.

Two client addresses (127.0.0.1 and 127.0.0.2, both loopback) stand for two trainers.
"""

from __future__ import annotations

import httpx
import pytest

from env_space.client import EnvClient, EnvClientError
from env_space.config import ServerConfig
from env_space.errors import ConfigError
from tests.apps.env.test_server import _Server

KEY = "env-key-0123456789"


def _from(address: str, url: str, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers=headers, transport=httpx.HTTPTransport(local_address=address))


def test_api_key_guards_every_route_but_health():
    s = _Server(ServerConfig(api_key=KEY, default_task="repeat"))
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        for method, path in [("POST", "/reset"), ("GET", "/sessions"), ("GET", "/schema"), ("GET", "/openapi.json"),
                             ("DELETE", "/sessions/x")]:
            r = httpx.request(method, f"{s.url}{path}", json={} if method == "POST" else None)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized", (path, r.text)
        r = httpx.post(f"{s.url}/reset", json={}, headers={"Authorization": "Bearer env-key-0123456780"})
        assert r.status_code == 401
        with EnvClient(s.url, api_key=KEY) as c:  # Bearer
            sid, _ = c.reset(seed=1)
            c.step(sid, "a")
        # beside a private Space's own Authorization header, the key travels as X-API-Key
        with EnvClient(s.url, api_key=KEY, headers={"Authorization": "Bearer hf_xxx"}) as c:
            c.reset(seed=2)
        with EnvClient(s.url) as c, pytest.raises(EnvClientError) as e:
            c.reset()
        assert e.value.status == 401
        # the WebSocket is refused before the handshake completes
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        with pytest.raises(InvalidStatus):
            connect(s.url.replace("http", "ws") + "/ws").close()
        connect(s.url.replace("http", "ws") + "/ws", additional_headers={"Authorization": f"Bearer {KEY}"}).close()
    finally:
        s.stop()
    assert "env-key" not in repr(ServerConfig(api_key=KEY)) and "ENV_API_KEY" not in ServerConfig(api_key=KEY).as_env()
    with pytest.raises(ConfigError, match="ENV_API_KEY"):
        ServerConfig.from_env({"ENV_API_KEY": "short"})


def test_one_client_cannot_take_every_session():
    s = _Server(ServerConfig(max_sessions=4, default_task="repeat"))  # 2 per client by default
    try:
        with _from("127.0.0.1", s.url) as a, _from("127.0.0.2", s.url) as b:
            mine = [a.post("/reset", json={}).json()["session_id"] for _ in range(2)]
            r = a.post("/reset", json={})
            assert r.status_code == 429 and r.json()["error"] == "client_capacity_reached", r.text
            theirs = [b.post("/reset", json={}) for _ in range(2)]
            assert all(x.status_code == 200 for x in theirs)  # the other client still gets its share
            assert len({*mine, *(x.json()["session_id"] for x in theirs)}) == 4
            assert all(len(sid) == 32 for sid in mine)  # 128 random bits
            assert a.delete(f"/sessions/{mine[0]}").status_code == 200  # closing frees the client's slot
            assert a.post("/reset", json={}).status_code == 200
            assert b.get("/sessions").json()["max_sessions_per_client"] == 2
    finally:
        s.stop()
