"""The one-command local run (`sparsesync demo`, trainer/demo.py), end to end on this machine.

Real processes: the env server, two embedded-engine replicas following a local bucket folder,
and the trainer; nothing is stood in for. Short configurations keep CI to about two minutes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("openenv")

from sparsesync.cli import app  # noqa: E402
from trainer.demo import DemoOptions, run_demo  # noqa: E402
from trainer.metrics import read_jsonl, step_records  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_local_run_learns_within_the_staleness_bound_and_ends_bit_exact(tmp_path: Path) -> None:
    opts = DemoOptions(steps=100, lr=2e-3, workdir=tmp_path, progress=False, min_reward_gain=0.2, max_staleness=4)
    report = run_demo(opts)  # raises DemoCheckError when any check fails
    assert report.ok, report.checks
    # the reward rose
    assert report.reward_end - report.reward_start >= 0.2
    # staleness stayed within the bound for every trained sample
    assert all(s["staleness_max"] <= opts.max_staleness for s in report.steps)
    # every replica serves the final version, and the bucket rebuilds the trainer's exact weights
    assert report.final_version == opts.steps
    assert all(
        st["current_version"] == report.final_version == st["serving_version"] for st in report.replicas.values()
    )
    assert report.checks["bit_exact"]["ok"] and report.checks["replica_outputs"]["ok"]
    # weights moved only through sparse patches much smaller than the model
    deltas = [c for c in report.commits if c.get("patch_bytes")]
    assert len(deltas) == opts.steps
    assert sum(c["patch_bytes"] for c in deltas) < 0.6 * len(deltas) * report.full_bytes
    # per-step metrics went to the JSONL file, with the commit events
    records = step_records(report.metrics_path)
    assert [r["step"] for r in records] == list(range(1, opts.steps + 1))
    assert {"reward", "staleness_max", "sync_bytes", "density", "lag/0", "lag/1", "samples_per_s"} <= set(records[-1])
    assert sum(1 for r in read_jsonl(report.metrics_path) if r.get("event") == "commit") == opts.steps + 1
    assert (tmp_path / "report.json").is_file()


def _children_of(out: str) -> list[int]:
    m = re.search(r"env server \(pid (\d+)\) and \d+ \w+ replicas \(pids ([\d, ]+)\)", out)
    assert m, out
    return [int(m.group(1))] + [int(p) for p in m.group(2).split(",")]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_ctrl_c_stops_every_process_it_started(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from sparsesync.cli import main; main()", "demo", "--workdir", str(tmp_path),
         "--steps", "500", "--no-progress"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    out = ""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 180
        while "training 500 steps" not in out:  # every child is up and healthy
            line = proc.stdout.readline()
            assert line or proc.poll() is None, out
            out += line
            assert time.monotonic() < deadline, out
        pids = _children_of(out)
        assert not any(_gone(p) for p in pids)
        time.sleep(2)  # mid-training
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        out += rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    if "still stopping" in out:  # the exit deadline had to end a stuck cleanup: the guarantee held, say where it stuck
        warnings.warn(f"the demo's cleanup overran its deadline after Ctrl-C:\n{out[-6000:]}", stacklevel=1)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), f"left running: {[p for p in pids if not _gone(p)]}"


_STUCK_CLEANUP = """
import sys, threading, time
from pathlib import Path
from trainer.processes import ProcessSet
with ProcessSet(Path(sys.argv[1]), exit_deadline_s=2.0) as procs:
    child = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(1000)"])
    try:
        print(child.pid, flush=True)  # inside the try: the test's Ctrl-C may land while it prints
        time.sleep(1000)
    finally:
        threading.Event().wait()  # a cleanup that never finishes (a stuck request, a lost wake-up)
"""


def test_ctrl_c_exits_by_the_deadline_even_when_cleanup_is_stuck(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_CLEANUP, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert not _gone(child)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert 1.5 <= took < 20, took  # not before the deadline, not much after it
    assert "still stopping 2 s after the interrupt" in err and "threading.py" in err, err  # says so, with the stacks
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)


@pytest.mark.slow
def test_a_failed_check_exits_non_zero(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path), "--steps", "3", "--replicas", "1",
                                      "--min-reward-gain", "5", "--no-progress"])
    assert result.exit_code == 1
    assert "FAIL reward_rose" in result.output and "PASS bit_exact" in result.output


def test_demo_cli_help_and_bad_engine() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--help"])
    assert result.exit_code == 0 and "bucket folder" in result.output
    result = runner.invoke(app, ["demo", "--engine", "tpu"])
    assert result.exit_code == 2
