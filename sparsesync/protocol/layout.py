"""Object names and the commit record: the on-bucket layout of a run (docs/protocol.md).

A run is everything under one URL prefix:

    writers/e000003.lock                               epoch 3 reserved (create-only, where the store has it)
    writers/e000003-<writer>.json                      a writer's claim of epoch 3
    anchors/v0000000040-e000003-<uid>/model*.safetensors   full snapshot of version 40 (+ index)
    deltas/v0000000040-v0000000041-e000003-<uid>.safetensors  patch 40 -> 41
    commits/v0000000041-e000003.json                   commit record of version 41, written last

Every object name is unique (epoch + random uid), so nothing is ever overwritten. The names
sort by version. Parsing is strict: anything that does not match is ignored by readers and is
garbage to `gc`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from sparsesync.errors import ProtocolError

COMMIT_FORMAT = "sparsesync-commit/1"
WRITERS = "writers/"
ANCHORS = "anchors/"
DELTAS = "deltas/"
COMMITS = "commits/"
MAX_COMMIT_BYTES = 64 << 20  # a commit record larger than this is refused (hostile bucket)

_COMMIT_RE = re.compile(r"^commits/v(\d{10})-e(\d{6})\.json$")
_LOCK_RE = re.compile(r"^writers/e(\d{6})\.lock$")
_WRITER_RE = re.compile(r"^writers/e(\d{6})-([A-Za-z0-9_.-]+)\.json$")
_DELTA_RE = re.compile(r"^deltas/v(\d{10})-v(\d{10})-e(\d{6})-[0-9a-f]+\.safetensors$")
_ANCHOR_RE = re.compile(r"^anchors/v(\d{10})-e(\d{6})-[0-9a-f]+/")


def new_uid() -> str:
    """A random id that makes an object name unique across writers and retries."""
    return uuid.uuid4().hex[:12]


def writer_key(epoch: int, writer: str) -> str:
    return f"{WRITERS}e{epoch:06d}-{writer}.json"


def commit_key(version: int, epoch: int) -> str:
    return f"{COMMITS}v{version:010d}-e{epoch:06d}.json"


def delta_key(base: int, target: int, epoch: int, uid: str) -> str:
    return f"{DELTAS}v{base:010d}-v{target:010d}-e{epoch:06d}-{uid}.safetensors"


def anchor_prefix(version: int, epoch: int, uid: str) -> str:
    return f"{ANCHORS}v{version:010d}-e{epoch:06d}-{uid}/"


def parse_commit_key(key: str) -> tuple[int, int] | None:
    """(version, epoch) of a commit-record key, or None if `key` is not one."""
    m = _COMMIT_RE.match(key)
    return (int(m[1]), int(m[2])) if m else None


def epoch_lock_key(epoch: int) -> str:
    """The create-only object that reserves `epoch` for one writer (stores with create-only writes)."""
    return f"{WRITERS}e{epoch:06d}.lock"


def parse_epoch_lock_key(key: str) -> int | None:
    """The epoch an epoch-lock key reserves, or None."""
    m = _LOCK_RE.match(key)
    return int(m[1]) if m else None


def parse_writer_key(key: str) -> tuple[int, str] | None:
    """(epoch, writer id) of a writer-claim key, or None."""
    m = _WRITER_RE.match(key)
    return (int(m[1]), m[2]) if m else None


def object_version(key: str) -> int | None:
    """The version an anchor or delta object belongs to (its target), or None."""
    if m := _DELTA_RE.match(key):
        return int(m[2])
    if m := _ANCHOR_RE.match(key):
        return int(m[1])
    return None


@dataclass(frozen=True)
class ObjectRef:
    """An object a commit depends on, with the digest of its bytes (xxh3_64 hex)."""

    key: str
    size: int
    xxh3: str


@dataclass
class CommitRecord:
    """The small JSON object that makes a version visible. Written after all its objects."""

    version: int
    epoch: int
    writer: str
    state_digest: str  # digest of the whole version (see codec.state_digest)
    created_at: float
    delta: ObjectRef | None = None  # patch base_version -> version
    base_version: int | None = None
    base_state_digest: str | None = None
    anchor: list[ObjectRef] = field(default_factory=list)  # full snapshot files, if any
    metrics: dict[str, Any] = field(default_factory=dict)
    format: str = COMMIT_FORMAT

    @property
    def has_anchor(self) -> bool:
        return bool(self.anchor)

    def objects(self) -> list[ObjectRef]:
        return ([self.delta] if self.delta else []) + list(self.anchor)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> CommitRecord:
        """Parse and validate a commit record; ProtocolError names `key` on any problem."""
        if len(data) > MAX_COMMIT_BYTES:
            raise ProtocolError(f"commit record {key!r} is {len(data)} bytes, over the limit")
        try:
            raw = json.loads(data)
            if raw.get("format") != COMMIT_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {COMMIT_FORMAT!r}")
            delta = ObjectRef(**raw["delta"]) if raw.get("delta") else None
            anchor = [ObjectRef(**o) for o in raw.get("anchor") or []]
            rec = cls(
                version=int(raw["version"]),
                epoch=int(raw["epoch"]),
                writer=str(raw["writer"]),
                state_digest=str(raw["state_digest"]),
                created_at=float(raw["created_at"]),
                delta=delta,
                base_version=None if raw.get("base_version") is None else int(raw["base_version"]),
                base_state_digest=raw.get("base_state_digest"),
                anchor=anchor,
                metrics=dict(raw.get("metrics") or {}),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(
                f"commit record {key!r} is malformed: {e}",
                hint="the object was not written by a compatible sparsesync; run `sparsesync verify`",
            ) from e
        if parse_commit_key(key) != (rec.version, rec.epoch):
            raise ProtocolError(
                f"commit record {key!r} says version {rec.version} epoch {rec.epoch}, "
                "which does not match its name"
            )
        if rec.delta is None and not rec.anchor:
            raise ProtocolError(f"commit record {key!r} names neither a delta nor an anchor")
        if rec.delta is not None and rec.base_version is None:
            raise ProtocolError(f"commit record {key!r} has a delta but no base_version")
        return rec


def valid_commits(keys: list[str]) -> list[tuple[int, int, str]]:
    """The commit keys readers trust, as sorted (version, epoch, key).

    Fencing rule: a commit (v, e) is valid iff no commit (v', e') exists with e' > e and
    v' <= v. Once a newer writer has committed anything, an older writer's later commits
    are ignored, even if it had not yet noticed that it was fenced.
    """
    parsed = sorted(p + (k,) for k in keys if (p := parse_commit_key(k)))
    out: list[tuple[int, int, str]] = []
    # walk from the newest version down, tracking the highest epoch seen at versions <= v
    # (that needs the minimum over *lower* versions, so scan ascending with a prefix max)
    prefix_max_epoch: list[int] = []
    best = -1
    for v, e, _ in parsed:
        best = max(best, e)
        prefix_max_epoch.append(best)
    for i, (v, e, k) in enumerate(parsed):
        # highest epoch among commits with version <= v: include equal versions after i
        j = i
        while j + 1 < len(parsed) and parsed[j + 1][0] == v:
            j += 1
        if prefix_max_epoch[j] <= e:
            out.append((v, e, k))
    return out
