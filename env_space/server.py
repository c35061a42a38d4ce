"""The FastAPI app: OpenEnv's `create_app`, plus HTTP sessions, limits and clear errors.

What comes from OpenEnv unchanged: `GET /health`, `/schema`, `/metadata`, `WS /ws` (one
persistent `TaskEnvironment` per connection, capped at ENV_MAX_SESSIONS, idle timeout
ENV_IDLE_TIMEOUT_S), the MCP and task routes. So OpenEnv's `EnvClient`, and TRL through it,
drive this server unchanged.

What this module replaces: OpenEnv's HTTP `POST /reset`, `POST /step` and `GET /state` build a
fresh environment per request, so a plain-HTTP episode cannot last past one call. Here they keep
the same request and response shapes and add a session id:

- `POST /reset` `{"seed"?: int>=0, "task"?: "wordle"|"repeat", "episode_id"?: str,
  "session_id"?: str}` -> `{"observation": {...,"prompt": str,...}, "reward": null, "done": false,
  "session_id": str}`. Without `session_id` it opens a new session (503 when all are taken).
- `POST /step` `{"action": {"text": str}, "session_id": str}` -> `{"observation", "reward",
  "done", "session_id"}`. The id may instead come in the `X-Session-Id` header.
- `GET /state?session_id=...` (or the header) -> the episode's `EpisodeState`.
- `DELETE /sessions/{id}` frees a session; `GET /sessions` reports live/finished counts.

Access: with an API key (ENV_API_KEY / --api-key), every route but `GET /health`, the WebSocket
included, needs `Authorization: Bearer <key>` (or `X-API-Key: <key>`, for a private Space whose
proxy takes the Authorization header), compared in constant time; refused with 401 before the
body is read. One client holds at most ENV_MAX_SESSIONS_PER_CLIENT live HTTP sessions, its idle
ones replaced first (sessions.py), so one client cannot take every slot; who the client is comes
from clients.py (the peer address, or `X-Forwarded-For` only from ENV_TRUSTED_PROXIES).

Guarantees: every refusal is a 4xx (503 when full) with `{"detail", "error", "hint"}` (see
errors.py), FastAPI's and Starlette's own refusals (404, 405, 422) included; bodies over
ENV_MAX_BODY_BYTES get 413 before any parsing (the servers' one reader:
`sparsesync.access.read_capped_body`); JSON bodies and WebSocket messages whose strings are not
valid Unicode (a lone surrogate such as "\ud800", which no UTF-8 text can carry) or that nest too
deeply are refused at the boundary (400 `invalid_text`; an `error` frame on the WebSocket) before
any handler or session sees them, so they cannot poison a session; handlers never block (the
session store's critical sections are microseconds), so no request hangs another.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
from typing import Any

from fastapi import Body, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import ConcurrencyConfig, ResetRequest, ResetResponse, StepRequest, StepResponse
from pydantic import Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from env_space.config import ServerConfig
from env_space.environment import TaskEnvironment
from env_space.errors import (
    EnvError,
    InvalidTextError,
    MalformedActionError,
    MalformedRequestError,
    MissingSessionError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from env_space.models import EpisodeState, TextAction, TextObservation
from env_space.sessions import SessionStore
from sparsesync.access import BodyRefusal, read_capped_body, replaying

SESSION_HEADER = "X-Session-Id"
log = logging.getLogger("env_space")


# -- wire models: OpenEnv's, plus the session id ------------------------------------------------
class SessionResetRequest(ResetRequest):
    task: str | None = Field(default=None, description="'wordle' or 'repeat'; default: the server's ENV_TASK.")
    session_id: str | None = Field(default=None, max_length=64,
                                   description="Reuse this session for the new episode; omit for a new session.")


class SessionStepRequest(StepRequest):
    session_id: str | None = Field(default=None, max_length=64,
                                   description="The session returned by /reset (or send the X-Session-Id header).")


class SessionResetResponse(ResetResponse):
    session_id: str = Field(description="Send this with every /step of the episode.")


class SessionStepResponse(StepResponse):
    session_id: str


def _wire(obs: TextObservation, session_id: str) -> dict[str, Any]:
    """OpenEnv's serialization (observation without reward/done, those beside it) plus the id."""
    return {"observation": obs.model_dump(exclude={"reward", "done"}), "reward": obs.reward,
            "done": obs.done, "session_id": session_id}


