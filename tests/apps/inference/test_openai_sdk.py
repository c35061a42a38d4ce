"""The replica through the official `openai` SDK, unmodified, over real HTTP on 127.0.0.1.

An embedded-engine replica of a tiny model: streamed and non-streamed completions and chats give
the same tokens, text and logprobs; chat takes content parts, the `developer` role and
`max_completion_tokens`; `models.retrieve` works and an unknown model is a 404; logprobs come in
OpenAI's shape. Then the boundary: the API key (Bearer, constant-time, /health open), the body
cap (413 without reading the body), request cost bounds (400 fast), and the hold bound (a long
batch never keeps a committed version off the engine past `max_hold_s`).
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from sparsesync.checkpoint import load_checkpoint  # noqa: E402
from tests.apps.inference.test_server import Server  # noqa: E402
from tests.support.model_steps import PROMPTS  # noqa: E402

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def served(tiny):  # type: ignore[no-untyped-def]
    replica = Replica(EmbeddedEngine(tiny), None, served_model_name="tiny")
    with Server(replica, api_key=KEY) as srv:
        yield srv, replica, openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)


def _extra(obj, name):  # type: ignore[no-untyped-def]
    return (obj.model_extra or {})[name]


def test_completions_stream_equals_non_stream(served):  # type: ignore[no-untyped-def]
    _, replica, client = served
    args = dict(model="tiny", prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=12, temperature=0.0, n=2, logprobs=1,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args)
    assert len(full.choices) == 4 and full.choices[0].finish_reason == "length"
    texts, ids, lps, tokens, finish = {}, {}, {}, {}, {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    for ch in chunks[:-1]:
        (c,) = ch.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        ids.setdefault(c.index, []).extend(_extra(c, "token_ids"))
        lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
        finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in full.choices:
        assert (
            texts[c.index] == c.text and ids[c.index] == _extra(c, "token_ids") and finish[c.index] == c.finish_reason
        )
        assert lps[c.index] == c.logprobs.token_logprobs and tokens[c.index] == c.logprobs.tokens
        assert _extra(c, "weight_version") is None
    # OpenAI's logprobs shape: token strings, offsets into the text, top-1 dicts
    lp = full.choices[0].logprobs
    assert lp.tokens == [replica.engine.tokenizer.decode([t]) for t in _extra(full.choices[0], "token_ids")]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # greedy: top-1 is sampled
    assert all(isinstance(d, dict) and lp.tokens[i] in d for i, d in enumerate(lp.top_logprobs))
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)


def test_chat_content_parts_developer_role_stream(served):  # type: ignore[no-untyped-def]
    _, replica, client = served
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Count"}, {"type": "text", "text": "to 5:"}]}]
    args = dict(
        model="tiny",
        messages=messages,
        max_completion_tokens=8,
        temperature=0.0,
        logprobs=True,
        top_logprobs=1,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**args)
    want = replica.engine.apply_chat_template([{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Count\nto 5:"}])
    assert _extra(full, "prompt_token_ids") == want
    c = full.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length" and len(_extra(c, "token_ids")) == 8
    content = c.logprobs.content
    assert len(content) == 8 and all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 1 for e in content)
    assert [e.logprob for e in content] == [e.top_logprobs[0].logprob for e in content]  # greedy
    stream = list(client.chat.completions.create(stream=True, **args))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream)
    ids = [t for ch in stream for t in _extra(ch.choices[0], "token_ids")]
    streamed_lps = [e.logprob for ch in stream if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert text == c.message.content and ids == _extra(c, "token_ids") and streamed_lps == [e.logprob for e in content]
    assert stream[-1].choices[0].finish_reason == "length"


def test_models_retrieve_and_unknown_model_404(served):  # type: ignore[no-untyped-def]
    _, replica, client = served
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and _extra(m, "max_model_len") == replica.engine.max_model_len
    assert [x.id for x in client.models.list()] == ["tiny"]
    # the --model folder is the name vLLM would serve it under (TRL's async worker sends it)
    assert client.completions.create(model=str(replica.engine.model_dir), prompt="hi", max_tokens=1).model == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_api_key(served):  # type: ignore[no-untyped-def]
    srv, _, _ = served
    wrong = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with httpx.Client(base_url=srv.url) as h:
        assert h.get("/health").status_code == 200  # stays open for probes
        for path in ("/sync", "/v1/models", "/openapi.json"):
            r = h.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert h.get("/sync", headers={"X-API-Key": KEY}).status_code == 200
        assert (
            h.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}).status_code == 401
        )


def test_request_cost_bounds(served):  # type: ignore[no-untyped-def]
    srv, replica, client = served
    # 96 MiB announced: 413 at once, nothing of the body read
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        t0 = time.monotonic()
        s.sendall(
            (
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Length: {96 << 20}\r\n\r\n"
            ).encode()
            + b"{"
            + b" " * (1 << 20)
        )
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 2, reply[:200]
    # 96 MiB streamed without a length: cut off once past the cap
    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(96):
            yield b" " * (1 << 20)
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as h:
        t0 = time.monotonic()
        try:
            r = h.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413
        except httpx.TransportError:  # the server closed the upload after answering
            pass
        assert time.monotonic() - t0 < 5
        assert h.get("/health").status_code == 200
        # 100,000 stop strings (2 MB): 400 before any generation
        t0 = time.monotonic()
        r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stop": [f"s{i}" for i in range(100_000)]})
        assert r.status_code == 400 and "stop" in r.json()["error"]["message"] and time.monotonic() - t0 < 2, r.text
        for bad, word in [({"prompt": "a", "max_tokens": 100_000}, "context"),
                          ({"prompt": "a", "stop": ["x" * 5000]}, "stop"),
                          ({"prompt": ["a"] * 200, "n": 2}, "256")]:
            r = h.post("/v1/completions", json=bad)
            assert r.status_code == 400 and word in r.json()["error"]["message"], (bad, r.text)
        r = h.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**5},
        )
        assert r.status_code == 400 and "context" in r.text


def test_a_long_batch_never_holds_an_update_past_max_hold(tiny):  # type: ignore[no-untyped-def]
    engine = EmbeddedEngine(tiny)
    engine.max_hold_s = 0.3
    replica = Replica(engine, None, served_model_name="tiny")
    weights = load_checkpoint(tiny)
    with Server(replica) as srv, httpx.Client(base_url=srv.url, timeout=120) as h:
        body = {"prompt": PROMPTS[0], "max_tokens": 500, "temperature": 0, "ignore_eos": True, "n": 16}
        t0 = time.monotonic()
        full = h.post("/v1/completions", json=body).json()["choices"][0]
        alone = time.monotonic() - t0
        # long enough that an update waiting on it shows the bound: max_hold_s (0.3 s) plus a decoding
        # step stays well under half the batch (1.45 s on a quiet 2-core machine, more under load)
        assert full["finish_reason"] == "length" and alone > 1.0, alone
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(h.post("/v1/completions", json=body).json()))
        t.start()
        time.sleep(0.2)
        t1 = time.monotonic()
        engine.load_full(1, weights)  # what the follower's hook does for a committed version
        waited = time.monotonic() - t1
        t.join()
        ch = result["choices"][0]
        assert waited < min(1.0, alone / 2) and engine.pauses.last_wait_ms < 1000, (waited, alone)
        assert ch["finish_reason"] == "abort" and ch["stop_reason"] == "weight_update" and ch["weight_version"] is None
        assert 0 < len(ch["token_ids"]) < 500 and ch["token_ids"] == full["token_ids"][: len(ch["token_ids"])]
        # a per-request time bound cuts a batch the same way
        engine.max_hold_s, engine.request_timeout_s = None, 0.3
        ch = h.post("/v1/completions", json=body).json()["choices"][0]
        assert ch["finish_reason"] == "abort" and ch["stop_reason"] == "request_timeout" and ch["weight_version"] == 1
