"""The fleet, seen through the bucket: heartbeats, the fleet view, waiting for it, switching together.

Replicas share nothing with the trainer but the bucket, so a follower that opts in writes a
small heartbeat record into the run, and anyone who can read the run sees the fleet:

    fleet/<replica-id>.json          a replica's heartbeat, overwritten in place every few seconds
    switches/v{version:010}.json     "switch to this version at apply_at", written once

Guarantees:
- Fleet records are advisory. Which bytes a replica serves is still decided only by commit
  records and digests: a missing, stale, forged or malformed fleet record can delay a switch
  (never past its deadline) or mislead `sparsesync status`, never make a replica serve wrong
  weights. They are the one kind of object that is overwritten (each only by its own replica).
- Writing never holds up following or generation: a heartbeat thread writes; a failed write is
  logged and retried next period. Without write access (read-only credentials or folder) the
  replica keeps following and says "read-only" in its status.
- Reading is total and bounded: at most `MAX_RECORDS` records, each read with one range request
  of at most `MAX_RECORD_BYTES`; a record that does not parse or validate is skipped with its
  reason. Readers never raise on a bad record.
- Ageing: a heartbeat is live while its age (reader's clock minus the writer's `written_at`) is
  at most `expiry_s(interval_s)` = 3 x its period + 1 s and its health is not "stopped".
- Switching together (opt-in, `FleetOptions.coordinated`): a replica that has staged version N
  (fetched, verified, decoded into its mirror) reports "staged N" and applies N only when the
  switch record of N appears (at its `apply_at`), or at the deadline `commit time of N +
  switch_deadline_s`, a moment common to every replica. A replica that cannot stage in time is
  reported as behind, never waited for past the deadline. See docs/protocol.md.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from sparsesync.errors import ConfigError, FleetTimeoutError, ObjectNotFoundError, StoreAuthError, StoreError
from sparsesync.store import Store

log = logging.getLogger(__name__)

FLEET = "fleet/"
SWITCHES = "switches/"
HEARTBEAT_FORMAT = "sparsesync-heartbeat/1"
SWITCH_FORMAT = "sparsesync-switch/1"
MAX_RECORD_BYTES = 16 << 10  # a heartbeat or switch record larger than this is skipped
MAX_RECORDS = 1000  # heartbeats read per look at the fleet (the rest are skipped with a reason)
MAX_LEAD_S = 10.0  # a replica never sleeps longer than this for a switch record's apply_at
EXPIRY_GRACE_S = 1.0  # clock skew and write latency allowed on top of 3 heartbeat periods
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEARTBEAT_RE = re.compile(r"^fleet/([A-Za-z0-9_.-]{1,64})\.json$")
_MAX_TEXT = 300  # longest string field kept from a record (errors are cut to this)


def heartbeat_key(replica_id: str) -> str:
    return f"{FLEET}{replica_id}.json"


def switch_key(version: int) -> str:
    return f"{SWITCHES}v{version:010d}.json"


def expiry_s(interval_s: float) -> float:
    """How old a heartbeat written every `interval_s` may be and still count as live."""
    return 3 * interval_s + EXPIRY_GRACE_S


def default_replica_id() -> str:
    """`SPARSESYNC_REPLICA_ID`, else the Space id (stable across restarts), else host-pid."""
    raw = os.environ.get("SPARSESYNC_REPLICA_ID") or os.environ.get("SPACE_ID", "").replace("/", "--")
    raw = raw or f"{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:64]


def default_where() -> dict[str, str]:
    """Where this replica runs: the Space id, region and host, as far as the environment says."""
    where = {"host": socket.gethostname()[:_MAX_TEXT]}
    for key, var in (("space_id", "SPACE_ID"), ("region", "SPARSESYNC_REGION")):
        if os.environ.get(var):
            where[key] = os.environ[var][:_MAX_TEXT]
    return where


# ------------------------------------------------------------------------------ records
@dataclass
class Heartbeat:
    """One replica's report of itself (`fleet/<replica>.json`)."""

    replica: str
    written_at: float  # writer's unix time
    interval_s: float  # the writer's heartbeat period (readers age the record by it)
    health: str  # follower state: starting | following | degraded | stopped
    version: int | None  # the version the engine serves
    state_digest: str | None  # state digest of that version (from its commit)
    newest_version: int | None  # newest committed version the replica has seen
    lag: int | None
    last_apply_at: float | None
    last_apply_s: float | None  # the engine's pause for the last apply
    last_error: str | None
    engine: str = ""
    where: dict[str, str] = field(default_factory=dict)
    coordinated: bool = False  # takes part in switching together
    switch_poll_s: float = 1.0  # how often it looks for a switch record while staged
    staged_version: int | None = None  # staged, waiting for the switch
    staged_at: float | None = None
    last_switch: dict[str, Any] | None = None  # {version, how: "switch"|"deadline", at}
    versions_applied: int = 0
    seq: int = 0  # counts this replica's writes
    format: str = HEARTBEAT_FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> Heartbeat:
        """Parse and validate; ValueError says what is wrong (the caller skips the record)."""
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if raw.get("format") != HEARTBEAT_FORMAT:
            raise ValueError(f"format {str(raw.get('format'))[:40]!r}, expected {HEARTBEAT_FORMAT!r}")
        m = _HEARTBEAT_RE.match(key)
        if not m or raw.get("replica") != m[1]:
            raise ValueError(f"replica {str(raw.get('replica'))[:70]!r} does not match the record's name")
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)[:5]}")
        hb = cls(
            replica=m[1],
            written_at=_num(raw, "written_at"),
            interval_s=min(max(_num(raw, "interval_s"), 0.01), 3600.0),
            health=_text(raw, "health"),
            version=_int(raw, "version"),
            state_digest=_text(raw, "state_digest", optional=True),
            newest_version=_int(raw, "newest_version"),
            lag=_int(raw, "lag"),
            last_apply_at=_num(raw, "last_apply_at", optional=True),
            last_apply_s=_num(raw, "last_apply_s", optional=True),
            last_error=_text(raw, "last_error", optional=True),
            engine=_text(raw, "engine", default=""),
            where=_where(raw.get("where")),
            coordinated=_bool(raw, "coordinated"),
            switch_poll_s=min(max(_num(raw, "switch_poll_s", default=1.0), 0.01), MAX_LEAD_S),
            staged_version=_int(raw, "staged_version"),
            staged_at=_num(raw, "staged_at", optional=True),
            last_switch=_last_switch(raw.get("last_switch")),
            versions_applied=_int(raw, "versions_applied") or 0,
            seq=_int(raw, "seq") or 0,
        )
        return hb


