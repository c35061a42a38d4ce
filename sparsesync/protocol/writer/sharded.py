"""Sharded encoding: on every rank of a torch.distributed trainer, each rank diffs, encodes and uploads its own shard.

Under an initialized `torch.distributed` process group (world size > 1), or given `group=`,
`Publisher(url)` on every rank is one rank of a distributed writer. The first `publish` decides
the mode, alike on every rank: with DTensors in the state, the ranks set up the groups below (a
collective: every rank must publish) and publish in shards (`ShardedState`); without (DDP,
replicated weights), rank 0 publishes exactly as a single process does (`WholeState`) and the
other ranks' calls do nothing, so a publisher created on rank 0 only (TRL's
`is_world_process_zero`) still works. `publish(model.state_dict(), step)` takes DTensor values
sharded on dim 0 over a 1-D mesh (FSDP2 `fully_shard`) and plain tensors:

- each rank keeps a snapshot of only its rows of every DTensor and diffs and encodes only those
  (memory and time per rank about 1/N of the model), as parts over `name[start:stop]` units in
  global coordinates (`sparsesync.protocol.writer.parts`); plain (replicated) tensors are published by
  rank 0 only. The key set is the checkpoint's, as a single-process publisher's
  (`checkpoint_shards`): tied names once (FSDP2 gives them DTensors over one local storage),
  runtime-fused MoE experts per expert (each a whole tensor of the rank whose rows hold that
  expert), tensors a later state leaves out (frozen) from the previous version.
- each rank uploads its parts in the background as they are encoded; then one collective
  (`all_gather_object` on a gloo group of our own) carries every rank's part references and
  digests to rank 0, which writes the commit record (fenced as a single-process writer is) and
  broadcasts the outcome. If any rank failed or died before its parts were stored, no commit is
  written and every surviving rank raises RankFailedError from its next `publish`/`flush`
  (a dead rank is noticed by gloo at once, or after `dist_timeout_s`).
- anchors (the first version, then as `anchor_every`/`anchor_fraction` say, decided alike on
  every rank from all ranks' byte counts) are sharded: each tensor is gathered whole to one rank
  only, and every rank writes its tensors as one file of a transformers-loadable sharded
  checkpoint (`model-0000k-of-0000n.safetensors`); rank 0 adds `model.safetensors.index.json` at
  commit (`sparsesync.protocol.writer.anchor_shards`; no rank holds the whole model). Such a version is
  an anchor only, without parts.
- when uploads lag, versions are coalesced as a single-process publisher's are, decided alike
  on every rank (every rank must commit the same versions): when some rank has `queue_size`
  versions waiting and every rank still has the previous version waiting (not started), every
  rank merges the new version into it (B->N-1 and N-1->N become B->N, part by part; N-1 is never
  committed). Otherwise (an anchor is due, or some rank already uploads N-1) `publish` waits
  while `queue_size` versions wait for upload. Deciding costs nothing extra: it rides on the
  all_reduce that decides anchors.

A new writer continues a sharded run with an anchor (its first version), at any world size; with
`resume(model.state_dict())` its first version is a delta, at any world size, once the weights are
checked to be the run's newest version (PatchMismatchError on all ranks when they are not): at the
world size that wrote it (same units), the digests of every rank's units must make up its state
digest; otherwise (another world size, or an anchor) the weights are hashed over that version's
own units, each tensor gathered to one rank as for an anchor. `state_digest` is the global digest
of the newest committed version (after `flush()`; ConfigError before).

This module is the mode (`ShardedState`, a `mode.WriterMode`: publish, resume, encode); each
rank's uploads and rank 0's commit are in `writer.sharded_commit` (the uploader's thread), what
each rank holds and the collectives that gather across ranks in `writer.ranks`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sparsesync.checkpoint import check_key_set, shared_aliases
from sparsesync.codec import state_digest, tensor_digest
from sparsesync.codec.anchor import write_anchor_shard
from sparsesync.errors import ConfigError, RunNotFoundError, SparsesyncError
from sparsesync.protocol.records import Unit
from sparsesync.protocol.writer.anchors import AnchorHistory
from sparsesync.protocol.writer.mode import WriterContext, WriterMode
from sparsesync.protocol.writer.parts import PartedSnapshot, group_by_bytes
from sparsesync.protocol.writer.ranks import (
    Ranks,
    ShardedTensor,
    anchor_plan,
    checkpoint_shards,
    collective,
    digests_over,
    gather_whole,
    local_units,
    shard_rows,
)
from sparsesync.protocol.writer.rewind import check_checkpoint, resume_info
from sparsesync.protocol.writer.sharded_commit import ShardCommits, anchor_folder
from sparsesync.protocol.writer.stream import PartStream
from sparsesync.protocol.writer.uploads import PendingVersion, coalesce

log = logging.getLogger(__name__)


class ShardedState:
    """The sharded writer mode of one rank (see the module docstring). Creating it is a
    collective (every rank of `ranks` creates it, at its first `publish` or `resume`): our own
    gloo groups (one for the caller's thread, one for the uploader; never the trainer's), and
    rank 0's epoch, writer id and tied names for all (rank 0 holds rows of every non-empty
    tensor, so it sees every tie; a rank with an empty shard could not, and every rank must plan
    the same key set)."""

    def __init__(self, state: Mapping[str, torch.Tensor], *, ranks: Ranks, ctx: WriterContext) -> None:
        self.r, self.ctx, self.config, self.run, self.commits = ranks, ctx, ctx.config, ctx.run, ctx.commits
        self.queue, self.anchors, self.staging, self.tally = ctx.queue, ctx.anchors, ctx.staging, ctx.tally
        self.url = self.run.store.url
        self.snapshot: PartedSnapshot | None = None  # this rank's units of the last published (or resumed) version
        self.published = self.committed = ctx.tally.committed  # the last version published here, the newest committed
        self.committed_digest: str | None = None  # the global state digest of `committed`
        self.key_set: list[ShardedTensor] | None = None  # the run's tensors (from the first version), no data
        timeout = timedelta(seconds=self.config.dist_timeout_s)
        self._ctl = dist.new_group(ranks=list(ranks.ranks), backend="gloo", timeout=timeout)
        up = dist.new_group(ranks=list(ranks.ranks), backend="gloo", timeout=timeout)
        got: list[Any] = [(self.commits.epoch, self.commits.writer, shared_aliases(state) if ranks.rank == 0 else None)]
        dist.broadcast_object_list(got, src=ranks.src, group=self._ctl)
        self.commits.epoch, self.commits.writer, self.aliases = got[0]
        self._uploads = ShardCommits(ranks=ranks, group=up, config=self.config, commits=self.commits, files=ctx.files,
                                     queue=self.queue, staging=self.staging, url=self.url)
        self.queue.start(self.upload)

    @property
    def state_digest(self) -> str | None:
        """The global state digest of the newest version, once committed (ConfigError before)."""
        if self.published is not None and self.published != self.committed:
            raise ConfigError(f"the state digest of version {self.published} is known once it is committed",
                              hint="call flush() first: a sharded version's digest covers every rank's part")
        return self.committed_digest

    # -- the writer interface (`mode.WriterMode`) -------------------------------------------
    def settle(self, state: Mapping[str, torch.Tensor] | Any) -> WriterMode:
        """Itself: decided."""
        return self

    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None) -> int:
        """Publish this rank's share of `state` as version `step` (None: the next one; every rank
        calls it with the same step), full weights only. Returns after diff+encode (and, on anchor
        versions, the gather of its tensors)."""
        if self.tally.adapter is not None:
            raise ConfigError("a sharded publisher publishes full weights only, not a LoRA adapter run",
                              hint="publish the adapter from rank 0 alone (Publisher(url, group=None)): it is small")
        self.ctx.check_open()
        version = self.tally.next_version(step)
        self.encode(state, version)
        self.tally.last = version
        return version

    def resume(self, state: Mapping[str, torch.Tensor] | Any, version: int | None) -> None:
        """`resume_shards`, then the publisher stands at the version it resumed (or rewound) to."""
        self.resume_shards(state, version)
        if self.published is not None and self.published != self.tally.last:  # a rewind, committed
            self.tally.committed = self.tally.last = self.published

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        """`held_version` (a collective, on every rank)."""
        return self.held_version(state)

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        """ConfigError: only a single process continues below the newest version."""
        raise ConfigError(f"a distributed publisher cannot continue {self.url} below its newest version",
                          hint="resume from the run's newest version, or publish to a new run URL")

    def upload(self, item: PendingVersion) -> None:
        """Uploader thread (`sharded_commit.ShardCommits.upload`): this rank's objects, one
        collective, rank 0's commit; then the version is committed here too (RankFailedError: nowhere)."""
        metrics, digest = self._uploads.upload(item)
        self.committed, self.committed_digest = item.version, digest
        self.tally.committed_as(item.version, metrics)

    # -- the mode's own steps -------------------------------------------------------------
    def encode(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Diff and encode this rank's share of `state` as `version` and queue it (every rank
        calls it with the same version). Returns after diff+encode (and, on anchor versions, the
        gather to rank 0)."""
        rank, world = self.r.rank, self.r.world
        tensors = self._with_frozen(checkpoint_shards(state, rank, world, self.aliases))
        local, units = local_units(tensors, rank, world)
        pinned = self.queue.take_newest(self.published) if self.snapshot is not None else None
        anchor, merge = (True, False) if self.snapshot is None else self._plan(version, pinned)
        if pinned is not None and not merge:
            self.queue.append(pinned)  # back where it was: the uploader takes it in turn
        if not merge:
            self.queue.wait_for_room()
        if anchor:
            item = PendingVersion(version=version, base_version=None, state_digest="", base_state_digest=None,
                                  digests={}, base_digests=None, changes=None, delta=None, anchor_dir=None, metrics={})
            t0 = time.perf_counter()
            self.snapshot = self._shard_snapshot(local, units, version)
            item.metrics["snapshot_s"] = time.perf_counter() - t0
            self.anchors.anchored(version, self._write_anchor_shard(item, tensors))
            item.digests = self.snapshot.digests
            self.queue.append(item)
        else:
            assert self.snapshot is not None
            after = pinned if merge else None

            with PartStream(self.queue, self.snapshot, version, after=after) as stream:
                item = stream.encode(local)
                self.anchors.add_delta(int(item.metrics["patch_bytes"]))
            if not stream.streamed:
                self.queue.append(item if after is None else coalesce(after, item))
        self.published = version

    def resume_shards(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Continue the run from its newest committed version, whose weights `state` holds (a
        collective, on every rank): the next `publish` is a delta against it once the weights are
        checked to be that version; PatchMismatchError on every rank when they are not. When that
        version is in parts over the same units (written at this world size), every rank's unit
        digests make up its state digest; over other units (another world size's rows, or whole
        tensors: an anchor, or a single process's version) the weights are hashed over its units
        (`ranks.digests_over`: each tensor gathered to one rank, as for an anchor, but nothing written
        or uploaded). The delta is over this world's units.

        `version` below the newest: a rewind (`writer.rewind`, docs/protocol.md
        "Rewinds"): the weights are checked against the run's trusted `version` (when it has one)
        as above, then the rewind commit `(version, epoch)` is written (that version's own anchor
        when it has one of whole tensors, else a new sharded anchor of `state`) before this returns."""
        if self.snapshot is not None:
            raise ConfigError("resume() must come before the first publish()")
        rank, world = self.r.rank, self.r.world
        tensors = checkpoint_shards(state, rank, world, self.aliases)
        self.key_set = [replace(t, local=None) for t in tensors]
        snap = self._shard_snapshot(*local_units(tensors, rank, world), 0)
        info = resume_info(self.run, version) if rank == 0 else None
        got: list[Any] = [None] * world
        with collective(f"resume() of {self.url}"):
            dist.all_gather_object(got, (snap.digests, info), group=self._ctl)
        info = got[0][1]
        if info is None:
            raise RunNotFoundError(f"nothing to resume under {self.url}", hint="publish() starts a run")
        if isinstance(info, SparsesyncError):
            raise info  # refused alike on every rank, nothing written
        own = {k: d for held, _ in got for k, d in held.items()}
        target = info["target"]
        if target is not None:
            digest = state_digest(self._digests_over(tensors, own, target["units"], info["version"]))
            # a match over this world's own units names the version too (no other unit set is hashed)
            check_checkpoint(self.url, info["commits"], info["version"], digest, also=state_digest(own),
                             what=f"the weights given to resume() on {world} ranks")
        n = info["version"]
        snap.version = n
        for sub in snap.snapshots:
            sub.version = n
        if info["rewind"] is None:
            self.snapshot = snap
            self.anchors.resume_from(info["history"], with_bytes=rank == 0)  # summed over ranks by `_plan`
            self.committed_digest = target["state_digest"]
            return
        # a rewind: the commit (n, epoch), through the uploader as any version, before training goes on
        item = PendingVersion(version=n, base_version=None, state_digest="", base_state_digest=None,
                              digests=snap.digests, base_digests=None, changes=None, delta=None, anchor_dir=None,
                              metrics={"_rewind": info["rewind"]})
        if info["rewind"]["anchor"] is None:  # nothing to reuse: a sharded anchor of the checkpoint
            self.anchors.anchored(n, self._write_anchor_shard(item, tensors))
        else:
            self.anchors.resume_from(AnchorHistory(n, info["rewind"]["anchor_bytes"], 0), with_bytes=rank == 0)
        self.snapshot = snap
        self.queue.append(item)
        self.queue.flush()
        self.queue.raise_error()
        self.published = n

    def held_version(self, state: Mapping[str, torch.Tensor]) -> int | None:
        """The newest trusted version whose weights `state` holds, or None (a collective, before the
        first publish): the weights are hashed over each set of units the run's commits use (this
        world's rows: the ranks' own digests; others: `_digests_over`), nothing written."""
        tensors = checkpoint_shards(state, self.r.rank, self.r.world, self.aliases)
        local, _units = local_units(tensors, self.r.rank, self.r.world)
        listing = [(c.version, c.state_digest, sorted((u for p in c.parts for u in p.units), key=lambda u: u.key)
                    if c.parts else None) for c in self.run.commits()] if self.r.rank == 0 else None
        got: list[Any] = [None] * self.r.world
        with collective(f"resume() of {self.url}"):
            dist.all_gather_object(got, ({k: tensor_digest(t) for k, t in local.items()}, listing), group=self._ctl)
        own, listing = {k: d for held, _ in got for k, d in held.items()}, got[0][1]
        found: list[int] = []
        for units in {repr(u): u for _v, _d, u in listing}.values():  # alike on every rank: rank 0's listing
            digest = state_digest(self._digests_over(tensors, own, units, listing[-1][0]))
            found += [v for v, d, u in listing if u == units and d == digest]
        return max(found, default=None)

    def _digests_over(self, tensors: list[ShardedTensor], own: dict[str, str], units: list[Unit] | None,
                      version: int) -> dict[str, str]:
        """The weights' digests over `units` (None: whole tensors): the ranks' own digests when
        those are this world's units, else hashed over them (a collective)."""
        if units is not None and [u.key for u in units] == sorted(own):
            return own
        # another world size's rows, or whole tensors (an anchor, or a single process's version)
        t0 = time.perf_counter()
        with collective(f"resume() of {self.url}"):
            digests = digests_over(tensors, units or [Unit(t.name) for t in tensors], self.r, self._ctl)
        log.info("resume(): version %d of %s covers other units (another world size, or whole tensors): "
                 "checked the weights over its units in %.1f s; the first version is a delta over this "
                 "world's units", version, self.url, time.perf_counter() - t0)
        return digests

    # -- internals --------------------------------------------------------------------
    def _shard_snapshot(self, local: dict[str, torch.Tensor], units: list[Unit], version: int) -> PartedSnapshot:
        """This rank's `units` (tensors `local`, by `Unit.key`) as the snapshot of `version`, in parts of
        `part_bytes`."""
        by_key = {u.key: u for u in units}
        groups = [[by_key[k] for k in g] for g in group_by_bytes(local, self.config.part_bytes or (1 << 62))]
        return PartedSnapshot(groups, local, version, effort=self.config.effort)

    def _with_frozen(self, tensors: list[ShardedTensor]) -> list[ShardedTensor]:
        """`tensors` in the run's key set, as `checkpoint_state` completes a whole state: the first
        version sets it; later, tensors the state lacks (frozen, left out by the caller) are this
        rank's share of the previous version (the snapshot), and names the run lacks raise ConfigError
        on every rank alike (names are global) before anything is published."""
        if self.key_set is None or self.snapshot is None:
            self.key_set = [replace(t, local=None) for t in tensors]
            return tensors
        given = {t.name: t for t in tensors}
        check_key_set(given, (t.name for t in self.key_set))
        held = self.snapshot.state
        out = []
        for t in self.key_set:
            if t.name in given:
                out.append(given[t.name])
            elif t.holder is None:
                start, stop = shard_rows(t.shape[0], self.r.rank, self.r.world)
                empty = torch.empty((0, *t.shape[1:]), dtype=t.dtype)
                out.append(replace(t, local=held[Unit(t.name, (start, stop)).key] if stop > start else empty))
            else:
                out.append(replace(t, local=held[t.name] if t.holder == self.r.rank else None))
        return out

    def _write_anchor_shard(self, item: PendingVersion, tensors: list[ShardedTensor]) -> int:
        """Every rank: gather the tensors the plan gives this rank, whole, and write them as its
        file of the anchor of `item` (`anchor_shards`); the file's size (0: none here). A failure
        after the collectives is reported at commit, so every rank raises it."""
        t0 = time.perf_counter()
        plan = anchor_plan(tensors, self.r.world)
        mine: dict[str, torch.Tensor] = {}
        with collective(f"anchor of version {item.version} of {self.url}"):
            got: list[Any] = [item.uid]
            dist.broadcast_object_list(got, src=self.r.src, group=self._ctl)  # one folder for every rank's file
            item.uid = got[0]
            for t, whole in gather_whole(tensors, plan, self.r, self._ctl):
                # a tensor held whole is copied: experts are views of one fused tensor, which safetensors refuses
                mine[t.name] = whole if t.holder is None else whole.detach().to("cpu", copy=True).contiguous()
        item.metrics["_anchor_plan"], item.metrics["_anchor_digests"] = plan, {}
        nbytes = 0
        if self.r.rank in plan.files:
            try:
                path = anchor_folder(self.staging, item) / plan.files[self.r.rank]
                item.metrics["_anchor_digests"] = write_anchor_shard(mine, path, version=item.version,
                                                                     alone=len(plan.files) == 1)
                nbytes = path.stat().st_size
            except Exception as e:  # noqa: BLE001 - reported at commit, raised on every rank
                item.metrics["_anchor_error"] = f"writing its anchor file failed: {type(e).__name__}: {e}"
        item.metrics["anchor_bytes"] = nbytes
        item.metrics["anchor_write_s"] = time.perf_counter() - t0
        return nbytes

    def _plan(self, version: int, pinned: PendingVersion | None) -> tuple[bool, bool]:
        """(anchor, merge) for `version`, alike on every rank (one all_reduce): the anchor rule on
        all ranks' delta bytes and rank 0's anchor size; and, for a delta, whether it is merged
        into the previous version (`pinned`, which then is never committed). That happens when
        some rank has `queue_size` versions waiting and every rank still has the previous one
        waiting: uploads lag, and training goes on instead of waiting for them."""
        full = self.queue.waiting + (pinned is not None) >= self.config.queue_size
        t = torch.tensor([float(self.anchors.delta_bytes), float(self.anchors.anchor_bytes), float(full),
                          float(pinned is not None)], dtype=torch.float64)
        with collective(f"version {version} of {self.url} not published"):
            dist.all_reduce(t, group=self._ctl)
        if self.anchors.due(version, delta_bytes=float(t[0]), anchor_bytes=float(t[1])):
            return True, False
        return False, float(t[2]) > 0 and int(t[3]) == self.r.world
