"""The replica app's errors (subclasses of the library's, so the CLI formats them alike)."""

from __future__ import annotations

from sparsesync.errors import ConfigError


class RequestFieldError(ConfigError):
    """A request field the replica refuses (400), named as OpenAI's error `param`."""

    def __init__(self, param: str, message: str, *, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.param = param
