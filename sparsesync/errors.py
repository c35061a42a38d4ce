"""Every exception the sparsesync library raises on purpose.

Each error carries what went wrong (naming the object: a tensor, a file, a URL, a version),
and a `hint`: the action that fixes it. The CLI turns them into one clear line in one place
(`sparsesync/cli/_errors.py`); library users can catch the classes below.

Rule of thumb: raise the most specific class, put the bad value and what was expected into
the message, and put the fix into `hint`.

Library errors only: the apps keep theirs (`trainer/errors.py`, `sparsesync/deploy/errors.py`,
`env_space/errors.py`), subclasses of `SparsesyncError` where the CLI runs the app, so the CLI
still prints every one of them in its one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SparsesyncError(Exception):
    """Base of every sparsesync error. `hint` says how to fix it (may be empty).

    Where the failure is one object of a run, `key` names it (the part, delta, anchor file or
    commit record; a reader that fails on an object's bytes sets it before the error leaves it),
    and `written` says that the failing step had already written into the caller's state: its
    writes were undone, but the bits it started from were not what their digests said, so the
    holder must reload rather than fetch the object again.
    """

    key: str | None = None
    written: bool = False

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


# ---------------------------------------------------------------------------- configuration
class ConfigError(SparsesyncError):
    """A configuration value or CLI argument is invalid."""


class RunKindError(ConfigError):
    """An adapter run met a full-weight publisher, follower or engine (or the reverse), or an
    adapter of another base or configuration (`sparsesync.lora.bridge`)."""


class BaseModelMismatchError(ConfigError):
    """The base weights an adapter replica starts from are not the adapter run's base."""


class AdapterTargetError(ConfigError):
    """An adapter's `target_modules` (with `exclude_modules`, `layers_to_transform`) selects no
    module of the base model the adapter is put on (what PEFT raises as NoMatchingPeftModuleError)."""


class RewindRefusedError(ConfigError):
    """A push at or below the run's newest version would rewind the run (abandon its newer
    versions) and was not allowed to (`push(..., rewind=True)`, the CLI's `--rewind`). Nothing
    was written. `newest`: the run's newest version; `version`: the one asked for; `abandoned`:
    the versions the rewind would abandon."""

    def __init__(self, message: str, *, newest: int, version: int, abandoned: list[int], hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.newest = newest
        self.version = version
        self.abandoned = list(abandoned)


class OutputError(SparsesyncError):
    """Writing a result to the local disk failed (read-only folder, full disk, a file in the way).
    What was there before is left as it was."""


# ---------------------------------------------------------------------------- patches
class PatchError(SparsesyncError):
    """Base for problems with a patch or anchor file."""


class PatchFormatError(PatchError):
    """The file is not a valid sparsesync patch (bad header, offsets, sizes, encodings, streams)."""


class PatchMismatchError(PatchError):
    """The patch is well-formed but does not fit the tensors it is applied to
    (missing tensor, wrong shape or dtype, base digest mismatch). Nothing was written."""


class DigestMismatchError(PatchError):
    """Bytes do not match their recorded digest (after apply, or a stored object's bytes)."""


class MirrorMismatchError(DigestMismatchError):
    """A follower's mirror no longer holds the bytes its version's digests record (something other
    than the follower wrote into the mirror's file): it is reloaded from the run, never served."""


# ---------------------------------------------------------------------------- stores
class StoreError(SparsesyncError):
    """Base for object-store failures. `url` names the store or object (never a token)."""

    def __init__(self, message: str, *, url: str = "", hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.url = url


class ObjectNotFoundError(StoreError):
    """The object does not exist in the store."""


class StoreUnavailableError(StoreError):
    """The store did not answer (or answered with transient errors) after all retries."""


class StoreAuthError(StoreError):
    """The store refused our credentials or we lack permission."""


# ---------------------------------------------------------------------------- protocol
class ProtocolError(SparsesyncError):
    """Base for run-layout and commit-protocol problems."""


class MalformedCommitError(ProtocolError):
    """An object named like a commit record that is not one (wrong JSON shape, types, ranges, or a
    name that disagrees with its content). Readers skip it; `key` names it, `reason` says why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key} is not a commit record: {reason}",
                         hint="it was not written by a compatible sparsesync; delete it, or run `sparsesync gc`")
        self.key = key
        self.reason = reason


class RunNotFoundError(ProtocolError):
    """No committed version exists under the run URL."""


class VersionNotFoundError(ProtocolError):
    """The requested version is not committed (or no longer reachable after GC)."""


class BrokenChainError(ProtocolError):
    """No chain of committed objects leads from an anchor to the requested version."""


class FencedWriterError(ProtocolError):
    """Another writer with a newer epoch took over the run; this writer must stop."""


class RankFailedError(ProtocolError):
    """A rank of a distributed publisher failed (or died) before its part of a version was stored:
    the version is not committed, and every rank raises this."""


class FleetTimeoutError(ProtocolError, TimeoutError):
    """Too few replicas reported a version in time (`Publisher.wait_for_fleet`). `ready` names
    the replicas that did."""

    def __init__(self, message: str, *, ready: list[str] | None = None, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.ready = list(ready or [])


class ReplicaUnreachableError(ProtocolError, ConnectionError):
    """No replica answered at a URL a trainer was given, within the wait it allows (a
    `ConnectionError`, as TRL's own vLLM client raises for a server that is not up)."""


# ---------------------------------------------------------------------------- inference engines
class EngineError(SparsesyncError):
    """An inference engine (embedded transformers or vLLM) failed to load, generate or apply.
    Library errors: `sparsesync.integrations.vllm` raises them, as do the replicas' engines."""


class WeightUpdateError(EngineError):
    """A weight update does not fit the engine (unknown tensor, wrong shape or dtype, bad indices);
    rejected before the engine saw any of it."""


def some_of(problems: list[str], shown: int = 3) -> str:
    """The first `shown` of `problems` joined, plus how many more: an error message of bounded
    length however many tensors are wrong (e.g. every tensor of an fp32 state)."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more of {len(problems)}" if more > 0 else "")


def dtype_hint(got: Mapping[str, Any], served: Mapping[str, Any], who: str) -> str:
    """The fix when an update's floating tensors come in another dtype than `who` serves (e.g. an
    fp32 master published as is to a bf16 replica); "" when the dtypes are not the problem."""
    pairs = {(str(t.dtype), str(served[n])) for n, t in got.items() if n in served and t.dtype != served[n]}
    if len(pairs) != 1:
        return ""
    have, want = (d.removeprefix("torch.") for d in next(iter(pairs)))
    return f"the run holds {have} tensors and this {who} serves {want}: publish with Publisher(url, dtype=torch.{want})"


class EngineCheckError(EngineError):
    """The weights an engine computes with, read back after an apply, are not the version it was
    given (stale fused layer, stale tied LM head, a half-loaded expert group)."""
