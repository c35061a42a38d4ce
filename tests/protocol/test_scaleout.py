"""Scale-out: every rank of an FSDP2 trainer (gloo, CPU) publishes its own shard as parts of a version.

Real torch.distributed: each test launches 2 or 4 rank processes (tests/support/scaleout_worker.py) that
train a tiny Qwen3 with `fully_shard` and publish `model.state_dict()` (DTensors) through
`Publisher(url)`; rank 0 saves the gathered full state of every version, which followers here
must reproduce bit for bit. The shapes users bring run too: a tied Qwen3 (as Qwen3-0.6B), a
Qwen3-MoE with runtime-fused experts, a frozen embedding.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from sparsesync.cli import app
from sparsesync.errors import DigestMismatchError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.parts_reader import apply_parts
from sparsesync.protocol.run import Run
from sparsesync.protocol.verify import verify_run
from tests.support.weights import assert_bit_equal

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, timeout: float = 240, **args) -> list[subprocess.CompletedProcess]:
    """Run `world` ranks of tests/support/scaleout_worker.py to completion; their results by rank."""
    port = _free_port()
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.scaleout_worker", json.dumps(args)], cwd=ROOT,
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def _check_versions(url: str, out: Path, versions: range, want=None) -> None:  # type: ignore[no-untyped-def]
    """Every version reconstructs bit-exact to the gathered full state (`want(v)`: in the checkpoint's
    key set); and a follower that steps through them (anchor, then parts) holds each one."""
    want = want or (lambda v: load_file(out / f"v{v}.safetensors"))
    run = Run(url)
    commits = {c.version: c for c in run.commits()}
    assert sorted(commits) == list(versions) or set(versions) <= set(commits)
    _rec, state, digests = run.reconstruct(versions[0])
    assert_bit_equal(state, want(versions[0]))
    for v in versions[1:]:
        rec = commits[v]
        if rec.has_anchor and not rec.has_delta:
            state, digests = run.fetch_anchor(rec)
        else:
            assert rec.parts and rec.base_version == v - 1
            run.apply_delta(rec, state, digests)
        assert_bit_equal(state, want(v))


@pytest.mark.slow
def test_fsdp2_ranks_publish_their_shards_bit_exact_then_a_wider_world_continues(tmp_path):
    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=11, anchor_every=6)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    run = Run(url)
    commits = run.commits()
    assert [c.version for c in commits] == list(range(1, 12))
    assert [c.version for c in commits if c.has_anchor] == [1, 7]
    for c in commits[0], commits[6]:  # sharded anchors: one file per rank, and rank 0's index
        assert sorted(o.key.rsplit("/", 1)[1] for o in c.anchor) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    _check_transformers_loads(url, commits[6], out / "v7.safetensors", tmp_path)
    deltas = [c for c in commits if c.parts]
    for c in deltas:  # every rank's shard of every DTensor, in global rows, in parts of its own
        assert len({p.key.rsplit("-", 2)[-2] for p in c.parts}) == 2  # one uid per rank
        assert any(u.rows is not None for p in c.parts for u in p.units)
    _check_versions(url, out, range(1, 12))
    f = Follower(url)
    assert f.sync_once() == 11
    assert_bit_equal(f.mirror, load_file(out / "v11.safetensors"))

    # a wider world (4 ranks) whose weights are one ulp off the run's newest version: refused on every rank
    res = _launch(4, url=url, out=str(out), first=12, last=13, resume=True, perturb=True)
    assert [r.returncode for r in res] == [3] * 4, [r.stderr[-1500:] for r in res]
    assert all("PatchMismatchError" in r.stderr and "version 11" in r.stderr for r in res), [
        r.stderr[-1500:] for r in res
    ]
    assert run.commits()[-1].version == 11
    # with version 11's weights it resumes: the run's units are 2 ranks' rows, so every tensor is
    # gathered to one rank and hashed over them; its first version is a delta over 4 ranks' rows
    res = _launch(4, url=url, out=str(out), first=12, last=22, resume=True, anchor_every=6)
    assert [r.returncode for r in res] == [0] * 4, [r.stderr[-2000:] for r in res]
    commits = run.commits()
    rec = run.commit(12)
    assert commits[-1].version == 22 and rec.parts and rec.base_version == 11 and not rec.has_anchor
    assert len({p.key.rsplit("-", 2)[-2] for p in rec.parts}) == 4  # one uid per rank
    assert {u.rows for p in rec.parts for u in p.units} != {u.rows for p in run.commit(11).parts for u in p.units}
    assert run.commit(13).has_anchor and len(run.commit(13).anchor) == 5  # 13 - 7 >= 6: 4 ranks' files and the index
    _r, state, digests = run.reconstruct(11)
    run.apply_delta(rec, state, digests)  # 2 ranks' rows -> 4 ranks' rows
    assert_bit_equal(state, load_file(out / "v12.safetensors"))
    _check_versions(url, out, range(12, 23))
    assert f.sync_once() == 22
    assert_bit_equal(f.mirror, load_file(out / "v22.safetensors"))
    assert verify_run(url).ok

    # one damaged part of a sharded version: the follower applies none of them
    run2 = tmp_path / "damaged"
    shutil.copytree(url, run2)
    r2 = Run(str(run2))
    rec = r2.commit(22)
    _r, state, digests = r2.reconstruct(21)
    before = {k: v.clone() for k, v in state.items()}
    victim = run2 / rec.parts[len(rec.parts) // 2].key
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError):
        apply_parts(r2.fetch, rec, state, digests)
    assert_bit_equal(state, before)


def test_lagging_uploads_coalesce_alike_on_every_rank(tmp_path):
    """Part uploads that take 0.25 s each, a queue of one version: the ranks merge waiting versions
    (the same ones on every rank) instead of waiting, and every committed version is bit-exact."""
    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=9, queue_size=1, slow_puts=0.25)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    run = Run(url)
    commits = run.commits()
    versions = [c.version for c in commits]
    # some were merged, the last one is in
    assert versions[0] == 1 and versions[-1] == 9 and len(versions) < 9, versions
    merged = [c for c in commits[1:] if c.base_version != c.version - 1]
    assert merged, [(c.base_version, c.version) for c in commits]
    for prev, c in zip(commits, commits[1:]):
        assert c.parts and c.base_version == prev.version  # a chain: each delta from the version before it
        assert len({p.key.rsplit("-", 2)[-2] for p in c.parts}) == 2  # both ranks' parts, of the same merged version
    _rec, state, digests = run.reconstruct(1)
    for c in commits[1:]:
        run.apply_delta(c, state, digests)
        assert_bit_equal(state, load_file(out / f"v{c.version}.safetensors"))
    f = Follower(url)
    assert f.sync_once() == 9
    assert_bit_equal(f.mirror, load_file(out / "v9.safetensors"))
    assert verify_run(url).ok


@pytest.mark.slow
def test_a_rank_killed_before_its_part_is_stored_leaves_no_torn_version(tmp_path):
    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=6, kill_rank=1, kill_version=4, dist_timeout=8)
    codes = [r.returncode for r in res]
    assert codes == [3, 17], (codes, [r.stderr[-1500:] for r in res])
    for i, r in enumerate(res):  # the surviving rank says loudly that version 4 was not committed
        if i != 1:
            assert "RankFailedError" in r.stderr and "version 4" in r.stderr, r.stderr[-1500:]
    run = Run(url)
    assert [c.version for c in run.commits()] == [1, 2, 3]  # no version 4: its parts are garbage
    assert any("-v0000000004-" in o.key for o in run.store.list("deltas/"))
    # weights that are not version 3's: resume() refuses them on every rank, before anything is written
    res = _launch(2, url=url, out=str(out), first=4, last=6, resume=True, perturb=True)
    assert [r.returncode for r in res] == [3, 3], [r.stderr[-1500:] for r in res]
    assert all("PatchMismatchError" in r.stderr and "version 3" in r.stderr for r in res), [
        r.stderr[-1500:] for r in res
    ]
    assert [c.version for c in run.commits()] == [1, 2, 3]
    # the next writer at the same world size resumes from version 3 with a delta: its shards match version 3's units
    res = _launch(2, url=url, out=str(out), first=4, last=6, resume=True)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    assert [c.version for c in run.commits()] == [1, 2, 3, 4, 5, 6]
    rec = run.commit(4)
    assert rec.parts and rec.base_version == 3 and not rec.has_anchor and rec.epoch > run.commit(3).epoch
    _check_versions(url, out, range(4, 7))
    assert verify_run(url).ok


@pytest.mark.slow
def test_a_commit_refused_to_rank_0_fails_every_rank_loudly(tmp_path):
    """Another writer claims the run before version 3: rank 0 is fenced at commit, and every rank
    raises RankFailedError naming the cause; nothing of version 3 is committed."""
    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=4, fence_version=3, dist_timeout=30)
    assert [r.returncode for r in res] == [3, 3], [r.stderr[-1500:] for r in res]
    for r in res:
        assert "RankFailedError" in r.stderr and "version 3" in r.stderr and "FencedWriterError" in r.stderr, r.stderr[
            -1500:
        ]
    run = Run(url)
    assert [c.version for c in run.commits()] == [1, 2]
    assert verify_run(url).ok


def _check_transformers_loads(url: str, rec, full: Path, tmp_path: Path, cfg=None) -> None:
    """The sharded anchor of `rec`, as stored, and `sparsesync pull` of its version: both load
    with a plain `from_pretrained` (of `cfg`, default the worker's tiny Qwen3), bit-exact, a tied
    LM head still the embedding."""
    from transformers import AutoModelForCausalLM

    from sparsesync.tiny_model import tiny_config

    want = load_file(full)
    folder = tmp_path / f"as-stored-{rec.version}"
    shutil.copytree(Path(url) / rec.anchor[0].key.rsplit("/", 1)[0], folder)
    pulled = tmp_path / f"pulled-{rec.version}"
    done = CliRunner().invoke(app, ["pull", url, str(pulled), "--version", str(rec.version)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    cfg = cfg or tiny_config(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    for d in folder, pulled:
        cfg.save_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        assert_bit_equal({k: v for k, v in model.state_dict().items() if k in want}, want)
        assert set(want) <= set(model.state_dict())
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("who", ["rank0", "all"])
def test_replicated_weights_are_published_by_rank_0_alone(tmp_path, who):
    """DDP: no DTensors. A Publisher on rank 0 only (TRL's world-process-zero hook) must not wait
    for the other ranks; one on every rank publishes once, from rank 0."""
    url = str(tmp_path / "run")
    res = _launch(2, url=url, out=str(tmp_path), ddp=who, timeout=120)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    commits = Run(url).commits()
    assert [c.version for c in commits] == [1, 2, 3]
    assert len({c.writer for c in commits}) == 1 and all(not u.rows for p in commits[-1].parts for u in p.units)
    assert len(list(Run(url).store.list("writers/"))) <= 2  # rank 0's claim (and lock): no claim per rank


def _world_of_one(rank: int, port: int, url: str) -> None:
    """A distributed publisher on one rank (DTensors on a 1-rank mesh): see the test below."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from sparsesync.errors import ConfigError, PatchMismatchError
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.protocol.writer.test_parts import _held_store
    from tests.support.weights import make_state, train_step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(3)
        states = [make_state(0)]
        for _ in range(3):
            states.append(train_step(states[-1], g))

        def sharded(s):  # type: ignore[no-untyped-def]
            return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in s.items()}

        store, gate = _held_store(url, lambda key: key == "commits/v0000000002-e000001.json")
        pub = Publisher(store, group=dist.group.WORLD, part_bytes=20_000, anchor_every=0, anchor_fraction=1e9)
        pub.publish(sharded(states[0]), 1)
        pub.flush()
        assert pub.state_digest == Run(url).commit(1).state_digest
        pub.publish(sharded(states[1]), 2)  # its commit waits for the gate
        with pytest.raises(ConfigError, match="known once it is committed"):
            pub.state_digest  # noqa: B018 - the property raises
        gate.set()
        pub.flush()
        assert pub.state_digest == Run(url).commit(2).state_digest
        pub.close()
        other = Publisher(url, group=dist.group.WORLD)
        with pytest.raises(PatchMismatchError, match="version 2"):
            other.resume(sharded(states[0]))
        other.close()
        pub = Publisher(url, group=dist.group.WORLD, part_bytes=20_000, anchor_every=0, anchor_fraction=1e9)
        pub.resume(sharded(states[1]))
        assert pub.state_digest == Run(url).commit(2).state_digest
        pub.publish(sharded(states[2]), 3)
        pub.close()
    finally:
        dist.destroy_process_group()


def test_one_rank_writes_a_one_file_anchor_resumes_with_a_delta_and_knows_the_global_digest(tmp_path):
    """World size 1: the anchor is model.safetensors alone; `state_digest` raises until its version
    is committed, then is the commit's; resume() with the run's weights continues with a delta."""
    import torch.multiprocessing as mp

    from tests.support.weights import make_state, train_step

    url = str(tmp_path / "run")
    mp.spawn(_world_of_one, args=(_free_port(), url), nprocs=1, join=True)
    run = Run(url)
    assert [c.version for c in run.commits()] == [1, 2, 3]
    assert [o.key.rsplit("/", 1)[1] for o in run.commit(1).anchor] == ["model.safetensors"]
    rec = run.commit(3)
    assert rec.parts and rec.base_version == 2 and not rec.has_anchor and rec.epoch == 3
    g = torch.Generator().manual_seed(3)
    states = [make_state(0)]
    for _ in range(3):
        states.append(train_step(states[-1], g))
    for v in (1, 2, 3):
        assert_bit_equal(run.reconstruct(v)[1], states[v - 1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "world", "effort"), [("qwen3-tied", 2, "size"), ("qwen3-moe", 2, "size"), ("qwen3-moe", 3, "speed")]
)
def test_fsdp2_tied_and_moe_models_publish_the_checkpoint_key_set(tmp_path, arch, world, effort):
    """The shapes users bring, sharded: a tied LM head (Qwen3-0.6B; FSDP2 gives it and the embedding
    two DTensors over one local storage) is published once, as the embedding; runtime-fused MoE
    experts ([experts, ...] DTensors, each rank holding whole experts) are published per expert,
    each by the rank that holds it (3 ranks: 4 experts in chunks of 2, the last rank holds none).
    The run's key set is the one a single-process Publisher writes for the same model, every
    version is bit-exact, the sharded anchors load in transformers, and an embedded replica
    following the run holds every version in its runtime layout (a tied head still the embedding).
    A tied run resumes with a delta: the next writer's units are the run's. The 3-rank run
    encodes with effort "speed" (no class-conditioned codings): readers need nothing new.""" 
    from transformers import AutoModelForCausalLM

    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.tiny_model import arch_config

    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(world, url=url, out=str(out), first=1, last=6, anchor_every=4, arch=arch, effort=effort)
    assert [r.returncode for r in res] == [0] * world, [r.stderr[-2000:] for r in res]
    cfg = arch_config(arch, hidden=64)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    want = _gathered_as_checkpoint(model, out)
    single = str(tmp_path / "single")
    with Publisher(single, part_bytes=16 << 10) as pub:
        pub.publish(model.state_dict(), 1)
    keys = set(Run(single).reconstruct(1)[1])
    if arch == "qwen3-tied":
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    else:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys and not any(k.endswith("_proj") for k in keys)
    run = Run(url)
    commits = run.commits()
    assert [c.version for c in commits if c.has_anchor] == [1, 5]
    for c in commits:
        assert set(run.reconstruct(c.version)[1]) == keys
        units = {u.name for p in c.parts for u in p.units}
        assert not c.parts or units == keys
    _check_versions(url, out, range(1, 7), want)
    classed = [_classed(run, run.commit(v)) for v in (2, 3, 4, 6)]  # the deltas: was the class coding used?
    assert all(classed) if effort == "size" else not any(classed)
    for v in 1, 5:
        _check_transformers_loads(url, run.commit(v), out / f"v{v}.safetensors", tmp_path, cfg)
    _replica_follows(url, tmp_path, arch, range(1, 7), want)
    if arch == "qwen3-tied":  # the next writer at the same world size resumes with a delta over the same units
        res = _launch(world, url=url, out=str(out), first=7, last=8, resume=True, arch=arch)
        assert [r.returncode for r in res] == [0] * world, [r.stderr[-2000:] for r in res]
        rec = run.commit(7)
        assert rec.parts and rec.base_version == 6 and rec.epoch > run.commit(6).epoch
        _check_versions(url, out, range(7, 9), want)
    if arch == "qwen3-moe":  # each rank wrote the experts it holds: experts 0-1 in rank 0's file, 2-3 in rank 1's
        index = json.loads((Path(url) / run.commit(1).anchor[-1].key).read_text())["weight_map"]
        assert [index[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(4)] == [
            f"model-00001-of-0000{world}.safetensors"] * 2 + [f"model-00002-of-0000{world}.safetensors"] * 2
        for v in 2, 6:  # and published them as whole tensors, rank by rank
            units = [u for p in run.commit(v).parts for u in p.units if ".experts." in u.name]
            assert units and all(u.rows is None for u in units)


def _classed(run: Run, rec) -> bool:  # type: ignore[no-untyped-def]
    """Whether any tensor of the version's parts is coded per class of the base magnitude."""
    from sparsesync.codec import read_patch

    entries = [e for p in rec.parts for e in read_patch(run.store.get(p.key)).header.tensors.values()]
    return any(e.position_params.get("thresholds") or e.value_params.get("thresholds") for e in entries)


def _gathered_as_checkpoint(model, out: Path):  # type: ignore[no-untyped-def]
    """`want(v)` for `_check_versions`: the gathered full state of version `v` (`out/v<v>.safetensors`,
    in `model`'s runtime key set) in the checkpoint's key set, as one process holds it."""
    from sparsesync.checkpoint import checkpoint_state

    def want(v: int) -> dict[str, torch.Tensor]:
        full = load_file(out / f"v{v}.safetensors")
        if model.config.tie_word_embeddings:  # the gathered head is the embedding, at every version
            assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
        model.load_state_dict(full)
        return {k: t.clone() for k, t in checkpoint_state(model.state_dict()).items()}

    return want


@pytest.mark.slow
def test_a_sharded_moe_run_resumed_at_the_same_world_size_continues_with_a_delta_bit_exact(tmp_path):
    """A Qwen3-MoE (runtime-fused experts) on 2 FSDP2 ranks publishes an anchor and deltas in parts;
    the next job at the same world size loads the run's newest version into its sharded model,
    resume()s and continues with a delta over the same units (experts per expert, each from the rank
    that holds it), every version bit-exact. Weights with one expert one ulp off are refused by
    resume() on every rank (the rank holding the expert and the one that does not), nothing written.
    Then the same at 3 ranks (other units: the weights are hashed over the run's), and at 2 ranks
    again after a sharded anchor (whole tensors): each continues with a delta."""
    from transformers import AutoModelForCausalLM

    from sparsesync.checkpoint import checkpoint_state
    from sparsesync.tiny_model import arch_config

    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=3, arch="qwen3-moe")
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    run = Run(url)
    assert [(c.version, c.has_anchor, bool(c.parts)) for c in run.commits()] == [
        (1, True, False), (2, False, True), (3, False, True)]
    # expert 3 of layer 1 is rank 1's alone: rank 0's weights are right, and still it refuses with rank 1
    res = _launch(2, url=url, out=str(out), first=4, last=5, arch="qwen3-moe", resume=True,
                  perturb="model.layers.1.mlp.experts.3.gate_proj.weight")
    assert [r.returncode for r in res] == [3, 3], [r.stderr[-1500:] for r in res]
    assert all("PatchMismatchError" in r.stderr and "version 3" in r.stderr for r in res), [
        r.stderr[-1500:] for r in res
    ]
    assert [c.version for c in run.commits()] == [1, 2, 3]
    res = _launch(2, url=url, out=str(out), first=4, last=5, arch="qwen3-moe", resume=True)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    commits = run.commits()
    assert [c.version for c in commits] == [1, 2, 3, 4, 5]
    rec = run.commit(4)
    assert rec.parts and rec.base_version == 3 and not rec.has_anchor and rec.epoch > run.commit(3).epoch
    assert rec.base_state_digest == run.commit(3).state_digest
    model = AutoModelForCausalLM.from_config(arch_config("qwen3-moe", hidden=64), dtype=torch.bfloat16)
    keys = set(checkpoint_state(model.state_dict()))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys and not any(k.endswith("_proj") for k in keys)
    for c in commits[1:]:  # both jobs' deltas: every rank's parts, over the checkpoint's key set, experts whole
        assert len({p.key.rsplit("-", 2)[-2] for p in c.parts}) == 2  # one uid per rank
        assert {u.name for p in c.parts for u in p.units} == keys
        experts = [u for p in c.parts for u in p.units if ".experts." in u.name]
        assert len(experts) == 2 * 4 * 3 and all(u.rows is None for u in experts)
    _check_versions(url, out, range(1, 6), _gathered_as_checkpoint(model, out))
    assert verify_run(url).ok

    # another world size: 3 ranks (experts 0-1 on rank 0, 2-3 on rank 1, none on rank 2) check the
    # weights over the run's units, 2 ranks' rows and whole experts; expert 3 one ulp off is refused
    # by every rank, though only rank 1 holds it
    res = _launch(3, url=url, out=str(out), first=6, last=7, arch="qwen3-moe", resume=True,
                  perturb="model.layers.1.mlp.experts.3.gate_proj.weight")
    assert [r.returncode for r in res] == [3, 3, 3], [r.stderr[-1500:] for r in res]
    assert all("PatchMismatchError" in r.stderr and "version 5" in r.stderr for r in res), [
        r.stderr[-1500:] for r in res
    ]
    # with version 5's weights: a delta over 3 ranks' rows, then version 7 is a sharded anchor (7 - 1 >= 6)
    res = _launch(3, url=url, out=str(out), first=6, last=7, arch="qwen3-moe", resume=True, anchor_every=6)
    assert [r.returncode for r in res] == [0] * 3, [r.stderr[-2000:] for r in res]
    rec = run.commit(6)
    assert rec.parts and rec.base_version == 5 and not rec.has_anchor
    assert len({p.key.rsplit("-", 2)[-2] for p in rec.parts}) == 3  # one uid per rank (rank 2: rows only)
    assert run.commit(7).has_anchor and not run.commit(7).parts
    # after that anchor (whole tensors), 2 ranks resume over it: a delta again
    res = _launch(2, url=url, out=str(out), first=8, last=8, arch="qwen3-moe", resume=True)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    rec = run.commit(8)
    assert rec.parts and rec.base_version == 7 and not rec.has_anchor
    _check_versions(url, out, range(5, 9), _gathered_as_checkpoint(model, out))
    assert verify_run(url).ok


def _tied_world_of_one(rank: int, port: int, url: str) -> None:
    """A one-rank distributed publisher given tied DTensors (two over one local storage, as FSDP2
    gives them): see the test below."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from sparsesync.errors import ConfigError
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.support.weights import make_state, train_step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def sharded(s):  # type: ignore[no-untyped-def]
            return {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in s.items()}

        s1 = make_state(0)
        s1["lm_head.weight"] = s1["model.embed_tokens.weight"]
        s2 = train_step(s1, torch.Generator().manual_seed(5))
        s2["lm_head.weight"] = s2["model.embed_tokens.weight"]
        pub = Publisher(url, group=dist.group.WORLD, part_bytes=20_000, anchor_every=0, anchor_fraction=1e9)
        pub.publish(sharded(s1), 1)
        untied = {**s2, "lm_head.weight": s2["lm_head.weight"].clone()}
        untied["lm_head.weight"][0, 0] += 1
        with pytest.raises(ConfigError, match="'lm_head.weight' was tied to 'model.embed_tokens.weight'"):
            pub.publish(sharded(untied), 2)
        with pytest.raises(ConfigError, match="lacks: 'model.stranger'"):
            pub.publish(sharded({**s2, "model.stranger": torch.zeros(4, 4, dtype=torch.bfloat16)}), 2)
        pub.publish({k: v for k, v in sharded(s2).items() if k != "model.layers.0.mlp.up_proj.weight"}, 2)  # frozen
        pub.close()
    finally:
        dist.destroy_process_group()


def test_a_sharded_tie_is_published_once_checked_every_version_and_strangers_are_refused(tmp_path):
    """Tied DTensors are published once, under the first name; a later version whose alias holds
    other values, or with a name the run lacks, is refused before anything is written; a tensor
    left out is the previous version's."""
    import torch.multiprocessing as mp

    from tests.support.weights import make_state, train_step

    url = str(tmp_path / "run")
    mp.spawn(_tied_world_of_one, args=(_free_port(), url), nprocs=1, join=True)
    run = Run(url)
    assert [c.version for c in run.commits()] == [1, 2]
    s1 = make_state(0)
    s1["lm_head.weight"] = s1["model.embed_tokens.weight"]
    s2 = train_step(s1, torch.Generator().manual_seed(5))
    s2["model.layers.0.mlp.up_proj.weight"] = s1["model.layers.0.mlp.up_proj.weight"]
    assert_bit_equal(run.reconstruct(1)[1], {k: v for k, v in s1.items() if k != "lm_head.weight"})
    assert_bit_equal(run.reconstruct(2)[1], {k: v for k, v in s2.items() if k != "lm_head.weight"})


@pytest.mark.slow
def test_fsdp2_frozen_tensors_left_out_of_the_state_are_taken_from_the_previous_version(tmp_path):
    """A frozen embedding, and after the first version a state of the trainable tensors alone (as
    callbacks that send what changes do): every version, the periodic anchor included, still holds
    the frozen embedding, as a single-process Publisher fills it in from the previous version."""
    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=6, anchor_every=4, freeze=True, trainable_only=True)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    run = Run(url)
    assert [c.version for c in run.commits() if c.has_anchor] == [1, 5]
    _check_versions(url, out, range(1, 7))
    first, last = load_file(out / "v1.safetensors"), load_file(out / "v6.safetensors")
    assert torch.equal(first["model.embed_tokens.weight"], last["model.embed_tokens.weight"])
    assert not torch.equal(first["lm_head.weight"], last["lm_head.weight"])
    assert "model.embed_tokens.weight" in run.fetch_anchor(run.commit(5))[0]


