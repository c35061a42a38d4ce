"""scripts/gpu_check.sh cannot rot: its --dry-run runs here, on CPU, end to end.

The dry run checks the carried wheels (if .whl/ is there) install for CPython 3.12 manylinux
without network, builds the codec in place, collects every gpu-marked test (each skips, naming
why) and runs benchmarks/gpu_bench.py in its --tiny CPU mode; every step must pass and every
result file must be there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and [s["step"] for s in summary["steps"]] == [
        "prereqs",
        "install",
        "build",
        "env",
        "tests",
        "bench",
    ]
    assert all(s["rc"] == 0 for s in summary["steps"]), summary
    assert {"log", "env.json", "pytest.xml", "gpu_bench.json", "summary.json", "results.json"} <= {
        p.name for p in out.iterdir()
    }
    # the one raw record: the commit, the command, the bench whole and the raw pytest output
    rec = json.loads((out / "results.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert rec["commit"] == head and rec["command"] == "bash scripts/gpu_check.sh --dry-run"
    assert rec["gpu_bench"] == json.loads((out / "gpu_bench.json").read_text())
    assert rec["pytest_junit_xml"] == (out / "pytest.xml").read_text() and "skipped" in rec["pytest_output"]
    assert rec["per_shape"] and all(v["publish_stall_over_trl"] > 0 for v in rec["per_shape"].values())
    # the named fields, read off the bench (the digest checked against the C codec's)
    assert rec["digest_GBps"] > 0 and rec["gpu_bench"]["digest"]["digest_matches_cpu"] is True
    assert rec["replica_pause_ms"] > 0 and rec["replica_host_model_copies"] > 0
    suite = ET.parse(out / "pytest.xml").getroot().find("testsuite")
    assert (
        suite is not None
        and int(suite.get("tests", 0)) >= 20
        and int(suite.get("failures", 0)) == int(suite.get("errors", 0)) == 0
    )
    skipped = [c for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert len(skipped) == int(suite.get("tests", 0)), "on CPU every gpu test skips"
    assert all("CUDA" in (c.find("skipped").get("message") or "") for c in skipped), "each skip names its reason"
    bench = json.loads((out / "gpu_bench.json").read_text())
    row = bench["rows"][0]
    assert row["apply_bit_exact"] and row["snapshot_bit_exact"] and 0.005 < row["density"] < 0.05
    assert bench["pause"]["replica_bit_exact"] and bench["pause"]["replica_pause_ms"] > 0
    assert "python" in json.loads((out / "env.json").read_text())
    assert (out / "log").read_text().count("=== [") >= 10  # every step's start and end, logged


def test_gpu_check_names_a_missing_prerequisite_and_stops(tmp_path):
    """A machine without a C compiler (here: CC names none) stops at step 0 with one MISSING line."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "CC": "/nonexistent/cc"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "MISSING: a C compiler (/nonexistent/cc" in r.stdout and "=== [install]" not in r.stdout
