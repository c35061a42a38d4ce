"""Rewinds: a run continues from a checkpoint older than its newest version (docs/protocol.md, "Rewinds").

Writer side, `rewind(whole, state, version, ...)` (called by `Publisher.resume(state, version=N)`
for N below the run's newest version, on the writer's parts: `protocol.writer.whole.WholeState`): checks the checkpoint against the run before anything is
uploaded (when the run trusts a commit of N, the state digests must be equal; else
PatchMismatchError whose hint names what exists), then writes the rewind commit `(N, epoch)` at
once: the trusted N's own anchor when it has one (nothing uploaded), else a new anchor of
`state`. Under the fencing rule every commit of an older epoch at N or above is then
untrusted (abandoned), and the publisher continues with deltas from N.

Reader side, `Lineage`: from one listing of `commits/`, whether a replica's `(version,
state_digest)` is a trusted version, an abandoned one, or one this listing cannot judge (a
version newer than it shows), reading at most the records of that version (cached: records
are immutable). `abandoned_by_rewinds` says which versions of which epoch each rewind abandoned
(`sparsesync log`, `pull --version`). Readers never need either to stay bit-exact: trust is
the fencing rule and identity the state digest; these only make the fleet view and messages right.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparsesync.checkpoint import checkpoint_state
from sparsesync.codec import write_anchor
from sparsesync.errors import (
    ConfigError,
    MalformedCommitError,
    PatchMismatchError,
    SparsesyncError,
)
from sparsesync.protocol.adapter_runs import check_publish
from sparsesync.protocol.keys import COMMITS, new_uid, parse_commit_key, valid_commits
from sparsesync.protocol.records import MAX_COMMIT_BYTES, AdapterMeta, CommitRecord, ObjectRef
from sparsesync.protocol.run import read_at_most
from sparsesync.protocol.writer.anchors import AnchorHistory
from sparsesync.store import Store

if TYPE_CHECKING:
    from sparsesync.protocol.writer.whole import WholeState

log = logging.getLogger(__name__)
SWITCH_SLACK_S = 1.0  # a switch record written more than this before a commit belongs to an abandoned version


# ------------------------------------------------------------------------------ writer side
def version_with_digest(commits: list[CommitRecord], digest: str) -> CommitRecord | None:
    """The newest trusted commit whose state digest is `digest` (None: these weights are no version of the run)."""
    return next((c for c in reversed(commits) if c.state_digest == digest), None)


def describe_versions(commits: list[CommitRecord]) -> str:
    """`0..5` style summary of the trusted versions, for messages."""
    vs = [c.version for c in commits]
    if not vs:
        return "no version"
    if vs == list(range(vs[0], vs[-1] + 1)):
        return f"versions {vs[0]}..{vs[-1]}"
    return "versions " + ", ".join(map(str, vs[:3])) + (" ... " if len(vs) > 5 else ", ") + ", ".join(map(str, vs[3:][-2:]))


def check_checkpoint(url: str, commits: list[CommitRecord], version: int, digest: str) -> CommitRecord | None:
    """The trusted commit of `version` when the run has one and its weights are `digest`; None when
    the run never committed `version`. PatchMismatchError (nothing written) when it holds other
    weights: the hint names the version these weights are, if any, else the run's versions."""
    target = next((c for c in commits if c.version == version), None)
    if target is None or target.state_digest == digest:
        return target
    same = version_with_digest(commits, digest)
    hint = (f"these weights are version {same.version} of the run: resume from checkpoint-{same.version}"
            if same is not None else
            f"they are none of the run's {describe_versions(commits)}: resume from a checkpoint of this run, "
            "or publish to a new run URL")
    raise PatchMismatchError(
        f"the checkpoint's weights have state digest {digest}, but version {version} of {url} has "
        f"{target.state_digest}: it is not a checkpoint of this run", hint=hint)


def rewind(whole: WholeState, state: Mapping[str, torch.Tensor], version: int, commits: list[CommitRecord],
           adapter: AdapterMeta | None) -> CommitRecord:
    """Make `state` (an adapter's tensors when `adapter` is set) version `version` of the run,
    abandoning the newer versions (see module docstring), through the writer's parts (`whole`
    has not published yet; afterwards it continues with deltas from `version`); returns the
    rewind commit."""
    url = whole.url
    newest = commits[-1]
    if version >= newest.version:
        raise ConfigError(f"rewind to version {version} of {url}, whose newest version is {newest.version}",
                          hint="a rewind goes back; resume() without version continues from the newest")
    check_publish(newest, adapter, url)
    snap = whole.new_snapshot(checkpoint_state(state), version)
    target = check_checkpoint(url, commits, version, snap.state_digest)
    w = whole.commits
    rec = CommitRecord(version=version, epoch=w.epoch, writer=w.writer, state_digest=snap.state_digest,
                       created_at=time.time(), adapter=adapter)
    t0 = time.perf_counter()
    uid = new_uid()
    if target is not None and target.has_anchor and not any(u.rows is not None for p in target.parts for u in p.units):
        rec.anchor = list(target.anchor)  # the same bytes (same version, same digest): nothing uploaded
    else:
        rec.anchor = _upload_anchor(whole, snap.state, version, uid)
    rec.files = whole.files.refs(w, version, uid, adapter_run=adapter is not None)
    abandoned = [c for c in commits if c.version > version]  # version N itself: the same weights (checked)
    rec.metrics = {"kind": "rewind", "version": version, "rewind_from": newest.version,
                   "rewind_from_epoch": max(c.epoch for c in abandoned), "abandoned": [c.version for c in abandoned],
                   "anchor_bytes": sum(o.size for o in rec.anchor), "upload_s": time.perf_counter() - t0,
                   "reused_anchor": target is not None and rec.anchor == list(target.anchor)}
    w.commit(rec)  # fenced, then confirmed visible
    # the writer now stands where a resume from `version` would leave it
    whole.stand_at(snap, AnchorHistory(version, rec.metrics["anchor_bytes"], 0))
    log.warning("rewound %s to version %d (epoch %d): versions %s of epoch %d abandoned", url, version, w.epoch,
                rec.metrics["abandoned"], rec.metrics["rewind_from_epoch"])
    return rec


