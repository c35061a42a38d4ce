"""Which versions a replica's report names, across rewinds (docs/protocol.md, "Rewinds").

`Lineage`: from one listing of `commits/`, whether a replica's `(version, state_digest)` is a
trusted version, an abandoned one (a rewind committed that version number again with other
weights, or the digest is an untrusted commit's), or one this listing cannot judge (a version
newer than it shows), reading at most the records of that version (cached: records are
immutable). Used by the fleet (`fleet.wait_for_fleet`, the switch rule in `fleet_member`) and
`sparsesync status`. Readers never need it to stay bit-exact: trust is the fencing rule
(`keys.valid_commits`) and identity the state digest; this only makes the fleet view right.
"""

from __future__ import annotations

from typing import Any

from sparsesync.errors import MalformedCommitError, SparsesyncError
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
        keys = [o.key for o in store.list(COMMITS)]
        self.trusted: dict[int, str] = {v: k for v, _e, k in valid_commits(keys)}
        self.newest = max(self.trusted, default=None)
        self.untrusted: dict[int, list[str]] = {}
        for k in keys:
            if (p := parse_commit_key(k)) and self.trusted.get(p[0]) != k:
                self.untrusted.setdefault(p[0], []).append(k)
        self._cache = {} if cache is None else cache

    def record(self, key: str) -> CommitRecord | None:
        if key not in self._cache:
            try:
                self._cache[key] = CommitRecord.from_json(read_at_most(self.store, key, MAX_COMMIT_BYTES), key)
            except (SparsesyncError, MalformedCommitError):
                self._cache[key] = None
        return self._cache[key]

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
