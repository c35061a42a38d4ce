"""Run-level operations in the library (issue 49, item 3): the one reader of the newest trusted
commit (`Run.head`), fleet health as a typed report (`fleet.fleet_report`), `log` rows
(`history.log_rows`), `push`'s rewind plan (`writer.rewind.plan_push`) and commit metrics typed
(`records.CommitMetrics`). Real runs in a local folder, real records; the CLI prints what the
library returns.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.errors import ConfigError, RewindRefusedError, RunNotFoundError
from sparsesync.protocol.fleet import FleetReport, fleet_report
from sparsesync.protocol.history import log_rows
from sparsesync.protocol.keys import heartbeat_key
from sparsesync.protocol.records import KINDS, CommitMetrics, Heartbeat
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.protocol.writer.rewind import RewindPlan, plan_push, pushed_abandoned
from sparsesync.store import Store, open_store
from tests.support.weights import make_state, train_step


def _states(n: int, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [make_state(seed)]
    while len(out) < n:
        out.append(train_step(out[-1], g))
    return out


def _run(url: str, states: list[dict[str, torch.Tensor]]) -> int:
    """Commit states[i] as version i + 1, each on its own (anchor_every=0: an anchor first, then deltas); the epoch."""
    with Publisher(url, anchor_every=0) as pub:
        for v, s in enumerate(states, 1):
            pub.publish(s, v)
            pub.flush()
        return pub.epoch


def _beat(store: Store, replica: str, version: int | None, digest: str | None, *, health: str = "following",
          written_at: float | None = None, last_error: str | None = None) -> None:
    rec = Heartbeat(replica=replica, written_at=time.time() if written_at is None else written_at, interval_s=30.0,
                    health=health, version=version, state_digest=digest, newest_version=version, lag=0,
                    last_apply_at=None, last_apply_s=None, last_error=last_error, engine="test")
    store.put(heartbeat_key(replica), rec.to_json())


# ------------------------------------------------------------------------------ the newest trusted commit
def test_head_is_the_newest_trusted_commit_and_names_the_refused_names_above_it(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    assert Run(url).head().record is None and Run(url).head().refused == [] and Run(url).newest() is None
    epoch = _run(url, _states(2))
    stray = f"commits/v{3:010d}-e{epoch:06d}.json"
    open_store(url).put(stray, b"{not a commit")
    run = Run(url)
    head = run.head()
    assert head.record is not None and head.record.version == 2 and head.record == Run(url).commits()[-1]
    assert [k for k, _why in head.refused] == [stray] and head.refused[0][1] == run.rejected[stray]
    assert run.newest() == head.record


# ------------------------------------------------------------------------------ fleet health
def test_fleet_health_is_a_typed_report_and_status_prints_it(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _run(url, _states(4))
    run = Run(url)
    commits = run.commits()
    store = open_store(url)
    _beat(store, "a-current", 4, commits[3].state_digest)
    _beat(store, "b-behind", 1, commits[0].state_digest)
    _beat(store, "c-degraded", 4, commits[3].state_digest, health="degraded", last_error="fetch failed")
    _beat(store, "d-gone", 2, commits[1].state_digest, written_at=time.time() - 3600)

    report = fleet_report(store, min_replicas=4, max_lag=2)
    assert isinstance(report, FleetReport) and not report.ok
    assert (report.url, report.newest_version, report.live) == (store.url, 4, 3)
    assert report.newest_committed_at == commits[3].created_at and report.refused == []
    assert [(r.seen.record.replica, r.seen.live, r.behind, r.abandoned) for r in report.replicas] == [
        ("a-current", True, 0, False), ("b-behind", True, 3, False), ("c-degraded", True, 0, False),
        ("d-gone", False, 2, False)]
    assert report.problems == ["3 live replica(s), fewer than 4",
                               "b-behind serves version 1, newest is 4 (max lag 2)",
                               "c-degraded is degraded: fetch failed"]
    assert fleet_report(store, min_replicas=3, max_lag=3).problems == ["c-degraded is degraded: fetch failed"]

    # the CLI prints the library's report: the same fields, the exit status from `ok`
    res = CliRunner().invoke(app, ["status", url, "--json", "--min-replicas", "4"])
    printed, expected = json.loads(res.stdout), report.to_dict()
    for d in (printed, expected):
        d.pop("read_at")
        for r in d["replicas"]:
            r.pop("age_s")
    assert res.exit_code == 3 and printed == expected


def test_fleet_report_of_a_run_without_a_commit_is_run_not_found(tmp_path: Path) -> None:
    with pytest.raises(RunNotFoundError, match="no committed version under"):
        fleet_report(open_store(str(tmp_path / "empty"), create=True))


# ------------------------------------------------------------------------------ commit metrics, typed
def test_commit_metrics_are_typed_with_a_kind_literal(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    _run(url, _states(3))
    commits = Run(url).commits()
    assert [c.kind for c in commits] == ["anchor", "delta", "delta"] and set(KINDS) >= {c.kind for c in commits}
    assert all(c.stats.n_changed is not None for c in commits[1:]) and commits[0].stats.n_changed is None
    odd = CommitMetrics.of({"kind": "sideways", "n_changed": True, "coalesced": ["x"], "abandoned": [1, 2],
                            "rewind_from": 2.5, "density": 0.25})
    assert (odd.kind, odd.kind_text, odd.n_changed, odd.coalesced, odd.abandoned, odd.rewind_from, odd.density) == (
        None, "sideways", None, None, [1, 2], None, 0.25)
    assert not odd.is_rewind and CommitMetrics.of({"kind": "rewind"}).is_rewind and CommitMetrics.of({}).kind is None


# ------------------------------------------------------------------------------ log rows
def test_log_rows_are_the_commits_and_log_json_prints_them(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    states = _states(3)
    _run(url, states)
    with Publisher(url) as pub:  # rewind to version 1: versions 2 and 3 abandoned
        pub.resume(states[0], version=1)
    rows = log_rows(Run(url))
    assert [(r.version, r.metrics.kind) for r in rows] == [(1, "rewind")]
    assert rows[0].to_dict()["rewind_from"] == 3 and rows[0].to_dict()["abandoned"] == [2, 3]
    res = CliRunner().invoke(app, ["log", url, "--json"])
    assert res.exit_code == 0 and [json.loads(line) for line in res.stdout.splitlines()] == [r.to_dict() for r in rows]


# ------------------------------------------------------------------------------ push's rewind plan
def test_plan_push_decides_before_anything_is_written(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    states = _states(4)
    epoch = _run(url, states[:3])
    run = Run(url)
    newest = run.newest()
    names = sorted(o.key for o in open_store(url).list(""))
    kw = {"step_from": "step", "step_source": "--step", "rewind_source": "--rewind"}

    nxt = plan_push(run, newest, states[3], 4, rewind=False, **kw)
    assert (nxt.how, nxt.base, nxt.abandoning, nxt.below_newest) == ("next", 3, [], False)
    assert pushed_abandoned(run, nxt, epoch, {"kind": "delta"}) is None
    assert plan_push(run, None, states[0], 0, rewind=False, **kw).base is None  # a new run's first version
    assert plan_push(run, newest, states[2], 3, rewind=False, **kw).how == "held"

    asked: list[RewindPlan] = []
    back = plan_push(run, newest, states[0], 1, rewind=lambda p: asked.append(p) or True, **kw)
    assert (back.how, back.base, back.abandoning) == ("rewind", None, [2, 3])
    assert asked == [RewindPlan(url=run.url, newest=3, version=1, step_from="step", abandoned=[2, 3])]
    assert pushed_abandoned(run, back, epoch + 1, {"kind": "rewind", "abandoned": [3, 2, 3]}) == [2, 3]

    below = plan_push(run, newest, states[3], 2, rewind=True, **kw)  # other weights at 2: a delta from 1
    assert (below.how, below.base, below.abandoning) == ("below", 1, [2, 3])

    with pytest.raises(RewindRefusedError, match="refusing to rewind: version 2 .* abandons versions 2, 3") as e:
        plan_push(run, newest, states[3], 2, rewind=False, **kw)
    assert "--rewind" in e.value.hint
    with pytest.raises(ConfigError, match="has no version below it"):
        plan_push(run, newest, states[3], 0, rewind=True, **kw)
    assert sorted(o.key for o in open_store(url).list("")) == names  # nothing written by any plan
