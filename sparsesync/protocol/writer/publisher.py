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
`uploads` (the queue, coalescing, retries), `anchors` (anchor policy) and a mode (`mode.WriterMode`),
picked without the caller asking (`choice`): `whole` (one process encodes the whole state; parts
streamed as encoded), `sharded` (under torch.distributed with DTensors in the state, every rank
its own shard) or passive (replicated weights, rank > 0); distributed, decided at the first
`publish`/`resume`/`version_of`, alike on every rank. The Publisher delegates every call to its
mode and never asks which one it is.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparsesync.codec import Effort
from sparsesync.errors import ConfigError
from sparsesync.protocol.extras import collect_files
from sparsesync.protocol.keys import MAX_VERSION
from sparsesync.protocol.records import AdapterMeta
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.choice import open_mode
from sparsesync.protocol.writer.commits import CheckpointFiles
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.mode import Tally
from sparsesync.protocol.writer.parts import DEFAULT_PART_BYTES
from sparsesync.protocol.writer.ranks import Ranks
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
        snapshot (`str`, *optional*):
            Where the copy of the last published version lives (reported as `snapshot_device`).
            None or `"auto"`: weights on the CPU as `"cpu"`; weights on a GPU on that GPU when the
            model fits twice in its free memory, else `"host"`. `"cpu"`: a host copy, diffed and
            encoded in `publish`. `"device"`: on the weights' device; `"host"`: in pinned host
            memory; both find the changes on the weights' device (two device->host reads per
            version) and `publish` returns once they are in host memory, while the entropy coding
            runs on the uploader thread (`flush`/`close` wait for it; a failure there is raised
            from the next `publish`/`flush`, as an upload failure is). One process only: a sharded
            publisher keeps its CPU snapshot.

    Raises ConfigError for an option out of range, before anything is written.
    """

    def __init__(self, url: str | Store, *, adapter: AdapterMeta | None = None,
                 extra_files: str | Path | Mapping[str, bytes] | None = None,
                 anchor_every: int = 50, anchor_fraction: float = 0.5, queue_size: int = 4,
                 retry_backoff_s: float = 0.5, writer: str = "", part_bytes: int = DEFAULT_PART_BYTES,
                 effort: Effort = "size", dist_timeout_s: float = 300.0, group: Any = None,
                 dtype: torch.dtype | None = None, snapshot: str | None = None) -> None:
        files = CheckpointFiles(collect_files(extra_files))  # checked before anything is written
        self.config = PublisherConfig(anchor_every=anchor_every, anchor_fraction=anchor_fraction,
                                      queue_size=queue_size, retry_backoff_s=retry_backoff_s, writer=writer,
                                      part_bytes=part_bytes, dist_timeout_s=dist_timeout_s, effort=effort,
                                      dtype=dtype, snapshot=snapshot)
        self.config.validate()
        ranks = Ranks.of(group)
        self.store = open_store(url, create=True) if isinstance(url, str) else url
        self.run = Run(self.store)
        newest = self.run.newest()  # its kind (adapter or full weights) is checked at the first publish
        committed = newest.version if newest else None
        self._tally = Tally(self.store.url, newest=newest, adapter=adapter, committed=committed, last=committed)
        # distributed: undecided until the first publish/resume/version_of (`choice`)
        self._ctx, self._mode = open_mode(self.run, self.config, files, self._tally, ranks)
        self._files, self._queue = files, self._ctx.queue

    # -- public API -------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None = None) -> int:
        """Publish `state` as version `step` (default: previous + 1; 0 in an empty run: a version is
        the number of optimizer steps behind its weights, 0 the weights before training). Returns the version.

        `state`: a state dict, or a `peft.PeftModel` (its adapter is published: an adapter run);
        distributed, this rank's `model.state_dict()` (every rank calls it with the same step).
        Returns after diff+encode (and anchor serialization on anchor versions; sharded, the
        gather of its tensors); the upload happens in the background. With a snapshot beside GPU
        weights (`snapshot`), returns once the changes are in host memory: the entropy coding
        happens in the background too.
        """
        self._mode = self._mode.settle(state)
        return self._mode.publish(state, step)

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
            raise ConfigError(
                f"resume(version={version!r}) for {self.store.url}: a version is an int in [0, {MAX_VERSION}]",
                hint="pass the version the weights hold (e.g. the optimizer step) as an int, or leave "
                "version out to continue from the newest",
            )
        self._mode = self._mode.settle(state)
        self._mode.resume(state, version)

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        """The newest version the run trusts whose weights `state` holds (by state digest), or None:
        which version a checkpoint is, before `resume(state, version=...)`. Distributed with
        DTensors: a collective, on every rank, before the first publish (the weights are hashed
        over the units of the run's commits); replicated weights: rank 0's answer, None elsewhere."""
        self._mode = self._mode.settle(state)
        return self._mode.version_of(state)

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        """Stand (before the first `publish`) at the run's trusted `version`, below its newest,
        whose weights `state` holds (checked by state digest), without committing anything: the
        next `publish(state, N)` (N above `version`, at or below the run's newest) is a delta
        `version -> N` whose commit abandons the older epochs' versions from N on (`sparsesync
        push --step N`; `sparsesync.protocol.writer.rewind.stand_below`). One process only."""
        self._mode.continue_below(state, version)

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
            shutil.rmtree(self._ctx.staging, ignore_errors=True)

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
        return self._mode.state_digest

    @property
    def snapshot_device(self) -> str | None:
        """Where the snapshot of the last published version lives: "cpu" (the C codec's host
        copy), a device ("cuda:0"), "pinned" or "host" memory (compared on the weights' device);
        None before the first publish/resume (and on ranks that hold none)."""
        return self._tally.snapshot_device

    @property
    def pending(self) -> int:
        """Versions published but not yet committed."""
        return self._queue.pending

    @property
    def epoch(self) -> int:
        """The writer epoch this publisher claimed (distributed: rank 0's, known from the first sharded publish)."""
        return self._ctx.commits.epoch

    @property
    def writer(self) -> str:
        """The writer id recorded in claims and commits."""
        return self._ctx.commits.writer

    @property
    def rank(self) -> int:
        """This process's rank in the publishing group (0 for a single process)."""
        return self._ctx.rank

    @property
    def world(self) -> int:
        """How many ranks publish together (1 for a single process)."""
        return self._ctx.world

    @property
    def adapter(self) -> AdapterMeta | None:
        """The adapter run's base and config (None: full weights; a `peft.PeftModel` passed to
        `publish` sets it)."""
        return self._tally.adapter

    @property
    def committed_version(self) -> int | None:
        """The newest version committed (or resumed from); None in an empty run."""
        return self._tally.committed

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One dict per committed version, in commit order."""
        return self._tally.metrics
