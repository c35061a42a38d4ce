"""The fleet's records: a replica's heartbeat and the switch record (docs/protocol.md, "The fleet").

    fleet/<replica-id>.json          Heartbeat, overwritten in place every few seconds
    switches/v{version:010}.json     SwitchRecord, "switch to this version at apply_at", written once

Guarantees: `to_json()` gives the bytes every earlier sparsesync wrote (sorted keys; a heartbeat
without a pending retry has no `retry_at`). `from_json` reads at most `MAX_RECORD_BYTES` and
raises ValueError with a one-line reason for anything else; a record it returns has every number
in range (times are unix times in [0, MAX_TIME), durations in [0, MAX_DURATION]; NaN, infinities
and integers too large for a float refused; the heartbeat's own periods clamped to what its
readers use) and control characters in its strings replaced (`clean_text`), so its text is safe
to print. What readers do with them (ageing, skipping, waiting) is `protocol.fleet`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sparsesync.protocol import keys
from sparsesync.protocol.records.fields import Fields, load_object

HEARTBEAT_FORMAT = "sparsesync-heartbeat/1"
SWITCH_FORMAT = "sparsesync-switch/1"
MAX_RECORD_BYTES = 16 << 10  # a heartbeat or switch record larger than this is skipped
MAX_LEAD_S = 10.0  # a replica never sleeps longer than this for a switch record's apply_at
MAX_TEXT = 300  # longest string field kept from a record (errors are cut to this)
MAX_TIME = 1e11  # a unix time in a record is in [0, MAX_TIME) (the year 5138)
MAX_DURATION = 1e9  # a duration in a record (seconds) is in [0, MAX_DURATION]
_MAX_INT = (1 << 62) - 1  # the largest version or counter a record reports (-1 is allowed too)


def _time(f: Fields, name: str, *, optional: bool = False) -> Any:
    return f.number(name, 0.0, MAX_TIME, optional=optional, below=True)


def _duration(f: Fields, name: str, *, optional: bool = False, default: float | None = None) -> Any:
    return f.number(name, 0.0, MAX_DURATION, optional=optional, default=default)


def _int(f: Fields, name: str, *, optional: bool = True) -> Any:
    return f.integer(name, -1, _MAX_INT, optional=optional)


def _text(f: Fields, name: str, *, optional: bool = False, default: str | None = None) -> Any:
    return f.text(name, max_len=MAX_TEXT, optional=optional, default=default, clean=True)


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
        f = Fields(load_object(data, MAX_RECORD_BYTES), known=frozenset(x.name for x in fields(cls)))
        f.choice("format", (HEARTBEAT_FORMAT,))
        replica = keys.parse_heartbeat_key(key)
        if replica is None or f.get("replica") != replica:
            raise ValueError(f"replica {str(f.get('replica'))[:70]!r} does not match the record's name")
        last_switch = None
        if f.get("last_switch") is not None:
            s = f.sub("last_switch")
            last_switch = {"version": _int(s, "version", optional=False), "how": _text(s, "how"), "at": _time(s, "at")}
        return cls(
            replica=replica,
            written_at=_time(f, "written_at"),
            interval_s=min(max(_duration(f, "interval_s"), 0.01), 3600.0),
            health=_text(f, "health"),
            version=_int(f, "version"),
            state_digest=_text(f, "state_digest", optional=True),
            newest_version=_int(f, "newest_version"),
            lag=_int(f, "lag"),
            last_apply_at=_time(f, "last_apply_at", optional=True),
            last_apply_s=_duration(f, "last_apply_s", optional=True),
            last_error=_text(f, "last_error", optional=True),
            engine=_text(f, "engine", default=""),
            where=f.text_map("where", max_items=8, max_key=40, max_len=MAX_TEXT),
            coordinated=f.boolean("coordinated"),
            switch_poll_s=min(max(_duration(f, "switch_poll_s", default=1.0), 0.01), MAX_LEAD_S),
            staged_version=_int(f, "staged_version"),
            staged_at=_time(f, "staged_at", optional=True),
            last_switch=last_switch,
            versions_applied=_int(f, "versions_applied") or 0,
            seq=_int(f, "seq") or 0,
            retry_at=_time(f, "retry_at", optional=True),
        )


@dataclass(frozen=True)
class SwitchRecord:
    """`switches/v<N>.json` (or `v<N>-e<E>.json`, `fleet.switch_for`): replicas that staged
    `version` (committed by `epoch`) apply it at `apply_at`."""

    version: int
    apply_at: float  # writer's unix time
    written_at: float
    by: str  # "trainer:<writer>" or "replica:<id>" (the rule: every live replica staged)
    epoch: int | None = None  # the epoch of the commit it gates (None: written before records named it)
    format: str = SWITCH_FORMAT

    def to_json(self) -> bytes:
        raw = asdict(self)
        if raw["epoch"] is None:
            del raw["epoch"]  # as records were before this field existed
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> SwitchRecord:
        f = Fields(load_object(data, MAX_RECORD_BYTES))
        f.choice("format", (SWITCH_FORMAT,))
        rec = cls(version=_int(f, "version", optional=False), apply_at=_time(f, "apply_at"),
                  written_at=_time(f, "written_at"), by=_text(f, "by"), epoch=_int(f, "epoch"))
        if keys.parse_switch_key(key) != rec.version:
            raise ValueError(f"version {rec.version} does not match the record's name")
        return rec
