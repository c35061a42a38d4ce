"""The reader side: keep a replica's weights at the newest committed version of a run.

Guarantees:
- The engine (the `ApplyHook`) only ever receives fully verified versions. The follower
  fetches, checks object digests, decodes and applies each patch to its own CPU mirror
  (all-or-nothing, target digests and the commit's state digest verified) while the engine
  keeps serving; only then does it call the hook, whose duration is the replica's pause.
- The mirror is the replica's only host copy of the weights besides the engine's own, and it
  is not anonymous memory: anchors are read straight into one shared file map in `mirror_dir`
  (`sparsesync.protocol.follower.mirror`: on local disk, default `~/.cache/sparsesync/mirror`), which
  patches then write in place, so the OS can page it. After each attempt the memory the
  allocator kept from freed buffers is handed back to the OS (`release_freed_memory`); for a hook
  that sets `pages_out_mirror` (vLLM), so does the mirror from the process's RSS (`mirror.pager`).
- A version number is reported only while the engine holds exactly that version: once the
  mirror has taken a version the engine has not (an exception between the mirror's advance and
  the engine's: the gate, the hook, a bug), the engine gets the whole mirror (`load_full`) before
  any later version is reported, never a patch on top of stale weights; if the hook fails, it is
  reloaded from the mirror; if that fails too, no version is reported until a load succeeds.
  Any full load but an anchor's first (checked as read) hashes the mirror against the version's
  digests first (`check_held`): a mismatch (another writer) reloads it from an anchor instead.
- A failed attempt is retried with exponential backoff (from max(poll_interval, 1 s), doubling,
  capped at `max_retry_interval`, default 60 s), so a broken engine or object never becomes a
  reload storm; meanwhile the last good version stays in place, state "degraded", and
  `status()` carries the error, the count of failed attempts and the time of the next one
  (`retry_at`). A newly committed version is tried at once unless the engine itself failed.
- What is held is judged by state digest, not by version number: when the trusted commit of
  the version held names another state (a newer writer committed the same version number with
  other weights), the follower reloads, even at the same version number.
- A commit it refuses is logged once and reported in `status()` (`refused`, `last_error`): `refusals.py`.
- Faults (missing or corrupt objects, broken chains, an unreachable store) never stop the
  replica: the follower refetches, then falls back to the newest anchor that reaches the
  newest version, and meanwhile keeps the last good version with state "degraded".

With `fleet=FleetOptions(...)` the follower also writes a heartbeat into the run and may switch
versions together with the other replicas (`sparsesync.protocol.fleet`).

New versions are found by polling the commit listing with backoff (cheap: one listing of
`commits/`); stores that can push change notifications (`Store.wait_for_change`) wake it early.
With `prefetch` (default), a follower that is up to date also lists the part objects stored for
the next version and fetches and decodes them before its commit lands (`parts_reader.Prefetcher`:
nothing prefetched is trusted until the commit's digests and every check pass). The backoff
restarts from `poll_interval` when a version was applied, and stays there while a version is
streaming in (new parts were seen in the last `STREAMING_WINDOW_S`; its commit normally follows
within seconds): the commit is seen within `poll_interval`, while a quiet store is polled ever
more rarely (idle listings cost the store requests and the CPU the decoding needs).

Length: about 460 lines while issue 49 is open: that reshape moves this module into
`protocol/follower/` and splits it there (mirror steps, engine steps, polling); a split made here
first would be moved and cut again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sparsesync.codec import state_digest
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import (
    DigestMismatchError,
    MirrorMismatchError,
    ObjectNotFoundError,
    PatchError,
    ProtocolError,
    RunKindError,
    SparsesyncError,
    StoreError,
)
from sparsesync.protocol import lineage
from sparsesync.protocol.follower.backoff import Backoff
from sparsesync.protocol.follower.fleet_member import FleetMember, FleetOptions
from sparsesync.protocol.follower.hooks import ApplyHook, FollowerStatus, NoHook
from sparsesync.protocol.follower.mirror import MirrorDir, drop_resident, pager, release_freed_memory
from sparsesync.protocol.follower.refusals import Refusals
from sparsesync.protocol.parts_reader import Prefetcher, check_held
from sparsesync.protocol.records import AdapterMeta, CommitRecord
from sparsesync.protocol.run import Run, State, Step
from sparsesync.store import Store, open_store

STREAMING_WINDOW_S = 60.0  # after new parts were seen, poll at poll_interval this long (or until their version is applied)

log = logging.getLogger(__name__)

# errors that mean "this object/path is bad": avoid it and re-plan (anchor fallback)
_BAD_OBJECT = (DigestMismatchError, ObjectNotFoundError, PatchError, ProtocolError)


class Follower:
    """Follows the run at `url` and drives `hook` (see module docstring)."""

    def __init__(
        self,
        url: str | Store,
        hook: ApplyHook | None = None,
        *,
        poll_interval: float = 1.0,
        max_poll_interval: float = 15.0,
        max_retry_interval: float = 60.0,
        fleet: FleetOptions | None = None,
        adapter: AdapterMeta | None = None,
        prefetch: bool = True,
        mirror_dir: str | Path | None = None,
    ) -> None:
        """`adapter`: the LoRA adapter run the hook serves (None: a full-weight run); versions of
        the other kind, base or config raise RunKindError (sparsesync.protocol.adapter_runs.check_follow).
        `mirror_dir`: the folder on local disk the mirror's file map lives in (default
        `sparsesync.protocol.follower.mirror.mirror_dir()`: `SPARSESYNC_MIRROR_DIR` or ~/.cache/sparsesync/mirror)."""
        self.adapter = adapter
        self.store = open_store(url) if isinstance(url, str) else url
        self._owns_store = isinstance(url, str)
        self.run = Run(self.store)
        self.hook: ApplyHook = hook or NoHook()
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.max_retry_interval = max_retry_interval
        self.mirror: State = {}  # tensors of one shared file map (mirror.MirrorDir), written in place
        self._mirror_dir = MirrorDir(mirror_dir)
        self.digests: dict[str, str] = {}
        self._mirror_version: int | None = None  # version the mirror holds (None: must reload)
        self._commits, self._served_epoch = [], None  # the last listing's trusted commits; the served commit's epoch
        # True while the mirror holds changes the engine has not received (or the engine's bits are
        # unknown): the engine then gets the whole mirror before any version is reported
        self._engine_behind = False
        self._backoff = Backoff()
        self._refusals = Refusals(self.store.url)  # commits it will not take: logged once, reported in status()
        self._suspect: set[str] = set()  # object keys that failed once (refetched next time)
        self._bad: set[str] = set()  # object keys that failed twice (planned around)
        self._lock = threading.Lock()  # one sync at a time
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prefetch = Prefetcher(self.store) if prefetch else None
        self._parts_seen_at: float | None = None  # when a poll last prefetched new parts of the next version
        self._status = FollowerStatus(
            url=self.store.url, current_version=None, newest_version=None, lag=None, state="starting",
            last_error=None, last_fetch_s=None, last_apply_s=None, last_apply_at=None,
            versions_applied=0, anchor_loads=0,
        )
        # heartbeat + switch gate (None: this follower is not part of the fleet view)
        self.fleet = FleetMember(self.store, fleet.resolved(poll_interval), lambda: self.status().to_dict(),
                                 self._stop) if fleet is not None else None

    # -- public API -------------------------------------------------------------------
    @property
    def current_version(self) -> int | None:
        return self._status.current_version

    def status(self) -> FollowerStatus:
        with self._changed:
            st = FollowerStatus(**self._status.to_dict())
        if st.retry_at is not None:
            st.retry_in_s = max(st.retry_at - time.time(), 0.0)
        self._refusals.report(st)
        if self.fleet is not None:
            st.fleet = self.fleet.describe()
        return st

    def sync_once(self, *, backoff: bool = False) -> int | None:
        """Bring the replica to the newest committed version; returns the version served.

        Never raises for store or object faults: they are recorded in `status()` (state
        "degraded") and the last good version stays in place. With `backoff` (the follow loop)
        an attempt is not made before the retry time of the last failed one (see module
        docstring); a direct call always tries.
        """
        with self._lock:
            try:
                commits = self.run.commits()
            except StoreError as e:
                self._degrade(e)
                return self.current_version
            self._commits = commits
            self._refusals.listed(self.run.rejected, commits)
            if not commits:
                self._set(newest_version=None, lag=None)
                return self.current_version
            newest = commits[-1]
            self._set(newest_version=newest.version, lag=self._lag())
            self._refusals.check(newest, self.adapter)  # a config error: raised, not degraded
            held = next((c for c in commits if c.version == self._mirror_version), None)
            if held is not None and held.state_digest != state_digest(self.digests):
                log.warning("version %s of %s was overruled by epoch %d (state %s): reloading",
                            held.version, self.store.url, held.epoch, held.state_digest)
                self._mirror_version = None  # the weights held are not what readers trust: reload
            if self._in_sync() and self._mirror_version == newest.version:
                self._succeeded()
                if self._prefetch is not None:
                    try:
                        if self._prefetch.poll(newest.version, self.mirror):
                            self._parts_seen_at = time.monotonic()
                            self._page_out()  # it read the mirror to decode ahead
                    except StoreError as e:
                        log.debug("prefetch of %s failed: %s", self.store.url, e)
                return self.current_version
            if backoff and self._backoff.waiting((newest.version, newest.state_digest)):
                return self.current_version
            try:
                self._attempt(newest, commits)
            except BaseException:
                self._failed(newest)  # a bug or an interrupt: counted, and the engine stays reconciled
                raise
            finally:
                release_freed_memory()  # decode buffers and the engine's reload temporaries, back to the OS
                self._page_out()
            if self._status.state == "degraded":
                self._failed(newest)
            return self.current_version

    def _attempt(self, newest: CommitRecord, commits: list[CommitRecord]) -> None:
        """Plan and execute up to three times (a bad object is refetched once, then planned around)."""
        self._backoff.engine_failed = False
        for _attempt in range(3):
            try:
                steps = self.run.plan(newest, commits, current=self._mirror_version, avoid=self._bad)
                if not steps and not self._in_sync():  # the mirror is at the newest version, the engine is not
                    steps = [Step("reload", newest)]
                self._execute(steps)
                self._succeeded()
                self._set(lag=self._lag())
                return
            except _BAD_OBJECT as e:
                key = e.key
                log.warning("sync of %s failed: %s", self.store.url, e)
                if isinstance(e, MirrorMismatchError):
                    self._mirror_version = None  # its bits are not its version's: re-planned from an anchor, never served
                if key is not None and key in self._suspect:
                    self._bad.add(key)  # failed twice: avoid it, re-plan around it
                elif key is not None:
                    self._suspect.add(key)  # first failure: refetch once
                self._degrade(e)
            except SparsesyncError as e:  # store unreachable, engine failed to load
                self._degrade(e)
                return

    def start(self) -> None:
        """Follow in a background thread until `stop()`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="sparsesync-follow", daemon=True)
        self._thread.start()
        if self.fleet is not None:
            self.fleet.start()

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.fleet is not None:
            self.fleet.stop()  # its last heartbeat says "stopped"
        if self._owns_store:
            self.store.close()  # e.g. ends the HF bucket events feed
        self._set(state="stopped")

    def wait_for_version(self, version: int, timeout: float) -> None:
        """Block until the replica serves `version` or newer; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._status.current_version is None or self._status.current_version < version:
                self._backoff.raise_refused(self.store.url)  # the engine refuses the run's layout: no wait helps
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"replica following {self.store.url} serves version {self._status.current_version}, "
                        f"not {version}, after {timeout} s (last error: {self._status.last_error})"
                    )
                self._changed.wait(timeout=left)

    # -- internals --------------------------------------------------------------------
    def _loop(self) -> None:
        interval = self.poll_interval
        while not self._stop.is_set():
            before = self.current_version
            try:
                self.sync_once(backoff=True)
            except RunKindError as e:  # a refused commit (check_follow): logged once, by the refusals
                self._degrade(e)
            except Exception as e:  # noqa: BLE001 - a bug must not stop the replica from serving
                log.exception("follower of %s hit an unexpected error", self.store.url)
                self._degrade(e)
            seen = self._parts_seen_at
            streaming = seen is not None and time.monotonic() - seen < STREAMING_WINDOW_S
            moved = self.current_version != before or streaming
            interval = self.poll_interval if moved else min(interval * 1.5, self.max_poll_interval)
            retry_at = self._backoff.retry_at
            wait = interval if retry_at is None else min(interval, max(retry_at - time.time(), 0.0) + 0.01)
            self.store.wait_for_change(wait, self._stop)

    def _execute(self, steps: list[Step]) -> None:
        """Each step into the mirror, then into the engine. The engine gets a patch only when it
        held the mirror's previous version; otherwise (`_engine_behind`) the whole mirror."""
        for step in steps:
            rec = step.commit
            self._refusals.check(rec, self.adapter)
            t0 = time.perf_counter()
            last = step is steps[-1]
            if step.kind == "anchor":
                try:
                    alloc, written = self._mirror_dir.allocator(page_out=self._pages_out)
                    state, digests = self._mirror_dir.staged(lambda wd: self.run.fetch_anchor(rec, wd, alloc=alloc, written=written))
                except _BAD_OBJECT as e:
                    e.key = rec.anchor[0].key
                    raise
                fetch_s = time.perf_counter() - t0
                self._gate(rec, last=last)
                t1 = time.perf_counter()
                self._call_hook(lambda: self.hook.load_full(rec.version, state, **self._label(rec, digests)), rec, state,
                                adopt=lambda: self._adopt(state, digests, rec.version), digests=digests)
                self._advance(rec, fetch_s, time.perf_counter() - t1, anchor=True)
            elif step.kind == "reload":  # the mirror is at rec.version and the engine is not
                self._gate(rec, last=last)
                t1 = time.perf_counter()
                self._load_mirror(rec)
                self._advance(rec, 0.0, time.perf_counter() - t1, anchor=False)
            else:
                in_sync = self._in_sync()
                updates = self._stage_delta(rec)  # all or nothing (or the mirror is marked for reload)
                self._engine_behind = True  # the mirror has taken rec.version; the engine has not
                self._mirror_version = rec.version
                fetch_s = time.perf_counter() - t0
                self._gate(rec, last=last)
                t1 = time.perf_counter()
                if in_sync:
                    full = {name: self.mirror[name] for name in updates}
                    self._call_hook(lambda: self.hook.apply_sparse(rec.version, updates, full, **self._label(rec)), rec, self.mirror)
                else:  # the engine missed earlier changes of the mirror: send all of it
                    self._load_mirror(rec)
                self._advance(rec, fetch_s, time.perf_counter() - t1, anchor=False)

    @property
    def _pages_out(self) -> bool:  # the hook wants the mirror out of the process's RSS (hooks docstring)
        return bool(getattr(self.hook, "pages_out_mirror", False))

    def _pager(self, state: State | None = None) -> Callable[[torch.Tensor], int] | None:  # unmaps mirror tensors, for hooks that ask
        return pager((self.mirror if state is None else state).values()) if self._pages_out else None

    def _page_out(self) -> None:
        if self._pages_out:
            drop_resident(self.mirror.values())  # the pages stay in the page cache, out of RSS

    def _label(self, rec: CommitRecord, digests: dict[str, str] | None = None) -> dict[str, object]:  # what a hook takes (hooks.py)
        kw: dict[str, object] = {"state_digest": rec.state_digest} if getattr(self.hook, "takes_state_digest", False) else {}
        return {**kw, "digests": self.digests if digests is None else digests} if getattr(self.hook, "takes_digests", False) else kw

    def _in_sync(self) -> bool:
        """Whether the engine holds exactly the mirror's version (so a patch may go on top)."""
        return not self._engine_behind and self.current_version == self._mirror_version

    def _adopt(self, state: State, digests: dict[str, str], version: int) -> None:
        self.mirror, self.digests, self._mirror_version = state, digests, version

    def _gate(self, rec: CommitRecord, *, last: bool) -> None:
        """Coordinated switching: hold the newest staged version until the fleet switches to it."""
        if self.fleet is not None and last:
            self.fleet.gate(rec.version, rec.created_at, self.current_version, rec.epoch)

    def _stage_delta(self, rec: CommitRecord) -> dict[str, SparseUpdate]:
        """Fetch, verify and apply one delta to the mirror (the engine is untouched)."""
        if rec.parts:  # fetched concurrently, decoded as they land, applied all or nothing
            try:
                return self.run.apply_delta(rec, self.mirror, self.digests, self._prefetch, written=self._pager())
            except DigestMismatchError as e:
                if e.written:
                    self._mirror_version = None  # undone, but the base bits were not what we thought: reload
                raise
        assert rec.delta is not None
        try:
            patch = self.run.load_delta(rec, self.digests)  # writes nothing
            digests = dict(self.digests)
            try:
                updates = self.run.apply_loaded(rec, patch, self.mirror, digests, written=self._pager())
            except PatchError as e:  # the codec restored the mirror, unless the state digest failed after
                if isinstance(e, DigestMismatchError):
                    self._mirror_version = None  # the mirror was written and is wrong: reload an anchor
                raise
            except BaseException:  # anything else: what the mirror holds is unknown
                self._mirror_version = None
                raise
        except _BAD_OBJECT as e:
            e.key = rec.delta.key
            raise
        self.digests = digests
        return updates

    def _load_mirror(self, rec: CommitRecord) -> None:  # the engine gets all of the mirror, verified first (others may reach its file)
        check_held(self.mirror, self.digests, rec, written=self._pager())  # MirrorMismatchError: reloaded from an anchor instead
        self._call_hook(lambda: self.hook.load_full(rec.version, self.mirror, **self._label(rec)), rec, self.mirror)

    def _call_hook(self, fn, rec: CommitRecord, state: State, adopt=None, digests=None) -> None:  # type: ignore[no-untyped-def]
        """Run the engine step `fn` that brings the engine to `state` (version `rec`, tensor digests
        `digests`, default the mirror's); on failure reload it with all of `state`, verified first. When this
        returns the engine holds exactly `state` (`adopt` then makes it the mirror); when it raises
        the engine's bits are unknown: no version is reported until a later load succeeds."""
        self._engine_behind = True  # from the first write on, the engine holds neither version for sure
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - engine failure: reload it from the verified mirror
            log.log(self._backoff.level(str(e)), "engine failed to apply version %d (%s); reloading all weights", rec.version, e)
            try:
                check_held(state, self.digests if digests is None else digests, rec, written=self._pager(state))
                self.hook.load_full(rec.version, state, **self._label(rec, digests))
            except BaseException as e2:
                self._backoff.engine_error(e2, counts=not isinstance(e2, MirrorMismatchError))
                self._set(current_version=None, lag=None, state_digest=None)
                if not isinstance(e2, Exception) or isinstance(e2, MirrorMismatchError):
                    raise
                raise SparsesyncError(
                    f"engine could not load version {rec.version} of {self.store.url}: {str(e2)[:300]}",
                    hint="the replica reports no version until a load succeeds (retried with backoff); check the engine logs",
                ) from e2
        except BaseException:  # an interrupt inside the engine: its bits are unknown
            self._set(current_version=None, lag=None, state_digest=None)
            raise
        if adopt is not None:
            adopt()
        self._engine_behind = False
        self._served_epoch = rec.epoch
        self._set(current_version=rec.version, state_digest=rec.state_digest)  # the engine holds it: report it at once

    def _advance(self, rec: CommitRecord, fetch_s: float, apply_s: float, *, anchor: bool) -> None:
        st = self._status
        self._parts_seen_at = None  # the version streaming in (if any) has landed
        self._set(
            current_version=rec.version,
            last_fetch_s=fetch_s,
            last_apply_s=apply_s,
            last_apply_at=time.time(),
            versions_applied=st.versions_applied + 1,
            anchor_loads=st.anchor_loads + int(anchor),
            lag=self._lag(),
        )
        if self.fleet is not None:
            self.fleet.applied(rec.version, rec.state_digest)

    def _lag(self) -> int | None:  # what it serves against the newest trusted commit (lineage.lag)
        return lineage.lag(self._commits, self._status.current_version, self._status.state_digest, self._served_epoch)

    def _degrade(self, e: BaseException) -> None:
        self._set(state="degraded", last_error=str(e) or type(e).__name__)

    def _succeeded(self) -> None:
        self._backoff.succeeded()
        self._set(state="following", last_error=None, retry_at=None, failures=0)

    def _failed(self, newest: CommitRecord) -> None:
        """Count a failed attempt and set the time of the next one (`backoff`)."""
        delay = self._backoff.failed((newest.version, newest.state_digest), self.poll_interval, self.max_retry_interval)
        if self._status.state != "degraded":
            self._set(state="degraded")
        self._set(retry_at=self._backoff.retry_at, failures=self._backoff.failures)
        log.warning("sync of %s failed %d time(s) in a row; next attempt in %.1f s",
                    self.store.url, self._backoff.failures, delay)

    def _set(self, **kw: object) -> None:
        with self._changed:
            for k, v in kw.items():
                setattr(self._status, k, v)
            self._changed.notify_all()