def _upload_anchor(whole: WholeState, state: Mapping[str, torch.Tensor], version: int, uid: str) -> list[ObjectRef]:
    folder = whole.staging / f"rewind-{version}-{uid}"
    try:
        files = write_anchor(dict(state), folder, version=version)
        return whole.commits.put_anchor(version, uid, sorted(files))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------ reader side
@dataclass(frozen=True)
class Abandoned:
    """Versions of `epoch` that the rewind commit `(version, by_epoch)` made untrusted."""

    versions: tuple[int, ...]
    epoch: int
    version: int  # the rewind commit's version
    by_epoch: int


def abandoned_by_rewinds(keys: list[str]) -> list[Abandoned]:
    """From the names of `commits/`: for each untrusted commit, the trusted commit of a newer epoch
    at or below its version that overrules it (the first such), grouped per (epoch, rewind)."""
    valid = valid_commits(keys)
    trusted = {k for _v, _e, k in valid}
    groups: dict[tuple[int, int, int], list[int]] = {}
    for v, e in sorted(p for k in keys if (p := parse_commit_key(k)) and k not in trusted):
        by = next(((tv, te) for tv, te, _k in valid if te > e and tv <= v), None)
        if by is not None:
            groups.setdefault((e, by[0], by[1]), []).append(v)
    return [Abandoned(tuple(vs), e, bv, be) for (e, bv, be), vs in sorted(groups.items())]


def abandoned_note(store: Store, version: int) -> str:
    """' (abandoned by the rewind to version N, epoch E)' when `version` was abandoned, else ''."""
    try:
        keys = [o.key for o in store.list(COMMITS)]
    except SparsesyncError:
        return ""
    for a in abandoned_by_rewinds(keys):
        if version in a.versions:
            return f"; version {version} of epoch {a.epoch} was abandoned by the rewind to version {a.version} (epoch {a.by_epoch})"
    return ""


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
                return hb.staged_at is not None and hb.staged_at < at - SWITCH_SLACK_S
            return hb.staged_version in self.untrusted  # no trusted commit has that number, an abandoned one has
        return served


# ------------------------------------------------------------------------------ push --step N <= newest
def stand_below(whole: WholeState, state: Mapping[str, torch.Tensor], version: int, commits: list[CommitRecord]) -> None:
    """Stand the writer (not published yet) at the trusted `version`, whose weights `state` holds
    (checked by state digest), without committing anything: its next `publish(state, N)` (N above
    `version`, at or below the run's newest) is a delta `version -> N` whose commit abandons the
    older epochs' versions from N on (`Publisher.continue_below`, `sparsesync push --step N`)."""
    target = next((c for c in commits if c.version == version), None)
    if target is None:
        raise ConfigError(f"version {version} is not committed under {whole.url}")
    snap = whole.new_snapshot(checkpoint_state(state), version)
    if snap.state_digest != target.state_digest:
        raise PatchMismatchError(f"the weights given have state digest {snap.state_digest}, but version {version} of "
                                 f"{whole.url} has {target.state_digest}", hint="load that version first (`sparsesync pull`)")
    whole.stand_at(snap, AnchorHistory.of([c for c in commits if c.version <= version]))


# ------------------------------------------------------------------------------ switching together
def current_switch(store: Store, version: int, epoch: int, committed_at: float) -> tuple[Any, int | None]:
    """(the switch record in force for the commit of `version` by `epoch`, written `committed_at`,
    or None; the epoch its key carries, None for the plain `switches/v{N}.json`). A plain record
    written more than `SWITCH_SLACK_S` before that commit belongs to a version a rewind abandoned:
    the commit's switch is then `switches/v{N}-e{E}.json` (docs/protocol.md, "Rewinds")."""
    from sparsesync.protocol.fleet import read_switch

    plain = read_switch(store, version)
    if plain is None or plain.written_at >= committed_at - SWITCH_SLACK_S:
        return plain, None
    return read_switch(store, version, epoch), epoch
