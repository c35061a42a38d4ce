"""Greedy generation, the way the engine tests compare two engines: the token ids and logprobs of
every prompt of `tests.support.model_steps.PROMPTS`, sampled greedily (temperature 0)."""

from __future__ import annotations

from inference_space.engines import Engine, SamplingParams
from tests.support.model_steps import PROMPTS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def greedy(engine: Engine, params: SamplingParams = GREEDY) -> list[tuple[list[int], list[float]]]:
    """(token ids, logprobs) of each completion `engine` generates for each of PROMPTS with `params`."""
    return [(c.token_ids, c.logprobs) for p in PROMPTS for c in engine.generate(p, params)]
