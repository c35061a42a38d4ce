"""The fleet through the bucket: heartbeats, `sparsesync status`, waiting for replicas, switching together.

Replicas are real followers (threads in this process, and follower processes where one must be
killed) on the local folder and on a real S3 server (moto on 127.0.0.1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.errors import FleetTimeoutError
from sparsesync.protocol.fleet import read_fleet, read_switch
from sparsesync.protocol.follower.fleet_member import FleetOptions
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.keys import heartbeat_key, switch_key
from sparsesync.protocol.records import MAX_RECORD_BYTES, Heartbeat
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from tests.support.waiting import until  # noqa: E402
from tests.support.weights import assert_bit_equal, make_state, train_step

ROOT = Path(__file__).resolve().parents[2]
local_and_s3 = pytest.mark.parametrize("store_backend", ["local", "s3"], indirect=True)


class TimedHook(ApplyHook):
    """An engine stand-in: keeps its weights and the wall-clock time each version went live."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.applied_at: dict[int, float] = {}

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        self.weights = {k: v.clone() for k, v in tensors.items()}
        self.applied_at[version] = time.time()

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        for name, upd in updates.items():
            self.weights[name].view(-1)[upd.indices] = upd.values
        self.applied_at[version] = time.time()


def _follower(
    url: str, replica_id: str, hook: TimedHook | None = None, poll: float = 0.05, **fleet: object
) -> Follower:
    opts = FleetOptions(replica_id=replica_id, interval_s=0.1, engine="test", **fleet)  # type: ignore[arg-type]
    return Follower(url, hook, poll_interval=poll, max_poll_interval=poll, fleet=opts)


