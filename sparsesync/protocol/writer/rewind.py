"""Rewinds, the writer side: a run continues from a checkpoint older than its newest version (docs/protocol.md, "Rewinds").

`rewind(whole, state, version, ...)` (called by `Publisher.resume(state, version=N)` for N below
the run's newest version, on the writer's parts: `writer.whole.WholeState`) checks the
checkpoint against the run before anything is uploaded (when the run trusts a commit of N, the
state digests must be equal; else PatchMismatchError whose hint names what exists), then writes
the rewind commit `(N, epoch)` at once: the trusted N's own anchor when it has one (nothing
uploaded), else a new anchor of `state`. Under the fencing rule every commit of an older epoch
at N or above is then untrusted (abandoned), and the publisher continues with deltas from N.
A sharded writer (`writer.sharded.ShardedState.resume`) does the same on every rank from
`resume_info` (rank 0's view of the run) with `check_checkpoint`, its rewind commit written
through its uploader as any version. `stand_below`: `sparsesync push --step N` below the newest.

The reader side (which versions a rewind abandoned, whether a replica serves one) is
`protocol.keys.abandoned_by_rewinds` and `protocol.lineage.Lineage`.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sparsesync.checkpoint import checkpoint_state
from sparsesync.codec import write_anchor
from sparsesync.errors import ConfigError, PatchMismatchError, SparsesyncError
from sparsesync.protocol.adapter_runs import check_publish
from sparsesync.protocol.keys import new_uid
from sparsesync.protocol.records import AdapterMeta, CommitRecord, ObjectRef
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.anchors import AnchorHistory

if TYPE_CHECKING:  # `whole` calls this module: what it offers here is a protocol (`mode.WholeWriter`)
    from sparsesync.protocol.writer.mode import WholeWriter

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ writer side
def version_with_digest(commits: Sequence[Any], digest: str) -> Any:
    """The newest trusted commit whose state digest is `digest` (None: these weights are no version of the run)."""
    return next((c for c in reversed(commits) if c.state_digest == digest), None)


def describe_versions(commits: Sequence[Any]) -> str:
    """`0..5` style summary of the trusted versions, for messages."""
    vs = [c.version for c in commits]
    if not vs:
        return "no version"
    if vs == list(range(vs[0], vs[-1] + 1)):
        return f"versions {vs[0]}..{vs[-1]}"
    return "versions " + ", ".join(map(str, vs[:3])) + (" ... " if len(vs) > 5 else ", ") + ", ".join(map(str, vs[3:][-2:]))


@dataclass(frozen=True)
class VersionDigest:
    """A trusted version and its state digest (what a refusal's hint needs of a commit)."""

    version: int
    state_digest: str


def check_checkpoint(url: str, commits: Sequence[CommitRecord | VersionDigest], version: int, digest: str, *,
                     also: str | None = None, what: str = "the checkpoint's weights") -> Any:
    """The trusted commit of `version` when the run has one and its weights are `digest`; None when
    the run never committed `version`. PatchMismatchError (nothing written) when it holds other
    weights: the hint names the version these weights are (by `digest`, or `also`: their digest
    over other units), if any, else the run's versions."""
    target = next((c for c in commits if c.version == version), None)
    if target is None or target.state_digest == digest:
        return target
    same = next((c for d in (digest, also) if d for c in [version_with_digest(commits, d)] if c), None)
    hint = (f"these weights are version {same.version} of the run: resume from checkpoint-{same.version}"
            if same is not None else
            f"they are none of the run's {describe_versions(commits)}: resume from a checkpoint of this run, "
            "or publish to a new run URL")
    raise PatchMismatchError(
        f"{what} have state digest {digest}, but version {version} of {url} has "
        f"{target.state_digest}: it is not a checkpoint of this run", hint=hint)


def resume_info(run: Run, version: int | None) -> dict[str, Any] | SparsesyncError | None:
    """Rank 0 of a sharded writer, for `ShardedState.resume(state, version)`: what every rank needs
    to check the weights and (when `version` is below the newest) to rewind; None for an empty run,
    the error every rank raises when the request is refused before anything is written."""
    commits = run.commits()
    if not commits:
        return None
    newest = commits[-1]
    n = newest.version if version is None else version
    if n > newest.version:
        return ConfigError(f"rewind to version {n} of {run.url}, whose newest version is {newest.version}",
                           hint="a rewind goes back; resume() without version continues from the newest")
    target = next((c for c in commits if c.version == n), None)
    info: dict[str, Any] = {
        "version": n, "commits": [VersionDigest(c.version, c.state_digest) for c in commits], "rewind": None,
        "history": AnchorHistory.of(commits),
        "target": None if target is None else {
            "state_digest": target.state_digest,
            "units": sorted((u for p in target.parts for u in p.units), key=lambda u: u.key) if target.parts else None},
    }
    if n == newest.version:
        return info
    try:
        check_publish(newest, None, run.url)  # a sharded writer publishes full weights only
    except SparsesyncError as e:
        return e
    abandoned = [c for c in commits if c.version > n]
    reuse = target is not None and target.has_anchor and not any(u.rows is not None for p in target.parts for u in p.units)
    info["rewind"] = {
        "anchor": list(target.anchor) if reuse else None, "anchor_bytes": sum(o.size for o in target.anchor) if reuse else 0,
        "state_digest": target.state_digest if reuse else None, "version": n, "rewind_from": newest.version,
        "rewind_from_epoch": max(c.epoch for c in abandoned), "abandoned": [c.version for c in abandoned]}
    return info


def rewind(whole: WholeWriter, state: Mapping[str, torch.Tensor], version: int, commits: list[CommitRecord],
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
    snap = whole.new_snapshot(whole.cast(checkpoint_state(state)), version)
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


def _upload_anchor(whole: WholeWriter, state: Mapping[str, torch.Tensor], version: int, uid: str) -> list[ObjectRef]:
    folder = whole.staging / f"rewind-{version}-{uid}"
    try:
        files = write_anchor(dict(state), folder, version=version)
        return whole.commits.put_anchor(version, uid, sorted(files))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------ push --step N <= newest
def stand_below(whole: WholeWriter, state: Mapping[str, torch.Tensor], version: int, commits: list[CommitRecord]) -> None:
    """Stand the writer (not published yet) at the trusted `version`, whose weights `state` holds
    (checked by state digest), without committing anything: its next `publish(state, N)` (N above
    `version`, at or below the run's newest) is a delta `version -> N` whose commit abandons the
    older epochs' versions from N on (`Publisher.continue_below`, `sparsesync push --step N`)."""
    target = next((c for c in commits if c.version == version), None)
    if target is None:
        raise ConfigError(f"version {version} is not committed under {whole.url}")
    snap = whole.new_snapshot(whole.cast(checkpoint_state(state)), version)
    if snap.state_digest != target.state_digest:
        raise PatchMismatchError(f"the weights given have state digest {snap.state_digest}, but version {version} of "
                                 f"{whole.url} has {target.state_digest}", hint="load that version first (`sparsesync pull`)")
    whole.stand_at(snap, AnchorHistory.of([c for c in commits if c.version <= version]))


