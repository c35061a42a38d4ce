"""What a replica plugs into the follower: the apply hook, and the status the follower reports.

The follower keeps a verified CPU mirror of the weights in checkpoint coordinates (the names
and shapes of the trainer's state dict). For each new version it fetches, verifies and decodes
the patch while the replica keeps serving, applies it to the mirror (all-or-nothing, target
digests verified), and only then calls the hook, which is the only step that touches the
engine. If the hook raises, the follower reloads the engine from the mirror with `load_full`.

What a hook takes beyond the weights is declared on `ApplyHook` and read by the follower as typed
fields (a hook subclasses `ApplyHook`, so each defaults to False):
- `takes_state_digest`: both calls also get `state_digest=` (the commit's state digest of
  `version`), so the hook can report which commit its weights are, not only which version number
  (a rewind commits a number again with other weights).
- `takes_digests`: both calls also get `digests=`, the version's per-tensor digests (every tensor,
  as verified in the mirror; a tensor published in row units is missing), against which it checks
  the whole state it serves, not only what the version touched, before reporting it.
- `takes_base_version`: `apply_sparse` also gets `base_version=`, the version the update is a
  delta from (the engine refuses it when it holds another; the follower then reloads it in full).
- `holds_device_state`: the engine's own tensors are the verified state (a GPU engine): the follower
  keeps no host mirror and writes each version straight into them inside the engine's pause, through
  `write_in_place` (deltas by `codec.device_apply`, all or nothing, base and target digests checked on
  the device; anchors tensor by tensor, hashed), reading them outside the pause through
  `device_tensors` (`engine_held` states the whole).
- `pages_out_mirror`: the follower keeps the mirror out of the process's RSS (`mirror.pager`:
  each tensor unmapped once read or written, the bits kept in the page cache): for engines whose
  update reads what it touches of the mirror once and costs far more than mapping it back (vLLM:
  +1-10% lag, total RSS peak 2.39 -> 1.69 copies of a 96 MB model). An engine with cheap in-place
  updates keeps it mapped (the embedded engine: +23-34% lag otherwise; its total RSS is engine +
  mirror, 2.05-2.09 copies). The page cache holds the mirror either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from sparsesync.codec.apply import SparseUpdate

InPlaceWrite = Callable[[Mapping[str, torch.Tensor]], Mapping[str, str]]  # live tensors -> the version's digests


class ApplyHook(Protocol):
    """Implemented by an inference engine (vLLM adapter, embedded transformers engine).

    A hook subclasses it: the capability fields below then default to False, and the follower
    passes a keyword only to a hook whose field says it takes it (module docstring)."""

    takes_state_digest: bool = False  # `state_digest=` on both calls
    takes_digests: bool = False  # `digests=` on both calls
    takes_base_version: bool = False  # `base_version=` on `apply_sparse`
    pages_out_mirror: bool = False  # the follower keeps the mirror out of the process's RSS
    holds_device_state: bool = False  # no host mirror: versions are written into the engine (`write_in_place`)

    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor], *, state_digest: str | None = None,
                  digests: Mapping[str, str] | None = None) -> None:
        """Replace all weights (cold start, anchor fallback, recovery). Pauses the engine."""

    def apply_sparse(
        self,
        version: int,
        updates: Mapping[str, SparseUpdate],
        full: Mapping[str, torch.Tensor],
        *,
        base_version: int | None = None,
        state_digest: str | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        """Apply one verified version: `updates` holds the changed elements per tensor (flat
        indices and target values); `full` holds the complete new value of each touched tensor
        (views of the mirror, read-only) for engines that reload whole tensors. The engine
        pauses only for the in-place write and reports `version` from then on."""

    def device_tensors(self) -> Mapping[str, torch.Tensor]:
        """(`holds_device_state`) The live tensors the forward pass reads, by checkpoint name, for
        reading only (decoding against them while the engine serves)."""
        _lacks_device_state(self)
        return {}

    def write_in_place(self, version: int, write: InPlaceWrite, *, base_version: int | None,
                       state_digest: str | None = None) -> None:
        """(`holds_device_state`) Pause the engine, call `write` with its live tensors; `write`
        brings them to `version` (from `base_version`; None: every tensor, a full load) and returns
        the version's per-tensor digests, against which the engine checks its whole state; then serve
        `version`. If anything raises, the engine reports no version until a later write passes, and
        a delta is refused (EngineCheckError, nothing written) unless the engine holds `base_version`."""
        _lacks_device_state(self)


def _lacks_device_state(hook: object) -> None:
    raise NotImplementedError(f"{type(hook).__name__} does not hold device state (holds_device_state is False)")


@dataclass(frozen=True)
class HookLabels:
    """What the follower hands a hook beside the weights of one version; `for_load`/`for_patch`
    give the keywords the hook's capability fields say it takes (never one it does not)."""

    state_digest: str | None
    digests: Mapping[str, str]
    base_version: int | None = None

    def for_load(self, hook: ApplyHook) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if hook.takes_state_digest:
            kw["state_digest"] = self.state_digest
        if hook.takes_digests:
            kw["digests"] = self.digests
        return kw

    def for_patch(self, hook: ApplyHook) -> dict[str, Any]:
        kw = self.for_load(hook)
        if hook.takes_base_version:
            kw["base_version"] = self.base_version
        return kw


class NoHook(ApplyHook):
    """The hook of a follower with no engine: the mirror is the replica (CLI pull --follow, tests)."""

    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor], *, state_digest: str | None = None,
                  digests: Mapping[str, str] | None = None) -> None:
        pass

    def apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor], *,
                     base_version: int | None = None, state_digest: str | None = None,
                     digests: Mapping[str, str] | None = None) -> None:
        pass


@dataclass
class FollowerStatus:
    """A follower's view of itself; served by replicas as their sync status."""

    url: str
    current_version: int | None  # version the engine serves (None before the first load)
    newest_version: int | None  # newest committed version seen in the store
    # newest_version - current_version; serving a version a rewind abandoned: the versions from the rewind on
    # (lineage.lag)
    lag: int | None
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
    # the commit's state digest of current_version (a version number may be re-committed after a rewind)
    state_digest: str | None = None
    # commits this follower refuses: {key, reason}, newest first (refusals.py)
    refused: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
