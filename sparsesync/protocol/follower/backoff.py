"""When a follower tries again after a failed sync.

Guarantees:
- After the n-th failed attempt in a row, the next one comes `max(poll, RETRY_BASE_S) * 2**(n-1)`
  seconds later, capped at the follower's `max_retry_interval`; one success resets the count.
- A newer committed version (another number or another state digest than the one that failed)
  lifts the wait at once, unless the engine failed: a broken engine gets no faster retries.
- An engine failure is logged in full once; the same failure again, at debug level. An engine
  that refuses a version's layout (`refused`) makes `Follower.wait_for_version` fail at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sparsesync.errors import WeightUpdateError

RETRY_BASE_S = 1.0  # the first retry after a failed attempt comes at least this late


@dataclass
class Backoff:
    """The retry state of one follower (see module docstring)."""

    failures: int = 0  # failed attempts in a row
    retry_at: float | None = None  # unix time before which the loop does not try again
    failed_on: tuple[int, str] | None = None  # newest (version, state digest) when the last attempt failed
    engine_failed: bool = False  # the last failure was the engine's (no new version lifts the wait)
    refused: Exception | None = None  # the engine refuses the weights' layout (WeightUpdateError): no retry can help
    logged: str = ""  # the engine failure last logged in full (a repeat is logged at debug level)

    def succeeded(self) -> None:
        self.failures, self.retry_at, self.failed_on, self.refused, self.logged = 0, None, None, None, ""

    def level(self, message: str) -> int:
        """The log level of the engine failure `message`: ERROR the first time, DEBUG while it repeats."""
        new, self.logged = message != self.logged, message
        return logging.ERROR if new else logging.DEBUG

    def engine_error(self, e: BaseException, *, counts: bool) -> None:
        """The engine failed to load a version (`counts`: its failure, not the mirror's); a
        WeightUpdateError (the version's layout refused) is kept for `raise_refused`."""
        self.engine_failed = counts
        self.refused = e if isinstance(e, WeightUpdateError) else None

    def raise_refused(self, url: str) -> None:
        """Raise the engine's refusal of the run's layout at `url` (WeightUpdateError), if any."""
        if self.refused is not None:
            raise WeightUpdateError(f"replica following {url}: {getattr(self.refused, 'message', self.refused)}",
                                    hint=getattr(self.refused, "hint", ""))

    def failed(self, newest: tuple[int, str], poll_interval: float, max_interval: float) -> float:
        """Count a failed attempt while `newest` was the newest commit; the seconds until the next."""
        self.failures += 1
        delay = min(max(poll_interval, RETRY_BASE_S) * 2 ** min(self.failures - 1, 30), max_interval)
        self.retry_at = time.time() + delay
        self.failed_on = newest
        return delay

    def waiting(self, newest: tuple[int, str]) -> bool:
        """Whether the loop must not try yet, `newest` being the newest commit now."""
        if self.retry_at is None or time.time() >= self.retry_at:
            return False
        return self.engine_failed or self.failed_on == newest
