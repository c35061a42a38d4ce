"""A replica's part in the fleet: its heartbeat thread and the switch gate (`Follower(fleet=...)`).

Guarantees:
- Writing never holds up following or generation: heartbeats are written from their own thread
  every `interval_s` and at once when the replica stages or applies a version (never two writes
  closer than min(0.25 s, interval_s)); a failed write is logged and retried next period. Without write access
  (read-only credentials or folder) the replica keeps following, says "read-only" in its
  status, and tries again once a minute.
- The gate holds only the newest version a coordinated replica has staged, and never past the
  deadline `commit time + switch_deadline_s` (at most that long after staging), nor past a
  switch record's `apply_at` (at most `MAX_LEAD_S` ahead). A cold replica, and every
  intermediate version of a catch-up, go live at once. Reading the fleet: `fleet.py`; the records:
  `records` (`Heartbeat`, `SwitchRecord`), their names: `keys`.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sparsesync.errors import ConfigError, StoreAuthError, StoreError
from sparsesync.protocol.fleet import reached, read_fleet, read_switch, switch_for, switch_lead_s, write_switch
from sparsesync.protocol.keys import REPLICA_ID_RE, heartbeat_key
from sparsesync.protocol.lineage import Lineage
from sparsesync.protocol.records import MAX_LEAD_S, MAX_TEXT, Heartbeat, SwitchRecord
from sparsesync.store import Store

log = logging.getLogger(__name__)


def default_replica_id() -> str:
    """`SPARSESYNC_REPLICA_ID`, else the Space id (stable across restarts), else host-pid."""
    raw = os.environ.get("SPARSESYNC_REPLICA_ID") or os.environ.get("SPACE_ID", "").replace("/", "--")
    raw = raw or f"{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:64]


def default_where() -> dict[str, str]:
    """Where this replica runs: the Space id, region and host, as far as the environment says."""
    where = {"host": socket.gethostname()[:MAX_TEXT]}
    for key, var in (("space_id", "SPACE_ID"), ("region", "SPARSESYNC_REGION")):
        if os.environ.get(var):
            where[key] = os.environ[var][:MAX_TEXT]
    return where


@dataclass
class FleetOptions:
    """How a follower takes part in the fleet. Defaults come from the environment (a Space's
    variables): SPARSESYNC_REPLICA_ID, SPARSESYNC_REGION, SPARSESYNC_HEARTBEAT_S,
    SPARSESYNC_SWITCH (= "coordinated"), SPARSESYNC_SWITCH_DEADLINE_S."""

    replica_id: str = ""  # default: default_replica_id()
    engine: str = ""  # engine name reported (embedded, vllm)
    interval_s: float = 0.0  # heartbeat period; 0: SPARSESYNC_HEARTBEAT_S or 2 s
    where: dict[str, str] | None = None  # default: default_where()
    heartbeat: bool = True  # write heartbeats (False: a silent reader that may still switch together)
    coordinated: bool | None = None  # switch together; None: SPARSESYNC_SWITCH == "coordinated"
    switch_rule: Literal["all-staged", "trainer"] = "all-staged"  # who writes switch records
    switch_deadline_s: float = 0.0  # after a version's commit time, apply it alone; 0: env or 30 s
    switch_poll_s: float = 0.0  # look for the switch record this often while staged; 0: the poll interval (<= 10 s)

    def resolved(self, poll_interval: float) -> FleetOptions:
        """A copy with every default filled in and checked (ConfigError names the bad value)."""
        env = os.environ
        try:
            out = FleetOptions(
                replica_id=self.replica_id or default_replica_id(),
                engine=self.engine,
                interval_s=self.interval_s or float(env.get("SPARSESYNC_HEARTBEAT_S") or 2.0),
                where=dict(self.where) if self.where is not None else default_where(),
                heartbeat=self.heartbeat,
                coordinated=self.coordinated if self.coordinated is not None
                else env.get("SPARSESYNC_SWITCH", "").lower() == "coordinated",
                switch_rule=self.switch_rule,
                switch_deadline_s=self.switch_deadline_s or float(env.get("SPARSESYNC_SWITCH_DEADLINE_S") or 30.0),
                switch_poll_s=self.switch_poll_s or min(poll_interval, MAX_LEAD_S),
            )
        except ValueError as e:
            raise ConfigError(f"fleet option from the environment is not a number: {e}",
                              hint="check SPARSESYNC_HEARTBEAT_S and SPARSESYNC_SWITCH_DEADLINE_S") from e
        if not REPLICA_ID_RE.match(out.replica_id):
            raise ConfigError(f"replica id {out.replica_id!r}: 1-64 of A-Z a-z 0-9 _ . -",
                              hint="set SPARSESYNC_REPLICA_ID to such a name")
        where = out.where or {}
        if len(where) > 8 or any(len(k) > 40 or not isinstance(v, str) or len(v) > MAX_TEXT for k, v in where.items()):
            raise ConfigError(f"where (fields {sorted(where)[:10]}): at most 8 string fields, names of at most 40 "
                              f"and values of at most {MAX_TEXT} characters (readers skip larger heartbeats)")
        if not 0.01 <= out.interval_s <= 3600:
            raise ConfigError(f"heartbeat interval {out.interval_s} s: must be in [0.01, 3600]")
        if out.switch_rule not in ("all-staged", "trainer"):
            raise ConfigError(f"switch_rule {out.switch_rule!r}: expected 'all-staged' or 'trainer'")
        if out.switch_deadline_s <= 0 or not 0 < out.switch_poll_s <= MAX_LEAD_S:
            raise ConfigError(f"switch_deadline_s={out.switch_deadline_s}, switch_poll_s={out.switch_poll_s}: "
                              f"must be > 0 (poll at most {MAX_LEAD_S} s)")
        return out


class FleetMember:
    """A follower's part in the fleet: its heartbeat thread and the switch gate.

    `status` returns the follower's status as a dict (FollowerStatus.to_dict()); `stop` is the
    follower's stop event (a waiting gate returns when it is set).
    """

    def __init__(self, store: Store, options: FleetOptions, status: Callable[[], dict[str, Any]],
                 stop: threading.Event) -> None:
        self.store = store
        self.options = options
        self.key = heartbeat_key(options.replica_id)
        self._status = status
        self._follower_stop = stop
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._digest: str | None = None  # state digest of the version served
        self._staged: tuple[int, float] | None = None
        self._last_switch: dict[str, Any] | None = None
        self._records: dict[str, Any] = {}  # commit records read by the switch rule (immutable)
        self._writes = 0
        self._state = "off" if not options.heartbeat else "starting"  # ok | read-only | failing
        self._error: str | None = None
        self._next_retry = 0.0

    # -- called by the follower ----------------------------------------------------------
    def start(self) -> None:
        if not self.options.heartbeat or self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="sparsesync-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Write a last record saying "stopped" (it leaves the live fleet at once) and end the thread."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._thread = None

    def applied(self, version: int, state_digest: str) -> None:
        with self._lock:
            self._digest = state_digest
        self._wake.set()

    def describe(self) -> dict[str, Any]:
        """What the follower's status says about its part in the fleet."""
        with self._lock:
            return {
                "replica": self.options.replica_id, "key": self.key, "heartbeat": self._state,
                "error": self._error, "writes": self._writes, "coordinated": self.options.coordinated,
                "staged_version": self._staged[0] if self._staged else None, "last_switch": self._last_switch,
            }

    def gate(self, version: int, committed_at: float, serving: int | None, epoch: int | None = None) -> None:
        """Hold a staged `version` until the fleet switches to it (coordinated mode only).

        Returns at once when not coordinated, or when the engine serves nothing yet (a cold
        replica loads at once). Otherwise reports "staged", then returns at the switch record's
        apply_at, or at the deadline `committed_at + switch_deadline_s` (at most that long from
        now), or when the follower stops.
        """
        opt = self.options
        if not opt.coordinated or serving is None:
            return
        now = time.time()
        with self._lock:
            self._staged = (version, now)
        self._wake.set()  # report "staged" now, not at the next period
        deadline = min(committed_at, now) + opt.switch_deadline_s
        how = "deadline"
        while not self._follower_stop.is_set():
            # the record of this commit: one of a commit a rewind abandoned does not count (`fleet.switch_for`)
            sw = read_switch(self.store, version) if epoch is None else switch_for(self.store, version, epoch)
            if sw is None and opt.switch_rule == "all-staged":
                sw = self._switch_if_all_staged(version, epoch)
            if sw is not None:
                self._follower_stop.wait(min(max(sw.apply_at - time.time(), 0.0), MAX_LEAD_S))
                how = "switch"
                break
            left = deadline - time.time()
            if left <= 0:
                log.warning("version %d: no switch record by the deadline; applying it alone", version)
                break
            self._follower_stop.wait(min(opt.switch_poll_s, left))
        with self._lock:
            self._staged = None
            self._last_switch = {"version": version, "how": how, "at": time.time()}

    # -- internals ------------------------------------------------------------------------
    def _switch_if_all_staged(self, version: int, epoch: int | None = None) -> SwitchRecord | None:
        """The rule: when every live coordinated replica has staged (or serves) `version`, any
        of them writes its switch record (of the commit by `epoch`, `fleet.write_switch`). A replica that
        reaches it only through a version a rewind abandoned has not."""
        try:
            view = read_fleet(self.store)
            lineage = Lineage(self.store, self._records)
        except StoreError as e:
            log.warning("reading the fleet of %s failed: %s", self.store.url, e)
            return None
        members = [s for s in view.live if s.record.coordinated and s.record.replica != self.options.replica_id]
        if not all(reached(s.record, version, staged=True) and not lineage.abandoned(s.record, version, staged=True)
                   for s in members):
            return None
        if self._state == "read-only":
            return None  # cannot write it; wait for one written by another replica or the trainer
        try:
            return write_switch(self.store, version, by=f"replica:{self.options.replica_id}",
                                apply_in_s=switch_lead_s(view), epoch=epoch)
        except StoreError as e:
            log.warning("could not write the switch record of version %d: %s", version, e)
            return None

    def _loop(self) -> None:
        interval = self.options.interval_s
        min_gap = min(interval, 0.25)  # event-driven writes (staged, applied) come no closer than this
        last = 0.0
        while True:
            self._wake.wait(timeout=max(interval - (time.monotonic() - last), 0.0))
            self._wake.clear()
            stopping = self._stopping.is_set()
            gap = last + min_gap - time.monotonic()
            if gap > 0 and not stopping:
                self._stopping.wait(gap)
                stopping = self._stopping.is_set()
            last = time.monotonic()
            self._write(final=stopping)
            if stopping:
                return

    def _write(self, *, final: bool) -> None:
        if self._state == "read-only" and time.monotonic() < self._next_retry:
            return
        try:
            data = self._record(final).to_json()
            self.store.put(self.key, data)
        except Exception as e:  # noqa: BLE001 - a heartbeat must never stop the replica
            read_only = _is_read_only(e)
            with self._lock:
                if self._state != ("read-only" if read_only else "failing"):
                    log.warning("replica %s cannot write its heartbeat %s: %s%s", self.options.replica_id,
                                self.store.object_url(self.key), e,
                                " (read-only: it keeps following, unseen by `sparsesync status`)" if read_only else "")
                self._state = "read-only" if read_only else "failing"
                self._error = str(e)[:MAX_TEXT]
                self._next_retry = time.monotonic() + 60.0  # read-only: try again once a minute (failing: next period)
            return
        with self._lock:
            self._state, self._error = "ok", None
            self._writes += 1

    def _record(self, final: bool) -> Heartbeat:
        st = self._status()
        opt = self.options
        with self._lock:
            self._seq += 1
            staged = self._staged
            return Heartbeat(
                replica=opt.replica_id, written_at=time.time(), interval_s=opt.interval_s,
                health="stopped" if final else str(st.get("state")),
                version=st.get("current_version"), state_digest=self._digest,
                newest_version=st.get("newest_version"), lag=st.get("lag"),
                last_apply_at=st.get("last_apply_at"), last_apply_s=st.get("last_apply_s"),
                last_error=(st.get("last_error") or None) and str(st["last_error"])[:MAX_TEXT],
                engine=opt.engine[:MAX_TEXT], where=dict(opt.where or {}), coordinated=bool(opt.coordinated),
                switch_poll_s=opt.switch_poll_s, staged_version=staged[0] if staged else None,
                staged_at=staged[1] if staged else None, last_switch=self._last_switch,
                versions_applied=int(st.get("versions_applied") or 0), seq=self._seq,
                retry_at=st.get("retry_at"),
            )


def _is_read_only(e: BaseException) -> bool:
    """Whether a failed write means "no write access" (not a passing fault)."""
    if isinstance(e, StoreAuthError):
        return True
    cause = e.__cause__ or e.__context__
    return isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
