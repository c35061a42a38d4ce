"""When a version also carries a full anchor: the first version, then every `anchor_every`
versions, or sooner once the deltas since the last anchor outweigh `anchor_fraction` of it.

Guarantees: the decision depends only on the versions' numbers and byte counts, so a writer
that resumes a run (`AnchorPolicy.resume_from`, from the run's commits) or every rank of a
sharded writer (`due` with the byte counts summed over the ranks) decides exactly as one
uninterrupted writer would. It reads `PublisherConfig` live: a change of `anchor_every` applies
from the next version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.writer.config import PublisherConfig


@dataclass(frozen=True)
class AnchorHistory:
    """What a run's commits say about its anchors, for a writer that continues it."""

    last_anchor: int | None  # the version of the newest anchor; None: no anchor in the run
    anchor_bytes: int  # its size
    delta_bytes: int  # the delta bytes of the versions committed after it

    @classmethod
    def of(cls, commits: Sequence[CommitRecord]) -> AnchorHistory:
        """From a run's commits, in version order."""
        anchors = [c for c in commits if c.has_anchor]
        if not anchors:
            return cls(None, 0, 0)
        last = anchors[-1]
        return cls(last.version, sum(o.size for o in last.anchor),
                   sum(o.size for c in commits if c.version > last.version for o in c.delta_objects()))


class AnchorPolicy:
    """The anchor bookkeeping of one writer (one rank of a sharded writer: its own bytes)."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self.last_anchor: int | None = None  # the version of the newest anchor written
        self.anchor_bytes = 0  # its size (one rank's share, for a sharded writer)
        self.delta_bytes = 0  # delta bytes written since

    def due(self, version: int, *, delta_bytes: float | None = None, anchor_bytes: float | None = None) -> bool:
        """Whether `version` carries an anchor; `delta_bytes`/`anchor_bytes` replace this writer's
        own counts (a sharded writer passes all ranks' sums, so every rank decides alike)."""
        cfg = self.config
        if self.last_anchor is None:
            return True
        if cfg.anchor_every and version - self.last_anchor >= cfg.anchor_every:
            return True
        delta = self.delta_bytes if delta_bytes is None else delta_bytes
        anchor = self.anchor_bytes if anchor_bytes is None else anchor_bytes
        return delta > cfg.anchor_fraction * max(anchor, 1)

    def add_delta(self, nbytes: int) -> None:
        """A delta of `nbytes` was encoded."""
        self.delta_bytes += nbytes

    def anchored(self, version: int, nbytes: int) -> None:
        """`version` carries an anchor of `nbytes`: the deltas count from here."""
        self.last_anchor, self.anchor_bytes, self.delta_bytes = version, nbytes, 0

    def resume_from(self, history: AnchorHistory, *, with_bytes: bool = True) -> None:
        """Continue the run whose anchors `history` describes (`with_bytes` False: the version
        only, for the ranks of a sharded writer other than the one whose counts stand for the run)."""
        self.last_anchor = history.last_anchor
        if with_bytes:
            self.anchor_bytes, self.delta_bytes = history.anchor_bytes, history.delta_bytes
