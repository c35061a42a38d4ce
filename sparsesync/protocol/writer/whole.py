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
one is encoded (`stream.PartStream`); the commit record (format 2, listing the parts)
is still written last. A version is streamed this way when no other version waits for upload;
otherwise it is encoded whole and queued (and coalesced).

Weights on a GPU (`snapshot_place`; `Publisher(snapshot=...)`): the snapshot is a
`codec.DeviceSnapshot` beside them (one delta file per version, no parts). `publish` extracts the
changes there (two device->host reads) and queues them unencoded; `upload` entropy codes them
first (`_encode_late`, in version order; a failure stops the publisher as a failed upload does,
nothing of the version committed). The anchor policy counts a version's delta bytes once it is
encoded, so `anchor_fraction` may see them a version or two late.

`upload` (on the uploader's thread) stores the version's objects, then the commit record
through `CommitWriter.commit` (fenced, confirmed visible), then records it in the `Tally`.

A `mode.WriterMode`: `publish`/`resume`/`version_of`/`continue_below` take the caller's state
(a state dict, or a `peft.PeftModel` whose adapter is published: an adapter run), check it
against the run (`adapter_runs.check_publish`) and bring it to the checkpoint's key set before
anything is written. Under torch.distributed with replicated weights this is rank 0's mode.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch

from sparsesync.checkpoint import checkpoint_digest, checkpoint_state
from sparsesync.codec import DEFAULT_ALGO, Snapshot, algo_of, write_anchor
from sparsesync.codec.cast import CastState, state_nbytes
from sparsesync.codec.device_snapshot import DeviceSnapshot, placement_for, weights_device
from sparsesync.errors import ConfigError, PatchMismatchError, RunNotFoundError, SparsesyncError
from sparsesync.lora.state import adapter_state
from sparsesync.protocol.adapter_runs import check_publish
from sparsesync.protocol.records import CommitRecord, PartRef
from sparsesync.protocol.writer.anchors import AnchorHistory
from sparsesync.protocol.writer.config import served_dtype
from sparsesync.protocol.writer.mode import WriterContext, WriterMode
from sparsesync.protocol.writer.parts import PartedSnapshot
from sparsesync.protocol.writer.ranks import holds_shards
from sparsesync.protocol.writer.rewind import rewind, stand_below, version_with_digest
from sparsesync.protocol.writer.stream import PartStream
from sparsesync.protocol.writer.uploads import PendingVersion

log = logging.getLogger(__name__)


class WholeState:
    """The whole-state writer mode of one process (see the module docstring); `distributed`:
    rank 0 of a group with replicated weights. Starts the uploader."""

    def __init__(self, ctx: WriterContext, *, distributed: bool = False) -> None:
        self.config, self.run, self.commits, self.files = ctx.config, ctx.run, ctx.commits, ctx.files
        self.queue, self.anchors, self.staging, self.tally = ctx.queue, ctx.anchors, ctx.staging, ctx.tally
        self.ctx, self.distributed = ctx, distributed
        self.url = self.run.store.url
        # the last published (or resumed) version
        self.snapshot: Snapshot | PartedSnapshot | DeviceSnapshot | None = None
        self._dtype_picked = self.config.dtype is not None  # else the first publish/resume picks it (`_pick_dtype`)
        self.queue.start(self.upload)

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

    # -- the writer interface (`mode.WriterMode`) -------------------------------------------
    def settle(self, state: Mapping[str, torch.Tensor] | Any) -> WriterMode:
        """Itself: decided."""
        return self

    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None) -> int:
        """Publish `state` (a state dict, or a `peft.PeftModel`: its adapter) as version `step`
        (None: the next one): checked against the run (an adapter run or not) and brought to its
        key set, then diffed, encoded and queued (`encode`). Nothing is written when it is refused."""
        tally = self.tally
        self.ctx.check_open()
        state, tally.adapter = adapter_state(state, tally.adapter)
        check_publish(tally.newest, tally.adapter, self.url)
        self._pick_dtype(state)
        state = self.checkpoint(state)
        version = tally.next_version(step)
        self.encode(state, version)
        tally.last = version
        return version

    def resume(self, state: Mapping[str, torch.Tensor] | Any, version: int | None) -> None:
        """Continue from the run's newest version (`version` None or the newest), whose weights
        `state` holds (PatchMismatchError when it is not exactly that version); `version` below
        the newest: a rewind (`writer.rewind.rewind`, docs/protocol.md "Rewinds"), committed before
        this returns."""
        if self.distributed and holds_shards(state):  # rank 0 of replicated weights decided already
            raise ConfigError("resume() must come before the first publish()")
        self._pick_dtype(state)
        if version is None:
            self._resume_newest(state)
            return
        commits = self.commits_to_resume()
        if version == commits[-1].version:
            self._resume_newest(state, commits)
            return
        tally = self.tally
        state, tally.adapter = adapter_state(state, tally.adapter)
        rec = rewind(self, state, version, commits, tally.adapter)
        tally.newest, tally.committed, tally.last = rec, version, version
        tally.metrics.append(rec.metrics)

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        """The newest trusted version whose state digest is `state`'s (in the checkpoint's key set), or None."""
        state, _adapter = adapter_state(state, self.tally.adapter)
        commits = self.run.commits()  # hashed in the run's digest algorithm (the newest commit's)
        same = (
            version_with_digest(commits, checkpoint_digest(state, algo_of(commits[-1].state_digest)))
            if commits
            else None
        )
        return None if same is None else same.version

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        """Stand at the run's trusted `version` (below its newest), whose weights `state` holds
        (`writer.rewind.stand_below`), nothing committed: the next `publish` is a delta from it."""
        commits = self.commits_to_resume()
        tally = self.tally
        state, tally.adapter = adapter_state(state, tally.adapter)
        check_publish(commits[-1], tally.adapter, self.url)
        stand_below(self, state, version, commits)
        tally.committed = tally.last = version

    def upload(self, item: PendingVersion) -> None:
        """Uploader thread: store `item`'s objects, then its commit record (fenced, confirmed
        visible), then record it in the tally; nothing when its encoding failed half-way."""
        metrics = self._commit(item)
        if metrics is not None:
            self.tally.committed_as(item.version, metrics)

    # -- the mode's own steps -------------------------------------------------------------
    def encode(self, state: Mapping[str, torch.Tensor], version: int) -> None:
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
        elif isinstance(self.snapshot, DeviceSnapshot):
            ex = self.snapshot.extract(state, version)  # the changes in host memory: encoded in the background
            item = PendingVersion(
                version=version, base_version=ex.base_version, state_digest=ex.target_state_digest,
                base_state_digest=ex.base_state_digest, digests=dict(ex.target_digests),
                base_digests=dict(ex.base_digests), changes=ex.changes, delta=None, anchor_dir=None,
                metrics={"diff_s": ex.diff_s, "snapshot_device": self.snapshot.where}, unencoded=ex,
            )
            if self.anchors.due(version):  # the delta bytes count once encoded (`_encode_late`)
                self.write_anchor(item)
            item.queued_at = time.perf_counter()
        elif isinstance(self.snapshot, PartedSnapshot):
            with PartStream(self.queue, self.snapshot, version) as stream:
                item = stream.encode(state)
                self._seal(item)
            if not stream.streamed:
                self._enqueue(item)
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

    def _resume_newest(self, state: Mapping[str, torch.Tensor], commits: list[CommitRecord] | None = None) -> None:
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
        # the key set its first publish() had, and the run's digest algorithm (a run begun with "xxh3" keeps it)
        snap = self.new_snapshot(self.cast(checkpoint_state(state)), newest.version, algo_of(newest.state_digest))
        if snap.state_digest != newest.state_digest:
            raise PatchMismatchError(
                f"the weights given to resume() have state digest {snap.state_digest}, but version "
                f"{newest.version} of {self.url} has {newest.state_digest}",
                hint="load the run's newest version first (`sparsesync pull`)",
            )
        self.stand_at(snap, AnchorHistory.of(commits))

    def stand_at(self, snap: Snapshot | PartedSnapshot | DeviceSnapshot, history: AnchorHistory) -> None:
        """Continue from `snap`, a version the run trusts (`resume`, a rewind), whose anchors
        `history` describes: the next `publish` is a delta against it."""
        self.snapshot = snap
        self.anchors.resume_from(history)

    def write_anchor(self, item: PendingVersion) -> None:
        """Serialize the snapshot (which holds `item`'s version) as `item`'s anchor, to staging."""
        assert self.snapshot is not None
        t0 = time.perf_counter()
        d = self.staging / f"anchor-{item.version}-{item.uid}"
        files = write_anchor(self.snapshot.state, d, version=item.version, algo=self.snapshot.algo)
        item.anchor_dir = d
        self.anchors.anchored(item.version, sum(f.stat().st_size for f in files))
        item.metrics["anchor_bytes"] = self.anchors.anchor_bytes
        item.metrics["anchor_write_s"] = time.perf_counter() - t0

    def _commit(self, item: PendingVersion) -> dict[str, Any] | None:
        """`upload`: store `item`'s objects, then its commit record (fenced, confirmed visible);
        the commit's metrics, or None when its encoding failed half-way (nothing committed)."""
        if item.unencoded is not None:
            self._encode_late(item)
        t0 = time.perf_counter()
        adapter = self.tally.adapter
        refs: list[PartRef] = []
        if item.parts is not None:
            base = item.base_version
            assert base is not None
            refs = [
                self.commits.put_part(base, item.version, item.uid, part) for part in self.queue.encoded_parts(item)
            ]
            if item.failed:
                return None  # encoding failed half-way (publish() raised it): nothing to commit
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

    def _encode_late(self, item: PendingVersion) -> None:
        """Uploader thread: entropy code a version extracted on a device (`DeviceSnapshot`), in
        version order before its objects are stored; a failure stops the publisher as a failed
        upload does (raised from the next `publish`/`flush`), nothing of the version committed."""
        assert item.unencoded is not None
        # how long after `publish` returned the coding began (>= 0: it overlapped the caller's next step)
        item.metrics["encode_wait_s"] = time.perf_counter() - item.queued_at
        try:
            enc = item.unencoded.encode()
        except Exception as e:
            raise SparsesyncError(f"encoding version {item.version} for {self.url} failed in the background: {e!r}",
                                  hint="start a new Publisher (its first version is an anchor)") from e
        item.delta, item.unencoded = enc.data, None
        item.metrics.update(enc.stats.to_dict())
        self.anchors.add_delta(len(enc.data))

    def new_snapshot(
        self, state: Mapping[str, torch.Tensor], version: int, algo: str = DEFAULT_ALGO
    ) -> Snapshot | PartedSnapshot | DeviceSnapshot:
        """The snapshot of `state` as `version` (in parts when the state is larger than one part),
        digested with `algo` (new runs: `DEFAULT_ALGO`; a resumed run: its own); beside the
        weights when `snapshot_place` says so (one delta file per version, coded in the background)."""
        place = snapshot_place(state, self.config.snapshot, algo)
        self.tally.snapshot_device = "cpu" if place == "cpu" else None
        if place != "cpu":
            snap = DeviceSnapshot(state, version, placement="device" if place == "device" else "host",
                                  effort=self.config.effort, algo=algo)
            self.tally.snapshot_device = snap.where
            return snap
        # a model that fits in one part is one delta file per version: a parts list would only add
        # an entry per tensor to every commit record (5.5 KB per version for a 23M-parameter model)
        if self.config.part_bytes and state_nbytes(state) > self.config.part_bytes:
            return PartedSnapshot.whole(state, version, self.config.part_bytes, effort=self.config.effort, algo=algo)
        return Snapshot(state, version, effort=self.config.effort, algo=algo)

    # -- internals --------------------------------------------------------------------
    def _pick_dtype(self, state: Any) -> None:
        """No `dtype=` given: at the first publish/resume, publish an fp32 master in the 16-bit
        dtype its config.json declares (`served_dtype`), for the rest of the run."""
        adapter_run = self.tally.adapter is not None or getattr(self.tally.newest, "adapter", None) is not None
        if self._dtype_picked or adapter_run or not isinstance(state, Mapping):
            return
        self._dtype_picked = True
        if self.config.dtype is None and (dtype := served_dtype(self.files.get("config.json"), state)) is not None:
            self.config.dtype = dtype
            log.info("publishing the fp32 state as %s, the dtype its config.json declares (replicas serve it); "
                     "Publisher(dtype=torch.float32) keeps fp32", str(dtype).removeprefix("torch."))

    def _seal(self, item: PendingVersion) -> None:
        """A delta in parts is encoded: count its bytes, and serialize an anchor when one is due."""
        self.anchors.add_delta(int(item.metrics["patch_bytes"]))
        if self.anchors.due(item.version):
            self.write_anchor(item)

    def _enqueue(self, item: PendingVersion) -> None:
        self.queue.put(item, self.write_anchor)


def snapshot_place(state: Mapping[str, torch.Tensor], wanted: str | None, algo: str) -> str:
    """Where a whole-state writer keeps its snapshot (`config.SNAPSHOT_PLACES`): "cpu", or
    "device"/"host" (a `DeviceSnapshot`). Picked (None, "auto"): "cpu" for CPU weights and for a
    run digested with another algorithm than the device computes (a resumed "xxh3" run), else
    "device" when the model fits twice in the GPU's free memory, else "host"."""
    if wanted == "cpu" or algo != DEFAULT_ALGO or not state:
        return "cpu"
    if wanted in ("device", "host"):
        return wanted
    if weights_device(state).type == "cpu":
        return "cpu"
    return placement_for(state)
