"""Repo-wide layout rule (issue 41): no module of the shipped packages (`sparsesync/`, `trainer/`,
`inference_space/`, `env_space/`) is over `MAX_LINES` lines unless its docstring says why, in a
line that starts with `Length:` followed by the reason (e.g. "Length: one state machine whose
states share every field; split, each half would reach into the other's"). docs/architecture.md
states the rule; this test holds it in CI.

"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sparsesync", "trainer", "inference_space", "env_space")
MAX_LINES = 450
MARKER = "Length:"
MIN_REASON_CHARS = 20  # "Length: long" is not a reason

def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _reason(path: Path) -> str | None:
    """The text after `Length:` on a line of the module's docstring, or None."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) or ""
    for line in doc.splitlines():
        if line.strip().startswith(MARKER):
            return line.strip().removeprefix(MARKER).strip()
    return None


def _too_long(path: Path) -> str | None:
    """Why `path` breaks the rule, or None."""
    n = len(path.read_text(encoding="utf-8").splitlines())
    if n <= MAX_LINES:
        return None
    reason = _reason(path)
    if reason is None:
        return f"{n} lines, no `{MARKER}` line in its docstring"
    if len(reason) < MIN_REASON_CHARS:
        return f"{n} lines, and `{MARKER} {reason}` states no reason"
    return None


def test_modules_are_short_or_say_why() -> None:
    bad = {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if (why := _too_long(path)) is not None:
            bad[rel] = why
    assert not bad, (
        f"modules over {MAX_LINES} lines (split them along a concept seam, or state the reason in the module "
        f"docstring on a line starting `{MARKER}`; docs/architecture.md):\n"
        + "\n".join(f"  {k}: {v}" for k, v in sorted(bad.items()))
    )


def test_the_rule_sees_a_long_module_and_its_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * MAX_LINES
    plain = tmp_path / "plain.py"
    plain.write_text('"""A module."""\n' + body)
    assert _too_long(plain) is not None
    vague = tmp_path / "vague.py"
    vague.write_text('"""A module.\n\nLength: long\n"""\n' + body)
    assert _too_long(vague) is not None
    stated = tmp_path / "stated.py"
    stated.write_text('"""A module.\n\nLength: one state machine; each half would reach into the other.\n"""\n' + body)
    assert _too_long(stated) is None
    short = tmp_path / "short.py"
    short.write_text('"""A module."""\n' + "x = 1\n" * (MAX_LINES - 1))
    assert _too_long(short) is None
