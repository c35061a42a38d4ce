"""The writer side: publish weight versions into a run without making training wait on the network.

`Publisher.publish(state, step)` brings `state` to the checkpoint's own key set
(`checkpoint.checkpoint_state`: tied aliases once, runtime-fused experts per expert, frozen
tensors from the previous version, unknown tensors rejected before anything is uploaded),
diffs it against the last *published* version, encodes the patch, hands it to a background
uploader and returns. The uploader writes the version's objects, checks that no newer writer has
claimed the run, and writes the commit record last.

When it blocks: `publish` runs diff+encode on the caller's thread, and on anchor versions also
serializes the anchor to a local staging folder (about 1 s per GB). It never waits for the
network: when `queue_size` versions are waiting to upload, the newest waiting delta is coalesced
with the new one (B->N-1 and N-1->N become B->N; version N-1 is never committed).
Memory: the diff snapshot (2 B/param for bf16) plus at most `queue_size` encoded deltas.

Fencing: each Publisher claims a writer epoch when it starts and re-lists the claims before
every commit; once a newer writer claimed the run it raises FencedWriterError from the next
`publish`/`flush`, and a commit nobody can read is never reported as published. Versions and
epochs that do not fit the object names (10 and 6 digits) are refused before anything is uploaded.

The Publisher is a facade over small parts (`sparsesync.protocol.writer`), each stating its own
guarantees: `config` (options), `commits` (epoch claim, fencing, commit record, visibility),
`uploads` (the queue, coalescing, retries), `anchors` (anchor policy) and one of two modes,
picked without the caller asking: `whole` (one process encodes the whole state; parts streamed
as encoded) or `sharded` (under torch.distributed with DTensors in the state, every rank its own
shard; decided at the first `publish`/`resume`, alike on every rank).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparsesync.checkpoint import checkpoint_digest
from sparsesync.codec import Effort
from sparsesync.errors import ConfigError
from sparsesync.lora.state import adapter_state
from sparsesync.protocol.adapter_runs import check_publish
from sparsesync.protocol.extras import collect_files
from sparsesync.protocol.keys import MAX_VERSION, check_version
from sparsesync.protocol.records import AdapterMeta
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.anchors import AnchorPolicy
from sparsesync.protocol.writer.commits import CheckpointFiles, CommitWriter
from sparsesync.protocol.writer.config import PublisherConfig, served_dtype
from sparsesync.protocol.writer.parts import DEFAULT_PART_BYTES
from sparsesync.protocol.writer.ranks import Ranks, holds_shards
from sparsesync.protocol.writer.rewind import rewind, stand_below, version_with_digest
from sparsesync.protocol.writer.sharded import ShardedState
from sparsesync.protocol.writer.uploads import PendingVersion, UploadQueue
from sparsesync.protocol.writer.whole import WholeState
from sparsesync.store import Store, open_store

log = logging.getLogger(__name__)

__all__ = ["Publisher"]


class Publisher:
    """Publishes versions of a state dict to the run at `url` (see the module docstring).

    Under an initialized torch.distributed group (world size > 1), or given `group=`, every rank
    creates one: with DTensors in the state (FSDP2) each rank publishes its own shard and rank 0
    commits (`sparsesync.protocol.writer.sharded`); with plain tensors (DDP) rank 0 publishes as
    one process would and the other ranks' calls do nothing.

    Args:
        url (`str` or `Store`):
            The run: a local folder, `file://...`, `s3://bucket/prefix` or
            `hf://buckets/<namespace>/<bucket>/<prefix>` (created when missing), or an open store.
        adapter (`AdapterMeta`, *optional*):
            Publish a LoRA adapter run of this base and config (a `peft.PeftModel` passed to
            `publish` brings its own; see `sparsesync.lora.bridge`).
        extra_files (`str`, `Path` or `Mapping[str, bytes]`, *optional*):
            The checkpoint's non-weight files every commit carries: a `save_pretrained` folder (of
            which only config, generation config and tokenizer files are taken) or `{name: bytes}`;
            see `set_extra_files`. Checked before anything is written.
        anchor_every (`int`, defaults to 50):
            Versions between periodic anchors (full copies readers can start from); 0: only the first.
        anchor_fraction (`float`, defaults to 0.5):
            Also write an anchor once the delta bytes since the last anchor exceed this times its size.
        queue_size (`int`, defaults to 4):
            Versions that may wait for upload before new deltas are coalesced into the newest waiting one.
        retry_backoff_s (`float`, defaults to 0.5):
            First wait after a failed upload (doubles, at most 30 s); uploads are retried until `flush`'s timeout.
        writer (`str`, defaults to host-pid-random):
            Writer id recorded in the epoch claim and in every commit.
        part_bytes (`int`, defaults to 256 MiB):
            Tensor bytes per part of a version, uploaded while the next part is encoded; 0, or a
            model no larger than one part: one delta file per version.
        dtype (`torch.dtype`, *optional*):
            Publish floating tensors in this dtype (e.g. `torch.bfloat16` for an fp32 master): each
            tensor is cast as it is diffed, so no cast copy of the whole state exists; the bytes are
            those of publishing the cast state. Default: an fp32 state (every floating tensor
            fp32: an fp32 master) whose `extra_files` config.json declares bfloat16 or float16 is
            published in that dtype, the one replicas started from that checkpoint serve (logged
            once); any other state as given. `dtype=torch.float32` keeps an fp32 master as fp32.
            Not for a sharded publisher (its shards are published as given).
        effort (`"size"` or `"speed"`, defaults to `"size"`):
            `"size"`: smallest patches; `"speed"`: 26-29% larger at 1.6% density, encoded and decoded faster.
        dist_timeout_s (`float`, defaults to 300.0):
            Distributed publisher: how long ranks wait for each other's parts before RankFailedError.
        group (`torch.distributed.ProcessGroup`, *optional*):
            The ranks that publish together (default: the world, when torch.distributed runs
            with more than one process).

    Raises ConfigError for an option out of range, before anything is written.
    """

    def __init__(self, url: str | Store, *, adapter: AdapterMeta | None = None,
                 extra_files: str | Path | Mapping[str, bytes] | None = None,
                 anchor_every: int = 50, anchor_fraction: float = 0.5, queue_size: int = 4,
                 retry_backoff_s: float = 0.5, writer: str = "", part_bytes: int = DEFAULT_PART_BYTES,
                 effort: Effort = "size", dist_timeout_s: float = 300.0, group: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        self._files = CheckpointFiles(collect_files(extra_files))  # checked before anything is written
        self.config = PublisherConfig(anchor_every=anchor_every, anchor_fraction=anchor_fraction,
                                      queue_size=queue_size, retry_backoff_s=retry_backoff_s, writer=writer,
                                      part_bytes=part_bytes, dist_timeout_s=dist_timeout_s, effort=effort,
                                      dtype=dtype)
        self.config.validate()
        self.adapter = adapter
        self._ranks = Ranks.of(group)
        self.store = open_store(url, create=True) if isinstance(url, str) else url
        self.run = Run(self.store)
        self.metrics: list[dict[str, Any]] = []  # one per committed version, in commit order
        newest = self.run.newest()
        self._newest = newest  # its kind (adapter or full weights) is checked at the first publish
        self.committed_version: int | None = newest.version if newest else None
        self._last_version = self.committed_version
        self._commits = CommitWriter(self.store, self.config.writer_id())
        if self._ranks is None or self._ranks.rank == 0:  # other ranks learn rank 0's epoch (`ShardedState`)
            self._commits.claim()
        self._staging = Path(tempfile.mkdtemp(prefix="sparsesync-publish-"))
        self._anchors = AnchorPolicy(self.config)
        self._queue = UploadQueue(self.store.url, self.config, self._upload)
        # None: not decided yet (distributed: the first publish/resume decides), or a rank other
        # than 0 under replicated weights, which publishes nothing
        self._dtype_picked = dtype is not None  # else the first publish/resume picks it (`_pick_dtype`)
        self._mode: WholeState | ShardedState | None = self._whole() if self._ranks is None else None
        self._decided = self._ranks is None

    # -- public API -------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None = None) -> int:
        """Publish `state` as version `step` (default: previous + 1; 0 in an empty run: a version is
        the number of optimizer steps behind its weights, 0 the weights before training). Returns the version.

        `state`: a state dict, or a `peft.PeftModel` (its adapter is published: an adapter run);
        distributed, this rank's `model.state_dict()` (every rank calls it with the same step).
        Returns after diff+encode (and anchor serialization on anchor versions; sharded, the
        gather of its tensors); the upload happens in the background.
        """
        mode = self._mode if self._decided else self._choose(state)
        if mode is None:
            # replicated weights, rank > 0: nothing is published here, so nothing is checked against
            # the run (which rank 0 may already have moved past when this rank opened it): the
            # version rank 0 gives `step`
            self._last_version = step if step is not None else 0 if self._last_version is None else self._last_version + 1
            return self._last_version
        if isinstance(mode, ShardedState):
            if self.adapter is not None:
                raise ConfigError("a sharded publisher publishes full weights only, not a LoRA adapter run",
                                  hint="publish the adapter from rank 0 alone (Publisher(url, group=None)): it is small")
            self._check_open()
            version = self._next_version(step)
            mode.publish(state, version)
        else:
            self._check_open()
            state, self.adapter = adapter_state(state, self.adapter)
            check_publish(self._newest, self.adapter, self.store.url)
            self._pick_dtype(state)
            state = mode.checkpoint(state)
            version = self._next_version(step)
            mode.publish(state, version)
        self._last_version = version
        return version

    def set_extra_files(self, source: str | Path | Mapping[str, bytes] | None) -> None:
        """Carry these checkpoint files (config.json, tokenizer files, ...; `protocol.extras`) in
        every commit from the next one on, so `sparsesync pull` writes a folder that loads as is.
        Stored once per publisher (and again when they change); an adapter run leaves
        config.json and generation_config.json out. ConfigError, before anything is uploaded,
        for names outside the allow-list or files over the bounds."""
        self._files.set(collect_files(source))

    def resume(self, state: Mapping[str, torch.Tensor], *, version: int | None = None) -> None:
        """Continue the run from its newest committed version, whose weights `state` holds.

        The next `publish` is then a delta against that version instead of a fresh anchor.
        Raises PatchMismatchError when `state` is not exactly that version. Distributed with
        DTensors: a collective, on every rank (see `sparsesync.protocol.writer.sharded`);
        replicated weights: rank 0 resumes as one process does.

        `version` below the newest: a rewind (`sparsesync.protocol.writer.rewind`): `state`
        (checked against the run's version `version` when it has one) becomes that version at
        once and the newer versions are abandoned; replicas follow without any change.
        Distributed with DTensors: every rank rewinds its shard alike (a collective).
        A `version` that is not an int in [0, MAX_VERSION] is a ConfigError before anything is written.
        """
        if version is not None and (type(version) is not int or not 0 <= version <= MAX_VERSION):
            raise ConfigError(f"resume(version={version!r}) for {self.store.url}: a version is an int in [0, {MAX_VERSION}]",
                              hint="pass the version the weights hold (e.g. the optimizer step) as an int, or leave "
                                   "version out to continue from the newest")
        if self._ranks is not None:
            if holds_shards(state) and self._decided and not isinstance(self._mode, ShardedState):
                raise ConfigError("resume() must come before the first publish()")
            if not self._decided:
                self._choose(state)
        mode = self._mode
        if isinstance(mode, WholeState):
            self._pick_dtype(state)
        if isinstance(mode, WholeState) and version is not None:
            commits = mode.commits_to_resume()
            if version != commits[-1].version:  # a rewind (docs/protocol.md, "Rewinds")
                state, self.adapter = adapter_state(state, self.adapter)
                rec = rewind(mode, state, version, commits, self.adapter)
                self._newest, self.committed_version, self._last_version = rec, version, version
                self.metrics.append(rec.metrics)
                return
            mode.resume(state, commits)
        elif isinstance(mode, ShardedState):
            mode.resume(state, version)
            if mode.published is not None and mode.published != self._last_version:  # a rewind, committed
                self.committed_version = self._last_version = mode.published
        elif mode is not None:
            mode.resume(state)
        elif version is not None:  # replicated weights, rank > 0: rank 0 resumes (or rewinds) for all
            self._last_version = version

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        """The newest version the run trusts whose weights `state` holds (by state digest), or None:
        which version a checkpoint is, before `resume(state, version=...)`. Distributed with
        DTensors: a collective, on every rank, before the first publish (the weights are hashed
        over the units of the run's commits); replicated weights: rank 0's answer, None elsewhere."""
        if self._ranks is not None and not self._decided:
            self._choose(state)
        if isinstance(self._mode, ShardedState):
            return self._mode.held_version(state)
        if self._mode is None:
            return None
        state, _adapter = adapter_state(state, self.adapter)
        same = version_with_digest(self.run.commits(), checkpoint_digest(state))
        return None if same is None else same.version

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        """Stand (before the first `publish`) at the run's trusted `version`, below its newest,
        whose weights `state` holds (checked by state digest), without committing anything: the
        next `publish(state, N)` (N above `version`, at or below the run's newest) is a delta
        `version -> N` whose commit abandons the older epochs' versions from N on (`sparsesync
        push --step N`; `sparsesync.protocol.writer.rewind.stand_below`). One process only."""
        if not isinstance(self._mode, WholeState):
            raise ConfigError(f"a distributed publisher cannot continue {self.store.url} below its newest version",
                              hint="resume from the run's newest version, or publish to a new run URL")
        commits = self._mode.commits_to_resume()
        state, self.adapter = adapter_state(state, self.adapter)
        check_publish(commits[-1], self.adapter, self.store.url)
        stand_below(self._mode, state, version, commits)
        self.committed_version = self._last_version = version

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every published version is committed (or raise the uploader's error).
        StoreUnavailableError after `timeout` seconds (the uploader keeps retrying)."""
        self._queue.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the uploader and remove the staging folder."""
        if self._queue.closed:
            return
        try:
            if self._queue.error is None:
                self._queue.flush(timeout)
        finally:
            self._queue.close()
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

        lead = switch_lead_s(read_fleet(self.store)) if apply_in_s is None else apply_in_s
        # the record of the trusted commit of `version` (tied to it by its epoch, docs/protocol.md "Rewinds")
        epoch = next((c.epoch for c in self.run.commits() if c.version == version), self.epoch)
        return write_switch(self.store, version, by=f"trainer:{self.writer}", apply_in_s=lead, epoch=epoch).apply_at

    @property
    def state_digest(self) -> str | None:
        """State digest of the newest version this publisher published or resumed from (sharded:
        the global digest of the newest committed version; ConfigError until it is committed)."""
        return self._mode.state_digest if self._mode is not None else None

    @property
    def pending(self) -> int:
        """Versions published but not yet committed."""
        return self._queue.pending

    @property
    def epoch(self) -> int:
        """The writer epoch this publisher claimed (distributed: rank 0's, known from the first sharded publish)."""
        return self._commits.epoch

    @property
    def writer(self) -> str:
        """The writer id recorded in claims and commits."""
        return self._commits.writer

    @property
    def rank(self) -> int:
        """This process's rank in the publishing group (0 for a single process)."""
        return self._ranks.rank if self._ranks is not None else 0

    @property
    def world(self) -> int:
        """How many ranks publish together (1 for a single process)."""
        return self._ranks.world if self._ranks is not None else 1

    # -- internals --------------------------------------------------------------------
    def _choose(self, state: Any) -> WholeState | ShardedState | None:
        """Distributed: the mode, from the first state given (alike on every rank): DTensors:
        sharded (a collective); else whole on rank 0, nothing elsewhere."""
        assert self._ranks is not None
        if holds_shards(state):
            if self.config.dtype is not None:
                raise ConfigError("a sharded publisher publishes its shards as given: dtype= is for whole-state publishing",
                                  hint="cast the sharded state before publish(), or leave dtype unset")
            self._mode = ShardedState(state, ranks=self._ranks, newest=self.committed_version, config=self.config,
                                      run=self.run, commits=self._commits, files=self._files, queue=self._queue,
                                      anchors=self._anchors, staging=self._staging)
        elif self._ranks.rank == 0:
            self._mode = self._whole()
        self._decided = True
        return self._mode

    def _pick_dtype(self, state: Any) -> None:
        """Whole state, no `dtype=` given: at the first publish/resume, publish an fp32 master in
        the 16-bit dtype its config.json declares (`served_dtype`), for the rest of the run."""
        adapter_run = self.adapter is not None or getattr(self._newest, "adapter", None) is not None
        if self._dtype_picked or adapter_run or not isinstance(state, Mapping):
            return
        self._dtype_picked = True
        if self.config.dtype is None and (dtype := served_dtype(self._files.get("config.json"), state)) is not None:
            self.config.dtype = dtype
            log.info("publishing the fp32 state as %s, the dtype its config.json declares (replicas serve it); "
                     "Publisher(dtype=torch.float32) keeps fp32", str(dtype).removeprefix("torch."))

    def _whole(self) -> WholeState:
        return WholeState(config=self.config, run=self.run, commits=self._commits, files=self._files,
                          queue=self._queue, anchors=self._anchors, staging=self._staging)

    def _check_open(self) -> None:
        self._queue.raise_error()
        if self._queue.closed:
            raise ConfigError("publish() after close()")

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

    def _upload(self, item: PendingVersion) -> None:
        """Uploader thread: commit `item` through the mode; record what was committed."""
        assert self._mode is not None
        metrics = self._mode.upload(item, self.adapter)
        if metrics is not None:
            self.committed_version = item.version
            self.metrics.append(metrics)
