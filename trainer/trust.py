"""Which samples the learner may train on: each must name the run's trusted commit of its version.

A replica returns with each completion the `(weight_version, state_digest)` of the weights that
produced it; `SampleJudge` checks those pairs against the run's commits for the rollout buffer's
`take` (`trainer/buffer.py`), so a sample of a version a rewind abandoned, or one naming no
version or digest, is never trained on (docs/protocol.md, "Rewinds").

Guarantees:
- One listing of `commits/` per take (`for_take`: its first round lists afresh, later rounds of
  the same take reuse that listing), made outside the buffer's lock. A listing made at the take
  means no stale view: a rewind committed before the take is seen by it.
- A failed listing does not end the run: the take raises `TrustCheckUnavailable`, the buffer
  keeps its groups, and the learner retries; only when listings keep failing for `patience_s`
  seconds (no take succeeding meanwhile) does `failed` raise `TrainerError` naming the store
  error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sparsesync.errors import SparsesyncError
from sparsesync.protocol.lineage import TrustedCommits
from sparsesync.store import Store
from trainer.buffer import Pair, TrustCheckUnavailable
from trainer.errors import TrainerError

log = logging.getLogger(__name__)

PATIENCE_S = 300.0  # how long listings of the run's commits may keep failing before the run stops


class SampleJudge:
    """Judges the samples of the run in `store` for the buffer's takes (see module docstring)."""

    def __init__(self, store: Store, *, patience_s: float = PATIENCE_S) -> None:
        self.trusted = TrustedCommits(store, max_age_s=0.0)
        self.patience_s = patience_s
        self._failing_since: float | None = None

    def for_take(self) -> Callable[[set[Pair]], set[Pair]]:
        """The `judge` of one take: the untrusted pairs, listing `commits/` at most once."""
        listed = False

        def judge(pairs: set[Pair]) -> set[Pair]:
            nonlocal listed
            try:
                bad = self.trusted.untrusted(pairs, fresh=not listed)
            except SparsesyncError as e:
                raise TrustCheckUnavailable(str(e)) from e
            listed = True
            self._failing_since = None
            return bad  # type: ignore[return-value]

        return judge

    def failed(self, e: TrustCheckUnavailable) -> None:
        """A take could not check its samples: log it, or raise TrainerError once listings have
        failed for `patience_s` seconds in a row."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        waited = now - self._failing_since
        if waited >= self.patience_s:
            raise TrainerError(
                f"could not list the commits of {self.trusted.store.url} to check rollout samples for {waited:.0f} s: "
                f"{e}",
                hint="check that the bucket is reachable and the token may read it",
            ) from e
        log.warning(
            "checking rollout samples against the commits of %s failed (retrying): %s", self.trusted.store.url, e
        )
