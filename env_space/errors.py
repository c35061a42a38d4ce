"""Every error the environment server answers on purpose, each with its HTTP status.

Guarantee: a request the server refuses gets one of these, rendered by the server as
`{"detail": <what went wrong>, "error": <stable code>, "hint": <how to fix it>}` with a 4xx status
(503 when the server is full); nothing a client sends makes the server answer 500.
"""

from __future__ import annotations


class EnvError(Exception):
    """Base: `status` is the HTTP status, `code` a stable machine-readable name."""

    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def body(self) -> dict[str, str]:
        return {"detail": self.message, "error": self.code, "hint": self.hint}


class ConfigError(EnvError, ValueError):
    """A server setting (CLI flag or environment variable) is invalid."""

    code = "bad_config"


class UnknownTaskError(EnvError):
    code = "unknown_task"


class MissingSessionError(EnvError):
    code = "missing_session_id"


class UnknownSessionError(EnvError):
    status = 404
    code = "unknown_session"


class SessionExpiredError(EnvError):
    status = 410
    code = "session_expired"


class EpisodeFinishedError(EnvError):
    status = 409
    code = "episode_finished"


class MalformedActionError(EnvError):
    status = 422
    code = "malformed_action"


class MalformedRequestError(EnvError):
    status = 422
    code = "malformed_request"


class InvalidTextError(EnvError):
    """A JSON body or WebSocket message holds text that is not Unicode (a lone surrogate) or nests
    too deeply; refused before any handler sees it."""

    status = 400
    code = "invalid_text"


class PayloadTooLargeError(EnvError):
    status = 413
    code = "payload_too_large"


class CapacityError(EnvError):
    """All session slots are taken; retry later (the response carries Retry-After)."""

    status = 503
    code = "capacity_reached"


class ClientCapacityError(EnvError):
    """This client holds as many live sessions as one client may; finish or close some."""

    status = 429
    code = "client_capacity_reached"


class UnauthorizedError(EnvError):
    """The server has an API key and the request did not carry it."""

    status = 401
    code = "unauthorized"
