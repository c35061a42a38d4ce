"""env_space over real HTTP: uvicorn on 127.0.0.1 (random port), httpx and OpenEnv's own client.

Covers the session contract the trainer relies on, isolation under 64 concurrent sessions, the
limits (cap, idle timeout, body size) and every bad-input case: each gets a clear 4xx, and the
server keeps answering afterwards.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from env_space import repeat, wordle
from env_space.client import EnvClient, EnvClientError
from env_space.config import ServerConfig
from env_space.server import build_app


class _Server:
    """build_app(config) under a real uvicorn server on 127.0.0.1:<free port>, in a thread."""

    def __init__(self, config: ServerConfig) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(config), log_level="warning",  # as __main__ runs it
                                                    ws_max_size=config.max_body_bytes, proxy_headers=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("env server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server(ServerConfig(max_sessions=512, idle_timeout_s=300, max_body_bytes=4096))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_server() -> Iterator[_Server]:
    """Tight limits: 3 sessions, 0.5 s idle timeout."""
    s = _Server(ServerConfig(max_sessions=3, idle_timeout_s=0.5, default_task="repeat", max_sessions_per_client=3))
    yield s
    s.stop()


@pytest.fixture
def client(server: _Server) -> Iterator[EnvClient]:
    with EnvClient(server.url) as c:
        yield c


def _err(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"] == code and body["detail"], body
    return body["detail"]


# -- the contract ---------------------------------------------------------------------------------
def test_repeat_episode_over_plain_http(client):
    sid, obs = client.reset(task="repeat", seed=1)
    target = repeat.target_for_seed(1)
    assert obs["prompt"] == f"Repeat the letter {target}:" and obs["session_id"] == sid and obs["task"] == "repeat"
    obs2, reward, done = client.step(sid, target * 3 + "z")
    assert reward == 0.75 and done and obs2["turn"] == 1
    assert client.state(sid)["done"] is True


def test_raw_wire_format(server):
    r = httpx.post(f"{server.url}/reset", json={"seed": 5, "task": "repeat"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) >= {"observation", "reward", "done", "session_id"}
    assert body["reward"] is None and body["done"] is False and "prompt" in body["observation"]
    # the session id may also travel in the X-Session-Id header
    r = httpx.post(f"{server.url}/step", json={"action": {"text": "eeee"}},
                   headers={"X-Session-Id": body["session_id"]})
    assert r.status_code == 200 and r.json()["done"] is True and isinstance(r.json()["reward"], float)


def test_wordle_episode_win_and_rewards(client):
    sid, obs = client.reset(task="wordle", seed=11)
    answer = wordle.WordleGame.from_seed(11).answer
    assert obs["max_turns"] == 6 and "guess" in obs["prompt"].lower() and answer not in obs["prompt"]
    wrong = "crane" if answer != "crane" else "slate"
    obs, reward, done = client.step(sid, wrong)
    fb = wordle.feedback(wrong, answer)
    assert obs["feedback"] == [f"{wrong}: {fb}"] and reward == pytest.approx(wordle.turn_reward(fb, False))
    assert not done and answer not in client.state(sid).values()
    obs, reward, done = client.step(sid, answer)
    assert done and reward == pytest.approx(1.0 + wordle.WIN_BONUS) and obs["message"] == "solved"


def test_default_task_comes_from_config(client):
    _, obs = client.reset()
    assert obs["task"] == "wordle"


def test_seeds_reproduce_episodes(client):
    _, a = client.reset(task="wordle", seed=123)
    _, b = client.reset(task="wordle", seed=123)
    assert a["prompt"] == b["prompt"] and a["seed"] == b["seed"] == 123
    sa, _ = client.reset(task="wordle", seed=123)
    sb, _ = client.reset(task="wordle", seed=123)
    assert client.step(sa, "crane")[0]["feedback"] == client.step(sb, "crane")[0]["feedback"]
    # without a seed the server draws one and reports it: replaying it gives the same episode
    _, c = client.reset(task="repeat")
    _, d = client.reset(task="repeat", seed=c["seed"])
    assert c["prompt"] == d["prompt"]


def test_reset_reuses_a_session(client):
    sid, _ = client.reset(task="repeat", seed=0)
    client.step(sid, "a")
    sid2, obs = client.reset(task="repeat", seed=2, session_id=sid)
    assert sid2 == sid and obs["turn"] == 0
    assert client.step(sid, "x")[2] is True


def test_openenv_routes_and_websocket_client(server):
    """OpenEnv's own client (what TRL's harness uses) plays over /ws unchanged."""
    from openenv.core.generic_client import GenericEnvClient

    assert httpx.get(f"{server.url}/health").json()["status"] == "healthy"
    schema = httpx.get(f"{server.url}/schema").json()
    assert "text" in schema["action"]["properties"] and "prompt" in schema["observation"]["properties"]
    with GenericEnvClient(base_url=server.url).sync() as env:
        r = env.reset(seed=4, task="repeat")
        target = repeat.target_for_seed(4)
        assert r.observation["prompt"] == f"Repeat the letter {target}:" and not r.done
        r = env.step({"text": target * 2})
        assert r.reward == 1.0 and r.done


# -- isolation under concurrency -----------------------------------------------------------------
def test_64_concurrent_sessions_stay_isolated(server):
    n = 64
    barrier = threading.Barrier(n)
    guesses = ["crane", "slate", "pious", "mound", "lucky", "wheat"]

    def play(i: int) -> None:
        with EnvClient(server.url) as c:
            barrier.wait()
            rsid, robs = c.reset(task="repeat", seed=i)
            wsid, wobs = c.reset(task="wordle", seed=1000 + i)
            target = repeat.target_for_seed(i)
            answer = wordle.WordleGame.from_seed(1000 + i).answer
            assert robs["prompt"] == f"Repeat the letter {target}:" and robs["session_id"] == rsid
            for turn, g in enumerate(guesses, start=1):
                obs, reward, done = c.step(wsid, g)
                fb = wordle.feedback(g, answer)
                assert obs["session_id"] == wsid and obs["turn"] == turn and obs["seed"] == 1000 + i
                assert obs["feedback"][-1] == f"{g}: {fb}"
                assert reward == pytest.approx(wordle.turn_reward(fb, g == answer))
                if done:
                    break
            text = (target * (i % 5)) + "z" * (i % 3)
            _, reward, done = c.step(rsid, text)
            assert done and reward == repeat.reward(text, target)

    with ThreadPoolExecutor(n) as pool:
        for f in [pool.submit(play, i) for i in range(n)]:
            f.result(timeout=60)


def test_concurrent_steps_on_one_session_are_serialized(client, server):
    sid, _ = client.reset(task="wordle", seed=3)
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: httpx.post(f"{server.url}/step", json={
            "action": {"text": "crane"}, "session_id": sid}).status_code, range(16)))
    # exactly six turns fit in an episode (one if "crane" wins); every other step is refused with 409
    turns = 1 if wordle.WordleGame.from_seed(3).answer == "crane" else 6
    assert codes.count(200) == turns and codes.count(409) == 16 - turns
    assert client.state(sid)["step_count"] == turns


# -- bad input: a clear 4xx, never a crash ---------------------------------------------------------
def test_bad_requests_get_clear_4xx(server, client):
    u = server.url
    sid, _ = client.reset(task="wordle", seed=1)
    _err(httpx.post(f"{u}/step", json={"action": {"text": "crane"}, "session_id": "nope"}), 404, "unknown_session")
    _err(httpx.post(f"{u}/step", json={"action": {"text": "crane"}}), 400, "missing_session_id")
    assert "text" in _err(httpx.post(f"{u}/step", json={"action": {"txt": "a"}, "session_id": sid}),
                          422, "malformed_action")
    _err(httpx.post(f"{u}/step", json={"action": {"text": 5}, "session_id": sid}), 422, "malformed_action")
    _err(httpx.post(f"{u}/step", json={"action": "crane", "session_id": sid}), 422, "malformed_request")
    _err(httpx.post(f"{u}/step", json={"session_id": sid}), 422, "malformed_request")
    _err(httpx.post(f"{u}/step", content=b"{not json", headers={"content-type": "application/json"}),
         422, "malformed_request")
    _err(httpx.post(f"{u}/step", json={"action": {"text": "a"}, "session_id": sid},
                    headers={"X-Session-Id": "other"}), 400, "missing_session_id")
    _err(httpx.post(f"{u}/reset", json={"task": "chess"}), 400, "unknown_task")
    _err(httpx.post(f"{u}/reset", json={"seed": -1}), 422, "malformed_request")
    _err(httpx.post(f"{u}/reset", json={"session_id": "nope"}), 404, "unknown_session")
    _err(httpx.get(f"{u}/state"), 400, "missing_session_id")
    _err(httpx.get(f"{u}/state", params={"session_id": "nope"}), 404, "unknown_session")
    _err(httpx.delete(f"{u}/sessions/nope"), 404, "unknown_session")
    # none of that touched the session
    assert client.state(sid)["step_count"] == 0 and client.step(sid, "crane")[0]["turn"] == 1


def test_action_after_episode_end_is_409(client):
    sid, _ = client.reset(task="repeat", seed=0)
    client.step(sid, "a")
    with pytest.raises(EnvClientError) as e:
        client.step(sid, "a")
    assert e.value.status == 409 and e.value.code == "episode_finished" and "reset" in e.value.hint


def test_oversized_payloads_are_413(server, client):
    sid, _ = client.reset(task="repeat", seed=0)
    big = {"action": {"text": "a" * 10_000}, "session_id": sid}
    assert "4096" in _err(httpx.post(f"{server.url}/step", json=big), 413, "payload_too_large")

    def chunks():  # no Content-Length: a chunked upload is cut off at the limit too
        for _ in range(100):
            yield b"x" * 1000

    _err(httpx.post(f"{server.url}/step", content=chunks()), 413, "payload_too_large")
    assert client.step(sid, "a")[2] is True  # the session is intact


def test_malformed_body_does_not_break_the_server(server):
    for payload in [b"", b"null", b"[]", b"\xff\xfe", b'{"action": {"text": "' + b"\\ud800" + b'"}}']:
        r = httpx.post(f"{server.url}/step", content=payload, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (payload, r.status_code, r.text)
    assert httpx.get(f"{server.url}/health").status_code == 200


# -- limits ----------------------------------------------------------------------------------------
def test_session_cap_and_release(small_server):
    with EnvClient(small_server.url, retries=0) as c:
        sids = [c.reset(seed=i)[0] for i in range(3)]
        r = httpx.post(f"{small_server.url}/reset", json={})
        _err(r, 503, "capacity_reached")
        assert r.headers["Retry-After"] == "1"
        c.step(sids[0], "a")  # a finished episode frees its slot at once
        sids.append(c.reset(seed=9)[0])
        with pytest.raises(EnvClientError):
            c.reset()
        c.close_session(sids[1])  # so does closing a session
        sids.append(c.reset()[0])
        for s in (sids[2], sids[3], sids[4]):
            c.close_session(s)
        assert httpx.get(f"{small_server.url}/sessions").json()["live_sessions"] == 0


def test_idle_sessions_expire_with_410(small_server):
    with EnvClient(small_server.url, retries=0) as c:
        sid, _ = c.reset(seed=1)
        time.sleep(0.7)
        with pytest.raises(EnvClientError) as e:
            c.step(sid, "a")
        assert e.value.status == 410 and e.value.code == "session_expired"
        # expired sessions no longer count: the cap is free again
        new = [c.reset(seed=i)[0] for i in range(3)]
        for s in new:
            c.close_session(s)


# -- the boundary: text that is not Unicode, fuzzing from the OpenAPI schema --------------------------
def test_lone_surrogate_is_refused_and_never_poisons_the_session(server, client):
    """A JSON string may escape a lone UTF-16 surrogate ("\\ud800"): valid JSON, not Unicode text. It
    is a 400 at the boundary, and the session (over HTTP and over the WebSocket) plays on."""
    from websockets.sync.client import connect

    sid, _ = client.reset(task="repeat", seed=2)
    for body in ('{"action": {"text": "\\ud800abcd"}, "session_id": "%s"}' % sid,
                 '{"action": {"text": "ok"}, "session_id": "\\udfff%s"}' % sid,
                 '{"seed": 1, "episode_id": "\\ud800"}', "[" * 2000 + "]" * 2000):
        r = httpx.post(f"{server.url}/{'step' if 'action' in body else 'reset'}", content=body,
                       headers={"content-type": "application/json"})
        assert r.status_code in (400, 413) and r.json()["error"] in ("invalid_text", "payload_too_large"), r.text
    target = repeat.target_for_seed(2)
    assert client.step(sid, target * 2)[1] == 1.0  # the session was never touched
    with connect(server.url.replace("http", "ws") + "/ws") as ws:
        ws.send(json.dumps({"type": "reset", "data": {"seed": 3, "task": "repeat"}}))
        assert json.loads(ws.recv())["type"] == "observation"
        ws.send('{"type": "step", "data": {"text": "\\ud800abcd"}}')
        err = json.loads(ws.recv())
        assert err["type"] == "error" and err["data"]["code"] == "invalid_text", err
        ws.send(json.dumps({"type": "step", "data": {"text": repeat.target_for_seed(3) * 2}}))
        assert json.loads(ws.recv())["data"]["reward"] == 1.0


def test_framework_refusals_have_the_common_error_shape(server):
    for r in (httpx.get(f"{server.url}/no-such-route"), httpx.put(f"{server.url}/reset")):
        assert r.status_code in (404, 405) and {"detail", "error", "hint"} <= set(r.json()), r.text


def _error_shape_ok(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and {"detail", "error", "hint"} <= set(body) and isinstance(body["error"], str)


def test_http_api_fuzzed_from_its_openapi_schema(server):
    """schemathesis generates requests for every operation of the served OpenAPI schema, valid
    (positive) and invalid (negative) ones; hypothesis adds JSON bodies whose strings may hold
    lone surrogates. No answer is a 5xx except 503 when full; every error has the common shape."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    problems: list[str] = []

    def check(label: str, r: httpx.Response | object, sent: object) -> None:
        status = r.status_code  # type: ignore[attr-defined]
        if (status >= 500 and not (status == 503 and r.json().get("error") == "capacity_reached")) or (
                status >= 400 and not _error_shape_ok(r)):  # type: ignore[arg-type]
            problems.append(f"{label} -> {status} {r.text[:200]} for {str(sent)[:200]}")  # type: ignore[attr-defined]

    fuzz = settings(max_examples=12, deadline=None, database=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))
    n_ops = 0
    for result in schema.get_all_operations():
        op = result.ok()
        n_ops += 1
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @fuzz
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:  # type: ignore[no-untyped-def]
                check(
                    op.label, case.call(base_url=server.url, timeout=10), (case.path_parameters, case.query, case.body)
                )

            try:
                run()
            except Unsatisfiable:  # an operation without parameters has no invalid request
                pass
    assert n_ops >= 10  # /reset, /step, /state, /sessions, OpenEnv's routes

    text = st.text(
        st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=20
    )
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text,
                               lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
                               max_leaves=12)
    sid, _ = httpx.post(f"{server.url}/reset", json={"task": "repeat", "seed": 5}).json()["session_id"], None

    @fuzz
    @given(path=st.sampled_from(["/reset", "/step"]), action=json_values, extra=json_values, use_sid=st.booleans())
    def raw(path: str, action: object, extra: object, use_sid: bool) -> None:
        body = {"action": action, "extra": extra} if path == "/step" else {"episode_id": action, "seed": extra}
        if use_sid:
            body["session_id"] = sid
        payload = json.dumps(body, ensure_ascii=True, allow_nan=True)  # lone surrogates travel as \ud800 escapes
        check(
            path,
            httpx.post(f"{server.url}{path}", content=payload, headers={"content-type": "application/json"}),
            payload,
        )

    raw()
    assert not problems, "\n".join(problems[:10])
    assert httpx.post(f"{server.url}/step", json={"action": {"text": "x"}, "session_id": sid}).status_code in (200, 409)
