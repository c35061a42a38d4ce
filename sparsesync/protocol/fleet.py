"""The fleet, seen through the bucket: heartbeats, the fleet view, waiting for it, switching together.

Replicas share nothing with the trainer but the bucket, so a follower that opts in writes a
small heartbeat record into the run, and anyone who can read the run sees the fleet:

    fleet/<replica-id>.json          a replica's heartbeat, overwritten in place every few seconds
    switches/v{version:010}.json     "switch to this version at apply_at", written once
    switches/v{version:010}-e{epoch:06}.json   the same, for a version committed again after a rewind

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
- Health (`fleet_report`, what `sparsesync status` prints): a `FleetReport` whose `problems`
  list every threshold crossed, one line each, and `ok` is True exactly when there are none.
  The rules live here only; the CLI renders the report and adds nothing.

The records themselves (`Heartbeat`, `SwitchRecord`: fields, bounds, parsing) are in `records`,
their names in `keys`; the replica side (writing heartbeats, holding a staged version until the
switch) lives in `fleet_member.py`; the protocol is specified in docs/protocol.md ("The fleet").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from sparsesync.errors import ConfigError, FleetTimeoutError, ObjectNotFoundError, RunNotFoundError, StoreError
from sparsesync.protocol.keys import COMMITS, FLEET, epoch_switch_key, parse_commit_key, parse_heartbeat_key, switch_key
from sparsesync.protocol.lineage import Lineage
from sparsesync.protocol.records import MAX_LEAD_S, MAX_RECORD_BYTES, MAX_TEXT, Heartbeat, SwitchRecord, clean_text
from sparsesync.protocol.run import Run
from sparsesync.store import Store

log = logging.getLogger(__name__)

MAX_RECORDS = 1000  # heartbeats read per look at the fleet (the rest are skipped with a reason)
EXPIRY_GRACE_S = 1.0  # clock skew and write latency allowed on top of 3 heartbeat periods


def expiry_s(interval_s: float) -> float:
    """How old a heartbeat written every `interval_s` may be and still count as live."""
    return 3 * interval_s + EXPIRY_GRACE_S


# ------------------------------------------------------------------------------ views
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


# ------------------------------------------------------------------------------ reading
def read_fleet(store: Store, *, now: float | None = None, max_age_s: float | None = None) -> FleetView:
    """Every heartbeat under the run (live or aged out). Never raises for a bad record; store
    errors on the listing propagate (the caller decides whether to retry). `max_age_s`
    overrides each record's own expiry."""
    listing = store.list(FLEET)
    skipped: list[tuple[str, str]] = []
    keys: list[str] = []
    for obj in listing:
        if parse_heartbeat_key(obj.key) is None:
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
    """The switch record of `version` (`epoch`: its record after a rewind, `keys.epoch_switch_key`),
    or None (absent, unreadable, or malformed: logged)."""
    key = switch_key(version) if epoch is None else epoch_switch_key(version, epoch)
    rec, why = _read_record(store, key, SwitchRecord.from_json)
    if rec is None and why != "absent":
        log.warning("ignoring switch record %s: %s", store.object_url(key), why)
    return rec


def switch_for(store: Store, version: int, epoch: int) -> SwitchRecord | None:
    """The switch record in force for the commit of `version` by `epoch`, or None. The plain
    `switches/v{N}.json` gates it when the record names that epoch; when it names another one
    (a commit of `version` a rewind abandoned), `switches/v{N}-e{E}.json` does. A plain record
    that names no epoch (written by a release before records named it) gates it only when no
    other epoch ever committed `version` (the commit names are listed then, and only then), so a
    record is tied to the commit it gates by what the records say, never by clocks."""
    plain = read_switch(store, version)
    if plain is None:
        return None  # the epoch's record is written only beside another epoch's plain one
    if plain.epoch == epoch or (plain.epoch is None and not _committed_by_another(store, version, epoch)):
        return plain
    return read_switch(store, version, epoch)


def write_switch(
    store: Store, version: int, *, by: str, apply_in_s: float = 0.0, epoch: int | None = None
) -> SwitchRecord:
    """Write the switch record of the commit of `version` by `epoch` (apply `apply_in_s` from now)
    unless one is in force (`switch_for`); returns the record in force. Create-only where the
    store has it, so racing writers agree. The plain key when it is free, else (it belongs to a
    commit of `version` a rewind abandoned) `switches/v{N}-e{E}.json`. `epoch` None: the plain
    record, as written before records named their epoch."""
    now = time.time()
    rec = SwitchRecord(
        version=version, apply_at=now + max(apply_in_s, 0.0), written_at=now, by=by[:MAX_TEXT], epoch=epoch
    )
    if store.put_new(switch_key(version), rec.to_json()):
        return rec
    if epoch is None:
        return read_switch(store, version) or rec
    current = switch_for(store, version, epoch)
    if current is not None:
        return current
    if store.put_new(epoch_switch_key(version, epoch), rec.to_json()):
        return rec
    return read_switch(store, version, epoch) or rec


def _committed_by_another(store: Store, version: int, epoch: int) -> bool:
    """Whether `commits/` names a commit of `version` by an epoch other than `epoch`."""
    try:
        return any(p[0] == version and p[1] != epoch for o in store.list(COMMITS) if (p := parse_commit_key(o.key)))
    except StoreError as e:
        log.warning("listing the commits of %s failed: %s", store.url, e)
        return True  # cannot tell which commit an old record gates: it gates none


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
            behind = (
                ", ".join(
                    f"{s.record.replica} at {s.record.version}"
                    + (f" (staged {s.record.staged_version})" if staged else "")
                    + (
                        " (abandoned by a rewind)"
                        if lineage is not None and lineage.abandoned(s.record, version, staged)
                        else ""
                    )
                    for s in view.live
                    if s not in ready
                )
                or "none"
            )
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


