"""The OpenEnv wire types of this environment (pydantic): one text action, one observation.

Guarantee: these are subclasses of OpenEnv's `Action`, `Observation` and `State`, so `/schema`,
the WebSocket protocol and OpenEnv/TRL clients see ordinary OpenEnv types; unknown action
fields are rejected (OpenEnv's `extra="forbid"`).
"""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class TextAction(Action):
    """What the agent sends each step: free text (a Wordle guess, a completion)."""

    text: str = Field(description="The agent's reply: a Wordle guess, or a model completion for `repeat`.")


class TextObservation(Observation):
    """What the agent sees. `reward` and `done` travel beside it on the wire (OpenEnv format)."""

    prompt: str = Field(default="", description="The text to show the model next.")
    task: str = Field(default="", description="Task of this episode: 'wordle' or 'repeat'.")
    seed: int = Field(default=0, description="Seed of this episode (the server draws one when none was sent).")
    turn: int = Field(default=0, description="Steps taken so far in this episode.")
    max_turns: int = Field(default=1, description="Steps after which the episode ends at the latest.")
    feedback: list[str] = Field(default_factory=list, description="Wordle: one 'guess: feedback' line per turn.")
    message: str = Field(default="", description="What the last step did, in words.")
    session_id: str | None = Field(default=None, description="HTTP session of this episode (None over /ws).")


class EpisodeState(State):
    """`GET /state`: the episode's bookkeeping (never the Wordle answer while the game is on)."""

    task: str = ""
    seed: int = 0
    done: bool = False
    total_reward: float = 0.0
    session_id: str | None = None