@dataclass
class Seen:
    """A heartbeat as one reader saw it: the record, its age, and whether it counts as live."""

    record: Heartbeat
    age_s: float
    live: bool

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.record), "age_s": self.age_s, "live": self.live}


@dataclass
class FleetView:
    """Every heartbeat under a run at one moment, and the records skipped (key, reason)."""

    replicas: list[Seen]
    skipped: list[tuple[str, str]]
    read_at: float

    @property
    def live(self) -> list[Seen]:
        return [s for s in self.replicas if s.live]


@dataclass(frozen=True)
class SwitchRecord:
    """`switches/v<N>.json`: replicas that staged `version` apply it at `apply_at`."""

    version: int
    apply_at: float  # writer's unix time
    written_at: float
    by: str  # "trainer:<writer>" or "replica:<id>" (the rule: every live replica staged)
    format: str = SWITCH_FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> SwitchRecord:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != SWITCH_FORMAT:
            raise ValueError(f"not a {SWITCH_FORMAT} record")
        rec = cls(version=_int(raw, "version", optional=False), apply_at=_num(raw, "apply_at"),  # type: ignore[arg-type]
                  written_at=_num(raw, "written_at"), by=_text(raw, "by"))
        if key != switch_key(rec.version):
            raise ValueError(f"version {rec.version} does not match the record's name")
        return rec


