"""ReplicaPool against real HTTP servers on 127.0.0.1: spreading, failover, a replica that
disappears and comes back, 5xx and malformed replies, and 4xx surfacing without failover.

The servers are tiny FastAPI apps speaking the replica's `/v1/completions` and `/sync` shapes
(run by uvicorn in threads); the code under test (`trainer.replicas`) is unmodified.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from trainer.errors import ReplicaUnavailableError, RolloutError  # noqa: E402
from trainer.replicas import ReplicaPool  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TinyReplica:
    """A FastAPI server answering like an inference replica; `mode` switches its behaviour."""

    def __init__(self, name: str, version: int | None = 3, port: int | None = None) -> None:
        self.name = name
        self.version = version
        self.mode = "ok"  # ok | error500 | garbage | bad_request
        self.hits = 0
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = fastapi.FastAPI()

        @app.post("/v1/completions")
        def complete(body: dict[str, Any]) -> Any:
            self.hits += 1
            if self.mode == "error500":
                raise fastapi.HTTPException(500, "engine crashed")
            if self.mode == "bad_request":
                raise fastapi.HTTPException(400, "max_tokens too large")
            if self.mode == "garbage":
                return {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]}
            n = int(body.get("n", 1))
            return {"weight_version": self.version, "choices": [
                {"index": i, "text": self.name, "finish_reason": "length", "prompt_token_ids": [7, 8],
                 "token_ids": [1, 2], "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25]},
                 "weight_version": self.version} for i in range(n)]}

        @app.get("/sync")
        def sync() -> dict[str, Any]:
            return {"current_version": self.version, "newest_version": self.version, "lag": 0, "last_apply_s": 0.001}

        @app.get("/health")
        def health() -> dict[str, str]:
            return {"status": "ok"}

        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self._thread: threading.Thread | None = None

    def start(self) -> TinyReplica:
        self._server.should_exit = False
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("tiny replica did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server.started = False


@pytest.fixture
def replicas() -> Iterator[list[TinyReplica]]:
    reps = [TinyReplica("r0").start(), TinyReplica("r1", version=None).start()]
    yield reps
    for r in reps:
        r.stop()


def test_requests_are_spread_and_parsed(replicas: list[TinyReplica]) -> None:
    with ReplicaPool([r.url for r in replicas], cooldown_s=5) as pool:
        outs = [pool.complete("Repeat the letter a:", n=3, max_tokens=2) for _ in range(6)]
    assert {o.replica for o in outs} == {r.url for r in replicas}
    assert replicas[0].hits == replicas[1].hits == 3
    c = outs[0].choices[0]
    assert (
        len(outs[0].choices) == 3 and c.token_ids == (1, 2) and c.logprobs == (-0.5, -0.25) and c.prompt_ids == (7, 8)
    )
    assert {o.choices[0].weight_version for o in outs} == {3, None}  # None: start-up weights


def test_failover_when_a_replica_disappears_and_returns(replicas: list[TinyReplica]) -> None:
    r0, r1 = replicas
    with ReplicaPool([r0.url, r1.url], cooldown_s=0.5, timeout_s=5) as pool:
        r0.stop()
        outs = [pool.complete("p", n=1) for _ in range(6)]  # every request still answered
        assert {o.replica for o in outs} == {r1.url}
        assert pool.stats[r0.url].failures == 1  # tried once, then skipped while cooling down
        assert pool.sync_status()[r0.url] is None and pool.healthy() == {r0.url: False, r1.url: True}
        # it comes back on the same port: after the cooldown it gets traffic again
        back = TinyReplica("r0b", port=r0.port).start()
        try:
            time.sleep(0.6)
            outs = [pool.complete("p", n=1) for _ in range(4)]
            assert r0.url in {o.replica for o in outs}
        finally:
            back.stop()


def test_failover_on_5xx_and_malformed_replies(replicas: list[TinyReplica]) -> None:
    r0, r1 = replicas
    with ReplicaPool([r0.url, r1.url], cooldown_s=30) as pool:
        r0.mode = "error500"
        assert all(pool.complete("p").replica == r1.url for _ in range(3))
        r1.mode = "garbage"  # one log-prob for two tokens: rejected, r0 (cooling down) tried last
        with pytest.raises(ReplicaUnavailableError) as e:
            pool.complete("p")
        assert set(e.value.urls) == {r0.url, r1.url}
        r0.mode = "ok"
        assert pool.complete("p").replica == r0.url  # every replica down: the cooled-down ones are retried


def test_bad_request_raises_without_failover(replicas: list[TinyReplica]) -> None:
    r0, r1 = replicas
    r0.mode = r1.mode = "bad_request"
    with ReplicaPool([r0.url, r1.url]) as pool, pytest.raises(RolloutError, match="HTTP 400"):
        pool.complete("p")
    assert r0.hits + r1.hits == 1


def test_all_replicas_gone_raises_naming_them() -> None:
    urls = [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]
    with ReplicaPool(urls, timeout_s=2) as pool, pytest.raises(ReplicaUnavailableError, match="no inference replica"):
        pool.complete("p")


def test_a_completion_of_the_start_up_weights_is_attributed_to_no_version(replicas: list[TinyReplica]) -> None:
    """Before: play_group labelled the completions of a replica serving its start-up weights
    (`weight_version: null`) with the version the trainer resumed at, and they were trained on
    as that version. Now they carry None and the buffer drops them, counted."""
    from env_space.client import EnvClient
    from env_space.config import ServerConfig
    from env_space.server import build_app
    from trainer.buffer import RolloutBuffer
    from trainer.rollout import SamplingParams, play_group

    port = _free_port()
    env = uvicorn.Server(uvicorn.Config(build_app(ServerConfig(default_task="repeat")), host="127.0.0.1", port=port,
                                        log_level="error"))
    thread = threading.Thread(target=env.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not env.started:
            assert time.monotonic() < deadline, "the env server did not start"
            time.sleep(0.02)
        with EnvClient(f"http://127.0.0.1:{port}") as client, ReplicaPool([r.url for r in replicas]) as pool:
            params = SamplingParams(group_size=2, max_tokens=2)
            groups = [play_group(client, pool, group_id=i, seed=i, task="repeat", params=params) for i in range(2)]
    finally:
        env.should_exit = True
        thread.join(timeout=10)
    by_replica = {g.samples[0].replica: g for g in groups}
    assert [s.version for s in by_replica[replicas[1].url].samples] == [None, None]  # r1 serves its start-up weights
    assert [s.version for s in by_replica[replicas[0].url].samples] == [3, 3]
    buf = RolloutBuffer(4, max_staleness=4)
    buf.put(by_replica[replicas[1].url])
    buf.put(by_replica[replicas[0].url])
    (out,) = buf.take(1, current_version=5, timeout=1)
    assert out.samples[0].replica == replicas[0].url and buf.stats.dropped_unversioned == 2 and len(buf) == 0
