"""A follower with no host mirror: the engine's own tensors are the verified state.

For a hook whose `holds_device_state` is set (a GPU engine), the follower keeps no copy of the
weights on the host. `HeldEngine` takes the place of both the mirror (`mirror_steps.HeldMirror`)
and the engine steps (`engine_steps.EngineSteps`):
- a delta is fetched, checked (object digest, header, commit, the base state digest of what the
  engine holds) and decoded against the engine's tensors, and its compact updates copied to the
  device (`codec.device_apply.stage_on_device`), all while the engine serves; then, inside the
  engine's pause (`ApplyHook.write_in_place`), it is applied all or nothing on the device
  (`apply_staged`): the base digests of the touched tensors prove the engine held exactly the base
  version, the target digests that it now holds exactly the target, and any mismatch or error
  scatters the old bits back. A delta in parts goes through `Run.apply_delta` on the engine's
  tensors inside the pause (all or nothing too; decoded there, not ahead);
- an anchor is downloaded and its files checked while the engine serves, then read inside the pause
  into the engine's tensors through one host buffer of 64 MiB, each tensor hashed where it lives
  against the anchor's digest (`anchor_into`);
- after either, the engine checks its whole live state against the version's digests before it
  reports the version (`write_in_place`).

Guarantees: `version` is the version the engine's tensors hold (None when not known: after any
failure inside the pause); the follower reports a version only after `write_in_place` returned
(`served(rec)`), and reports none (`served(None)`) after one that raised, until an anchor loads.
A delta is taken only on top of the version held (`in_sync`); otherwise (and for a step that
would reload a mirror, which there is none of) `version` becomes None and the follower re-plans
from an anchor. Host memory beyond the process's baseline: the compact updates of one delta, or
while an anchor loads a buffer of 64 MiB (the anchor's files are on disk).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from sparsesync.codec import state_digest
from sparsesync.codec.device_apply import apply_staged, device_apply_supported, stage_on_device
from sparsesync.errors import DigestMismatchError, MirrorMismatchError
from sparsesync.protocol.follower.anchor_into import load_into
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.follower.mirror_steps import BAD_OBJECT
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import Run, State, Step


class HeldEngine:
    """The engine's tensors as the follower's verified state (see module docstring)."""

    pages_out = False
    prefetch = None  # decoding ahead would read the engine's tensors to the host: not done

    def __init__(self, run: Run, hook: ApplyHook, served: Callable[[CommitRecord | None], None],
                 workdir: str | Path | None = None) -> None:
        self.run = run
        self.hook = hook
        self.state: State = {}  # no host copy of the weights
        self.digests: dict[str, str] = {}  # the per-tensor digests of `version`
        self.version: int | None = None  # the version the engine's tensors hold (None: unknown)
        self.behind = False  # True while a write into the engine has not returned
        self._served = served
        self._workdir = workdir

    def overruled_by(self, commits: list[CommitRecord]) -> CommitRecord | None:
        """The trusted commit of the version held when it names another state, else None."""
        held = next((c for c in commits if c.version == self.version), None)
        return held if held is not None and held.state_digest != state_digest(self.digests) else None

    def page_out(self) -> None:
        """Nothing to page out: there is no mirror."""

    def run_step(self, step: Step, *, in_sync: bool, gate: Callable[[], None]) -> tuple[float, float]:
        """Bring the engine to `step.commit`; (seconds fetching and decoding, seconds in the pause).
        `gate`: called once the version is staged, before the pause (the fleet's switch)."""
        rec = step.commit
        t0 = time.perf_counter()
        if step.kind == "anchor":
            with tempfile.TemporaryDirectory(dir=self._workdir, prefix="sparsesync-anchor-") as tmp:
                try:
                    files = self.run.download_anchor(rec, Path(tmp))
                except BAD_OBJECT as e:
                    e.key = rec.anchor[0].key
                    raise
                fetch_s = time.perf_counter() - t0
                gate()
                t1 = time.perf_counter()
                self._write(rec, lambda live: self._load_anchor(rec, files, live), None, rec.anchor[0].key)
            return fetch_s, time.perf_counter() - t1
        if step.kind != "delta" or not in_sync:  # nothing on the host to reload from: re-plan from an anchor
            held, self.version = self.version, None
            raise MirrorMismatchError(
                f"the engine does not hold the base of version {rec.version} (it holds {held})",
                hint="the follower reloads the engine from an anchor",
            )
        write, key = self._stage_delta(rec)
        fetch_s = time.perf_counter() - t0
        gate()
        t1 = time.perf_counter()
        self._write(rec, write, rec.base_version, key)
        return fetch_s, time.perf_counter() - t1

    def _stage_delta(self, rec: CommitRecord) -> tuple[Callable[[Mapping[str, torch.Tensor]], dict[str, str]], str]:
        """Fetch, check and decode one delta while the engine serves: (the write to run in the
        pause, the key of the delta's object)."""
        if rec.parts:
            def parts(live: Mapping[str, torch.Tensor]) -> dict[str, str]:
                digests = dict(self.digests)
                self.run.apply_delta(rec, dict(live), digests)
                return digests

            return parts, rec.parts[0].key
        assert rec.delta is not None
        try:
            patch = self.run.load_delta(rec, self.digests)  # object digest, header, commit, base state digest
            after = {**self.digests, **{n: e.target_digest for n, e in patch.header.tensors.items()}}
            if state_digest(after) != rec.state_digest:
                raise DigestMismatchError(
                    f"delta {rec.delta.key} would give state digest {state_digest(after)}, but version "
                    f"{rec.version}'s commit says {rec.state_digest} (nothing written)",
                    hint="the patch does not produce the committed version; reload from an anchor",
                )
            if not device_apply_supported(patch):  # a run with "xxh3" digests: the codec's host path
                def legacy(live: Mapping[str, torch.Tensor]) -> dict[str, str]:
                    digests = dict(self.digests)
                    self.run.apply_loaded(rec, patch, dict(live), digests)
                    return digests

                return legacy, rec.delta.key
            staged = stage_on_device(patch, self.hook.device_tensors())
        except BAD_OBJECT as e:
            e.key = rec.delta.key
            raise

        def delta(live: Mapping[str, torch.Tensor]) -> dict[str, str]:
            apply_staged(staged, dict(live), verify=True, check_base_digest=True)
            return after

        return delta, rec.delta.key

    def _load_anchor(self, rec: CommitRecord, files: list[Path], live: Mapping[str, torch.Tensor]) -> dict[str, str]:
        """The anchor's tensors read into the engine's through one bounded host buffer, each hashed
        where it lives against the anchor's digest (`anchor_into`); the anchor's digests."""
        return load_into(self.run, rec, files, live)

    def _write(self, rec: CommitRecord, write: Callable[[Mapping[str, torch.Tensor]], Mapping[str, str]],
               base_version: int | None, key: str) -> None:
        """`write` into the engine inside its pause; the version is held and reported once it returned."""
        got: dict[str, str] = {}

        def recorded(live: Mapping[str, torch.Tensor]) -> Mapping[str, str]:
            got.update(write(live))
            return got

        self.behind = True
        try:
            self.hook.write_in_place(rec.version, recorded, base_version=base_version, state_digest=rec.state_digest)
        except BaseException as e:
            self.version = None  # the engine reports none until an anchor loads (it refuses deltas meanwhile)
            self._served(None)
            if isinstance(e, BAD_OBJECT):
                e.key = key
            raise
        self.digests, self.version, self.behind = got, rec.version, False
        self._served(rec)

