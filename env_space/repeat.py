"""`repeat`: a one-step task a tiny randomly initialised byte-level model learns with GRPO on a CPU.

The observation is the prompt `Repeat the letter x:` with x drawn by the seed from LETTERS; the
action is the model's completion text; the episode ends after that one step.

Reward (exactly checkable, a pure function of target and completion):

    window = completion[:WINDOW]                        # first 16 characters, or all if shorter
    reward = count(c == target for c in window) / len(window)     # 0.0 when completion == ""

No stripping and no case folding: a leading space or an upper-case letter counts as a miss, so
the optimum (1.0) is exactly `target * k` for any k >= 1 (only the first 16 characters count).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LETTERS = "abcde"  # the small set a target letter is drawn from
WINDOW = 16  # only the first WINDOW characters of a completion are scored


def target_for_seed(seed: int) -> str:
    return LETTERS[random.Random(seed).randrange(len(LETTERS))]


def prompt_for(letter: str) -> str:
    return f"Repeat the letter {letter}:"


def reward(completion: str, target: str) -> float:
    """Fraction of the first WINDOW characters of `completion` equal to `target` (0.0 if empty)."""
    window = completion[:WINDOW]
    if not window:
        return 0.0
    return sum(1 for c in window if c == target) / len(window)


@dataclass
class RepeatGame:
    """One single-step episode."""

    target: str
    completion: str | None = None  # set by the one step

    @classmethod
    def from_seed(cls, seed: int) -> RepeatGame:
        return cls(target=target_for_seed(seed))

    @property
    def done(self) -> bool:
        return self.completion is not None

    def prompt(self) -> str:
        return prompt_for(self.target)

    def play(self, text: str) -> float:
        if self.done:
            raise RuntimeError("the episode is over")  # guarded by the environment with a 409
        self.completion = text
        return reward(text, self.target)
