"""The follower's polling policy: how long a follower that follows in the background waits before
it looks for a new version again (`Follower.start`'s loop asks `next_wait` after each poll).

Guarantees:
- New versions are found by polling the commit listing (cheap: one listing of `commits/`);
  stores that can push change notifications (`Store.wait_for_change`) wake the loop early, and
  `stop()` wakes it at once.
- The interval restarts from `poll_interval` when a version was applied, and stays there while a
  version is streaming in (new parts were seen in the last `STREAMING_WINDOW_S`; its commit
  normally follows within seconds): the commit is seen within `poll_interval`, while a quiet
  store is polled ever more rarely (x1.5 per quiet poll, up to `max_poll_interval`: idle listings
  cost the store requests and the CPU the decoding needs).
- A failed attempt is retried at its backoff time (`backoff`), not before and not much after.
"""

from __future__ import annotations

import time

# after new parts were seen, poll at poll_interval this long (or until their version is applied)
STREAMING_WINDOW_S = 60.0


def streaming(parts_seen_at: float | None) -> bool:
    """Whether a version is streaming in: new parts of it were seen in the last `STREAMING_WINDOW_S`."""
    return parts_seen_at is not None and time.monotonic() - parts_seen_at < STREAMING_WINDOW_S


def next_wait(interval: float, *, moved: bool, poll_interval: float, max_poll_interval: float,
              retry_at: float | None) -> tuple[float, float]:
    """(the next poll interval, the seconds to wait now) after one poll; `moved`: a version was
    applied or is streaming in; `retry_at`: the unix time of the next attempt after a failure."""
    interval = poll_interval if moved else min(interval * 1.5, max_poll_interval)
    return interval, interval if retry_at is None else min(interval, max(retry_at - time.time(), 0.0) + 0.01)
