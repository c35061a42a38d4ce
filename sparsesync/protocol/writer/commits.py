"""The commit writer: a writer epoch claimed once, every object of a version stored under it,
and the commit record written last, fenced and confirmed visible.

Fencing: each writer claims a writer epoch (one higher than any seen; reserved with a
create-only write where the store has one, so no two writers share an epoch there) when it
starts, and re-lists the claims before every commit; when a newer claim exists (ordered by
epoch, then writer id) it stops with FencedWriterError. The epoch is one above every epoch seen
in claims, locks *and* commit names (a run copied without `writers/` still fences its old
commits correctly). After writing a commit record it lists `commits/` again and checks that
readers trust it as the newest version; if a commit of a newer epoch overrules it,
FencedWriterError names the version readers see, so a commit nobody can read is never reported
as published. Epochs that do not fit the object names (6 digits) are refused before anything
is written.

Checkpoint files (`CheckpointFiles`): the non-weight files a commit carries are stored once per
writer (and again when they change), then referenced by every commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from sparsesync.codec.digest import bytes_digest, file_digest
from sparsesync.errors import FencedWriterError, ObjectNotFoundError, ProtocolError, StoreUnavailableError
from sparsesync.protocol.extras import MODEL_FILES
from sparsesync.protocol.keys import (
    COMMITS,
    MAX_EPOCH,
    WRITERS,
    anchor_prefix,
    commit_key,
    delta_key,
    epoch_lock_key,
    file_key,
    parse_commit_key,
    parse_epoch_lock_key,
    parse_writer_key,
    part_key,
    valid_commits,
    writer_key,
)
from sparsesync.protocol.records import (
    MAX_CLAIM_BYTES,
    MAX_COMMIT_BYTES,
    CommitRecord,
    FileRef,
    ObjectRef,
    PartRef,
    WriterClaim,
)
from sparsesync.protocol.run import Run, read_at_most
from sparsesync.protocol.writer.parts import EncodedPart
from sparsesync.store import Store

CLAIM_TRIES = 100  # epochs tried before giving up on a run that other writers keep claiming

log = logging.getLogger(__name__)


class CommitWriter:
    """One writer of the run in `store`, as `writer` of `epoch` (0 until `claim`; a sharded
    writer's ranks learn rank 0's epoch and writer id and set them here)."""

    def __init__(self, store: Store, writer: str, epoch: int = 0) -> None:
        self.store = store
        self.writer = writer
        self.epoch = epoch
        self._claim_checked: dict[str, bool] = {}  # claim-named keys read: whether each is a claim record

    # -- the epoch ------------------------------------------------------------------------
    def claims(self) -> tuple[list[tuple[int, str]], set[int]]:
        """(epoch, writer) claims and the epochs reserved by create-only locks, listed afresh.
        A name newer than this writer's own claim counts only if its object is a claim record of
        that name (`WriterClaim`): a stray file named like a claim fences nothing and takes no
        epoch (issue 47). Only those names are read, each once."""
        keys = [o.key for o in self.store.list(WRITERS)]
        ours = (self.epoch, self.writer)
        claims = [p for k in keys if (p := parse_writer_key(k)) and (p <= ours or self._is_claim(k))]
        return claims, {e for k in keys if (e := parse_epoch_lock_key(k)) is not None}

    def _is_claim(self, key: str) -> bool:
        if key not in self._claim_checked:
            try:
                WriterClaim.from_json(read_at_most(self.store, key, MAX_CLAIM_BYTES), key)
                self._claim_checked[key] = True
            except (ValueError, ObjectNotFoundError) as e:
                log.warning("ignoring %s: not a writer claim (%s)", self.store.object_url(key), e)
                self._claim_checked[key] = False
        return self._claim_checked[key]

    def committed_epoch(self, above: int) -> int:
        """The newest epoch above `above` that a commit record carries (a run copied without
        `writers/` still has them), else `above`. Only commit records count: a stray object named
        like a commit of epoch 999999 must not leave the run without an epoch to claim (issue 47).
        Reads records newest epoch first until one is a commit record (one read on a run
        without stray names)."""
        run = Run(self.store)
        names = sorted(
            ((p[1], o.key) for o in self.store.list(COMMITS) if (p := parse_commit_key(o.key)) and p[1] > above),
            reverse=True,
        )
        return next((epoch for epoch, key in names if run.is_commit(key)), above)

    def claim(self) -> int:
        """Claim the epoch after every one seen (and return it). Where the store has create-only
        writes, an epoch is first reserved with a create-only lock object, so no two writers ever
        share one; a lost race moves on to the next epoch. Elsewhere two writers starting in the
        same instant may claim the same epoch; `check_fence` then orders them by (epoch, writer)
        and the smaller one stops at its next commit."""
        for _ in range(CLAIM_TRIES):
            claims, locks = self.claims()
            epoch = self.committed_epoch(max([e for e, _w in claims] + list(locks), default=0)) + 1
            if epoch > MAX_EPOCH:
                raise ProtocolError(
                    f"cannot claim writer epoch {epoch} of {self.store.url}: epochs have at most 6 digits "
                    f"(the run already holds epoch {epoch - 1})",
                    hint="publish to a new run URL",
                )
            if self.store.has_create_only and not self.store.put_new(epoch_lock_key(epoch), self.writer.encode()):
                continue  # another writer reserved this epoch after our listing
            self.store.put(
                writer_key(epoch, self.writer),
                f'{{"epoch": {epoch}, "writer": "{self.writer}", "at": {time.time()}}}'.encode(),
            )
            self.epoch = epoch
            return epoch
        raise StoreUnavailableError(
            f"could not claim a writer epoch of {self.store.url}: {CLAIM_TRIES} epochs in a row were taken by other "
            "writers",
            hint="only one trainer may publish to a run; stop the others or use a new run URL",
        )

    def check_fence(self) -> None:
        """FencedWriterError when a newer (epoch, writer) claim than ours exists."""
        claims, _ = self.claims()
        newer = [(e, w) for e, w in claims if (e, w) > (self.epoch, self.writer)]
        if newer:
            e, w = max(newer)
            raise FencedWriterError(
                f"writer {self.writer!r} (epoch {self.epoch}) was fenced: writer {w!r} claimed epoch {e} "
                f"of {self.store.url}",
                hint="only one trainer may publish to a run; stop the other one or use a new run URL",
            )

    # -- a version's objects ----------------------------------------------------------------
    def put_delta(self, base: int, version: int, uid: str, data: bytes) -> ObjectRef:
        """Store a version's delta file; its reference."""
        key = delta_key(base, version, self.epoch, uid)
        self.store.put(key, data)
        return ObjectRef(key, len(data), bytes_digest(data))

    def put_part(self, base: int, version: int, uid: str, part: EncodedPart) -> PartRef:
        """Store one part of a version's delta; its reference."""
        key = part_key(base, version, self.epoch, uid, part.index)
        data = part.patch.data
        self.store.put(key, data)
        return PartRef(key, len(data), bytes_digest(data), base_state_digest=part.patch.base_state_digest,
                       state_digest=part.patch.target_state_digest, units=part.units)

    def put_anchor(self, version: int, uid: str, files: list[Path]) -> list[ObjectRef]:
        """Store `files` (of the anchor of `version`) under its anchor prefix; their references."""
        prefix = anchor_prefix(version, self.epoch, uid)
        self.store.put_many([(prefix + f.name, f) for f in files])
        return [ObjectRef(prefix + f.name, f.stat().st_size, file_digest(f)) for f in files]

    # -- the commit ---------------------------------------------------------------------------
    def commit(self, rec: CommitRecord) -> None:
        """Write the commit record `rec` (every object it names already stored): fence check
        first, then the record, then `confirm_visible`. FencedWriterError when fenced or overruled."""
        self.check_fence()
        # visible at once, durable in the background before this store writes anything else: the
        # version's objects were durable before it (a power loss can only lose the newest commit)
        with self.store.deferred_sync():
            self.store.put(commit_key(rec.version, self.epoch), rec.to_json())
        self.confirm_visible(rec)

    def confirm_visible(self, rec: CommitRecord) -> None:
        """Raise FencedWriterError unless readers trust our commit record `rec` as the newest
        version. The listing may be stale (it cannot show our own commit yet): it is judged with
        our key added, so only commits it does show can overrule ours. The record is read back
        too: a writer that claimed the same epoch (stores without create-only writes) may have
        replaced it."""
        version = rec.version
        ours = commit_key(version, self.epoch)
        keys = {o.key for o in self.store.list(COMMITS)} | {ours}
        run = Run(self.store)  # only commit records fence: a stray object named like a commit does not

        def is_commit(key: str) -> bool:
            return key == ours or run.is_commit(key)

        newest = next((c for c in reversed(valid_commits(keys, is_commit)) if is_commit(c[2])), None)
        if newest is not None and newest[2] == ours:
            stored = CommitRecord.from_json(read_at_most(self.store, ours, MAX_COMMIT_BYTES), ours)
            if (stored.writer, stored.state_digest) == (self.writer, rec.state_digest):
                return
            raise FencedWriterError(
                f"version {version} (epoch {self.epoch}) of {self.store.url} was replaced by writer "
                f"{stored.writer!r} of the same epoch (state {stored.state_digest}); readers see that one",
                hint="only one trainer may publish to a run; stop the other one or use a new run URL",
            )
        overrulers = sorted(p for k in keys if (p := parse_commit_key(k)) and p[1] > self.epoch and p[0] <= version
                            and is_commit(k))
        seen = f"version {newest[0]} (epoch {newest[1]})" if newest is not None else "no version"
        raise FencedWriterError(
            f"version {version} (epoch {self.epoch}) was written to {self.store.url} but readers do not see it: "
            + (
                f"the commit of version {overrulers[0][0]} by epoch {overrulers[0][1]} overrules it; "
                if overrulers
                else ""
            )
            + f"readers see {seen}",
            hint="another writer holds a newer epoch of this run; stop it, or publish to a new run URL",
        )


