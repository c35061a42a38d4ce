"""The replica's boundary, before FastAPI parses anything: the API key and the body-size cap.

`Guard` is pure ASGI middleware. Guarantees:
- With an API key set, every route but `GET /health` needs `Authorization: Bearer <key>` (as
  vLLM's `--api-key`; `X-API-Key: <key>` is accepted too, for a private Space whose proxy takes
  the Authorization header); both headers are compared, in constant time; a refusal is a 401 in
  the server's error shape, sent before the body is read. The key follows the shared rule
  (`sparsesync.access.check_key`: at least 8 printable characters); `""` is not "no key".
- A body over `max_body_bytes` is a 413: at once when Content-Length says so (nothing of the body
  is read), otherwise as soon as the bytes received pass the cap (chunked uploads). The body is
  buffered only up to the cap, so one request cannot make the replica hold more than that (the
  servers' one reader: `sparsesync.access.read_capped_body`).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from sparsesync.access import BodyRefusal, bearer_matches, check_key, read_capped_body, replaying

OPEN_PATHS = frozenset({"/health"})
DEFAULT_MAX_BODY_BYTES = 8 << 20  # prompt batches of TRL-sized token ids fit many times over


class Guard:
    """API key and body cap (see module docstring)."""

    def __init__(
        self, app: ASGIApp, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    ) -> None:
        self.app = app
        key = check_key(api_key, "the replica's API key")
        self._key = key.encode() if key is not None else None
        self._keys = (key,) if key is not None else ()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self._key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _error(send, 401, "missing or wrong API key", "authentication_error",
                         extra_headers=[(b"www-authenticate", b"Bearer")])
            return
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        got = await read_capped_body(scope, receive, self.max_body_bytes)
        if got is None:  # the client went away
            return
        if isinstance(got, BodyRefusal):
            if got.status == 413:
                await self._too_large(send, got.detail)
            else:
                await _error(send, got.status, f"bad Content-Length {got.detail}", "invalid_request_error")
            return
        await self.app(scope, replaying(got, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        assert self._key is not None
        headers = dict(scope["headers"])
        # both compared, always: the time taken does not say which header was tried
        ok_bearer = bearer_matches(scope["headers"], self._keys)
        ok_header = hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self._key)
        return ok_bearer or ok_header

    async def _too_large(self, send: Send, size: str) -> None:
        await _error(send, 413, f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes "
                                "(split the batch, or raise --max-body-bytes / SPARSESYNC_MAX_BODY_BYTES)",
                     "invalid_request_error")


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict[str, object]:
    """The one error shape of every refusal (vLLM's: message, type, param, code)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def _error(send: Send, status: int, message: str, kind: str,
                 extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(message, kind, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(extra_headers or [])]})
    await send({"type": "http.response.body", "body": body})
