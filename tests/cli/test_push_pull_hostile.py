"""`push` of a hostile checkpoint folder and `pull` into a hostile DEST (issue 47, items 2, 7, 9).

push reads nothing outside SOURCE (a link out of it is refused with one line, a FIFO at once),
whatever is swapped in while it reads; pull changes nothing in DEST until the new version is
complete, also when DEST is a link to another file system or its layout is in the way. Real
files, FIFOs, links and file systems (/dev/shm when it is another one); the CLI as the console
script runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparsesync.cli import app
from sparsesync.cli._errors import run_guarded
from sparsesync.protocol.run import Run
from sparsesync.store import open_store
from tests.support.weights import assert_bit_equal, make_state, train_step

SECRET = b"[default]\naws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"


def _fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The CLI as the console script runs it must fail with one `error:` line; returns stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_guarded(lambda: app(list(args), standalone_mode=False))
    err = capsys.readouterr().err
    assert exc.value.code == 1 and len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, err
    return " ".join(err.split())


def _ok(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    run_guarded(lambda: app(list(args), standalone_mode=False))
    return " ".join(capsys.readouterr().out.split())


def _checkpoint(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _objects(url: Path) -> dict[str, bytes]:
    store = open_store(str(url))
    return {o.key: store.get(o.key) for o in store.list("")} if url.exists() else {}


def test_push_reads_nothing_outside_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "home" / ".aws" / "credentials"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(SECRET)
    # names of its own
    save_file({"outside.weight": torch.ones(4, 4)}, str(tmp_path / "home" / "elsewhere.safetensors"))
    run = tmp_path / "run"
    # a tokenizer file (carried with the version) or a weights shard that links out: refused, nothing written
    for name, target in (
        ("tokenizer.json", secret),
        ("model-00002-of-00002.safetensors", tmp_path / "home" / "elsewhere.safetensors"),
    ):
        src = _checkpoint(tmp_path / f"ckpt-{name}", make_state(0))
        (src / name).symlink_to(target)
        err = _fails(capsys, "push", str(src), str(run))
        assert f"{src / name} is a link to {target}, outside the checkpoint folder {src}" in err, err
        assert "fix: copy the file into the folder" in err, err
        assert not any(SECRET in data for data in _objects(run).values()) and not Run(str(run)).commits()
    # a link inside the folder is followed, and a Hugging Face cache snapshot's links into its blobs
    hub = tmp_path / "hub" / "models--me--tiny"
    snapshot = _checkpoint(hub / "snapshots" / "abc123", make_state(0))
    (hub / "blobs").mkdir()
    (hub / "blobs" / "e3b0c442").write_text('{"chat_template": "{{ messages }}"}')
    (snapshot / "tokenizer_config.json").symlink_to("../../blobs/e3b0c442")
    (snapshot / "generation_config.json").symlink_to("config.json")
    out = _ok(capsys, "push", str(snapshot), str(run))
    assert "pushed version 0" in out and "generation_config.json" in out and "tokenizer_config.json" in out, out
    out = _ok(capsys, "pull", str(run), str(tmp_path / "pulled"))
    assert (tmp_path / "pulled" / "tokenizer_config.json").read_text() == '{"chat_template": "{{ messages }}"}'
    assert not any(SECRET in p.read_bytes() for p in (tmp_path / "pulled").iterdir())


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "trainer_state.json"])
def test_push_of_a_fifo_fails_at_once(tmp_path: Path, name: str) -> None:
    """A FIFO in the folder (weights, a carried file, trainer_state.json) is refused before it is
    opened: a FIFO `model.safetensors` made push wait forever for a writer. A real process, bounded."""
    src = _checkpoint(tmp_path / "checkpoint-4", make_state(0))
    (src / name).unlink(missing_ok=True)
    os.mkfifo(src / name)
    res = subprocess.run(
        [sys.executable, "-c", "from sparsesync.cli import main; main()", "push", str(src), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    err = " ".join(res.stderr.split())
    assert res.returncode == 1 and f"error: {src / name} is a FIFO (named pipe), not a regular file" in err, err


def test_a_file_swapped_for_a_link_while_push_reads_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check and the read are one open file: a co-tenant who swaps the checked file (or a
    folder on its path) for a link out of the checkpoint between the two gets a ConfigError,
    never the outside file's bytes. The swap is done at the last moment before the open."""
    from sparsesync.errors import ConfigError
    from sparsesync.protocol.extras import collect_files

    secret = tmp_path / "outside" / "tokenizer.json"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    real_stat = os.stat

    def swap_at(path: Path, swap: object) -> None:
        def stat(p: object, *a: object, **kw: object) -> os.stat_result:
            st = real_stat(p, *a, **kw)  # type: ignore[arg-type]
            if Path(str(p)) == path and not kw.get("follow_symlinks", True):
                swap()  # type: ignore[operator]
            return st

        monkeypatch.setattr(os, "stat", stat)

    # the file itself becomes a link: the open does not follow it
    src = _checkpoint(tmp_path / "a", make_state(0))
    (src / "tokenizer.json").write_text("{}")

    def file_to_link() -> None:
        (src / "tokenizer.json").unlink()
        (src / "tokenizer.json").symlink_to(secret)

    swap_at(src / "tokenizer.json", file_to_link)
    with pytest.raises(ConfigError, match="changed into a link while it was read"):
        collect_files(src)
    # a folder on the path (a link inside the checkpoint into its sub-folder) becomes a link out:
    # what was opened is checked, not the path
    src = _checkpoint(tmp_path / "b", make_state(0))
    (src / "sub").mkdir()
    (src / "sub" / "tokenizer.json").write_text("{}")
    (src / "tokenizer.json").symlink_to("sub/tokenizer.json")

    def folder_to_link() -> None:
        (src / "sub").rename(src / "sub-old")
        (src / "sub").symlink_to(secret.parent)

    swap_at(src / "sub" / "tokenizer.json", folder_to_link)
    with pytest.raises(ConfigError, match="changed into a link out of the checkpoint folder"):
        collect_files(src)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="outside the checkpoint folder"):
        collect_files(tmp_path / "b")