def _replica_follows(url: str, tmp_path: Path, arch: str, versions: range, want) -> None:
    """An embedded (transformers) replica, loaded from the first version's pulled anchor, follows
    the run as its commits land one by one: at every version its runtime parameters hold the
    version bit for bit (per-expert tensors in the fused experts), and a tied LM head is the
    embedding's storage."""
    from inference_space.engines.embedded import EmbeddedEngine
    from sparsesync.tiny_model import build_tiny_model

    built = build_tiny_model(tmp_path / "built", arch=arch, hidden=64)  # for its tokenizer
    engine_dir = tmp_path / "engine"
    shutil.copytree(tmp_path / f"pulled-{versions[0]}", engine_dir)
    for f in built.glob("*token*"):
        shutil.copy(f, engine_dir / f.name)
    landing = tmp_path / "landing"  # the run's objects, and its commits as they land
    shutil.copytree(url, landing, ignore=shutil.ignore_patterns("commits"))
    (landing / "commits").mkdir()
    engine = EmbeddedEngine(engine_dir)
    follower = Follower(str(landing), hook=engine, prefetch=False)
    for v in versions:
        for f in (Path(url) / "commits").glob(f"v{v:010d}-*"):
            shutil.copy(f, landing / "commits" / f.name)
        assert follower.sync_once() == v, follower.status().last_error
        assert engine.weight_version == v
        assert_bit_equal(engine.state_dict(), want(v))
        head, emb = engine.model.lm_head.weight, engine.model.model.embed_tokens.weight
        assert (head.data_ptr() == emb.data_ptr()) == (arch == "qwen3-tied")


