"""The OpenAI wire format of the replica: request schemas, response and stream shapes (as vLLM's).

Requests (`CompletionRequest`, `ChatRequest`) are strict pydantic models: a field this replica
does not know is a 422, a known OpenAI field it does not implement is accepted only at its
neutral value (400 otherwise, naming it as the error's `param`, in vLLM's error shape):
`response_format` {"type": "text"}, `store` false, `service_tier` "auto" or "default",
`presence_penalty` / `frequency_penalty` 0, `echo` false, `logit_bias` {}, `suffix` "", `best_of`
n; `metadata` and `parallel_tool_calls` (no tools are ever called) take any value. Top logprobs:
0 to 20 per token (`logprobs` on completions, `top_logprobs` on chat), as vLLM's default. Chat takes string or text
content-part messages and the `developer` role (sent to the chat template as `system`, as OpenAI treats it), and
`max_completion_tokens` (the SDK's current name for `max_tokens`).

Responses follow vLLM's OpenAI server field by field; the extras an RL trainer needs ride along:
`weight_version` and `state_digest` (top level and per choice: the version that produced the
completion and its commit's state digest, read together under the engine's gate, so a sample of a
version a rewind abandoned is told from the new commit of that number), `prompt_token_ids`, `token_ids`. Logprobs are in
OpenAI's shape: completions `{tokens (strings), token_logprobs, top_logprobs, text_offset}`,
chat `{content: [{token, logprob, bytes, top_logprobs}]}`; `return_tokens_as_token_ids` makes
every token string vLLM's "token_id:N".

Streams (`stream: true`) are Server-Sent Events of vLLM's chunk objects ending in `[DONE]`.
A completion is generated whole under the engine's gate, then streamed, so the in-flight policy
is unchanged (one weight version per completion) and the concatenated stream deltas are exactly
the non-streamed text, token ids and logprobs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inference_space.engines import Completion, SamplingParams
from inference_space.errors import RequestFieldError

MAX_BATCH = 256  # prompts x n in one request
MAX_STOP = 64  # stop strings in one request (OpenAI allows 4; each costs a search per decoded token)
MAX_STOP_CHARS = 4096  # their total length
MAX_PENDING = 16  # streaming: tokens without new text before the natural pieces end (a character is at most 4 bytes)
LOGPROB_FLOOR = -9999.0  # what vLLM sends for -inf (JSON has no infinity)

MAX_LOGPROBS = 20  # top logprobs per token at most (vLLM's default `max_logprobs`)

# OpenAI fields this replica does not implement: accepted only at their neutral values (None: left out)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": ({},), "echo": (False,), "suffix": ("",),
    "response_format": ({"type": "text"},), "store": (False,), "service_tier": ("auto", "default"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False  # a last chunk with no choices and the usage
    continuous_usage_stats: bool | None = False  # vLLM's flag; accepted, usage comes at the end only


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field we do not know is an error, never ignored

    model: str | None = None  # must be the served name (404 otherwise); None: the served model
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=256)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    top_k: int = Field(0, ge=-1, description="-1 or 0: no limit")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    user: str | None = None  # informational
    return_token_ids: bool | None = None  # vLLM's flag (TRL sends it): token ids are always returned
    return_tokens_as_token_ids: bool = False  # logprob tokens as vLLM's "token_id:N" strings (TRL's VLLMClient)
    top_logprobs: int | None = Field(None, ge=0)  # chat: the most likely tokens per position, 0 to 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool | None = None
    stream: bool | None = False
    suffix: str | None = None
    stream_options: StreamOptions | None = None
    # OpenAI fields with no effect on a completion at their neutral values (as vLLM accepts them)
    response_format: dict[str, Any] | None = None  # {"type": "text"}: plain text (structured output is refused)
    store: bool | None = None  # False: nothing is stored (this replica stores nothing)
    metadata: dict[str, str] | None = Field(None, max_length=16)  # informational, like `user`
    service_tier: str | None = None  # "auto" / "default": the one tier there is
    parallel_tool_calls: bool | None = None  # no tools are called, so any value is neutral

    def _top_n(self) -> int:
        raise NotImplementedError

    def params(self, max_tokens: int) -> SamplingParams:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise RequestFieldError(
                    name, f"{name}={value!r}: not supported by this replica", hint=f"leave {name} out"
                )
        if self.best_of is not None and self.best_of != self.n:
            raise RequestFieldError(
                "best_of", f"best_of={self.best_of!r}: not supported by this replica", hint="leave best_of out"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP or sum(len(s) for s in stop) > MAX_STOP_CHARS:
            raise RequestFieldError(
                "stop",
                f"stop: {len(stop)} strings of {sum(len(s) for s in stop)} characters, more than "
                f"{MAX_STOP} strings or {MAX_STOP_CHARS} characters",
                hint="send fewer, shorter stop strings",
            )
        for s in stop:
            check_text("stop", s)
        return SamplingParams(
            max_tokens, self.temperature, self.top_p, self.n, self.seed, stop, self.ignore_eos,
            top_k=max(self.top_k, 0), min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            logprobs=self._top_n(),
        )


def check_text(field: str, text: str) -> None:
    """Text must be valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestFieldError(
            field.split("[")[0],
            f"{field}: lone surrogate {text[e.start]!r} at position {e.start}",
            hint="send valid UTF-16 surrogate pairs",
        ) from e


