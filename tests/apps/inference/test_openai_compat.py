"""The replica is no stricter than vLLM's OpenAI server where a client sends neutral values.

Through the official `openai` SDK against an embedded-engine replica on 127.0.0.1: the fields
OpenAI clients send at their neutral values (`response_format` text, `store` false,
`parallel_tool_calls`, `metadata`, `service_tier` auto) are accepted; non-neutral ones are a 400
in vLLM's error shape naming the field as `param`; top logprobs up to 20 (chat and completions);
choices carry `stop_reason` (the stop string that ended them, as vLLM); an unknown route answers
in the server's `{"error": ...}` shape. vLLM's own server on the same requests: see
tests/apps/deploy/test_vllm_space.py.
"""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from tests.apps.inference.test_openai_sdk import KEY, served  # noqa: E402, F401

NEUTRAL = {"response_format": {"type": "text"}, "store": False, "parallel_tool_calls": True, "metadata": {"run": "a"},
           "service_tier": "auto"}
REFUSED = [("response_format", {"type": "json_object"}), ("store", True), ("service_tier", "flex"),
           ("presence_penalty", 0.5), ("frequency_penalty", 1.0)]
ERROR_KEYS = {"message", "type", "param", "code"}  # vLLM's ErrorInfo


def test_neutral_fields_are_accepted(served):  # type: ignore[no-untyped-def]
    _, _, client = served
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, **NEUTRAL
    )
    assert chat.choices[0].message.role == "assistant"
    neutral = {k: v for k, v in NEUTRAL.items() if k != "parallel_tool_calls"}  # a chat field in the SDK
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body=neutral)
    assert len(done.choices) == 1
    stream = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, stream=True, **NEUTRAL
        )
    )
    assert stream[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_non_neutral_fields_are_refused_in_vllms_error_shape(served, field, value):  # type: ignore[no-untyped-def]
    srv, _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=3,
            extra_body={field: value},
        )
    err = e.value.body
    assert set(err) == ERROR_KEYS and err["param"] == field and err["code"] == 400 and field in err["message"], err
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS and r.json()["error"]["param"] == field, r.text


def test_echo_is_refused_in_vllms_error_shape(served):  # type: ignore[no-untyped-def]
    _, _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, echo=True)
    assert set(e.value.body) == ERROR_KEYS and e.value.body["param"] == "echo"


def test_top_logprobs_up_to_20(served):  # type: ignore[no-untyped-def]
    _, replica, client = served
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=20,
    )
    for e in chat.choices[0].logprobs.content:
        tops = [t.logprob for t in e.top_logprobs]
        # greedy: sampled is the top
        assert len(tops) == 20 and tops == sorted(tops, reverse=True) and e.logprob == tops[0]
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=1.0, seed=3, logprobs=5,
                                     extra_body={"return_tokens_as_token_ids": True})  # keys unique per token id
    lp = done.choices[0].logprobs
    for tok, lp_tok, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tops[tok] == lp_tok and 5 <= len(tops) <= 6  # the sampled token, and the 5 most likely
    for bad in (dict(logprobs=21), ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, **bad)
        assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=2,
            logprobs=True,
            top_logprobs=21,
        )
    assert e.value.body["param"] == "top_logprobs"


def test_choices_carry_stop_reason(served):  # type: ignore[no-untyped-def]
    _, replica, client = served
    full = client.completions.create(model="tiny", prompt="Repeat the letter a:", max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert (full.choices[0].model_extra or {})["stop_reason"] is None  # length: no stop reason, as vLLM
    stop = text.strip()[:1] if text.strip() else text[:1]
    assert stop, text
    cut = client.completions.create(
        model="tiny",
        prompt="Repeat the letter a:",
        max_tokens=12,
        temperature=0.0,
        stop=[stop, "zzz"],
        extra_body={"ignore_eos": True},
    )
    c = cut.choices[0]
    assert c.finish_reason == "stop" and (c.model_extra or {})["stop_reason"] == stop and stop not in c.text
    chunks = list(client.completions.create(model="tiny", prompt="Repeat the letter a:", max_tokens=12, temperature=0.0,
                                            stop=[stop, "zzz"], stream=True, extra_body={"ignore_eos": True}))
    assert all("stop_reason" in (ch.choices[0].model_extra or {}) for ch in chunks)
    assert (chunks[-1].choices[0].model_extra or {})["stop_reason"] == stop
    chat = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, stream=True
        )
    )
    assert all("stop_reason" in (ch.choices[0].model_extra or {}) for ch in chat)


def test_unknown_routes_answer_in_the_error_shape(served):  # type: ignore[no-untyped-def]
    srv, _, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, code in [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/health", 405),
    ]:
        r = httpx.request(method, f"{srv.url}{path}", headers=auth)
        assert r.status_code == code and set(r.json()) == {"error"} and set(r.json()["error"]) == ERROR_KEYS, (
            method,
            path,
            r.text,
        )
