"""The servers' one request-body reader (`sparsesync.access.read_capped_body`), driven with ASGI
messages as uvicorn sends them; the replica (tests/apps/inference/test_openai_sdk.py) and the
environment server (tests/apps/env/test_server.py) check it over real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

from sparsesync.access import BodyRefusal, read_capped_body, replaying


def _read(chunks: list[bytes], max_bytes: int, length: int | str | None = None) -> tuple[Any, int]:
    """What the reader returns for a body sent in `chunks`, and how many messages it took."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    taken = 0

    async def receive() -> dict[str, Any]:
        nonlocal taken
        taken += 1
        return messages[taken - 1] if taken <= len(messages) else {"type": "http.disconnect"}

    headers = [] if length is None else [(b"content-length", str(length).encode())]
    got = asyncio.run(read_capped_body({"type": "http", "headers": headers}, receive, max_bytes))
    return got, taken


def test_a_body_within_the_cap_is_read_whole() -> None:
    assert _read([b"ab", b"cd", b"e"], 5) == (b"abcde", 3)
    assert _read([b""], 0) == (b"", 1)


def test_a_declared_length_over_the_cap_is_refused_before_reading() -> None:
    assert _read([b"x" * 10], 5, length=10) == (BodyRefusal(413, "10"), 0)
    assert _read([b"x"], 5, length="ten") == (BodyRefusal(400, "b'ten'"), 0)


def test_a_stream_is_cut_off_as_soon_as_it_passes_the_cap() -> None:
    got, taken = _read([b"x" * 4] * 100, 10)
    assert got == BodyRefusal(413, "more than 10") and taken == 3  # 12 bytes seen: nothing more read


def test_a_disconnect_is_none_and_replay_hands_the_body_once() -> None:
    assert _read([], 10)[0] is None

    async def later() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def two() -> list[dict[str, Any]]:
        receive = replaying(b"body", later)
        return [await receive(), await receive()]

    first, second = asyncio.run(two())
    assert (
        first == {"type": "http.request", "body": b"body", "more_body": False} and second["type"] == "http.disconnect"
    )
