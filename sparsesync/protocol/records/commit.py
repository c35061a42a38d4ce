"""The writer's records: the commit record with its fields, and the writer claim (docs/protocol.md).

    commits/v{version}-e{epoch}.json    CommitRecord (ObjectRef, PartRef + Unit, FileRef, AdapterMeta)
    writers/e{epoch}-{writer}.json      WriterClaim

Guarantees: `to_json()` gives the bytes every earlier sparsesync wrote, byte for byte (format 1
records stay format 1: no `parts`, and no `adapter` or `files` when there are none).
`CommitRecord.from_json` is the one schema parser every reader uses: anything but a record
within the schema of docs/protocol.md ("Commit record", "Versions in parts", "Checkpoint
files", "LoRA adapter runs") raises `MalformedCommitError` naming the record, with a one-line
reason naming the field. It is bounded: the record's size is capped before parsing and the
parse is linear in its size (plus a sort of each tensor's row ranges).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sparsesync.errors import MalformedCommitError
from sparsesync.lora.config import check_config
from sparsesync.lora.meta import ADAPTER_DTYPES, AdapterMeta
from sparsesync.protocol import keys
from sparsesync.protocol.records.fields import Fields, check_list, load_object, show
from sparsesync.protocol.records.metrics import CommitKind, CommitMetrics

COMMIT_FORMAT = "sparsesync-commit/1"
COMMIT_FORMAT_PARTS = "sparsesync-commit/2"  # a version in parts (docs/protocol.md, "Versions in parts")
MAX_COMMIT_BYTES = 64 << 20  # a commit record larger than this is refused (hostile bucket)
# 1 TiB: no object of a run is larger (anchor shards are at most 5 GiB, parts about `part_bytes`);
# a record saying more is not a commit, so no reader ever sizes a read by it
MAX_OBJECT_BYTES = 1 << 40
# the checkpoint files a run carries (`protocol.extras`): only these names, within these bounds
FILE_NAMES = frozenset({
    "config.json", "generation_config.json",  # the model (full-weight runs only)
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
})
MAX_FILES = 32
MAX_FILE_BYTES = 64 << 20  # a large tokenizer.json is ~35 MB
MAX_TOTAL_BYTES = 128 << 20
_NUMERIC_METRICS = ("n_changed", "n_params", "density", "patch_bytes", "anchor_bytes", "diff_s", "encode_s",
                    "upload_s", "snapshot_s", "anchor_write_s", "bytes_per_changed")
_MAX_ANCHOR_FILES = 10_000
_MAX_PARTS = 100_000
_MAX_UNITS = 1_000_000
_MAX_ROWS = 1 << 50  # a unit's rows end below this
_INDEX_NAME = "model.safetensors.index.json"
MAX_CLAIM_BYTES = 16 << 10


# ------------------------------------------------------------------------------ a commit's fields
_REF_FIELDS = ("key", "size", "xxh3")


@dataclass(frozen=True)
class ObjectRef:
    """An object a commit depends on, with the digest of its bytes (xxh3_64 hex)."""

    key: str
    size: int
    xxh3: str

    @classmethod
    def read(cls, f: Fields, kind: str, names: tuple[int, ...] | None) -> ObjectRef:
        """The ref in `f`, whose key must be a `kind` ("delta", "delta part", "anchor") object of
        the versions `names` ((base, version) for deltas, (version,) for anchors)."""
        key = f.text("key", max_len=1024)
        parsed = {"delta": keys.parse_delta_key, "delta part": keys.parse_part_key,
                  "anchor": keys.parse_anchor_file_key}[kind](key)
        if parsed is None:
            raise ValueError(f"{f.where}key {key!r} is not a {kind.split()[0]} object name")
        got = parsed[:1] if kind == "anchor" else parsed[:2]
        if got != names:
            raise ValueError(f"{f.where}key {key!r} names versions {got}, not this commit's")
        return cls(key=key, size=f.integer("size", 0, MAX_OBJECT_BYTES), xxh3=f.digest("xxh3"))


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

    @classmethod
    def from_json(cls, raw: Any, path: str) -> Unit:
        ok = isinstance(raw, list) and len(raw) in (1, 3) and isinstance(raw[0], str) and 0 < len(raw[0]) <= 1024
        if ok and len(raw) == 3:
            ok = all(type(x) is int for x in raw[1:]) and 0 <= raw[1] < raw[2] <= _MAX_ROWS
        if not ok:
            raise ValueError(f"{path} is {show(raw)}, expected [name] or [name, start, stop] with 0 <= start < stop")
        return cls(raw[0], None if len(raw) == 1 else (raw[1], raw[2]))


@dataclass(frozen=True)
class PartRef(ObjectRef):
    """One part of a version: a patch object over `units`, with the state digests of those units
    before and after (digests over `Unit.key` names, as the part's patch header says)."""

    base_state_digest: str = ""
    state_digest: str = ""
    units: tuple[Unit, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "xxh3": self.xxh3, "base_state_digest": self.base_state_digest,
                "state_digest": self.state_digest, "units": [u.to_json() for u in self.units]}


@dataclass(frozen=True)
class FileRef:
    """A checkpoint file of a version: written to DEST as `name`, stored at `key` (`extras.py`)."""

    name: str
    key: str
    size: int
    xxh3: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "size": self.size, "xxh3": self.xxh3}

    @classmethod
    def read(cls, f: Fields, version: int) -> FileRef:
        """A `files` entry of a commit of `version`: a name sparsesync carries, stored under
        `files/` by this version or an earlier one."""
        name = f.text("name", max_len=1024)
        if name not in FILE_NAMES:
            raise ValueError(f"{f.where}name {name[:80]!r} is not a checkpoint file name sparsesync carries "
                             f"({', '.join(sorted(FILE_NAMES)[:4])}, ...)")
        key = f.text("key", max_len=1024)
        parsed = keys.parse_file_key(key)
        if parsed is None or parsed[2] != name or parsed[0] > version:
            raise ValueError(f"{f.where}key {key[:120]!r} is not files/v<version <= {version}>-e<epoch>-<uid>/{name}")
        return cls(name, key, f.integer("size", 0, MAX_FILE_BYTES), f.digest("xxh3"))


