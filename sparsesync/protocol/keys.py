"""Every object key of a run: how each is built and parsed (docs/protocol.md, "Layout").

A run is everything under one URL prefix:

    writers/e000003.lock                               epoch 3 reserved (create-only, where the store has it)
    writers/e000003-<writer>.json                      a writer's claim of epoch 3
    anchors/v0000000040-e000003-<uid>/model*.safetensors   full snapshot of version 40 (shards + index)
    deltas/v0000000040-v0000000041-e000003-<uid>.safetensors  patch 40 -> 41
    deltas/v0000000040-v0000000041-e000003-<uid>-p00002.safetensors  part 2 of patch 40 -> 41 (format 2)
    files/v0000000041-e000003-<uid>/tokenizer.json     a checkpoint file that is not weights
    commits/v0000000041-e000003.json                   commit record of version 41, written last
    fleet/<replica>.json                               a replica's heartbeat (overwritten in place)
    switches/v0000000041.json                          "switch to version 41 at apply_at", written once

Guarantees: a key built from values the names can carry (versions of 10 digits, epochs of 6,
hex uids, ids of `[A-Za-z0-9_.-]`) parses back (`parse_*`) to those values. Every object name of
a writer is unique (epoch + random uid), so nothing but a heartbeat is ever overwritten. The
names sort by version. Parsing is strict and total: a key that does not match gives None, never
an exception; readers ignore such keys and `gc` treats them as garbage. What an object holds is
`records.py`'s concern; this module only names things.
"""

from __future__ import annotations

import bisect
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparsesync.errors import ConfigError

WRITERS = "writers/"
ANCHORS = "anchors/"
DELTAS = "deltas/"
COMMITS = "commits/"
FILES = "files/"
FLEET = "fleet/"
SWITCHES = "switches/"
MAX_VERSION = 10**10 - 1  # the widest version a commit name can carry (10 digits)
MAX_EPOCH = 10**6 - 1  # the widest epoch a name can carry (6 digits)
REPLICA_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")

_COMMIT_RE = re.compile(r"^commits/v([0-9]{10})-e([0-9]{6})\.json\Z")
_LOCK_RE = re.compile(r"^writers/e([0-9]{6})\.lock\Z")
_WRITER_RE = re.compile(r"^writers/e([0-9]{6})-([A-Za-z0-9_.-]+)\.json\Z")
_DELTA_RE = re.compile(r"^deltas/v([0-9]{10})-v([0-9]{10})-e([0-9]{6})-[0-9a-f]+\.safetensors\Z")
_PART_RE = re.compile(r"^deltas/v([0-9]{10})-v([0-9]{10})-e([0-9]{6})-[0-9a-f]+-p([0-9]{5})\.safetensors\Z")
_ANCHOR_RE = re.compile(r"^anchors/v([0-9]{10})-e([0-9]{6})-[0-9a-f]+/")
_ANCHOR_FILE_RE = re.compile(
    r"^anchors/v([0-9]{10})-e[0-9]{6}-[0-9a-f]+/"
    r"(model\.safetensors|model-[0-9]{5}-of-[0-9]{5}\.safetensors|model\.safetensors\.index\.json)\Z"
)
_SHARD_NAME_RE = re.compile(r"^model-([0-9]{5})-of-([0-9]{5})\.safetensors\Z")
_FILE_KEY_RE = re.compile(r"^files/v([0-9]{10})-e([0-9]{6})-[0-9a-f]+/([^/]+)\Z")
_HEARTBEAT_RE = re.compile(r"^fleet/([A-Za-z0-9_.-]{1,64})\.json\Z")
# -e: a version committed again after a rewind
_SWITCH_RE = re.compile(r"^switches/v([0-9]{10})(?:-e[0-9]{6})?\.json\Z")


# ------------------------------------------------------------------------------ builders
def new_uid() -> str:
    """A random id that makes an object name unique across writers and retries."""
    return uuid.uuid4().hex[:12]


def epoch_lock_key(epoch: int) -> str:
    """The create-only object that reserves `epoch` for one writer (stores with create-only writes)."""
    return f"{WRITERS}e{epoch:06d}.lock"


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


def file_key(version: int, epoch: int, uid: str, name: str) -> str:
    return f"{FILES}v{version:010d}-e{epoch:06d}-{uid}/{name}"


def heartbeat_key(replica_id: str) -> str:
    return f"{FLEET}{replica_id}.json"


def switch_key(version: int) -> str:
    return f"{SWITCHES}v{version:010d}.json"


def epoch_switch_key(version: int, epoch: int) -> str:
    """The switch record of `version` as committed again by `epoch` after a rewind
    (`protocol.fleet.switch_for`; docs/protocol.md, "Rewinds")."""
    return f"{SWITCHES}v{version:010d}-e{epoch:06d}.json"


def check_version(version: object, url: str) -> int:
    """`version` if it is an integer a commit name can carry; ConfigError before anything is written."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ConfigError(
            f"version {version!r} for {url} is not an integer in [0, {MAX_VERSION}] (commit names carry 10 digits)",
            hint="pass a smaller step, e.g. the optimizer step count",
        )
    return version


# ------------------------------------------------------------------------------ parsers
def parse_commit_key(key: str) -> tuple[int, int] | None:
    """(version, epoch) of a commit-record key, or None if `key` is not one."""
    m = _COMMIT_RE.match(key)
    return (int(m[1]), int(m[2])) if m else None


def parse_epoch_lock_key(key: str) -> int | None:
    """The epoch an epoch-lock key reserves, or None."""
    m = _LOCK_RE.match(key)
    return int(m[1]) if m else None


def parse_writer_key(key: str) -> tuple[int, str] | None:
    """(epoch, writer id) of a writer-claim key, or None."""
    m = _WRITER_RE.match(key)
    return (int(m[1]), m[2]) if m else None


def parse_delta_key(key: str) -> tuple[int, int, int] | None:
    """(base, target, epoch) of a one-file delta's key, or None."""
    m = _DELTA_RE.match(key)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def parse_part_key(key: str) -> tuple[int, int, int, int] | None:
    """(base, target, epoch, index) of a part object's key, or None."""
    m = _PART_RE.match(key)
    return (int(m[1]), int(m[2]), int(m[3]), int(m[4])) if m else None


