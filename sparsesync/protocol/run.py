"""Reading a run: which versions are committed, how to reach one, and fetching verified objects.

`Run` is the one reader of a run's commits: `commits()` (every trusted version), `head()` /
`newest()` (the newest trusted commit, and the commit names above it that are refused),
`commit(version)`, `abandoned()` (what rewinds abandoned). The CLI and `transfer` read through it.

Guarantees: only committed versions (under the fencing rule of `keys.valid_commits`) are
ever returned; every object's bytes are checked against the size and xxh3 digest recorded in
its commit before anything parses them; `reconstruct` returns a state whose digest equals the
commit's `state_digest` or raises.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsesync.codec import Patch, apply_patch, load_anchor, read_patch, state_digest
from sparsesync.codec.anchor import Alloc
from sparsesync.codec.apply import SparseUpdate, Written
from sparsesync.codec.digest import bytes_digest, file_digest
from sparsesync.errors import (
    BrokenChainError,
    DigestMismatchError,
    MalformedCommitError,
    ObjectNotFoundError,
    PatchMismatchError,
    ProtocolError,
    RunNotFoundError,
    SparsesyncError,
    VersionNotFoundError,
)
from sparsesync.protocol.keys import COMMITS, Abandoned, abandoned_by_rewinds, valid_commits
from sparsesync.protocol.parts_reader import Prefetcher, apply_parts
from sparsesync.protocol.records import MAX_COMMIT_BYTES, CommitRecord, FileRef, ObjectRef
from sparsesync.store import Store, open_store

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Head:
    """The newest trusted commit of a run at one listing (`Run.head`)."""

    record: CommitRecord | None
    """The newest trusted commit record; None when the run has none (or every name's object is refused)."""
    refused: list[tuple[str, str]]
    """The commit names newer than `record` whose object is not a commit record, with the reason, newest first.
    Every reader passes over them."""


@dataclass(frozen=True)
class Step:
    """One step of a plan: load the anchor of `commit`, or apply its delta."""

    kind: str  # "anchor" | "delta" (the follower adds "reload": the engine gets its whole mirror)
    commit: CommitRecord


READ_CHUNK = 256 << 20  # a read sized by a record's claim asks for at most this many bytes at a time


def read_at_most(store: Store, key: str, limit: int) -> bytes:
    """The object's bytes, reading at most `limit + 1` of them (so a result longer than `limit`
    says the object is too large without allocating more than that). Reads of more than
    `READ_CHUNK` go chunk by chunk: memory follows the bytes the object really has, not the
    size a record claims."""
    if limit < READ_CHUNK:
        return store.get_range(key, 0, limit + 1)
    chunks: list[bytes] = []
    got = 0
    while got <= limit:
        want = min(READ_CHUNK, limit + 1 - got)
        data = store.get_range(key, got, want)
        chunks.append(data)
        got += len(data)
        if len(data) < want:
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Run:
    """A read view of the run rooted at a store. Commit records are cached (immutable)."""

    def __init__(self, store: Store | str) -> None:
        self.store = open_store(store) if isinstance(store, str) else store
        self._records: dict[str, CommitRecord] = {}
        # : commit-named objects of the last listing that are not commit records, with the reason (`log`/`verify` show
        # them)
        self.rejected: dict[str, str] = {}

    @property
    def url(self) -> str:
        return self.store.url

    # -- commits ----------------------------------------------------------------------
    def commits(self) -> list[CommitRecord]:
        """Every valid committed version, oldest first (a fresh listing each call).

        Fencing is decided on the names (`valid_commits`), counting only objects that are commit
        records: a name whose object is not one (see `CommitRecord.from_json`) fences nothing, is
        skipped, and its reason is kept in `rejected` (as long as a listing names it).
        """
        keys = [o.key for o in self.store.list(COMMITS)]
        listed = set(keys)  # a rejected name deleted since is no longer reported
        self.rejected = {k: r for k, r in self.rejected.items() if k in listed}
        return [rec for _v, _e, key in valid_commits(keys, self.is_commit) if (rec := self.record(key)) is not None]

    def record(self, key: str) -> CommitRecord | None:
        """The commit record at commit key `key` (read once, then cached); None for an object that
        is gone (gc raced us) or not a commit record (its reason kept in `rejected`). Other store
        errors raise: an unread record is never taken for a stray object."""
        if key in self._records or key in self.rejected:
            return self._records.get(key)
        try:
            rec = CommitRecord.from_json(read_at_most(self.store, key, MAX_COMMIT_BYTES), key)
        except ObjectNotFoundError:
            return None  # listed but gone: not committed any more
        except MalformedCommitError as e:
            self.rejected[key] = e.reason
            return None
        self._records[key] = rec
        return rec

    def is_commit(self, key: str) -> bool:
        """Whether the object at `key` is a commit record (`record`): what fences (`valid_commits`)."""
        return self.record(key) is not None

    def abandoned(self) -> list[Abandoned]:
        """The versions rewinds abandoned, per rewind (`keys.abandoned_by_rewinds`, counting only
        commit records), from a fresh listing."""
        return abandoned_by_rewinds([o.key for o in self.store.list(COMMITS)], self.is_commit)

    def head(self) -> Head:
        """The newest trusted commit and the refused names above it (`Head`), from a fresh listing.

        Reads records from the newest trusted name down, stopping at the first commit record
        (plus what fencing needs), not every record: the same commit as `commits()[-1]`. Names
        whose object is gone are passed over, as every reader does.
        """
        keys = [o.key for o in self.store.list(COMMITS)]
        listed = set(keys)
        self.rejected = {k: r for k, r in self.rejected.items() if k in listed}
        refused: list[tuple[str, str]] = []
        for _v, _e, key in reversed(valid_commits(keys, self.is_commit)):
            if (rec := self.record(key)) is not None:
                return Head(rec, refused)
            if key in self.rejected:
                refused.append((key, self.rejected[key]))
        return Head(None, refused)

    def newest(self) -> CommitRecord | None:
        """The newest trusted commit record (`head().record`); None for a run without one."""
        return self.head().record

    def commit(self, version: int | None, commits: list[CommitRecord] | None = None) -> CommitRecord:
        """The commit of `version` (newest when None); raises RunNotFound/VersionNotFound."""
        commits = self.commits() if commits is None else commits
        if not commits:
            raise RunNotFoundError(
                f"no committed version under {self.url}",
                hint="check the URL, or publish a first version with `sparsesync push`",
            )
        if version is None:
            return commits[-1]
        for rec in commits:
            if rec.version == version:
                return rec
        have = ", ".join(str(c.version) for c in commits[-5:])
        raise VersionNotFoundError(
            f"version {version} is not committed under {self.url} (newest: {have}){self._abandoned_note(version)}",
            hint="run `sparsesync log URL` to list committed versions",
        )

    def _abandoned_note(self, version: int) -> str:
        """'; version V of epoch E was abandoned by the rewind to ...' when `version` was abandoned, else ''."""
        try:
            abandoned = self.abandoned()
        except SparsesyncError:
            return ""
        for a in abandoned:
            if version in a.versions:
                return (
                    f"; version {version} of epoch {a.epoch} was abandoned by the rewind to version {a.version} (epoch "
                    f"{a.by_epoch})"
                )
        return ""

    # -- planning ---------------------------------------------------------------------
    def plan(
        self,
        target: CommitRecord,
        commits: list[CommitRecord],
        *,
        current: int | None = None,
        avoid: Iterable[str] = (),
    ) -> list[Step]:
        """Steps that bring a holder of `current` (None: nothing) to `target`.

        Prefers the delta chain from `current`; otherwise the newest anchor at or before the
        target from which a delta chain reaches it. Objects whose keys are in `avoid` (known
        bad) are never used. Raises BrokenChainError when no path exists.
        """
        bad = set(avoid)
        if current is not None:
            if current == target.version:
                return []
            chain = self.chain(current, target.version, commits, bad)
            if chain is not None:
                return chain
        for rec in reversed(commits):
            if rec.version > target.version or not rec.has_anchor:
                continue
            if any(o.key in bad for o in rec.anchor):
                continue
            chain = self.chain(rec.version, target.version, commits, bad)
            if chain is not None:
                return [Step("anchor", rec), *chain]
        skipped = sorted(bad)
        avoided = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        raise BrokenChainError(
            f"no anchor plus delta chain reaches version {target.version} under {self.url}"
            + (f" from version {current}" if current is not None else "")
            + (f" avoiding the objects that failed their checks ({avoided})" if skipped else ""),
            hint="the trainer must publish a new anchor (restart it, or `sparsesync push` a full checkpoint)",
        )

    @staticmethod
    def chain(start: int, target: int, commits: list[CommitRecord], bad: set[str]) -> list[Step] | None:
        """The delta steps from version `start` to `target`, or None when the chain is broken.

        Cannot loop: only deltas that go forward are followed (records whose base is not below
        their version are ignored here too, not only by the record's parser), so every step goes
        to a strictly higher version.
        """
        by_base: dict[int, list[CommitRecord]] = {}
        for rec in commits:
            if (rec.has_delta and not any(o.key in bad for o in rec.delta_objects()) and rec.base_version is not None
                    and rec.base_version < rec.version <= target):
                by_base.setdefault(rec.base_version, []).append(rec)
        steps: list[Step] = []
        cur = start
        while cur != target:
            nxt = by_base.get(cur)
            if not nxt:
                return None
            rec = max(nxt, key=lambda r: r.version)  # a coalesced delta skips ahead
            steps.append(Step("delta", rec))
            cur = rec.version
        return steps

    # -- objects ----------------------------------------------------------------------
    def fetch(self, ref: ObjectRef | FileRef) -> bytes:
        """The object's bytes, checked against the size and digest its commit recorded (reading
        at most one byte more than the recorded size)."""
        data = read_at_most(self.store, ref.key, ref.size)
        if len(data) != ref.size or bytes_digest(data) != ref.xxh3:
            raise DigestMismatchError(
                f"object {self.store.object_url(ref.key)} has {len(data)}{'+' if len(data) > ref.size else ''} bytes "
                "with digest "
                f"{bytes_digest(data)}, expected {ref.size} bytes with digest {ref.xxh3}",
                hint="the stored object is corrupt; followers fall back to an anchor",
            )
        return data

    def fetch_anchor(self, rec: CommitRecord, workdir: Path | None = None, *, alloc: Alloc | None = None,
                     written: Written | None = None) -> tuple[State, dict[str, str]]:
        """Download (into a temporary folder in `workdir`), verify and load the anchor of `rec`:
        (state, per-tensor digests). `alloc`: where the tensors go, `written`: told of each once
        loaded (`codec.anchor.load_anchor`)."""
        with tempfile.TemporaryDirectory(dir=workdir, prefix="sparsesync-anchor-") as tmp:
            # shards and, when sharded, the index
            state, info = load_anchor(self.download_anchor(rec, Path(tmp)), alloc=alloc, written=written)
        self.check_anchor(rec, info.version, info.state_digest)
        return state, dict(info.digests)

    def download_anchor(self, rec: CommitRecord, folder: Path) -> list[Path]:
        """The anchor files of `rec`, downloaded into `folder`, each checked against the size and
        digest its commit records (DigestMismatchError)."""
        items = [(ref.key, folder / Path(ref.key).name) for ref in rec.anchor]
        self.store.get_many(items)
        for ref, (_key, path) in zip(rec.anchor, items, strict=True):
            size = path.stat().st_size
            if size != ref.size or file_digest(path) != ref.xxh3:
                raise DigestMismatchError(
                    f"anchor file {self.store.object_url(ref.key)} is corrupt "
                    f"({size} bytes, expected {ref.size} with digest {ref.xxh3})",
                    hint="the stored anchor is damaged; publish a new anchor",
                )
        return [p for _k, p in items]

    def check_anchor(self, rec: CommitRecord, info_version: int, info_state: str) -> None:
        """DigestMismatchError unless the anchor loaded holds `rec`'s version and state digest."""
        if info_version != rec.version or info_state != rec.state_digest:
            raise DigestMismatchError(
                f"anchor of version {rec.version} under {self.url} holds version {info_version} "
                f"with state digest {info_state}, expected {rec.state_digest}"
            )

    def load_delta(self, rec: CommitRecord, digests: Mapping[str, str]) -> Patch:
        """Fetch and check the delta of `rec` for a holder whose tensors have `digests`.

        Checks the object's bytes, the patch structure, that the patch is the one the commit
        names, and that it applies to the held state. Writes nothing.
        """
        assert rec.delta is not None
        patch = read_patch(self.fetch(rec.delta))
        h = patch.header
        if (h.base_version, h.target_version) != (rec.base_version, rec.version) or (
            h.target_state_digest != rec.state_digest
        ):
            raise ProtocolError(
                f"delta {rec.delta.key} takes {h.base_version}->{h.target_version} "
                f"(state {h.target_state_digest}), but its commit says "
                f"{rec.base_version}->{rec.version} (state {rec.state_digest})"
            )
        held = state_digest(digests)
        if held != h.base_state_digest:
            raise PatchMismatchError(
                f"delta {rec.delta.key} applies to state {h.base_state_digest}, but the weights held are {held}",
                hint="the holder is not at the delta's base version; reload from an anchor",
            )
        return patch

    @staticmethod
    def apply_loaded(rec: CommitRecord, patch: Patch, state: State, digests: dict[str, str], *,
                     written: Written | None = None) -> dict[str, SparseUpdate]:
        """Apply a checked delta to `state` in place and update `digests` (`written`: see `codec.apply_patch`).

        All or nothing: the state digest the patch's target digests give is checked against the
        commit before anything is written, and the codec checks every written tensor against its
        target digest, restoring every old bit on any failure (`apply_patch`). So on any error
        `state` and `digests` are as they were.
        """
        after = {**digests, **{name: e.target_digest for name, e in patch.header.tensors.items()}}
        if state_digest(after) != rec.state_digest:
            raise DigestMismatchError(
                f"delta {rec.delta.key if rec.delta else rec.version} would give state digest {state_digest(after)}, "
                f"but version {rec.version}'s commit says {rec.state_digest} (nothing written)",
                hint="the patch does not produce the committed version; reload from an anchor",
            )
        # `state` matches `digests` (verified when it was loaded or last patched), and the
        # target digests are verified after writing: hashing the base again would add nothing
        updates = apply_patch(patch, state, verify=True, check_base_digest=False, written=written)
        digests.update(after)
        return updates

    def apply_delta(
        self,
        rec: CommitRecord,
        state: State,
        digests: dict[str, str],
        prefetched: Prefetcher | None = None,
        *,
        written: Written | None = None,
    ) -> dict[str, SparseUpdate]:
        """Fetch, check and apply the delta of `rec` (one file or parts) to `state` in place,
        updating `digests`. All or nothing, one file (`apply_loaded`) or parts
        (`parts_reader.apply_parts`; `prefetched`: a `parts_reader.Prefetcher`). `written`: see
        `codec.apply_patch`."""
        if rec.parts:
            return apply_parts(self.fetch, rec, state, digests, prefetched=prefetched, written=written)
        return self.apply_loaded(rec, self.load_delta(rec, digests), state, digests, written=written)

    def reconstruct(
        self,
        version: int | None = None,
        *,
        on_step: Callable[[Step], None] | None = None,
    ) -> tuple[CommitRecord, State, dict[str, str]]:
        """Materialize a committed version (newest when None), bit-exact and verified."""
        commits = self.commits()
        target = self.commit(version, commits)
        state: State = {}
        digests: dict[str, str] = {}
        for step in self.plan(target, commits):
            if on_step:
                on_step(step)
            if step.kind == "anchor":
                state, digests = self.fetch_anchor(step.commit)
            else:
                self.apply_delta(step.commit, state, digests)
        return target, state, digests