def read_adapter(raw: Any) -> AdapterMeta:
    """A commit's `adapter` field (`sparsesync.lora.meta.AdapterMeta`); ValueError with a one-line
    reason on anything else."""
    f = Fields(raw, "adapter.", exactly=("base_model", "base_digest", "config", "dtype"))
    dtype = f.choice("dtype", ADAPTER_DTYPES)
    base, digest = f.text("base_model", max_len=1024), f.digest("base_digest", tensors=True)
    check_config(f.get("config"), "adapter.config")
    return AdapterMeta(base, digest, f.get("config"), dtype)


# ------------------------------------------------------------------------------ the commit record
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
    adapter: AdapterMeta | None = None  # set in LoRA adapter runs (sparsesync.lora)
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

    @property
    def stats(self) -> CommitMetrics:
        """`metrics`, typed (`records.metrics.CommitMetrics`: the kind, sizes, timings, what a rewind abandoned)."""
        return CommitMetrics.of(self.metrics)

    @property
    def kind(self) -> CommitKind | None:
        """anchor, delta, delta+anchor or rewind (None: the record names none this release writes)."""
        return self.stats.kind

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
            raw["parts"] = [p.to_json() for p in self.parts]
        else:  # format 1, byte for byte what readers of format 1 know
            raw.pop("parts")
            raw["format"] = COMMIT_FORMAT
        return json.dumps(raw, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> CommitRecord:
        """Parse a commit record against the schema (docs/protocol.md); anything else raises
        `MalformedCommitError` with a one-line reason naming `key`."""
        name = keys.parse_commit_key(key)
        if name is None:
            raise MalformedCommitError(key, "the name is not commits/v<10 digits>-e<6 digits>.json")
        try:
            return _parse_commit(Fields(load_object(data, MAX_COMMIT_BYTES)), name)
        except ValueError as e:
            raise MalformedCommitError(key, str(e)) from None


def _parse_commit(f: Fields, name: tuple[int, int]) -> CommitRecord:
    fmt = f.choice("format", (COMMIT_FORMAT, COMMIT_FORMAT_PARTS))
    version = f.integer("version", 0, keys.MAX_VERSION)
    epoch = f.integer("epoch", 0, keys.MAX_EPOCH)
    if (version, epoch) != name:
        raise ValueError(f"it says version {version} epoch {epoch}, which does not match its name")
    base = f.integer("base_version", 0, keys.MAX_VERSION, optional=True)
    if base is not None and base >= version:
        raise ValueError(f"base_version {base} is not below version {version}")
    created = f.number("created_at")
    delta = None
    if f.get("delta") is not None:
        delta = ObjectRef.read(f.sub("delta", exactly=_REF_FIELDS), "delta", (base, version))
        if base is None:
            raise ValueError("it has a delta but no base_version")
    parts = _parts(f, version, base) if fmt == COMMIT_FORMAT_PARTS else []
    if parts and delta is not None:
        raise ValueError("it has both a delta and parts")
    anchor_raw = check_list(f.get("anchor") or [], "anchor", _MAX_ANCHOR_FILES)
    anchor = [ObjectRef.read(Fields(o, f"anchor[{i}].", exactly=_REF_FIELDS), "anchor", (version,))
              for i, o in enumerate(anchor_raw)]
    _check_anchor_files(anchor)
    if anchor and any(u.rows is not None for p in parts for u in p.units):
        raise ValueError(
            "it has an anchor beside parts with row ranges (allowed only when every unit is a whole tensor)"
        )
    if delta is None and not parts and not anchor:
        raise ValueError("it names neither a delta nor an anchor")
    metrics = Fields(f.get("metrics") or {}, "metrics.")
    for m in _NUMERIC_METRICS:
        metrics.number(m, optional=True)
    metrics.text("kind", optional=True, max_len=MAX_COMMIT_BYTES)
    return CommitRecord(
        version=version,
        epoch=epoch,
        writer=f.text("writer"),
        state_digest=f.digest("state_digest", tensors=True),
        created_at=created,
        delta=delta,
        base_version=base,
        base_state_digest=f.digest("base_state_digest", optional=True, tensors=True),
        anchor=anchor,
        metrics=metrics.raw,
        format=fmt,
        parts=parts,
        adapter=None if f.get("adapter") is None else read_adapter(f.get("adapter")),
        files=_files(f.get("files"), version),
    )


def _parts(f: Fields, version: int, base: int | None) -> list[PartRef]:
    """The `parts` of a format-2 record: at least one; every part names a part object of
    base -> version, its digests and its units; no unit twice, no two units of a tensor overlap.
    Linear in the number of units (plus a sort of each tensor's row ranges)."""
    plist = check_list(f.get("parts"), "parts", _MAX_PARTS, lo=1)
    if base is None:
        raise ValueError("it has parts but no base_version")
    out: list[PartRef] = []
    n_units = 0
    rows: dict[str, list[tuple[int, int, int]]] = {}  # tensor -> (start, stop, part index) of each unit
    for i, raw in enumerate(plist):
        p = Fields(raw, f"parts[{i}].", exactly=(*_REF_FIELDS, "base_state_digest", "state_digest", "units"))
        ref = ObjectRef.read(p, "delta part", (base, version))
        ulist = p.get("units")
        n_units += len(ulist) if isinstance(ulist, list) else 0
        if not isinstance(ulist, list) or not ulist or n_units > _MAX_UNITS:
            raise ValueError(
                f"parts[{i}].units is {show(ulist)}, expected a non-empty list (at most {_MAX_UNITS} in all)"
            )
        units = tuple(Unit.from_json(u, f"parts[{i}].units[{j}]") for j, u in enumerate(ulist))
        for u in units:
            start, stop = u.rows or (0, _MAX_ROWS + 1)
            rows.setdefault(u.name, []).append((start, stop, i))
        out.append(
            PartRef(
                key=ref.key,
                size=ref.size,
                xxh3=ref.xxh3,
                base_state_digest=p.digest("base_state_digest", tensors=True),
                state_digest=p.digest("state_digest", tensors=True),
                units=units,
            )
        )
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
    shards = sorted(s for n in names if (s := keys.parse_shard_name(n)))
    n = len(shards)
    if _INDEX_NAME not in names or n + 1 != len(names) or shards != [(k, n) for k in range(1, n + 1)]:
        raise ValueError(
            f"anchor files {sorted(names)[:4]}{'...' if len(names) > 4 else ''} are neither model.safetensors "
            "alone nor shards model-0000k-of-0000n.safetensors (k = 1..n) with model.safetensors.index.json"
        )


def _files(raw: Any, version: int) -> list[FileRef]:
    """The `files` field of a commit record of `version` (absent: none), within the bounds above."""
    if raw is None:
        return []
    out = [FileRef.read(Fields(x, f"files[{i}].", exactly=("name", "key", "size", "xxh3")), version)
           for i, x in enumerate(check_list(raw, "files", MAX_FILES))]
    if len({f.name for f in out}) != len(out):
        raise ValueError("files lists one name twice")
    if sum(f.size for f in out) > MAX_TOTAL_BYTES:
        raise ValueError(f"files hold more than {MAX_TOTAL_BYTES} bytes in all")
    return out


# ------------------------------------------------------------------------------ the writer claim
@dataclass(frozen=True)
class WriterClaim:
    """`writers/e{epoch}-{writer}.json`: a writer's claim of `epoch`, written at `at` (its unix
    time). Readers fence by the claims' names (`keys.parse_writer_key`); the body is for people."""

    epoch: int
    writer: str
    at: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "writer": self.writer, "at": self.at}).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> WriterClaim:
        """Parse a claim; ValueError with a one-line reason unless it matches its name `key`."""
        f = Fields(load_object(data, MAX_CLAIM_BYTES))
        claim = cls(f.integer("epoch", 0, keys.MAX_EPOCH), f.text("writer"), f.number("at"))
        if keys.parse_writer_key(key) != (claim.epoch, claim.writer):
            raise ValueError(f"epoch {claim.epoch} writer {claim.writer!r} does not match the claim's name")
        return claim