def parse_anchor_file_key(key: str) -> tuple[int, str] | None:
    """(version, file name) of an anchor file a commit may name (`model.safetensors`, a shard
    `model-0000k-of-0000n.safetensors` or the index), or None."""
    m = _ANCHOR_FILE_RE.match(key)
    return (int(m[1]), m[2]) if m else None


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """(k, n) of a shard file name `model-0000k-of-0000n.safetensors`, or None."""
    m = _SHARD_NAME_RE.match(name)
    return (int(m[1]), int(m[2])) if m else None


def parse_file_key(key: str) -> tuple[int, int, str] | None:
    """(version, epoch, name) of a checkpoint-file object's key, or None."""
    m = _FILE_KEY_RE.match(key)
    return (int(m[1]), int(m[2]), m[3]) if m else None


def file_version(key: str) -> int | None:
    """The version that first stored a checkpoint-file object (in its name), or None."""
    parsed = parse_file_key(key)
    return parsed[0] if parsed else None


def parse_heartbeat_key(key: str) -> str | None:
    """The replica id of a heartbeat key (`fleet/<replica-id>.json`), or None."""
    m = _HEARTBEAT_RE.match(key)
    return m[1] if m else None


def parse_switch_key(key: str) -> int | None:
    """The version of a switch-record key, or None."""
    m = _SWITCH_RE.match(key)
    return int(m[1]) if m else None


def object_version(key: str) -> int | None:
    """The version an anchor or delta object belongs to (its target), or None."""
    if m := _DELTA_RE.match(key) or _PART_RE.match(key):
        return int(m[2])
    if m := _ANCHOR_RE.match(key):
        return int(m[1])
    return None


def valid_commits(keys: Iterable[str], is_commit: Callable[[str], bool] | None = None) -> list[tuple[int, int, str]]:
    """The commit keys readers trust, as sorted (version, epoch, key).

    Fencing rule: a commit (v, e) is trusted iff no commit (v', e') exists with e' > e and
    v' <= v. Once a newer writer has committed anything, an older writer's later commits are
    ignored, even if it had not yet noticed that it was fenced.

    Only a commit fences: `is_commit(key)` says whether the object is a commit record
    (`CommitRecord.from_json` accepts it, name and content agreeing), so a stray object named like
    a newer epoch's commit fences nothing and rolls no reader back. It is asked at most once per
    key, newest epoch first, and only of a key the rule trusts whose being a commit decides
    another's trust (an older epoch committed its version or a higher one); every other key is
    returned unasked, and the reader, which reads each record it uses, passes over those that
    are not commits. None takes every well-formed name for a commit. O(n log n) in the names.
    """
    by_epoch: dict[int, list[tuple[int, str]]] = {}
    for k in set(keys):
        if (p := parse_commit_key(k)) is not None:
            by_epoch.setdefault(p[1], []).append((p[0], k))
    epochs = sorted(by_epoch)
    below: dict[int, int] = {}  # epoch -> the highest version any older epoch committed (-1: none)
    highest = -1
    for e in epochs:
        below[e] = highest
        highest = max(highest, max(v for v, _k in by_epoch[e]))
    out: list[tuple[int, int, str]] = []
    floor = MAX_VERSION + 1  # the lowest version a commit of a newer epoch than the one at hand holds
    for e in reversed(epochs):
        lowest = floor
        for v, k in by_epoch[e]:
            if v >= floor:
                continue  # fenced
            if v <= below[e] and is_commit is not None and not is_commit(k):
                continue  # not a commit: it fences nothing (and is not trusted)
            out.append((v, e, k))
            lowest = min(lowest, v)
        floor = lowest
    out.sort()
    return out


# ------------------------------------------------------------------------------ rewinds
@dataclass(frozen=True)
class Abandoned:
    """Versions of `epoch` that the rewind commit `(version, by_epoch)` made untrusted."""

    versions: tuple[int, ...]
    epoch: int
    version: int  # the rewind commit's version
    by_epoch: int


def abandoned_by_rewinds(keys: Iterable[str], is_commit: Callable[[str], bool] | None = None) -> list[Abandoned]:
    """From the names of `commits/`: for each untrusted commit, the trusted commit of a newer epoch
    at or below its version that overrules it (the first such), grouped per (epoch, rewind).
    `is_commit` as in `valid_commits` (a name that is not a commit abandons nothing)."""
    keys = set(keys)
    valid = valid_commits(keys, is_commit)
    trusted = {k for _v, _e, k in valid}
    # trusted commits hold one version each, and their epochs never fall as versions rise (a lower
    # version of a higher epoch would fence the higher version): the first trusted commit of an
    # epoch above e is the first one of that epoch or newer, found by bisection
    epochs = [te for _tv, te, _k in valid]
    groups: dict[tuple[int, int, int], list[int]] = {}
    for v, e in sorted(p for k in keys if (p := parse_commit_key(k)) and k not in trusted):
        i = bisect.bisect_right(epochs, e)
        if i < len(valid) and valid[i][0] <= v:
            groups.setdefault((e, valid[i][0], valid[i][1]), []).append(v)
    return [Abandoned(tuple(vs), e, bv, be) for (e, bv, be), vs in sorted(groups.items())]
