"""Scratch buffers for the codec's per-tensor temporaries, reused across the tensors of one state.

Guarantee: `buffer(name, n, dtype)` returns a C-contiguous array of `n` elements, contents
undefined, that no other caller in this thread gets until this thread asks for `name` again:
a caller must be done with it (or have copied what it keeps) before its next call with the
same name. Inside `scope()` (one diff+encode of a whole state) each thread keeps one growing
buffer per name, so the kernel zeroes their pages once per scope rather than once per tensor
(fresh pages were about 20% of an encode at 0.6B parameters and 10% density); when the last
open scope ends, every thread's buffers are dropped. Outside any scope each call allocates.
Only speed and peak memory depend on this module, never a result.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

_LOCK = threading.Lock()
_OPEN = [0]  # scopes open now, in any thread
_BUFFERS: dict[int, dict[str, np.ndarray]] = {}  # thread id -> name -> bytes


def buffer(name: str, n: int, dtype: np.dtype | type) -> np.ndarray:
    """`n` elements of `dtype` from this thread's buffer `name` (fresh memory outside a scope)."""
    dt = np.dtype(dtype)
    if not _OPEN[0]:
        return np.empty(n, dtype=dt)
    mine = _BUFFERS.setdefault(threading.get_ident(), {})
    nbytes = n * dt.itemsize
    buf = mine.get(name)
    if buf is None or buf.size < nbytes:
        buf = mine[name] = np.empty(max(nbytes, 0 if buf is None else buf.size * 3 // 2), dtype=np.uint8)
    return buf[:nbytes].view(dt)


@contextmanager
def scope() -> Iterator[None]:
    """Reuse buffers inside the block; drop them all when the last open block ends."""
    with _LOCK:
        _OPEN[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _OPEN[0] -= 1
            if _OPEN[0] == 0:
                _BUFFERS.clear()
