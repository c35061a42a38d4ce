"""The fleet, seen through the bucket: heartbeats, the fleet view, waiting for it, switching together.

Replicas share nothing with the trainer but the bucket, so a follower that opts in writes a
small heartbeat record into the run, and anyone who can read the run sees the fleet:

    fleet/<replica-id>.json          a replica's heartbeat, overwritten in place every few seconds
    switches/v{version:010}.json     "switch to this version at apply_at", written once

Guarantees:
- Fleet records are advisory. Which bytes a replica serves is still decided only by commit
  records and digests: a missing, stale, forged or malformed fleet record can delay a switch
  (never past its deadline) or mislead `sparsesync status`, never make a replica serve wrong
  weights. Heartbeats are the one kind of object that is overwritten (each only by its replica).
- Reading is total and bounded: at most `MAX_RECORDS` records, each read with one range request
  of at most `MAX_RECORD_BYTES`; a record that does not parse or validate is skipped with its
  reason. Readers never raise on a bad record: every number is checked against its range
  (times are unix times in [0, 1e11), durations in [0, 1e9]; NaN, infinities and integers too
  large for a float are refused), and control characters in strings are replaced (U+FFFD; tabs
  and newlines by spaces), so a record's text is safe to print. Rich markup in strings is
  data: printers escape it (`sparsesync status`).
- Ageing: a heartbeat is live while its age (reader's clock minus the writer's `written_at`) is
  at most `expiry_s(interval_s)` = 3 x its period + 1 s, is not below -`EXPIRY_GRACE_S` (a
  record dated in the future is not live), and its health is not "stopped".
- Switch records are written once (create-only where the store has it); `wait_for_fleet`
  returns or raises `FleetTimeoutError` by its timeout.

The replica side (writing heartbeats, holding a staged version until the switch) lives in
`fleet_member.py`; the protocol is specified in docs/protocol.md ("The fleet").
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sparsesync.errors import ConfigError, FleetTimeoutError, ObjectNotFoundError, StoreError
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
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEARTBEAT_RE = re.compile(r"^fleet/([A-Za-z0-9_.-]{1,64})\.json$")
MAX_TEXT = 300  # longest string field kept from a record (errors are cut to this)
MAX_TIME = 1e11  # a unix time in a record is in [0, MAX_TIME) (the year 5138)
MAX_DURATION = 1e9  # a duration in a record (seconds) is in [0, MAX_DURATION]
# C0/C1 controls, DEL, and the bidirectional/zero-width format characters terminals honour
_CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def clean_text(text: str) -> str:
    """`text` with tabs and newlines as spaces and other control characters as U+FFFD: a record's
    strings never carry terminal escape sequences (markup is escaped where it is printed)."""
    return _CONTROL_RE.sub("\ufffd", text.replace("\t", " ").replace("\n", " ").replace("\r", " "))


def heartbeat_key(replica_id: str) -> str:
    return f"{FLEET}{replica_id}.json"


def switch_key(version: int) -> str:
    return f"{SWITCHES}v{version:010d}.json"


def epoch_switch_key(version: int, epoch: int) -> str:
    """The switch record of version `version` as committed again by `epoch` after a rewind
    (`protocol.rewind.current_switch`; docs/protocol.md, "Rewinds")."""
    return f"{SWITCHES}v{version:010d}-e{epoch:06d}.json"


def expiry_s(interval_s: float) -> float:
    """How old a heartbeat written every `interval_s` may be and still count as live."""
    return 3 * interval_s + EXPIRY_GRACE_S


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
    retry_at: float | None = None  # after a failed sync: the writer's time of its next attempt (omitted when none)
    format: str = HEARTBEAT_FORMAT

    def to_json(self) -> bytes:
        raw = asdict(self)
        if raw["retry_at"] is None:
            del raw["retry_at"]  # records without a pending retry read as before this field existed
        return json.dumps(raw, sort_keys=True).encode()

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
        return cls(
            replica=m[1],
            written_at=_time(raw, "written_at"),
            interval_s=min(max(_duration(raw, "interval_s"), 0.01), 3600.0),
            health=_text(raw, "health"),
            version=_int(raw, "version"),
            state_digest=_text(raw, "state_digest", optional=True),
            newest_version=_int(raw, "newest_version"),
            lag=_int(raw, "lag"),
            last_apply_at=_time(raw, "last_apply_at", optional=True),
            last_apply_s=_duration(raw, "last_apply_s", optional=True),
            last_error=_text(raw, "last_error", optional=True),
            engine=_text(raw, "engine", default=""),
            where=_where(raw.get("where")),
            coordinated=_bool(raw, "coordinated"),
            switch_poll_s=min(max(_duration(raw, "switch_poll_s", default=1.0), 0.01), MAX_LEAD_S),
            staged_version=_int(raw, "staged_version"),
            staged_at=_time(raw, "staged_at", optional=True),
            last_switch=_last_switch(raw.get("last_switch")),
            versions_applied=_int(raw, "versions_applied") or 0,
            seq=_int(raw, "seq") or 0,
            retry_at=_time(raw, "retry_at", optional=True),
        )


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
        rec = cls(version=_int(raw, "version", optional=False), apply_at=_time(raw, "apply_at"),  # type: ignore[arg-type]
                  written_at=_time(raw, "written_at"), by=_text(raw, "by"))
        if key != switch_key(rec.version) and not re.fullmatch(rf"{SWITCHES}v{rec.version:010d}-e\d{{6}}\.json", key):
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
        # a record from the future is not live (it would otherwise stay "live" that much longer)
        seen.append(Seen(rec, age, live=-EXPIRY_GRACE_S <= age <= limit and rec.health != "stopped"))
    return FleetView(seen, skipped, now)


def read_switch(store: Store, version: int, epoch: int | None = None) -> SwitchRecord | None:
    """The switch record of `version` (`epoch`: its record after a rewind, `epoch_switch_key`),
    or None (absent, unreadable, or malformed: logged)."""
    key = switch_key(version) if epoch is None else epoch_switch_key(version, epoch)
    rec, why = _read_record(store, key, SwitchRecord.from_json)
    if rec is None and why != "absent":
        log.warning("ignoring switch record %s: %s", store.object_url(key), why)
    return rec


def write_switch(store: Store, version: int, *, by: str, apply_in_s: float = 0.0, epoch: int | None = None) -> SwitchRecord:
    """Write the switch record of `version` (apply `apply_in_s` from now) unless one exists;
    returns the record in force. Create-only where the store has it, so racing writers agree.
    `epoch`: the record of `version` as committed again by that epoch after a rewind."""
    now = time.time()
    rec = SwitchRecord(version=version, apply_at=now + max(apply_in_s, 0.0), written_at=now, by=by[:MAX_TEXT])
    if store.put_new(switch_key(version) if epoch is None else epoch_switch_key(version, epoch), rec.to_json()):
        return rec
    return read_switch(store, version, epoch) or rec


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
    from sparsesync.protocol.rewind import Lineage  # rewind hook: a replica on an abandoned version counts for nothing

    if min_replicas < 1:
        raise ConfigError(f"min_replicas={min_replicas}: must be >= 1")
    deadline = time.monotonic() + timeout
    records: dict[str, Any] = {}  # commit records read so far (immutable)
    while True:
        try:
            view = read_fleet(store)
            lineage = Lineage(store, records)
        except StoreError as e:  # a failed listing is retried until the deadline
            log.warning("reading the fleet of %s failed: %s", store.url, e)
            view, lineage = FleetView([], [], time.time()), None
        ready = [s for s in view.live if reached(s.record, version, staged)
                 and (lineage is None or not lineage.abandoned(s.record, version, staged))]
        if len(ready) >= min_replicas:
            return ready
        left = deadline - time.monotonic()
        if left <= 0:
            behind = ", ".join(
                f"{s.record.replica} at {s.record.version}" + (f" (staged {s.record.staged_version})" if staged else "")
                + (" (abandoned by a rewind)" if lineage is not None and lineage.abandoned(s.record, version, staged) else "")
                for s in view.live if s not in ready
            ) or "none"
            raise FleetTimeoutError(
                f"only {len(ready)} of the {min_replicas} replicas needed {'have staged' if staged else 'serve'} "
                f"version {version} of {store.url} after {timeout} s (live: {len(view.live)}; behind: {behind})",
                hint="check the replicas with `sparsesync status URL`; lower min_replicas or raise the timeout",
                ready=[s.record.replica for s in ready],
            )
        time.sleep(min(poll_s, left))


def switch_lead_s(view: FleetView) -> float:
    """How far ahead to set a switch's apply_at so every live coordinated replica sees the
    record first: the slowest one's switch poll period plus 0.25 s for the read itself."""
    polls = [s.record.switch_poll_s for s in view.live if s.record.coordinated]
    return min(max(polls, default=0.0) + 0.25, MAX_LEAD_S)


