"""The `sparsesync` CLI as a user reads it: its help, and its output in a file or a pipe.

Every command runs as a user runs it, in a subprocess (`python -m sparsesync.cli`, stdout and
stderr pipes): `--version`; each command's help names its arguments as the usage line shows
them, shows flags without a value type, reflows its paragraphs, cross-references `push --step`
and `pull --version`, and says what its exit statuses mean; push/log/inspect/status write rows
with no trailing spaces, no progress lines and nothing on stderr, and `status`' title keeps a
long run URL on one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsesync import __version__

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [
    "push",
    "pull",
    "log",
    "inspect",
    "verify",
    "gc",
    "demo",
    "follow",
    "status",
    "deploy env",
    "deploy inference",
]


def _cli(*args: str, columns: int | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "SPARSESYNC_DEBUG")}
    env["PYTHONPATH"] = str(ROOT)
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-c", "from sparsesync.cli import main; main()", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_version():
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout == f"sparsesync {__version__}\n" and res.stderr == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_help_reads_as_the_command_is_used(command):
    res = _cli(*command.split(), "--help", columns=400)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert "{" not in usage, usage  # positional arguments by name
    for arg in re.findall(r"\[OPTIONS\] (.*)", usage)[0].split():
        assert arg == arg.upper(), usage
    assert "<bool>" not in text, text  # a flag takes no value
    assert "Exit status: 0 " in text and "1 an error" in text, text


def test_help_paragraphs_wrap_at_the_terminal_not_at_the_source():
    text = _cli("push", "--help", columns=400).stdout
    assert ("The version is the checkpoint's optimizer step (see --step). The folder's config, generation config and "
            "tokenizer files travel with it") in text


def test_help_cross_references_and_what_gc_keeps():
    push = " ".join(_cli("push", "--help", columns=400).stdout.split())
    pull = " ".join(_cli("pull", "--help", columns=400).stdout.split())
    assert "`pull --version`" in push and "`push --step`" in pull
    gc = " ".join(_cli("gc", "--help", columns=400).stdout.split())
    assert "Kept: the newest committed version" in gc and "--keep-anchors" in gc
    status = " ".join(_cli("status", "--help", columns=400).stdout.split())
    assert "3 the fleet is not healthy" in status


def test_flags_take_their_negative_form(tmp_path):
    res = _cli("gc", str(tmp_path / "none"), "--no-dry-run", "--json")
    assert "No such option" not in res.stderr


def test_output_in_a_pipe_has_no_padding_progress_or_broken_titles(tiny, tmp_path):
    # a run under a long folder name: the status title is longer than 80 columns
    run = tmp_path / ("a-run-folder-whose-name-is-long-" * 3) / "run-1"
    outs = []
    for step in (0, 1):
        res = _cli("push", str(tiny), str(run), "--step", str(step))
        assert res.returncode == 0 and res.stderr == "", (res.stdout, res.stderr)  # no spinner, no lone newline
        outs.append(res.stdout)
    delta = next(p for p in (run / "deltas").rglob("*.safetensors"))
    for args, code in ((["log", str(run)], 0), (["inspect", str(run), "--version", "1"], 0),
                       (["status", str(run)], 3), (["verify", str(run)], 0), (["gc", str(run), "--dry-run"], 0),
                       (["inspect", str(delta)], 0)):
        res = _cli(*args)
        assert res.returncode == code and res.stderr == "", (args, res.stdout, res.stderr)
        outs.append(res.stdout)
        lines = res.stdout.splitlines()
        assert lines and lines[0].strip() and lines[-1].strip(), (args, res.stdout)
        assert [line for line in lines if line != line.rstrip()] == [], (args, res.stdout)
    status_title = outs[4].splitlines()[0]
    assert status_title.startswith(f"{run}: newest version 1") and status_title.endswith("0 live replica(s)"), outs[4]
