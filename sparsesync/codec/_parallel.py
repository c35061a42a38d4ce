"""Thread pools for the codec's CPU work (per-tensor encode/decode, diff slices).

Guarantee: `map_ordered(fn, items)` returns exactly `[fn(x) for x in items]` (same order, same
values) or raises the exception of the first failing item in input order; `map_settled` runs
every item and hands failures back in place; parallelism only changes speed. The codec's C
passes and numpy's heavy kernels release the GIL, so independent tensors overlap on a
multi-core CPU. Two pools, so that a task of the outer one (a tensor) may wait on tasks of the
inner one (chunks of that tensor) without deadlock. `SPARSESYNC_CODEC_THREADS=1` runs serially.
`interrupts_deferred` holds a Ctrl-C back until a block of writes (and their undo) is done.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)
_POOLS: dict[str, ThreadPoolExecutor] = {}
_GC_LOCK = threading.Lock()
_GC_HOLDERS = [0, False]  # blocks inside `gc_paused`, and whether the collector was on before the first


def workers() -> int:
    """Threads per pool: SPARSESYNC_CODEC_THREADS, else the CPUs this process may run on (its
    affinity: a process pinned to one core gets one thread), at most 4."""
    env = os.environ.get("SPARSESYNC_CODEC_THREADS", "")
    if env.isdigit():
        return max(1, int(env))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cpus or 1))


def pool(kind: str) -> ThreadPoolExecutor:
    """The shared pool `kind` ("tensors" for whole tensors, "chunks" for pieces of one tensor)."""
    p = _POOLS.get(kind)
    if p is None:
        p = _POOLS.setdefault(kind, ThreadPoolExecutor(max_workers=workers(), thread_name_prefix=f"sparsesync-codec-{kind}"))
    return p


def map_ordered(fn: Callable[[T], R], items: Sequence[T], kind: str = "tensors") -> list[R]:
    """`[fn(x) for x in items]`, run on pool `kind` when there is more than one item."""
    if len(items) <= 1 or workers() == 1:
        return [fn(x) for x in items]
    return list(pool(kind).map(fn, items))


def map_settled(fn: Callable[[T], R], items: Sequence[T], kind: str = "tensors") -> list[R | Exception]:
    """Like `map_ordered`, but every item runs to completion and a failing item's exception is
    returned in its place (the caller decides which failure to report)."""

    def settle(x: T) -> R | Exception:
        try:
            return fn(x)
        except Exception as e:  # noqa: BLE001 - handed back to the caller, who raises it
            return e

    return map_ordered(settle, items, kind)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, back to its previous state when
    the last concurrent block ends. The codec's per-tensor Python work allocates many small
    acyclic objects; the collections they trigger hold the GIL that the other codec threads
    need (5-6% of an encode, measured at 150M parameters). Reference counting still frees everything as usual."""
    with _GC_LOCK:
        if _GC_HOLDERS[0] == 0:
            _GC_HOLDERS[1] = gc.isenabled()
            gc.disable()
        _GC_HOLDERS[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_HOLDERS[0] -= 1
            if _GC_HOLDERS[0] == 0 and _GC_HOLDERS[1]:
                gc.enable()


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C (SIGINT) that arrives inside the block is raised as KeyboardInterrupt when the
    block ends, not in the middle of it. The codec's writes are all or nothing: interrupted half
    way, the waiting thread would stop while the pool's threads still write, and no undo would
    run. So the block runs to its end (written, or failed and undone: weights at one version or
    the other, never between) and the interrupt follows. A second Ctrl-C stops at once, as
    without this block (for a user who would rather stop than wait). Only where Python's default
    SIGINT handler is installed and this is the main thread (elsewhere a Ctrl-C does not
    interrupt this thread, or the application handles it itself); nested blocks defer to the
    outermost."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pending: list[int] = []

    def defer(signum: int, _frame: object) -> None:
        if pending:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pending.append(signum)
        log.warning("Ctrl-C: stopping once the weights are written or restored (Ctrl-C again stops now, "
                    "which may leave them between two versions)")

    signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt
