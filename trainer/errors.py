"""The errors of the asynchronous GRPO trainer (trainer/) and the local demo (`sparsesync demo`).

Guarantee: each names what failed (the replicas tried, the failed check) and carries a `hint`;
each is a `SparsesyncError`, so the CLI prints it as one line (`sparsesync/cli/_errors.py`) like
the library's own errors, which the trainer also raises (`ConfigError`, `PatchMismatchError`, ...).
"""

from __future__ import annotations

from sparsesync.errors import SparsesyncError


class TrainerError(SparsesyncError):
    """Base for failures of the asynchronous GRPO trainer (trainer/) and the local demo."""


class ReplicaUnavailableError(TrainerError):
    """No inference replica answered a request (every one failed or is cooling down).
    `urls` names the replicas tried."""

    def __init__(self, message: str, *, urls: list[str] | None = None, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.urls = list(urls or [])


class RolloutError(TrainerError):
    """An episode could not be played (the environment server refused or a reply was malformed)."""


class DemoCheckError(TrainerError):
    """A check of the local demo failed (reward did not rise, staleness out of bound, replicas
    not bit-exact, a process died). `check` names the failed check."""

    def __init__(self, message: str, *, check: str = "", hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.check = check
