"""Server settings: defaults, overridden by environment variables, overridden by CLI flags.

Guarantee: `ServerConfig.from_env()` validates every value at start-up and raises `ConfigError`
naming the variable, the bad value and what is expected; a server never starts half-configured.
An ENV_API_KEY that is set but empty is refused (it would otherwise mean "no key" silently).

| variable            | default     | meaning                                                       |
|---------------------|-------------|---------------------------------------------------------------|
| ENV_TASK            | wordle      | task of a /reset that names none: `wordle` or `repeat`        |
| ENV_MAX_SESSIONS    | 256         | live HTTP sessions at most (and /ws connections at most)      |
| ENV_MAX_SESSIONS_PER_CLIENT | half of the above | live HTTP sessions one client may hold |
| ENV_REPLACE_IDLE_S  | 30          | a client at its cap replaces its own session idle this long   |
| ENV_TRUSTED_PROXIES | (none)      | proxies whose X-Forwarded-For names the client (clients.py)   |
| ENV_API_KEY         | (none)      | if set, every route but /health needs `Authorization: Bearer` |
| ENV_IDLE_TIMEOUT_S  | 300         | a live session untouched this long is evicted                 |
| ENV_MAX_BODY_BYTES  | 65536       | larger request bodies (and /ws messages) are refused with 413 |
| ENV_HOST            | 127.0.0.1   | bind address (the Space image sets 0.0.0.0)                   |
| ENV_PORT / PORT     | 8000        | bind port                                                     |
| ENV_LOG_LEVEL       | warning     | uvicorn log level                                             |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from env_space import TASKS
from env_space.clients import ClientIdentity
from env_space.errors import ConfigError

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class ServerConfig:
    default_task: str = "wordle"  # ENV_TASK
    max_sessions: int = 256  # ENV_MAX_SESSIONS
    idle_timeout_s: float = 300.0  # ENV_IDLE_TIMEOUT_S
    max_body_bytes: int = 65536  # ENV_MAX_BODY_BYTES
    host: str = "127.0.0.1"  # ENV_HOST
    port: int = 8000  # ENV_PORT (or PORT, as Spaces and PaaS set it)
    log_level: str = "warning"  # ENV_LOG_LEVEL
    max_sessions_per_client: int = 0  # ENV_MAX_SESSIONS_PER_CLIENT (0: half of max_sessions, at least 1)
    api_key: str | None = field(default=None, repr=False)  # ENV_API_KEY: a secret, never in as_env()
    replace_idle_s: float = 30.0  # ENV_REPLACE_IDLE_S
    trusted_proxies: str = ""  # ENV_TRUSTED_PROXIES: comma-separated addresses / networks, or *

    def __post_init__(self) -> None:
        if self.default_task not in TASKS:
            raise ConfigError(f"ENV_TASK={self.default_task!r} is not a task", hint=f"use one of: {', '.join(TASKS)}")
        if self.max_sessions < 1:
            raise ConfigError(f"ENV_MAX_SESSIONS={self.max_sessions}: must be >= 1")
        if self.idle_timeout_s <= 0:
            raise ConfigError(f"ENV_IDLE_TIMEOUT_S={self.idle_timeout_s}: must be > 0")
        if self.max_body_bytes < 256:
            raise ConfigError(f"ENV_MAX_BODY_BYTES={self.max_body_bytes}: must be >= 256")
        if self.max_sessions_per_client < 0:
            raise ConfigError(
                f"ENV_MAX_SESSIONS_PER_CLIENT={self.max_sessions_per_client}: must be >= 0 (0: half of "
                "ENV_MAX_SESSIONS)"
            )
        if self.replace_idle_s < 0:
            raise ConfigError(f"ENV_REPLACE_IDLE_S={self.replace_idle_s}: must be >= 0")
        ClientIdentity.parse(self.trusted_proxies)  # raises on an entry that is not an address
        if self.api_key == "":
            raise ConfigError("ENV_API_KEY is set but empty: the server would run with no key",
                              hint="set a key of 8+ characters (openssl rand -hex 32), or unset ENV_API_KEY "
                              "to serve without one")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ConfigError("ENV_API_KEY is shorter than 8 characters", hint="use a long random key, e.g. "
                              "openssl rand -hex 32")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ENV_PORT={self.port}: must be a TCP port (0-65535)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Defaults < environment variables < `overrides` (None values in overrides are ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        spec = {"default_task": ("ENV_TASK", str), "max_sessions": ("ENV_MAX_SESSIONS", int),
                "idle_timeout_s": ("ENV_IDLE_TIMEOUT_S", float), "max_body_bytes": ("ENV_MAX_BODY_BYTES", int),
                "host": ("ENV_HOST", str), "port": ("ENV_PORT", int), "log_level": ("ENV_LOG_LEVEL", str),
                "max_sessions_per_client": ("ENV_MAX_SESSIONS_PER_CLIENT", int), "api_key": ("ENV_API_KEY", str),
                "replace_idle_s": ("ENV_REPLACE_IDLE_S", float), "trusted_proxies": ("ENV_TRUSTED_PROXIES", str)}
        if "ENV_PORT" not in env and "PORT" in env:
            spec["port"] = ("PORT", int)
        for name, (var, typ) in spec.items():
            raw = env.get(var)
            if raw is None or (raw == "" and var != "ENV_API_KEY"):  # an empty key is refused, not skipped
                continue
            try:
                values[name] = typ(raw)
            except ValueError:
                raise ConfigError(f"{var}={raw!r} is not a valid {typ.__name__}") from None
        known = {f.name for f in fields(cls)}
        for k, v in overrides.items():
            if k not in known:
                raise ConfigError(f"unknown setting {k!r}", hint=f"use one of: {', '.join(sorted(known))}")
            if v is not None:
                values[k] = v
        return replace(cls(), **values)

    @property
    def clients(self) -> ClientIdentity:
        """How a request's client is told apart (see clients.py)."""
        return ClientIdentity.parse(self.trusted_proxies)

    @property
    def open_to_network(self) -> bool:
        """Bound beyond loopback with no API key: anyone who can reach the port may play."""
        return self.api_key is None and self.host not in LOOPBACK_HOSTS

    @property
    def per_client_cap(self) -> int:
        """Live HTTP sessions one client may hold."""
        return min(self.max_sessions_per_client or max(1, self.max_sessions // 2), self.max_sessions)

    def as_env(self) -> dict[str, str]:
        """These settings as the environment variables that reproduce them (the API key, a
        secret, is left out)."""
        return {"ENV_TASK": self.default_task, "ENV_MAX_SESSIONS": str(self.max_sessions),
                "ENV_IDLE_TIMEOUT_S": f"{self.idle_timeout_s:g}", "ENV_MAX_BODY_BYTES": str(self.max_body_bytes),
                "ENV_HOST": self.host, "ENV_PORT": str(self.port), "ENV_LOG_LEVEL": self.log_level,
                "ENV_MAX_SESSIONS_PER_CLIENT": str(self.max_sessions_per_client),
                "ENV_REPLACE_IDLE_S": f"{self.replace_idle_s:g}", "ENV_TRUSTED_PROXIES": self.trusted_proxies}
