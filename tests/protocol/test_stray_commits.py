"""Objects named like commits that are not commits (issue 47 items 3 and 8).

Only a commit record fences a writer or rewinds a follower: a stray object named like a newer
epoch's commit is reported (`verify`: NOT A COMMIT) and otherwise ignored. Names are parsed with
ASCII digits only. The fencing rule over the names is O(n log n): 20,000 commit names of one
version are judged in well under a second.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from sparsesync.checkpoint import EXPERT_KEY
from sparsesync.cli import app
from sparsesync.codec import state_digest, tensor_digests
from sparsesync.protocol import keys
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.gc import plan_gc
from sparsesync.protocol.lineage import Lineage, TrustedCommits
from sparsesync.protocol.parts_reader import _unit_of
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.parts import Unit
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.store import open_store
from sparsesync.transfer import checkpoint_step
from tests.support.weights import assert_bit_equal, make_state, train_step


def _digest(state: dict[str, torch.Tensor]) -> str:
    return state_digest(tensor_digests(state))


def _states(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = [make_state(3)]
    for _ in range(n - 1):
        out.append(train_step(out[-1], g))
    return out


def _serves(url: str, version: int, state: dict[str, torch.Tensor]) -> None:
    """A new follower of `url` serves `version`, bit-exact to `state`."""
    f = Follower(url)
    try:
        assert f.sync_once() == version
        assert_bit_equal(f.mirror, state)
    finally:
        f.stop()


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


def test_a_junk_object_named_like_a_newer_epochs_commit_fences_and_rewinds_nothing(tmp_path: Path) -> None:
    """Before: the 2-byte `commits/v0000000003-e000099.json` fenced by its name: the follower went
    back from 5 to 2 ("following"), and the live writer's next commit failed with FencedWriterError."""
    url = str(tmp_path / "run")
    states = _states(7)
    junk = keys.commit_key(3, 99)
    with Publisher(url, anchor_every=0, writer="w1") as pub:
        for v in range(6):
            pub.publish(states[v], v)
            pub.flush()
        follower = Follower(url)
        try:
            assert follower.sync_once() == 5
            (tmp_path / "run" / junk).write_bytes(b"{}")
            assert follower.sync_once() == 5 and follower.status().state == "following"
            assert_bit_equal(follower.mirror, states[5])
            pub.publish(states[6], 6)
            pub.flush()  # the live writer is not fenced by it
            assert follower.sync_once() == 6
            assert_bit_equal(follower.mirror, states[6])
            assert follower.status().lag == 0
        finally:
            follower.stop()
    run = Run(url)
    assert [c.version for c in run.commits()] == list(range(7)) and run.abandoned() == []
    assert junk in run.rejected
    store = open_store(url)
    assert Lineage(store).judge(6, _digest(states[6])) == "trusted"
    assert TrustedCommits(store).trusts(6, _digest(states[6]))
    assert plan_gc(store).invalid_commits == [junk]  # gc drops the stray object, not the run's commits
    code, out = _cli("verify", url)
    assert code == 1 and "NOT A COMMIT" in out and "v0000000003-e000099" in out, out
    code, out = _cli("log", url)
    assert code == 0 and "7 committed" in out and "rewind" not in out, out
    # a resumed writer claims an epoch above the stray name's (harmless) and is not fenced either
    ckpt = tmp_path / "c.safetensors"
    save_file(train_step(states[6], torch.Generator().manual_seed(5)), str(ckpt))
    code, out = _cli("push", str(ckpt), url, "--step", "7")
    assert code == 0 and "pushed version 7" in out, out
    assert Run(url).newest().version == 7


