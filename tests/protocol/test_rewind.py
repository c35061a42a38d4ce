"""Rewinds (docs/protocol.md, "Rewinds"): a writer resumes from a state older than the run's newest
version; the run goes on at the same URL and replicas move to the rewound weights.

Real publishers and followers on a local folder; the replica is a follower driving an engine
stand-in that keeps its own copy of the weights and the digest of every state it ever served.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.codec import state_digest, tensor_digests
from sparsesync.errors import (
    FleetTimeoutError,
    ObjectNotFoundError,
    PatchMismatchError,
    VersionNotFoundError,
)
from sparsesync.protocol.fleet import wait_for_fleet
from sparsesync.protocol.follower.fleet_member import FleetOptions
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.gc import apply_gc, plan_gc
from sparsesync.protocol.keys import heartbeat_key
from sparsesync.protocol.records import Heartbeat
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from tests.support.waiting import until  # noqa: E402
from tests.support.weights import assert_bit_equal, make_state, train_step


def digest(state: dict[str, torch.Tensor]) -> str:
    return state_digest(tensor_digests(state))


class ServingEngine(ApplyHook):
    """An engine stand-in: its own weights, and the digest of every state it served, in order."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.served: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        with self.lock:
            self.weights = {k: v.clone() for k, v in tensors.items()}
            self.served.append((version, digest(self.weights)))

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        with self.lock:
            for name, upd in updates.items():
                self.weights[name].view(-1)[upd.indices] = upd.values
            self.served.append((version, digest(self.weights)))

    def digests(self) -> list[str]:
        with self.lock:
            return [d for _v, d in self.served]


