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
  whose `pages_out_mirror` is set (vLLM), so does the mirror from the process's RSS (`mirror.pager`).
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

New versions are found by polling the commit listing (`polling`: the interval, and when a failed
attempt is retried). With `prefetch` (default), a follower that is up to date also lists the part
objects stored for the next version and fetches and decodes them before its commit lands
(`parts_reader.Prefetcher`: nothing prefetched is trusted until the commit's digests and every
check pass).

A hook whose `holds_device_state` is set (a GPU engine) gets no mirror: `engine_held.HeldEngine`
writes each version straight into the engine's tensors (deltas all or nothing on the device,
anchors tensor by tensor), and what is reported is what they hold (its module docstring).

The parts: `mirror_steps` (what the mirror holds and how a version gets into it), `engine_steps`
(how a verified version reaches the engine, and its recovery), `polling` (how long the background loop waits);
this module plans each sync and keeps the status.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

from sparsesync.errors import MirrorMismatchError, RunKindError, SparsesyncError, StoreError
from sparsesync.protocol import lineage
from sparsesync.protocol.follower.backoff import Backoff
from sparsesync.protocol.follower.engine_held import HeldEngine
from sparsesync.protocol.follower.engine_steps import EngineSteps
from sparsesync.protocol.follower.fleet_member import FleetMember, FleetOptions
from sparsesync.protocol.follower.hooks import ApplyHook, FollowerStatus, NoHook
from sparsesync.protocol.follower.mirror import release_freed_memory
from sparsesync.protocol.follower.mirror_steps import BAD_OBJECT, HeldMirror
from sparsesync.protocol.follower.polling import next_wait, streaming
from sparsesync.protocol.follower.refusals import Refusals
from sparsesync.protocol.parts_reader import Prefetcher
from sparsesync.protocol.records import AdapterMeta, CommitRecord
from sparsesync.protocol.run import Run, State, Step
from sparsesync.store import Store, open_store

