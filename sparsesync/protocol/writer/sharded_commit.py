"""The uploader's side of a sharded writer (`sharded.ShardedState.upload`): every rank stores
its own objects, one collective carries every rank's report to rank 0, rank 0 writes the commit
record, and every rank learns the outcome.

Guarantees: a version is committed only when every rank stored its parts (and anchor file) and
published the same version; otherwise no commit is written and every rank raises the same
RankFailedError (a dead rank is noticed by gloo at once, or after `dist_timeout_s`). A store
outage is retried `STORE_TRIES` times with backoff before a rank reports it. Rank 0's commit is
fenced and confirmed visible as a single-process writer's (`CommitWriter.commit`). Split from
`sharded` along the caller's thread / uploader's thread seam, to keep both under 450 lines.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sparsesync.codec import state_digest
from sparsesync.codec.anchor import write_anchor_index
from sparsesync.errors import RankFailedError, SparsesyncError, StoreUnavailableError
from sparsesync.protocol.records import CommitRecord, ObjectRef, PartRef
from sparsesync.protocol.writer.commits import CheckpointFiles, CommitWriter
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.ranks import RANK_DIED, Ranks, collective, combined_metrics
from sparsesync.protocol.writer.uploads import PendingVersion, UploadQueue, wait_to_retry

STORE_TRIES = 5  # store outages retried (with backoff) before a rank reports failure to the others


def anchor_folder(staging: Path, item: PendingVersion) -> Path:
    """The staging folder of the anchor files of `item` (created, and set as its `anchor_dir`)."""
    d = staging / f"anchor-{item.version}-{item.uid}"
    d.mkdir(parents=True, exist_ok=True)
    item.anchor_dir = d
    return d


class ShardCommits:
    """One rank's uploads of a sharded writer, and rank 0's commits (see the module docstring).
    `group`: the uploader's own gloo group (never the caller's thread's)."""

    def __init__(self, *, ranks: Ranks, group: Any, config: PublisherConfig, commits: CommitWriter,
                 files: CheckpointFiles, queue: UploadQueue, staging: Path, url: str) -> None:
        self.r, self._up, self.config, self.commits, self.files = ranks, group, config, commits, files
        self.queue, self.staging, self.url = queue, staging, url

    def upload(self, item: PendingVersion) -> tuple[dict[str, Any], str]:
        """Store this rank's objects, then one collective; rank 0 commits; all learn the outcome.
        The commit's metrics (this rank's) and its global state digest; RankFailedError when any rank failed."""
        t0 = time.perf_counter()
        report: dict[str, Any] = {"rank": self.r.rank, "version": item.version, "error": None}
        try:
            refs, anchor = self._store_local(item)
            report.update(parts=refs, anchor=anchor, digests=item.digests, base_digests=item.base_digests or {},
                          anchor_digests=item.metrics.get("_anchor_digests", {}),
                          metrics={k: v for k, v in item.metrics.items() if not k.startswith("_")})
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            report["error"] = f"{type(e).__name__}: {e}"
        reports: list[Any] = [None] * self.r.world
        outcome: list[Any] = [None]
        with collective(f"version {item.version} of {self.url} was not committed", "a rank did not report its part",
                         hint=f"{RANK_DIED}: the next writer continues from the newest committed version"):
            dist.all_gather_object(reports, report, group=self._up)
            if self.r.rank == 0:
                outcome = [self._commit_all(item, reports, t0)]
            dist.broadcast_object_list(outcome, src=self.r.src, group=self._up)  # (error or None, state digest)
        error, digest = outcome[0]
        if error is not None:
            raise RankFailedError(
                f"version {item.version} of {self.url} was not committed: {error}",
                hint="fix the failing rank and restart the job: the next writer continues from the newest committed "
                     "version",
            )
        if item.anchor_dir is not None:
            shutil.rmtree(item.anchor_dir, ignore_errors=True)
        out = {k: v for k, v in item.metrics.items() if not k.startswith("_")} | {"version": item.version}
        if rewind := item.metrics.get("_rewind"):  # what rank 0's commit says of the rewind, on every rank
            out |= {k: v for k, v in rewind.items() if k not in ("anchor", "state_digest")} | {"kind": "rewind"}
        return out, digest

    def _store_local(self, item: PendingVersion) -> tuple[list[PartRef], list[ObjectRef]]:
        """Upload this rank's parts (and its anchor file), retrying store outages a few times
        (the last one is reported to every rank)."""
        backoff = self.config.retry_backoff_s
        for _ in range(STORE_TRIES - 1):
            try:
                return self._store_objects(item)
            except StoreUnavailableError as e:
                backoff = wait_to_retry(f"rank {self.r.rank}: upload of version {item.version}", e, backoff)
        return self._store_objects(item)

    def _store_objects(self, item: PendingVersion) -> tuple[list[PartRef], list[ObjectRef]]:
        """One try of `_store_local`."""
        if err := item.metrics.get("_anchor_error"):
            raise SparsesyncError(err)
        refs: list[PartRef] = []
        if item.parts is not None:
            base = item.base_version
            assert base is not None
            refs = [
                self.commits.put_part(base, item.version, item.uid, part) for part in self.queue.encoded_parts(item)
            ]
        if item.failed:
            raise SparsesyncError(f"encoding version {item.version} failed on this rank")
        anchor = (
            self.commits.put_anchor(item.version, item.uid, sorted(item.anchor_dir.iterdir()))
            if item.anchor_dir
            else []
        )
        return refs, anchor

    def _commit_all(self, item: PendingVersion, reports: list[dict[str, Any]], t0: float) -> tuple[str | None, str]:
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
            rewind = item.metrics.get("_rewind")
            if parts:
                sd = state_digest(digests)
                base_sd = state_digest({k: d for r in reports for k, d in r["base_digests"].items()})
            elif rewind is not None and rewind["anchor"] is not None:  # the rewound version's own anchor
                anchor, sd, base_sd = list(rewind["anchor"]), rewind["state_digest"], None
            else:
                (sd, index), base_sd = self._anchor_index(item, reports), None
                anchor += index
            rec = CommitRecord(
                version=item.version,
                epoch=self.commits.epoch,
                writer=self.commits.writer,
                state_digest=sd,
                created_at=time.time(),
                base_version=item.base_version if parts else None,
                base_state_digest=base_sd,
                anchor=anchor,
                parts=parts,
                files=self.files.refs(self.commits, item.version, item.uid, adapter_run=False),
            )
            rec.metrics = {**combined_metrics([r["metrics"] for r in reports]), "version": item.version,
                           "base_version": rec.base_version, "ranks": self.r.world,
                           "upload_s": time.perf_counter() - t0, "kind": "delta" if parts else "anchor"}
            if rewind is not None:  # docs/protocol.md, "Rewinds"
                rec.metrics |= {k: v for k, v in rewind.items() if k not in ("anchor", "state_digest")} | {
                    "kind": "rewind",
                    "anchor_bytes": sum(o.size for o in anchor),
                    "reused_anchor": rewind["anchor"] is not None,
                }
            self.commits.commit(rec)
        except Exception as e:  # noqa: BLE001 - every rank raises it
            return f"rank 0 could not commit: {type(e).__name__}: {e}", ""
        return None, sd

    def _anchor_index(self, item: PendingVersion, reports: list[dict[str, Any]]) -> tuple[str, list[ObjectRef]]:
        """Rank 0, an anchor version: its state digest (whole tensors), and the index it stores
        beside the ranks' files when there are several ([] when one file holds it all)."""
        plan = item.metrics["_anchor_plan"]
        digests = {k: d for r in reports for k, d in r["anchor_digests"].items()}
        if set(digests) != set(plan.owner):
            raise SparsesyncError(f"the ranks' anchor files hold {len(digests)} tensors, the plan {len(plan.owner)}")
        if len(plan.files) == 1:
            return state_digest(digests), []
        path = write_anchor_index(anchor_folder(self.staging, item), plan.weight_map, digests, version=item.version,
                                  total_size=plan.total_size)
        return state_digest(digests), self.commits.put_anchor(item.version, item.uid, [path])