# ------------------------------------------------------------------------------ reading
def read_fleet(store: Store, *, now: float | None = None, max_age_s: float | None = None) -> FleetView:
    """Every heartbeat under the run (live or aged out). Never raises for a bad record; store
    errors on the listing propagate (the caller decides whether to retry). `max_age_s`
    overrides each record's own expiry."""
    listing = store.list(FLEET)
    skipped: list[tuple[str, str]] = []
    keys = []
    for obj in listing:
        if not _HEARTBEAT_RE.match(obj.key):
            skipped.append((obj.key, "not a heartbeat name (fleet/<replica-id>.json)"))
        elif obj.size > MAX_RECORD_BYTES:
            skipped.append((obj.key, f"{obj.size} bytes, over the {MAX_RECORD_BYTES} byte limit"))
        elif len(keys) >= MAX_RECORDS:
            skipped.append((obj.key, f"more than {MAX_RECORDS} heartbeats; not read"))
        else:
            keys.append(obj.key)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(keys)))) as pool:
        results = list(pool.map(lambda k: _read_record(store, k, Heartbeat.from_json), keys))
    now = time.time() if now is None else now
    seen = []
    for key, (rec, why) in zip(keys, results, strict=True):
        if rec is None:
            skipped.append((key, why))
            continue
        age = now - rec.written_at
        limit = max_age_s if max_age_s is not None else expiry_s(rec.interval_s)
        seen.append(Seen(rec, age, live=age <= limit and rec.health != "stopped"))
    return FleetView(seen, skipped, now)


def read_switch(store: Store, version: int) -> SwitchRecord | None:
    """The switch record of `version`, or None (absent, unreadable, or malformed: logged)."""
    rec, why = _read_record(store, switch_key(version), SwitchRecord.from_json)
    if rec is None and why != "absent":
        log.warning("ignoring switch record %s: %s", store.object_url(switch_key(version)), why)
    return rec


def write_switch(store: Store, version: int, *, by: str, apply_in_s: float = 0.0) -> SwitchRecord:
    """Write the switch record of `version` (apply `apply_in_s` from now) unless one exists;
    returns the record in force. Create-only where the store has it, so racing writers agree."""
    now = time.time()
    rec = SwitchRecord(version=version, apply_at=now + max(apply_in_s, 0.0), written_at=now, by=by[:_MAX_TEXT])
    if store.put_new(switch_key(version), rec.to_json()):
        return rec
    return read_switch(store, version) or rec


def wait_for_fleet(
    store: Store,
    version: int,
    min_replicas: int,
    timeout: float,
    *,
    staged: bool = False,
    poll_s: float = 0.5,
) -> list[Seen]:
    """Block until `min_replicas` live replicas serve `version` or newer (with `staged`: have
    staged or serve it); returns them. FleetTimeoutError after `timeout` s names who is behind."""
    if min_replicas < 1:
        raise ConfigError(f"min_replicas={min_replicas}: must be >= 1")
    deadline = time.monotonic() + timeout
    while True:
        try:
            view = read_fleet(store)
        except StoreError as e:  # a failed listing is retried until the deadline
            log.warning("reading the fleet of %s failed: %s", store.url, e)
            view = FleetView([], [], time.time())
        ready = [s for s in view.live if _reached(s.record, version, staged)]
        if len(ready) >= min_replicas:
            return ready
        left = deadline - time.monotonic()
        if left <= 0:
            behind = ", ".join(
                f"{s.record.replica} at {s.record.version}" + (f" (staged {s.record.staged_version})" if staged else "")
                for s in view.live if not _reached(s.record, version, staged)
            ) or "none"
            raise FleetTimeoutError(
                f"{len(ready)} of the {min_replicas} replicas needed {'staged' if staged else 'serve'} version "
                f"{version} of {store.url} after {timeout} s (live: {len(view.live)}; behind: {behind})",
                hint="check the replicas with `sparsesync status URL`; lower min_replicas or raise the timeout",
                ready=[s.record.replica for s in ready],
            )
        time.sleep(min(poll_s, left))


def switch_lead_s(view: FleetView) -> float:
    """How far ahead to set a switch's apply_at so every live coordinated replica sees the
    record first: the slowest one's switch poll period plus 0.25 s for the read itself."""
    polls = [s.record.switch_poll_s for s in view.live if s.record.coordinated]
    return min(max(polls, default=0.0) + 0.25, MAX_LEAD_S)


def _reached(rec: Heartbeat, version: int, staged: bool) -> bool:
    if rec.version is not None and rec.version >= version:
        return True
    return staged and rec.staged_version is not None and rec.staged_version >= version


