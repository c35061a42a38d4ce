"""Fuzz the replica's HTTP API from its own OpenAPI schema: no 5xx, one error shape.

Request bodies for /v1/completions and /v1/chat/completions are drawn (hypothesis) from the
schema the app publishes at /openapi.json: every declared field, each with values at and
beyond its declared bounds, of the wrong type, extreme floats (1e-300, 5e-324, 1e300),
64-bit-plus integers, lone surrogates in text, plus unknown fields. Only the request size
(n, max_tokens) is kept small so each request takes milliseconds; their limits are part of
the edge values all the same. Sent over real HTTP to a real server (embedded engine).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers (pip install -e '.[embedded]')")
hypothesis = pytest.importorskip("hypothesis")

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from sparsesync.tiny_model import build_tiny_model  # noqa: E402
from tests.apps.inference.test_server import Server  # noqa: E402

_TEXT = ["", "a", "Repeat the letter a:", "\ud800", "x\udfffy", "\x00", "é😀", "a" * 3000]
_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e300, -1.0, 0.5, 1.0, 2.0]
_INTS = [0, 1, -1, 2, 511, 512, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
_SMALL = {"n": [1, 2], "max_tokens": [1, 3], "max_completion_tokens": [1, 3]}  # request size: valid values stay cheap


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in spec:
        spec = schema["components"]["schemas"][spec["$ref"].rsplit("/", 1)[-1]]
    return spec


def _values(schema: dict[str, Any], name: str, spec: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values for one declared field: its bounds and beyond, other types, edge cases."""
    spec = _resolve(schema, spec)
    options = [spec] + [_resolve(schema, s) for s in spec.get("anyOf", [])]
    pool: list[Any] = [None, True, "x", {}, []]
    for o in options:
        t = o.get("type")
        bounds = [
            o.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if o.get(k) is not None
        ]
        if t == "integer":
            pool += _INTS + [b + d for b in bounds for d in (-1, 0, 1)]
        elif t == "number":
            pool += _FLOATS + [b + d for b in bounds for d in (-1e-9, 0.0, 1e-9)]
        elif t == "string":
            pool += _TEXT + list(o.get("enum", []))
        elif t == "array":
            item = _resolve(schema, o.get("items", {}))
            if item.get("type") == "integer":
                pool += [[], [0], [-1], [511], [512], [2**63], [1, 2, 3] * 50]
            elif item.get("type") == "string":
                pool += [[], [""], ["\ud800"], ["a", "b"]]
            else:
                pool += [
                    [],
                    [{"role": "user", "content": t} for t in ("hi", "\ud800", "")],
                    [{"role": "robot", "content": "x"}],
                    [{}],
                ]
        elif t == "object":
            pool += [{"a": 1.0}, {"1": -100.0}]
    if name in _SMALL:
        return st.sampled_from(
            _SMALL[name] + [v for v in pool if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v > 2**20]
        )
    return st.sampled_from(pool)


def _bodies(schema: dict[str, Any], component: str) -> st.SearchStrategy[dict[str, Any]]:
    comp = schema["components"]["schemas"][component]
    props = comp["properties"]
    required = set(comp.get("required", []))
    fields = {k: _values(schema, k, v) for k, v in props.items()}
    optional = {k: v for k, v in fields.items() if k not in required}
    base = st.fixed_dictionaries({k: fields[k] for k in required}, optional=optional)
    extra = st.dictionaries(
        st.sampled_from(["bogus", "tools", "response_format"]), st.sampled_from([1, "x"]), max_size=1
    )
    return st.tuples(base, extra).map(lambda be: {**be[0], **be[1]})


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    with Server(Replica(EmbeddedEngine(model))) as s:
        yield s


def _check(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all(json.loads(e)["object"] for e in events[:-1]), (body, r.text[:300])
        return
    data = r.json()
    if r.status_code >= 400:
        err = data.get("error")
        assert (
            isinstance(err, dict)
            and isinstance(err.get("message"), str)
            and err["message"]
            and isinstance(err.get("type"), str)
        ), (body, data)
    else:
        lps = [c["logprobs"].get("token_logprobs") or c["logprobs"]["content"] for c in data["choices"]]
        assert data["choices"] and all(
            len(c["token_ids"]) == len(lp) for c, lp in zip(data["choices"], lps, strict=True)
        )


@pytest.mark.slow
def test_completions_api_fuzzed_from_its_openapi_schema(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        schema = client.get("/openapi.json").json()
        assert {"CompletionRequest", "ChatRequest"} <= set(schema["components"]["schemas"])
        seen: dict[int, int] = {}

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(body=_bodies(schema, "CompletionRequest"))
        def completions(body: dict[str, Any]) -> None:
            _check(client, "/v1/completions", body)

        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(body=_bodies(schema, "ChatRequest"))
        def chat(body: dict[str, Any]) -> None:
            _check(client, "/v1/chat/completions", body)

        completions()
        chat()
        for body in (
            {"prompt": "a", "max_tokens": 2, "seed": 2**64},
            {"prompt": "a", "temperature": 1e-300},
            {"prompt": "\ud800"},
        ):
            r = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code == 400, (body, r.text)
        models = client.get("/v1/models").json()["data"][0]
        assert models["max_model_len"] == 512
