"""Rewinds, the writer side: a run continues from a checkpoint older than its newest version (docs/protocol.md,
"Rewinds").

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

`push`'s planning (`sparsesync.transfer.push`, `sparsesync push`) is one call: `plan_push` decides,
before anything is written, how a checkpoint becomes version N of the run (the next version; the
newest already held; a rewind to N; or a delta from the newest version below N), names what it
abandons and asks for approval (`RewindPlan`); `pushed_abandoned` says afterwards what it did
abandon.

The reader side (which versions a rewind abandoned, whether a replica serves one) is
`protocol.keys.abandoned_by_rewinds` and `protocol.lineage.Lineage`.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from sparsesync.checkpoint import checkpoint_digest, checkpoint_state
from sparsesync.codec import algo_of, write_anchor
from sparsesync.errors import ConfigError, PatchMismatchError, RewindRefusedError, SparsesyncError
from sparsesync.protocol.adapter_runs import check_publish
from sparsesync.protocol.keys import new_uid
from sparsesync.protocol.records import AdapterMeta, CommitMetrics, CommitRecord, ObjectRef
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
    return (
        "versions "
        + ", ".join(map(str, vs[:3]))
        + (" ... " if len(vs) > 5 else ", ")
        + ", ".join(map(str, vs[3:][-2:]))
    )


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
    reuse = (
        target
        if target is not None
        and target.has_anchor
        and not any(u.rows is not None for p in target.parts for u in p.units)
        else None
    )
    info["rewind"] = {
        "anchor": list(reuse.anchor) if reuse else None,
        "anchor_bytes": sum(o.size for o in reuse.anchor) if reuse else 0,
        "state_digest": reuse.state_digest if reuse else None,
        "version": n,
        "rewind_from": newest.version,
        "rewind_from_epoch": max(c.epoch for c in abandoned),
        "abandoned": [c.version for c in abandoned],
    }
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
    # the run's digest algorithm
    snap = whole.new_snapshot(whole.cast(checkpoint_state(state)), version, algo_of(newest.state_digest))
    target = check_checkpoint(url, commits, version, snap.state_digest)
    w = whole.commits
    rec = CommitRecord(version=version, epoch=w.epoch, writer=w.writer, state_digest=snap.state_digest,
                       created_at=time.time(), adapter=adapter)
    t0 = time.perf_counter()
    uid = new_uid()
    if target is not None and target.has_anchor and not any(u.rows is not None for p in target.parts for u in p.units):
        rec.anchor = list(target.anchor)  # the same bytes (same version, same digest): nothing uploaded
    else:
        rec.anchor = _upload_anchor(whole, snap.state, version, uid, snap.algo)
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


def _upload_anchor(
    whole: WholeWriter, state: Mapping[str, torch.Tensor], version: int, uid: str, algo: str
) -> list[ObjectRef]:
    folder = whole.staging / f"rewind-{version}-{uid}"
    try:
        files = write_anchor(dict(state), folder, version=version, algo=algo)
        return whole.commits.put_anchor(version, uid, sorted(files))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------ push --step N <= newest
def stand_below(
    whole: WholeWriter, state: Mapping[str, torch.Tensor], version: int, commits: list[CommitRecord]
) -> None:
    """Stand the writer (not published yet) at the trusted `version`, whose weights `state` holds
    (checked by state digest), without committing anything: its next `publish(state, N)` (N above
    `version`, at or below the run's newest) is a delta `version -> N` whose commit abandons the
    older epochs' versions from N on (`Publisher.continue_below`, `sparsesync push --step N`)."""
    target = next((c for c in commits if c.version == version), None)
    if target is None:
        raise ConfigError(f"version {version} is not committed under {whole.url}")
    snap = whole.new_snapshot(whole.cast(checkpoint_state(state)), version, algo_of(target.state_digest))
    if snap.state_digest != target.state_digest:
        raise PatchMismatchError(
            f"the weights given have state digest {snap.state_digest}, but version {version} of "
            f"{whole.url} has {target.state_digest}",
            hint="load that version first (`sparsesync pull`)",
        )
    whole.stand_at(snap, AnchorHistory.of([c for c in commits if c.version <= version]))




# ------------------------------------------------------------------------------ push's plan
@dataclass(frozen=True)
class RewindPlan:
    """A rewind `push` is about to do, before anything is written (what `rewind` approves)."""

    url: str
    """The run's URL."""
    newest: int
    """The run's newest version."""
    version: int
    """The version the checkpoint becomes."""
    step_from: str
    """Where `version` came from."""
    abandoned: list[int]
    """The versions the rewind abandons, each once, ascending."""

    def describe(self) -> str:
        """One line: what the rewind does."""
        return (f"version {self.version} (from {self.step_from}) is not above version {self.newest}, the newest of "
                f"{self.url}: pushing it rewinds the run and abandons {_versions_text(self.abandoned)}")


def _versions_text(versions: list[int]) -> str:
    """'version 5', 'versions 4, 5', 'versions 3..900 (898 versions)' or
    'versions 1, 4, 7 ... 99, 120 (40 versions)'."""
    if len(versions) == 1:
        return f"version {versions[0]}"
    if len(versions) <= 8:
        return "versions " + ", ".join(map(str, versions))
    if versions == list(range(versions[0], versions[-1] + 1)):
        return f"versions {versions[0]}..{versions[-1]} ({len(versions)} versions)"
    head, tail = ", ".join(map(str, versions[:3])), ", ".join(map(str, versions[-2:]))
    return f"versions {head} ... {tail} ({len(versions)} versions)"


@dataclass(frozen=True)
class PushPlan:
    """How `push` publishes a checkpoint as version `version` (`plan_push`).

    next: above the newest (or a new run): a delta from `base` (None: a new run's first anchor).
    held: the newest version already is these weights: nothing to push.
    rewind: these weights are the run's version `version`: the run is rewound to it (`Publisher.resume(version=)`).
    below: the checkpoint becomes `version` as a delta from `base`, the newest version below it
    (`Publisher.continue_below`).
    """

    how: Literal["next", "held", "rewind", "below"]
    version: int
    base: int | None
    abandoning: list[int]
    """The versions it abandons, each once, ascending (empty for next and held)."""

    @property
    def below_newest(self) -> bool:
        """Whether the version is at or below the run's newest (a rewind, held, or below)."""
        return self.how != "next"


def plan_push(run: Run, newest: CommitRecord | None, state: Mapping[str, Any], version: int, *, step_from: str,
              step_source: str, rewind: bool | Callable[[RewindPlan], bool], rewind_source: str) -> PushPlan:
    """How `push` publishes `state` as `version` of `run`, whose newest trusted commit is `newest`
    (docs/protocol.md, "Rewinds"). Writes nothing. At or below the newest: held when the newest
    already is these weights (by state digest); else the plan abandons versions, so it goes ahead
    only when `rewind` is True or approves the `RewindPlan` naming them, else RewindRefusedError.
    ConfigError when the run has no version below `version` to continue from. `step_source` and
    `rewind_source` name the options in messages ("--step", "--rewind")."""
    if newest is None or version > newest.version:
        return PushPlan("next", version, None if newest is None else newest.version, [])
    commits = run.commits()
    same = next((c for c in commits if c.version == version), None)
    # in the run's digest algorithm
    if same is not None and same.state_digest == checkpoint_digest(state, algo_of(same.state_digest)):
        if same is commits[-1]:
            return PushPlan("held", version, None, [])
        plan = PushPlan("rewind", version, None, sorted({c.version for c in commits if c.version > version}))
    else:
        below = [c.version for c in commits if c.version < version]
        if not below:
            raise ConfigError(f"version {version} (from {step_from}) is not newer than version {commits[-1].version}, "
                              f"the newest of {run.url}, and the run has no version below it to continue from",
                              hint=f"pass {step_source} N with a larger N, or push to a new run URL")
        plan = PushPlan("below", version, below[-1], sorted({c.version for c in commits if c.version >= version}))
    asked = RewindPlan(url=run.url, newest=newest.version, version=version, step_from=step_from,
                       abandoned=plan.abandoning)
    if not (rewind(asked) if callable(rewind) else rewind is True):
        raise RewindRefusedError(
            f"refusing to rewind: {asked.describe()}", newest=newest.version, version=version,
            abandoned=plan.abandoning,
            hint=f"pass {rewind_source} to rewind the run, or {step_source} N with N above {newest.version} "
                 "to publish the checkpoint as a new version")
    return plan


def pushed_abandoned(run: Run, plan: PushPlan, epoch: int, metrics: Mapping[str, Any]) -> list[int] | None:
    """What the push of `plan` abandoned once committed by `epoch` with `metrics` (its commit's):
    the versions of the older attempt, each once, ascending; None for a push above the newest.
    A rewind commit names them; a delta below the newest abandoned every older commit from its
    version on (read from a fresh listing of `run`)."""
    if not plan.below_newest:
        return None
    m = CommitMetrics.of(metrics)
    if m.is_rewind:
        return sorted(set(m.abandoned or []))
    return sorted({v for a in run.abandoned() if (a.version, a.by_epoch) == (plan.version, epoch) for v in a.versions})