def _top_n_checked(field: str, n: int) -> int:
    if n > MAX_LOGPROBS:
        raise RequestFieldError(
            field,
            f"{field}={n}: more than the {MAX_LOGPROBS} top logprobs per token this replica returns",
            hint=f"send {field} 0 to {MAX_LOGPROBS}",
        )
    return n


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, prompt token ids, or a batch of either (choices prompt-major)")
    # top logprobs per token, 0 to 20 (the sampled token's are always returned)
    logprobs: int | bool | None = Field(None, ge=0)

    def _top_n(self) -> int:
        if self.top_logprobs:
            raise RequestFieldError("top_logprobs", f"top_logprobs={self.top_logprobs}: a chat field",
                                    hint=f"send logprobs 0 to {MAX_LOGPROBS} for completions")
        return _top_n_checked("logprobs", int(self.logprobs or 0))

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        batch = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
        prompts: list[str | list[int]] = list(p) if batch else [p]  # type: ignore[arg-type]
        if len(prompts) * self.n > MAX_BATCH:
            raise RequestFieldError(
                "prompt",
                f"{len(prompts)} prompts x n={self.n}: more than {MAX_BATCH} completions in one request",
                hint="split the batch",
            )
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines (as vLLM
        does), `developer` as `system`."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool | None = False  # the sampled tokens' logprobs are always returned
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)  # the SDK's name for max_tokens
    chat_template: str | None = None  # only the model's own template is applied
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None

    def _top_n(self) -> int:
        return _top_n_checked("top_logprobs", int(self.top_logprobs or 0))

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_template(self) -> None:
        """Fields of vLLM's chat API this replica does not implement: refused unless neutral."""
        if self.chat_template is not None:
            raise RequestFieldError(
                "chat_template",
                "chat_template: the replica applies the model's own chat template",
                hint="leave chat_template out",
            )
        if self.chat_template_kwargs:
            raise RequestFieldError(
                "chat_template_kwargs",
                f"chat_template_kwargs={self.chat_template_kwargs!r}: not supported by this replica",
                hint="leave chat_template_kwargs out",
            )
        if self.tools or self.tool_choice not in (None, "none"):
            raise RequestFieldError(
                "tools",
                "tools / tool_choice: not supported by this replica",
                hint="send tools null and tool_choice 'none'",
            )
        for i, m in enumerate(self.messages):
            check_text(f"messages[{i}].content", m.template_dict()["content"])


