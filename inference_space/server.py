"""The replica's HTTP API: OpenAI-compatible completions that carry what an RL trainer needs.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /sync.
What TRL's vLLM clients send is understood: a batch of prompts (choices prompt-major),
`return_token_ids`, `return_tokens_as_token_ids` (logprobs.tokens as "token_id:N"),
`top_logprobs` 0; chat requests get the model's own chat template (a `chat_template`, template
kwargs or tools are refused with 400) and a top-level `prompt_token_ids`. Every choice carries `prompt_token_ids`, `token_ids`, `logprobs.token_logprobs` (log p of each
sampled token under the weights that produced it, raw distribution) and `weight_version` (the
version that produced every token of it; null before the first bucket version). Malformed
requests get 422 (schema: types, unknown fields) or 400 (values the engine refuses: seeds
beyond 63 bits, temperatures or top_p too small to compute with, lone surrogates in text,
OpenAI fields this replica does not implement set to a non-neutral value, top-N logprobs) with
a message naming the field, in one shape: {"error": {"message", "type"}}. top_k, min_p and
repetition_penalty are honoured by both engines; /v1/models reports max_model_len;
nothing a client sends can stop the follower. Generation runs in FastAPI's thread pool, so
/health and /sync answer while a batch runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from inference_space.engines import Completion, SamplingParams
from inference_space.replica import Replica
from sparsesync.errors import ConfigError, EngineError


# OpenAI fields this replica does not implement: accepted only at their neutral value
_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "best_of": None,
    "echo": False, "stream": False, "suffix": None, "stream_options": None,
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not know is an error, never ignored

    model: str | None = None
    max_tokens: int = Field(16, ge=1, le=1 << 20)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=256)
    seed: int | None = None
    logprobs: int | bool | None = None  # the sampled tokens' logprobs are always returned (no top-N)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    top_k: int = Field(0, ge=-1, description="-1 or 0: no limit")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    user: str | None = None  # informational
    return_token_ids: bool | None = None  # vLLM's flag (TRL sends it): token ids are always returned
    return_tokens_as_token_ids: bool = False  # logprobs.tokens as vLLM's "token_id:N" strings (TRL's VLLMClient)
    top_logprobs: int | None = Field(None, ge=0)  # only 0: the sampled token's logprob
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool | None = None
    stream: bool | None = None
    suffix: str | None = None
    stream_options: dict[str, Any] | None = None

    def params(self) -> SamplingParams:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral and not (name == "logit_bias" and value == {}) and not (name == "best_of" and value == self.n):
                raise ConfigError(f"{name}={value!r}: not supported by this replica", hint=f"leave {name} out")
        if self.logprobs is not None and not isinstance(self.logprobs, bool) and self.logprobs > 1:
            raise ConfigError(f"logprobs={self.logprobs}: only the sampled token's logprob is returned", hint="send logprobs 0 or 1")
        if self.top_logprobs:
            raise ConfigError(f"top_logprobs={self.top_logprobs}: only the sampled token's logprob is returned", hint="send top_logprobs 0")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stop:
            _check_text("stop", s)
        return SamplingParams(
            self.max_tokens, self.temperature, self.top_p, self.n, self.seed, stop, self.ignore_eos,
            top_k=max(self.top_k, 0), min_p=self.min_p, repetition_penalty=self.repetition_penalty,
        )


def _check_text(field: str, text: str) -> None:
    """Text must be valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{field}: lone surrogate {text[e.start]!r} at position {e.start}", hint="send valid UTF-16 surrogate pairs") from e


