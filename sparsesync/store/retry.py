"""One retry-with-backoff helper shared by every store backend.

Guarantee: a call either returns, raises the backend's own permanent error unchanged (the
backend turns it into a `StoreError`), or, once transient failures (timeouts, dropped
connections, 5xx, 429) have used up the policy's tries or time budget, raises
`StoreUnavailableError` naming the URL and the last cause. Nothing here ever formats a
credential: messages go through `redact`.

The budget can be tuned without code through the environment:
`SPARSESYNC_STORE_RETRY_S` (total seconds, default 60) and `SPARSESYNC_STORE_RETRY_TRIES`
(tries, default 8); tests set them low to see `StoreUnavailableError` quickly.

`unreachable` tells the failures that waiting does not cure at first contact (a host name that
does not resolve, a refused connection): a backend checks its endpoint once with it and fails at
once, in one line, instead of spending the whole budget on retries (hf_bucket.py).
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from sparsesync.errors import StoreError, StoreUnavailableError

T = TypeVar("T")
log = logging.getLogger(__name__)

#: HTTP statuses worth retrying: timeouts, rate limits, server-side trouble
TRANSIENT_HTTP_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
#: OS errors worth retrying (network filesystems, loopback races)
_TRANSIENT_ERRNO = frozenset(
    {errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
     errno.ECONNABORTED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ESTALE}
)
_SECRET_PATTERNS = (
    re.compile(r"hf_[A-Za-z0-9]{8,}"),
    re.compile(r"AKIA[0-9A-Z]{12,}"),
    re.compile(r"(?i)(bearer\s+)[^\s'\",]+"),
    re.compile(r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)[^'\",}]+"),
    # URL userinfo: scheme://user:password@host (also percent-encoded inside a query value)
    re.compile(r"(?i)([a-z][a-z0-9+.-]*(?::|%3A)(?:/|%2F){2})[^/\s@'\"?#]+(?:@|%40)"),
    # query parameters (and key=value pairs) that carry keys, tokens, passwords, signatures
    re.compile(r"(?i)((?:^|[?&;\s,(]|%26|%3F)[\w.-]*(?:token|secret|password|passwd|pwd|signature|sig|"
               r"credential|api[_-]?key|access[_-]?key|apikey|auth|session)[\w.-]*(?:=|%3D))[^&\s'\",;)#]+"),
)


@dataclass(frozen=True)
class RetryPolicy:
    """How long a store keeps trying before it calls itself unavailable."""

    tries: int = 8  # total attempts, the first included
    deadline_s: float = 60.0  # total seconds across all attempts and sleeps
    base_delay_s: float = 0.25  # first sleep; doubles each retry (full jitter down to half)
    max_delay_s: float = 8.0  # cap of one sleep

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy, with `SPARSESYNC_STORE_RETRY_S` / `_TRIES` applied."""
        p = cls()
        deadline = float(os.environ.get("SPARSESYNC_STORE_RETRY_S", p.deadline_s))
        tries = int(os.environ.get("SPARSESYNC_STORE_RETRY_TRIES", p.tries))
        return cls(tries=max(1, tries), deadline_s=max(0.0, deadline),
                   base_delay_s=min(p.base_delay_s, max(deadline / 8, 0.01)), max_delay_s=p.max_delay_s)

    def delay(self, retry: int) -> float:
        """Sleep before retry number `retry` (1-based), jittered into [d/2, d]."""
        d = min(self.max_delay_s, self.base_delay_s * 2 ** (retry - 1))
        return d * random.uniform(0.5, 1.0)


def redact(text: str, secrets: tuple[str | None, ...] = ()) -> str:
    """`text` with tokens, bearer headers, signatures and the given secret values masked."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "***")
    for pat in _SECRET_PATTERNS:
        text = pat.sub(
            lambda m: (m.group(1) if m.lastindex else "") + ("***@" if m.group(0).endswith(("@", "%40")) else "***"),
            text,
        )
    return text


def describe(exc: BaseException, secrets: tuple[str | None, ...] = ()) -> str:
    """A one-line, credential-free description of an exception."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if len(msg) > 300:
        msg = msg[:300] + "..."
    return redact(f"{type(exc).__name__}: {msg}", secrets)