def test_a_deeply_nested_trainer_state_is_ignored_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47, item 9: a deeply nested trainer_state.json failed push with "unexpected
    RecursionError"; now it is read as no step information, and push says so in its line."""
    src = _checkpoint(tmp_path / "checkpoint-3", make_state(0))
    (src / "trainer_state.json").write_text("[" * 200_000 + "]" * 200_000)
    out = _ok(capsys, "push", str(src), str(tmp_path / "run"))
    assert (
        "pushed version 3 (anchor; version from the folder name checkpoint-3; trainer_state.json ignored: nested too "
        "deep "
        "to read)" in out
    ), out
    (src / "trainer_state.json").write_text('{"global_step": ' * 100_000 + "1" + "}" * 100_000)
    nested = src.rename(tmp_path / "weights")
    out = _ok(capsys, "push", str(nested), str(tmp_path / "run"), "--json")
    assert json.loads(out)["step_from"] == "newest + 1; trainer_state.json ignored: nested too deep to read", out


# -- pull: nothing in DEST changes until the new version is complete ----------------------------
def _other_file_system(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm on another file system than the test's folder")
    import tempfile

    return Path(tempfile.mkdtemp(prefix="sparsesync-test-", dir=shm))


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    return {p.name: (str(p) + "/" if p.is_dir() else p.read_bytes()) for p in sorted(folder.iterdir())}


def _two_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    first = make_state(0)
    second = train_step(first, g)
    run = str(tmp_path / "run")
    _ok(capsys, "push", str(_checkpoint(tmp_path / "checkpoint-1", first)), run)
    _ok(capsys, "push", str(_checkpoint(tmp_path / "checkpoint-2", second)), run)
    return run, second


def test_pull_into_a_link_to_another_file_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DEST a link to a folder on another file system holding an older version (sharded, with its
    index): the pull stages there, not beside the link, so no rename crosses devices."""
    run, second = _two_versions(tmp_path, capsys)
    other = _other_file_system(tmp_path)
    try:
        _ok(capsys, "pull", run, str(other / "model"), "--version", "1")
        dest = tmp_path / "weights"
        dest.symlink_to(other / "model")
        out = _ok(capsys, "pull", run, str(dest))
        assert f"pulled version 2 (state {Run(run).newest().state_digest}) into {dest}" in out, out
        assert dest.is_symlink() and {p.name for p in (other / "model").iterdir()} == {
            "model.safetensors",
            "config.json",
        }
        assert_bit_equal(load_file(str(dest / "model.safetensors")), second)
        # one file DEST, a link to a file there
        _ok(capsys, "pull", run, str(other / "one.safetensors"), "--version", "1")
        (tmp_path / "one.safetensors").symlink_to(other / "one.safetensors")
        _ok(capsys, "pull", run, str(tmp_path / "one.safetensors"))
        assert_bit_equal(load_file(str(other / "one.safetensors")), second)
    finally:
        import shutil

        shutil.rmtree(other, ignore_errors=True)


def _older_sharded_model(dest: Path, state: dict[str, torch.Tensor]) -> None:
    """DEST as save_pretrained leaves a sharded checkpoint: two shards and their index."""
    names = sorted(state)
    half = len(names) // 2
    dest.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({n: state[n] for n in keys}, str(dest / shard))
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: shard for shard, keys in shards.items() for n in keys}}))


def _loads(dest: Path) -> dict[str, torch.Tensor]:
    """What a loader reads: the index's shards, else model.safetensors."""
    index = dest / "model.safetensors.index.json"
    out: dict[str, torch.Tensor] = {}
    for f in (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    ):
        out.update(load_file(str(dest / f)))
    return out


def test_a_pull_that_fails_leaves_dest_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run, second = _two_versions(tmp_path, capsys)
    older = make_state(7)
    dest = tmp_path / "dest"
    _older_sharded_model(dest, older)
    # a layout that clashes: a folder where the new version writes a file
    (dest / "config.json").mkdir()
    before = _snapshot(dest)
    err = _fails(capsys, "pull", run, str(dest))
    assert f"{dest / 'config.json'} is a folder where version 2 writes a model or checkpoint file" in err, err
    assert _snapshot(dest) == before
    assert_bit_equal(_loads(dest), older)  # the older model still loads
    (dest / "config.json").rmdir()
    # a rename of the swap fails half way (the disk, a co-tenant): every file moved is moved back
    before = _snapshot(dest)
    real_replace = os.replace
    calls = threading.local()

    def replace(src: object, dst: object, *a: object, **kw: object) -> None:
        if Path(str(dst)) == dest / "model.safetensors" and not getattr(calls, "failed", False):
            calls.failed = True
            raise OSError(28, "No space left on device")
        real_replace(src, dst, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", replace)
    err = _fails(capsys, "pull", run, str(dest))
    monkeypatch.undo()
    assert f"cannot write version 2 to {dest}" in err and "free disk space" in err, err
    assert _snapshot(dest) == before
    assert_bit_equal(_loads(dest), older)
    # and then it goes through: the new version, the older shards and index gone, other files kept
    (dest / "notes.txt").write_text("mine")
    _ok(capsys, "pull", run, str(dest))
    assert {p.name for p in dest.iterdir()} == {"model.safetensors", "config.json", "notes.txt"}
    assert_bit_equal(_loads(dest), second)
