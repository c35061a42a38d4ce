"""The `sparsesync` CLI: push/pull/log/inspect/verify/gc on real files and stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from sparsesync.cli import app
from tests.weights import assert_bit_equal, make_state, train_step

runner = CliRunner()


def _invoke(*args: str) -> str:
    res = runner.invoke(app, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def _save_ckpt(state: dict[str, torch.Tensor], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    half = len(names) // 2  # two shards, like a saved HF checkpoint
    save_file({n: state[n] for n in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    return folder


def test_push_pull_log_inspect_verify_gc(store_url, tmp_path):
    g = torch.Generator().manual_seed(0)
    states = [make_state(0)]
    for _ in range(5):
        states.append(train_step(states[-1], g))
    for i, s in enumerate(states, start=1):
        out = _invoke("push", str(_save_ckpt(s, tmp_path / f"ckpt{i}")), store_url, "--anchor-every", "3")
        assert f"pushed version {i}" in out
    # weights that return to an earlier value are just another delta (here also an anchor: 7 = 4 + 3)
    m = json.loads(_invoke("push", str(_save_ckpt(states[0], tmp_path / "again")), store_url,
                           "--anchor-every", "3", "--json", "--effort", "speed"))
    assert m["version"] == 7 and m["kind"] == "delta+anchor"

    rows = [json.loads(line) for line in _invoke("log", store_url, "--json").splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert rows[0]["kind"] == "anchor" and rows[1]["kind"] == "delta"
    assert 0 < rows[1]["density"] < 0.05 and rows[1]["patch_bytes"] > 0
    assert "7 committed" in _invoke("log", store_url)

    # pull an older version into a folder and the newest into one file: bit-exact
    _invoke("pull", store_url, str(tmp_path / "v3"), "--version", "3")
    got = {}
    for f in sorted((tmp_path / "v3").glob("*.safetensors")):
        got.update(load_file(f))
    assert_bit_equal(got, states[2])
    _invoke("pull", store_url, str(tmp_path / "newest.safetensors"))
    assert_bit_equal(load_file(tmp_path / "newest.safetensors"), states[0])

    # inspect a delta by URL (header by range reads) and as a local file
    from sparsesync.protocol.run import Run

    rec = Run(store_url).commit(2)
    header = json.loads(_invoke("inspect", f"{store_url.rstrip('/')}/{rec.delta_objects()[0].key}", "--json"))
    assert header["base_version"] == 1 and header["target_version"] == 2
    local = tmp_path / "p.safetensors"
    local.write_bytes(Run(store_url).fetch(rec.delta_objects()[0]))
    assert "1 -> 2" in _invoke("inspect", str(local))

    assert "7/7 versions verified" in _invoke("verify", store_url)

    plan = json.loads(_invoke("gc", store_url, "--dry-run", "--json"))
    assert plan["dry_run"] and plan["old_commits"]
    assert [r["version"] for r in map(json.loads, _invoke("log", store_url, "--json").splitlines())] == list(range(1, 8))
    _invoke("gc", store_url)
    kept = [json.loads(line)["version"] for line in _invoke("log", store_url, "--json").splitlines()]
    assert kept[0] == plan["oldest_kept_version"] and kept[-1] == 7
    assert "versions verified" in _invoke("verify", store_url)
    _invoke("pull", store_url, str(tmp_path / "after-gc.safetensors"))
    assert_bit_equal(load_file(tmp_path / "after-gc.safetensors"), states[0])


def test_errors_are_one_clear_line_and_nonzero(tmp_path):
    """The real console script: a missing run prints `error:` + `fix:`, no traceback."""
    exe = Path(sys.executable).with_name("sparsesync")
    env = {**os.environ, "HF_TOKEN": "hf_secretsecretsecret123456"}
    env.pop("SPARSESYNC_DEBUG", None)
    res = subprocess.run([str(exe), "pull", str(tmp_path / "nothing-here"), str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1
    assert "error:" in res.stderr and "fix:" in res.stderr
    assert "Traceback" not in res.stderr
    assert "hf_secret" not in res.stderr + res.stdout
    res = subprocess.run([str(exe), "push", str(tmp_path / "missing.safetensors"), str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1 and "does not exist" in res.stderr
    res = subprocess.run([str(exe), "push", str(tmp_path / "missing.safetensors"), str(tmp_path / "run2"), "--effort", "fast"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1 and "effort='fast'" in res.stderr and "fix:" in res.stderr
    assert not (tmp_path / "run2").exists()  # refused before anything was created


def test_help_is_fast_and_light():
    """`sparsesync --help` must not import torch."""
    code = "import sys; from sparsesync.cli import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
