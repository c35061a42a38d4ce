"""`TaskEnvironment`: the OpenEnv `Environment` that plays one episode of a task at a time.

Guarantees:
- One instance holds one episode; instances share no mutable state, so any number of them can
  run side by side (`SUPPORTS_CONCURRENT_SESSIONS = True`): OpenEnv's `/ws` gives each
  connection its own instance, the HTTP session store (sessions.py) holds one per session id.
- `reset(seed=s, task=t)` is reproducible: the same (task, seed) gives the same episode. With no
  seed the instance draws one and reports it in the observation, so any episode can be replayed.
- Stepping before a reset or after the episode ended raises `EpisodeFinishedError` (409), never
  a silent new episode.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from env_space import TASKS, repeat, wordle
from env_space.errors import EnvError, EpisodeFinishedError, UnknownTaskError
from env_space.models import EpisodeState, TextAction, TextObservation

MAX_SEED = 2**63 - 1


def check_task(task: str) -> str:
    if task not in TASKS:
        raise UnknownTaskError(f"unknown task {task!r}", hint=f"use one of: {', '.join(TASKS)}")
    return task


class TaskEnvironment(Environment[TextAction, TextObservation, EpisodeState]):
    """Wordle or `repeat`, chosen per reset (default: the server's ENV_TASK)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, default_task: str = "wordle") -> None:
        super().__init__()
        self.default_task = check_task(default_task)
        self.session_id: str | None = None  # set by the HTTP session store; None over /ws
        self._game: wordle.WordleGame | repeat.RepeatGame | None = None
        self._state = EpisodeState()
        self._feedback: list[str] = []

    # -- OpenEnv API ----------------------------------------------------------------------
    def reset(self, seed: int | None = None, episode_id: str | None = None,
              task: str | None = None, **kwargs: Any) -> TextObservation:
        self.check_reset(seed, task)
        task = task or self.default_task
        if seed is None:
            seed = secrets.randbelow(2**31)
        self._game = wordle.WordleGame.from_seed(seed) if task == "wordle" else repeat.RepeatGame.from_seed(seed)
        self._feedback = []
        self._state = EpisodeState(episode_id=episode_id or uuid.uuid4().hex, step_count=0, task=task,
                                   seed=seed, done=False, total_reward=0.0, session_id=self.session_id)
        return self._observation(reward=None, message="new episode")

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        game = self._game
        if game is None:
            raise EpisodeFinishedError("no episode to act in", hint="call reset first")
        if game.done:
            raise EpisodeFinishedError(
                f"episode {self._state.episode_id} has ended after {self._state.step_count} steps",
                hint="call reset for a new episode")
        if isinstance(game, wordle.WordleGame):
            turn = game.guess(action.text)
            reward = turn.reward
            if turn.feedback is None:
                message = f"invalid guess {turn.guess!r}: not a five-letter word from the word list"
                self._feedback.append(f"{turn.guess}: invalid")
            else:
                message = "solved" if game.won else f"feedback {turn.feedback}"
                self._feedback.append(f"{turn.guess}: {turn.feedback}")
        else:
            reward = game.play(action.text)
            message = f"scored {reward:.4f}"
        self._state.step_count += 1
        self._state.total_reward += reward
        self._state.done = game.done
        return self._observation(reward=reward, message=message)

    def check_reset(self, seed: int | None = None, task: str | None = None) -> None:
        """Raise what `reset(seed=seed, task=task)` would raise for these arguments, changing nothing."""
        check_task(task or self.default_task)
        if seed is not None and not 0 <= seed <= MAX_SEED:
            raise EnvError(f"seed {seed} out of range", hint=f"send 0 <= seed <= {MAX_SEED}")

    @property
    def state(self) -> EpisodeState:
        return self._state.model_copy()

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="sparsesync-env",
            description="Wordle (6 guesses, shaped reward) and `repeat` (a one-step task a tiny model "
                        "learns on a CPU); OpenEnv HTTP + WebSocket contract with HTTP session ids.",
            version="0.1.0",
        )

    # -- helpers --------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._game is None or self._game.done

    def _observation(self, *, reward: float | None, message: str) -> TextObservation:
        game = self._game
        assert game is not None  # internal invariant: only called after reset
        max_turns = game.max_guesses if isinstance(game, wordle.WordleGame) else 1
        return TextObservation(
            prompt=game.prompt(), task=self._state.task, seed=self._state.seed,
            turn=self._state.step_count, max_turns=max_turns, feedback=list(self._feedback),
            message=message, session_id=self.session_id, reward=reward, done=game.done,
        )