def test_commit_names_with_digits_other_than_ascii_are_not_commit_names(tmp_path: Path) -> None:
    """`\\d` matches '٩' and int('٩') is 9: such a name was trusted as epoch 99, fenced the writer
    and wedged the run (its key never rebuilt from the numbers) until deleted by hand."""
    assert keys.parse_commit_key("commits/v000000000\u0665-e0000\u0669\u0669.json") is None
    assert keys.parse_commit_key("commits/v0000000005-e000001.json\n") is None
    assert keys.parse_commit_key("commits/v0000000005-e000001.json") == (5, 1)
    for key in (
        "writers/e00000\u0669.lock",
        "writers/e00000\u0669-w.json",
        "fleet/r.json\n",
        "switches/v000000000\u0669.json",
        "deltas/v0000000001-v000000000\u0662-e000001-ab.safetensors",
        "anchors/v000000000\u0662-e000001-ab/model.safetensors",
        "files/v000000000\u0662-e000001-ab/config.json",
    ):
        assert not any(
            parse(key)
            for parse in (
                keys.parse_epoch_lock_key,
                keys.parse_writer_key,
                keys.parse_heartbeat_key,
                keys.parse_switch_key,
                keys.object_version,
                keys.parse_anchor_file_key,
                keys.parse_file_key,
            )
        ), key

    # the other names parsed for numbers: a checkpoint folder's step, an expert's index, a unit's rows
    (tmp_path / "checkpoint-\u0663").mkdir()
    (tmp_path / "checkpoint-3").mkdir()
    assert checkpoint_step(tmp_path / "checkpoint-\u0663") is None and checkpoint_step(tmp_path / "checkpoint-3") == (
        3,
        "the folder name checkpoint-3",
    )
    assert EXPERT_KEY.match("m.experts.\u0663.gate_proj.weight") is None and EXPERT_KEY.match(
        "m.experts.3.gate_proj.weight"
    )
    assert _unit_of("w[\u0660:\u0663]") == Unit("w[\u0660:\u0663]") and _unit_of("w[0:3]") == Unit("w", (0, 3))

    url = str(tmp_path / "run")
    states = _states(7)
    with Publisher(url, anchor_every=0, writer="w1") as pub:
        for v in range(6):
            pub.publish(states[v], v)
            pub.flush()
        follower = Follower(url)
        try:
            assert follower.sync_once() == 5
            rec = json.loads((tmp_path / "run" / keys.commit_key(5, 1)).read_text())
            (tmp_path / "run" / "commits" / "v000000000\u0665-e0000\u0669\u0669.json").write_text(
                json.dumps({**rec, "epoch": 99})
            )
            pub.publish(states[6], 6)
            pub.flush()  # before: FencedWriterError (the commit of version 5 by epoch 99 overrules it)
            assert follower.sync_once() == 6 and follower.status().state == "following"
            assert_bit_equal(follower.mirror, states[6])
        finally:
            follower.stop()
    code, out = _cli("log", url)
    assert code == 0 and "7 committed" in out, out
    code, out = _cli("pull", url, str(tmp_path / "out"))
    assert code == 0 and "pulled version 6" in out, out
    ckpt = tmp_path / "c.safetensors"
    save_file(train_step(states[6], torch.Generator().manual_seed(5)), str(ckpt))
    code, out = _cli("push", str(ckpt), url, "--step", "7")
    assert code == 0 and "pushed version 7" in out, out
    assert Run(url).newest().version == 7


def test_the_fencing_rule_is_n_log_n_in_the_names_of_one_version() -> None:
    """20,000 commit names of one version (a writer restarted 20,000 times at the same step, or a
    hostile lister): before, judging them was quadratic (16-43 s a follower poll, holding its lock)."""
    names = [keys.commit_key(7, e) for e in range(20_000)] + [keys.commit_key(v, 0) for v in range(7)]
    names += [keys.commit_key(8, 19_999), keys.commit_key(9, 3)]
    asked: list[str] = []

    def is_commit(key: str) -> bool:
        asked.append(key)
        return True

    t0 = time.perf_counter()
    valid = keys.valid_commits(names, is_commit)
    abandoned = keys.abandoned_by_rewinds(names, is_commit)
    took = time.perf_counter() - t0
    assert took < 2.0, f"judging 20,009 commit names took {took:.1f} s"
    assert [(v, e) for v, e, _k in valid] == [*((v, 0) for v in range(7)), (7, 19_999), (8, 19_999)]
    # each call asks only of keys whose being a commit decides another's trust, each once
    assert sorted(asked) == sorted(2 * [keys.commit_key(7, 19_999), keys.commit_key(8, 19_999)])
    assert sum(len(a.versions) for a in abandoned) == 19_999 + 1  # every older epoch's 7, and epoch 3's 9
    assert {(a.version, a.by_epoch) for a in abandoned} == {(7, 19_999)}


def test_a_junk_object_named_like_a_commit_of_the_last_epoch_leaves_writers_an_epoch(tmp_path: Path) -> None:
    """Before: `commits/v0000000001-e999999.json` (2 bytes) counted as a commit of epoch 999999, so
    no new writer could claim an epoch ("epochs have at most 6 digits"): the run was wedged."""
    url = str(tmp_path / "run")
    states = _states(3)
    with Publisher(url, anchor_every=0, writer="w1") as pub:
        pub.publish(states[0], 0)
    (tmp_path / "run" / keys.commit_key(1, keys.MAX_EPOCH)).write_bytes(b"{}")
    with Publisher(url, anchor_every=0, writer="w2") as pub:  # resumes: claims the epoch after the last commit's
        assert pub.epoch == 2
        pub.publish(states[1], 1)
    _serves(url, 1, states[1])


def test_a_junk_object_named_like_a_newer_writers_claim_fences_nothing(tmp_path: Path) -> None:
    """Before: a 2-byte `writers/e000099-x.json` fenced the live writer by its name, and a stray
    `writers/e999999-x.json` left no epoch to claim. Only a claim record of its name counts."""
    url = str(tmp_path / "run")
    states = _states(4)
    with Publisher(url, anchor_every=0, writer="w1") as pub:
        pub.publish(states[0], 0)
        (tmp_path / "run" / keys.writer_key(99, "x")).write_bytes(b"{}")
        (tmp_path / "run" / keys.writer_key(keys.MAX_EPOCH, "y")).write_bytes(b"[]")
        pub.publish(states[1], 1)  # not fenced
    with Publisher(url, anchor_every=0, writer="w2") as pub:  # a resumed trainer can still claim an epoch
        assert pub.epoch == 2
        pub.publish(states[2], 2)
    _serves(url, 2, states[2])
