"""What one request asks of an engine and what it gets back: `SamplingParams` (OpenAI completion
fields, validated before any engine sees them) and `Completion` (token ids, the logprobs of the
sampled tokens, the finish reason and the weight version and state digest that produced every
token).

Guarantee: `SamplingParams.validate()` refuses, with `ConfigError` naming the field and its bounds,
every value an engine could not honour exactly (temperatures that overflow the logits, top_p
below `MIN_TOP_P` or above 1, more than `MAX_LOGPROBS` logprobs, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from sparsesync.errors import ConfigError

FinishReason = Literal["stop", "length", "abort"]  # abort: cut by the hold or time bound
MIN_TEMPERATURE = 1e-3  # below this, logits / temperature overflows; use 0 for greedy
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20  # top logprobs per position at most (vLLM's default max_logprobs)


@dataclass
class SamplingParams:
    """How to sample one request (OpenAI completion fields)."""

    max_tokens: int = 16  # completion tokens at most
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling mass, (0, 1]
    n: int = 1  # completions per prompt
    seed: int | None = None  # makes sampling reproducible on one engine and version
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    ignore_eos: bool = False  # keep generating past the end-of-sequence token
    top_k: int = 0  # sample among the k most likely tokens (0: all)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0: off)
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (1: off)
    logprobs: int = 0  # the most likely tokens' logprobs per position besides the sampled one's: 0 to MAX_LOGPROBS

    def validate(self) -> None:
        if not 1 <= self.max_tokens <= 1 << 20:
            raise ConfigError(f"max_tokens={self.max_tokens}: must be >= 1")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):
            raise ConfigError(f"temperature={self.temperature}: must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100]")
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p}: must be in [{MIN_TOP_P}, 1]")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ConfigError(f"seed={self.seed}: must be in [0, 2**63)")
        if not 0 <= self.top_k <= 1 << 20:
            raise ConfigError(f"top_k={self.top_k}: must be >= 0 (0: no limit)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p={self.min_p}: must be in [0, 1]")
        if not 0.01 <= self.repetition_penalty <= 100.0:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty}: must be in [0.01, 100] (1: off)")
        if not 1 <= self.n <= 256:
            raise ConfigError(f"n={self.n}: must be in [1, 256]")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs={self.logprobs}: must be in [0, {MAX_LOGPROBS}] top logprobs per token")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop={self.stop!r}: stop strings must be non-empty strings")


@dataclass
class Completion:
    """One completion and everything an RL trainer needs from it."""

    index: int
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token_ids[i]) under the weights of `weight_version`
    finish_reason: FinishReason
    weight_version: int | None  # None: the weights from --model, before any bucket version
    # as vLLM: the stop string (or token id) that ended it; for an "abort", why: "weight_update" | "request_timeout" |
    # "shutdown"
    stop_reason: int | str | None = None
    # per token, the `logprobs` most likely tokens' logprobs, most likely first
    top_logprobs: list[dict[int, float]] | None = None
    state_digest: str | None = None  # the commit's state digest of `weight_version` (read with it, under the gate)
