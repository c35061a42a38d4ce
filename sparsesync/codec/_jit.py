"""Optional compiled kernels (numba) for the codec's linear walks; pure-numpy fallbacks exist
for every kernel, so numba is only a speed-up: `available()` is False when numba is missing,
fails to import, or SPARSESYNC_NO_NUMBA=1. Results are identical either way."""

from __future__ import annotations

import os
import threading

import numpy as np

_KERNELS: dict | None = None
_TRIED = False
_LOCK = threading.Lock()


def _build() -> dict | None:
    if os.environ.get("SPARSESYNC_NO_NUMBA", "") not in ("", "0"):
        return None
    try:
        import numba
    except Exception:  # noqa: BLE001 - missing or broken numba: use numpy
        return None

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def select_sorted(words, cum, pop, sel8, pop8, r, out):  # pragma: no cover - compiled
        # r strictly increasing, all < cum[-1]: walk the words once
        w = 0
        nw = cum.size
        for j in range(r.size):
            rj = r[j]
            while w < nw and cum[w] <= rj:
                w += 1
            if w == nw:  # cannot happen for ranks < cum[-1]; never read past the words
                out[j] = -1
                continue
            k = rj - (cum[w] - pop[w])  # rank inside word w
            x = words[w]
            sh = 0
            while True:
                b = (x >> np.uint64(sh)) & np.uint64(0xFF)
                c = pop8[b]
                if k < c:
                    break
                k -= c
                sh += 8
            out[j] = w * 64 + sh + sel8[b, k]
        return out

    return {"select_sorted": select_sorted}


def kernels() -> dict | None:
    global _KERNELS, _TRIED
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                _KERNELS = _build()
                _TRIED = True
    return _KERNELS
