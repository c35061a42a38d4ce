"""Wordle: guess a secret five-letter word in at most six tries, with per-letter feedback.

Guarantees:
- `feedback(guess, answer)` follows the game's rule for repeated letters exactly: greens are
  assigned first, then each remaining guess letter (left to right) is yellow only while the
  answer still has an unmatched copy of it; a letter is never counted twice.
- An episode is a pure function of its seed and the guesses sent: the answer is
  `answers[random.Random(seed).randrange(len(answers))]`.
- Every episode ends after a win or after `max_guesses` turns, invalid guesses included, so an
  agent that never produces a valid word still terminates.

Reward of one turn (documented in env_space/README.md too):
- valid guess:   (greens + 0.5 * yellows) / 5, plus WIN_BONUS (1.0) when the guess is the answer
- invalid guess: INVALID_PENALTY (-0.1); the turn is used up
A guess is the action text with surrounding whitespace and quotes/brackets/periods stripped,
lower-cased; it is valid when it is five ASCII letters and in `allowed.txt`.

Word lists ship in env_space/words/ (see NOTICE.md there); nothing is downloaded at run time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

WORD_LENGTH = 5
MAX_GUESSES = 6
WIN_BONUS = 1.0
INVALID_PENALTY = -0.1
GREEN, YELLOW, GRAY = "G", "Y", "-"  # one character per letter of a guess

_STRIP = " \t\r\n\"'`.,!?[](){}<>*"


@lru_cache(maxsize=1)
def answers() -> tuple[str, ...]:
    """The secret words, sorted (the seed indexes into this order, so keep it stable)."""
    return _load("answers.txt")


@lru_cache(maxsize=1)
def allowed() -> frozenset[str]:
    """Every word a guess may be (a superset of `answers()`)."""
    return frozenset(_load("allowed.txt")) | frozenset(answers())


def _load(name: str) -> tuple[str, ...]:
    text = resources.files("env_space").joinpath("words", name).read_text(encoding="ascii")
    words = tuple(sorted({w.strip() for w in text.splitlines() if w.strip()}))
    bad = [w for w in words if len(w) != WORD_LENGTH or not (w.isascii() and w.isalpha() and w.islower())]
    if bad:
        raise ValueError(f"word list {name!r}: {len(bad)} entries are not five lowercase letters, e.g. {bad[0]!r}")
    return words


def feedback(guess: str, answer: str) -> str:
    """Per-letter feedback of `guess` against `answer`: 'G' right place, 'Y' elsewhere, '-' absent.

    Repeated letters: greens first; then a letter is yellow only while unmatched copies remain
    in the answer: guess 'speed' vs answer 'abide' gives '--Y-Y' (the first 'e' is yellow, the
    second gray: 'abide' has one 'e').
    """
    if len(guess) != len(answer):
        raise ValueError(f"guess {guess!r} and answer {answer!r} differ in length")
    result = [GRAY] * len(guess)
    unmatched: dict[str, int] = {}
    for i, (g, a) in enumerate(zip(guess, answer)):
        if g == a:
            result[i] = GREEN
        else:
            unmatched[a] = unmatched.get(a, 0) + 1
    for i, g in enumerate(guess):
        if result[i] != GREEN and unmatched.get(g, 0) > 0:
            result[i] = YELLOW
            unmatched[g] -= 1
    return "".join(result)


def parse_guess(text: str) -> str:
    """The guess an action text stands for (may be invalid; see `is_valid_guess`)."""
    return text.strip(_STRIP).lower()


def is_valid_guess(word: str) -> bool:
    return len(word) == WORD_LENGTH and word.isascii() and word.isalpha() and word in allowed()


def turn_reward(fb: str | None, won: bool) -> float:
    """Reward of one turn: `fb` is the feedback string, or None for an invalid guess."""
    if fb is None:
        return INVALID_PENALTY
    score = (fb.count(GREEN) + 0.5 * fb.count(YELLOW)) / WORD_LENGTH
    return score + (WIN_BONUS if won else 0.0)


@dataclass
class Turn:
    """One guess and what came back."""

    guess: str  # the parsed guess (as sent, lower-cased)
    feedback: str | None  # None when the guess was invalid
    reward: float


@dataclass
class WordleGame:
    """One episode of Wordle. Not thread-safe: the session store serializes access."""

    answer: str
    max_guesses: int = MAX_GUESSES
    turns: list[Turn] = field(default_factory=list)
    won: bool = False

    @classmethod
    def from_seed(cls, seed: int, max_guesses: int = MAX_GUESSES) -> WordleGame:
        words = answers()
        return cls(answer=words[random.Random(seed).randrange(len(words))], max_guesses=max_guesses)

    @property
    def done(self) -> bool:
        return self.won or len(self.turns) >= self.max_guesses

    def prompt(self) -> str:
        """What the agent sees: the rules, every turn so far, and the guesses left."""
        lines = [
            f"Wordle: guess the secret {WORD_LENGTH}-letter English word in {self.max_guesses} tries. "
            f"Reply with one word. Feedback per letter: {GREEN}=right place, {YELLOW}=in the word "
            f"elsewhere, {GRAY}=not in the word."
        ]
        for t in self.turns:
            lines.append(f"{t.guess}: {t.feedback}" if t.feedback is not None else f"{t.guess!r}: invalid guess")
        left = self.max_guesses - len(self.turns)
        lines.append(f"{left} guesses left. Your guess:" if not self.done else
                     ("Solved." if self.won else f"Out of guesses; the word was {self.answer}."))
        return "\n".join(lines)

    def guess(self, text: str) -> Turn:
        """Play one turn; the caller makes sure the game is not over."""
        if self.done:
            raise RuntimeError("the game is over")  # guarded by the environment with a 409
        word = parse_guess(text)
        if not is_valid_guess(word):
            turn = Turn(guess=word[:32], feedback=None, reward=INVALID_PENALTY)
        else:
            fb = feedback(word, self.answer)
            self.won = word == self.answer
            turn = Turn(guess=word, feedback=fb, reward=turn_reward(fb, self.won))
        self.turns.append(turn)
        return turn