@pytest.mark.slow
def test_a_sharded_run_resumed_from_an_older_version_rewinds_and_a_follower_ends_bit_exact(tmp_path):
    """2 FSDP2 ranks publish versions 1..5 (an anchor, then deltas in row parts); the next job
    starts from version 3's weights (a checkpoint from before a crash) and `resume(state,
    version=3)`s on every rank: the weights are checked over version 3's units, the rewind commit
    (3, new epoch) is a sharded anchor of them, versions 4..5 of the first job are abandoned and
    the job continues with deltas 3 -> 4 -> 5 -> 6. A follower that held the abandoned version 5
    ends bit-exact with the job's final weights. Weights one ulp off version 3 are refused on every
    rank before anything is uploaded; a rewind to version 1 (an anchor of whole tensors) reuses it."""
    url, out = str(tmp_path / "run"), tmp_path / "full"
    out.mkdir()
    res = _launch(2, url=url, out=str(out), first=1, last=5)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    run = Run(url)
    f = Follower(url)
    assert f.sync_once() == 5
    abandoned = run.commit(5).state_digest
    objects = sorted(p.relative_to(url) for p in Path(url).rglob("*") if p.is_file() and "writers" not in p.parts)

    res = _launch(2, url=url, out=str(out), first=4, last=6, resume=True, resume_version=3, perturb=True)
    assert [r.returncode for r in res] == [3, 3], [r.stderr[-1500:] for r in res]
    assert all("PatchMismatchError" in r.stderr and "version 3" in r.stderr for r in res), [
        r.stderr[-1500:] for r in res
    ]
    assert (
        sorted(p.relative_to(url) for p in Path(url).rglob("*") if p.is_file() and "writers" not in p.parts) == objects
    )

    res = _launch(2, url=url, out=str(out), first=4, last=6, resume=True, resume_version=3)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    commits = run.commits()
    assert [c.version for c in commits] == [1, 2, 3, 4, 5, 6]
    rec = run.commit(3)
    assert rec.metrics["kind"] == "rewind" and rec.metrics["rewind_from"] == 5 and rec.metrics["abandoned"] == [4, 5]
    assert rec.epoch > commits[1].epoch and rec.has_anchor and not rec.parts  # a sharded anchor: 2 files and the index
    assert len(rec.anchor) == 3 and not rec.metrics["reused_anchor"]
    assert all(c.parts and c.base_version == c.version - 1 and c.epoch == rec.epoch for c in commits[3:])
    assert run.commit(5).state_digest != abandoned
    _check_versions(url, out, range(3, 7))  # v3 is the first job's file: the same weights
    assert f.sync_once() == 6
    assert_bit_equal(f.mirror, load_file(out / "v6.safetensors"))
    assert verify_run(url).ok

    # a rewind to version 1, an anchor of whole tensors: the rewind commit is that anchor, nothing uploaded
    res = _launch(2, url=url, out=str(out), first=2, last=2, resume=True, resume_version=1)
    assert [r.returncode for r in res] == [0, 0], [r.stderr[-2000:] for r in res]
    rec = run.commit(1)
    assert (
        rec.metrics["kind"] == "rewind" and rec.metrics["reused_anchor"] and rec.metrics["abandoned"] == [2, 3, 4, 5, 6]
    )
    assert [o.key for o in rec.anchor] == [o.key for o in commits[0].anchor]
    assert [c.version for c in run.commits()] == [1, 2] and run.commit(2).base_version == 1
    assert f.sync_once() == 2
    assert_bit_equal(f.mirror, load_file(out / "v2.safetensors"))
