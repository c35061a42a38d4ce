"""The follower's engine steps: how a verified version reaches the engine (the `ApplyHook`).

Guarantees (the follower's, for the engine; `follower` states the whole):
- The hook gets only what its capability fields say it takes (`hooks.HookLabels`).
- `behind` is True while the mirror holds changes the engine has not received, or the engine's
  bits are unknown (from the first write of a step until it returned); the follower then sends the
  whole mirror (`load_mirror`), never a patch on top of stale weights.
- A step that raises is followed by a full load of the state the step was bringing the engine to,
  hashed against its digests first (`HeldMirror.check`). When a step returns, the engine holds
  exactly that state and `served(rec)` is told; when the reload fails too, `served(None)` is
  told (no version is reported until a later load succeeds) and the error is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import MirrorMismatchError, SparsesyncError
from sparsesync.protocol.follower.backoff import Backoff
from sparsesync.protocol.follower.hooks import ApplyHook, HookLabels
from sparsesync.protocol.follower.mirror_steps import HeldMirror
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import State

log = logging.getLogger("sparsesync.protocol.follower.follower")  # the follower's one logger: its steps log as it


class EngineSteps:
    """The engine side of one follower (see module docstring)."""

    def __init__(self, hook: ApplyHook, held: HeldMirror, backoff: Backoff, url: str,
                 served: Callable[[CommitRecord | None], None]) -> None:
        self.hook = hook
        self.behind = False
        self._held = held
        self._backoff = backoff
        self._url = url
        self._served = served

    def load_anchor(self, rec: CommitRecord, state: State, digests: dict[str, str]) -> None:
        """The whole of an anchor just fetched; it becomes the mirror once the engine took it."""
        labels = HookLabels(rec.state_digest, digests)
        self._call(lambda: self.hook.load_full(rec.version, state, **labels.for_load(self.hook)), rec, state,
                   adopt=lambda: self._held.adopt(state, digests, rec.version), digests=digests)

    def apply_delta(self, rec: CommitRecord, updates: Mapping[str, SparseUpdate]) -> None:
        """The changes of one version the mirror took, for an engine that held its base."""
        full = {name: self._held.state[name] for name in updates}
        labels = HookLabels(rec.state_digest, self._held.digests, rec.base_version)
        self._call(
            lambda: self.hook.apply_sparse(rec.version, updates, full, **labels.for_patch(self.hook)),
            rec,
            self._held.state,
        )

    def load_mirror(self, rec: CommitRecord) -> None:
        """All of the mirror, verified first (others may reach its file)."""
        self._held.check(rec)  # MirrorMismatchError: reloaded from an anchor instead
        labels = HookLabels(rec.state_digest, self._held.digests)
        self._call(
            lambda: self.hook.load_full(rec.version, self._held.state, **labels.for_load(self.hook)),
            rec,
            self._held.state,
        )

    def _call(self, fn: Callable[[], None], rec: CommitRecord, state: State, adopt: Callable[[], None] | None = None,
              digests: dict[str, str] | None = None) -> None:
        """Run the engine step `fn` that brings the engine to `state` (version `rec`, tensor digests
        `digests`, default the mirror's); on failure reload it with all of `state`, verified first. When this
        returns the engine holds exactly `state` (`adopt` then makes it the mirror); when it raises
        the engine's bits are unknown: no version is reported until a later load succeeds."""
        self.behind = True  # from the first write on, the engine holds neither version for sure
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - engine failure: reload it from the verified mirror
            log.log(
                self._backoff.level(str(e)),
                "engine failed to apply version %d (%s); reloading all weights",
                rec.version,
                e,
            )
            try:
                self._held.check(rec, state, digests)
                labels = HookLabels(rec.state_digest, self._held.digests if digests is None else digests)
                self.hook.load_full(rec.version, state, **labels.for_load(self.hook))
            except BaseException as e2:
                self._backoff.engine_error(e2, counts=not isinstance(e2, MirrorMismatchError))
                self._served(None)
                if not isinstance(e2, Exception) or isinstance(e2, MirrorMismatchError):
                    raise
                raise SparsesyncError(
                    f"engine could not load version {rec.version} of {self._url}: {str(e2)[:300]}",
                    hint="the replica reports no version until a load succeeds (retried with backoff); check the "
                         "engine logs",
                ) from e2
        except BaseException:  # an interrupt inside the engine: its bits are unknown
            self._served(None)
            raise
        if adopt is not None:
            adopt()
        self.behind = False
        self._served(rec)  # the engine holds it: report it at once

