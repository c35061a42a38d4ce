"""Waiting for a condition in a test, with a deadline that names what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(cond: Callable[[], object], timeout: float, what: str, *, every: float = 0.05) -> None:
    """Poll `cond` every `every` seconds until it is true; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
