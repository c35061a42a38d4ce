"""Which versions a replica's report names, across rewinds (docs/protocol.md, "Rewinds").

`Lineage`: from one listing of `commits/`, whether a replica's `(version, state_digest)` is a
trusted version, an abandoned one (a rewind committed that version number again with other
weights, or the digest is an untrusted commit's), or one this listing cannot judge (a version
newer than it shows), reading at most the records of that version (cached: records are
immutable). Used by the fleet (`fleet.wait_for_fleet`, the switch rule in `fleet_member`) and
`sparsesync status`. `TrustedCommits`: whether a sample's `(version, state_digest)` (what a replica
returns with each completion) is the run's trusted commit of that version, so an RL trainer drops
samples of versions a rewind abandoned, and samples that name no version or digest (the project's
trainer, TRL's async rollout worker). `lag`: how far behind a replica is, counting a version a
rewind abandoned as none of the run's. Readers never need it to stay bit-exact: trust is the fencing rule
(`keys.valid_commits`, counting commit records only) and identity the state digest; this only makes
the fleet view and the samples' attribution right.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sparsesync.errors import MalformedCommitError, ObjectNotFoundError, SparsesyncError
from sparsesync.protocol.keys import COMMITS, parse_commit_key, valid_commits
from sparsesync.protocol.records import MAX_COMMIT_BYTES, CommitRecord
from sparsesync.protocol.run import read_at_most
from sparsesync.store import Store

# a replica that staged a version more than this before the version's commit staged an abandoned
# one (heartbeats carry no epoch of what they staged; the writer's and the replica's clocks)
STAGED_SLACK_S = 1.0


class Lineage:
    """Judges `(version, state_digest)` pairs against one listing of `commits/` (see module docstring)."""

    def __init__(self, store: Store, cache: dict[str, CommitRecord | None] | None = None) -> None:
        self.store = store
        self._cache = {} if cache is None else cache
        keys = [o.key for o in store.list(COMMITS)]
        # only commit records fence (a store error reading one raises, as the listing's does)
        self.trusted: dict[int, str] = {v: k for v, _e, k in valid_commits(keys, lambda k: self._read(k) is not None)}
        self.newest = max(self.trusted, default=None)
        self.untrusted: dict[int, list[str]] = {}
        for k in keys:
            if (p := parse_commit_key(k)) and self.trusted.get(p[0]) != k:
                self.untrusted.setdefault(p[0], []).append(k)

    def _read(self, key: str) -> CommitRecord | None:
        """The record at `key`, None when it is gone or not a commit (cached); other errors raise."""
        if key not in self._cache:
            try:
                self._cache[key] = CommitRecord.from_json(read_at_most(self.store, key, MAX_COMMIT_BYTES), key)
            except (ObjectNotFoundError, MalformedCommitError):
                self._cache[key] = None
        return self._cache[key]

    def record(self, key: str) -> CommitRecord | None:
        """The record at `key`, or None (gone, not a commit, or unreadable just now)."""
        try:
            return self._read(key)
        except SparsesyncError:
            return None

    def judge(self, version: int | None, digest: str | None) -> str:
        """"trusted": the trusted commit of `version` has `digest`; "abandoned": `version` was
        committed again by a newer epoch (a rewind) and `digest` is not the trusted one, or an
        untrusted commit of `version` has `digest`; "unknown" otherwise (nothing to serve, a
        version this listing does not show yet, or a digest no commit explains)."""
        if version is None:
            return "unknown"
        key = self.trusted.get(version)
        if key is not None:
            rec = self.record(key)
            if rec is None or digest is None:
                return "unknown"
            if rec.state_digest == digest:
                return "trusted"
            return "abandoned" if version in self.untrusted else "unknown"
        for k in self.untrusted.get(version, []):
            rec = self.record(k)
            if rec is not None and digest is not None and rec.state_digest == digest:
                return "abandoned"
        return "unknown"

    def committed_at(self, version: int) -> float | None:
        """When the trusted commit of `version` was written (writer's clock), or None."""
        key = self.trusted.get(version)
        rec = self.record(key) if key is not None else None
        return None if rec is None else rec.created_at

    def abandoned(self, hb: Any, target: int, staged: bool = False) -> bool:
        """Whether heartbeat `hb` (`fleet.Heartbeat`) reaches version `target` (`fleet.reached`)
        only through a version a rewind abandoned: it serves one (and, with `staged`, has not
        staged `target` or newer since that version was committed again)."""
        served = hb.version is not None and hb.version >= target
        if served and self.judge(hb.version, hb.state_digest) != "abandoned":
            return False
        if staged and hb.staged_version is not None and hb.staged_version >= target:
            at = self.committed_at(hb.staged_version)
            if at is not None:
                return hb.staged_at is not None and hb.staged_at < at - STAGED_SLACK_S
            return hb.staged_version in self.untrusted  # no trusted commit has that number, an abandoned one has
        return served


class TrustedCommits:
    """Whether samples' `(version, state_digest)` pairs name the run's trusted commits of those versions.

    A pair is trusted only when it names both and the digest is the trusted commit's of that
    version: a sample without a version (a replica serving its start-up weights, before any
    bucket version) or without a digest names no commit and is never trusted. `untrusted(pairs)`
    judges a batch on one listing of `commits/`: the last listing is reused while it is at most
    `max_age_s` old and trusts every pair of the batch; otherwise (a pair it does not trust: a
    version committed since, or a rewind) `commits/` is listed afresh and every pair of the batch
    is judged again on it, so a rewind that any one sample reveals is applied to all.
    `fresh=True` lists at once, `fresh=False` never lists while a listing is held (a caller that
    lists once per batch, e.g. a trainer's take). A failed listing raises its StoreError."""

    def __init__(self, store: Store, *, max_age_s: float = 10.0) -> None:
        self.store = store
        self.max_age_s = max_age_s
        self.listings = 0  # how many times `commits/` was listed
        self._cache: dict[str, CommitRecord | None] = {}
        self._lineage: Lineage | None = None
        self._listed_at = 0.0

    @staticmethod
    def _judge(lin: Lineage, version: int | None, digest: str | None) -> bool:
        key = lin.trusted.get(version) if version is not None else None
        if key is None or digest is None:
            return False
        rec = lin.record(key)
        return rec is not None and rec.state_digest == digest

    def untrusted(self, pairs: Iterable[tuple[int | None, str | None]], *,
                  fresh: bool | None = None) -> set[tuple[int | None, str | None]]:
        """The pairs that are not the run's trusted commit of their version (see the class docstring)."""
        pairs = set(pairs)
        if not pairs:
            return set()
        lin = self._lineage
        if lin is not None and not fresh:
            bad = {p for p in pairs if not self._judge(lin, *p)}
            young = time.monotonic() - self._listed_at <= self.max_age_s
            if fresh is False or (young and not bad):
                return bad
        self._lineage = lin = Lineage(self.store, self._cache)
        self._listed_at = time.monotonic()
        self.listings += 1
        return {p for p in pairs if not self._judge(lin, *p)}

    def trusts(self, version: int | None, digest: str | None) -> bool:
        """Whether `(version, digest)` is the run's trusted commit of `version` (`untrusted`)."""
        return not self.untrusted([(version, digest)])

def lag(commits: list[CommitRecord], version: int | None, digest: str | None, epoch: int | None) -> int | None:
    """How many versions a replica serving `(version, digest)` of commit epoch `epoch` is behind
    the newest of `commits` (the trusted ones, oldest first); None when it serves nothing or
    nothing is committed. Serving the trusted commit of its version: `newest - version`. Serving
    weights no trusted commit has (a version a rewind abandoned, or one committed again with
    other weights) it is not current, whatever the numbers say: it is behind by every version
    from the one it diverged at (the first trusted commit of a newer epoch at or below its
    version, or its own version) to the newest, that one included, so at least 1."""
    if version is None or not commits:
        return None
    newest = commits[-1].version
    held = next((c for c in reversed(commits) if c.version <= version), None)
    if held is not None and held.version == version and held.state_digest == digest:
        return max(newest - version, 0)
    fork = next((c.version for c in commits if epoch is not None and c.epoch > epoch and c.version <= version), version)
    return max(newest - min(fork, newest), 0) + 1
