"""The tensor digest's format bump: runs written before "xxh3b" (tests/data/run_xxh3, written by
sparsesync d1f4da3: whole-stream XXH3-64 digests, patch format 3) stay readable by `verify`,
`pull` and followers, and a writer that resumes one keeps its digest; a new run records
"xxh3b" (its state digests say so, its patches are format 5, small tensors grouped or not)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sparsesync.codec import algo_of, read_patch
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from sparsesync.protocol.writer.publisher import Publisher
from sparsesync.transfer import pull
from tests.support.weights import assert_bit_equal

DATA = Path(__file__).parent.parent / "data" / "run_xxh3"


def _states() -> list[dict[str, torch.Tensor]]:
    spec = importlib.util.spec_from_file_location("make_run_xxh3", DATA / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.states()


class Hook(ApplyHook):
    """An engine stand-in keeping its own copy of the weights."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load_full(self, version, tensors):  # type: ignore[no-untyped-def]
        self.weights = {k: v.clone() for k, v in tensors.items()}

    def apply_sparse(self, version, updates, full):  # type: ignore[no-untyped-def]
        for name, upd in updates.items():
            self.weights[name].view(-1)[upd.indices] = upd.values


def _patch_formats(url: str) -> set[int]:
    """The format versions of every patch the run's commits name."""
    run = Run(url)
    return {
        read_patch(run.fetch(r)).header.format_version
        for c in run.commits()
        for r in ([c.delta] if c.delta else []) + list(c.parts)
    }


@pytest.fixture(params=["whole", "parts"])
def old_run(request, tmp_path) -> str:  # type: ignore[no-untyped-def]
    url = tmp_path / request.param
    shutil.copytree(DATA / request.param, url)
    return str(url)


def test_the_old_run_is_what_the_old_code_wrote(old_run):
    commits = Run(old_run).commits()
    assert [c.version for c in commits] == [0, 1, 2]
    assert {algo_of(c.state_digest) for c in commits} == {"xxh3"}
    assert _patch_formats(old_run) == {3}


def test_an_old_digest_run_verifies_pulls_and_is_followed(old_run, tmp_path):
    states = _states()
    report = verify_run(old_run)
    assert report.ok, report.to_dict()
    got = pull(old_run, tmp_path / "out")
    assert got.version == 2 and algo_of(got.state_digest) == "xxh3"
    assert_bit_equal(load_file(str(tmp_path / "out" / "model.safetensors")), states[2])
    # the folder names the version as the run does
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert f.metadata()["sparsesync.state_digest"] == got.state_digest
    for v in (0, 1):
        pull(old_run, tmp_path / f"v{v}", version=v)
        assert_bit_equal(load_file(str(tmp_path / f"v{v}" / "model.safetensors")), states[v])
    hook = Hook()
    f = Follower(old_run, hook, poll_interval=0.05)
    assert f.sync_once() == 2
    assert_bit_equal(hook.weights, states[2])
    assert_bit_equal(f.mirror, states[2])


def test_a_writer_resuming_an_old_run_keeps_its_digest(old_run):
    states = _states()
    hook = Hook()
    f = Follower(old_run, hook, poll_interval=0.05)
    assert f.sync_once() == 2  # a follower at the old run's head before the writer comes back
    nxt = {k: t.clone() for k, t in states[2].items()}
    nxt["a"].view(torch.int16)[100:40000:50] += 1
    with Publisher(old_run, anchor_every=50, part_bytes=1 << 10 if old_run.endswith("parts") else 1 << 30) as pub:
        pub.resume(states[2])
        pub.publish(nxt, 3)
        pub.flush()
    commits = Run(old_run).commits()
    assert [c.version for c in commits] == [0, 1, 2, 3]
    assert algo_of(commits[-1].state_digest) == "xxh3"
    assert _patch_formats(old_run) == {3}  # readable by followers of any version that read the run
    assert f.sync_once() == 3
    assert_bit_equal(hook.weights, nxt)
    assert verify_run(old_run).ok


def test_a_new_run_records_the_block_digest(tmp_path):
    states = _states()
    url = str(tmp_path / "new")
    with Publisher(url, anchor_every=50) as pub:
        for v, s in enumerate(states):
            pub.publish(s, v)
    commits = Run(url).commits()
    assert {algo_of(c.state_digest) for c in commits} == {"xxh3b"}
    assert all(c.state_digest.startswith("xxh3b:") for c in commits)
    assert _patch_formats(url) == {5}
    assert verify_run(url).ok
    pull(url, tmp_path / "out")
    assert_bit_equal(load_file(str(tmp_path / "out" / "model.safetensors")), states[2])
    hook = Hook()
    assert Follower(url, hook, poll_interval=0.05).sync_once() == 2
    assert_bit_equal(hook.weights, states[2])


def test_a_new_run_groups_small_tensors_in_format_5(tmp_path):
    """Small tensors of one dtype are coded together (a `groups` section) under "xxh3b" digests:
    format 5, whose member digests carry the prefix; verify, pull and a follower agree bit for bit."""
    g = torch.Generator().manual_seed(5)
    states = [{f"lora.{i}.w": torch.randn(64, 48, generator=g).to(torch.bfloat16) for i in range(6)}]
    for v in (1, 2):
        s = {k: t.clone() for k, t in states[-1].items()}
        for k in ("lora.1.w", "lora.4.w", "lora.5.w"):
            s[k].view(torch.int16)[v :: 37] += 1
        states.append(s)
    url = str(tmp_path / "grouped")
    with Publisher(url, anchor_every=50) as pub:
        for v, s in enumerate(states):
            pub.publish(s, v)
    run = Run(url)
    patches = [read_patch(run.fetch(c.delta)) for c in run.commits() if c.delta]
    assert patches and all(p.header.format_version == 5 and p.header.groups for p in patches)
    assert all(e.target_digest.startswith("xxh3b:") for p in patches for e in p.header.tensors.values())
    assert verify_run(url).ok
    pull(url, tmp_path / "out")
    assert_bit_equal(load_file(str(tmp_path / "out" / "model.safetensors")), states[2])
    hook = Hook()
    f = Follower(url, hook, poll_interval=0.05)
    assert f.sync_once() == 2
    assert_bit_equal(hook.weights, states[2])
    assert_bit_equal(f.mirror, states[2])