def _spawn_replica(url: str, replica_id: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.fleet_replica", url, replica_id], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc



def _status(url: str, *args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(app, ["status", url, "--json", *args])
    return res.exit_code, json.loads(res.stdout)


@contextmanager
def _fleet_at_v1(url: str, followers: list[Follower], state: dict[str, torch.Tensor]) -> Iterator[Publisher]:
    """A publisher that committed `state` as version 1, with `followers` started and serving it
    (stopped on the way out)."""
    with Publisher(url) as pub:
        pub.publish(state, 1)
        pub.flush()
        try:
            for f in followers:
                f.start()
            pub.wait_for_fleet(1, len(followers), timeout=30)
            yield pub
        finally:
            for f in followers:
                f.stop()


@local_and_s3
def test_status_shows_three_replicas_and_a_killed_one_ages_out(store_url):
    g = torch.Generator().manual_seed(1)
    state = make_state(0)
    pub = Publisher(store_url)
    proc = None
    followers = [_follower(store_url, f"thread-{i}", TimedHook()) for i in range(2)]
    try:
        pub.publish(state, 1)
        pub.flush()
        proc = _spawn_replica(store_url, "process-2")
        for f in followers:
            f.start()
        assert sorted(pub.wait_for_fleet(1, 3, timeout=60)) == ["process-2", "thread-0", "thread-1"]
        for v in (2, 3):
            state = train_step(state, g)
            pub.publish(state, v)
        pub.flush()
        ready = pub.wait_for_fleet(3, 3, timeout=30)
        assert len(ready) == 3

        code, report = _status(store_url)
        assert code == 0, report["problems"]
        assert report["newest_version"] == 3 and report["live"] == 3
        rows = {r["replica"]: r for r in report["replicas"]}
        assert set(rows) == {"thread-0", "thread-1", "process-2"}
        digest = pub.run.newest().state_digest
        for r in rows.values():
            assert (r["version"], r["behind"], r["health"], r["state_digest"]) == (3, 0, "following", digest)
            assert r["live"] and r["age_s"] < 2 and r["where"]["host"]
        assert rows["process-2"]["engine"] == "mirror" and rows["thread-0"]["engine"] == "test"
        human = CliRunner().invoke(app, ["status", store_url])
        assert human.exit_code == 0 and "process-2" in human.stdout and "3 live" in human.stdout

        proc.send_signal(signal.SIGKILL)  # no last heartbeat: its record must age out on its own
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        until(lambda: {s.record.replica for s in read_fleet(pub.store).live} == {"thread-0", "thread-1"},
               timeout=10, what="the killed replica to age out")
        assert time.monotonic() - killed_at < 3  # 3 x 0.1 s period + 1 s grace, plus one listing
        code, report = _status(store_url, "--min-replicas", "3")
        assert code == 3 and "2 live replica(s), fewer than 3" in report["problems"][0]
        gone = next(r for r in report["replicas"] if r["replica"] == "process-2")
        assert not gone["live"] and gone["health"] == "following"  # aged out, not stopped
        assert _status(store_url, "--min-replicas", "2")[0] == 0
        shown = CliRunner().invoke(app, ["status", store_url, "--min-replicas", "2"]).stdout
        assert "process-2" not in shown and "2 live" in shown
        shown_all = CliRunner().invoke(app, ["status", store_url, "--all", "--min-replicas", "2"]).stdout
        assert "process-2" in shown_all and "gone (aged out)" in shown_all

        for f in followers:  # a clean stop leaves the fleet at once (its last heartbeat says so)
            f.stop()
        assert read_fleet(pub.store).live == []
        assert {s.record.health for s in read_fleet(pub.store).replicas} >= {"stopped"}
    finally:
        for f in followers:
            f.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        pub.close()


def test_a_heartbeat_round_trip_on_every_backend(store_url):
    """One replica on each backend (local, S3, HF bucket): seen live at its version, then stopped."""
    follower = _follower(store_url, "solo")
    with Publisher(store_url) as pub:
        pub.publish(make_state(7), 1)
        pub.flush()
        follower.start()
        try:
            assert pub.wait_for_fleet(1, 1, timeout=60) == ["solo"]
            (seen,) = read_fleet(pub.store).replicas
            assert seen.live and seen.record.state_digest == pub.run.newest().state_digest
            writes = follower.status().fleet["writes"]
            time.sleep(1.0)
            assert follower.status().fleet["writes"] - writes <= 11  # one per 0.1 s period, no more
        finally:
            follower.stop()
        (seen,) = read_fleet(pub.store).replicas
        assert not seen.live and seen.record.health == "stopped"


@contextmanager
def _read_only_view(folder: Path, view: Path) -> Iterator[Path]:
    """`folder`, seen through a path this process cannot write: a read-only bind mount when
    running as root (root ignores file modes), else the folder itself with its top level made
    read-only (nothing new can be created beside commits/, deltas/ and anchors/)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    view.mkdir()
    ok = subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True).returncode == 0
    if not ok:
        pytest.skip("running as root without the right to bind-mount: cannot make a read-only folder")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True, capture_output=True)
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=True)


def _follows_without_write_access(reader_url: str, pub: Publisher, state: dict[str, torch.Tensor], first: int) -> None:
    """`pub` has committed `state` as version `first`; a follower of `reader_url` (no write
    access) follows two more versions bit-exactly and reports that its heartbeat is read-only."""
    g = torch.Generator().manual_seed(2)
    hook = TimedHook()
    follower = _follower(reader_url, "reader", hook)
    follower.start()
    try:
        for v in (first + 1, first + 2):
            state = train_step(state, g)
            pub.publish(state, v)
            pub.flush()
            follower.wait_for_version(v, timeout=20)
            assert_bit_equal(hook.weights, state)
        until(lambda: follower.status().fleet["heartbeat"] == "read-only", 10, "the read-only report")
        st = follower.status()
        assert st.state == "following" and st.current_version == first + 2 and st.fleet["error"]
    finally:
        follower.stop()
    assert read_fleet(pub.store).replicas == []  # it wrote nothing


def test_a_replica_without_write_access_still_follows_and_says_so(tmp_path):
    url = tmp_path / "run"
    state = make_state(1)
    with Publisher(str(url), anchor_every=0) as pub:  # one anchor: no new folder after the first delta
        pub.publish(state, 0)
        state = train_step(state, torch.Generator().manual_seed(9))
        pub.publish(state, 1)
        pub.flush()
        with _read_only_view(url, tmp_path / "ro") as ro:
            _follows_without_write_access(str(ro), pub, state, 1)


def test_a_replica_with_read_only_s3_credentials_still_follows(s3_server, monkeypatch):
    """moto with IAM enforced: the trainer's key may write, the replica's may only get and list."""
    import boto3
    import moto.settings

    from tests.conftest import S3_TEST_BUCKET

    iam = boto3.client("iam", endpoint_url=s3_server.direct_url, aws_access_key_id="x", aws_secret_access_key="x",
                       region_name="us-east-1")

    def user(name: str, actions: list[str]) -> dict[str, str]:
        name = f"{name}-{time.time_ns()}"
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                "AWS_DEFAULT_REGION": "us-east-1"}

    writer, reader = user("trainer", ["s3:*"]), user("replica", ["s3:GetObject", "s3:ListBucket"])
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("SPARSESYNC_S3_ENDPOINT", s3_server.endpoint)
    url = f"s3://{S3_TEST_BUCKET}/read-only-{time.time_ns()}"
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # IAM enforced from here on
    for k, v in writer.items():
        monkeypatch.setenv(k, v)
    state = make_state(1)
    with Publisher(url) as pub:  # the store's client keeps the credentials it was opened with
        pub.publish(state, 1)
        pub.flush()
        for k, v in reader.items():
            monkeypatch.setenv(k, v)
        _follows_without_write_access(url, pub, state, 1)


def test_coordinated_replicas_apply_each_version_together(tmp_path):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(3)
    state = make_state(2)
    hooks = [TimedHook() for _ in range(3)]
    # each polls at its own pace (0.05, 0.3, 0.6 s): alone they would go live up to 0.6 s apart
    followers = [_follower(url, f"r{i}", h, poll=[0.05, 0.3, 0.6][i], coordinated=True, switch_deadline_s=20.0)
                 for i, h in enumerate(hooks)]
    with _fleet_at_v1(url, followers, state) as pub:
        for v in range(2, 6):
            state = train_step(state, g)
            pub.publish(state, v)
            pub.flush()
            pub.wait_for_fleet(v, 3, timeout=30)
            times = [h.applied_at[v] for h in hooks]
            # all apply at the switch record's apply_at (not at their own pace)
            assert max(times) - min(times) < 0.05, times
            for f, h in zip(followers, hooks, strict=True):
                assert f.status().fleet["last_switch"]["how"] == "switch"
                assert_bit_equal(h.weights, state)
        assert open_store(url).exists(switch_key(5))


def test_a_replica_that_cannot_stage_is_reported_not_waited_for(tmp_path):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(4)
    state = make_state(3)
    hooks = [TimedHook() for _ in range(2)]
    followers = [_follower(url, f"fast-{i}", h, coordinated=True, switch_deadline_s=1.5) for i, h in enumerate(hooks)]
    # alive (heartbeats every 0.1 s) but it only looks for new versions once a minute: it cannot stage in time
    stuck = Follower(url, TimedHook(), poll_interval=60, max_poll_interval=60,
                     fleet=FleetOptions(replica_id="stuck", interval_s=0.1, coordinated=True, switch_deadline_s=1.5))
    with _fleet_at_v1(url, [*followers, stuck], state) as pub:
        state = train_step(state, g)
        pub.publish(state, 2)
        pub.flush()
        committed_at = pub.run.newest().created_at
        ready = pub.wait_for_fleet(2, 2, timeout=20)
        assert sorted(ready) == ["fast-0", "fast-1"]
        times = [h.applied_at[2] for h in hooks]
        assert all(t >= committed_at + 1.5 for t in times)  # they waited for the stuck one...
        assert max(times) < committed_at + 5  # ...only until the deadline
        assert max(times) - min(times) < 0.2  # the deadline is one moment for all of them
        assert [f.status().fleet["last_switch"]["how"] for f in followers] == ["deadline", "deadline"]
        assert not open_store(url).exists(switch_key(2))
        code, report = _status(url, "--max-lag", "0")
        assert code == 3 and any("stuck serves version 1" in p for p in report["problems"])
        with pytest.raises(FleetTimeoutError, match="stuck at 1"):
            pub.wait_for_fleet(2, 3, timeout=0.5)


def test_trainer_written_switch_record(tmp_path):
    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(5)
    state = make_state(4)
    hooks = [TimedHook() for _ in range(2)]
    followers = [_follower(url, f"r{i}", h, coordinated=True, switch_rule="trainer", switch_deadline_s=30.0)
                 for i, h in enumerate(hooks)]
    with _fleet_at_v1(url, followers, state) as pub:
        state = train_step(state, g)
        pub.publish(state, 2)
        pub.flush()
        assert len(pub.wait_for_fleet(2, 2, timeout=20, staged=True)) == 2
        time.sleep(0.5)
        assert all(2 not in h.applied_at for h in hooks)  # staged, held: the rule is the trainer's
        apply_at = pub.switch_fleet(2)
        pub.wait_for_fleet(2, 2, timeout=20)
        assert all(apply_at <= h.applied_at[2] < apply_at + 0.2 for h in hooks)


def test_hostile_fleet_records_are_skipped_with_a_reason(tmp_path):
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(make_state(5), 1)
        pub.flush()
    store = open_store(url)
    good = Heartbeat(replica="ok", written_at=time.time(), interval_s=1.0, health="following", version=1,
                     state_digest="ab", newest_version=1, lag=0, last_apply_at=None, last_apply_s=None, last_error=None)
    store.put(heartbeat_key("ok"), good.to_json())
    bad = {
        "junk": b"\xff\x00not json",
        "list": b"[1, 2]",
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "big": b" " * (MAX_RECORD_BYTES + 1),
        "renamed": good.to_json(),  # says replica "ok" under another name
        "nan": good.to_json().replace(b'"written_at": ', b'"written_at": NaN, "x": '),
        "huge-version": json.dumps(
            {**json.loads(good.to_json()), "replica": "huge-version", "version": 10**30}
        ).encode(),
        "bad-where": json.dumps({**json.loads(good.to_json()), "replica": "bad-where", "where": {"a": [1]}}).encode(),
    }
    for name, data in bad.items():
        store.put(heartbeat_key(name), data)
    store.put("fleet/nested/x.json", good.to_json())
    view = read_fleet(store)
    assert [s.record.replica for s in view.replicas] == ["ok"] and view.replicas[0].live
    reasons = dict(view.skipped)
    assert set(reasons) == {heartbeat_key(n) for n in bad} | {"fleet/nested/x.json"}
    assert "over the" in reasons[heartbeat_key("big")] and "does not match" in reasons[heartbeat_key("renamed")]
    assert "version" in reasons[heartbeat_key("huge-version")]
    store.put(switch_key(2), b'{"format": "sparsesync-switch/1", "version": 3}')  # wrong version: ignored
    assert read_switch(store, 2) is None
    code, report = _status(url)
    assert code == 0 and report["live"] == 1 and len(report["skipped"]) == len(bad) + 1
    assert CliRunner().invoke(app, ["status", url]).exit_code == 0


def test_status_of_a_missing_run_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["status", str(tmp_path / "nothing")])
    assert res.exit_code != 0 and "no committed version" in str(res.exception or res.output)


def test_trainer_waits_until_its_fleet_serves_the_bound(tmp_path):
    from sparsesync.errors import ConfigError
    from trainer.config import TrainerConfig
    from trainer.train import AsyncGRPOTrainer

    url = str(tmp_path / "run")
    base = {
        "model": {"path": "/tmp/model"},
        "rollout": {"replicas": ["http://127.0.0.1:1"], "env_url": "http://127.0.0.1:2"},
    }
    with pytest.raises(ConfigError, match=r"\[sync\] fleet_max_lag"):
        TrainerConfig.from_dict({**base, "sync": {"bucket": url, "fleet_min_replicas": 1, "fleet_max_lag": -1}})
    cfg = TrainerConfig.from_dict({**base, "sync": {"bucket": url, "fleet_min_replicas": 2, "fleet_max_lag": 1,
                                                    "fleet_timeout_s": 20.0}})
    trainer = AsyncGRPOTrainer(cfg)
    g = torch.Generator().manual_seed(6)
    state = make_state(6)
    followers = [_follower(url, f"r{i}", poll=0.3) for i in range(2)]
    with Publisher(url) as pub:
        pub.publish(state, 0)
        pub.flush()
        try:
            for f in followers:
                f.start()
            for v in (1, 2, 3):
                state = train_step(state, g)
                trainer.version = pub.publish(state, v)
                trainer._wait_for_fleet(pub)
                assert all(f.current_version >= v - 1 for f in followers)  # the bound: at most 1 behind
            trainer.cfg.sync.fleet_timeout_s = 0.3
            trainer.version = 10  # nobody serves 9
            with pytest.raises(FleetTimeoutError, match="r0 at 3"):
                trainer._wait_for_fleet(pub)
        finally:
            for f in followers:
                f.stop()


def test_an_inference_replica_reports_its_engine_and_place(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the embedded engine needs transformers")
    from inference_space.engines.embedded import EmbeddedEngine
    from inference_space.replica import Replica
    from sparsesync.deploy.inference import inference_space_specs
    from sparsesync.tiny_model import build_tiny_model
    from tests.support.model_steps import Trainer

    specs = inference_space_specs("me/rep", bucket=str(tmp_path), model="org/model", engine="embedded",
                                  regions=["us", "eu"], replicas=2, allow_local_bucket=True)
    assert [s.variables.get("SPARSESYNC_REGION") for s in specs] == ["us", "eu"]

    monkeypatch.setenv("SPARSESYNC_REPLICA_ID", "me--rep-2")
    monkeypatch.setenv("SPARSESYNC_REGION", "eu")
    monkeypatch.setenv("SPARSESYNC_HEARTBEAT_S", "0.1")
    tiny = build_tiny_model(tmp_path / "model", seed=0)
    url = str(tmp_path / "run")
    replica = Replica(EmbeddedEngine(tiny), url, poll_interval=0.05)
    with Publisher(url) as pub:
        pub.publish(Trainer(tiny, seed=1).step(), 1)
        pub.flush()
        replica.start()
        try:
            assert pub.wait_for_fleet(1, 1, timeout=30) == ["me--rep-2"]
            code, report = _status(url)
            (row,) = report["replicas"]
            assert code == 0 and row["engine"] == "embedded" and row["where"]["region"] == "eu"
            assert replica.status()["fleet"]["heartbeat"] == "ok"
        finally:
            replica.close()


def test_status_watch_refreshes_until_ctrl_c_and_exits_with_the_last_verdict(tmp_path):
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(make_state(8), 1)
        pub.flush()
    exe = Path(sys.executable).with_name("sparsesync")
    proc = subprocess.Popen([str(exe), "status", url, "--watch", "--json", "--interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        first, second = json.loads(proc.stdout.readline()), json.loads(proc.stdout.readline())
        assert first["newest_version"] == second["newest_version"] == 1 and second["read_at"] > first["read_at"]
        assert first["problems"] == ["0 live replica(s), fewer than 1"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 3  # nobody serves the run: the threshold is crossed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_trl_weight_transfer_can_wait_for_its_fleet(tmp_path):
    from sparsesync.integrations.trl import SparsesyncWeightTransfer

    url = str(tmp_path / "run")
    g = torch.Generator().manual_seed(10)
    state = make_state(10)
    followers = [_follower(url, f"r{i}", poll=0.3) for i in range(2)]
    transfer = SparsesyncWeightTransfer(url, fleet_min_replicas=2, fleet_max_lag=0, fleet_timeout_s=30.0)
    # what the transfer reads of TRL's AsyncGRPOTrainer: model_version, and the model (nothing frozen here)
    trl_trainer = SimpleNamespace(
        model_version=0, model=torch.nn.Module(), accelerator=SimpleNamespace(unwrap_model=lambda m: m)
    )
    transfer.bind(trl_trainer)
    transfer.init_weight_transfer()
    try:
        for f in followers:
            f.start()
        for k in (1, 2, 3):  # the k-th update is version k
            transfer.send_weights(iter(state.items()))
            trl_trainer.model_version = k  # TRL bumps model_version once send_weights returns
            assert [f.current_version for f in followers] == [k, k]  # returned only once both serve it
            state = train_step(state, g)
    finally:
        transfer.destroy()
        for f in followers:
            f.stop()


def test_status_passes_over_a_newest_commit_name_that_is_not_a_commit(tmp_path):
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(make_state(11), 1)
        pub.flush()
        epoch = pub.epoch
    key = f"commits/v{2:010d}-e{epoch:06d}.json"
    open_store(url).put(key, b"{not a commit")
    code, report = _status(url, "--min-replicas", "0")
    # newest is the trusted version 1; the name every reader refuses is a problem, with its reason (issue 53)
    assert code == 3 and report["newest_version"] == 1 and [r["key"] for r in report["refused"]] == [key]
    assert report["problems"] == [f"commit {key} is not a commit record, every reader refuses it: "
                                  f"{report['refused'][0]['reason']} (newest trusted version: 1)"]


def test_fleet_records_with_wild_numbers_markup_and_escapes_are_data(tmp_path):
    """Issue 43, case 3: 10**400 (or NaN, inf, a negative) in any time or period field, rich markup and
    terminal escapes in strings, and a heartbeat dated an hour ahead."""
    from sparsesync.protocol.fleet import wait_for_fleet

    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        pub.publish(make_state(5), 1)
        pub.flush()
    store = open_store(url)
    now = time.time()
    good = json.loads(Heartbeat(replica="ok", written_at=now, interval_s=30.0, health="degraded", version=1,
                                state_digest="ab", newest_version=1, lag=0, last_apply_at=None, last_apply_s=None,
                                last_error="[link=https://evil.example]click[/link] \x1b[2J\x1b]8;;https://e\x07",
                                engine="[/x]", where={"region": "[bold red]eu"}).to_json())
    store.put(heartbeat_key("ok"), json.dumps(good).encode())
    store.put(heartbeat_key("future"), json.dumps({**good, "replica": "future", "written_at": now + 3600}).encode())
    bad = {}
    for field in (
        "written_at",
        "interval_s",
        "last_apply_at",
        "last_apply_s",
        "staged_at",
        "switch_poll_s",
        "retry_at",
    ):
        for label, value in (("huge", 10**400), ("nan", float("nan")), ("inf", float("inf")), ("neg", -5)):
            name = f"{field}-{label}".replace("_", "-")
            bad[name] = field
            store.put(heartbeat_key(name), json.dumps({**good, "replica": name, field: value}).encode())
    for v, field in ((2, "apply_at"), (3, "written_at")):
        store.put(switch_key(v), json.dumps({"format": "sparsesync-switch/1", "version": v, "apply_at": now,
                                             "written_at": now, "by": "x", field: 10**400}).encode())
    view = read_fleet(store)
    assert {s.record.replica: s.live for s in view.replicas} == {"ok": True, "future": False}
    reasons = dict(view.skipped)
    for name, field in bad.items():
        assert field in reasons[heartbeat_key(name)], reasons[heartbeat_key(name)]
    assert "\x1b" not in view.replicas[0].record.last_error
    assert read_switch(store, 2) is None and read_switch(store, 3) is None
    assert [s.record.replica for s in wait_for_fleet(store, 1, 1, timeout=1)] == ["ok"]
    with pytest.raises(FleetTimeoutError):
        wait_for_fleet(store, 2, 1, timeout=0.2)
    code, report = _status(url)
    assert code == 3 and report["live"] == 1 and any("ok is degraded" in p for p in report["problems"])
    res = CliRunner().invoke(app, ["status", url, "--all"], env={"COLUMNS": "250"})
    assert res.exit_code == 3, res.output
    assert "[/x]" in res.stdout and "[bold red]eu" in res.stdout and "click[/link]" in res.stdout, res.stdout
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout


def test_a_full_weight_replica_reports_a_commit_it_refuses_once_and_until_it_is_passed(tmp_path, monkeypatch, caplog):
    """A commit record readers refuse (here: a state digest that is no digest) is named with its
    reason in /sync, the heartbeat and `status`, and logged once; a newer version clears the error."""
    pytest.importorskip("transformers", reason="the embedded engine needs transformers")
    import logging

    import httpx

    from inference_space.engines.embedded import EmbeddedEngine
    from inference_space.replica import Replica
    from sparsesync.tiny_model import build_tiny_model
    from tests.apps.inference.test_server import Server, wait_sync
    from tests.support.model_steps import Trainer

    monkeypatch.setenv("SPARSESYNC_REPLICA_ID", "rep")
    monkeypatch.setenv("SPARSESYNC_HEARTBEAT_S", "0.1")
    caplog.set_level(logging.WARNING, logger="sparsesync.protocol.follower.follower")
    tiny = build_tiny_model(tmp_path / "model", seed=0)
    url, trainer = str(tmp_path / "run"), Trainer(tiny, seed=1)
    replica = Replica(EmbeddedEngine(tiny), url, poll_interval=0.05)
    with Publisher(url, anchor_every=0) as pub:
        pub.publish(trainer.step(), 1)
        pub.flush()
        key = f"commits/v{2:010d}-e{pub.epoch:06d}.json"
        pub.publish(trainer.step(), 2)
        pub.flush()
    raw = json.loads((tmp_path / "run" / key).read_text())
    (tmp_path / "run" / key).write_text(json.dumps({**raw, "state_digest": "not-a-digest"}))
    try:
        with Server(replica) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            st = wait_sync(client, lambda s: s["serving_version"] == 1 and s["last_error"] is not None)
            err = st["last_error"]
            assert st["state"] == "degraded" and key in err and "state_digest 'not-a-digest' is not a hex digest" in err
            assert st["refused"][0]["key"] == key
            until(
                lambda: key in next((s.record.last_error or "" for s in read_fleet(open_store(url)).replicas), ""),
                10,
                "the heartbeat naming the refused commit",
            )
            code, report = _status(url)
            assert code == 3 and report["newest_version"] == 1 and report["refused"][0]["key"] == key
            assert any(p.startswith("rep is degraded") and key in p for p in report["problems"]), report["problems"]
            time.sleep(1.0)  # >= 20 polls
            with Publisher(url) as pub:  # a newer version the replica takes: the refused commit is behind it
                pub.publish(trainer.step(), 3)
            st = wait_sync(client, lambda s: s["serving_version"] == 3)
            assert st["state"] == "following" and st["last_error"] is None and st["refused"][0]["key"] == key
            until(lambda: _status(url)[0] == 0, 10, "a healthy status once version 3 is served")
            (tmp_path / "run" / key).unlink()  # deleted: no longer reported
            wait_sync(client, lambda s: s["refused"] == [])
    finally:
        replica.close()
    logged = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(f"refusing commit {key}"), logged
