"""Object names and the commit record: the on-bucket layout of a run (docs/protocol.md).

A run is everything under one URL prefix:

    writers/e000003.lock                               epoch 3 reserved (create-only, where the store has it)
    writers/e000003-<writer>.json                      a writer's claim of epoch 3
    anchors/v0000000040-e000003-<uid>/model*.safetensors   full snapshot of version 40 (shards + index)
    deltas/v0000000040-v0000000041-e000003-<uid>.safetensors  patch 40 -> 41
    deltas/v0000000040-v0000000041-e000003-<uid>-p00002.safetensors  part 2 of patch 40 -> 41 (format 2)
    commits/v0000000041-e000003.json                   commit record of version 41, written last

Every object name is unique (epoch + random uid), so nothing is ever overwritten. The names
sort by version. Parsing is strict: anything that does not match is ignored by readers and is
garbage to `gc`.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from sparsesync.adapter import AdapterMeta
from sparsesync.errors import ConfigError, MalformedCommitError
from sparsesync.protocol.extras import FileRef, parse_files

COMMIT_FORMAT = "sparsesync-commit/1"
COMMIT_FORMAT_PARTS = "sparsesync-commit/2"  # a version in parts (docs/protocol.md, "Versions in parts")
WRITERS = "writers/"
ANCHORS = "anchors/"
DELTAS = "deltas/"
COMMITS = "commits/"
MAX_COMMIT_BYTES = 64 << 20  # a commit record larger than this is refused (hostile bucket)
MAX_VERSION = 10**10 - 1  # the widest version a commit name can carry (10 digits)
MAX_EPOCH = 10**6 - 1  # the widest epoch a name can carry (6 digits)

_COMMIT_RE = re.compile(r"^commits/v(\d{10})-e(\d{6})\.json$")
_LOCK_RE = re.compile(r"^writers/e(\d{6})\.lock$")
_WRITER_RE = re.compile(r"^writers/e(\d{6})-([A-Za-z0-9_.-]+)\.json$")
_DELTA_RE = re.compile(r"^deltas/v(\d{10})-v(\d{10})-e(\d{6})-[0-9a-f]+\.safetensors$")
_PART_RE = re.compile(r"^deltas/v(\d{10})-v(\d{10})-e(\d{6})-[0-9a-f]+-p(\d{5})\.safetensors$")
_ANCHOR_RE = re.compile(r"^anchors/v(\d{10})-e(\d{6})-[0-9a-f]+/")
_ANCHOR_FILE_RE = re.compile(r"^anchors/v(\d{10})-e\d{6}-[0-9a-f]+/"
                             r"(?:model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$")
_SHARD_NAME_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def new_uid() -> str:
    """A random id that makes an object name unique across writers and retries."""
    return uuid.uuid4().hex[:12]


def writer_key(epoch: int, writer: str) -> str:
    return f"{WRITERS}e{epoch:06d}-{writer}.json"


def commit_key(version: int, epoch: int) -> str:
    return f"{COMMITS}v{version:010d}-e{epoch:06d}.json"


def delta_key(base: int, target: int, epoch: int, uid: str) -> str:
    return f"{DELTAS}v{base:010d}-v{target:010d}-e{epoch:06d}-{uid}.safetensors"


def part_key(base: int, target: int, epoch: int, uid: str, index: int) -> str:
    return f"{DELTAS}v{base:010d}-v{target:010d}-e{epoch:06d}-{uid}-p{index:05d}.safetensors"


def anchor_prefix(version: int, epoch: int, uid: str) -> str:
    return f"{ANCHORS}v{version:010d}-e{epoch:06d}-{uid}/"


def check_version(version: object, url: str) -> int:
    """`version` if it is an integer a commit name can carry; ConfigError before anything is written."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ConfigError(
            f"version {version!r} for {url} is not an integer in [0, {MAX_VERSION}] (commit names carry 10 digits)",
            hint="pass a smaller step, e.g. the optimizer step count",
        )
    return version


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


def parse_part_key(key: str) -> tuple[int, int, int, int] | None:
    """(base, target, epoch, index) of a part object's key, or None."""
    m = _PART_RE.match(key)
    return (int(m[1]), int(m[2]), int(m[3]), int(m[4])) if m else None


def object_version(key: str) -> int | None:
    """The version an anchor or delta object belongs to (its target), or None."""
    if m := _DELTA_RE.match(key) or _PART_RE.match(key):
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


