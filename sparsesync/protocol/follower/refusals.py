"""The commits a follower refuses, and how it says so (`Follower`'s part of "a replica that
serves nothing says why").

A follower refuses a commit when the object named like a commit record is not one (`Run.rejected`:
malformed JSON, out-of-range fields, a hostile `adapter_config`, ...) or when the version is of
another kind, base or adapter configuration than its engine serves (`adapter_runs.check_follow`).

Guarantees:
- Each refusal is logged once per (commit key, reason), at WARNING, however often the run is
  polled; a refusal whose name leaves the listing (deleted, fenced out by a rewind) is dropped.
- `report` puts every refusal of the last listing into a status's `refused` ({key, reason},
  newest first, at most `MAX_SHOWN`), and, when the newest refused commit is newer than the version
  served (or nothing is served) and no other error is pending, sets `last_error` to one line naming
  its key and reason and the state to "degraded": `/sync`, the heartbeat (so `sparsesync status`'
  problems) and `/health` then say why the replica does not serve the run's newest commit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

from sparsesync.errors import RunKindError
from sparsesync.protocol.adapter_runs import check_follow
from sparsesync.protocol.follower.hooks import FollowerStatus
from sparsesync.protocol.keys import commit_key, parse_commit_key
from sparsesync.protocol.records import AdapterMeta, CommitRecord

log = logging.getLogger("sparsesync.protocol.follower.follower")

MAX_SHOWN = 8  # refusals a status lists
MAX_REASON = 500  # characters of a reason kept (a heartbeat cuts its error to 300)


class Refusals:
    """The commits one follower of `url` refuses (see module docstring). Thread-safe."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._rejected: dict[str, str] = {}  # names in the listing that are not commit records
        self._follow: dict[str, str] = {}  # trusted commits of another kind, base or configuration
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def listed(self, rejected: Mapping[str, str], commits: Iterable[CommitRecord]) -> None:
        """The refusals as of one listing: `rejected` ({key: reason}, `Run.rejected`) and the
        follow refusals of `commits` (the trusted records) that are still listed."""
        keys = {commit_key(c.version, c.epoch) for c in commits}
        with self._lock:
            self._rejected = {k: _line(r) for k, r in rejected.items()}
            self._follow = {k: r for k, r in self._follow.items() if k in keys}
            self._log_new()

    def check(self, rec: CommitRecord, adapter: AdapterMeta | None) -> None:
        """`check_follow` for `rec`; its RunKindError is recorded (and logged once) before it propagates."""
        try:
            check_follow(rec, adapter, self.url)
        except RunKindError as e:
            with self._lock:
                self._follow[commit_key(rec.version, rec.epoch)] = _line(str(e))
                self._log_new()
            raise

    def report(self, st: FollowerStatus) -> None:
        """Fill `st` (a copy) in: `refused`, and `last_error`/`state` for a refused newer commit."""
        with self._lock:
            refused = sorted({**self._rejected, **self._follow}.items(), key=lambda kv: _order(kv[0]), reverse=True)
        st.refused = [{"key": k, "reason": r} for k, r in refused[:MAX_SHOWN]]
        if not refused or st.last_error is not None or st.state == "stopped":
            return
        key, reason = refused[0]
        version = _order(key)[0]
        if st.current_version is None or version > st.current_version:
            st.state = "degraded"
            st.last_error = f"commit {key} of {self.url} refused: {reason}"

    def _log_new(self) -> None:  # under the lock
        for key, reason in (*self._rejected.items(), *self._follow.items()):
            if (key, reason) not in self._logged:
                self._logged.add((key, reason))
                log.warning("refusing commit %s of %s: %s", key, self.url, reason)


def _order(key: str) -> tuple[int, int]:
    """(version, epoch) of a commit key; (-1, -1) for a name that is not one."""
    return parse_commit_key(key) or (-1, -1)


def _line(reason: str) -> str:
    """`reason` as one line of at most MAX_REASON characters."""
    return " ".join(reason.split())[:MAX_REASON]
