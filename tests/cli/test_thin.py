"""The CLI and `transfer.py` are thin over the library (issue 49, item 3): read from the source.

Run-level operations live once, in the library: the newest trusted commit (`protocol.run.Run`),
fleet health (`protocol.fleet.fleet_report`), log rows (`protocol.history`), push's rewind plan
(`protocol.writer.rewind.plan_push`), commit metrics typed (`protocol.records.CommitMetrics`).
These checks fail when a copy of any of them comes back into the CLI or `transfer.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIN = sorted((ROOT / "sparsesync" / "cli").glob("*.py")) + [ROOT / "sparsesync" / "transfer.py"]

# what reading commits, fencing, lineage and heartbeats takes: the library's, never the CLI's
COMMIT_PARSING = {"valid_commits", "parse_commit_key", "commit_key", "COMMITS", "abandoned_by_rewinds", "read_at_most",
                  "CommitRecord", "MAX_COMMIT_BYTES", "Lineage", "read_fleet", "Heartbeat", "checkpoint_digest"}
LIBRARY_MODULES = {"sparsesync.protocol.lineage", "sparsesync.protocol.records.commit"}  # (keys: by name above)
# the fleet health rules' own words (protocol/fleet.py); the CLI prints the report's `problems`
HEALTH_RULES = ("live replica(s), fewer than", "(max lag", "is degraded:", "of an abandoned attempt",
                "is not a commit record, every reader refuses it", "next attempt in")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("path", THIN, ids=lambda p: p.name)
def test_no_commit_parsing_of_its_own(path: Path) -> None:
    bad = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module in LIBRARY_MODULES:
                bad.append(f"line {node.lineno}: from {node.module} import ...")
            bad += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in COMMIT_PARSING]
        elif isinstance(node, ast.Attribute) and node.attr in COMMIT_PARSING:
            bad.append(f"line {node.lineno}: uses .{node.attr}")
    assert not bad, f"{path.relative_to(ROOT)} reads commits itself; use sparsesync.protocol.run.Run: {bad}"


@pytest.mark.parametrize("path", THIN, ids=lambda p: p.name)
def test_commit_metrics_are_read_typed(path: Path) -> None:
    """No `m.get("kind")` or `m["kind"]`: `CommitMetrics.of(m).kind` (a `CommitKind` literal) instead."""
    bad = []
    for node in ast.walk(_tree(path)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"):
            bad.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "kind":
            bad.append(node.lineno)
    assert not bad, f"{path.relative_to(ROOT)} reads a commit's kind untyped at lines {bad}"


def test_status_renders_the_library_fleet_report() -> None:
    """`sparsesync status` calls `fleet_report` and keeps none of its rules: every problem line
    and every field it prints come from the `FleetReport`."""
    path = ROOT / "sparsesync" / "cli" / "status.py"
    tree = _tree(path)
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("sparsesync.protocol.fleet", "fleet_report") in imported
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    texts += [v.value for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values
              if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    assert not [(rule, t) for rule in HEALTH_RULES for t in texts if rule in t]
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    renderers = {"status", "_title", "_table", "_str", "_safe"}
    assert defined <= renderers, defined - renderers
