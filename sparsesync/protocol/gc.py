"""Retention: delete what no follower can need, never what the newest version's chain needs.

Guarantees: the anchor that followers would cold-start from (the newest anchor from which a
delta chain reaches the newest committed version) and every object of every version from
the oldest kept anchor on stay in place. Deletion order keeps readers safe if gc dies
midway: commit records that are not valid (fenced writers) first, then old commit records,
then objects no remaining commit references (anchors, deltas, checkpoint files). Objects of versions newer than the
newest commit are never touched: they may belong to a writer that is uploading right now.

gc trusts only what it has seen: an anchor or delta counts as kept only when the listing shows
it with the size its commit recorded. When the newest committed version cannot be rebuilt from
what would be kept (its anchor or a delta of its chain is missing or has the wrong size),
`plan_gc` raises `BrokenChainError` and nothing is deleted: the older versions may be the only
good copies left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsesync.errors import BrokenChainError, ConfigError
from sparsesync.protocol.keys import (
    ANCHORS,
    COMMITS,
    DELTAS,
    FILES,
    commit_key,
    file_version,
    object_version,
    parse_commit_key,
)
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import Run
from sparsesync.store import Store


@dataclass
class GcPlan:
    """What `apply_gc` will delete, in order, and what it keeps."""

    newest_version: int | None
    oldest_kept_version: int | None
    invalid_commits: list[str] = field(default_factory=list)
    old_commits: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    kept_versions: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.invalid_commits or self.old_commits or self.objects)


def plan_gc(store: Store, *, keep_anchors: int = 1) -> GcPlan:
    """Compute what can go. Keeps the newest `keep_anchors` usable anchors and all after them."""
    if keep_anchors < 1:
        raise ConfigError(f"keep_anchors={keep_anchors}: must be >= 1 (the newest chain needs its anchor)")
    run = Run(store)
    commits = run.commits()
    listing = store.list("")  # after the commits: every object a listed commit names is listed too
    sizes = {o.key: o.size for o in listing}
    if not commits:
        return GcPlan(newest_version=None, oldest_kept_version=None)
    newest = commits[-1]
    # objects that are missing or do not have the size their commit recorded cannot be used
    unusable = {ref.key for c in commits for ref in c.objects() if sizes.get(ref.key) != ref.size}
    anchors = [c for c in reversed(commits) if c.has_anchor and not any(o.key in unusable for o in c.anchor)]
    usable = [a for a in anchors if _reaches(a.version, newest, commits, unusable)]
    if not usable:
        missing = sorted(ref.key for ref in newest.objects() if ref.key in unusable)
        raise BrokenChainError(
            f"gc of {store.url}: the newest version {newest.version} cannot be rebuilt from the objects present"
            + (
                f" ({missing[0]} is missing or has the wrong size)"
                if missing
                else " (no complete anchor with a delta chain to it)"
            )
            + "; nothing was deleted",
            hint="publish a new anchor (restart the trainer, or `sparsesync push` a full checkpoint), then run gc "
                 "again",
        )
    kept_anchor_versions = [a.version for a in usable[:keep_anchors]]
    keep_from = min(kept_anchor_versions)
    valid_keys = {k for k in sizes if k.startswith(COMMITS)} & {_key(c) for c in commits}
    plan = GcPlan(newest_version=newest.version, oldest_kept_version=keep_from)
    # fenced commit records, and commit-named objects that are not commit records
    plan.invalid_commits = sorted(k for k in sizes if parse_commit_key(k) and k not in valid_keys)
    kept = [c for c in commits if c.version >= keep_from]
    plan.kept_versions = [c.version for c in kept]
    plan.old_commits = sorted(_key(c) for c in commits if c.version < keep_from)
    referenced = {ref.key for c in kept for ref in c.objects()} | {f.key for c in kept for f in c.files}
    for key in sizes:
        if not key.startswith((ANCHORS, DELTAS, FILES)) or key in referenced:
            continue
        v = object_version(key) if not key.startswith(FILES) else file_version(key)
        if v is not None and v <= newest.version:
            plan.objects.append(key)
    plan.objects.sort()
    plan.bytes_freed = sum(sizes[k] for k in plan.invalid_commits + plan.old_commits + plan.objects)
    return plan


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Delete what `plan` lists, in the safe order."""
    for keys in (plan.invalid_commits, plan.old_commits, plan.objects):
        if keys:
            store.delete(keys)


def _key(rec: CommitRecord) -> str:
    return commit_key(rec.version, rec.epoch)


def _reaches(start: int, target: CommitRecord, commits: list[CommitRecord], unusable: set[str]) -> bool:
    return start == target.version or Run.chain(start, target.version, commits, unusable) is not None
