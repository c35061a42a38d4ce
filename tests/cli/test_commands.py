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
from tests.support.readme import readme_blocks
from tests.support.weights import assert_bit_equal, make_state, train_step

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
    for i, s in enumerate(states):  # folders that name no step: a new run starts at version 0
        out = _invoke("push", str(_save_ckpt(s, tmp_path / f"ckpt{i}")), store_url, "--anchor-every", "3")
        assert f"pushed version {i}" in out and ("a new run's first version" if i == 0 else "newest + 1") in out
    # weights that return to an earlier value are just another delta (here also an anchor: 6 = 3 + 3)
    m = json.loads(_invoke("push", str(_save_ckpt(states[0], tmp_path / "again")), store_url,
                           "--anchor-every", "3", "--json", "--effort", "speed"))
    assert m["version"] == 6 and m["kind"] == "delta+anchor"

    rows = [json.loads(line) for line in _invoke("log", store_url, "--json").splitlines()]
    assert [r["version"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert rows[0]["kind"] == "anchor" and rows[1]["kind"] == "delta"
    assert 0 < rows[1]["density"] < 0.05 and rows[1]["patch_bytes"] > 0
    assert "7 committed" in _invoke("log", store_url)

    # pull an older version into a folder and the newest into one file: bit-exact
    _invoke("pull", store_url, str(tmp_path / "v3"), "--version", "3")
    got = {}
    for f in sorted((tmp_path / "v3").glob("*.safetensors")):
        got.update(load_file(f))
    assert_bit_equal(got, states[3])
    _invoke("pull", store_url, str(tmp_path / "newest.safetensors"))
    assert_bit_equal(load_file(tmp_path / "newest.safetensors"), states[0])

    # inspect a delta by URL (header by range reads) and as a local file
    from sparsesync.protocol.run import Run

    rec = Run(store_url).commit(2)
    header = json.loads(_invoke("inspect", f"{store_url.rstrip('/')}/{rec.delta_objects()[0].key}", "--json"))
    assert header["base_version"] == 1 and header["target_version"] == 2
    assert json.loads(_invoke("inspect", store_url, "--version", "2", "--json")) == header  # by run URL and version
    local = tmp_path / "p.safetensors"
    local.write_bytes(Run(store_url).fetch(rec.delta_objects()[0]))
    assert "1 -> 2" in _invoke("inspect", str(local))

    assert "7/7 versions verified" in _invoke("verify", store_url)

    plan = json.loads(_invoke("gc", store_url, "--dry-run", "--json"))
    assert plan["dry_run"] and plan["old_commits"]
    assert [r["version"] for r in map(json.loads, _invoke("log", store_url, "--json").splitlines())] == list(range(7))
    _invoke("gc", store_url)
    kept = [json.loads(line)["version"] for line in _invoke("log", store_url, "--json").splitlines()]
    assert kept[0] == plan["oldest_kept_version"] and kept[-1] == 6
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
    res = subprocess.run(
        [str(exe), "push", str(tmp_path / "missing.safetensors"), str(tmp_path / "run2"), "--effort", "fast"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 1 and "effort='fast'" in res.stderr and "fix:" in res.stderr
    assert not (tmp_path / "run2").exists()  # refused before anything was created


def test_help_is_fast_and_light():
    """`sparsesync --help` must not import torch."""
    code = "import sys; from sparsesync.cli import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- a pulled folder loads as is; versions are the checkpoint's step; the README runs as printed --
URL = "hf://buckets/me/rl-weights/run-1"


def _fails(capsys, *args: str) -> str:  # type: ignore[no-untyped-def]
    """Run the CLI as the console script does (errors formatted in one place); it must fail with
    exit status 1 and one `error:` line. Returns stderr."""
    import pytest

    from sparsesync.cli._errors import run_guarded

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_guarded(lambda: app(list(args), standalone_mode=False))
    err = capsys.readouterr().err
    assert exc.value.code == 1 and [ln for ln in err.splitlines() if ln.startswith("error:")].__len__() == 1, err
    return err


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """checkpoint-100 (a tiny model as save_pretrained writes it, with its tokenizer) and
    checkpoint-101 (the same model one "optimizer step" later, saved the way transformers'
    Trainer saves a checkpoint: weights, config, tokenizer, trainer_state.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparsesync.tiny_model import build_tiny_model

    first = build_tiny_model(tmp_path / "checkpoint-100", seed=0, arch="qwen3-tied")
    model = AutoModelForCausalLM.from_pretrained(first)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01 * (torch.rand(p.shape, generator=g) < 0.05))
    second = tmp_path / "checkpoint-101"
    model.save_pretrained(second)
    AutoTokenizer.from_pretrained(first).save_pretrained(second)
    (second / "trainer_state.json").write_text(json.dumps({"global_step": 101, "log_history": []}))
    return first, second


def _assert_loads_as(dest: Path, source: Path) -> None:
    """`from_pretrained(dest)` is the model and tokenizer of `source`, bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    want, got = AutoModelForCausalLM.from_pretrained(source), AutoModelForCausalLM.from_pretrained(dest)
    assert type(got) is type(want)
    assert {**got.config.to_dict(), "_name_or_path": ""} == {**want.config.to_dict(), "_name_or_path": ""}
    assert_bit_equal(got.state_dict(), want.state_dict())
    ids = torch.tensor([[3, 14, 15, 92, 6, 5]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    tok_want, tok_got = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(dest)
    assert tok_got.chat_template == tok_want.chat_template and tok_got.chat_template
    assert tok_got("Repeat the letter x:")["input_ids"] == tok_want("Repeat the letter x:")["input_ids"]


def test_pulled_folder_loads_with_from_pretrained_and_versions_are_steps(tmp_path):
    first, second = _checkpoints(tmp_path)
    run = str(tmp_path / "run")
    out = _invoke("push", str(first), run)
    assert "pushed version 100 (anchor; version from the folder name checkpoint-100)" in out and "config.json" in out
    out = _invoke("push", str(second), run)
    assert "pushed version 101 (delta; version from trainer_state.json's global_step)" in out
    out = _invoke("push", str(second), run, "--step", "205")
    assert "pushed version 205 (" in out and "version from --step)" in out
    for version, source in ((100, first), (101, second)):
        dest = tmp_path / f"pulled-{version}"
        out = _invoke("pull", run, str(dest), "--version", str(version))
        assert f"pulled version {version}" in out and "tokenizer.json" in out
        assert {p.name for p in dest.iterdir()} == {"model.safetensors", "config.json", "generation_config.json",
                                                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
        for f in dest.iterdir():
            if f.suffix != ".safetensors":
                assert f.read_bytes() == (source / f.name).read_bytes(), f.name
        _assert_loads_as(dest, source)
    # into an existing folder: the run's files replace that folder's, other files stay
    (tmp_path / "pulled-100" / "config.json").write_text("{}")
    (tmp_path / "pulled-100" / "notes.txt").write_text("mine")
    _invoke("pull", run, str(tmp_path / "pulled-100"), "--version", "101")
    _assert_loads_as(tmp_path / "pulled-100", second)
    assert (tmp_path / "pulled-100" / "notes.txt").read_text() == "mine"
    assert "3/3 versions verified" in _invoke("verify", run)
    # a checkpoint of a step at or below the newest version that the run holds rewinds the run to it
    # (docs/protocol.md, "Rewinds"), with --rewind: version 205 is abandoned
    out = " ".join(_invoke("push", str(second), run, "--rewind").split())
    assert "pushed version 101 (rewind; version from trainer_state.json's global_step)" in out, out
    assert "versions [205] of the older attempt abandoned" in out, out
    from sparsesync.protocol.run import Run

    assert [c.version for c in Run(run).commits()] == [100, 101]


def test_hostile_checkpoint_files_are_refused_with_one_line(tmp_path, capsys, monkeypatch):
    from sparsesync.protocol import extras
    from sparsesync.protocol.keys import commit_key
    from sparsesync.protocol.run import Run
    from sparsesync.tiny_model import build_tiny_model

    src = build_tiny_model(tmp_path / "ckpt", seed=0)
    run, dest = tmp_path / "run", tmp_path / "dest"
    _invoke("push", str(src), str(run))
    rec = Run(str(run)).newest()
    assert rec is not None and rec.version == 0
    # a stored file whose bytes changed (same size): pull names it, and leaves DEST as it was
    ref = next(f for f in rec.files if f.name == "config.json")
    obj, original = run / ref.key, (run / ref.key).read_bytes()
    obj.write_bytes(original.replace(b'"qwen3"', b'"llama"'))
    err = _fails(capsys, "pull", str(run), str(dest))
    assert ref.key in err and "digest" in err and not dest.exists()
    obj.write_bytes(original)
    # a commit listing a name outside the allow-list, a path, code, or a file over the bound: not a commit
    commit = run / commit_key(rec.version, rec.epoch)
    raw = json.loads(commit.read_bytes())
    good = raw["files"][0]
    hostile = [
        (
            {"name": "../../../tmp/evil.json", "key": good["key"].rsplit("/", 1)[0] + "/../../../tmp/evil.json"},
            "not a checkpoint file name",
        ),
        (
            {"name": "modeling_evil.py", "key": good["key"].rsplit("/", 1)[0] + "/modeling_evil.py"},
            "not a checkpoint file name",
        ),
        ({"name": ".env", "key": good["key"].rsplit("/", 1)[0] + "/.env"}, "not a checkpoint file name"),
        ({"key": "anchors/../" + good["key"]}, "is not files/v"),
        ({"size": extras.MAX_FILE_BYTES + 1}, "size"),
    ]
    for bad, reason in hostile:
        commit.write_text(json.dumps({**raw, "files": [{**good, **bad}]}))
        err = _fails(capsys, "pull", str(run), str(dest))
        assert "not a commit record" in err and reason in err, err
        assert not dest.exists() and not (tmp_path / "tmp").exists()
    commit.write_text(json.dumps(raw))
    _invoke("pull", str(run), str(dest))
    # push: an allowed file over the bound, or a publisher given a name outside the allow-list
    monkeypatch.setattr(extras, "MAX_FILE_BYTES", 1000)
    err = _fails(capsys, "push", str(src), str(tmp_path / "run2"))
    assert "tokenizer.json" in err and "over the limit" in err
    assert not Run(str(tmp_path / "run2")).store.list("")  # nothing was written
    from sparsesync.errors import ConfigError
    from sparsesync.protocol.writer.publisher import Publisher

    with __import__("pytest").raises(ConfigError, match="'modeling.py' is not one sparsesync carries"):
        Publisher(str(tmp_path / "run3"), extra_files={"modeling.py": b"import os"})


def readme_using_it_block() -> str:
    blocks = [b for b in readme_blocks("Using it", "bash") if b.startswith("sparsesync push")]
    assert len(blocks) == 1, "the README's 'Using it' section has one bash block of push/pull commands"
    return blocks[0]


def test_readme_using_it_block_runs_as_printed(tmp_path, monkeypatch):
    """Every line of the block, as printed, with only the bucket URL swapped for a local folder;
    `status` exits 3 (its documented code: no replica serves the run)."""
    import shlex

    block = readme_using_it_block()
    monkeypatch.chdir(tmp_path)
    _, second = _checkpoints(tmp_path)
    bucket = str(tmp_path / "bucket")
    lines = [ln for ln in block.splitlines() if ln.strip()]
    assert all(URL in ln for ln in lines)
    outputs = {}
    for line in lines:
        argv = shlex.split(line.replace(URL, bucket), comments=True)
        assert argv[0] == "sparsesync", line
        res = runner.invoke(app, argv[1:])
        assert res.exit_code == (3 if argv[1] == "status" else 0), (line, res.output, res.exception)
        outputs.setdefault(argv[1], []).append(res.output)
    assert "pushed version 100" in outputs["push"][0] and "pushed version 101" in outputs["push"][1]
    assert "-> 101" in outputs["inspect"][0]
    _assert_loads_as(tmp_path / "weights", second)


def test_tables_print_every_value_in_full_when_not_a_terminal(tmp_path):
    """CliRunner's stdout is not a terminal: rich must not cut cells to 80 columns."""
    first, second = _checkpoints(tmp_path)
    run = str(tmp_path / "run")
    _invoke("push", str(first), run)
    _invoke("push", str(second), run)
    out = _invoke("inspect", f"{run}/{Run_delta_key(run)}")
    assert "…" not in out
    names = json.loads(_invoke("inspect", f"{run}/{Run_delta_key(run)}", "--json"))["tensors"]
    assert len(names) > 5
    for name in names:  # every tensor row, its name in full
        assert f" {name} " in out, name
    log_out = _invoke("log", run)
    assert "…" not in log_out
    row = json.loads(_invoke("log", run, "--json").splitlines()[-1])
    assert f"{row['density']:.3%}" in log_out
    status_out = runner.invoke(app, ["status", run, "--all"]).output
    assert "…" not in status_out


def Run_delta_key(run: str) -> str:  # noqa: N802
    from sparsesync.protocol.run import Run

    return Run(run).commit(None).delta_objects()[0].key  # the newest version's delta


def test_demo_step_line_labels_the_changed_share():
    """`sync 263.3 KB (88.0%)` read as 88% of the model; it is the share of changed elements."""
    from trainer.metrics import _summary

    line = _summary({"sync_bytes": 263_300, "density": 0.88})
    assert "sync 263.3 KB" in line and "88.0% of elements changed" in line