MAX_BATCH = 256  # prompts x n in one request


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, prompt token ids, or a batch of either (choices prompt-major)")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        batch = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
        prompts: list[str | list[int]] = list(p) if batch else [p]  # type: ignore[arg-type]
        if len(prompts) * self.n > MAX_BATCH:
            raise ConfigError(f"{len(prompts)} prompts x n={self.n}: more than {MAX_BATCH} completions in one request",
                              hint="split the batch")
        return prompts


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    chat_template: str | None = None  # only the model's own template is applied
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None

    def check_template(self) -> None:
        """Fields of vLLM's chat API this replica does not implement: refused unless neutral."""
        if self.chat_template is not None:
            raise ConfigError("chat_template: the replica applies the model's own chat template", hint="leave chat_template out")
        if self.chat_template_kwargs:
            raise ConfigError(f"chat_template_kwargs={self.chat_template_kwargs!r}: not supported by this replica",
                              hint="leave chat_template_kwargs out")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ConfigError("tools / tool_choice: not supported by this replica", hint="send tools null and tool_choice 'none'")


def _choice(c: Completion, req: _Sampling) -> dict[str, Any]:
    tokens: list[Any] = [f"token_id:{t}" for t in c.token_ids] if req.return_tokens_as_token_ids else c.token_ids
    return {
        "index": c.index,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "prompt_token_ids": c.prompt_token_ids,
        "token_ids": c.token_ids,
        "logprobs": {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": [None] * len(c.token_ids)},
        "weight_version": c.weight_version,
    }


def _usage(outs: list[Completion], n: int = 1) -> dict[str, int]:
    prompt = sum(len(c.prompt_token_ids) for c in outs[::n])
    completion = sum(len(c.token_ids) for c in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _version_of(outs: list[Completion]) -> int | None:
    versions = {c.weight_version for c in outs}
    return versions.pop() if len(versions) == 1 else None


def create_app(replica: Replica, *, manage_lifecycle: bool = True) -> FastAPI:
    """The FastAPI app serving `replica`; starts its follower on startup when `manage_lifecycle`."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if manage_lifecycle:
            replica.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                replica.stop()

    app = FastAPI(title="sparsesync inference replica", lifespan=lifespan)
    app.state.replica = replica

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in exc.errors()]
        return JSONResponse(status_code=422, content={"error": {"message": "; ".join(problems), "type": "invalid_request_error"}})

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # a bug: same error shape, logged
        import logging

        logging.getLogger(__name__).exception("unexpected error serving %s", request.url.path)
        return JSONResponse(status_code=500, content={"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error"}})

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": {"message": exc.detail, "type": "invalid_request_error"}})

    def _run(prompt: str | list[int], req: _Sampling) -> list[Completion]:
        try:
            if isinstance(prompt, str):
                _check_text("prompt", prompt)
            return replica.engine.generate(prompt, req.params())
        except ConfigError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        except EngineError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        try:
            prompts = req.prompts()
        except ConfigError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        outs = [c for p in prompts for c in _run(p, req)]
        choices = [_choice(c, req) for c in outs]
        for i, ch in enumerate(choices):  # prompt-major across the batch
            ch["index"] = i
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": replica.model_name,
            "weight_version": _version_of(outs),
            "choices": choices,
            "usage": _usage(outs, req.n),
        }

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> dict[str, Any]:
        try:
            for i, m in enumerate(req.messages):
                _check_text(f"messages[{i}].content", m.content)
            req.check_template()
        except ConfigError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        try:
            ids = replica.engine.apply_chat_template([m.model_dump() for m in req.messages])
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise HTTPException(status_code=400, detail=f"cannot apply the chat template: {e}") from e
        outs = _run(ids, req)
        choices = []
        for c in outs:
            ch = _choice(c, req)
            ch["message"] = {"role": "assistant", "content": ch.pop("text")}
            choices.append(ch)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": replica.model_name,
            "weight_version": _version_of(outs),
            "prompt_token_ids": ids,
            "choices": choices,
            "usage": _usage(outs, req.n),
        }

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": replica.model_name, "object": "model", "owned_by": "sparsesync",
                    "weight_version": replica.weight_version, "max_model_len": replica.engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    def health() -> dict[str, Any]:
        st = replica.status()
        return {"status": "ok", "engine": st["engine"], "weight_version": st["serving_version"], "state": st["state"]}

    @app.get("/sync")
    def sync() -> dict[str, Any]:
        return replica.status()

    return app
