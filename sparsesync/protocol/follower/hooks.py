"""What a replica plugs into the follower: the apply hook, and the status the follower reports.

The follower keeps a verified CPU mirror of the weights in checkpoint coordinates (the names
and shapes of the trainer's state dict). For each new version it fetches, verifies and decodes
the patch while the replica keeps serving, applies it to the mirror (all-or-nothing, target
digests verified), and only then calls the hook, which is the only step that touches the
engine. If the hook raises, the follower reloads the engine from the mirror with `load_full`.
A hook whose class sets `takes_state_digest = True` also gets `state_digest=` (the commit's state
digest of `version`) on both calls, so it can report which commit its weights are, not only which
version number (a rewind commits a number again with other weights). A hook whose class sets
`takes_digests = True` also gets `digests=` on both calls: the version's per-tensor digests (every
tensor, as verified in the mirror; a tensor published in row units is missing), against which it
checks the whole state it serves, not only what the version touched, before reporting it.
A hook whose class sets `pages_out_mirror = True` gets a follower that keeps the mirror out of the
process's RSS (`mirror.pager`: each tensor unmapped once read or written, the bits kept in the
page cache): for engines whose update reads what it touches of the mirror once and costs far more
than mapping it back (vLLM: +1-10% lag, total RSS peak 2.39 -> 1.69 copies of a 96 MB model). An
engine with cheap in-place updates keeps it mapped (the embedded engine: +23-34% lag otherwise;
its total RSS is engine + mirror, 2.05-2.09 copies). The page cache holds the mirror either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from sparsesync.codec.apply import SparseUpdate


class ApplyHook(Protocol):
    """Implemented by an inference engine (vLLM adapter, embedded transformers engine)."""

    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace all weights (cold start, anchor fallback, recovery). Pauses the engine."""

    def apply_sparse(
        self,
        version: int,
        updates: Mapping[str, SparseUpdate],
        full: Mapping[str, torch.Tensor],
    ) -> None:
        """Apply one verified version: `updates` holds the changed elements per tensor (flat
        indices and target values); `full` holds the complete new value of each touched tensor
        (views of the mirror, read-only) for engines that reload whole tensors. The engine
        pauses only for the in-place write and reports `version` from then on."""


class NoHook:
    """The hook of a follower with no engine: the mirror is the replica (CLI pull --follow, tests)."""

    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        pass

    def apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]) -> None:
        pass


@dataclass
class FollowerStatus:
    """A follower's view of itself; served by replicas as their sync status."""

    url: str
    current_version: int | None  # version the engine serves (None before the first load)
    newest_version: int | None  # newest committed version seen in the store
    lag: int | None  # newest_version - current_version; serving a version a rewind abandoned: the versions from the rewind on (lineage.lag)
    state: str  # "starting" | "following" | "degraded" (serving last good version) | "stopped"
    last_error: str | None
    last_fetch_s: float | None  # fetch+verify+decode seconds of the last version
    last_apply_s: float | None  # seconds the engine was paused for the last apply
    last_apply_at: float | None  # unix time of the last successful apply
    versions_applied: int
    anchor_loads: int
    fleet: dict[str, Any] | None = None  # heartbeat and switching (FleetMember.describe()); None: not in the fleet
    failures: int = 0  # failed sync attempts in a row (0 once one succeeds)
    retry_at: float | None = None  # unix time of the next attempt after a failure (backoff); None: none pending
    retry_in_s: float | None = None  # seconds until then, as of this status
    state_digest: str | None = None  # the commit's state digest of current_version (a version number may be re-committed after a rewind)
    refused: list[dict[str, str]] = field(default_factory=list)  # commits this follower refuses: {key, reason}, newest first (refusals.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
