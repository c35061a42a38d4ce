"""HTTP sessions: a bounded, thread-safe table from session id to its own `TaskEnvironment`.

OpenEnv's `create_app` keeps state only per WebSocket; its HTTP /reset and /step build a fresh
environment per request. This store gives plain HTTP clients persistent episodes keyed by a
session id, which the server hands out on /reset.

Guarantees:
- Isolation: each session owns one environment instance; every operation on the table and on a
  session's environment runs under one lock, so concurrent requests never see or change another
  session's state, and two concurrent steps on one session are applied one after the other.
- Bounded: at most `max_sessions` *live* sessions (episode not yet over). A session whose episode
  ended frees its slot at once but stays readable (/state, and a 409 that says so on /step)
  among the last `remember` finished sessions; /reset with its id starts a new episode in it.
- Idle timeout: a live session untouched for `idle_timeout_s` is evicted (before refusing a new
  one, and at most once a second otherwise); later requests for it get 410, not a silent reset.
- Per client: one client (clients.py says who: an address no header can forge) holds at most
  `max_per_client` live sessions, so one client cannot take every slot. A new session of a
  client at its cap (or of any client when every slot is taken) first replaces that client's
  least recently used session idle for `replace_idle_s` or more (a later request for it gets
  410 saying so); only when it has none is it refused (`ClientCapacityError`, 429; or
  `CapacityError`, 503). One client's leaked sessions so block nobody but, briefly, itself.
  Session ids are 128-bit random (`secrets.token_hex`), never guessable.
- Full means a `CapacityError` (503 with Retry-After), never a wait.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from env_space.environment import TaskEnvironment
from env_space.errors import (
    CapacityError,
    ClientCapacityError,
    EpisodeFinishedError,
    SessionExpiredError,
    UnknownSessionError,
)
from env_space.models import EpisodeState, TextAction, TextObservation


@dataclass
class _Session:
    env: TaskEnvironment
    last_used: float
    client: str = ""  # who opened it (the cap per client counts these)


class SessionStore:
    """Session id -> environment, with a cap on live sessions and an idle timeout."""

    def __init__(self, make_env: Callable[[], TaskEnvironment], *, max_sessions: int,
                 idle_timeout_s: float, remember: int = 4096, max_per_client: int | None = None,
                 replace_idle_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._make_env = make_env
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client or max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.replace_idle_s = replace_idle_s
        self._remember = remember
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, _Session] = {}
        self._finished: OrderedDict[str, _Session] = OrderedDict()  # episode over; no slot held
        self._expired: OrderedDict[str, str] = OrderedDict()  # id -> why it was evicted
        self._last_reap = 0.0

    # -- public API -----------------------------------------------------------------------
    def reset(self, *, session_id: str | None = None, seed: int | None = None, task: str | None = None,
              episode_id: str | None = None, client: str = "") -> tuple[str, TextObservation]:
        """Start an episode: in a new session of `client`, or in `session_id` (which must exist)."""
        with self._lock:
            now = self._clock()
            self._maybe_reap(now)
            if session_id is None:
                sess = _Session(env=self._make_env(), last_used=now, client=client)
                sess.env.check_reset(seed, task)  # bad arguments: refused before any session is replaced
                self._claim_slot(client, now)
                session_id = secrets.token_hex(16)
                sess.env.session_id = session_id
            else:
                sess = self._lookup(session_id, now)
                sess.env.check_reset(seed, task)
                if session_id not in self._live:
                    self._claim_slot(sess.client, now)
            obs = sess.env.reset(seed=seed, episode_id=episode_id, task=task)  # checked above: does not raise
            sess.last_used = now
            self._finished.pop(session_id, None)
            self._live[session_id] = sess
            return session_id, obs

    def step(self, session_id: str, action: TextAction) -> TextObservation:
        with self._lock:
            now = self._clock()
            sess = self._lookup(session_id, now)
            if session_id not in self._live:
                st = sess.env.state
                raise EpisodeFinishedError(
                    f"session {session_id}: episode {st.episode_id} has ended after {st.step_count} steps",
                    hint="POST /reset (with this session_id to reuse it) for a new episode")
            obs = sess.env.step(action)
            sess.last_used = now
            if sess.env.done:
                del self._live[session_id]
                self._remember_finished(session_id, sess)
            return obs

    def state(self, session_id: str) -> EpisodeState:
        with self._lock:
            return self._lookup(session_id, self._clock()).env.state

    def close(self, session_id: str) -> None:
        """Forget a session (frees its slot if live). Unknown ids raise `UnknownSessionError`."""
        with self._lock:
            if self._live.pop(session_id, None) is None and self._finished.pop(session_id, None) is None:
                raise UnknownSessionError(f"unknown session {session_id!r}", hint="nothing to close")

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return {"live_sessions": len(self._live), "finished_sessions": len(self._finished),
                    "max_sessions": self.max_sessions, "max_sessions_per_client": self.max_per_client,
                    "idle_timeout_s": self.idle_timeout_s, "replace_idle_s": self.replace_idle_s}

    # -- helpers (call with the lock held) --------------------------------------------------
    def _lookup(self, session_id: str, now: float) -> _Session:
        sess = self._live.get(session_id) or self._finished.get(session_id)
        if sess is not None and session_id in self._live and now - sess.last_used > self.idle_timeout_s:
            self._evict(session_id, f"expired after {self.idle_timeout_s:g} s idle")
            sess = None
        if sess is None:
            if session_id in self._expired:
                raise SessionExpiredError(f"session {session_id!r} {self._expired[session_id]}",
                                          hint="POST /reset without a session_id for a new session")
            raise UnknownSessionError(
                f"unknown session {session_id!r}",
                hint="use the session_id returned by POST /reset (it may have been closed)")
        return sess

    def _claim_slot(self, client: str, now: float) -> None:
        if len(self._live) >= self.max_sessions or self._held_by(client) >= self.max_per_client:
            self._reap(now)
        if len(self._live) >= self.max_sessions or self._held_by(client) >= self.max_per_client:
            self._replace_idle(client, now)
        if len(self._live) >= self.max_sessions:
            raise CapacityError(
                f"all {self.max_sessions} sessions are in use",
                hint="retry later, finish or DELETE /sessions/<id> idle sessions, or raise ENV_MAX_SESSIONS")
        held = self._held_by(client)
        if held >= self.max_per_client:
            raise ClientCapacityError(
                f"this client already holds {held} live sessions, the most one client may, none idle "
                f"for {self.replace_idle_s:g} s", hint="finish or DELETE /sessions/<id> your sessions, retry once one "
                "is idle that long, or raise ENV_MAX_SESSIONS_PER_CLIENT")

    def _replace_idle(self, client: str, now: float) -> None:
        """Evict `client`'s least recently used live session idle `replace_idle_s` or longer, if any."""
        idle = [(s.last_used, sid) for sid, s in self._live.items()
                if s.client == client and now - s.last_used >= self.replace_idle_s]
        if idle:
            last_used, sid = min(idle)
            self._evict(sid, f"was replaced by a new session of the same client after {now - last_used:.1f} s "
                             f"idle (a client holds at most {self.max_per_client} live sessions)")

    def _held_by(self, client: str) -> int:
        return sum(1 for s in self._live.values() if s.client == client)

    def _maybe_reap(self, now: float) -> None:
        if now - self._last_reap >= 1.0:
            self._reap(now)

    def _reap(self, now: float) -> None:
        self._last_reap = now
        stale = [sid for sid, s in self._live.items() if now - s.last_used > self.idle_timeout_s]
        for sid in stale:
            self._evict(sid, f"expired after {self.idle_timeout_s:g} s idle")

    def _evict(self, session_id: str, why: str) -> None:
        self._live.pop(session_id, None)
        self._finished.pop(session_id, None)
        self._expired[session_id] = why
        while len(self._expired) > self._remember:
            self._expired.popitem(last=False)

    def _remember_finished(self, session_id: str, sess: _Session) -> None:
        self._finished[session_id] = sess
        self._finished.move_to_end(session_id)
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
