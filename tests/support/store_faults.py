"""One fault-injection handle per store backend, for tests that run on every backend.

`StoreFaults` (the `store_faults` fixture) speaks the same words whatever backend a test
runs on; a fault a backend cannot have skips the test there (`pytest.skip`), so a
parametrized fault test simply runs where the fault is real:

| knob                     | local | s3 (moto behind TcpProxy)        | hf (hub_server behind TcpProxy) |
| ------------------------ | ----- | -------------------------------- | ------------------------------- |
| `unavailable(seconds)`   | skip  | connections refused              | connections refused             |
| `fail_requests(n)`       | skip  | next n connections reset         | next n requests answer 503      |
| `stale_listing()`        | skip  | skip (S3 listings are consistent)| tree/paths-info frozen at now   |
| `fresh_listing()`, `heal()` | no-op | restore                      | restore                         |

`hub` / `s3` give the underlying servers for finer control (e.g. `hub.fail_batch_path`).
The fixtures call `heal()` after every test, since the servers are shared by the session.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.support.hub_server import HubServer
from tests.support.s3_server import S3Server


@dataclass
class StoreFaults:
    """Switches that make the store under test misbehave."""

    backend: str  # "local", "s3" or "hf"
    hub: HubServer | None = None
    s3: S3Server | None = None

    def unavailable(self, seconds: float) -> None:
        """Refuse every connection for `seconds` (then recover by itself)."""
        proxy = self._proxy("be unavailable")
        proxy.refuse(seconds)

    def fail_requests(self, n: int) -> None:
        """The next `n` requests (hf) or connections (s3) fail with a transient error."""
        if self.hub is not None:
            self.hub.fail_next(n, status=503)
        else:
            self._proxy("fail requests").drop_next(n)

    def stale_listing(self) -> None:
        """Listings (and existence checks) answer from a snapshot taken now."""
        if self.hub is None:
            pytest.skip(f"the {self.backend} store has no stale listings")
        self.hub.stale_listing()

    def fresh_listing(self) -> None:
        if self.hub is not None:
            self.hub.fresh_listing()

    def heal(self) -> None:
        """End every fault now."""
        if self.hub is not None:
            self.hub.heal()
        if self.s3 is not None and self.s3.proxy is not None:
            self.s3.proxy.restore()

    def _proxy(self, what: str):  # type: ignore[no-untyped-def]
        server = self.hub or self.s3
        if server is None or server.proxy is None:
            pytest.skip(f"the {self.backend} store cannot {what}")
        return server.proxy
