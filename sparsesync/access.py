"""Who may reach a server, and how much one request may send: the rules every sparsesync server
applies at its boundary.

Shared by the replica app (`python -m inference_space`), the environment server (`python -m
env_space`) and vLLM's own server following a run (`sparsesync.integrations.vllm.server`). Guarantees:

- `check_key`: a key is printable ASCII without spaces and at least `MIN_KEY_CHARS` (8)
  characters long (the environment server's minimum); anything else is a `ConfigError` naming
  the setting (never the key).
- `check_access`: an empty key is no key; a server with no key on an address other than
  loopback refuses to start (`ConfigError` naming the three fixes) unless its operator opted in
  to an open server, and then it logs one warning that says so. A missing address (`None`,
  `""`) binds every interface, so it is not loopback.
- `bearer_matches`: `Authorization: Bearer <key>` against any of the keys, compared in constant
  time (sha256 digests, as vLLM's own middleware does, so the length says nothing either).
- `read_capped_body`: an HTTP request's body, buffered only up to the cap: refused (413) at once
  when Content-Length says more (nothing of the body is read), otherwise as soon as the bytes
  received pass the cap (chunked uploads); a Content-Length that is no number is refused (400).
  `replaying` hands the body read to the app as the request's one message. Pure ASGI (no web
  framework imported); each server answers a refusal in its own error shape.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from sparsesync.errors import ConfigError

MIN_KEY_CHARS = 8
OPEN_VALUES = ("1", "true", "yes", "on")  # what an opt-in variable accepts as "yes"
_HINT_KEY = "use a long random key, e.g. `openssl rand -hex 32`"

log = logging.getLogger(__name__)


def is_loopback(host: str | None) -> bool:
    """Whether binding `host` is reachable from this machine only."""
    if not host:
        return False  # every interface
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def is_set(value: str | None) -> bool:
    """An opt-in variable's value read as a yes (1, true, yes, on)."""
    return (value or "").strip().lower() in OPEN_VALUES


def check_key(key: str | None, setting: str) -> str | None:
    """`key` if it is a usable API key, None for no key; `ConfigError` (naming `setting`) otherwise."""
    if key is None:
        return None
    if len(key) < MIN_KEY_CHARS:
        raise ConfigError(f"{setting} is {len(key)} character(s) long, shorter than {MIN_KEY_CHARS}", hint=_HINT_KEY)
    if not all("!" <= ch <= "~" for ch in key):
        raise ConfigError(
            f"{setting} holds a space, a control or a non-ASCII character (no client header can carry it)",
            hint=_HINT_KEY,
        )
    return key


def check_access(key: str | None, host: str | None, *, allow_open: bool, setting: str, open_setting: str,
                 bind_setting: str = "--host 127.0.0.1", what: str = "server") -> str | None:
    """The key a server started on `host` must require (None: none), or `ConfigError`.

    `setting` names where the key comes from (e.g. `--api-key / SPARSESYNC_API_KEY`),
    `open_setting` the opt-in to an open server, `bind_setting` how to bind loopback only."""
    key = check_key(key or None, setting)
    if key is None and not is_loopback(host):
        where = host or "every interface"
        if not allow_open:
            raise ConfigError(
                f"the {what} would serve on {where} with no API key: anyone who reaches it can use it",
                hint=f"set {setting} (e.g. `openssl rand -hex 32`), or bind {bind_setting}, "
                     f"or set {open_setting}=1 to serve it open on purpose",
            )
        log.warning("OPEN %s: serving on %s with no API key (%s=1): anyone who reaches this address can use it",
                    what, where, open_setting)
    return key


def bearer_matches(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]], keys: Iterable[str]) -> bool:
    """Whether `Authorization: Bearer <token>` in `headers` (a str mapping, or ASGI's raw pairs)
    holds one of `keys`; every key is compared, in constant time."""
    if isinstance(headers, Mapping):
        value = headers.get("authorization") or headers.get("Authorization") or ""
    else:
        value = next((v.decode("latin-1") for k, v in headers if k.lower() == b"authorization"), "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    presented = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented, hashlib.sha256(key.encode()).digest())
    return ok and bool(token)


# -- the request-body cap (pure ASGI) ------------------------------------------------------------
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]


@dataclass(frozen=True)
class BodyRefusal:
    """A request body refused before it was read to the end: `status` 413 (over the cap) or 400 (a
    Content-Length that is no number); `detail` is the size declared or seen ("more than N") for
    413, the header's value (its first 40 bytes, quoted) for 400."""

    status: int
    detail: str


async def read_capped_body(scope: Mapping[str, Any], receive: _Receive, max_bytes: int) -> bytes | BodyRefusal | None:
    """The whole body of the HTTP request `scope`, or why it is refused (see module docstring);
    None when the client disconnected before its end."""
    length = dict(scope["headers"]).get(b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            return BodyRefusal(400, repr(length[:40]))
        if declared > max_bytes:
            return BodyRefusal(413, str(declared))
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes:
            return BodyRefusal(413, f"more than {max_bytes}")
        if not message.get("more_body", False):
            return b"".join(chunks)


def replaying(body: bytes, receive: _Receive) -> _Receive:
    """A `receive` that hands the app `body` (read already) as the request's one message, then the
    connection's own messages (a disconnect)."""
    replayed = False

    async def replay() -> _Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
