"""The follower's polling: when a follower that follows in the background looks for a new version.

Guarantees:
- New versions are found by polling the commit listing (cheap: one listing of `commits/`);
  stores that can push change notifications (`Store.wait_for_change`) wake it early, and
  `stop()` wakes it at once.
- The interval restarts from `poll_interval` when a version was applied, and stays there while a
  version is streaming in (new parts were seen in the last `STREAMING_WINDOW_S`; its commit
  normally follows within seconds): the commit is seen within `poll_interval`, while a quiet
  store is polled ever more rarely (x1.5 per quiet poll, up to `max_poll_interval`: idle listings
  cost the store requests and the CPU the decoding needs).
- A failed attempt is retried at its backoff time (`backoff`), not before and not much after.
- Nothing stops the loop but `stop()`: a refused commit or a bug is recorded in `status()`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sparsesync.errors import RunKindError

if TYPE_CHECKING:
    from sparsesync.protocol.follower.follower import Follower

STREAMING_WINDOW_S = 60.0  # after new parts were seen, poll at poll_interval this long (or until their version is applied)

log = logging.getLogger("sparsesync.protocol.follower.follower")  # the follower's one logger: its steps log as it


def next_wait(interval: float, *, moved: bool, poll_interval: float, max_poll_interval: float,
              retry_at: float | None) -> tuple[float, float]:
    """(the next poll interval, the seconds to wait now) after one poll."""
    interval = poll_interval if moved else min(interval * 1.5, max_poll_interval)
    return interval, interval if retry_at is None else min(interval, max(retry_at - time.time(), 0.0) + 0.01)


def follow(f: Follower) -> None:
    """Keep `f` at the newest version until it is stopped: the body of `Follower.start`'s thread, so
    it reads the follower's own state (its stop event, backoff and when parts were last seen)."""
    interval = f.poll_interval
    while not f._stop.is_set():
        before = f.current_version
        try:
            f.sync_once(backoff=True)
        except RunKindError as e:  # a refused commit (check_follow): logged once, by the refusals
            f._degrade(e)
        except Exception as e:  # noqa: BLE001 - a bug must not stop the replica from serving
            log.exception("follower of %s hit an unexpected error", f.store.url)
            f._degrade(e)
        seen = f._parts_seen_at
        streaming = seen is not None and time.monotonic() - seen < STREAMING_WINDOW_S
        interval, wait = next_wait(interval, moved=f.current_version != before or streaming, poll_interval=f.poll_interval,
                                   max_poll_interval=f.max_poll_interval, retry_at=f._backoff.retry_at)
        f.store.wait_for_change(wait, f._stop)
