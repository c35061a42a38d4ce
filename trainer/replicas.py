"""HTTP client to N inference replicas: spread requests across them, survive one disappearing.

Each replica is an inference server (inference_space/) speaking `POST /v1/completions` and
`GET /sync`. Requests go round-robin across the replicas that are up. A replica that fails
(connection refused or reset, timeout, HTTP 5xx, malformed reply) is marked down for
`cooldown_s` and the request is retried on the next one; a replica marked down is tried again
after its cooldown (or when every replica is down).

Guarantees: `complete` returns a reply from exactly one replica, parsed and checked (token ids,
one log-prob per completion token, the weight version); it raises `ReplicaUnavailableError`
only when every replica failed within the attempt budget. A 4xx answer is a bad request, not
a dead replica: it raises at once without failover. Safe to share between threads.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from trainer.errors import ReplicaUnavailableError, RolloutError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """One sampled completion as the replica reported it."""

    text: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log-prob of each token in `token_ids` under the serving weights
    weight_version: int | None  # None: the replica still serves its start-up weights
    finish_reason: str | None
    state_digest: str | None = None  # the commit's state digest of `weight_version` (None: not reported)


@dataclass(frozen=True)
class Completion:
    """A reply to one request: `n` choices from one replica."""

    replica: str
    choices: tuple[Choice, ...]
    latency_s: float


@dataclass
class ReplicaStats:
    """Per-replica counters."""

    requests: int = 0
    failures: int = 0
    down_until: float = 0.0
    last_error: str | None = None
    latency_s: list[float] = field(default_factory=list)


class ReplicaPool:
    """Round-robin client over `urls` with failover (see module docstring)."""

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 60.0,
        cooldown_s: float = 2.0,
        model: str | None = None,  # None: the replica's served model (a wrong name is a 404)
        headers: dict[str, str] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("ReplicaPool needs at least one replica URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.cooldown_s = cooldown_s
        self.model = model
        self.stats = {u: ReplicaStats() for u in self.urls}
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0), headers=headers,
                                  limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    # -- requests ---------------------------------------------------------------------
    def complete(
        self,
        prompt: str | list[int],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> Completion:
        """Sample `n` completions of `prompt` from one replica, failing over to the others."""
        body: dict[str, Any] = {
            **({"model": self.model} if self.model else {}),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "n": n,
            "logprobs": 1,
        }
        if seed is not None:
            body["seed"] = seed
        if stop:
            body["stop"] = stop
        errors: list[str] = []
        for url in self._order():
            t0 = time.perf_counter()
            try:
                resp = self._http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as e:
                self._mark_down(url, f"{type(e).__name__}: {e}")
                errors.append(f"{url}: {type(e).__name__}")
                continue
            if resp.status_code >= 500:
                self._mark_down(url, f"HTTP {resp.status_code}: {resp.text[:200]}")
                errors.append(f"{url}: HTTP {resp.status_code}")
                continue
            if resp.status_code >= 400:
                raise RolloutError(f"replica {url} refused the request: HTTP {resp.status_code}: {resp.text[:300]}",
                                   hint="check the sampling parameters against the replica's API")
            try:
                comp = _parse(url, resp.json(), time.perf_counter() - t0)
            except (ValueError, KeyError, TypeError) as e:
                self._mark_down(url, f"malformed reply: {e}")
                errors.append(f"{url}: malformed reply ({e})")
                continue
            self._mark_up(url, comp.latency_s)
            return comp
        raise ReplicaUnavailableError(
            f"no inference replica answered ({'; '.join(errors) or 'all cooling down'})",
            urls=self.urls, hint="check that the replicas are running and reachable",
        )

    def sync_status(self) -> dict[str, dict[str, Any] | None]:
        """Each replica's `GET /sync` (its follower status), or None when it does not answer."""
        out: dict[str, dict[str, Any] | None] = {}
        for url in self.urls:
            try:
                r = self._http.get(f"{url}/sync", timeout=5.0)
                out[url] = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                out[url] = None
        return out

    def healthy(self) -> dict[str, bool]:
        """Which replicas answer `GET /health` with 200."""
        out = {}
        for url in self.urls:
            try:
                out[url] = self._http.get(f"{url}/health", timeout=5.0).status_code == 200
            except httpx.HTTPError:
                out[url] = False
        return out

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------
    def _order(self) -> list[str]:
        """Replicas to try, in order: the up ones round-robin, then the cooling-down ones."""
        start = next(self._rr)
        k = len(self.urls)
        rotated = [self.urls[(start + i) % k] for i in range(k)]
        now = time.monotonic()
        with self._lock:
            up = [u for u in rotated if self.stats[u].down_until <= now]
            down = sorted(
                (u for u in rotated if self.stats[u].down_until > now), key=lambda u: self.stats[u].down_until
            )
        return up + down

    def _mark_down(self, url: str, error: str) -> None:
        log.warning("replica %s failed (%s); trying another for %.1f s", url, error, self.cooldown_s)
        with self._lock:
            st = self.stats[url]
            st.requests += 1
            st.failures += 1
            st.last_error = error
            st.down_until = time.monotonic() + self.cooldown_s

    def _mark_up(self, url: str, latency_s: float) -> None:
        with self._lock:
            st = self.stats[url]
            st.requests += 1
            st.down_until = 0.0
            st.latency_s.append(latency_s)
            del st.latency_s[:-100]


def _parse(url: str, data: dict[str, Any], latency_s: float) -> Completion:
    """Check and convert a /v1/completions reply (raises ValueError/KeyError/TypeError)."""
    top_version, top_digest = data.get("weight_version"), data.get("state_digest")
    choices = []
    for c in data["choices"]:
        token_ids = tuple(int(t) for t in c["token_ids"])
        lp = c.get("logprobs") or {}
        logprobs = tuple(float(x) for x in lp.get("token_logprobs") or [])
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs")
        version = c.get("weight_version", top_version)
        choices.append(Choice(
            text=str(c.get("text", "")),
            prompt_ids=tuple(int(t) for t in c["prompt_token_ids"]),
            token_ids=token_ids,
            logprobs=logprobs,
            weight_version=None if version is None else int(version),
            finish_reason=c.get("finish_reason"),
            state_digest=c.get("state_digest", top_digest),
        ))
    if not choices:
        raise ValueError("no choices")
    return Completion(replica=url, choices=tuple(choices), latency_s=latency_s)