def is_transient_os_error(exc: BaseException) -> bool:
    """Connection-level and timeout errors from the standard library."""
    if isinstance(exc, (socket.timeout, TimeoutError, ConnectionError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO


def unreachable(exc: BaseException) -> str | None:
    """Why a connection could not even be opened, when waiting cannot help the first contact
    (the host name does not resolve, the connection is refused, no route to the host); else
    None. Looks through the exception's causes (HTTP clients wrap the socket error)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, socket.gaierror):
            return "the host name does not resolve (no network, or a wrong name)"
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return "the connection was refused (nothing listens there)"
        if isinstance(e, OSError) and e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return "there is no route to the host (no network)"
        e = e.__cause__ or e.__context__
    text = str(exc).lower()  # the socket error may only survive as text (httpcore re-raises by message)
    if any(w in text for w in ("name or service not known", "nodename nor servname", "temporary failure in name "
                               "resolution", "name resolution", "getaddrinfo failed", "no address associated")):
        return "the host name does not resolve (no network, or a wrong name)"
    if "connection refused" in text:
        return "the connection was refused (nothing listens there)"
    if "network is unreachable" in text or "no route to host" in text:
        return "there is no route to the host (no network)"
    return None


_reached: set[str] = set()  # endpoints that answered once in this process
_reached_lock = threading.Lock()


def first_contact(endpoint: str, probe: Callable[[], object], *, what: str, url: str, hint: str,
                  timeouts: tuple[type[BaseException], ...] = ()) -> None:
    """Until `endpoint` has answered once in this process, run `probe` (one request, no retry):
    when it fails because the endpoint cannot be reached at all (`unreachable`), raise
    `StoreUnavailableError` at once, naming the host; any answer marks the endpoint reached.
    A probe that times out (`timeouts`) or fails otherwise decides nothing: the caller's own
    call, with its retries, goes ahead."""
    if endpoint in _reached:
        return
    try:
        probe()
    except timeouts:
        return
    except Exception as e:
        why = unreachable(e)
        if why is None:
            return
        host = urlsplit(endpoint).netloc or endpoint
        raise StoreUnavailableError(f"{what} {url}: cannot reach {host}: {why}", url=url, hint=hint) from e
    with _reached_lock:
        _reached.add(endpoint)


def call(
    fn: Callable[[], T],
    *,
    what: str,
    url: str,
    transient: Callable[[BaseException], bool],
    policy: RetryPolicy | None = None,
    secrets: tuple[str | None, ...] = (),
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `fn`, retrying while `transient(exc)` says the failure may pass.

    `what` names the operation for messages ("upload", "list"); `url` the store or object.
    `StoreError`s raised by `fn` pass through untouched; other permanent errors are re-raised
    unchanged for the backend to translate.
    """
    policy = policy or RetryPolicy.from_env()
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except StoreError:
            raise
        except Exception as e:
            if not transient(e):
                raise
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt)
            if attempt >= policy.tries or elapsed + pause > policy.deadline_s:
                raise StoreUnavailableError(
                    redact(
                        f"{what} {url} failed after {attempt} tries in {elapsed:.1f}s: {describe(e, secrets)}", secrets
                    ),
                    url=redact(url, secrets),
                    hint="the store did not answer; check the network and the endpoint, then retry "
                    "- SPARSESYNC_STORE_RETRY_S raises the time budget",
                ) from e
            log.warning("%s %s: %s; retry %d/%d in %.2fs", what, redact(url, secrets), describe(e, secrets),
                        attempt, policy.tries - 1, pause)
            sleep(pause)
