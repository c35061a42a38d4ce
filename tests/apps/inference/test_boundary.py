"""The replica's boundary under attack and under load, over real HTTP on 127.0.0.1.

The API key: the shared rule (8 characters at least; no key on an address other than loopback
only with an explicit opt-in), and a wrong key in every header form the guard accepts is a 401
(a guard that took any `X-API-Key` fails here). Under load: /health and /sync answer at once
while generations block the thread pool; SIGTERM stops `python -m inference_space` within 30 s
with requests in flight. Streaming is linear in the tokens, whatever they decode to.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers", reason="the embedded engine needs transformers")

from inference_space.__main__ import parse_config  # noqa: E402
from inference_space.engines import Completion  # noqa: E402
from inference_space.engines.embedded import EmbeddedEngine  # noqa: E402
from inference_space.openai_api import Shaper  # noqa: E402
from inference_space.replica import Replica  # noqa: E402
from inference_space.server import create_app  # noqa: E402
from sparsesync.access import MIN_KEY_CHARS, check_access  # noqa: E402
from sparsesync.errors import ConfigError, SparsesyncError  # noqa: E402
from tests.apps.inference.test_server import Server, free_port  # noqa: E402
from tests.support.model_steps import PROMPTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
KEY = "sk-boundary-0123456789"


# -- the key rule --------------------------------------------------------------------------------
def test_a_short_or_empty_key_and_an_open_public_address_are_refused(tiny):  # type: ignore[no-untyped-def]
    model = ["--model", str(tiny)]
    with pytest.raises(SparsesyncError, match="1 character"):  # the env server's minimum, shared
        parse_config([*model, "--api-key", "x"], environ={})
    with pytest.raises(SparsesyncError, match=f"shorter than {MIN_KEY_CHARS}"):
        parse_config(model, environ={"SPARSESYNC_API_KEY": "1234567"})
    with pytest.raises(SparsesyncError, match="space"):
        parse_config([*model, "--api-key", "has a space"], environ={})
    # an empty key on 0.0.0.0 is no key: refused, naming the three fixes
    for environ in ({"HOST": "0.0.0.0", "SPARSESYNC_API_KEY": ""}, {"HOST": "0.0.0.0"}, {"HOST": "::"}):
        with pytest.raises(SparsesyncError, match="with no API key") as e:
            parse_config(model, environ=environ)
        assert (
            "SPARSESYNC_API_KEY" in str(e.value)
            and "127.0.0.1" in str(e.value)
            and "SPARSESYNC_ALLOW_NO_KEY=1" in str(e.value)
        )
    # the fixes: a key, loopback, or the explicit opt-in (which warns)
    assert parse_config(model, environ={"HOST": "0.0.0.0", "SPARSESYNC_API_KEY": KEY})[0].api_key == KEY
    assert parse_config(model, environ={"SPARSESYNC_API_KEY": ""})[0].api_key is None  # 127.0.0.1 by default
    assert parse_config([*model, "--host", "localhost"], environ={})[0].api_key is None
    assert parse_config([*model, "--host", "0.0.0.0", "--allow-no-key"], environ={})[0].api_key is None
    assert parse_config(model, environ={"HOST": "0.0.0.0", "SPARSESYNC_ALLOW_NO_KEY": "1"})[0].api_key is None
    # the library's app refuses a key the rule refuses, "" included (only None is "no key")
    replica = Replica(EmbeddedEngine(tiny), None)
    for bad in ("", "short"):
        app = create_app(replica, api_key=bad, manage_lifecycle=False)
        with pytest.raises(ConfigError, match="shorter than"):
            app.build_middleware_stack()
    with pytest.raises(ConfigError, match="every interface"):
        check_access(None, None, allow_open=False, setting="K", open_setting="O")


def test_a_wrong_key_in_every_accepted_header_is_refused(tiny):  # type: ignore[no-untyped-def]
    """A guard that accepted any X-API-Key (or any Bearer token) would pass a test that only
    sends the right key in one form and none in the other: this one sends each form right,
    wrong (same length, a prefix, longer, empty) and beside a wrong key in the other form."""
    replica = Replica(EmbeddedEngine(tiny), None)
    wrongs = [KEY[:-1] + ("x" if KEY[-1] != "x" else "y"), KEY[:-1], KEY + "0", "sk-wrong-key-123", "x"]
    forms = {"bearer": lambda k: {"Authorization": f"Bearer {k}"}, "x-api-key": lambda k: {"X-API-Key": k}}
    with Server(replica, api_key=KEY) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"prompt": PROMPTS[0], "max_tokens": 1}
        for form, header in forms.items():
            assert c.get("/sync", headers=header(KEY)).status_code == 200, form
            assert c.post("/v1/completions", json=body, headers=header(KEY)).status_code == 200, form
            for wrong in wrongs:
                for path in ("/sync", "/v1/models"):
                    r = c.get(path, headers=header(wrong))
                    assert r.status_code == 401, (form, wrong, path, r.text)
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                r = c.post("/v1/completions", json=body, headers=header(wrong))
                assert r.status_code == 401, (form, wrong, r.text)
                # a wrong key in one header and another wrong one in the other
                other = next(f for f in forms if f != form)
                r = c.get("/sync", headers={**header(wrong), **forms[other](wrongs[0])})
                assert r.status_code == 401, (form, wrong)
        for scheme in ("Basic", "Token", ""):  # the key, but not as a Bearer token
            assert c.get("/sync", headers={"Authorization": f"{scheme} {KEY}".strip()}).status_code == 401, scheme
        assert c.get("/sync").status_code == 401
        assert c.get("/health").status_code == 200  # open for probes


# -- under load ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_health_and_sync_answer_while_generations_block_the_pool(tiny):  # type: ignore[no-untyped-def]
    """60 long generations occupy every worker thread of the pool (40) and queue behind the
    engine's gate; /health, /sync and /v1/models still answer within a second."""
    replica = Replica(EmbeddedEngine(tiny), None)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with (
        Server(replica) as srv,
        httpx.Client(base_url=srv.url, timeout=300, limits=httpx.Limits(max_connections=100)) as c,
    ):
        stop = threading.Event()
        threads = [threading.Thread(target=lambda: stop.is_set() or c.post("/v1/completions", json=body), daemon=True)
                   for _ in range(60)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # every pool thread is now blocked in the engine's gate (one generating)
        with httpx.Client(base_url=srv.url, timeout=30) as probe:
            for path in ("/health", "/sync", "/v1/models", "/health"):
                t0 = time.monotonic()
                r = probe.get(path)
                took = time.monotonic() - t0
                assert r.status_code == 200 and took < 1.0, (path, took)
        stop.set()
        replica.engine.stop_serving()  # ends the queued generations at once
        for t in threads:
            t.join(timeout=60)


@pytest.mark.slow
def test_sigterm_stops_the_server_within_30_s_with_requests_in_flight(tiny, tmp_path):  # type: ignore[no-untyped-def]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSESYNC_")}
    env.update(PYTHONPATH=str(ROOT), SPARSESYNC_LOG_LEVEL="WARNING")
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference_space",
            "--model",
            str(tiny),
            "--engine",
            "embedded",
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    results: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        body = {"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "n": 16, "temperature": 0}

        def ask() -> None:
            try:
                results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code)
            except httpx.HTTPError:
                results.append(-1)

        threads = [threading.Thread(target=ask, daemon=True) for _ in range(30)]  # ~30 batches of seconds each: minutes
        for t in threads:
            t.start()
        time.sleep(2.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs 30 s after SIGTERM: {log.read_text()[-2000:]}")
        took = time.monotonic() - t0
        assert took < 20, (took, log.read_text()[-2000:])  # cut at once, not by the last-resort exit at 25 s
        for t in threads:
            t.join(timeout=10)
        # the running batch ended (cut, status 200 with finish "abort"), the queued ones were refused or closed
        assert results and set(results) <= {200, 503, -1}, results
    finally:
        if proc.poll() is None:
            proc.kill()


# -- streaming -------------------------------------------------------------------------------------
def test_streaming_is_linear_in_tokens_that_add_no_text(tiny):  # type: ignore[no-untyped-def]
    """3000 special tokens (which the text skips) between two words: the pieces still concatenate
    to the text, and the tokens decoded in all stay linear (quadratic: about 9 million here)."""
    engine = EmbeddedEngine(tiny)
    tok = engine.tokenizer
    special = sorted(tok.all_special_ids)
    assert special, "the tiny model's tokenizer has special tokens"
    hello, world = engine.tokenize("hello"), engine.tokenize(" world")
    ids = hello + [special[0]] * 3000 + world + [special[0]] * 3000
    text = tok.decode(ids, skip_special_tokens=True)
    decoded = [0]

    def decode(x: list[int], skip: bool) -> str:
        decoded[0] += len(x)
        return tok.decode(x, skip_special_tokens=skip)

    shaper = Shaper(decode, "tiny", False, 0, no_text=frozenset(special))
    c = Completion(0, text, [1], ids, [0.0] * len(ids), "length", None)
    pieces = shaper.segments(c)
    assert "".join(p for p, _, _ in pieces) == text and pieces[0][1] == 0 and pieces[-1][2] == len(ids)
    assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:], strict=False))
    assert len(pieces) >= 2  # still incremental
    assert decoded[0] < 20 * len(ids), decoded[0]
    # bytes that never complete a character: bounded too
    c = Completion(0, "", [1], [special[0]] * 10 + [5] * 3000, [0.0] * 3010, "length", None)
    decoded[0] = 0
    shaper.segments(c)
    assert decoded[0] < 40 * 3010, decoded[0]
