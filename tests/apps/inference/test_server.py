"""The replica server over real HTTP on 127.0.0.1: the OpenAI-compatible contract, /sync, faults.

A uvicorn server with the embedded engine follows a local bucket that a Publisher writes to;
the test talks to it only over HTTP (httpx), as the trainer does.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers (pip install -e '.[embedded]')")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402
from tests.support.model_steps import PROMPTS, Trainer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """uvicorn in a thread, serving `create_app(replica)`."""

    def __init__(self, replica: Replica, **app_options: object) -> None:
        import uvicorn

        from inference_space.server import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(replica, **app_options), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_sync(client: httpx.Client, pred, timeout: float = 30.0) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        st = client.get("/sync").json()
        if pred(st):
            return st
        assert time.monotonic() < deadline, f"timed out; /sync says {st}"
        time.sleep(0.05)


def _newest_delta(bucket: Path) -> Path:
    files = [p for p in bucket.rglob("*") if p.is_file() and "delta" in p.as_posix()]
    return max(files, key=lambda p: p.stat().st_mtime_ns)


def test_server_contract_follow_and_degrade(tiny, tmp_path):
    bucket = tmp_path / "bucket"
    trainer = Trainer(tiny, seed=4)
    replica = Replica(EmbeddedEngine(tiny), str(bucket), poll_interval=0.05, served_model_name="tiny")
    with (
        Server(replica) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
        Publisher(str(bucket), anchor_every=0) as pub,
    ):
        # before the first version: serve --model, weight_version null
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 1}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == "tiny" and out["weight_version"] is None
        ch = out["choices"][0]
        assert set(ch) >= {
            "index",
            "text",
            "finish_reason",
            "prompt_token_ids",
            "token_ids",
            "logprobs",
            "weight_version",
        }
        assert len(ch["token_ids"]) == len(ch["logprobs"]["token_logprobs"]) == 6 and ch["finish_reason"] == "length"
        lp = ch["logprobs"]  # OpenAI's shape: token strings, offsets, the top-1 beside the sampled token
        assert lp["tokens"] == [replica.engine.tokenizer.decode([t]) for t in ch["token_ids"]]
        assert lp["text_offset"][0] == 0 and len(lp["text_offset"]) == len(lp["top_logprobs"]) == 6
        assert all(lp["tokens"][i] in lp["top_logprobs"][i] for i in range(6))  # greedy: sampled == top-1
        assert out["usage"] == {
            "prompt_tokens": len(ch["prompt_token_ids"]),
            "completion_tokens": 6,
            "total_tokens": len(ch["prompt_token_ids"]) + 6,
        }
        assert c.get("/sync").json()["serving_version"] is None

        # token-id prompts, n, seed
        r = c.post(
            "/v1/completions",
            json={
                "prompt": ch["prompt_token_ids"],
                "max_tokens": 4,
                "temperature": 1.0,
                "n": 3,
                "seed": 5,
                "top_p": 0.95,
            },
        )
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        assert r.json()["choices"][0]["prompt_token_ids"] == ch["prompt_token_ids"]

        # two versions: anchor, then a sparse delta
        for step in (1, 2):
            pub.publish(trainer.step(), step)
            pub.flush()
        st = wait_sync(c, lambda s: s["current_version"] == 2)
        assert st["state"] == "following" and st["lag"] == 0 and st["anchor_loads"] == 1
        assert st["pause_count"] == 2 and st["pause_last_ms"] > 0 and st["pause_max_ms"] >= st["pause_mean_ms"] > 0
        assert st["last_fetch_s"] is not None and st["last_apply_at"] is not None
        out = c.post("/v1/completions", json=body).json()
        assert out["weight_version"] == 2 and out["choices"][0]["weight_version"] == 2

        chat = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0},
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant" and chat.json()["weight_version"] == 2
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["weight_version"] == 2
        assert c.get("/health").json() == {
            "status": "ok",
            "engine": "embedded",
            "weight_version": 2,
            "state": "following",
            # the version's identity (a rewind reuses numbers)
            "state_digest": pub.state_digest,
        }

        # malformed requests: clear 4xx naming the problem
        for bad, code, word in [
            ({"max_tokens": 3}, 422, "prompt"),
            ({"prompt": "x", "temperature": -1}, 422, "temperature"),
            ({"prompt": "x", "n": 0}, 422, "n"),
            ({"prompt": "x", "top_p": 0}, 422, "top_p"),
            ({"prompt": []}, 400, "empty"),
            ({"prompt": [1, 99999]}, 400, "vocabulary"),
            ({"prompt": "x", "stop": [""]}, 400, "stop"),
        ]:
            r = c.post("/v1/completions", json=bad)
            assert r.status_code == code, (bad, r.text)
            assert word in r.json()["error"]["message"], (bad, r.text)
        assert (
            c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}).status_code
            == 422
        )
        assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 422

        # a bad patch: the replica keeps serving its last good version and says so
        assert replica.follower is not None
        replica.follower.stop()
        pub.publish(trainer.step(), 3)
        pub.flush()
        delta = _newest_delta(bucket)
        data = bytearray(delta.read_bytes())
        data[len(data) // 2] ^= 0xFF
        delta.write_bytes(bytes(data))
        replica.follower.start()
        st = wait_sync(c, lambda s: s["state"] == "degraded" and s["newest_version"] == 3)
        assert st["current_version"] == 2 and st["serving_version"] == 2 and st["lag"] == 1 and st["last_error"]
        out = c.post("/v1/completions", json=body).json()
        assert out["weight_version"] == 2

        # the trainer writes a new anchor: the replica recovers
        replica.follower.stop()
        with Publisher(str(bucket), anchor_every=1) as pub2:
            pub2.resume(trainer.state)
            pub2.publish(trainer.step(), 4)
            pub2.flush()
        replica.follower.start()
        st = wait_sync(c, lambda s: s["current_version"] == 4 and s["state"] == "following")
        assert c.post("/v1/completions", json=body).json()["weight_version"] == 4


def test_trl_vllm_clients_talk_to_a_replica(tiny, tmp_path):  # type: ignore[no-untyped-def]
    """TRL 1.16's own clients, unmodified, against a replica: GRPOTrainer's VLLMClient (batched
    token-id prompts, return_tokens_as_token_ids, chat) and async GRPO's (readiness, max_model_len)."""
    pytest.importorskip("trl")
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncVLLMClient
    from trl.generation.vllm_client import VLLMClient

    from sparsesync.checkpoint import load_checkpoint

    bucket = str(tmp_path / "bucket")
    with Publisher(bucket, anchor_every=0) as pub:
        pub.publish(load_checkpoint(tiny), 3)
        pub.flush()
    replica = Replica(EmbeddedEngine(tiny), bucket, poll_interval=0.1)
    with Server(replica) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        wait_sync(c, lambda st: st["serving_version"] == 3)
        PartialState()  # TRL's clients log through accelerate, as inside a trainer
        async_client = AsyncVLLMClient(srv.url, server_timeout=10)
        async_client.wait_for_server_ready(poll_interval_s=0.1)
        assert async_client.get_max_model_len() == replica.engine.max_model_len > 0

        client = VLLMClient(base_url=srv.url, connection_timeout=10)
        assert client.model == replica.model_name
        prompts = [
            c.post("/v1/completions", json={"prompt": p, "max_tokens": 1}).json()["choices"][0]["prompt_token_ids"]
            for p in PROMPTS[:2]
        ]
        out = client.generate(prompts, n=2, temperature=0.0, top_k=5, min_p=0.05, repetition_penalty=1.2, max_tokens=5,
                              generation_kwargs={"ignore_eos": True})
        assert out["prompt_ids"] == prompts and len(out["completion_ids"]) == 4
        for i, ids in enumerate(out["completion_ids"]):  # prompt-major; greedy: what one request of that prompt gives
            one = c.post(
                "/v1/completions",
                json={
                    "prompt": prompts[i // 2],
                    "max_tokens": 5,
                    "temperature": 0.0,
                    "top_k": 5,
                    "min_p": 0.05,
                    "repetition_penalty": 1.2,
                    "ignore_eos": True,
                },
            ).json()
            assert ids == one["choices"][0]["token_ids"] and one["weight_version"] == 3
            assert out["logprob_token_ids"][i] == [[t] for t in ids]
            assert [lp[0] for lp in out["logprobs"][i]] == pytest.approx(
                one["choices"][0]["logprobs"]["token_logprobs"]
            )

        chat = client.chat([[{"role": "user", "content": "Count to 5:"}]], n=1, temperature=0.0, max_tokens=4)
        assert len(chat["completion_ids"]) == 1 and len(chat["logprobs"][0]) == len(chat["completion_ids"][0])
        assert chat["prompt_ids"][0] == replica.engine.apply_chat_template([{"role": "user", "content": "Count to 5:"}])

        # sampling fields the replica does not implement are refused with 400, never ignored
        with pytest.raises(Exception, match="400.*logprobs=21: more than the 20 top logprobs"):
            client.generate(prompts, logprobs=21)
        with pytest.raises(Exception, match="400.*top_logprobs=21: more than the 20 top logprobs"):
            client.chat([[{"role": "user", "content": "hi"}]], logprobs=21)
        with pytest.raises(Exception, match="400.*presence_penalty"):
            client.generate(prompts, generation_kwargs={"presence_penalty": 0.5})
        with pytest.raises(Exception, match="400.*chat template"):
            client.chat([[{"role": "user", "content": "hi"}]], chat_template="{{ messages }}")


def test_top_k_min_p_and_repetition_penalty_are_honoured(tiny):  # type: ignore[no-untyped-def]
    """Sampling at temperature 1 with top_k=1, or min_p=1, is greedy decoding whatever the seed;
    a strong repetition penalty keeps greedy decoding from repeating a token."""
    replica = Replica(EmbeddedEngine(tiny), None)
    with Server(replica) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        def ids(**fields):  # type: ignore[no-untyped-def]
            body = {"prompt": PROMPTS[0], "max_tokens": 10, "ignore_eos": True, **fields}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        greedy = ids(temperature=0.0)
        sampled = {tuple(ids(temperature=1.0, seed=s)) for s in range(4)}
        assert sampled != {tuple(greedy)}  # plain sampling does differ from greedy here
        for s in range(4):
            assert ids(temperature=1.0, seed=s, top_k=1) == greedy
            assert ids(temperature=1.0, seed=s, min_p=1.0) == greedy
        assert len(set(greedy)) < len(greedy)  # this tiny model repeats itself greedily
        penalised = ids(temperature=0.0, repetition_penalty=100.0)
        assert len(set(penalised)) == len(penalised)
