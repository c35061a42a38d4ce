"""The publisher on every rank of a distributed trainer: each rank diffs, encodes and uploads its own shard.

Under an initialized `torch.distributed` process group, `Publisher(url)` (or `Publisher(url,
group=g)`) on every rank is a `DistributedPublisher`. `publish(model.state_dict(), step)` takes
DTensor values sharded on dim 0 over a 1-D mesh (FSDP2 `fully_shard`) and plain tensors:

- each rank keeps a snapshot of only its rows of every DTensor and diffs and encodes only those
  (memory and time per rank about 1/N of the model), as parts over `name[start:stop]` units in
  global coordinates (`sparsesync.protocol.parts`); plain (replicated) tensors are published by
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
  commit (`sparsesync.protocol.anchor_shards`; no rank holds the whole model). Such a version is
  an anchor only, without parts.
- when uploads lag, versions are coalesced as a single-process publisher's are, decided alike
  on every rank (every rank must commit the same versions): when some rank has `queue_size`
  versions waiting and every rank still has the previous version waiting (not started), every
  rank merges the new version into it (B->N-1 and N-1->N become B->N, part by part; N-1 is never
  committed). Otherwise (an anchor is due, or some rank already uploads N-1) `publish` waits
  while `queue_size` versions wait for upload. Deciding costs nothing extra: it rides on the
  all_reduce that decides anchors.

The first `publish` decides the mode, alike on every rank: with DTensors in the state, the
ranks set up the groups above (a collective: every rank must publish); without (DDP, replicated
weights), rank 0 publishes exactly as a single-process `Publisher` and the other ranks' calls do
nothing, so a publisher created on rank 0 only (TRL's `is_world_process_zero`) still works.

A new writer continues a sharded run with an anchor (its first version), at any world size; with
`resume(model.state_dict())` its first version is a delta, at any world size, once the weights are
checked to be the run's newest version (PatchMismatchError on all ranks when they are not): at the
world size that wrote it (same units), the digests of every rank's units must make up its state
digest; otherwise (another world size, or an anchor) the weights are hashed over that version's
own units, each tensor gathered to one rank as for an anchor. `state_digest` is
the global digest of the newest committed version (after `flush()`; ConfigError before).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sparsesync.checkpoint import EXPERT_KEY, check_key_set, check_tied, shared_aliases, split_fused_experts
from sparsesync.codec import state_digest, tensor_digest
from sparsesync.codec.anchor import write_anchor_index, write_anchor_shard
from sparsesync.errors import (
    ConfigError,
    PatchMismatchError,
    RankFailedError,
    RunNotFoundError,
    SparsesyncError,
    StoreUnavailableError,
)
from sparsesync.protocol.anchor_shards import AnchorPlan, assign, gather_rows
from sparsesync.protocol.keys import commit_key
from sparsesync.protocol.parts import PartedSnapshot, group_by_bytes
from sparsesync.protocol.publisher import Publisher, PublisherConfig, _Item, _wait_to_retry
from sparsesync.protocol.records import CommitRecord, ObjectRef, PartRef, Unit

log = logging.getLogger(__name__)
_STORE_TRIES = 5  # store outages retried (with backoff) before a rank reports failure to the others
_RANK_DIED = "a rank of the trainer died or hung; restart the job"


@contextlib.contextmanager
def _collective(what: str, lost: str = "a rank did not join", hint: str = _RANK_DIED) -> Iterator[None]:
    """Turn a failed collective (gloo: a peer died or timed out) into RankFailedError("`what`: `lost` (cause)")."""
    try:
        yield
    except RuntimeError as e:
        raise RankFailedError(f"{what}: {lost} ({e})", hint=hint) from None


def wants_distributed(group: Any) -> bool:
    """Whether a Publisher created now is one rank of a distributed publisher."""
    if group is not None:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The dim-0 rows [start, stop) of `rank` when `rows` are split as torch.chunk (FSDP2) splits them."""
    chunk = math.ceil(rows / world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


@dataclass(frozen=True)
class ShardedTensor:
    """One tensor of the checkpoint's key set as this rank holds it (alike on every rank but `local`)."""

    name: str  # its checkpoint name
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    holder: int | None  # the rank holding it whole; None: every rank holds its dim-0 rows (shard_rows)
    local: torch.Tensor | None  # this rank's rows (holder None), or the whole tensor where holder is this rank

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def checkpoint_shards(state: Mapping[str, torch.Tensor], rank: int, world: int,
                      aliases: Mapping[str, str]) -> list[ShardedTensor]:
    """`state` in the checkpoint's own key set, as `checkpoint.checkpoint_state` maps a whole state
    (in its order), with what this rank holds of each tensor:

    - the names of `aliases` (tied weights, found once by `checkpoint.shared_aliases`) are left out,
      after checking they still hold their kept tensor's values (`checkpoint.check_tied`);
    - a DTensor sharded on dim 0 of a 1-D mesh: its local rows, holder None; but runtime-fused MoE
      experts ([experts, ...]: dim 0 is the expert) are split per expert (`split_fused_experts`),
      each a whole tensor held by the rank whose rows hold that expert;
    - a plain tensor is replicated: held by rank 0 (fused experts split there too).

    Other placements raise ConfigError.
    """
    from torch.distributed.tensor import DTensor, Shard

    check_tied(state, aliases)
    out: list[ShardedTensor] = []
    for name, v in state.items():
        if name in aliases:
            continue
        if not isinstance(v, DTensor):
            for n, t in (split_fused_experts(name, v) or {name: v}).items():
                out.append(ShardedTensor(n, tuple(t.shape), t.dtype, 0, t.detach() if rank == 0 else None))
            continue
        if v.device_mesh.ndim != 1 or tuple(v.placements) != (Shard(0),):
            raise ConfigError(
                f"tensor {name!r}: DTensor placements {list(v.placements)} on a {v.device_mesh.ndim}-D mesh; "
                "the distributed publisher takes dim-0 shards on a 1-D mesh (FSDP2 fully_shard)",
                hint="shard with fully_shard on a 1-D mesh, or publish a full state dict from one process",
            )
        rows = v.shape[0]
        start, stop = shard_rows(rows, rank, world)
        local = v.to_local().detach()
        if local.shape[0] != stop - start:
            raise ConfigError(
                f"tensor {name!r}: rank {rank} holds {local.shape[0]} rows, expected [{start}, {stop}) "
                f"of {rows} (torch.chunk's split over {world} ranks)",
                hint="the distributed publisher expects FSDP2's even dim-0 sharding",
            )
        whole = split_fused_experts(name, torch.empty(tuple(v.shape), dtype=v.dtype, device="meta"))
        if whole is None:
            out.append(ShardedTensor(name, tuple(v.shape), v.dtype, None, local))
            continue
        mine = split_fused_experts(name, local, first=start) or {}
        chunk = math.ceil(rows / world)
        for n, t in whole.items():
            holder = int(EXPERT_KEY.match(n)["e"]) // chunk  # type: ignore[index]
            out.append(ShardedTensor(n, tuple(t.shape), v.dtype, holder, mine.get(n)))
    return out


def local_units(tensors: list[ShardedTensor], rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[Unit]]:
    """This rank's units of `tensors` and their local tensors by `Unit.key`: its rows of each
    row-sharded tensor (none when its shard is empty), and the tensors it holds whole."""
    out: dict[str, torch.Tensor] = {}
    units: list[Unit] = []
    for t in tensors:
        if t.holder is None:
            start, stop = shard_rows(t.shape[0], rank, world)
            if stop <= start:
                continue
            u = Unit(t.name, (start, stop))
        elif t.holder == rank:
            u = Unit(t.name)
        else:
            continue
        assert t.local is not None
        units.append(u)
        out[u.key] = t.local.contiguous()
    return out, units


class DistributedPublisher(Publisher):
    """One rank of a distributed publisher (see the module docstring). Same API as `Publisher`."""

    def __init__(self, url: Any, config: PublisherConfig | None = None, *, group: Any = None, **overrides: Any) -> None:
        self._group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self._group)
        self.world = dist.get_world_size(self._group)
        self._ranks = dist.get_process_group_ranks(self._group)
        self._src = self._ranks[0]
        self._sharded: bool | None = None  # decided by the first publish(): DTensors or not
        self._committed_digest: str | None = None  # sharded: the global state digest of `committed_version`
        self._aliases: dict[str, str] = {}  # sharded: tied names left out (alias -> name kept), rank 0's, from `_setup`
        self._key_set: list[ShardedTensor] | None = None  # sharded: the run's tensors (from the first version), no data
        super().__init__(url, config, **overrides)  # rank 0 claims the epoch here; no collective yet

    def _setup(self, state: Mapping[str, torch.Tensor]) -> None:
        """First sharded publish, on every rank: our own gloo groups (one for the caller's thread,
        one for the uploader; never the trainer's), and rank 0's epoch, writer id and tied names
        for all (rank 0 holds rows of every non-empty tensor, so it sees every tie; a rank with an
        empty shard could not, and every rank must plan the same key set)."""
        timeout = timedelta(seconds=self.config.dist_timeout_s)
        self._ctl = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        self._up = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        got: list[Any] = [(self.epoch, self.writer, shared_aliases(state) if self.rank == 0 else None)]
        dist.broadcast_object_list(got, src=self._src, group=self._ctl)
        self.epoch, self.writer, self._aliases = got[0]

    # -- publish ----------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor], step: int | None = None) -> int:
        """Publish this rank's share of `state` as version `step` (every rank calls it with the
        same step). Returns after diff+encode (and, on anchor versions, the gather to rank 0)."""
        from torch.distributed.tensor import DTensor

        if self._sharded is None:
            self._sharded = isinstance(state, Mapping) and any(isinstance(v, DTensor) for v in state.values())
            if self._sharded:
                self._setup(state)
        if self._sharded and self.adapter is not None:
            raise ConfigError("a sharded publisher publishes full weights only, not a LoRA adapter run",
                              hint="publish the adapter from rank 0 alone (Publisher(url, group=None)): it is small")
        if not self._sharded:  # replicated (DDP): rank 0 publishes it all, as one process would
            if self.rank == 0:
                return super().publish(state, step)
            # nothing is published here, so nothing is checked against the run (which rank 0 may
            # already have moved past when this rank opened it): the version rank 0 gives `step`
            self._last_version = step if step is not None else 0 if self._last_version is None else self._last_version + 1
            return self._last_version
        self._raise_background_error()
        if self._closed:
            raise ConfigError("publish() after close()")
        version = self._next_version(step)
        tensors = self._with_frozen(checkpoint_shards(state, self.rank, self.world, self._aliases))
        local, units = local_units(tensors, self.rank, self.world)
        pinned = self._pin_newest() if self._snapshot is not None else None
        anchor, merge = (True, False) if self._snapshot is None else self._plan(version, pinned)
        if pinned is not None and not merge:
            with self._cv:
                self._pending.append(pinned)  # back where it was: the uploader takes it in turn
                self._cv.notify_all()
        if not merge:
            self._wait_for_room()
        if anchor:
            item = _Item(version=version, base_version=None, state_digest="", base_state_digest=None, digests={},
                         base_digests=None, changes=None, delta=None, anchor_dir=None, metrics={})
            t0 = time.perf_counter()
            self._snapshot = self._shard_snapshot(local, units, version)
            self._last_anchor_version, self._delta_bytes_since_anchor = version, 0
            item.metrics["snapshot_s"] = time.perf_counter() - t0
            self._write_anchor_shard(item, tensors)
            item.digests = self._snapshot.digests
            self._enqueue(item)
        else:
            self._publish_parts(local, version, after=pinned if merge else None)
        self._last_version = version
        return version

    def resume(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue the run from its newest committed version, whose weights `state` holds.

        Replicated weights: rank 0 resumes as one process does. Sharded (a collective, on every
        rank): the next `publish` is a delta against the run's newest version once the weights
        are checked to be that version, and PatchMismatchError is raised on every rank when they
        are not. When that version is in parts over the same units (written at this world size),
        every rank's unit digests make up its state digest; over other units (another world
        size's rows, or whole tensors: an anchor, or a single process's version) the weights are
        hashed over its units (`_digests_over`: each tensor gathered to one rank, as for an
        anchor, but nothing written or uploaded). The delta is over this world's units."""
        from torch.distributed.tensor import DTensor

        if not any(isinstance(v, DTensor) for v in state.values()):
            self._sharded = False
            if self.rank == 0:
                super().resume(state)
            return
        if self._snapshot is not None or self._sharded is not None:
            raise ConfigError("resume() must come before the first publish()")
        self._sharded = True
        self._setup(state)
        tensors = checkpoint_shards(state, self.rank, self.world, self._aliases)
        self._key_set = [replace(t, local=None) for t in tensors]
        snap = self._shard_snapshot(*local_units(tensors, self.rank, self.world), 0)
        info = self._newest_info() if self.rank == 0 else None
        got: list[Any] = [None] * self.world
        with _collective(f"resume() of {self.store.url}"):
            dist.all_gather_object(got, (snap.digests, info), group=self._ctl)
        info = got[0][1]
        if info is None:
            raise RunNotFoundError(f"nothing to resume under {self.store.url}", hint="publish() starts a run")
        digests = {k: d for held, _ in got for k, d in held.items()}
        if info["units"] is None or [u.key for u in info["units"]] != sorted(digests):
            # another world size's rows, or whole tensors (an anchor, or a single process's version):
            # hash the weights over the newest version's own units
            t0 = time.perf_counter()
            digests = self._digests_over(tensors, info["units"] or [Unit(t.name) for t in tensors])
            log.info("resume(): version %d of %s covers other units (another world size, or whole tensors): "
                     "checked the weights over its units in %.1f s; the first version is a delta over this "
                     "world's units", info["version"], self.store.url, time.perf_counter() - t0)
        if state_digest(digests) != info["state_digest"]:
            raise PatchMismatchError(
                f"the weights given to resume() on {self.world} ranks have state digest {state_digest(digests)}, "
                f"but version {info['version']} of {self.store.url} has {info['state_digest']}",
                hint="load the run's newest version into the model on every rank first (`Run(url).reconstruct()`)",
            )
        snap.version = info["version"]
        for sub in snap.snapshots:
            sub.version = info["version"]
        self._snapshot, self._last_anchor_version = snap, info["last_anchor"]
        if self.rank == 0:  # summed over ranks by `_plan`
            self._anchor_bytes, self._delta_bytes_since_anchor = info["anchor_bytes"], info["delta_bytes"]
        self._committed_digest = info["state_digest"]

    @property
    def state_digest(self) -> str | None:
        """The global state digest of the newest version, once committed (sharded: see the module docstring)."""
        if not self._sharded:
            return super().state_digest
        if self._last_version is not None and self._last_version != self.committed_version:
            raise ConfigError(f"the state digest of version {self._last_version} is known once it is committed",
                              hint="call flush() first: a sharded version's digest covers every rank's part")
        return self._committed_digest

    # -- internals --------------------------------------------------------------------
    def _shard_snapshot(self, local: dict[str, torch.Tensor], units: list[Unit], version: int) -> PartedSnapshot:
        """This rank's `units` (tensors `local`, by `Unit.key`) as the snapshot of `version`, in parts of `part_bytes`."""
        by_key = {u.key: u for u in units}
        groups = [[by_key[k] for k in g] for g in group_by_bytes(local, self.config.part_bytes or (1 << 62))]
        return PartedSnapshot(groups, local, version, effort=self.config.effort)

    def _anchor_folder(self, item: _Item) -> Path:
        """The staging folder of the anchor files of `item` (created, and set as its `anchor_dir`)."""
        d = self._staging / f"anchor-{item.version}-{item.uid}"
        d.mkdir(parents=True, exist_ok=True)
        item.anchor_dir = d
        return d

    def _with_frozen(self, tensors: list[ShardedTensor]) -> list[ShardedTensor]:
        """`tensors` in the run's key set, as `checkpoint_state` completes a whole state: the first
        version sets it; later, tensors the state lacks (frozen, left out by the caller) are this
        rank's share of the previous version (the snapshot), and names the run lacks raise ConfigError
        on every rank alike (names are global) before anything is published."""
        if self._key_set is None or self._snapshot is None:
            self._key_set = [replace(t, local=None) for t in tensors]
            return tensors
        given = {t.name: t for t in tensors}
        check_key_set(given, (t.name for t in self._key_set))
        held = self._snapshot.state
        out = []
        for t in self._key_set:
            if t.name in given:
                out.append(given[t.name])
            elif t.holder is None:
                start, stop = shard_rows(t.shape[0], self.rank, self.world)
                empty = torch.empty((0, *t.shape[1:]), dtype=t.dtype)
                out.append(replace(t, local=held[Unit(t.name, (start, stop)).key] if stop > start else empty))
            else:
                out.append(replace(t, local=held[t.name] if t.holder == self.rank else None))
        return out

    def _newest_info(self) -> dict[str, Any] | None:
        """Rank 0, for resume(): what the run's newest version covers, and the anchor bookkeeping."""
        commits = self.run.commits()
        if not commits:
            return None
        newest = commits[-1]
        anchors = [c for c in commits if c.has_anchor]
        last = anchors[-1].version if anchors else None
        return {
            "version": newest.version, "state_digest": newest.state_digest,
            "units": sorted((u for p in newest.parts for u in p.units), key=lambda u: u.key) if newest.parts else None,
            "last_anchor": last, "anchor_bytes": sum(o.size for o in anchors[-1].anchor) if anchors else 0,
            "delta_bytes": sum(o.size for c in commits if last is not None and c.version > last for o in c.delta_objects()),
        }

    def _gathered(self, tensors: list[ShardedTensor], plan: AnchorPlan) -> Iterator[tuple[ShardedTensor, torch.Tensor]]:
        """Each tensor `plan` gives this rank, whole: a row-sharded one gathered from every rank's
        rows, one this rank holds whole as it is. Collectives: every rank iterates to the end."""
        for t in tensors:
            owner = plan.owner[t.name]
            if t.holder is None:
                assert t.local is not None
                whole = gather_rows(t.local, t.shape, t.dtype, owner, rank=self.rank, world=self.world,
                                    group=self._ctl, ranks=self._ranks)
                if whole is not None:
                    yield t, whole
            elif owner == self.rank:
                assert t.local is not None
                yield t, t.local

    def _digests_over(self, tensors: list[ShardedTensor], units: list[Unit]) -> dict[str, str]:
        """Every rank: the digest of each of `units` (another world size's rows, or whole tensors)
        from the ranks' own bytes, by `Unit.key`. Each row-sharded tensor is gathered whole to one
        rank (the anchor plan's), which hashes its units and drops it; a tensor one rank holds
        whole is hashed there. Units of tensors outside `tensors` get no digest (so the state
        digest differs). Memory: one tensor in flight per rank, as when writing an anchor."""
        by_name: dict[str, list[Unit]] = {}
        for u in units:
            by_name.setdefault(u.name, []).append(u)
        mine: dict[str, str] = {}
        with _collective(f"resume() of {self.store.url}"):
            for t, whole in self._gathered(tensors, _plan_of(tensors, self.world)):
                for u in by_name.get(t.name, ()):
                    if u.rows is None:
                        mine[u.key] = tensor_digest(whole)
                    elif whole.dim() and u.rows[1] <= whole.shape[0]:
                        mine[u.key] = tensor_digest(whole[u.rows[0] : u.rows[1]])
            got: list[Any] = [None] * self.world
            dist.all_gather_object(got, mine, group=self._ctl)
        return {k: d for part in got for k, d in part.items()}

    def _write_anchor_shard(self, item: _Item, tensors: list[ShardedTensor]) -> None:
        """Every rank: gather the tensors the plan gives this rank, whole, and write them as its
        file of the anchor of `item` (`anchor_shards`). A failure after the collectives is reported
        at commit, so every rank raises it."""
        t0 = time.perf_counter()
        plan = _plan_of(tensors, self.world)
        mine: dict[str, torch.Tensor] = {}
        with _collective(f"anchor of version {item.version} of {self.store.url}"):
            got: list[Any] = [item.uid]
            dist.broadcast_object_list(got, src=self._src, group=self._ctl)  # one folder for every rank's file
            item.uid = got[0]
            for t, whole in self._gathered(tensors, plan):
                # a tensor held whole is copied: experts are views of one fused tensor, which safetensors refuses
                mine[t.name] = whole if t.holder is None else whole.detach().to("cpu", copy=True).contiguous()
        item.metrics["_anchor_plan"], item.metrics["_anchor_digests"] = plan, {}
        self._anchor_bytes = 0
        if self.rank in plan.files:
            try:
                path = self._anchor_folder(item) / plan.files[self.rank]
                item.metrics["_anchor_digests"] = write_anchor_shard(mine, path, version=item.version,
                                                                     alone=len(plan.files) == 1)
                self._anchor_bytes = path.stat().st_size
            except Exception as e:  # noqa: BLE001 - reported at commit, raised on every rank
                item.metrics["_anchor_error"] = f"writing its anchor file failed: {type(e).__name__}: {e}"
        item.metrics["anchor_bytes"] = self._anchor_bytes
        item.metrics["anchor_write_s"] = time.perf_counter() - t0

    def _pin_newest(self) -> _Item | None:
        """The newest waiting version, taken off the queue (the uploader cannot start it while
        the ranks decide whether to merge into it), when it is the previous version and a delta
        (in parts: a sharded anchor has none); else None."""
        with self._cv:
            last = self._pending[-1] if self._pending else None
            if last is None or last.version != self._last_version or last.parts is None:
                return None
            return self._pending.pop()

    def _plan(self, version: int, pinned: _Item | None) -> tuple[bool, bool]:
        """(anchor, merge) for `version`, alike on every rank (one all_reduce): the publisher's
        anchor rule on all ranks' delta bytes and rank 0's anchor size; and, for a delta, whether
        it is merged into the previous version (`pinned`, which then is never committed). That
        happens when some rank has `queue_size` versions waiting and every rank still has the
        previous one waiting: uploads lag, and training goes on instead of waiting for them."""
        with self._cv:
            full = len(self._pending) + (pinned is not None) >= self.config.queue_size
        t = torch.tensor([float(self._delta_bytes_since_anchor), float(self._anchor_bytes), float(full),
                          float(pinned is not None)], dtype=torch.float64)
        with _collective(f"version {version} of {self.store.url} not published"):
            dist.all_reduce(t, group=self._ctl)
        cfg, last = self.config, self._last_anchor_version
        if last is None or (cfg.anchor_every and version - last >= cfg.anchor_every):
            return True, False
        if float(t[0]) > cfg.anchor_fraction * max(float(t[1]), 1.0):
            return True, False
        return False, float(t[2]) > 0 and int(t[3]) == self.world

    def _anchor_due(self, version: int) -> bool:
        if not self._sharded:
            return super()._anchor_due(version)
        return False  # decided for all ranks at once by `_plan`, before encoding

    def _wait_for_room(self) -> None:
        """Where the ranks did not merge (`_plan`): wait while `queue_size` versions wait for upload."""
        with self._cv:
            while len(self._pending) >= self.config.queue_size and self._error is None:
                self._cv.wait(timeout=1.0)
        self._raise_background_error()

    def _enqueue(self, item: _Item) -> None:
        """Queue `item` as it is (merging is decided by all ranks at once, in `_plan`)."""
        if not self._sharded:
            return super()._enqueue(item)
        with self._cv:
            self._pending.append(item)
            self._cv.notify_all()

    def _claim_epoch(self) -> int:
        """Rank 0 claims the epoch (others learn it in `_setup`; alone they never write)."""
        return super()._claim_epoch() if self.rank == 0 else 0

    def _store_local(self, item: _Item) -> tuple[list[PartRef], list[ObjectRef]]:
        """Upload this rank's parts (and its anchor file), retrying store outages a few times
        (the last one is reported to every rank)."""
        backoff = self.config.retry_backoff_s
        for _ in range(_STORE_TRIES - 1):
            try:
                return self._store_objects(item)
            except StoreUnavailableError as e:
                backoff = _wait_to_retry(f"rank {self.rank}: upload of version {item.version}", e, backoff)
        return self._store_objects(item)

    def _store_objects(self, item: _Item) -> tuple[list[PartRef], list[ObjectRef]]:
        """One try of `_store_local`."""
        if err := item.metrics.get("_anchor_error"):
            raise SparsesyncError(err)
        refs = self._upload_parts(item) if item.parts is not None else []
        if refs is None:
            raise SparsesyncError(f"encoding version {item.version} failed on this rank")
        anchor = self._put_anchor_files(item, sorted(item.anchor_dir.iterdir())) if item.anchor_dir is not None else []
        return refs, anchor

    def _upload(self, item: _Item) -> None:
        """Store this rank's objects, then one collective; rank 0 commits; all learn the outcome."""
        if not self._sharded:
            return super()._upload(item)
        t0 = time.perf_counter()
        report: dict[str, Any] = {"rank": self.rank, "version": item.version, "error": None}
        try:
            refs, anchor = self._store_local(item)
            report.update(parts=refs, anchor=anchor, digests=item.digests, base_digests=item.base_digests or {},
                          anchor_digests=item.metrics.get("_anchor_digests", {}),
                          metrics={k: v for k, v in item.metrics.items() if not k.startswith("_")})
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            report["error"] = f"{type(e).__name__}: {e}"
        reports: list[Any] = [None] * self.world
        outcome: list[Any] = [None]
        with _collective(f"version {item.version} of {self.store.url} was not committed", "a rank did not report its part",
                         hint=f"{_RANK_DIED}: the next writer continues from the newest committed version"):
            dist.all_gather_object(reports, report, group=self._up)
            if self.rank == 0:
                outcome = [self._commit_all(item, reports, t0)]
            dist.broadcast_object_list(outcome, src=self._src, group=self._up)  # (error or None, state digest)
        error, digest = outcome[0]
        if error is not None:
            raise RankFailedError(f"version {item.version} of {self.store.url} was not committed: {error}",
                                  hint="fix the failing rank and restart the job: the next writer continues from the newest committed version")
        if item.anchor_dir is not None:
            import shutil

            shutil.rmtree(item.anchor_dir, ignore_errors=True)
        self.committed_version, self._committed_digest = item.version, digest
        self.metrics.append({k: v for k, v in item.metrics.items() if not k.startswith("_")} | {"version": item.version})

    def _commit_all(self, item: _Item, reports: list[dict[str, Any]], t0: float) -> tuple[str | None, str]:
        """Rank 0: write the commit record from every rank's report (and an anchor's index);
        (the error text or None, the version's state digest)."""
        bad = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]]
        bad += [f"rank {r['rank']} published version {r['version']}, rank 0 {item.version}" for r in reports
                if not r["error"] and r["version"] != item.version]
        if bad:
            return "; ".join(bad), ""
        try:
            anchor = sorted((o for r in reports for o in r["anchor"]), key=lambda o: o.key)
            parts = [p for r in reports for p in r["parts"]]
            digests = {k: d for r in reports for k, d in r["digests"].items()}
            if parts:
                sd = state_digest(digests)
                base_sd = state_digest({k: d for r in reports for k, d in r["base_digests"].items()})
            else:
                (sd, index), base_sd = self._anchor_index(item, reports), None
                anchor += index
            metrics = combined_metrics([r["metrics"] for r in reports])
            rec = CommitRecord(
                version=item.version, epoch=self.epoch, writer=self.writer, state_digest=sd, created_at=time.time(),
                base_version=item.base_version if parts else None, base_state_digest=base_sd, anchor=anchor, parts=parts,
                files=self._commit_files(item.version, item.uid),
            )
            self._check_fence()
            rec.metrics = {**metrics, "version": item.version, "base_version": rec.base_version, "ranks": self.world,
                           "upload_s": time.perf_counter() - t0, "kind": "delta" if parts else "anchor"}
            self.store.put(commit_key(item.version, self.epoch), rec.to_json())
            self._confirm_visible(rec)
        except Exception as e:  # noqa: BLE001 - every rank raises it
            return f"rank 0 could not commit: {type(e).__name__}: {e}", ""
        return None, sd

    def _anchor_index(self, item: _Item, reports: list[dict[str, Any]]) -> tuple[str, list[ObjectRef]]:
        """Rank 0, an anchor version: its state digest (whole tensors), and the index it stores
        beside the ranks' files when there are several ([] when one file holds it all)."""
        plan = item.metrics["_anchor_plan"]
        digests = {k: d for r in reports for k, d in r["anchor_digests"].items()}
        if set(digests) != set(plan.owner):
            raise SparsesyncError(f"the ranks' anchor files hold {len(digests)} tensors, the plan {len(plan.owner)}")
        if len(plan.files) == 1:
            return state_digest(digests), []
        path = write_anchor_index(self._anchor_folder(item), plan.weight_map, digests, version=item.version,
                                  total_size=plan.total_size)
        return state_digest(digests), self._put_anchor_files(item, [path])


def _plan_of(tensors: list[ShardedTensor], world: int) -> AnchorPlan:
    """The sharded anchor plan of `tensors` (`anchor_shards.assign`): which rank holds each whole."""
    return assign([(t.name, t.nbytes, t.holder is None) for t in tensors], world,
                  holders={t.name: t.holder for t in tensors if t.holder is not None})


def combined_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum of the ranks' sizes; the slowest rank's times."""
    out: dict[str, Any] = {}
    for m in per_rank:
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = max(out.get(k, 0), v) if k.endswith("_s") else out.get(k, 0) + v
    if out.get("n_params"):
        out["density"] = out.get("n_changed", 0) / out["n_params"]
    return out