def _states(seed: int, n: int, start: dict[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [start if start is not None else make_state(seed)]
    for _ in range(n - 1):
        out.append(train_step(out[-1], g))
    return out


def _publish(url: str, states: dict[int, dict[str, torch.Tensor]], **kw: object) -> None:
    with Publisher(url, anchor_every=0, **kw) as pub:
        for v, s in sorted(states.items()):
            pub.publish(s, v)
            pub.flush()  # every version committed (none coalesced)



def test_a_rewind_moves_replicas_to_the_checkpoint_and_never_back_to_an_abandoned_version(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    first = _states(1, 6)  # the first attempt: versions 0..5, then a crash; the checkpoint is step 4
    _publish(url, dict(enumerate(first)))
    engine = ServingEngine()
    follower = Follower(url, engine, poll_interval=0.05, max_poll_interval=0.05)
    follower.start()
    try:
        until(lambda: follower.current_version == 5, 30, "the replica to serve version 5", every=0.01)
        abandoned = digest(first[5])
        # the resumed trainer: checkpoint-4's weights, then steps 5..7 of another trajectory
        second = _states(2, 4, start=first[4])
        with Publisher(url, anchor_every=0) as pub:
            t0 = time.monotonic()
            pub.resume(second[0], version=4)
            assert pub.committed_version == 4 and pub.state_digest == digest(first[4])
            # committed before resume() returns: the replica moves within its poll interval
            until(
                lambda: engine.digests()[-1] == digest(first[4]),
                5,
                "the replica to serve the rewound version 4",
                every=0.01,
            )
            moved = len(engine.served)
            assert time.monotonic() - t0 < 2.0
            for v, s in enumerate(second[1:], start=5):
                pub.publish(s, v)
            pub.flush()
        until(
            lambda: engine.digests()[-1] == digest(second[3]), 30, "the replica to serve the new version 7", every=0.01
        )
    finally:
        follower.stop()
    assert abandoned not in engine.digests()[moved - 1:]  # never served an abandoned version after the rewind
    assert_bit_equal(engine.weights, second[3])
    assert follower.current_version == 7

    run = Run(url)
    commits = run.commits()
    assert [(c.version, c.epoch) for c in commits] == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2), (7, 2)]
    assert commits[4].metrics["kind"] == "rewind" and commits[4].metrics["rewind_from"] == 5
    assert commits[4].has_anchor and commits[4].metrics["abandoned"] == [5]
    assert commits[5].base_version == 4  # deltas from the rewound version
    # pull --version 5 is the new attempt's version 5, bit for bit
    _rec, v5, _ = run.reconstruct(5)
    assert_bit_equal(v5, second[1])
    assert digest(v5) != abandoned
    assert verify_run(url).ok

    # log says what the rewind abandoned; verify passes; gc drops the abandoned commit records
    res = CliRunner().invoke(app, ["log", url])
    assert res.exit_code == 0 and "rewind" in res.output, res.output
    assert "the commits of versions 4..5 by epoch 1 are no longer trusted" in " ".join(res.output.split()), res.output
    rows = [json.loads(line) for line in CliRunner().invoke(app, ["log", url, "--json"]).output.splitlines()]
    assert rows[4]["kind"] == "rewind" and rows[4]["rewind_from"] == 5
    plan = plan_gc(open_store(url))
    assert plan.invalid_commits == ["commits/v0000000004-e000001.json", "commits/v0000000005-e000001.json"]
    apply_gc(open_store(url), plan)
    _rec, final, _ = Run(url).reconstruct()
    assert_bit_equal(final, second[3])


def test_a_rewound_version_number_that_only_the_abandoned_attempt_reached_is_not_pullable(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    first = _states(3, 7)
    _publish(url, dict(enumerate(first)))
    with Publisher(url, anchor_every=0) as pub:
        pub.resume(first[2], version=2)
    with pytest.raises(VersionNotFoundError, match=r"abandoned by the rewind to version 2 \(epoch 2\)"):
        Run(url).reconstruct(6)
    res = CliRunner().invoke(app, ["pull", url, str(tmp_path / "out"), "--version", "6"])
    assert res.exit_code != 0 and "abandoned by the rewind" in str(res.exception or res.output)


def test_a_checkpoint_of_another_run_is_refused_before_anything_is_uploaded(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    first = _states(4, 6)
    _publish(url, dict(enumerate(first)))
    before = {o.key for o in open_store(url).list("") if not o.key.startswith("writers/")}
    other = _states(5, 5)
    with Publisher(url, anchor_every=0) as pub, pytest.raises(PatchMismatchError) as e:
        pub.resume(other[4], version=4)
    assert "version 4 of" in str(e.value) and "not a checkpoint of this run" in str(e.value)
    assert "versions 0..5" in e.value.hint, e.value.hint  # names what exists
    # the weights of version 3 offered as step 4: the hint names version 3
    with Publisher(url, anchor_every=0) as pub, pytest.raises(PatchMismatchError) as e:
        pub.resume(first[3], version=4)
    assert "version 3 of the run" in e.value.hint and "checkpoint-3" in e.value.hint
    assert {o.key for o in open_store(url).list("") if not o.key.startswith("writers/")} == before
    assert [c.version for c in Run(url).commits()] == [0, 1, 2, 3, 4, 5]


def test_a_rewind_to_a_step_the_run_never_committed_writes_an_anchor(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    first = _states(6, 7)
    _publish(url, {0: first[0], 2: first[2], 4: first[4], 6: first[6]})  # published every second step
    follower = Follower(url)
    assert follower.sync_once() == 6
    with Publisher(url, anchor_every=0) as pub:
        pub.resume(first[3], version=3)
        pub.publish(first[5], 5)
    commits = Run(url).commits()
    assert [(c.version, c.epoch) for c in commits] == [(0, 1), (2, 1), (3, 2), (5, 2)]
    assert commits[2].has_anchor and not commits[2].has_delta and commits[2].metrics["kind"] == "rewind"
    assert follower.sync_once() == 5
    assert_bit_equal(follower.mirror, first[5])


def test_the_fleet_view_does_not_count_a_replica_serving_an_abandoned_version(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    first = _states(7, 6)
    _publish(url, dict(enumerate(first)))
    store = open_store(url)
    with Publisher(url, anchor_every=0) as pub:
        pub.resume(first[4], version=4)
        second = train_step(first[4], torch.Generator().manual_seed(9))
        pub.publish(second, 5)
        pub.flush()
    now = time.time()

    def beat(name: str, version: int, state: dict[str, torch.Tensor]) -> None:
        hb = Heartbeat(replica=name, written_at=now, interval_s=30.0, health="following", version=version,
                       state_digest=digest(state), newest_version=version, lag=0, last_apply_at=now,
                       last_apply_s=0.01, last_error=None)
        store.put(heartbeat_key(name), hb.to_json())

    beat("stuck", 5, first[5])  # still serving the abandoned version 5 of epoch 1
    with pytest.raises(FleetTimeoutError, match="stuck"):
        wait_for_fleet(store, 5, 1, timeout=0.3)
    with pytest.raises(FleetTimeoutError):
        wait_for_fleet(store, 4, 1, timeout=0.3)  # 5 >= 4 by number, but not a version of the run
    beat("good", 5, second)
    assert [s.record.replica for s in wait_for_fleet(store, 5, 1, timeout=5)] == ["good"]
    res = CliRunner().invoke(app, ["status", url, "--json"])
    report = json.loads(res.output)
    rows = {r["replica"]: r for r in report["replicas"]}
    assert rows["stuck"]["abandoned"] is True and rows["good"]["abandoned"] is False
    assert res.exit_code == 3 and any("abandoned" in p for p in report["problems"]), report["problems"]


def test_a_replica_stuck_on_an_abandoned_version_reports_how_far_behind_it_is(tmp_path: Path) -> None:
    """Before: a replica that could not load the rewind (its anchor gone) kept serving the
    abandoned 5 and reported lag 0 (newest 3 - 5, floored), then 1 once the run was back at 6.
    Its weights are none of the run's versions from the rewind on: lag counts them, 3 included."""
    url = str(tmp_path / "run")
    first = _states(5, 6)
    _publish(url, dict(enumerate(first)))
    follower = Follower(url, poll_interval=0.05, max_poll_interval=0.05,
                        fleet=FleetOptions(replica_id="stuck", interval_s=0.1, engine="test"))
    assert follower.sync_once() == 5 and follower.status().lag == 0
    with Publisher(url, anchor_every=0) as pub:
        pub.resume(first[3], version=3)  # the rewind commit (3, epoch 2), with an anchor of its own
        for p in (tmp_path / "run" / "anchors").glob("v0000000003-e000002-*/*"):
            p.unlink()  # the replica cannot load it: stuck on the abandoned 5
        assert follower.sync_once() == 5
        st = follower.status()
        assert (st.state, st.newest_version, st.lag) == ("degraded", 3, 1), st
        second = _states(6, 4, start=first[3])
        for v, s in enumerate(second[1:], start=4):
            pub.publish(s, v)
        pub.flush()
    follower.start()
    try:
        until(lambda: follower.status().newest_version == 6, 10, "the replica to see version 6")
        st = follower.status()
        assert (st.current_version, st.state, st.lag) == (5, "degraded", 4), st  # 3, 4, 5 and 6 still to take
        store = open_store(url)

        def beat() -> Heartbeat | None:
            with contextlib.suppress(ObjectNotFoundError):
                return Heartbeat.from_json(store.get(heartbeat_key("stuck")), heartbeat_key("stuck"))
            return None

        until(lambda: (hb := beat()) is not None and hb.newest_version == 6, 10, "a heartbeat naming version 6")
        hb = beat()
        assert hb is not None
        assert (hb.version, hb.lag, hb.health) == (5, 4, "degraded"), hb
    finally:
        follower.stop()


def _save(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def _push(*args: str) -> str:
    res = CliRunner().invoke(app, ["push", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return " ".join(res.output.split())


def test_push_of_an_older_checkpoint_rewinds_the_run_and_the_replica_follows(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    url = str(tmp_path / "run")
    first = _states(11, 6)
    for step, state in enumerate(first):  # a trainer pushing every checkpoint, then crashing after step 5
        _push(str(_save(tmp_path / "a" / f"checkpoint-{step}", state)), url)
    engine = ServingEngine()
    follower = Follower(url, engine)
    assert follower.sync_once() == 5
    abandoned = digest(first[5])
    # the trainer resumes from checkpoint-4: pushing it rewinds the run to 4 (nothing new uploaded but the record)
    out = _push(str(tmp_path / "a" / "checkpoint-4"), url, "--rewind")
    assert "pushed version 4 (rewind" in out and "versions [5] of the older attempt abandoned" in out, out
    assert follower.sync_once() == 4 and engine.digests()[-1] == digest(first[4])
    second = _states(12, 4, start=first[4])
    for step, state in enumerate(second[1:], start=5):
        _push(str(_save(tmp_path / "b" / f"checkpoint-{step}", state)), url)
        assert follower.sync_once() == step
    # --step N below the newest with weights the run does not hold: version N, a delta from N - 1
    third = train_step(second[1], torch.Generator().manual_seed(13))
    out = _push(str(_save(tmp_path / "c" / "weights", third)), url, "--step", "6", "--rewind")
    assert "pushed version 6 (delta" in out and "versions [6, 7] of the older attempt abandoned" in out, out
    assert follower.sync_once() == 6
    assert_bit_equal(engine.weights, third)
    assert abandoned not in engine.digests()[6:]  # after the rewind: never the first attempt's version 5
    commits = Run(url).commits()  # every push is a writer of its own (a new epoch)
    assert [(c.version, c.base_version, c.metrics["kind"]) for c in commits][3:] == [
        (3, 2, "delta"), (4, None, "rewind"), (5, 4, "delta"), (6, 5, "delta")]
    assert commits[4].has_anchor and not commits[4].has_delta
    res = CliRunner().invoke(app, ["pull", url, str(tmp_path / "pulled.safetensors")])
    assert res.exit_code == 0, res.output
    assert_bit_equal(load_file(str(tmp_path / "pulled.safetensors")), third)
    # the newest again: nothing to do
    assert "already holds these weights" in _push(str(tmp_path / "c" / "weights"), url, "--step", "6")
    assert [c.version for c in Run(url).commits()] == [0, 1, 2, 3, 4, 5, 6]


class _TimedEngine(ServingEngine):
    """ServingEngine that also notes when each (version, state) went live."""

    def __init__(self) -> None:
        super().__init__()
        self.live_at: dict[str, float] = {}

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        super().load_full(version, tensors)
        self.live_at[self.served[-1][1]] = time.time()

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        super().apply_sparse(version, updates, full)
        self.live_at[self.served[-1][1]] = time.time()


def test_coordinated_replicas_switch_together_across_a_rewind(tmp_path: Path) -> None:
    from sparsesync.protocol.follower.fleet_member import FleetOptions
    from sparsesync.protocol.keys import epoch_switch_key, switch_key

    url = str(tmp_path / "run")
    engines = [_TimedEngine() for _ in range(3)]
    # each polls at its own pace: alone they would go live up to 0.6 s apart
    followers = [Follower(url, e, poll_interval=p, max_poll_interval=p,
                          fleet=FleetOptions(replica_id=f"r{i}", interval_s=0.1, engine="test", coordinated=True,
                                             switch_deadline_s=20.0))
                 for i, (e, p) in enumerate(zip(engines, (0.05, 0.3, 0.6), strict=True))]
    first = _states(21, 6)
    with Publisher(url, anchor_every=0) as pub:
        pub.publish(first[0], 0)
        pub.flush()
        for f in followers:
            f.start()
        try:
            pub.wait_for_fleet(0, 3, timeout=30)
            for v in range(1, 6):
                pub.publish(first[v], v)
                pub.flush()
                pub.wait_for_fleet(v, 3, timeout=30)
            assert open_store(url).exists(switch_key(5))
            time.sleep(1.0)  # the crash
            second = _states(22, 3, start=first[4])
            with Publisher(url, anchor_every=0) as pub2:
                pub2.resume(second[0], version=4)
                pub2.wait_for_fleet(4, 3, timeout=30)  # replicas on the abandoned 5 do not count
                assert all(e.digests()[-1] == digest(first[4]) for e in engines)
                for v, s in ((5, second[1]), (6, second[2])):
                    pub2.publish(s, v)
                    pub2.flush()
                    pub2.wait_for_fleet(v, 3, timeout=30)
                    times = [e.live_at[digest(s)] for e in engines]
                    assert max(times) - min(times) < 0.05, (v, times)  # together, not each at its own pace
                    assert all(f.status().fleet["last_switch"]["how"] == "switch" for f in followers)
                    assert all(e.digests()[-1] == digest(s) for e in engines)
                # the old v5 record was the abandoned one's
                assert open_store(url).exists(epoch_switch_key(5, pub2.epoch))
        finally:
            for f in followers:
                f.stop()
    for e in engines:
        assert digest(first[5]) not in e.digests()[e.digests().index(digest(first[5])) + 1:]


def test_a_switch_record_gates_the_commit_its_epoch_names_whatever_the_clocks_say(tmp_path: Path) -> None:
    """Version 5 of epoch 1 was abandoned by a rewind and committed again by epoch 2. The plain
    `switches/v5.json` of epoch 1, dated 100 s ahead (its writer's clock runs fast), does not gate
    the commit (5, 2): the epoch it names decides, not its time. The trainer's switch of (5, 2) is
    then `switches/v5-e2.json`. A plain record without an epoch (an older release's) gates (5, 1)
    while no other epoch committed 5, and nothing once one did."""
    from sparsesync.protocol.fleet import switch_for, write_switch
    from sparsesync.protocol.keys import commit_key, switch_key
    from sparsesync.protocol.records import SwitchRecord

    store = open_store(str(tmp_path / "run"), create=True)
    store.put(commit_key(5, 1), b"{}")  # only the names matter to the rule
    old = SwitchRecord(version=5, apply_at=time.time() + 100, written_at=time.time() + 100, by="trainer:a")
    store.put(switch_key(5), old.to_json())  # no epoch: as written before records named it
    assert switch_for(store, 5, 1) == old
    store.put(commit_key(5, 2), b"{}")  # the rewind's epoch committed version 5 again
    assert switch_for(store, 5, 2) is None and switch_for(store, 5, 1) is None  # ambiguous: gates nothing
    store.put(switch_key(5), SwitchRecord(version=5, apply_at=time.time() + 100, written_at=time.time() + 100,
                                          by="trainer:a", epoch=1).to_json())
    assert switch_for(store, 5, 2) is None and switch_for(store, 5, 1).epoch == 1
    ours = write_switch(store, 5, by="trainer:b", apply_in_s=0.5, epoch=2)
    assert ours.epoch == 2 and store.exists("switches/v0000000005-e000002.json")
    assert switch_for(store, 5, 2) == ours and write_switch(store, 5, by="replica:r", epoch=2) == ours
    assert json.loads(store.get(switch_key(5)))["epoch"] == 1  # written once, never replaced


def _run_objects(url: str) -> list[str]:
    """Every object of the run but the writers' claims (each Publisher and push claims an epoch)."""
    return sorted(o.key for o in open_store(url).list("") if not o.key.startswith("writers/"))


def test_a_stray_push_of_an_older_or_foreign_checkpoint_does_not_rewind_without_rewind(tmp_path: Path) -> None:
    """Issue 47, item 4: re-running `push ./checkpoint-3` on a run at version 5 rewound every replica
    to 3 with no flag or prompt, and a foreign checkpoint-2 became version 2. A rewind now needs
    --rewind (not a terminal here: no prompt), and names the versions it abandons before it is done."""
    from sparsesync.errors import RewindRefusedError

    url = str(tmp_path / "run")
    first = _states(21, 6)
    for step, state in enumerate(first):
        _push(str(_save(tmp_path / "a" / f"checkpoint-{step}", state)), url)
    engine = ServingEngine()
    follower = Follower(url, engine)
    assert follower.sync_once() == 5
    before = _run_objects(url)
    foreign = _save(tmp_path / "b" / "checkpoint-2", make_state(99))
    for folder, version, abandoned in (
        (tmp_path / "a" / "checkpoint-3", 3, "versions 4, 5"),
        (foreign, 2, "versions 2, 3, 4, 5"),
    ):
        res = CliRunner().invoke(app, ["push", str(folder), url])
        assert res.exit_code == 1 and isinstance(res.exception, RewindRefusedError), (res.output, res.exception)
        msg = " ".join(str(res.exception).split())
        assert f"version {version} (from the folder name checkpoint-{version}) is not above version 5" in msg, msg
        assert f"abandons {abandoned}" in msg and "--rewind" in res.exception.hint, msg
        assert (res.exception.newest, res.exception.version) == (5, version)
        assert _run_objects(url) == before  # nothing written
        assert follower.sync_once() == 5 and engine.digests()[-1] == digest(first[5])
    # with --rewind: a line naming what it abandons comes first, then the push
    res = CliRunner().invoke(app, ["push", str(tmp_path / "a" / "checkpoint-3"), url, "--rewind"])
    out = " ".join(res.output.split())
    assert res.exit_code == 0, (out, res.exception)
    assert "rewinding: version 3 (from the folder name checkpoint-3) is not above version 5" in out, out
    assert "abandons versions 4, 5" in out and out.index("rewinding:") < out.index("pushed version 3 (rewind"), out
    assert follower.sync_once() == 3 and engine.digests()[-1] == digest(first[3])
    # pushed again past the rewind, then twice a push below the newest at the same step: the second
    # abandons the commits of 4 and 5 of several epochs: each version is named once
    second = _states(22, 3, start=first[3])
    for step, state in enumerate(second[1:], start=4):
        _push(str(_save(tmp_path / "c" / f"checkpoint-{step}", state)), url)
    for seed in (98, 97):
        out = _push(str(_save(tmp_path / f"d{seed}" / "weights", make_state(seed))), url, "--step", "4", "--rewind")
        assert "abandons versions 4, 5" in out and "versions [4, 5] of the older attempt abandoned" in out, out
        _push(str(_save(tmp_path / f"e{seed}" / "weights", make_state(seed + 1000))), url)  # version 5


def test_a_rewind_on_a_terminal_is_asked_for(tmp_path: Path) -> None:
    """On a terminal (stdin a TTY), a push that would rewind asks, naming what it abandons: 'n'
    pushes nothing, 'y' rewinds. Real processes on a pseudo-terminal."""
    import os
    import pty
    import subprocess
    import sys

    url = str(tmp_path / "run")
    states = _states(23, 3)
    for step, state in enumerate(states):
        _push(str(_save(tmp_path / f"checkpoint-{step}", state)), url)
    before = _run_objects(url)
    for answer, code in (("n", 1), ("y", 0)):
        main, tty = pty.openpty()
        try:
            os.write(main, f"{answer}\n".encode())
            res = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "from sparsesync.cli import main; main()",
                    "push",
                    str(tmp_path / "checkpoint-1"),
                    url,
                ],
                stdin=tty,
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            os.close(tty)
            os.close(main)
        err = " ".join(res.stderr.split())
        assert res.returncode == code, (res.stdout, err)
        assert (
            "version 1 (from the folder name checkpoint-1) is not above version 2" in err
            and "abandons version 2. Rewind?" in err
        ), err
        if answer == "n":
            assert "--rewind" in err and _run_objects(url) == before
        else:
            assert "pushed version 1 (rewind" in res.stdout
    assert [c.version for c in Run(url).commits()] == [0, 1]


@pytest.mark.parametrize("version", [-1, "3", 2.0, True, 10**10])
def test_resume_with_a_version_that_is_not_one_writes_nothing(tmp_path: Path, version: object) -> None:
    """Issue 47, item 9: resume(version=-1) uploaded an anchor and a commit named v-000000001, and
    version="3" raised TypeError. Now: one ConfigError naming the value, before anything is written."""
    from sparsesync.errors import ConfigError

    url = str(tmp_path / "run")
    states = _states(24, 3)
    _publish(url, dict(enumerate(states)))
    before = _run_objects(url)
    with Publisher(url, anchor_every=0) as pub:
        with pytest.raises(
            ConfigError, match=r"resume\(version=.*\) for .*: a version is an int in \[0, 9999999999\]"
        ) as e:
            pub.resume(states[1], version=version)  # type: ignore[arg-type]
        assert "int" in e.value.hint
    assert _run_objects(url) == before
    assert [c.version for c in Run(url).commits()] == [0, 1, 2]