def _session_id(body_id: str | None, header_id: str | None) -> str:
    if body_id and header_id and body_id != header_id:
        raise MissingSessionError(f"session_id {body_id!r} in the body differs from {SESSION_HEADER} {header_id!r}",
                                  hint="send one of them")
    sid = body_id or header_id
    if not sid:
        raise MissingSessionError("no session_id", hint=f"send the session_id from POST /reset in the body "
                                                        f"or the {SESSION_HEADER} header")
    return sid


def _describe(errors: list[Any], drop: int = 0) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ())[drop:]) or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)


# -- the boundary: body size, and text that is not Unicode (pure ASGI, before any parsing) --------
_MAX_DEPTH = 64  # JSON nesting deeper than any request shape here


def _text_problem(raw: bytes | str) -> str | None:
    """Why a JSON document must be refused at the boundary, or None (also None when it is not
    JSON at all: FastAPI's validation answers that with its own 422)."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        return "JSON nested too deeply"
    except ValueError:
        return None
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return f"JSON nested deeper than {_MAX_DEPTH} levels"
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return "a string holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode text"
        elif isinstance(node, dict):
            stack.extend((x, depth + 1) for kv in node.items() for x in kv)
        elif isinstance(node, list):
            stack.extend((x, depth + 1) for x in node)
    return None


def _invalid_text(why: str) -> InvalidTextError:
    return InvalidTextError(
        f"refused: {why}", hint="send valid UTF-8 JSON text (escape pairs like \\ud83d\\ude00 are fine)"
    )


class BodyLimitMiddleware:
    """Refuse HTTP bodies over `max_bytes` with 413, by Content-Length or while streaming, and
    JSON bodies or WebSocket text messages that are not Unicode text (see `_text_problem`)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self.app(scope, self._checked_ws(receive, send), send)
            return
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        got = await read_capped_body(scope, receive, self.max_bytes)  # bounded: a chunked upload cannot pass it either
        if got is None:  # the client went away
            return
        if isinstance(got, BodyRefusal):
            await _send_error(send, self._too_large(got.detail) if got.status == 413
                              else EnvError(f"bad Content-Length {got.detail}"))
            return
        if got and (why := _text_problem(got)):
            await _send_error(send, _invalid_text(why))
            return
        await self.app(scope, replaying(got, receive), send)

    def _checked_ws(self, receive: Receive, send: Send) -> Receive:
        """`receive` that answers a text message which is not Unicode with an error frame (the
        shape OpenEnv's own errors have) and hands the app the next message instead."""

        async def checked() -> Message:
            while True:
                message = await receive()
                text = message.get("text") if message["type"] == "websocket.receive" else None
                if text is None:
                    return message
                if len(text) > self.max_bytes:
                    err: EnvError | None = self._too_large(str(len(text)))
                else:
                    why = _text_problem(text)
                    err = _invalid_text(why) if why else None
                if err is None:
                    return message
                await send({"type": "websocket.send", "text": json.dumps(
                    {"type": "error", "data": {"message": err.message, "code": err.code, "hint": err.hint}})})

        return checked

    def _too_large(self, what: str) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"request body of {what} bytes exceeds the limit of {self.max_bytes} bytes",
                                    hint="send a shorter action, or raise ENV_MAX_BODY_BYTES on the server")


