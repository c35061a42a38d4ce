"""One writer interface: `WriterMode`, what every mode of a `Publisher` does, and what the modes share.

A `Publisher` is in exactly one mode at a time and delegates every call to it, never asking
which mode it is in:

- `whole.WholeState`: one process diffs, encodes and uploads the whole state;
- `sharded.ShardedState`: every rank of a torch.distributed trainer its own shard;
- `choice.Passive`: a rank that publishes nothing (replicated weights, rank > 0);
- `choice.Undecided`: distributed, before the first state shows which of the three it is.

The path of a version: `Publisher` -> mode (diff and encode against its snapshot, hand the
version to the `UploadQueue`); the uploader thread -> the mode's `upload` (store the objects,
then the commit record through `CommitWriter`). The queue only queues, coalesces and uploads.

`WholeWriter` is what a rewind (`rewind`) uses of the whole-state mode.

Guarantees of every mode: `publish`, `resume`, `version_of` and `continue_below` check what they
are given before anything is written (a refusal is a SparsesyncError with a hint); `upload` is
called only by the uploader thread, in commit order, and records each committed version in the
shared `Tally` (the `Publisher`'s `committed_version` and `metrics`) only once its commit record
is confirmed visible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from sparsesync.codec import DEFAULT_ALGO, Snapshot
from sparsesync.codec.device_snapshot import DeviceSnapshot
from sparsesync.errors import ConfigError
from sparsesync.protocol.keys import check_version
from sparsesync.protocol.records import AdapterMeta, CommitRecord
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.anchors import AnchorHistory, AnchorPolicy
from sparsesync.protocol.writer.commits import CheckpointFiles, CommitWriter
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.parts import PartedSnapshot
from sparsesync.protocol.writer.uploads import PendingVersion, UploadQueue


@runtime_checkable
class WriterMode(Protocol):
    """What a `Publisher` asks of its mode (see the module docstring). Callers hand every state
    to `settle` first and use the mode it returns from then on."""

    def settle(self, state: Mapping[str, torch.Tensor] | Any) -> WriterMode:
        """The mode that publishes `state` and everything after it: itself once decided."""
        ...

    def publish(self, state: Mapping[str, torch.Tensor] | Any, step: int | None) -> int:
        """Publish `state` as version `step` (None: the next one); the version. Returns once it
        is encoded and queued (the upload happens in the background)."""
        ...

    def resume(self, state: Mapping[str, torch.Tensor] | Any, version: int | None) -> None:
        """Continue the run from its newest version (or rewind it to `version`), whose weights `state` holds."""
        ...

    def version_of(self, state: Mapping[str, torch.Tensor] | Any) -> int | None:
        """The newest trusted version whose weights `state` holds, or None."""
        ...

    def continue_below(self, state: Mapping[str, torch.Tensor] | Any, version: int) -> None:
        """Stand at the run's trusted `version`, below its newest, without committing anything."""
        ...

    def upload(self, item: PendingVersion) -> None:
        """Uploader thread: store `item`'s objects, then commit it (StoreUnavailableError: retried)."""
        ...

    @property
    def state_digest(self) -> str | None:
        """State digest of the newest version published or resumed from (None: none yet, or none here)."""
        ...


class WholeWriter(Protocol):
    """What `rewind.rewind` and `rewind.stand_below` use of the whole-state mode (`whole.WholeState`,
    which calls them, so they name this protocol instead of importing it)."""

    url: str
    commits: CommitWriter
    files: CheckpointFiles
    staging: Path

    def cast(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """`state` read in the publisher's `dtype`."""
        ...

    def new_snapshot(
        self, state: Mapping[str, torch.Tensor], version: int, algo: str = DEFAULT_ALGO
    ) -> Snapshot | PartedSnapshot | DeviceSnapshot:
        """The snapshot of `state` as `version`, digested with `algo` (default: new runs' algorithm)."""
        ...

    def stand_at(self, snap: Snapshot | PartedSnapshot | DeviceSnapshot, history: AnchorHistory) -> None:
        """Continue from `snap`, a version the run trusts: the next `publish` is a delta against it."""
        ...


@dataclass
class Tally:
    """What a publisher has published and committed, shared by the `Publisher` (which reports
    it) and its mode (which moves it; `committed_as` on the uploader thread)."""

    url: str
    newest: CommitRecord | None  # the run's newest commit when opened (an adapter run or not), or a rewind's
    adapter: AdapterMeta | None  # the adapter run's base and config (None: full weights)
    committed: int | None  # the newest version committed (or resumed from)
    last: int | None  # the newest version published (or resumed from)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # one per committed version, in commit order
    snapshot_device: str | None = None  # where the writer's snapshot lives (None: none yet, or not this rank's)

    def next_version(self, step: int | None) -> int:
        """The version `publish(step)` publishes; ConfigError before anything is written if it cannot."""
        version = step if step is not None else 0 if self.last is None else self.last + 1
        check_version(version, self.url)
        if self.last is not None and version <= self.last:
            raise ConfigError(
                f"version {version} is not newer than the last version {self.last} of {self.url}",
                hint="pass a larger step, or publish to a new run URL",
            )
        return version

    def committed_as(self, version: int, metrics: dict[str, Any]) -> None:
        """Uploader thread: `version` is committed (its record confirmed visible)."""
        self.committed = version
        self.metrics.append(metrics)


@dataclass
class WriterContext:
    """The parts every mode of one publisher is built from (one of each per publisher)."""

    config: PublisherConfig
    run: Run
    commits: CommitWriter
    files: CheckpointFiles
    queue: UploadQueue
    anchors: AnchorPolicy
    staging: Path  # local folder for anchors being serialized
    tally: Tally
    rank: int = 0  # this process's rank in the publishing group
    world: int = 1  # ranks publishing together

    def check_open(self) -> None:
        """Raise what stopped the uploader, or ConfigError once the publisher is closed."""
        self.queue.raise_error()
        if self.queue.closed:
            raise ConfigError("publish() after close()")
