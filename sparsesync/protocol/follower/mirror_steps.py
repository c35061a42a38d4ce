"""The follower's mirror steps: what the verified host copy holds, and how a version gets into it.

Guarantees (the follower's, for the mirror; `follower` states the whole):
- `HeldMirror.version` names the version whose bits `state` holds, or None when they are not
  known to be any version's (a failed delta that had written, a digest mismatch): the follower
  then re-plans from an anchor, never patches or serves it.
- `fetch_anchor` stages an anchor into a fresh file map (`mirror.MirrorDir`) and returns it without
  touching `state`; it becomes the mirror only by `adopt`, once the engine took it.
- `stage_delta` applies one delta all or nothing: on success `state` and `digests` are the
  version's; on failure the codec restored `state`, or `version` is None.
- A failing object's key is set on the error it raises (`e.key`), so the follower refetches it
  once, then plans around it.
- With `pages_out` (the hook's `pages_out_mirror`) every tensor read or written is unmapped from
  the process once done with (`mirror.pager`), and `page_out` unmaps the whole mirror.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from sparsesync.codec import state_digest
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import DigestMismatchError, ObjectNotFoundError, PatchError, ProtocolError
from sparsesync.protocol.follower.mirror import MirrorDir, drop_resident, pager
from sparsesync.protocol.parts_reader import Prefetcher, check_held
from sparsesync.protocol.records import CommitRecord
from sparsesync.protocol.run import Run, State

# errors that mean "this object/path is bad": avoid it and re-plan (anchor fallback)
BAD_OBJECT = (DigestMismatchError, ObjectNotFoundError, PatchError, ProtocolError)


class HeldMirror:
    """The verified host copy of the weights a follower keeps (see module docstring)."""

    def __init__(self, run: Run, directory: str | Path | None, *, pages_out: bool, prefetch: Prefetcher | None) -> None:
        self.run = run
        self.state: State = {}  # tensors of one shared file map (mirror.MirrorDir), written in place
        self.digests: dict[str, str] = {}
        self.version: int | None = None  # version the mirror holds (None: must reload)
        self.pages_out = pages_out
        self.prefetch = prefetch
        self._dir = MirrorDir(directory)

    def overruled_by(self, commits: list[CommitRecord]) -> CommitRecord | None:
        """The trusted commit of the version held when it names another state (a newer writer
        committed the same version number with other weights), else None."""
        held = next((c for c in commits if c.version == self.version), None)
        return held if held is not None and held.state_digest != state_digest(self.digests) else None

    def pager(self, state: State | None = None) -> Callable[[torch.Tensor], int] | None:
        """Unmaps mirror tensors once done with, for hooks that ask (`pages_out`)."""
        return pager((self.state if state is None else state).values()) if self.pages_out else None

    def page_out(self) -> None:
        if self.pages_out:
            drop_resident(self.state.values())  # the pages stay in the page cache, out of RSS

    def adopt(self, state: State, digests: dict[str, str], version: int) -> None:
        self.state, self.digests, self.version = state, digests, version

    def check(self, rec: CommitRecord, state: State | None = None, digests: dict[str, str] | None = None) -> None:
        """MirrorMismatchError unless `state` (default the mirror) holds version `rec` (`check_held`)."""
        state = self.state if state is None else state
        check_held(state, self.digests if digests is None else digests, rec, written=self.pager(state))

    def fetch_anchor(self, rec: CommitRecord) -> tuple[State, dict[str, str]]:
        """Download and verify the anchor of `rec` into a new file map: (state, digests)."""
        try:
            alloc, written = self._dir.allocator(page_out=self.pages_out)
            return self._dir.staged(lambda wd: self.run.fetch_anchor(rec, wd, alloc=alloc, written=written))
        except BAD_OBJECT as e:
            e.key = rec.anchor[0].key
            raise

    def stage_delta(self, rec: CommitRecord) -> dict[str, SparseUpdate]:
        """Fetch, verify and apply one delta to the mirror (the engine is untouched)."""
        if rec.parts:  # fetched concurrently, decoded as they land, applied all or nothing
            try:
                updates = self.run.apply_delta(rec, self.state, self.digests, self.prefetch, written=self.pager())
            except DigestMismatchError as e:
                if e.written:
                    self.version = None  # undone, but the base bits were not what we thought: reload
                raise
            self.version = rec.version
            return updates
        assert rec.delta is not None
        try:
            patch = self.run.load_delta(rec, self.digests)  # writes nothing
            digests = dict(self.digests)
            try:
                updates = self.run.apply_loaded(rec, patch, self.state, digests, written=self.pager())
            except PatchError as e:  # the codec restored the mirror, unless the state digest failed after
                if isinstance(e, DigestMismatchError):
                    self.version = None  # the mirror was written and is wrong: reload an anchor
                raise
            except BaseException:  # anything else: what the mirror holds is unknown
                self.version = None
                raise
        except BAD_OBJECT as e:
            e.key = rec.delta.key
            raise
        self.digests, self.version = digests, rec.version
        return updates