# ------------------------------------------------------------------------------ health
@dataclass(frozen=True)
class ReplicaHealth:
    """One replica in a `FleetReport`: its heartbeat as seen, how far behind the newest version
    it is (None: it serves none, or the run has no trusted version), and whether it serves a
    version a rewind abandoned."""

    seen: Seen
    behind: int | None
    abandoned: bool

    def to_dict(self) -> dict[str, Any]:
        return {**self.seen.to_dict(), "behind": self.behind, "abandoned": self.abandoned}


@dataclass(frozen=True)
class FleetReport:
    """The fleet's health at one look (`fleet_report`): the run's newest trusted version, every
    heartbeat, and the thresholds crossed (`problems`, in the order `sparsesync status` prints
    them: refused commit names, too few live replicas, then per replica)."""

    url: str
    newest_version: int | None
    newest_committed_at: float | None
    refused: list[tuple[str, str]]
    """Commit names newer than the newest trusted version whose object is not a commit record (key, reason)."""
    read_at: float
    live: int
    """How many replicas' heartbeats are live."""
    replicas: list[ReplicaHealth]
    """Every heartbeat (live or not), by replica name."""
    skipped: list[tuple[str, str]]
    """Fleet records that were not read or did not parse (key, reason)."""
    min_replicas: int
    max_lag: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        """Whether no threshold is crossed (`sparsesync status` exits 0)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as `sparsesync status --json` prints it."""
        return {
            "url": self.url, "newest_version": self.newest_version, "newest_committed_at": self.newest_committed_at,
            "refused": [{"key": k, "reason": why} for k, why in self.refused],
            "read_at": self.read_at, "live": self.live, "replicas": [r.to_dict() for r in self.replicas],
            "skipped": [{"key": k, "reason": why} for k, why in self.skipped],
            "thresholds": {"min_replicas": self.min_replicas, "max_lag": self.max_lag},
            "problems": list(self.problems), "ok": self.ok,
        }


def fleet_report(store: Store, *, min_replicas: int = 1, max_lag: int = 2) -> FleetReport:
    """The fleet's health: a problem for each commit name above the newest trusted version that
    is not a commit record, for fewer than `min_replicas` live replicas, and per live replica:
    serving a version a rewind abandoned, no version or more than `max_lag` versions behind the
    newest, or "degraded" (its error, and when it tries again). RunNotFoundError when the run has
    no commit name at all; store errors propagate."""
    head = Run(store).head()  # reads only the records fencing and the newest names need
    if head.record is None and not head.refused:
        raise RunNotFoundError(f"no committed version under {store.url}",
                               hint="check the URL, or publish a first version with `sparsesync push`")
    newest = head.record
    view = read_fleet(store)
    lineage = Lineage(store)  # a replica still on a version a rewind abandoned (reads only those records)
    rows: list[ReplicaHealth] = []
    problems: list[str] = []
    newest_version = None if newest is None else newest.version
    for seen in sorted(view.replicas, key=lambda s: s.record.replica):
        r = seen.record
        behind = None if r.version is None or newest is None else max(newest.version - r.version, 0)
        abandoned = lineage.judge(r.version, r.state_digest) == "abandoned"
        rows.append(ReplicaHealth(seen, behind, abandoned))
        if seen.live:
            problems += _replica_problems(r, behind, abandoned, newest_version, max_lag, view.read_at)
    n_live = len(view.live)
    if n_live < min_replicas:
        problems.insert(0, f"{n_live} live replica(s), fewer than {min_replicas}")
    problems[:0] = [f"commit {key} is not a commit record, every reader refuses it: {why} (newest trusted version: "
                    f"{'none' if newest is None else newest.version})" for key, why in head.refused]
    return FleetReport(url=store.url, newest_version=newest_version,
                       newest_committed_at=None if newest is None else newest.created_at, refused=list(head.refused),
                       read_at=view.read_at, live=n_live, replicas=rows, skipped=list(view.skipped),
                       min_replicas=min_replicas, max_lag=max_lag, problems=problems)


def _replica_problems(r: Heartbeat, behind: int | None, abandoned: bool, newest_version: int | None, max_lag: int,
                      read_at: float) -> list[str]:
    """The thresholds a live replica's heartbeat `r` crosses, one line each."""
    out = []
    if abandoned:
        out.append(f"{r.replica} serves version {r.version} of an abandoned attempt (state {r.state_digest}); "
                   f"the run was rewound, newest is {newest_version}")
    elif r.version is None or (behind is not None and behind > max_lag):
        out.append(f"{r.replica} serves version {r.version}, newest is {newest_version} (max lag {max_lag})")
    if r.health == "degraded":
        retry = "" if r.retry_at is None else f" (next attempt in {max(r.retry_at - read_at, 0.0):.0f} s)"
        out.append(f"{r.replica} is degraded: {r.last_error}{retry}")
    return out


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
    # the records raise ValueError; the rest: belt and braces
    except (ValueError, TypeError, KeyError, RecursionError, ArithmeticError) as e:
        return None, f"malformed: {clean_text(str(e)[:200])}"