log = logging.getLogger(__name__)


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
        # a hook holding verified state on its device: no host mirror, versions written into the engine
        self._device = HeldEngine(self.run, self.hook, self._served) if self.hook.holds_device_state else None
        self._prefetch = Prefetcher(self.store) if prefetch and self._device is None else None
        self._commits: list[CommitRecord] = []  # the last listing's trusted commits
        self._served_epoch: int | None = None  # the served commit's epoch
        self._backoff = Backoff()
        self._mirror = None if self._device is not None else HeldMirror(
            self.run, mirror_dir, pages_out=self.hook.pages_out_mirror, prefetch=self._prefetch)
        self._steps = None if self._mirror is None else EngineSteps(
            self.hook, self._mirror, self._backoff, self.store.url, self._served)
        self._held: HeldMirror | HeldEngine = self._device or self._mirror  # type: ignore[assignment]
        self._engine: EngineSteps | HeldEngine = self._device or self._steps  # type: ignore[assignment]
        self._refusals = Refusals(self.store.url)  # commits it will not take: logged once, reported in status()
        self._suspect: set[str] = set()  # object keys that failed once (refetched next time)
        self._bad: set[str] = set()  # object keys that failed twice (planned around)
        self._lock = threading.Lock()  # one sync at a time
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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

    @property
    def mirror(self) -> State:
        """The verified host copy of the weights (tensors of one shared file map, written in place)."""
        return self._held.state

    @property
    def digests(self) -> dict[str, str]:
        """The mirror's per-tensor digests."""
        return self._held.digests

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
            held = self._held.overruled_by(commits)
            if held is not None:
                log.warning("version %s of %s was overruled by epoch %d (state %s): reloading",
                            held.version, self.store.url, held.epoch, held.state_digest)
                self._held.version = None  # the weights held are not what readers trust: reload
            if self._in_sync() and self._held.version == newest.version:
                self._succeeded()
                if self._prefetch is not None:
                    try:
                        if self._prefetch.poll(newest.version, self._held.state):
                            self._parts_seen_at = time.monotonic()
                            self._held.page_out()  # it read the mirror to decode ahead
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
                self._held.page_out()
            if self._status.state == "degraded":
                self._failed(newest)
            return self.current_version

    def _attempt(self, newest: CommitRecord, commits: list[CommitRecord]) -> None:
        """Plan and execute up to three times (a bad object is refetched once, then planned around)."""
        self._backoff.engine_failed = False
        for _attempt in range(3):
            try:
                steps = self.run.plan(newest, commits, current=self._held.version, avoid=self._bad)
                if not steps and not self._in_sync():  # the mirror is at the newest version, the engine is not
                    steps = [Step("reload", newest)]
                self._execute(steps)
                self._succeeded()
                self._set(lag=self._lag())
                return
            except BAD_OBJECT as e:
                key = e.key
                log.warning("sync of %s failed: %s", self.store.url, e)
                if isinstance(e, MirrorMismatchError):
                    self._held.version = None  # its bits are not its version's: re-planned from an anchor, never served
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
        """`start`'s thread: sync, then wait as `polling` says, until `stop()`; nothing else stops it
        (a refused commit or a bug is recorded in `status()`)."""
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
            moved = self.current_version != before or streaming(self._parts_seen_at)
            interval, wait = next_wait(interval, moved=moved, poll_interval=self.poll_interval,
                                       max_poll_interval=self.max_poll_interval, retry_at=self._backoff.retry_at)
            self.store.wait_for_change(wait, self._stop)

    def _execute(self, steps: list[Step]) -> None:
        """Each step into the mirror, then into the engine. The engine gets a patch only when it
        held the mirror's previous version; otherwise (`EngineSteps.behind`) the whole mirror.
        With no mirror (`engine_held`), each step goes straight into the engine."""
        for step in steps:
            if self._device is not None:
                self._refusals.check(step.commit, self.adapter)
                last = step is steps[-1]
                fetch_s, apply_s = self._device.run_step(
                    step, in_sync=self._in_sync(), gate=functools.partial(self._gate, step.commit, last=last))
                self._advance(step.commit, fetch_s, apply_s, anchor=step.kind == "anchor")
                continue
            held, engine = self._mirror, self._steps
            assert held is not None and engine is not None
            rec = step.commit
            self._refusals.check(rec, self.adapter)
            t0 = time.perf_counter()
            last = step is steps[-1]
            if step.kind == "anchor":
                state, digests = held.fetch_anchor(rec)
                fetch_s = time.perf_counter() - t0
                self._gate(rec, last=last)
                t1 = time.perf_counter()
                engine.load_anchor(rec, state, digests)
                self._advance(rec, fetch_s, time.perf_counter() - t1, anchor=True)
            elif step.kind == "reload":  # the mirror is at rec.version and the engine is not
                self._gate(rec, last=last)
                t1 = time.perf_counter()
                engine.load_mirror(rec)
                self._advance(rec, 0.0, time.perf_counter() - t1, anchor=False)
            else:
                in_sync = self._in_sync()
                updates = held.stage_delta(rec)  # all or nothing (or the mirror is marked for reload)
                engine.behind = True  # the mirror has taken rec.version; the engine has not
                fetch_s = time.perf_counter() - t0
                self._gate(rec, last=last)
                t1 = time.perf_counter()
                if in_sync:
                    engine.apply_delta(rec, updates)
                else:  # the engine missed earlier changes of the mirror: send all of it
                    engine.load_mirror(rec)
                self._advance(rec, fetch_s, time.perf_counter() - t1, anchor=False)

    def _in_sync(self) -> bool:
        """Whether the engine holds exactly the mirror's version (so a patch may go on top)."""
        return not self._engine.behind and self.current_version == self._held.version

    def _gate(self, rec: CommitRecord, *, last: bool) -> None:
        """Coordinated switching: hold the newest staged version until the fleet switches to it."""
        if self.fleet is not None and last:
            self.fleet.gate(rec.version, rec.created_at, self.current_version, rec.epoch)

    def _served(self, rec: CommitRecord | None) -> None:
        """What the engine holds (`engine_steps`): version `rec`, reported at once; None: unknown."""
        if rec is None:
            self._set(current_version=None, lag=None, state_digest=None)
            return
        self._served_epoch = rec.epoch
        self._set(current_version=rec.version, state_digest=rec.state_digest)

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
