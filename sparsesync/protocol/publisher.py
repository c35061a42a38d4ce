"""The writer side: publish weight versions into a run without making training wait on the network.

`Publisher.publish(state, step)` brings `state` to the checkpoint's own key set
(`checkpoint.checkpoint_state`: tied aliases once, runtime-fused experts per expert, frozen
tensors from the previous version, unknown tensors rejected before anything is uploaded),
diffs it against the last *published* version, encodes the
patch, hands it to a background uploader and returns. The uploader writes the version's
objects, checks that no newer writer has claimed the run, and writes the commit record last.

When it blocks: `publish` runs diff+encode on the caller's thread, and on anchor versions
also serializes the anchor to a local staging folder (about 1 s per GB). It never waits for
the network: when `queue_size` versions are waiting to upload, the newest waiting delta is
coalesced with the new one (B->N-1 and N-1->N become B->N; version N-1 is never committed).
Memory: the diff snapshot (2 B/param for bf16) plus at most `queue_size` encoded deltas.

Parts (`part_bytes`, default 256 MiB of tensor bytes; 0, or a model no larger than one part: one
file per version): the version's
delta is diffed and encoded in groups of whole tensors (`sparsesync.protocol.parts`), and each
part is uploaded as soon as it is encoded, while the next one is encoded; the commit record
(format 2, listing the parts) is still written last. A version is streamed this way when no
other version waits for upload; otherwise it is encoded whole and queued (and coalesced) as above.

Fencing: each Publisher claims a writer epoch (one higher than any seen; reserved with a
create-only write where the store has one, so no two writers share an epoch there) when it
starts, and re-lists the claims before every commit; when a newer claim exists (ordered by
epoch, then writer id) it stops and raises FencedWriterError from the next `publish`/`flush`.
The epoch is one above every epoch seen in claims, locks *and* commit names (a run copied
without `writers/` still fences its old commits correctly). After writing a commit record the
uploader lists `commits/` again and checks that readers trust it as the newest version; if a
commit of a newer epoch overrules it, FencedWriterError names the version readers see, so a
commit nobody can read is never reported as published. Versions and epochs that do not fit the
object names (10 and 6 digits) are refused before anything is uploaded.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparsesync.adapter import adapter_state, check_publish
from sparsesync.checkpoint import checkpoint_state
from sparsesync.codec import Effort, Snapshot, TensorChange, compose_changes, encode_changes, write_anchor
from sparsesync.codec.digest import bytes_digest, file_digest
from sparsesync.codec.patch import check_effort
from sparsesync.errors import (
    ConfigError,
    FencedWriterError,
    PatchMismatchError,
    ProtocolError,
    RunNotFoundError,
    SparsesyncError,
    StoreUnavailableError,
)
from sparsesync.protocol.extras import MODEL_FILES, collect_files
from sparsesync.protocol.keys import (
    COMMITS,
    MAX_EPOCH,
    WRITERS,
    anchor_prefix,
    check_version,
    commit_key,
    delta_key,
    epoch_lock_key,
    file_key,
    new_uid,
    parse_commit_key,
    parse_epoch_lock_key,
    parse_writer_key,
    part_key,
    valid_commits,
    writer_key,
)
from sparsesync.protocol.parts import DEFAULT_PART_BYTES, EncodedPart, PartedSnapshot, coalesce_parts, combined_stats
from sparsesync.protocol.records import MAX_COMMIT_BYTES, AdapterMeta, CommitRecord, FileRef, ObjectRef, PartRef
from sparsesync.protocol.run import Run, read_at_most
from sparsesync.store import Store, open_store

log = logging.getLogger(__name__)
_CLAIM_TRIES = 100  # epochs tried before giving up on a run that other writers keep claiming


@dataclass
class PublisherConfig:
    """How often anchors are written and how much may wait for upload."""

    anchor_every: int = 50  # versions between periodic anchors (0: only the first one)
    anchor_fraction: float = 0.5  # anchor when delta bytes since the last anchor exceed this x anchor bytes
    queue_size: int = 4  # versions waiting for upload before deltas are coalesced
    retry_backoff_s: float = 0.5  # first wait after a failed upload (doubles, max 30 s)
    writer: str = ""  # writer id recorded in claims and commits; default host-pid-random
    part_bytes: int = DEFAULT_PART_BYTES  # tensor bytes per part of a version (0: one delta file, format 1)
    dist_timeout_s: float = 300.0  # distributed publisher: how long ranks wait for each other's parts
    effort: Effort = "size"  # "size": smallest patches; "speed": 26-29% larger at 1.6% density, encode and decode faster (`sparsesync.codec.Effort`)

    def validate(self) -> None:
        if self.anchor_every < 0:
            raise ConfigError(f"anchor_every={self.anchor_every}: must be >= 0")
        if not 0 < self.anchor_fraction:
            raise ConfigError(f"anchor_fraction={self.anchor_fraction}: must be > 0")
        if self.queue_size < 1:
            raise ConfigError(f"queue_size={self.queue_size}: must be >= 1")
        if self.part_bytes < 0:
            raise ConfigError(f"part_bytes={self.part_bytes}: must be >= 0 (0: one delta file per version)")
        try:
            check_effort(self.effort)
        except ValueError as e:
            raise ConfigError(str(e), hint="'size' (smallest patches) or 'speed' (faster encode and decode, larger patches)") from None


@dataclass
class _Item:
    """One version waiting to be uploaded."""

    version: int
    base_version: int | None
    state_digest: str
    base_state_digest: str | None
    digests: dict[str, str]  # every tensor's digest at `version`
    base_digests: dict[str, str] | None
    changes: dict[str, TensorChange] | None
    delta: bytes | None
    anchor_dir: Path | None
    metrics: dict[str, Any]
    uid: str = field(default_factory=new_uid)
    parts: list[EncodedPart] | None = None  # the delta in parts (instead of `delta`), appended as encoded
    sealed: bool = True  # False while parts are still being encoded (streamed to the uploader)
    failed: bool = False  # encoding stopped half-way: never committed


class Publisher:
    """Publishes versions of a state dict to the run at `url` (see module docstring). Under an
    initialized torch.distributed group (world size > 1), or given `group=`, it is one rank of a
    `sparsesync.protocol.distributed.DistributedPublisher`."""

    def __new__(cls, *args: Any, group: Any = None, **kwargs: Any) -> Publisher:
        if cls is Publisher:
            from sparsesync.protocol.distributed import DistributedPublisher, wants_distributed

            if wants_distributed(group):
                return super().__new__(DistributedPublisher)
        return super().__new__(cls)

    def __init__(self, url: str | Store, config: PublisherConfig | None = None, *, adapter: AdapterMeta | None = None,
                 extra_files: str | Path | Mapping[str, bytes] | None = None, **overrides: Any) -> None:
        """`adapter`: publish a LoRA adapter run of this base and config (a PeftModel passed to
        `publish` brings its own; see sparsesync.adapter). `extra_files`: the checkpoint's
        non-weight files every commit carries (a `save_pretrained` folder, of which only config,
        generation config and tokenizer files are taken, or `{name: bytes}`; see `set_extra_files`)."""
        self.adapter = adapter
        self._extra = collect_files(extra_files)  # checked before anything is written
        self._extra_refs: list[FileRef] | None = None  # stored once, then referenced by every commit
        self.config = config or PublisherConfig()
        overrides.pop("group", None)  # group=None: not distributed (see __new__)
        for k, v in overrides.items():
            if not hasattr(self.config, k):
                raise ConfigError(f"unknown publisher option {k!r}")
            setattr(self.config, k, v)
        self.config.validate()
        self.store = open_store(url, create=True) if isinstance(url, str) else url
        self.run = Run(self.store)
        # host-pid-random: unique even for two publishers in one process (it breaks epoch ties, see _check_fence)
        self.writer = self.config.writer or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}".replace("_", "-")
        self._staging = Path(tempfile.mkdtemp(prefix="sparsesync-publish-"))
        self._snapshot: Snapshot | PartedSnapshot | None = None
        self._pending: deque[_Item] = deque()
        self._busy = False
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._last_anchor_version: int | None = None
        self._anchor_bytes = 0
        self._delta_bytes_since_anchor = 0
        self.metrics: list[dict[str, Any]] = []  # one per committed version, in commit order
        newest = self.run.newest()
        self._newest = newest  # its kind (adapter or full weights) is checked at the first publish
        self.committed_version: int | None = newest.version if newest else None
        self._last_version = self.committed_version
        self.epoch = self._claim_epoch()
        self._thread = threading.Thread(target=self._upload_loop, name="sparsesync-upload", daemon=True)
        self._thread.start()

    # -- public API -------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None = None) -> int:
        """Publish `state` as version `step` (default: previous + 1; 0 in an empty run: a version is
        the number of optimizer steps behind its weights, 0 the weights before training). Returns the version.

        `state`: a state dict, or a `peft.PeftModel` (its adapter is published: an adapter run).
        Returns after diff+encode (and anchor serialization on anchor versions); the upload
        happens in the background.
        """
        self._raise_background_error()
        if self._closed:
            raise ConfigError("publish() after close()")
        state, self.adapter = adapter_state(state, self.adapter)
        check_publish(self._newest, self.adapter, self.store.url)
        state = checkpoint_state(state, self._snapshot.state if self._snapshot is not None else None)
        version = self._next_version(step)
        if self._snapshot is None:
            t0 = time.perf_counter()
            self._snapshot = self._new_snapshot(state, version)
            item = _Item(
                version=version, base_version=None, state_digest=self._snapshot.state_digest,
                base_state_digest=None, digests=dict(self._snapshot.digests), base_digests=None,
                changes=None, delta=None, anchor_dir=None,
                metrics={"snapshot_s": time.perf_counter() - t0},
            )
            self._write_anchor(item)
        elif isinstance(self._snapshot, PartedSnapshot):
            self._publish_parts(state, version)
            self._last_version = version
            return version
        else:
            base_digests = dict(self._snapshot.digests)
            enc = self._snapshot.diff_encode(state, version)
            item = _Item(
                version=version, base_version=enc.base_version, state_digest=enc.target_state_digest,
                base_state_digest=enc.base_state_digest, digests=dict(self._snapshot.digests),
                base_digests=base_digests, changes=enc.changes, delta=enc.data, anchor_dir=None,
                metrics=enc.stats.to_dict(),
            )
            self._delta_bytes_since_anchor += len(enc.data)
            if self._anchor_due(version):
                self._write_anchor(item)
        self._last_version = version
        self._enqueue(item)
        return version

    def set_extra_files(self, source: str | Path | Mapping[str, bytes] | None) -> None:
        """Carry these checkpoint files (config.json, tokenizer files, ...; `protocol.extras`) in
        every commit from the next one on, so `sparsesync pull` writes a folder that loads as is.
        Stored once per publisher (and again when they change); an adapter run leaves
        config.json and generation_config.json out. ConfigError, before anything is uploaded,
        for names outside the allow-list or files over the bounds."""
        files = collect_files(source)
        with self._cv:
            if files != self._extra:
                self._extra, self._extra_refs = files, None

    def resume(self, state: Mapping[str, torch.Tensor], *, version: int | None = None) -> None:
        """Continue the run from its newest committed version, whose weights `state` holds.

        The next `publish` is then a delta against that version instead of a fresh anchor.
        Raises PatchMismatchError when `state` is not exactly that version.

        `version` below the newest: a rewind (`sparsesync.protocol.rewind`): `state` (checked
        against the run's version `version` when it has one) becomes that version at once and the
        newer versions are abandoned; replicas follow without any change.
        """
        if self._snapshot is not None:
            raise ConfigError("resume() must come before the first publish()")
        commits = self.run.commits()
        if not commits:
            raise RunNotFoundError(f"nothing to resume under {self.store.url}", hint="publish() starts a run")
        newest = commits[-1]
        if version is not None and version != newest.version:  # rewind hook (protocol/rewind.py)
            from sparsesync.protocol.rewind import rewind

            rewind(self, state, version, commits)
            return
        if any(u.rows is not None for p in newest.parts for u in p.units):
            raise ConfigError(
                f"version {newest.version} of {self.store.url} was published in shards by a distributed trainer; "
                "resume() cannot check whole weights against it",
                hint="publish without resume(): the first version is then a new anchor",
            )
        snap = self._new_snapshot(checkpoint_state(state), newest.version)  # the key set its first publish() had
        if snap.state_digest != newest.state_digest:
            raise PatchMismatchError(
                f"the weights given to resume() have state digest {snap.state_digest}, but version "
                f"{newest.version} of {self.store.url} has {newest.state_digest}",
                hint="load the run's newest version first (`sparsesync pull`)",
            )
        self._snapshot = snap
        anchors = [c for c in commits if c.has_anchor]
        if anchors:
            last = anchors[-1]
            self._last_anchor_version = last.version
            self._anchor_bytes = sum(o.size for o in last.anchor)
            self._delta_bytes_since_anchor = sum(
                o.size for c in commits if c.version > last.version for o in c.delta_objects()
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published version is committed (or raise the uploader's error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._pending or self._busy) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StoreUnavailableError(
                        f"{len(self._pending) + self._busy} version(s) still uploading to {self.store.url} "
                        f"after {timeout} s",
                        url=self.store.url,
                        hint="the store is slow or unreachable; the publisher keeps retrying",
                    )
                self._cv.wait(timeout=left if left is not None else 1.0)
        self._raise_background_error()

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the uploader and remove the staging folder."""
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush(timeout)
        finally:
            self._closed = True
            with self._cv:
                self._cv.notify_all()
            self._thread.join(timeout=5)
            shutil.rmtree(self._staging, ignore_errors=True)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_fleet(self, version: int, min_replicas: int, timeout: float, *, staged: bool = False) -> list[str]:
        """Block until `min_replicas` live replicas report serving `version` or newer (with
        `staged`: have staged it); returns their ids. FleetTimeoutError names who is behind.
        Replicas report through their heartbeats (`sparsesync.protocol.fleet`)."""
        from sparsesync.protocol.fleet import wait_for_fleet

        return [s.record.replica for s in wait_for_fleet(self.store, version, min_replicas, timeout, staged=staged)]

    def switch_fleet(self, version: int, apply_in_s: float | None = None) -> float:
        """Tell coordinated replicas to apply `version` together: writes its switch record (once)
        and returns its apply_at (unix time). Default lead: the slowest live replica's poll."""
        from sparsesync.protocol.fleet import read_fleet, switch_lead_s, write_switch
        from sparsesync.protocol.rewind import current_switch

        lead = switch_lead_s(read_fleet(self.store)) if apply_in_s is None else apply_in_s
        # rewind hook: the plain record may belong to a version a rewind abandoned
        ours = next((c for c in self.run.commits() if c.version == version and c.epoch == self.epoch), None)
        sw, epoch = current_switch(self.store, version, self.epoch, ours.created_at) if ours else (None, None)
        return (sw or write_switch(self.store, version, by=f"trainer:{self.writer}", apply_in_s=lead, epoch=epoch)).apply_at

    @property
    def state_digest(self) -> str | None:
        """State digest of the newest version this publisher published or resumed from."""
        return self._snapshot.state_digest if self._snapshot is not None else None

    @property
    def pending(self) -> int:
        """Versions published but not yet committed."""
        with self._cv:
            return len(self._pending) + int(self._busy)

    # -- internals --------------------------------------------------------------------
    def _next_version(self, step: int | None) -> int:
        """The version `publish(step)` publishes; ConfigError before anything is written if it cannot."""
        version = step if step is not None else 0 if self._last_version is None else self._last_version + 1
        check_version(version, self.store.url)
        if self._last_version is not None and version <= self._last_version:
            raise ConfigError(
                f"version {version} is not newer than the last version {self._last_version} of {self.store.url}",
                hint="pass a larger step, or publish to a new run URL",
            )
        return version

    def _new_snapshot(self, state: Mapping[str, torch.Tensor], version: int) -> Snapshot | PartedSnapshot:
        # a model that fits in one part is one delta file per version: a parts list would only add
        # an entry per tensor to every commit record (5.5 KB per version for a 23M-parameter model)
        if self.config.part_bytes and sum(t.numel() * t.element_size() for t in state.values()) > self.config.part_bytes:
            return PartedSnapshot.whole(state, version, self.config.part_bytes, effort=self.config.effort)
        return Snapshot(state, version, effort=self.config.effort)

    def _publish_parts(self, state: Mapping[str, torch.Tensor], version: int, *, after: _Item | None = None) -> None:
        """Diff and encode a delta in parts; when no other version waits, the uploader takes each
        part as soon as it is encoded (the commit still waits for the last part). `after`: the
        newest waiting version, taken off the queue by the caller: this one is encoded whole and
        merged into it (`_coalesce`), then queued; if encoding fails, `after` is queued again."""
        snap = self._snapshot
        assert isinstance(snap, PartedSnapshot)
        item = _Item(
            version=version, base_version=snap.version, state_digest="", base_state_digest=snap.state_digest,
            digests={}, base_digests=snap.digests, changes=None, delta=None, anchor_dir=None, metrics={},
            parts=[], sealed=False,
        )
        with self._cv:
            stream = after is None and not self._pending  # else: encoded whole, then queued or coalesced by `_enqueue`
            if stream:
                self._pending.append(item)
                self._cv.notify_all()

        def on_part(part: EncodedPart) -> None:
            with self._cv:
                item.parts.append(part)  # type: ignore[union-attr]
                self._cv.notify_all()

        try:
            parts = snap.diff_encode(state, version, on_part)
            item.state_digest, item.digests = snap.state_digest, snap.digests
            item.metrics = combined_stats(parts)
            self._delta_bytes_since_anchor += int(item.metrics["patch_bytes"])
            if self._anchor_due(version):
                self._write_anchor(item)
        except BaseException as e:
            with self._cv:  # the snapshot may hold this version in some parts only: nothing more can be published
                if after is not None:
                    self._pending.append(after)
                item.failed = True
                self._error = e if isinstance(e, SparsesyncError) else SparsesyncError(
                    f"encoding version {version} for {self.store.url} failed half-way: {e!r}",
                    hint="start a new Publisher (its first version is an anchor)")
                self._cv.notify_all()
            raise
        with self._cv:
            item.sealed = True
            self._cv.notify_all()
        if not stream:
            self._enqueue(item if after is None else self._coalesce(after, item))

    def _upload_parts(self, item: _Item) -> list[PartRef] | None:
        """Upload the parts of `item` as they are encoded; None when encoding failed half-way."""
        refs, i = [], 0
        assert item.parts is not None and item.base_version is not None
        while True:
            with self._cv:
                while len(item.parts) <= i and not item.sealed and not item.failed:
                    self._cv.wait(timeout=1.0)
                if item.failed:
                    return None
                if len(item.parts) <= i:
                    return refs
                part = item.parts[i]
            key = part_key(item.base_version, item.version, self.epoch, item.uid, part.index)
            data = part.patch.data
            self.store.put(key, data)
            refs.append(PartRef(key, len(data), bytes_digest(data), base_state_digest=part.patch.base_state_digest,
                                state_digest=part.patch.target_state_digest, units=part.units))
            i += 1

    def _put_anchor_files(self, item: _Item, files: list[Path]) -> list[ObjectRef]:
        """Store `files` (of the anchor of `item`) under its anchor prefix; their references."""
        prefix = anchor_prefix(item.version, self.epoch, item.uid)
        self.store.put_many([(prefix + f.name, f) for f in files])
        return [ObjectRef(prefix + f.name, f.stat().st_size, file_digest(f)) for f in files]

    def _commit_files(self, version: int, uid: str) -> list[FileRef]:
        """The checkpoint files' references for a commit of `version`, storing them first when
        they are new to this publisher (uploader thread; the distributed publisher's rank 0)."""
        with self._cv:
            files, refs = self._extra, self._extra_refs
        if refs is None:
            refs = []
            for name, data in sorted(files.items()):
                if self.adapter is not None and name in MODEL_FILES:
                    continue  # an adapter folder loads with its base model's config
                key = file_key(version, self.epoch, uid, name)
                self.store.put(key, data)
                refs.append(FileRef(name, key, len(data), bytes_digest(data)))
            with self._cv:
                if self._extra is files:  # not replaced meanwhile
                    self._extra_refs = refs
        return refs

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _claims(self) -> tuple[list[tuple[int, str]], set[int]]:
        """(epoch, writer) claims and the epochs reserved by create-only locks, listed afresh."""
        keys = [o.key for o in self.store.list(WRITERS)]
        return [p for k in keys if (p := parse_writer_key(k))], {e for k in keys if (e := parse_epoch_lock_key(k)) is not None}

    def _commit_epochs(self) -> set[int]:
        """The epochs named by commit records (a run copied without `writers/` still has them)."""
        return {p[1] for o in self.store.list(COMMITS) if (p := parse_commit_key(o.key))}

    def _claim_epoch(self) -> int:
        """Claim the epoch after every one seen. Where the store has create-only writes, an epoch
        is first reserved with a create-only lock object, so no two writers ever share one; a
        lost race moves on to the next epoch. Elsewhere two writers starting in the same instant
        may claim the same epoch; `_check_fence` then orders them by (epoch, writer) and the
        smaller one stops at its next commit."""
        committed = self._commit_epochs()
        for _ in range(_CLAIM_TRIES):
            claims, locks = self._claims()
            epoch = max([e for e, _w in claims] + list(locks) + list(committed), default=0) + 1
            if epoch > MAX_EPOCH:
                raise ProtocolError(
                    f"cannot claim writer epoch {epoch} of {self.store.url}: epochs have at most 6 digits "
                    f"(the run already holds epoch {epoch - 1})",
                    hint="publish to a new run URL",
                )
            if self.store.has_create_only and not self.store.put_new(epoch_lock_key(epoch), self.writer.encode()):
                continue  # another writer reserved this epoch after our listing
            self.store.put(writer_key(epoch, self.writer), f'{{"epoch": {epoch}, "writer": "{self.writer}", "at": {time.time()}}}'.encode())
            return epoch
        raise StoreUnavailableError(
            f"could not claim a writer epoch of {self.store.url}: {_CLAIM_TRIES} epochs in a row were taken by other writers",
            hint="only one trainer may publish to a run; stop the others or use a new run URL",
        )

    def _check_fence(self) -> None:
        claims, _ = self._claims()
        newer = [(e, w) for e, w in claims if (e, w) > (self.epoch, self.writer)]
        if newer:
            e, w = max(newer)
            raise FencedWriterError(
                f"writer {self.writer!r} (epoch {self.epoch}) was fenced: writer {w!r} claimed epoch {e} "
                f"of {self.store.url}",
                hint="only one trainer may publish to a run; stop the other one or use a new run URL",
            )

    def _confirm_visible(self, rec: CommitRecord) -> None:
        """Raise FencedWriterError unless readers trust our commit record `rec` as the newest
        version. The listing may be stale (it cannot show our own commit yet): it is judged with
        our key added, so only commits it does show can overrule ours. The record is read back
        too: a writer that claimed the same epoch (stores without create-only writes) may have
        replaced it."""
        version = rec.version
        ours = commit_key(version, self.epoch)
        keys = {o.key for o in self.store.list(COMMITS)} | {ours}
        valid = valid_commits(sorted(keys))
        if valid and valid[-1][2] == ours:
            stored = CommitRecord.from_json(read_at_most(self.store, ours, MAX_COMMIT_BYTES), ours)
            if (stored.writer, stored.state_digest) == (self.writer, rec.state_digest):
                return
            raise FencedWriterError(
                f"version {version} (epoch {self.epoch}) of {self.store.url} was replaced by writer "
                f"{stored.writer!r} of the same epoch (state {stored.state_digest}); readers see that one",
                hint="only one trainer may publish to a run; stop the other one or use a new run URL",
            )
        overrulers = sorted(p for k in keys if (p := parse_commit_key(k)) and p[1] > self.epoch and p[0] <= version)
        seen = f"version {valid[-1][0]} (epoch {valid[-1][1]})" if valid else "no version"
        raise FencedWriterError(
            f"version {version} (epoch {self.epoch}) was written to {self.store.url} but readers do not see it: "
            + (f"the commit of version {overrulers[0][0]} by epoch {overrulers[0][1]} overrules it; " if overrulers else "")
            + f"readers see {seen}",
            hint="another writer holds a newer epoch of this run; stop it, or publish to a new run URL",
        )

    def _anchor_due(self, version: int) -> bool:
        cfg = self.config
        if self._last_anchor_version is None:
            return True
        if cfg.anchor_every and version - self._last_anchor_version >= cfg.anchor_every:
            return True
        return self._delta_bytes_since_anchor > cfg.anchor_fraction * max(self._anchor_bytes, 1)

    def _write_anchor(self, item: _Item) -> None:
        assert self._snapshot is not None
        t0 = time.perf_counter()
        d = self._staging / f"anchor-{item.version}-{item.uid}"
        files = write_anchor(self._snapshot.state, d, version=item.version)
        item.anchor_dir = d
        self._anchor_bytes = sum(f.stat().st_size for f in files)
        self._delta_bytes_since_anchor = 0
        self._last_anchor_version = item.version
        item.metrics["anchor_bytes"] = self._anchor_bytes
        item.metrics["anchor_write_s"] = time.perf_counter() - t0

    def _enqueue(self, item: _Item) -> None:
        with self._cv:
            if len(self._pending) >= self.config.queue_size:
                item = self._coalesce(self._pending.pop(), item)
            self._pending.append(item)
            self._cv.notify_all()

    def _coalesce(self, old: _Item, new: _Item) -> _Item:
        """Merge two waiting versions into one delta old.base -> new.version."""
        if old.anchor_dir is not None:  # `old` is never committed: its anchor is handed on to `new`
            shutil.rmtree(old.anchor_dir, ignore_errors=True)
            if new.anchor_dir is None:
                self._write_anchor(new)
        if old.parts is not None and new.parts is not None:
            assert old.base_version is not None and old.base_digests is not None
            parts = coalesce_parts(old.parts, new.parts, old.base_version, old.base_digests, new.version)
            coalesced = old.metrics.get("coalesced", [old.version]) + [new.version]
            merged = _Item(
                version=new.version, base_version=old.base_version, state_digest=new.state_digest,
                base_state_digest=old.base_state_digest, digests=new.digests, base_digests=old.base_digests,
                changes=None, delta=None, anchor_dir=new.anchor_dir, parts=parts,
                metrics={**new.metrics, **combined_stats(parts), "coalesced": coalesced},
            )
            log.info("uploads lag: coalesced versions %s into %s->%s (in parts)", coalesced, merged.base_version, merged.version)
            return merged
        if old.changes is None or new.changes is None:
            # `old` is the very first version (a bare anchor, handed on above): the merge is an anchor of `new`
            new.changes, new.delta, new.base_version, new.parts = None, None, None, None
            new.base_state_digest = new.base_digests = None
            return new
        changes = compose_changes(old.changes, new.changes)
        assert old.base_digests is not None and old.base_version is not None
        data = encode_changes(
            changes,
            base_version=old.base_version,
            target_version=new.version,
            base_digests={n: old.base_digests[n] for n in changes},
            target_digests={n: new.digests[n] for n in changes},
            base_state_digest=old.base_state_digest or "",
            target_state_digest=new.state_digest,
        )
        merged = _Item(
            version=new.version, base_version=old.base_version, state_digest=new.state_digest,
            base_state_digest=old.base_state_digest, digests=new.digests, base_digests=old.base_digests,
            changes=changes, delta=data, anchor_dir=new.anchor_dir,
            metrics={**new.metrics, "patch_bytes": len(data),
                     "coalesced": old.metrics.get("coalesced", [old.version]) + [new.version]},
        )
        log.info("uploads lag: coalesced versions %s into %s->%s", merged.metrics["coalesced"],
                 merged.base_version, merged.version)
        return merged

    def _upload_loop(self) -> None:
        backoff = self.config.retry_backoff_s
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait(timeout=1.0)  # a lost wake-up (publish interrupted mid-enqueue) heals itself
                if not self._pending:
                    return
                item = self._pending.popleft()
                self._busy = True
            try:
                while True:
                    try:
                        self._upload(item)
                        backoff = self.config.retry_backoff_s
                        break
                    except StoreUnavailableError as e:
                        if self._closed:
                            raise
                        backoff = _wait_to_retry(f"upload of version {item.version}", e, backoff)
                        with self._cv:  # newer deltas may have queued: merge them in now
                            # (only pure deltas: anchors are serialized on the publishing thread)
                            if self._pending and _pure_delta(item) and _pure_delta(self._pending[0]):
                                nxt = self._pending.popleft()
                                item = self._coalesce(item, nxt)
            except BaseException as e:  # noqa: BLE001 - fatal: surfaced from publish()/flush()
                with self._cv:
                    self._error = e if isinstance(e, SparsesyncError) else SparsesyncError(
                        f"uploader of {self.store.url} failed: {e!r}")
                    self._busy = False
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _upload(self, item: _Item) -> None:
        t0 = time.perf_counter()
        refs = self._upload_parts(item) if item.parts is not None else []
        if refs is None:
            return  # encoding failed half-way (publish() raised it): nothing to commit
        rec = CommitRecord(
            version=item.version, epoch=self.epoch, writer=self.writer, state_digest=item.state_digest,
            created_at=time.time(), base_version=item.base_version, base_state_digest=item.base_state_digest,
            adapter=self.adapter,
        )
        if item.delta is not None:
            assert item.base_version is not None
            key = delta_key(item.base_version, item.version, self.epoch, item.uid)
            self.store.put(key, item.delta)
            rec.delta = ObjectRef(key, len(item.delta), bytes_digest(item.delta))
        rec.parts = refs
        if item.anchor_dir is not None:
            rec.anchor = self._put_anchor_files(item, sorted(item.anchor_dir.iterdir()))
        rec.files = self._commit_files(item.version, item.uid)
        self._check_fence()
        rec.metrics = {**item.metrics, "version": item.version, "base_version": item.base_version,
                       "upload_s": time.perf_counter() - t0, "kind": "anchor" if rec.anchor and not rec.has_delta else
                       ("delta+anchor" if rec.anchor else "delta")}
        self.store.put(commit_key(item.version, self.epoch), rec.to_json())
        self._confirm_visible(rec)
        if item.anchor_dir is not None:
            shutil.rmtree(item.anchor_dir, ignore_errors=True)
        self.committed_version = item.version
        self.metrics.append(rec.metrics)


def _wait_to_retry(what: str, error: StoreUnavailableError, backoff: float) -> float:
    """After a store outage (the store's own retries ran out): log it, sleep `backoff` seconds;
    the next wait (doubled, at most 30 s)."""
    log.warning("%s failed (%s); retrying in %.1f s", what, error, backoff)
    time.sleep(backoff)
    return min(backoff * 2, 30.0)


def _pure_delta(item: _Item) -> bool:
    return item.delta is not None and item.anchor_dir is None
