"""Repo-wide static checks, part of the README's test command (so of CI): `ruff check .` (the rules
of pyproject.toml's `[tool.ruff]`), `lint-imports` (the contracts of `[tool.importlinter]`: the
layers errors < codec < store < protocol < transfer < integrations < apps < cli, the library
below the apps never importing them, no import cycles) and `mypy` (the types of `sparsesync/`,
`[tool.mypy]`: any error fails, and so does a `type: ignore` that hides nothing or names no error
code). Each runs as a subprocess from the repository root, exactly as a developer would, and fails
with the tool's own output.

What remains of issue 41 (the exceptions the config still grants; delete each once it is gone):
- after the last branches merge, `ruff check --fix .` for the import order they bring.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    """The tool installed beside this Python (the project's venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it is in requirements/lock.txt (bash scripts/setup.sh installs it)")
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing() -> None:
    res = _run(_tool("ruff"), "check", "--no-cache", "--output-format", "concise", ".")
    assert res.returncode == 0, (
        "ruff check . (`ruff check --fix .` fixes what it marks [*]):\n" + res.stdout + res.stderr
    )


def test_import_contracts_hold() -> None:
    """The `ignore_imports` of the "acyclic" contract are what remains of issue 41's cycles: once an
    edge is gone, lint-imports fails on its now unmatched line until it is deleted."""
    res = _run(_tool("lint-imports"), "--no-logo", "--no-cache")
    assert res.returncode == 0, (
        "lint-imports (the contracts are [tool.importlinter] in pyproject.toml):\n" + res.stdout + res.stderr
    )


def test_types_check() -> None:
    """mypy over sparsesync/ (`[tool.mypy]` in pyproject.toml). Its cache (.mypy_cache) makes a
    rerun take seconds; a cold run about a minute of CPU."""
    res = _run(_tool("mypy"))
    assert res.returncode == 0, "mypy (the settings are [tool.mypy] in pyproject.toml):\n" + res.stdout + res.stderr
