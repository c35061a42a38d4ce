"""A local store's writes made durable in the background, in order (`LocalStore.deferred_sync`).

Guarantees: a file handed to `LaterSync.start` (already renamed into place, so readers see it
at once) is fsynced on a background thread; `settle` waits for that fsync, so a store that calls
`settle` before every write of its own makes every earlier object durable before a later one
becomes visible. After a power loss only the newest deferred object can be missing or empty
(never one with a later object after it). A failed fsync is not lost: `settle` raises it
(once, as an OSError whose filename is the file's). A process that exits normally waits for
the last fsync (an `atexit` hook settles every instance). `start` does not wait for a thread to
start: one worker per instance, started at its first deferred write, takes the files from a queue.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from pathlib import Path

log = logging.getLogger(__name__)
_ALL: weakref.WeakSet[LaterSync] = weakref.WeakSet()


class LaterSync:
    """At most one background fsync in flight (`start`), waited for by `settle`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Path, threading.Event]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._done: threading.Event | None = None  # the event of the fsync in flight
        self._error: OSError | None = None

    def start(self, path: Path) -> None:
        """fsync `path` in the background (after any fsync still in flight: `settle` first)."""
        self.settle()
        done = threading.Event()
        with self._lock:
            self._done = done
            if self._worker is None:
                self._worker = threading.Thread(target=_work, args=(self._queue, weakref.ref(self)),
                                                name="sparsesync-fsync", daemon=True)
                self._worker.start()
                _ALL.add(self)
        self._queue.put((path, done))

    def settle(self) -> None:
        """Wait until the last deferred fsync is done; raise its OSError if it failed."""
        with self._lock:
            done = self._done
        if done is not None:
            done.wait()
        with self._lock:
            if self._done is done:
                self._done = None
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _failed(self, e: OSError) -> None:
        with self._lock:
            self._error = e

    def __del__(self) -> None:
        self._queue.put(None)  # type: ignore[arg-type]  # the worker's signal to end


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _work(q: queue.SimpleQueue[tuple[Path, threading.Event] | None], owner: weakref.ref[LaterSync]) -> None:
    """The worker of one `LaterSync` (holding it only weakly): fsync each file queued, in order."""
    while (item := q.get()) is not None:
        path, done = item
        try:
            _fsync(path)
        except FileNotFoundError:
            pass  # deleted since (the store's own deletes settle first, so: by another process)
        except OSError as e:
            if (o := owner()) is not None:
                o._failed(OSError(e.errno, e.strerror, str(path)))
        finally:
            done.set()


@atexit.register
def _settle_all() -> None:
    """At a normal exit, wait for every deferred fsync still in flight (a failure is logged: no write follows)."""
    for later in list(_ALL):
        try:
            later.settle()
        except OSError as e:
            log.error("could not make %s durable: %s (it may be lost after a power failure)", e.filename, e.strerror)