@dataclass(frozen=True)
class Unit:
    """What a part covers of one tensor: all of it (`rows` None) or rows [start, stop) of dim 0."""

    name: str
    rows: tuple[int, int] | None = None

    @property
    def key(self) -> str:
        """The name the unit's digest goes by in state digests: the tensor name, or `name[start:stop]`."""
        return self.name if self.rows is None else f"{self.name}[{self.rows[0]}:{self.rows[1]}]"

    def to_json(self) -> list[Any]:
        return [self.name] if self.rows is None else [self.name, self.rows[0], self.rows[1]]


@dataclass(frozen=True)
class PartRef(ObjectRef):
    """One part of a version: a patch object over `units`, with the state digests of those units
    before and after (digests over `Unit.key` names, as the part's patch header says)."""

    base_state_digest: str = ""
    state_digest: str = ""
    units: tuple[Unit, ...] = ()


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
    adapter: AdapterMeta | None = None  # set in LoRA adapter runs (sparsesync.adapter)
    format: str = COMMIT_FORMAT
    parts: list[PartRef] = field(default_factory=list)  # format 2: the delta in parts (instead of `delta`)
    files: list[FileRef] = field(default_factory=list)  # the checkpoint's non-weight files (protocol.extras)

    @property
    def has_anchor(self) -> bool:
        return bool(self.anchor)

    @property
    def has_delta(self) -> bool:
        """Whether the record carries a delta from `base_version`: one file or parts."""
        return self.delta is not None or bool(self.parts)

    def delta_objects(self) -> list[ObjectRef]:
        return [self.delta] if self.delta else list(self.parts)

    def objects(self) -> list[ObjectRef]:
        return self.delta_objects() + list(self.anchor)

    def to_json(self) -> bytes:
        raw = asdict(self)
        if raw["adapter"] is None:
            del raw["adapter"]  # full-weight commits stay as they were
        if not raw["files"]:
            del raw["files"]  # likewise without checkpoint files
        if self.parts:
            raw["format"] = COMMIT_FORMAT_PARTS
            raw["parts"] = [{"key": p.key, "size": p.size, "xxh3": p.xxh3, "base_state_digest": p.base_state_digest,
                             "state_digest": p.state_digest, "units": [u.to_json() for u in p.units]} for p in self.parts]
        else:  # format 1, byte for byte what readers of format 1 know
            raw.pop("parts")
            raw["format"] = COMMIT_FORMAT
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> CommitRecord:
        """Parse a commit record against the schema (docs/protocol.md); anything else raises
        `MalformedCommitError` with a one-line reason naming `key`."""
        return _parse_commit(data, key)


_HEX = re.compile(r"^[0-9a-f]{8,64}$")
_NUMERIC_METRICS = ("n_changed", "n_params", "density", "patch_bytes", "anchor_bytes", "diff_s", "encode_s",
                    "upload_s", "snapshot_s", "anchor_write_s", "bytes_per_changed")
_MAX_ANCHOR_FILES = 10_000
# 1 TiB: no object of a run is larger (anchor shards are at most 5 GiB, parts about `part_bytes`);
# a record saying more is not a commit, so no reader ever sizes a read by it
MAX_OBJECT_BYTES = 1 << 40
_MAX_ROWS = 1 << 50  # a unit's rows end below this


