"""A run's history as `sparsesync log` shows it: one row per trusted version, one line per rewind.

    rows = log_rows(run)                        # LogRow per trusted version, oldest first
    for a in run.abandoned(): rewind_line(a)    # "rewind to version 4 (epoch 2): ..."

Guarantees: rows come from `Run.commits()` alone (so only trusted versions, under the fencing
rule, and `run.rejected` then names the commit-named objects that are not commit records); each
field is the commit's own (its metrics typed through `records.CommitMetrics`: a field that is
absent or ill-typed in the record is None, never another type). `LogRow.to_dict()` is the JSON
object `sparsesync log --json` prints for the version; the rewind keys appear only on a rewind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsesync.protocol.keys import Abandoned
from sparsesync.protocol.records import CommitMetrics, CommitRecord
from sparsesync.protocol.run import Run


@dataclass(frozen=True)
class LogRow:
    """One trusted version of a run: what it is, who wrote it, its sizes and timings."""

    version: int
    base_version: int | None
    epoch: int
    writer: str
    state_digest: str
    patch_bytes: int | None
    """The delta's bytes (one file or all parts); None without a delta."""
    anchor_bytes: int | None
    """The anchor's bytes; None without an anchor."""
    metrics: CommitMetrics

    @classmethod
    def of(cls, c: CommitRecord) -> LogRow:
        return cls(version=c.version, base_version=c.base_version, epoch=c.epoch, writer=c.writer,
                   state_digest=c.state_digest,
                   patch_bytes=sum(o.size for o in c.delta_objects()) if c.has_delta else None,
                   anchor_bytes=sum(o.size for o in c.anchor) if c.anchor else None, metrics=c.stats)

    def to_dict(self) -> dict[str, Any]:
        """The row as `sparsesync log --json` prints it."""
        m = self.metrics
        return {
            "version": self.version, "base_version": self.base_version, "kind": m.kind_text,
            "epoch": self.epoch, "writer": self.writer, "state_digest": self.state_digest,
            "n_changed": m.n_changed, "n_params": m.n_params, "density": m.density,
            "patch_bytes": self.patch_bytes, "anchor_bytes": self.anchor_bytes,
            "diff_s": m.diff_s, "encode_s": m.encode_s, "upload_s": m.upload_s, "coalesced": m.coalesced,
            **({"rewind_from": m.rewind_from, "abandoned": m.abandoned} if m.is_rewind else {}),
        }


def log_rows(run: Run) -> list[LogRow]:
    """One row per trusted version of `run`, oldest first (a fresh listing; `run.rejected` is then current)."""
    return [LogRow.of(c) for c in run.commits()]


def rewind_line(a: Abandoned) -> str:
    """What a rewind abandoned, in one line (docs/protocol.md, "Rewinds")."""
    vs = a.versions
    span = f"version {vs[0]}" if len(vs) == 1 else f"versions {vs[0]}..{vs[-1]}"
    return (f"rewind to version {a.version} (epoch {a.by_epoch}): the commits of {span} by epoch {a.epoch} "
            "are no longer trusted")
