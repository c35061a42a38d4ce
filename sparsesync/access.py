"""Who may reach a server: the API-key rule every sparsesync server applies at start-up.

Shared by the replica app (`python -m inference_space`) and vLLM's own server following a run
(`sparsesync.integrations.vllm.server`). Guarantees:

- `check_key`: a key is printable ASCII without spaces and at least `MIN_KEY_CHARS` (8)
  characters long (the environment server's minimum); anything else is a `ConfigError` naming
  the setting (never the key).
- `check_access`: an empty key is no key; a server with no key on an address other than
  loopback refuses to start (`ConfigError` naming the three fixes) unless its operator opted in
  to an open server, and then it logs one warning that says so. A missing address (`None`,
  `""`) binds every interface, so it is not loopback.
- `bearer_matches`: `Authorization: Bearer <key>` against any of the keys, compared in constant
  time (sha256 digests, as vLLM's own middleware does, so the length says nothing either).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable, Mapping

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
        raise ConfigError(f"{setting} holds a space, a control or a non-ASCII character (no client header can carry it)",
                          hint=_HINT_KEY)
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