class ApiKeyMiddleware:
    """Every HTTP request and WebSocket but `/health` must carry the key (see module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] != "/health" and not self._authorized(scope):
            if scope["type"] == "websocket":  # refused before the handshake: the client sees 403
                await send({"type": "websocket.close", "code": 1008})
                return
            await _send_error(send, UnauthorizedError("missing or wrong API key",
                                                      hint="send Authorization: Bearer <ENV_API_KEY>"),
                              [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        bearer = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        ok_bearer = hmac.compare_digest(bearer, self._key)  # both, always: timing says nothing
        ok_header = hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)
        return ok_bearer or ok_header


async def _send_error(send: Send, err: EnvError, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(extra_headers or [])]})
    await send({"type": "http.response.body", "body": body})


# -- the app -------------------------------------------------------------------------------------
def build_app(config: ServerConfig | None = None) -> FastAPI:
    """The environment server's ASGI app for `config` (default: from environment variables)."""
    config = config or ServerConfig.from_env()
    make_env = functools.partial(TaskEnvironment, default_task=config.default_task)
    app = create_app(
        make_env, TextAction, TextObservation, env_name="sparsesync_env", state_cls=EpisodeState,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=config.max_sessions,
                                             session_timeout=config.idle_timeout_s),
        mode="simulation",
    )
    # OpenEnv's stateless HTTP episode routes give way to the session-aware ones below
    replaced = {("/reset", "POST"), ("/step", "POST"), ("/state", "GET")}
    app.router.routes[:] = [r for r in app.router.routes if not (
        isinstance(r, APIRoute) and any((r.path, m) in replaced for m in r.methods))]
    store = SessionStore(make_env, max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_s,
                         max_per_client=config.per_client_cap, replace_idle_s=config.replace_idle_s)
    clients = config.clients
    app.state.store = store
    app.state.config = config

    @app.post("/reset", response_model=SessionResetResponse, tags=["Environment Control"])
    async def reset(request: Request, req: SessionResetRequest = Body(default_factory=SessionResetRequest),
                    x_session_id: str | None = Header(default=None, alias=SESSION_HEADER)) -> dict[str, Any]:
        """Start an episode: in a new session, or in `session_id` if given. Returns the session id."""
        client = clients.of(request.client.host if request.client else "", request.headers.getlist("x-forwarded-for"))
        sid, obs = store.reset(session_id=req.session_id or x_session_id, seed=req.seed, task=req.task,
                               episode_id=req.episode_id, client=client)
        return _wire(obs, sid)

    @app.post("/step", response_model=SessionStepResponse, tags=["Environment Control"])
    async def step(request: SessionStepRequest,
                   x_session_id: str | None = Header(default=None, alias=SESSION_HEADER)) -> dict[str, Any]:
        """Act in the session's episode: `{"action": {"text": ...}, "session_id": ...}`."""
        sid = _session_id(request.session_id, x_session_id)
        try:
            action = TextAction.model_validate(request.action)
        except ValidationError as e:
            raise MalformedActionError(f"malformed action: {_describe(e.errors())}",
                                       hint='send {"action": {"text": "<your reply>"}}') from None
        return _wire(store.step(sid, action), sid)

    @app.get("/state", response_model=EpisodeState, tags=["State Management"])
    async def state(session_id: str | None = None,
                    x_session_id: str | None = Header(default=None, alias=SESSION_HEADER)) -> EpisodeState:
        """The episode state of a session (`?session_id=` or the X-Session-Id header)."""
        return store.state(_session_id(session_id, x_session_id))

    @app.delete("/sessions/{session_id}", tags=["Environment Control"])
    async def close_session(session_id: str) -> dict[str, str]:
        """Forget a session and free its slot."""
        store.close(session_id)
        return {"closed": session_id}

    @app.get("/sessions", tags=["Environment Info"])
    async def sessions() -> dict[str, float | int]:
        """How many HTTP sessions are live (holding a slot) and finished, and the limits."""
        return store.stats()

    @app.exception_handler(EnvError)
    async def _env_error(_: Request, exc: EnvError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = MalformedRequestError(f"malformed request: {_describe(list(exc.errors()))}",
                                   hint="see GET /schema and the /docs page for the request shapes")
        return JSONResponse(err.body(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405 ... in our shape
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        hint = "see GET /docs for the routes and their methods" if exc.status_code in (404, 405) else ""
        return JSONResponse({"detail": str(exc.detail), "error": code, "hint": hint}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug, not bad input
        log.exception("unexpected error")
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}", "error": "internal", "hint": ""},
                            status_code=500)

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # outermost: before the body is read
    return app
