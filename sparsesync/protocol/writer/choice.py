"""Which mode a `Publisher` runs: `open_mode` (the first), `Undecided` (distributed, until the
first state decides) and `Passive` (a rank that publishes nothing).

A single process is `WholeState` from the start. Under torch.distributed (world size > 1, or
`group=`) every rank starts `Undecided`; the first `publish`/`resume`/`version_of` settles it,
alike on every rank: DTensors in the state: `ShardedState` (a collective: every rank must call
it); plain tensors (DDP, replicated weights): `WholeState` on rank 0 (which publishes as one
process would) and `Passive` elsewhere (its calls write nothing and check nothing against the
run, which rank 0 may already have moved past; they only keep the version count rank 0 uses).

Guarantees: the writer epoch is claimed once per publisher, by rank 0 (the others learn it
from rank 0 when they are sharded), before the staging folder or the uploader exists, so a
refused claim leaves nothing behind. Every mode here is a `mode.WriterMode`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sparsesync.errors import ConfigError
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.anchors import AnchorPolicy
from sparsesync.protocol.writer.commits import CheckpointFiles, CommitWriter
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.mode import Tally, WriterContext, WriterMode
from sparsesync.protocol.writer.ranks import Ranks, holds_shards
from sparsesync.protocol.writer.sharded import ShardedState
from sparsesync.protocol.writer.uploads import PendingVersion, UploadQueue
from sparsesync.protocol.writer.whole import WholeState


def open_mode(run: Run, config: PublisherConfig, files: CheckpointFiles, tally: Tally,
              ranks: Ranks | None) -> tuple[WriterContext, WriterMode]:
    """Claim the writer epoch (rank 0, or a single process) and build the parts every mode
    shares; the publisher's first mode: `WholeState` for a single process, else `Undecided`."""
    commits = CommitWriter(run.store, config.writer_id())
    if ranks is None or ranks.rank == 0:  # other ranks learn rank 0's epoch (`ShardedState`)
        commits.claim()
    staging = Path(tempfile.mkdtemp(prefix="sparsesync-publish-"))
    ctx = WriterContext(config=config, run=run, commits=commits, files=files, queue=UploadQueue(run.store.url, config),
                        anchors=AnchorPolicy(config), staging=staging, tally=tally,
                        rank=0 if ranks is None else ranks.rank, world=1 if ranks is None else ranks.world)
    return ctx, WholeState(ctx) if ranks is None else Undecided(ctx, ranks)


class Undecided:
    """A rank of a distributed publisher before its first state (see the module docstring)."""

    def __init__(self, ctx: WriterContext, ranks: Ranks) -> None:
        self.ctx, self.ranks = ctx, ranks

    def settle(self, state: Mapping[str, torch.Tensor] | Any) -> WriterMode:
        """The mode `state` decides, alike on every rank: DTensors: sharded (a collective); else
        whole on rank 0, passive elsewhere."""
        if holds_shards(state):
            if self.ctx.config.dtype is not None:
                raise ConfigError(
                    "a sharded publisher publishes its shards as given: dtype= is for whole-state publishing",
                    hint="cast the sharded state before publish(), or leave dtype unset",
                )
            return ShardedState(state, ranks=self.ranks, ctx=self.ctx)
        if self.ranks.rank == 0:
            return WholeState(self.ctx, distributed=True)
        return Passive(self.ctx)

    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None) -> int:
        return self._unsettled()

    def resume(self, state: Mapping[str, torch.Tensor] | Any, version: int | None) -> None:
        self._unsettled()

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        return self._unsettled()

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        raise _not_below(self.ctx)

    def upload(self, item: PendingVersion) -> None:
        raise RuntimeError(f"version {item.version} of {self.ctx.run.url} was queued before its publisher had a mode")

    @property
    def state_digest(self) -> str | None:
        return None

    def _unsettled(self) -> Any:
        raise RuntimeError("WriterMode.settle(state) comes first: an undecided publisher publishes nothing")


class Passive:
    """A rank that publishes nothing: replicated weights, rank > 0 (see the module docstring)."""

    def __init__(self, ctx: WriterContext) -> None:
        self.ctx, self.tally = ctx, ctx.tally

    def settle(self, state: Mapping[str, torch.Tensor] | Any) -> WriterMode:
        """Itself: decided."""
        return self

    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None) -> int:
        """Nothing is published or checked here: the version rank 0 gives `step` (None: the next one)."""
        tally = self.tally
        tally.last = step if step is not None else 0 if tally.last is None else tally.last + 1
        return tally.last

    def resume(self, state: Mapping[str, torch.Tensor] | Any, version: int | None) -> None:
        """Rank 0 resumes (or rewinds) for all; this rank only counts from `version` on.
        ConfigError for a sharded state (the mode was decided by a plain one)."""
        if holds_shards(state):
            raise ConfigError("resume() must come before the first publish()")
        if version is not None:
            self.tally.last = version

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        """None: rank 0 answers."""
        return None

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        raise _not_below(self.ctx)

    def upload(self, item: PendingVersion) -> None:
        raise RuntimeError(f"version {item.version} of {self.ctx.run.url} was queued on a rank that publishes nothing")

    @property
    def state_digest(self) -> str | None:
        """None: nothing is published here."""
        return None


def _not_below(ctx: WriterContext) -> ConfigError:
    return ConfigError(f"a distributed publisher cannot continue {ctx.run.url} below its newest version",
                       hint="resume from the run's newest version, or publish to a new run URL")
