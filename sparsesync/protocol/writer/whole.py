"""Whole-state encoding: one process diffs, encodes and uploads the whole state of each version.

`WholeState.publish` diffs the state (already in the checkpoint's key set, `checkpoint`) against
the last *published* version, encodes the patch and hands it to the upload queue. On anchor
versions (`AnchorPolicy`) it also serializes the anchor to a local staging folder (about 1 s per
GB), on the caller's thread. Memory: the diff snapshot (2 B/param for bf16) plus what the queue
holds; with the publisher's `dtype` (an fp32 master published as bf16) each tensor is cast as it
is diffed, so no cast copy of the whole state exists.

Parts (`part_bytes`, default 256 MiB of tensor bytes; 0, or a model no larger than one part: one
file per version): the version's delta is diffed and encoded in groups of whole tensors
(`sparsesync.protocol.writer.parts`), and each part is uploaded as soon as it is encoded, while the next
one is encoded (`UploadQueue.encode_streamed`); the commit record (format 2, listing the parts)
is still written last. A version is streamed this way when no other version waits for upload;
otherwise it is encoded whole and queued (and coalesced).

`upload` (on the uploader's thread) stores the version's objects, then the commit record
through `CommitWriter.commit` (fenced, confirmed visible).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparsesync.checkpoint import checkpoint_state
from sparsesync.codec import Snapshot, write_anchor
from sparsesync.codec.cast import CastState, state_nbytes
from sparsesync.errors import ConfigError, PatchMismatchError, RunNotFoundError
from sparsesync.protocol.records import AdapterMeta, CommitRecord, PartRef
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.anchors import AnchorHistory, AnchorPolicy
from sparsesync.protocol.writer.commits import CheckpointFiles, CommitWriter
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.parts import PartedSnapshot
from sparsesync.protocol.writer.uploads import PendingVersion, UploadQueue


class WholeState:
    """The whole-state writer mode of one process (see the module docstring)."""

    def __init__(self, *, config: PublisherConfig, run: Run, commits: CommitWriter, files: CheckpointFiles,
                 queue: UploadQueue, anchors: AnchorPolicy, staging: Path) -> None:
        self.config, self.run, self.commits, self.files = config, run, commits, files
        self.queue, self.anchors, self.staging = queue, anchors, staging
        self.url = run.store.url
        self.snapshot: Snapshot | PartedSnapshot | None = None  # the last published (or resumed) version

    @property
    def started(self) -> bool:
        """Whether a version was published or resumed from (the next one is then a delta)."""
        return self.snapshot is not None

    @property
    def state_digest(self) -> str | None:
        """State digest of the newest version published or resumed from."""
        return self.snapshot.state_digest if self.snapshot is not None else None

    def checkpoint(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """`state` in the run's key set (`checkpoint.checkpoint_state`, frozen tensors from the last
        version), seen in the publisher's `dtype` (`cast`)."""
        return self.cast(checkpoint_state(state, self.snapshot.state if self.snapshot is not None else None))

    def cast(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """`state` read in the publisher's `dtype`, one tensor at a time as it is diffed (`codec.cast`:
        no whole-state cast); `state` itself when `dtype` is None."""
        return state if self.config.dtype is None else CastState(state, self.config.dtype)

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Diff and encode `state` (from `checkpoint`) as `version` and queue it for upload."""
        if self.snapshot is None:
            t0 = time.perf_counter()
            self.snapshot = self.new_snapshot(state, version)
            item = PendingVersion(
                version=version, base_version=None, state_digest=self.snapshot.state_digest,
                base_state_digest=None, digests=dict(self.snapshot.digests), base_digests=None,
                changes=None, delta=None, anchor_dir=None,
                metrics={"snapshot_s": time.perf_counter() - t0},
            )
            self.write_anchor(item)
        elif isinstance(self.snapshot, PartedSnapshot):
            self.queue.encode_streamed(self.snapshot, state, version, seal=self._seal, enqueue=self._enqueue)
            return
        else:
            base_digests = dict(self.snapshot.digests)
            enc = self.snapshot.diff_encode(state, version)
            item = PendingVersion(
                version=version, base_version=enc.base_version, state_digest=enc.target_state_digest,
                base_state_digest=enc.base_state_digest, digests=dict(self.snapshot.digests),
                base_digests=base_digests, changes=enc.changes, delta=enc.data, anchor_dir=None,
                metrics=enc.stats.to_dict(),
            )
            self.anchors.add_delta(len(enc.data))
            if self.anchors.due(version):
                self.write_anchor(item)
        self._enqueue(item)

    def commits_to_resume(self) -> list[CommitRecord]:
        """The run's commits, for a writer that continues it: ConfigError after the first publish,
        RunNotFoundError when the run has none."""
        if self.snapshot is not None:
            raise ConfigError("resume() must come before the first publish()")
        commits = self.run.commits()
        if not commits:
            raise RunNotFoundError(f"nothing to resume under {self.url}", hint="publish() starts a run")
        return commits

    def resume(self, state: Mapping[str, torch.Tensor], commits: list[CommitRecord] | None = None) -> None:
        """Continue the run (`commits`, listed afresh when None) from its newest committed version,
        whose weights `state` holds. PatchMismatchError when `state` is not exactly that version."""
        commits = self.commits_to_resume() if commits is None else commits
        newest = commits[-1]
        if any(u.rows is not None for p in newest.parts for u in p.units):
            raise ConfigError(
                f"version {newest.version} of {self.url} was published in shards by a distributed trainer; "
                "resume() cannot check whole weights against it",
                hint="publish without resume(): the first version is then a new anchor",
            )
        snap = self.new_snapshot(self.cast(checkpoint_state(state)), newest.version)  # the key set its first publish() had
        if snap.state_digest != newest.state_digest:
            raise PatchMismatchError(
                f"the weights given to resume() have state digest {snap.state_digest}, but version "
                f"{newest.version} of {self.url} has {newest.state_digest}",
                hint="load the run's newest version first (`sparsesync pull`)",
            )
        self.stand_at(snap, AnchorHistory.of(commits))

    def stand_at(self, snap: Snapshot | PartedSnapshot, history: AnchorHistory) -> None:
        """Continue from `snap`, a version the run trusts (`resume`, a rewind), whose anchors
        `history` describes: the next `publish` is a delta against it."""
        self.snapshot = snap
        self.anchors.resume_from(history)

    def write_anchor(self, item: PendingVersion) -> None:
        """Serialize the snapshot (which holds `item`'s version) as `item`'s anchor, to staging."""
        assert self.snapshot is not None
        t0 = time.perf_counter()
        d = self.staging / f"anchor-{item.version}-{item.uid}"
        files = write_anchor(self.snapshot.state, d, version=item.version)
        item.anchor_dir = d
        self.anchors.anchored(item.version, sum(f.stat().st_size for f in files))
        item.metrics["anchor_bytes"] = self.anchors.anchor_bytes
        item.metrics["anchor_write_s"] = time.perf_counter() - t0

    def upload(self, item: PendingVersion, adapter: AdapterMeta | None) -> dict[str, Any] | None:
        """Uploader thread: store `item`'s objects, then its commit record (fenced, confirmed
        visible); the commit's metrics, or None when its encoding failed half-way (nothing committed)."""
        t0 = time.perf_counter()
        refs: list[PartRef] = []
        if item.parts is not None:
            base = item.base_version
            assert base is not None
            got = self.queue.parts_of(item, lambda part: self.commits.put_part(base, item.version, item.uid, part))
            if got is None:
                return None  # encoding failed half-way (publish() raised it): nothing to commit
            refs = got
        rec = CommitRecord(
            version=item.version, epoch=self.commits.epoch, writer=self.commits.writer, state_digest=item.state_digest,
            created_at=time.time(), base_version=item.base_version, base_state_digest=item.base_state_digest,
            adapter=adapter,
        )
        if item.delta is not None:
            assert item.base_version is not None
            rec.delta = self.commits.put_delta(item.base_version, item.version, item.uid, item.delta)
        rec.parts = refs
        if item.anchor_dir is not None:
            rec.anchor = self.commits.put_anchor(item.version, item.uid, sorted(item.anchor_dir.iterdir()))
        rec.files = self.files.refs(self.commits, item.version, item.uid, adapter_run=adapter is not None)
        rec.metrics = {**item.metrics, "version": item.version, "base_version": item.base_version,
                       "upload_s": time.perf_counter() - t0, "kind": "anchor" if rec.anchor and not rec.has_delta else
                       ("delta+anchor" if rec.anchor else "delta")}
        self.commits.commit(rec)
        if item.anchor_dir is not None:
            shutil.rmtree(item.anchor_dir, ignore_errors=True)
        return rec.metrics

    def new_snapshot(self, state: Mapping[str, torch.Tensor], version: int) -> Snapshot | PartedSnapshot:
        """The snapshot of `state` as `version` (in parts when the state is larger than one part)."""
        # a model that fits in one part is one delta file per version: a parts list would only add
        # an entry per tensor to every commit record (5.5 KB per version for a 23M-parameter model)
        if self.config.part_bytes and state_nbytes(state) > self.config.part_bytes:
            return PartedSnapshot.whole(state, version, self.config.part_bytes, effort=self.config.effort)
        return Snapshot(state, version, effort=self.config.effort)

    # -- internals --------------------------------------------------------------------
    def _seal(self, item: PendingVersion) -> None:
        """A delta in parts is encoded: count its bytes, and serialize an anchor when one is due."""
        self.anchors.add_delta(int(item.metrics["patch_bytes"]))
        if self.anchors.due(item.version):
            self.write_anchor(item)

    def _enqueue(self, item: PendingVersion) -> None:
        self.queue.put(item, self.write_anchor)
