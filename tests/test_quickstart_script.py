"""`bash scripts/quickstart.sh` as the README prints it: each version's kind once per line, and
its temporary bucket removed at the end (the line saying so names it).

Runs the script from a copy of `scripts/` beside a `.venv` link to this interpreter's
environment (the layout `scripts/setup.sh` makes), with this checkout first on PYTHONPATH and
TMPDIR pointing at the test's folder, so what the script leaves behind is visible.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_prints_each_kind_once_and_removes_its_bucket(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", repo / "scripts")
    (repo / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    res = subprocess.run(["bash", str(repo / "scripts" / "quickstart.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 5, res.stdout
    for line in steps:
        kinds = re.findall(r"\b(anchor|delta)\b", line)
        assert len(kinds) == 1, line  # the version's kind, once
    assert "5/5 versions verified" in res.stdout
    assert list(tmp.iterdir()) == [], "the temporary bucket was left behind"
    assert re.search(rf"removed the temporary bucket {re.escape(str(tmp))}/sparsesync-bucket-\w+", res.stdout), (
        res.stdout
    )