# ------------------------------------------------------------------------------ the replica side
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
        if not _ID_RE.match(out.replica_id):
            raise ConfigError(f"replica id {out.replica_id!r}: 1-64 of A-Z a-z 0-9 _ . -",
                              hint="set SPARSESYNC_REPLICA_ID to such a name")
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

    def gate(self, version: int, committed_at: float, serving: int | None) -> None:
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
            sw = read_switch(self.store, version)
            if sw is None and opt.switch_rule == "all-staged":
                sw = self._switch_if_all_staged(version)
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
    def _switch_if_all_staged(self, version: int) -> SwitchRecord | None:
        """The rule: when every live coordinated replica has staged (or serves) `version`, any
        of them writes its switch record."""
        try:
            view = read_fleet(self.store)
        except StoreError as e:
            log.warning("reading the fleet of %s failed: %s", self.store.url, e)
            return None
        members = [s for s in view.live if s.record.coordinated and s.record.replica != self.options.replica_id]
        if not all(_reached(s.record, version, staged=True) for s in members):
            return None
        if self._state == "read-only":
            return None  # cannot write it; wait for one written by another replica or the trainer
        try:
            return write_switch(self.store, version, by=f"replica:{self.options.replica_id}",
                                apply_in_s=switch_lead_s(view))
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
                self._error = str(e)[:_MAX_TEXT]
                self._next_retry = time.monotonic() + 60.0  # read-only: try again once a minute
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
                last_error=(st.get("last_error") or None) and str(st["last_error"])[:_MAX_TEXT],
                engine=opt.engine[:_MAX_TEXT], where=dict(opt.where or {}), coordinated=bool(opt.coordinated),
                switch_poll_s=opt.switch_poll_s, staged_version=staged[0] if staged else None,
                staged_at=staged[1] if staged else None, last_switch=self._last_switch,
                versions_applied=int(st.get("versions_applied") or 0), seq=self._seq,
            )


# ------------------------------------------------------------------------------ helpers
def _read_record(store: Store, key: str, parse: Callable[[bytes, str], Any]) -> tuple[Any, str]:
    """(record, "") or (None, why). Reads at most MAX_RECORD_BYTES + 1 bytes."""
    try:
        data = store.get_range(key, 0, MAX_RECORD_BYTES + 1)
    except ObjectNotFoundError:
        return None, "absent"
    except StoreError as e:
        return None, f"unreadable: {e}"
    if len(data) > MAX_RECORD_BYTES:
        return None, f"over the {MAX_RECORD_BYTES} byte limit"
    try:
        return parse(data, key), ""
    except (ValueError, TypeError, KeyError, RecursionError) as e:  # json errors are ValueErrors
        return None, f"malformed: {str(e)[:200]}"


def _is_read_only(e: BaseException) -> bool:
    """Whether a failed write means "no write access" (not a passing fault)."""
    if isinstance(e, StoreAuthError):
        return True
    cause = e.__cause__ or e.__context__
    return isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM)


def _num(raw: dict[str, Any], name: str, *, optional: bool = False, default: float | None = None) -> Any:
    v = raw.get(name, default)
    if v is None and (optional or default is not None):
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} = {str(v)[:40]!r}: expected a finite number")
    return float(v)


def _int(raw: dict[str, Any], name: str, *, optional: bool = True) -> int | None:
    v = raw.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < 1 << 62:
        raise ValueError(f"{name} = {str(v)[:40]!r}: expected an integer >= -1")
    return v


def _text(raw: dict[str, Any], name: str, *, optional: bool = False, default: str | None = None) -> Any:
    v = raw.get(name, default)
    if v is None and (optional or default is not None):
        return default
    if not isinstance(v, str) or len(v) > _MAX_TEXT:
        raise ValueError(f"{name}: expected a string of at most {_MAX_TEXT} characters")
    return v


def _bool(raw: dict[str, Any], name: str) -> bool:
    v = raw.get(name, False)
    if not isinstance(v, bool):
        raise ValueError(f"{name} = {str(v)[:40]!r}: expected true or false")
    return v


def _where(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > 8 or not all(
        isinstance(k, str) and isinstance(x, str) and len(k) <= 40 and len(x) <= _MAX_TEXT for k, x in v.items()
    ):
        raise ValueError("where: expected at most 8 short string fields")
    return dict(v)


def _last_switch(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError("last_switch: expected an object")
    return {"version": _int(v, "version", optional=False), "how": _text(v, "how"), "at": _num(v, "at")}