# -- responses --------------------------------------------------------------------------------
class Shaper:
    """Turns engine completions into OpenAI objects for one request (token strings decoded once)."""

    def __init__(self, decode: Callable[[list[int], bool], str], model: str, as_ids: bool, top_n: int,
                 no_text: frozenset[int] = frozenset()) -> None:
        self._raw = decode  # (ids, skip_special_tokens) -> text
        self.no_text = no_text  # token ids the completion text skips (the tokenizer's special tokens)
        self._decode = lambda ids: decode(ids, True)  # the completion text skips special tokens
        self.model = model
        self.as_ids = as_ids
        self.top_n = top_n
        self.created = int(time.time())

    def token(self, t: int) -> str:
        return f"token_id:{t}" if self.as_ids else self._raw([t], False)  # as vLLM: special tokens spelled out

    def completion_logprobs(self, c: Completion, lo: int = 0, hi: int | None = None, offset: int = 0) -> dict[str, Any]:
        ids = c.token_ids[lo:hi]
        tokens = [self.token(t) for t in ids]
        offsets, top = [], []
        for i, (t, s) in enumerate(zip(ids, tokens, strict=True)):
            offsets.append(offset)
            offset += len(s)
            entry = {s: max(c.logprobs[lo + i], LOGPROB_FLOOR)}  # the sampled token first, as vLLM
            for b, lp in (c.top_logprobs[lo + i] if c.top_logprobs else {}).items():
                entry.setdefault(self.token(b), max(lp, LOGPROB_FLOOR))
            top.append(entry)
        return {"text_offset": offsets, "token_logprobs": [max(x, LOGPROB_FLOOR) for x in c.logprobs[lo:hi]],
                "tokens": tokens, "top_logprobs": top}

    def chat_logprobs(self, c: Completion, lo: int = 0, hi: int | None = None) -> dict[str, Any]:
        content = []
        for i, t in enumerate(c.token_ids[lo:hi]):
            s = self.token(t)
            tops = (c.top_logprobs[lo + i] if c.top_logprobs and self.top_n else {}).items()
            content.append({"token": s, "logprob": max(c.logprobs[lo + i], LOGPROB_FLOOR), "bytes": _bytes(s),
                             "top_logprobs": [{"token": (b_s := self.token(b)), "logprob": max(lp, LOGPROB_FLOOR),
                                               "bytes": _bytes(b_s)} for b, lp in tops]})
        return {"content": content}

    def completion(self, outs: list[Completion], n: int) -> dict[str, Any]:
        choices = [{
            "index": i, "text": c.text, "logprobs": self.completion_logprobs(c), "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "prompt_token_ids": c.prompt_token_ids, "token_ids": c.token_ids,
            "weight_version": c.weight_version, "state_digest": c.state_digest,
        } for i, c in enumerate(outs)]  # prompt-major across the batch
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "weight_version": version_of(outs),
            "state_digest": digest_of(outs),
            "choices": choices,
            "usage": usage(outs, n),
        }

    def chat(self, outs: list[Completion], n: int, prompt_ids: list[int]) -> dict[str, Any]:
        choices = [{
            "index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": self.chat_logprobs(c),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "prompt_token_ids": c.prompt_token_ids,
            "token_ids": c.token_ids, "weight_version": c.weight_version, "state_digest": c.state_digest,
        } for i, c in enumerate(outs)]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "weight_version": version_of(outs),
            "state_digest": digest_of(outs),
            "prompt_token_ids": prompt_ids,
            "choices": choices,
            "usage": usage(outs, n),
        }

    # -- streams ------------------------------------------------------------------------------
    def completion_stream(self, outs: list[Completion], n: int, include_usage: bool) -> Iterator[str]:
        rid, version = f"cmpl-{uuid.uuid4().hex}", version_of(outs)
        head = {"id": rid, "object": "text_completion", "created": self.created, "model": self.model,
                "weight_version": version, "state_digest": digest_of(outs)}
        for i, c in enumerate(outs):
            segments = self.segments(c)
            offset = 0
            for k, (text, lo, hi) in enumerate(segments):
                last = k == len(segments) - 1
                choice = {
                    "index": i,
                    "text": text,
                    "logprobs": self.completion_logprobs(c, lo, hi, offset),
                    "finish_reason": c.finish_reason if last else None,
                    "stop_reason": c.stop_reason if last else None,
                    "token_ids": c.token_ids[lo:hi],
                    "weight_version": c.weight_version,
                    "state_digest": c.state_digest,
                }
                if k == 0:
                    choice["prompt_token_ids"] = c.prompt_token_ids
                offset += sum(len(s) for s in choice["logprobs"]["tokens"])
                yield _sse({**head, "choices": [choice]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage(outs, n)})
        yield "data: [DONE]\n\n"

    def chat_stream(self, outs: list[Completion], n: int, include_usage: bool) -> Iterator[str]:
        rid, version = f"chatcmpl-{uuid.uuid4().hex}", version_of(outs)
        head = {"id": rid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "weight_version": version, "state_digest": digest_of(outs)}
        for i, c in enumerate(outs):
            first = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": c.prompt_token_ids,
                "token_ids": [],
                "weight_version": c.weight_version,
                "state_digest": c.state_digest,
            }
            yield _sse({**head, "choices": [first]})
            segments = self.segments(c)
            for k, (text, lo, hi) in enumerate(segments):
                last = k == len(segments) - 1
                yield _sse(
                    {
                        **head,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"content": text},
                                "logprobs": self.chat_logprobs(c, lo, hi),
                                "finish_reason": c.finish_reason if last else None,
                                "stop_reason": c.stop_reason if last else None,
                                "token_ids": c.token_ids[lo:hi],
                                "weight_version": c.weight_version,
                                "state_digest": c.state_digest,
                            }
                        ],
                    }
                )
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage(outs, n)})
        yield "data: [DONE]\n\n"

    def segments(self, c: Completion) -> list[tuple[str, int, int]]:
        """(text delta, first token, end token) pieces of `c`, as incremental detokenization
        emits them (no half characters); the deltas concatenate to exactly `c.text`, the token
        ranges to exactly `c.token_ids`. Linear in the tokens: tokens that add no text (special
        tokens, which the text skips) never enter the decode window, and a window that yields no
        new text for `MAX_PENDING` tokens ends the natural pieces (the rest is one last piece)."""
        ids, final = c.token_ids, c.text
        out: list[tuple[str, int, int]] = []
        window: list[int] = []  # text-bearing ids since the previous boundary: the decode context
        read = 0  # window[:read] is the context, already emitted
        prefix_text = ""
        start = emitted = match = 0
        for i, t in enumerate(ids):
            if t in self.no_text:
                continue
            window.append(t)
            new_text = self._decode(window)
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                if len(window) - read > MAX_PENDING:
                    break  # no natural boundary ahead: the rest goes out as one piece
                continue
            agreed = True
            for ch in new_text[len(prefix_text):]:  # how far the natural text still agrees with the final one
                if match >= len(final) or final[match] != ch:
                    agreed = False
                    break
                match += 1
            if match > emitted:
                out.append((final[emitted:match], start, i + 1))
                emitted, start = match, i + 1
            if not agreed:
                break  # diverged (a stop string cut the text): the rest is one last piece
            window = window[read:]
            read = len(window)
            prefix_text = self._decode(window)
        if start < len(ids) or emitted < len(final) or not out:
            out.append((final[emitted:], start, len(ids)))
        return out


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(outs: list[Completion], n: int = 1) -> dict[str, int]:
    prompt = sum(len(c.prompt_token_ids) for c in outs[::n])
    completion = sum(len(c.token_ids) for c in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def digest_of(outs: list[Completion]) -> str | None:
    """The state digest all of `outs` were produced by (None: mixed, or not known)."""
    digests = {c.state_digest for c in outs}
    return digests.pop() if len(digests) == 1 else None


def version_of(outs: list[Completion]) -> int | None:
    versions = {c.weight_version for c in outs}
    return versions.pop() if len(versions) == 1 else None
