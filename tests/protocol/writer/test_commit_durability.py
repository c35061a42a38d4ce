"""A version on a local folder costs one fsync before `flush` returns: its delta, durable before
its commit record is written; the commit record is fsynced in the background, before the next
version's first write (`CommitWriter.commit` through `LocalStore.deferred_sync`).

A real Publisher and Follower on a real folder; `os.fsync` and `os.replace` are only wrapped to
record which file each touched, on which thread, in what order."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from sparsesync import Follower, Publisher
from tests.support.weights import make_state, train_step


def _kind(path: str) -> str:
    """The top folder of the object a (temp) file is, e.g. "deltas" or "commits"."""
    return Path(path).parent.name


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    log: list[tuple[str, str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        real_fsync(fd)
        log.append(("fsync", _kind(path), threading.current_thread().name))

    def replace(src, dst) -> None:  # type: ignore[no-untyped-def]
        real_replace(src, dst)
        log.append(("visible", _kind(str(dst)), threading.current_thread().name))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


def test_a_version_costs_one_fsync_before_flush_and_its_delta_is_durable_before_its_commit(
        tmp_path: Path, events: list[tuple[str, str, str]]) -> None:
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(0)
    state = make_state(0)
    with Publisher(url, anchor_every=0, anchor_fraction=1e9) as pub:
        pub.publish(state, 0)
        pub.flush()
        for v in (1, 2, 3):
            state = train_step(state, g)
            events.clear()
            pub.publish(state, v)
            pub.flush()
            # the writer's wait: the delta's fsync only (the commit's runs on its own thread)
            assert [k for what, k, t in events if what == "fsync" and t == "sparsesync-upload"] == ["deltas"]
            assert [e[:2] for e in events if e[1] != "commits" or e[2] != "sparsesync-fsync"] == [
                ("fsync", "deltas"), ("visible", "deltas"), ("visible", "commits")]
        state_v3 = state
    pub.store.close()  # waits for the last commit's fsync (as does the process's exit)
    assert events[-1] == ("fsync", "commits", "sparsesync-fsync")
    f = Follower(url)
    assert f.sync_once() == 3
    assert all(torch.equal(f.mirror[k], state_v3[k]) for k in state_v3)
    f.stop()


def test_the_commit_of_a_version_is_durable_before_the_next_versions_delta_is_visible(
        tmp_path: Path, events: list[tuple[str, str, str]]) -> None:
    g = torch.Generator().manual_seed(1)
    state = make_state(0)
    with Publisher(str(tmp_path / "run"), anchor_every=0, anchor_fraction=1e9) as pub:
        pub.publish(state, 0)
        pub.flush()
        events.clear()
        for v in (1, 2):
            state = train_step(state, g)
            pub.publish(state, v)
            pub.flush()
    order = [e[:2] for e in events]
    commit_visible = order.index(("visible", "commits"))
    commit_durable = order.index(("fsync", "commits"), commit_visible)  # (version 0's may land after the clear)
    next_delta = order.index(("visible", "deltas"), commit_visible)
    assert commit_visible < commit_durable < next_delta, order