class CheckpointFiles:
    """The checkpoint's non-weight files every commit carries (`protocol.extras`): stored once
    (and again when they change), then referenced. Thread-safe: set from the caller's thread,
    stored from the uploader's."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        self._lock = threading.Lock()
        self._files = dict(files)
        self._refs: list[FileRef] | None = None  # stored once, then referenced by every commit

    def set(self, files: Mapping[str, bytes]) -> None:
        """Carry `files` from the next commit on (nothing is stored when they are unchanged)."""
        with self._lock:
            if files != self._files:
                self._files, self._refs = dict(files), None

    def get(self, name: str) -> bytes | None:
        """The carried file `name` (e.g. config.json), or None."""
        with self._lock:
            return self._files.get(name)

    def refs(self, commits: CommitWriter, version: int, uid: str, *, adapter_run: bool) -> list[FileRef]:
        """The files' references for a commit of `version`, storing them first when they are new
        to this writer (an adapter run leaves config.json and generation_config.json out)."""
        with self._lock:
            files, refs = self._files, self._refs
        if refs is None:
            refs = []
            for name, data in sorted(files.items()):
                if adapter_run and name in MODEL_FILES:
                    continue  # an adapter folder loads with its base model's config
                key = file_key(version, commits.epoch, uid, name)
                commits.store.put(key, data)
                refs.append(FileRef(name, key, len(data), bytes_digest(data)))
            with self._lock:
                if self._files is files:  # not replaced meanwhile
                    self._refs = refs
        return refs
