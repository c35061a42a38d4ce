"""The replica's HTTP API: OpenAI-compatible completions that carry what an RL trainer needs.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health, GET /sync. The wire format (request schemas, vLLM's response and stream shapes,
OpenAI-shaped logprobs, the `weight_version` / token-id extras) lives in `openai_api.py`; the
official `openai` SDK works unmodified (`stream=True` included). What TRL's vLLM clients send is
understood: a batch of prompts (choices prompt-major), `return_token_ids`,
`return_tokens_as_token_ids`, `top_logprobs` 0; chat requests get the model's own chat template
(a `chat_template`, template kwargs or tools are refused with 400). Every choice carries
`weight_version`: the version that produced every token of it (null before the first bucket
version). A `model` other than the served name (or the `--model` folder or Hub id, the name
vLLM would serve it under) is a 404, as on vLLM.

Refusals, in one shape, vLLM's {"error": {"message", "type", "param", "code"}} (`param`: the
request field at fault, or null): 401 without the API key (when one is set; /health stays open),
413 for a body over the cap (`guard.py`, before parsing), 404 / 405 for a route or method that
does not exist, 422 (schema: types, unknown fields), 400 (values the engine refuses: seeds beyond
63 bits, temperatures or top_p too small to compute with, lone surrogates, OpenAI fields this
replica does not implement set to a non-neutral value, more than 20 top logprobs, `max_tokens`
beyond the model's context, more than 64 stop strings or 4096 stop characters, more than 256
completions), 503 once the server is stopping. A request's batch is cut (finish reason "abort")
past the engine's `request_timeout_s`, or when a committed version has waited `max_hold_s` for it
(see `engines.base`). Generation runs in FastAPI's thread pool; /health, /sync and /v1/models are
async routes on the event loop that never wait for the engine's gate, so they answer at once
however many generations are blocked; nothing a client sends can stop the follower.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_space.engines import Completion
from inference_space.guard import DEFAULT_MAX_BODY_BYTES, Guard, error_body
from inference_space.openai_api import ChatRequest, CompletionRequest, Shaper, _Sampling, check_text
from inference_space.replica import Replica
from sparsesync.errors import ConfigError, EngineError

__all__ = ["ChatRequest", "CompletionRequest", "create_app"]


def create_app(replica: Replica, *, manage_lifecycle: bool = True, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `replica`; starts its follower on startup when `manage_lifecycle`.
    With `api_key`, every route but /health needs `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="sparsesync inference replica", lifespan=_lifespan(replica, manage_lifecycle))
    app.state.replica = replica
    _add_error_handlers(app)
    _add_generation_routes(app, _Generation(replica))
    _add_info_routes(app, replica)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


def _lifespan(replica: Replica, manage_lifecycle: bool) -> Any:
    """Start the replica's follower with the app and stop it after (when `manage_lifecycle`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            replica.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                replica.stop()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in vLLM's one error shape (see module docstring), a bug's 500 included."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        where = [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in exc.errors()]
        problems = [f"{w}: {e.get('msg')}" for w, e in zip(where, exc.errors(), strict=True)]
        return JSONResponse(status_code=422, content=error_body("; ".join(problems), "invalid_request_error", 422,
                                                                where[0] if where else None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # a bug: same error shape, logged
        logging.getLogger(__name__).exception("unexpected error serving %s", request.url.path)
        return JSONResponse(
            status_code=500, content=error_body(f"internal error: {type(exc).__name__}", "server_error", 500)
        )

    @app.exception_handler(StarletteHTTPException)  # ours, and the router's 404 / 405 for routes that do not exist
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowed", 503: "ServiceUnavailable"}.get(
            exc.status_code, "invalid_request_error"
        )
        return JSONResponse(status_code=exc.status_code, headers=exc.headers,
                            content=error_body(str(exc.detail), kind, exc.status_code, getattr(exc, "param", None)))


def _served_names(replica: Replica) -> set[str]:
    """The served name, and what vLLM would call this model: the --model folder (or Hub id) as given."""
    return {replica.model_name, str(replica.engine.model_dir), *replica.model_aliases}


class _Generation:
    """What the generation routes share: the request checks, the engine call and the response shaping."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.names = _served_names(replica)
        self.tok = replica.engine.tokenizer  # type: ignore[attr-defined]
        self.no_text = frozenset(getattr(self.tok, "all_special_ids", ()))  # what the completion text skips

    def bad(self, e: Exception) -> HTTPException:
        if self.replica.engine.stopping:
            return HTTPException(status_code=503, detail="the replica is shutting down")
        err = HTTPException(status_code=400, detail=str(e))
        err.param = getattr(e, "param", None)  # type: ignore[attr-defined]
        return err

    def check_model(self, req: _Sampling) -> None:
        if req.model is not None and req.model not in self.names:
            raise HTTPException(status_code=404, detail=f"The model `{req.model}` does not exist.")

    def max_tokens(self, wanted: int | None, default: int) -> int:
        limit = self.replica.engine.max_model_len
        if wanted is not None and wanted > limit:
            raise ConfigError(f"max_tokens={wanted}: more than the model's context of {limit} tokens",
                              hint=f"send max_tokens <= {limit}")
        return default if wanted is None else wanted

    def run(self, prompt: str | list[int], req: _Sampling, max_tokens: int) -> list[Completion]:
        try:
            if isinstance(prompt, str):
                check_text("prompt", prompt)
            return self.replica.engine.generate(prompt, req.params(max_tokens))
        except (ConfigError, EngineError) as e:
            raise self.bad(e) from e

    def shaper(self, req: _Sampling, top_n: int) -> Shaper:
        tok = self.tok
        return Shaper(lambda ids, skip: tok.decode(ids, skip_special_tokens=skip), self.replica.model_name,
                      req.return_tokens_as_token_ids, top_n, no_text=self.no_text)


def _stream(lines: Any) -> StreamingResponse:
    return StreamingResponse(lines, media_type="text/event-stream")


def _add_generation_routes(app: FastAPI, gen: _Generation) -> None:
    """POST /v1/completions and /v1/chat/completions (FastAPI's thread pool: they wait for the engine)."""

    @app.post("/v1/completions", response_model=None)
    def completions(req: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        gen.check_model(req)
        try:
            prompts = req.prompts()
            max_tokens = gen.max_tokens(req.max_tokens, 16)  # OpenAI's default for completions
            top_n = req.params(max_tokens).logprobs  # refuse bad fields before any generation
        except ConfigError as e:
            raise gen.bad(e) from e
        outs = [c for p in prompts for c in gen.run(p, req, max_tokens)]
        shaper = gen.shaper(req, top_n)
        if req.stream:
            return _stream(
                shaper.completion_stream(outs, req.n, bool(req.stream_options and req.stream_options.include_usage))
            )
        return shaper.completion(outs, req.n)

    @app.post("/v1/chat/completions", response_model=None)
    def chat(req: ChatRequest) -> dict[str, Any] | StreamingResponse:
        gen.check_model(req)
        try:
            req.check_template()
            gen.max_tokens(req.wanted_tokens(), 0)
            top_n = req.params(1).logprobs
        except ConfigError as e:
            raise gen.bad(e) from e
        try:
            ids = gen.replica.engine.apply_chat_template([m.template_dict() for m in req.messages])
        except Exception as e:  # template errors are the request's fault
            raise HTTPException(status_code=400, detail=f"cannot apply the chat template: {e}") from e
        # no max_tokens: the rest of the context (as OpenAI and vLLM)
        room = gen.replica.engine.max_model_len - len(ids)
        outs = gen.run(ids, req, req.wanted_tokens() or max(room, 1))
        shaper = gen.shaper(req, top_n)
        if req.stream:
            return _stream(
                shaper.chat_stream(outs, req.n, bool(req.stream_options and req.stream_options.include_usage))
            )
        return shaper.chat(outs, req.n, ids)


def _add_info_routes(app: FastAPI, replica: Replica) -> None:
    """GET /v1/models, /v1/models/{id}, /health and /sync: async, on the event loop, never queued
    behind generations in the thread pool."""
    names = _served_names(replica)

    def _model_card() -> dict[str, Any]:
        return {
            "id": replica.model_name,
            "object": "model",
            "created": int(replica.started_at),
            "owned_by": "sparsesync",
            "root": replica.model_name,
            "parent": None,
            "weight_version": replica.weight_version,
            "max_model_len": replica.engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in names:
            raise HTTPException(status_code=404, detail=f"The model `{model_id}` does not exist.")
        return _model_card()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        st = replica.status()
        digest = st.get("state_digest") if st.get("current_version") == st["serving_version"] else None
        return {"status": "ok", "engine": st["engine"], "weight_version": st["serving_version"], "state": st["state"],
                "state_digest": digest}  # the version's identity: a number may be re-committed after a rewind

    @app.get("/sync")
    async def sync() -> dict[str, Any]:
        return replica.status()
