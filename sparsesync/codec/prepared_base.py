"""What the size encoder reads from a tensor's base, prepared where the base lives.

The encoder (`_select.choose`) reads a changed tensor's whole base for three things only: the
magnitude-key histogram of a fixed sample (to choose the class thresholds), the class rank of
each changed element (class-conditioned gap coding) and, for a dense change (at least 1/4 of
the elements), every base element (the dense delta coding). A writer whose snapshot lives on a
GPU computes these there (`device_snapshot`) and hands over only them: a `PreparedBase`.

Guarantee: the encoder makes the same bytes from a `PreparedBase` as from the whole base, or
raises: `thresholds_for` recomputes the thresholds on the host from the sample histogram and the
changed elements' base bits (as `_select.choose_thresholds` does) and refuses ranks prepared for
other thresholds or class sizes; a dense change without the whole base is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsesync.codec import _native


def hist_sample(numel: int, sample: int) -> tuple[np.ndarray, int]:
    """(block starts, block length) of the sample whose key histogram chooses the thresholds:
    the whole tensor up to `sample` elements, else 64 evenly spaced blocks of `sample // 64`."""
    if numel <= sample:
        return np.zeros(1, dtype=np.int64), numel
    block = sample // 64
    return np.linspace(0, numel - block, 64).astype(np.int64), block


def thresholds_from_hist(hist: np.ndarray, numel: int, changed_keys: np.ndarray, sample: int,
                         max_classes: int = 4, min_gain: float = 0.02) -> list[int]:
    """The class thresholds from the sample's key histogram `hist` (int64[128]) and the changed
    elements' key counts (the dynamic program in C; `_select.choose_thresholds`)."""
    tot = hist.astype(np.float64) * (numel / max(1, min(numel, sample)))
    return list(_native.thresholds_dp(tot, changed_keys.astype(np.float64), max_classes, min_gain))


@dataclass
class PreparedBase:
    """A tensor's base as the encoder needs it (see the module docstring)."""

    numel: int
    hist: np.ndarray | None  # key histogram of the threshold sample (int64[128]); None: not classed
    thresholds: list[int]  # the thresholds `ranks` were computed for ([]: no classes)
    ranks: np.ndarray | None  # int64: class 0's ranks, then class 1's, ... (None: no classes)
    full: np.ndarray | None  # every base element's bits (a dense change), else None

    def thresholds_for(self, changed_keys: np.ndarray, sample: int) -> list[int]:
        """The thresholds the encoder picks, checked against those the ranks were prepared for."""
        if self.hist is None:
            raise ValueError("a prepared base without its key histogram cannot choose class thresholds")
        got = thresholds_from_hist(self.hist, self.numel, changed_keys, sample)
        if got != self.thresholds:
            raise ValueError(f"prepared base: thresholds {self.thresholds} were prepared, the encoder picks {got}")
        return got

    def class_ranks(self, thresholds: list[int], sizes: list[int]) -> list[np.ndarray]:
        """The prepared ranks split per class (`_classes.class_ranks`'s result)."""
        if thresholds != self.thresholds or self.ranks is None or sum(sizes) != self.ranks.size:
            raise ValueError(f"prepared base: ranks for thresholds {self.thresholds}, asked for {thresholds} "
                             f"with class sizes {sizes}")
        return np.split(self.ranks, np.cumsum(sizes)[:-1])

    def whole(self) -> np.ndarray:
        """Every base element (a dense change)."""
        if self.full is None:
            raise ValueError("prepared base: a dense change needs the whole base, which was not prepared")
        return self.full