def reached(rec: Heartbeat, version: int, staged: bool) -> bool:
    """Whether `rec` serves `version` or newer (with `staged`: or has staged it)."""
    if rec.version is not None and rec.version >= version:
        return True
    return staged and rec.staged_version is not None and rec.staged_version >= version


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
    except (ValueError, TypeError, KeyError, RecursionError, ArithmeticError) as e:  # json errors are ValueErrors
        return None, f"malformed: {clean_text(str(e)[:200])}"


def _num(raw: dict[str, Any], name: str, lo: float, hi: float, *, optional: bool = False,
         default: float | None = None) -> Any:
    """A number in [lo, hi] (NaN, infinities and integers too large for a float refused)."""
    v = raw.get(name, default)
    if v is None and (optional or default is not None):
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name}: expected a number")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{name}: a number too large for a float") from None
    if not math.isfinite(f) or not lo <= f <= hi:
        raise ValueError(f"{name} = {f:.6g}: expected a number in [{lo:g}, {hi:g}]")
    return f


def _time(raw: dict[str, Any], name: str, *, optional: bool = False) -> Any:
    t = _num(raw, name, 0.0, MAX_TIME, optional=optional)
    if t is not None and t >= MAX_TIME:
        raise ValueError(f"{name} = {t:.6g}: expected a unix time below {MAX_TIME:g}")
    return t


def _duration(raw: dict[str, Any], name: str, *, optional: bool = False, default: float | None = None) -> Any:
    return _num(raw, name, 0.0, MAX_DURATION, optional=optional, default=default)


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
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise ValueError(f"{name}: expected a string of at most {MAX_TEXT} characters")
    return clean_text(v)


def _bool(raw: dict[str, Any], name: str) -> bool:
    v = raw.get(name, False)
    if not isinstance(v, bool):
        raise ValueError(f"{name} = {str(v)[:40]!r}: expected true or false")
    return v


def _where(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > 8 or not all(
        isinstance(k, str) and isinstance(x, str) and len(k) <= 40 and len(x) <= MAX_TEXT for k, x in v.items()
    ):
        raise ValueError("where: expected at most 8 short string fields")
    return {clean_text(k): clean_text(x) for k, x in v.items()}


def _last_switch(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError("last_switch: expected an object")
    return {"version": _int(v, "version", optional=False), "how": _text(v, "how"), "at": _time(v, "at")}