def _int(raw: dict[str, Any], name: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
    v = raw.get(name)
    if v is None and optional:
        return None
    if type(v) is not int:
        raise ValueError(f"{name} is {_show(v)}, expected an integer")
    if not lo <= v <= hi:
        raise ValueError(f"{name} {v} is outside [{lo}, {hi}]")
    return v


def _str(raw: dict[str, Any], name: str, pattern: re.Pattern[str] | None = None, *, optional: bool = False,
         max_len: int = 256) -> str | None:
    v = raw.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > max_len:
        raise ValueError(f"{name} is {_show(v)}, expected a string of at most {max_len} characters")
    if pattern is not None and not pattern.match(v):
        raise ValueError(f"{name} {v!r} is not a hex digest")
    return v


def _show(v: Any) -> str:
    """A short description of a JSON value for a one-line reason."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    return f"{type(v).__name__} {json.dumps(v)[:40]}"


def _ref(raw: Any, what: str, expect: re.Pattern[str], version: int, base: int | None) -> ObjectRef:
    if not isinstance(raw, dict) or set(raw) != {"key", "size", "xxh3"}:
        raise ValueError(f"{what} is {_show(raw)}, expected an object with exactly key, size, xxh3")
    key = _str(raw, "key", max_len=1024)
    m = expect.match(key or "")
    if m is None:
        raise ValueError(f"{what} key {key!r} is not a {what.split()[0]} object name")
    names = (int(m[1]), int(m[2])) if what.startswith("delta") else (int(m[1]),)
    if names != ((base, version) if what.startswith("delta") else (version,)):
        raise ValueError(f"{what} key {key!r} names versions {names}, not this commit's")
    size = _int(raw, "size", 0, MAX_OBJECT_BYTES)
    return ObjectRef(key=key, size=size, xxh3=_str(raw, "xxh3", _HEX))  # type: ignore[arg-type]


_MAX_PARTS = 100_000
_MAX_UNITS = 1_000_000


def _unit(raw: Any, what: str) -> Unit:
    ok = isinstance(raw, list) and len(raw) in (1, 3) and isinstance(raw[0], str) and 0 < len(raw[0]) <= 1024
    if ok and len(raw) == 3:
        ok = all(type(x) is int for x in raw[1:]) and 0 <= raw[1] < raw[2] <= _MAX_ROWS
    if not ok:
        raise ValueError(f"{what} is {_show(raw)}, expected [name] or [name, start, stop] with 0 <= start < stop")
    return Unit(raw[0], None if len(raw) == 1 else (raw[1], raw[2]))


def _parts(raw: dict[str, Any], version: int, base: int | None) -> list[PartRef]:
    """The `parts` of a format-2 record: at least one; every part names a part object of
    base -> version, its digests and its units; no unit twice, no two units of a tensor overlap.
    Linear in the number of units (plus a sort of each tensor's row ranges)."""
    plist = raw.get("parts")
    if not isinstance(plist, list) or not 0 < len(plist) <= _MAX_PARTS:
        raise ValueError(f"parts is {_show(plist)}, expected a list of 1 to {_MAX_PARTS} objects")
    if base is None:
        raise ValueError("it has parts but no base_version")
    out: list[PartRef] = []
    n_units = 0
    rows: dict[str, list[tuple[int, int, int]]] = {}  # tensor -> (start, stop, part index) of each unit
    for i, p in enumerate(plist):
        what = f"parts[{i}]"
        if not isinstance(p, dict) or set(p) != {"key", "size", "xxh3", "base_state_digest", "state_digest", "units"}:
            raise ValueError(f"{what} is {_show(p)}, expected an object with exactly key, size, xxh3, "
                             "base_state_digest, state_digest, units")
        ref = _ref({k: p[k] for k in ("key", "size", "xxh3")}, f"delta part {i}", _PART_RE, version, base)
        ulist = p["units"]
        n_units += len(ulist) if isinstance(ulist, list) else 0
        if not isinstance(ulist, list) or not ulist or n_units > _MAX_UNITS:
            raise ValueError(f"{what}.units is {_show(ulist)}, expected a non-empty list (at most {_MAX_UNITS} in all)")
        units = tuple(_unit(u, f"{what}.units[{j}]") for j, u in enumerate(ulist))
        for u in units:
            start, stop = u.rows or (0, _MAX_ROWS + 1)
            rows.setdefault(u.name, []).append((start, stop, i))
        out.append(PartRef(key=ref.key, size=ref.size, xxh3=ref.xxh3,
                           base_state_digest=_str(p, "base_state_digest", _HEX),  # type: ignore[arg-type]
                           state_digest=_str(p, "state_digest", _HEX), units=units))  # type: ignore[arg-type]
    for name, spans in rows.items():
        if len(spans) > 1:
            spans.sort()
            end = -1
            for start, stop, i in spans:
                if start < end:
                    raise ValueError(f"parts[{i}] covers tensor {name!r} rows that another unit covers too")
                end = max(end, stop)
    if len({p.key for p in out}) != len(out):
        raise ValueError("parts lists one object twice")
    return out


def _check_anchor_files(anchor: list[ObjectRef]) -> None:
    """An anchor is one folder holding `model.safetensors` alone, or the shards
    `model-0000k-of-0000n.safetensors` for k = 1..n (each once, one n) and their index."""
    if not anchor:
        return
    if len({o.key.rsplit("/", 1)[0] for o in anchor}) != 1:
        raise ValueError("anchor files lie in more than one folder")
    names = [o.key.rsplit("/", 1)[-1] for o in anchor]
    if len(set(names)) != len(names):
        raise ValueError("anchor lists one file name twice")
    if names == ["model.safetensors"]:
        return
    shards = sorted((int(m[1]), int(m[2])) for n in names if (m := _SHARD_NAME_RE.match(n)))
    n = len(shards)
    if "model.safetensors.index.json" not in names or n + 1 != len(names) or shards != [(k, n) for k in range(1, n + 1)]:
        raise ValueError(f"anchor files {sorted(names)[:4]}{'...' if len(names) > 4 else ''} are neither model.safetensors "
                         "alone nor shards model-0000k-of-0000n.safetensors (k = 1..n) with model.safetensors.index.json")


def _parse_commit(data: bytes, key: str) -> CommitRecord:
    def bad(reason: str) -> MalformedCommitError:
        return MalformedCommitError(key, reason)

    name = parse_commit_key(key)
    if name is None:
        raise bad("the name is not commits/v<10 digits>-e<6 digits>.json")
    if len(data) > MAX_COMMIT_BYTES:
        raise bad(f"{len(data)} bytes or more, over the limit of {MAX_COMMIT_BYTES}")
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
    except RecursionError:
        raise bad("JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: JSON syntax, ints over 4300 digits
        raise bad(f"not UTF-8 JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(raw, dict):
        raise bad(f"the JSON is {_show(raw)}, expected an object")
    try:
        if raw.get("format") not in (COMMIT_FORMAT, COMMIT_FORMAT_PARTS):
            raise ValueError(f"format is {_show(raw.get('format'))}, expected {COMMIT_FORMAT!r} or {COMMIT_FORMAT_PARTS!r}")
        version = _int(raw, "version", 0, MAX_VERSION)
        epoch = _int(raw, "epoch", 0, MAX_EPOCH)
        if (version, epoch) != name:
            raise ValueError(f"it says version {version} epoch {epoch}, which does not match its name")
        base = _int(raw, "base_version", 0, MAX_VERSION, optional=True)
        if base is not None and base >= version:  # type: ignore[operator]
            raise ValueError(f"base_version {base} is not below version {version}")
        created = raw.get("created_at")
        if type(created) not in (int, float) or not math.isfinite(created):
            raise ValueError(f"created_at is {_show(created)}, expected a finite number")
        delta = None if raw.get("delta") is None else _ref(raw["delta"], "delta", _DELTA_RE, version, base)  # type: ignore[arg-type]
        if delta is not None and base is None:
            raise ValueError("it has a delta but no base_version")
        parts = _parts(raw, version, base) if raw["format"] == COMMIT_FORMAT_PARTS else []
        if parts and delta is not None:
            raise ValueError("it has both a delta and parts")
        anchor_raw = raw.get("anchor") or []
        if not isinstance(anchor_raw, list) or len(anchor_raw) > _MAX_ANCHOR_FILES:
            raise ValueError(f"anchor is {_show(anchor_raw)}, expected a list of at most {_MAX_ANCHOR_FILES} objects")
        anchor = [_ref(o, "anchor file", _ANCHOR_FILE_RE, version, None) for o in anchor_raw]  # type: ignore[arg-type]
        _check_anchor_files(anchor)
        if anchor and any(u.rows is not None for p in parts for u in p.units):
            raise ValueError("it has an anchor beside parts with row ranges (allowed only when every unit is a whole tensor)")
        if delta is None and not parts and not anchor:
            raise ValueError("it names neither a delta nor an anchor")
        metrics = raw.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics is {_show(metrics)}, expected an object")
        for m in _NUMERIC_METRICS:
            if metrics.get(m) is not None and (type(metrics[m]) not in (int, float) or not math.isfinite(metrics[m])):
                raise ValueError(f"metrics.{m} is {_show(metrics[m])}, expected a finite number")
        if metrics.get("kind") is not None and not isinstance(metrics["kind"], str):
            raise ValueError(f"metrics.kind is {_show(metrics['kind'])}, expected a string")
        return CommitRecord(
            version=version, epoch=epoch, writer=_str(raw, "writer"), state_digest=_str(raw, "state_digest", _HEX),  # type: ignore[arg-type]
            created_at=float(created), delta=delta, base_version=base,
            base_state_digest=_str(raw, "base_state_digest", _HEX, optional=True),
            anchor=anchor, metrics=metrics, format=raw["format"], parts=parts,
            adapter=None if raw.get("adapter") is None else AdapterMeta.from_dict(raw["adapter"]),
            files=parse_files(raw.get("files"), version),  # type: ignore[arg-type]
        )
    except ValueError as e:
        raise bad(str(e)) from None


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
