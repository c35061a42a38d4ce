"""env_space: the RL environment server of a disaggregated sparsesync run, deployable as a Space.

Tasks: Wordle (`wordle.py`) and `repeat` (`repeat.py`); the OpenEnv environment
(`environment.py`); HTTP sessions (`sessions.py`); the app (`server.py`); the client a trainer
uses (`client.py`, needs only httpx); `python -m env_space` serves it (`__main__.py`).

Importing this package imports nothing heavy: the server modules load OpenEnv/FastAPI only
when imported themselves.
"""

from __future__ import annotations

__all__ = ["TASKS"]

TASKS: tuple[str, ...] = ("wordle", "repeat")
