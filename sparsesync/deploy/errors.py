"""The errors of deploying a run's apps as Spaces (`sparsesync deploy`).

Guarantee: every failure of rendering, planning or creating a Space is a `DeployError` naming the
Space (never a token) with a `hint`; it is a `SparsesyncError`, so the CLI prints it as one line
(`sparsesync/cli/_errors.py`) like the library's own errors.
"""

from __future__ import annotations

from sparsesync.errors import SparsesyncError


class DeployError(SparsesyncError):
    """Rendering or creating a Space failed. `space_id` names the Space (never a token)."""

    def __init__(self, message: str, *, space_id: str = "", hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.space_id = space_id
