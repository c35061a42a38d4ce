"""Thread pools for the codec's CPU work (per-tensor encode/decode, diff slices).

Guarantee: `map_ordered(fn, items)` returns exactly `[fn(x) for x in items]` (same order, same
values) or raises the exception of the first failing item in input order (on a pool, once every
item has run);
`map_settled` runs every item and hands failures back in place; parallelism only changes speed.
Items given a small weight (a tensor's elements) run one after another in one task: their
work is mostly Python, so threads would only contend for the GIL. The codec's C
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
        p = _POOLS.setdefault(
            kind, ThreadPoolExecutor(max_workers=workers(), thread_name_prefix=f"sparsesync-codec-{kind}")
        )
    return p


# Items lighter than this (elements of a tensor, say) run one after another in a single task:
# their work is mostly Python, which holds the GIL, so two threads on them contend and run
# slower than one (measured on 431 tensors of a 50M-parameter model).
SMALL_ITEM = 1 << 20


def _tasks(n: int, weights: Sequence[int] | None) -> list[list[int]]:
    """Item positions grouped into pool tasks: the light ones (weight below `SMALL_ITEM`) together
    in one task, first (it runs while the other threads take the heavy items), then each heavy
    item alone, in input order."""
    if weights is None:
        return [[i] for i in range(n)]
    light = [i for i in range(n) if weights[i] < SMALL_ITEM]
    return ([light] if light else []) + [[i] for i in range(n) if weights[i] >= SMALL_ITEM]


class _Failed:
    """An item whose call raised (kept apart from results that happen to be exceptions)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _run(fn: Callable[[T], R], items: Sequence[T], kind: str, weights: Sequence[int] | None) -> list[R | _Failed]:
    """Every item's result (or `_Failed`), in input order: from the tasks of `_tasks` on pool
    `kind`, or in this thread for one item or one worker."""

    def run(task: Sequence[int]) -> list[R | _Failed]:
        out: list[R | _Failed] = []
        for i in task:
            try:
                out.append(fn(items[i]))
            except Exception as e:  # noqa: BLE001 - handed back to the caller
                out.append(_Failed(e))
        return out

    if len(items) <= 1 or workers() == 1:
        return run(range(len(items)))
    tasks = _tasks(len(items), weights)
    by_position = {i: r for task, out in zip(tasks, pool(kind).map(run, tasks)) for i, r in zip(task, out)}
    return [by_position[i] for i in range(len(items))]


def map_ordered(
    fn: Callable[[T], R], items: Sequence[T], kind: str = "tensors", weights: Sequence[int] | None = None
) -> list[R]:
    """`[fn(x) for x in items]`, run on pool `kind` when there is more than one item (every item
    runs, then the first failure in input order is raised). `weights` (one per item, e.g. its
    elements): light items share one task (see `SMALL_ITEM`)."""
    if len(items) <= 1 or workers() == 1:
        return [fn(x) for x in items]
    out: list[R] = []
    for r in _run(fn, items, kind, weights):
        if isinstance(r, _Failed):
            raise r.error
        out.append(r)
    return out


def map_settled(
    fn: Callable[[T], R], items: Sequence[T], kind: str = "tensors", weights: Sequence[int] | None = None
) -> list[R | Exception]:
    """Like `map_ordered`, but every item runs to completion and a failing item's exception is
    returned in its place (the caller decides which failure to report)."""
    return [r.error if isinstance(r, _Failed) else r for r in _run(fn, items, kind, weights)]


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
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
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
