"""env_space's access rules over real HTTP on 127.0.0.1: the API key and the cap per client.

Two client addresses (127.0.0.1 and 127.0.0.2, both loopback) stand for two trainers; a loopback
client that sends `X-Forwarded-For` stands for a reverse proxy (or for a client forging it).
`python -m env_space` runs as a real process where what uvicorn itself does with headers matters.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from env_space.client import EnvClient, EnvClientError
from env_space.clients import ClientIdentity
from env_space.config import ServerConfig
from env_space.errors import ConfigError
from tests.apps.env.test_server import _Server
from trainer.processes import ProcessSet, free_port

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


def test_a_wrong_key_is_refused_in_every_header_form():
    """Each form the guard accepts, with the right key and with a wrong one: only the right key
    passes, on HTTP and on the WebSocket (a guard that took any X-API-Key would fail here)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    wrong = "not-the-key-0123456789"
    forms = [lambda k: {"Authorization": f"Bearer {k}"}, lambda k: {"Authorization": f"bearer {k}"},
             lambda k: {"X-API-Key": k}, lambda k: {"Authorization": "Bearer hf_private_space", "X-API-Key": k}]
    s = _Server(ServerConfig(api_key=KEY, default_task="repeat"))
    try:
        ws = s.url.replace("http", "ws") + "/ws"
        for form in forms:
            for key, status in [(wrong, 401), ("x", 401), (KEY[:-1], 401), (KEY + "x", 401), (KEY, 200)]:
                r = httpx.post(f"{s.url}/reset", json={}, headers=form(key))
                assert r.status_code == status, (form(key), r.text)
                assert httpx.get(f"{s.url}/sessions", headers=form(key)).status_code == status, form(key)
            with pytest.raises(InvalidStatus), connect(ws, additional_headers=form(wrong)):
                pass
            with connect(ws, additional_headers=form(KEY)):
                pass
        # both headers present: a wrong one of them does not lend the right one's access, either way round
        assert httpx.post(f"{s.url}/reset", json={}, headers={"Authorization": f"Bearer {KEY}",
                                                               "X-API-Key": wrong}).status_code == 200
        with EnvClient(s.url, api_key=wrong) as c, pytest.raises(EnvClientError) as e:
            c.reset()
        assert e.value.status == 401
        with EnvClient(s.url, api_key=wrong, headers={"Authorization": "Bearer hf_xxx"}) as c, \
                pytest.raises(EnvClientError) as e:
            c.reset()
        assert e.value.status == 401
    finally:
        s.stop()


def test_clients_behind_one_proxy_each_get_their_share():
    """Every client of a Space arrives from its proxy's address: named as trusted, the proxy's
    X-Forwarded-For tells them apart. One client's 40 resets take its own 16 sessions, never the
    others'; its next session replaces its least recently used idle one instead of a 429."""
    s = _Server(ServerConfig(max_sessions=96, max_sessions_per_client=16, default_task="wordle",  # 6 steps
                             trusted_proxies="127.0.0.1", replace_idle_s=3))
    try:
        with httpx.Client(base_url=s.url) as proxy:
            def reset(client: str, forged: str = "") -> httpx.Response:
                xff = f"{forged}, {client}" if forged else client  # the proxy appends the address it saw
                return proxy.post("/reset", json={}, headers={"X-Forwarded-For": xff})

            first = [reset("203.0.113.1") for _ in range(40)]
            assert [r.status_code for r in first] == [200] * 16 + [429] * 24, [r.status_code for r in first]
            assert "none idle for 3 s" in first[-1].json()["detail"]
            # a forged entry in front of what the proxy appended changes nothing
            assert reset("203.0.113.1", forged="198.51.100.7").status_code == 429
            others = [reset(f"203.0.113.{i}") for i in range(2, 5) for _ in range(16)]
            assert all(r.status_code == 200 for r in others), {r.status_code for r in others}
            mine = [r.json()["session_id"] for r in first[:16]]
            assert proxy.post("/step", json={"action": {"text": "crane"}, "session_id": mine[1]}).status_code == 200
            time.sleep(3.1)  # every session of 203.0.113.1 is idle now; mine[0] is its least recently used
            assert reset("203.0.113.1").status_code == 200
            r = proxy.post("/step", json={"action": {"text": "crane"}, "session_id": mine[0]})
            assert r.status_code == 410 and "replaced by a new session of the same client" in r.json()["detail"]
            assert proxy.post("/step", json={"action": {"text": "crane"}, "session_id": mine[2]}).status_code == 200
            # an untrusted peer's header is ignored: 127.0.0.2 is one client however it signs
            with _from("127.0.0.2", s.url) as direct:
                codes = [direct.post("/reset", json={}, headers={"X-Forwarded-For": f"192.0.2.{i}"}).status_code
                         for i in range(17)]
            assert codes == [200] * 16 + [429], codes
    finally:
        s.stop()


def test_client_identity_believes_forwarded_for_only_from_named_proxies():
    none, named, anyp = (ClientIdentity.parse(x) for x in ("", "10.0.0.0/8, 192.168.1.1", "*"))
    assert none.of("10.1.1.1", ["1.2.3.4"]) == "10.1.1.1"
    assert named.of("8.8.8.8", ["1.2.3.4"]) == "8.8.8.8"  # not a named proxy: its header is the client's own
    assert named.of("10.1.1.1", ["6.6.6.6, 1.2.3.4"]) == "1.2.3.4"  # the entry the proxy appended
    assert named.of("10.1.1.1", ["6.6.6.6, 1.2.3.4, 10.2.2.2"]) == "1.2.3.4"  # through two named proxies
    assert named.of("10.1.1.1", ["6.6.6.6", "1.2.3.4"]) == "1.2.3.4"  # the header sent twice
    assert named.of("10.1.1.1", []) == "10.1.1.1"
    assert anyp.of("172.17.0.1", ["6.6.6.6, 1.2.3.4"]) == "1.2.3.4"  # *: the peer's one hop only
    assert anyp.of("172.17.0.1", ["[2001:db8::1]:443"]) == "2001:db8::1"
    with pytest.raises(ConfigError, match="ENV_TRUSTED_PROXIES entry 'proxy.local'"):
        ServerConfig(trusted_proxies="10.0.0.1,proxy.local")


def _env_server(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "env_space", *args], capture_output=True, text=True, timeout=30,
                          env={**_clean_env(), **(env or {})})


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("ENV_") and k != "FORWARDED_ALLOW_IPS"}


def test_forged_forwarded_for_from_loopback_does_not_multiply_a_share(tmp_path: Path):
    """`python -m env_space` as shipped: uvicorn's own proxy-header rewriting (which believes
    X-Forwarded-For from loopback) is off, so forging the header does not make a new client."""
    port = free_port()
    with ProcessSet(tmp_path / "logs", env=_clean_env()) as procs:
        env = procs.start("env", [sys.executable, "-m", "env_space", "--host", "127.0.0.1", "--port", str(port),
                                  "--task", "repeat", "--max-sessions", "8"], url=f"http://127.0.0.1:{port}")
        procs.wait_healthy([env], 60)
        with httpx.Client(base_url=env.url) as c:
            codes = [c.post("/reset", json={}, headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
                     for i in range(6)]
    assert codes == [200] * 4 + [429] * 2, codes  # 4 per client (half of 8), however the header is forged


def test_an_empty_api_key_is_refused_not_read_as_no_key(tmp_path: Path):
    r = _env_server(tmp_path, "--host", "0.0.0.0", "--port", "0", env={"ENV_API_KEY": ""})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "ENV_API_KEY is set but empty" in lines[0] and "openssl rand" in lines[0], r.stderr
    r = _env_server(tmp_path, "--api-key", "")
    assert r.returncode == 2 and "ENV_API_KEY is set but empty" in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="set but empty"):
        ServerConfig.from_env({"ENV_API_KEY": ""})
    assert ServerConfig.from_env({}).api_key is None  # unset: no key, on loopback


def test_an_open_server_beyond_loopback_says_so(tmp_path: Path):
    proc = subprocess.Popen([sys.executable, "-m", "env_space", "--host", "0.0.0.0", "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_clean_env())
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("warning: no API key: anyone who can reach 0.0.0.0:0 may use this server"), line
    finally:
        proc.terminate()
        proc.wait(timeout=20)
