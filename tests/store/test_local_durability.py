"""A local folder's listings (only the folders that can hold the prefix's keys are read), and its
deferred writes (`LocalStore.deferred_sync`, used for commit records): visible at once, fsynced
in the background, and durable before any later write becomes visible.

Real files and real fsyncs; `os.fsync`, `os.replace` and `os.scandir` are only wrapped to record the order."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from sparsesync.errors import StoreError
from sparsesync.store.local import LocalStore


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _name(path: str) -> str:
    """A file's name, its temp file's as "tmp:" + the name it is renamed to."""
    name = Path(path).name
    return "tmp:" + name.split("-", 3)[3] if name.startswith(".sparsesync-tmp-") else name


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    """(what, file name, thread name) of every fsync finished and every rename, in order; the
    fsync of a file named "slow" takes 0.3 s."""
    log: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        name = _name(_fd_path(fd))
        if name == "slow":
            time.sleep(0.3)
        real_fsync(fd)
        log.append(("fsync", name, threading.current_thread().name))

    def replace(src, dst) -> None:  # type: ignore[no-untyped-def]
        real_replace(src, dst)
        log.append(("visible", Path(dst).name, threading.current_thread().name))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


def test_a_deferred_write_is_visible_before_its_fsync_and_durable_before_the_next_write(
        tmp_path: Path, events: list[tuple[str, str, str]]) -> None:
    store = LocalStore(tmp_path / "run", create=True)
    t0 = time.perf_counter()
    with store.deferred_sync():
        store.put("commits/slow", b"the commit")
    assert time.perf_counter() - t0 < 0.25  # it did not wait for its 0.3 s fsync
    assert store.get("commits/slow") == b"the commit"  # readers see it at once
    store.put("deltas/next", b"the next version's delta")
    order = [(what, name) for what, name, _t in events]
    assert order == [("visible", "slow"), ("fsync", "slow"), ("fsync", "tmp:next"), ("visible", "next")], order
    assert events[1][2] == "sparsesync-fsync"  # in the background, not on the writer's thread
    store.close()


@pytest.mark.parametrize("then", ["put", "put_new", "delete", "close"])
def test_every_later_operation_waits_for_the_deferred_fsync(
        tmp_path: Path, events: list[tuple[str, str, str]], then: str) -> None:
    store = LocalStore(tmp_path / "run", create=True)
    with store.deferred_sync():
        store.put("slow", b"x")
    if then == "put":
        store.put("b", b"y")
    elif then == "put_new":
        assert store.put_new("b", b"y")
    elif then == "delete":
        store.delete(["slow"])
    else:
        store.close()
    assert ("fsync", "slow") in [(w, n) for w, n, _t in events]  # done before the operation returned
    assert store._later._done is None  # nothing in flight


def test_writes_outside_the_block_are_durable_when_put_returns(tmp_path: Path,
                                                                events: list[tuple[str, str, str]]) -> None:
    store = LocalStore(tmp_path / "run", create=True)
    store.put("a", b"x")
    assert [(w, n) for w, n, _t in events] == [("fsync", "tmp:a"), ("visible", "a")]  # the temp file, then the rename


def test_a_failed_deferred_fsync_fails_the_next_write_loudly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if Path(_fd_path(fd)).name == "commit":
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = LocalStore(tmp_path / "run", create=True)
    with store.deferred_sync():
        store.put("commit", b"x")
    why = r"next was not written: the write before it, .*/commit, could not be made durable \(Input/output error\)"
    with pytest.raises(StoreError, match=why) as e:
        store.put("next", b"y")
    assert "power failure" in e.value.hint
    assert not store.exists("next")  # nothing written after it
    store.put("next", b"y")  # reported once: the store goes on


_EXIT_AFTER_A_DEFERRED_WRITE = r'''
import os, sys, time
from sparsesync.store.local import LocalStore
real_fsync = os.fsync
def fsync(fd):
    time.sleep(0.5)
    real_fsync(fd)
    open(sys.argv[2], "w").close()  # the fsync finished
os.fsync = fsync
store = LocalStore(sys.argv[1], create=True)
with store.deferred_sync():
    store.put("commit", b"x")
'''


def test_a_process_that_exits_waits_for_its_last_deferred_fsync(tmp_path: Path) -> None:
    import subprocess
    import sys

    marker = tmp_path / "synced"
    subprocess.run([sys.executable, "-c", _EXIT_AFTER_A_DEFERRED_WRITE, str(tmp_path / "run"), str(marker)],
                   check=True, timeout=60)
    assert marker.exists() and (tmp_path / "run" / "commit").read_bytes() == b"x"


def test_a_listing_reads_only_the_folders_that_can_hold_its_keys(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`list("commits/")` reads commits/ alone, `list("comm")` the root and commits/: never the
    anchors' and deltas' folders (a run holds one folder per anchor), and it finds what it did."""
    store = LocalStore(tmp_path / "run", create=True)
    for key in ("commits/v1.json", "commits/v2.json", "deltas/d1", "anchors/v1/model.safetensors",
                "anchors/v2/model.safetensors", "writers/w1", "comma"):
        store.put(key, b"x")
    read: list[str] = []
    real_scandir = os.scandir

    def scandir(path):  # type: ignore[no-untyped-def]
        read.append(os.path.relpath(path, tmp_path / "run"))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert [o.key for o in store.list("commits/")] == ["commits/v1.json", "commits/v2.json"]
    assert read == ["commits"]
    read.clear()
    assert [o.key for o in store.list("comm")] == ["comma", "commits/v1.json", "commits/v2.json"]
    assert sorted(read) == [".", "commits"]
    read.clear()
    assert len(store.list("")) == 7 and sorted(read) == [".", "anchors", "anchors/v1", "anchors/v2", "commits",
                                                         "deltas", "writers"]
