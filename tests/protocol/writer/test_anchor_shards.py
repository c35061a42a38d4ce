"""Sharded anchors: the rank plan, and readers of a sharded anchor (shards + index) in a bucket.

The distributed writer is exercised under real gloo in tests/protocol/test_scaleout.py; here sharded anchors
are written with the same codec functions (`write_anchor` with a small shard size writes the files
a distributed anchor has) into a local run, and hostile variants must fail loudly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sparsesync.codec import write_anchor
from sparsesync.codec.anchor import INDEX_NAME
from sparsesync.codec.digest import file_digest
from sparsesync.errors import DigestMismatchError, MalformedCommitError, PatchFormatError
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.keys import anchor_prefix, commit_key
from sparsesync.protocol.records import CommitRecord, ObjectRef
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.anchor_shards import assign
from sparsesync.store import open_store
from tests.support.weights import assert_bit_equal, make_state


def test_the_plan_spreads_tensors_by_bytes_and_keeps_replicated_ones_on_rank_0():
    sizes = [
        ("embed", 1000, True),
        ("norm", 10, False),
        *[(f"l{i}", 100 + i, True) for i in range(20)],
        ("head", 1000, True),
    ]
    for world in (1, 2, 3, 4, 8):
        plan = assign(sizes, world)
        assert (
            plan.owner["norm"] == 0
            and set(plan.owner) == {n for n, _, _ in sizes}
            and list(plan.owner) == [n for n, _, _ in sizes]
        )
        load = [sum(b for n, b, _ in sizes if plan.owner[n] == r) for r in range(world)]
        assert max(load) <= sum(load) / world + 1000  # about 1/N each, plus at most the largest tensor
        assert plan.total_size == sum(load) and plan == assign(sizes, world)  # the same plan on every rank
        names = sorted(plan.files.values())
        assert names == (["model.safetensors"] if len(plan.files) == 1 else
                         [f"model-{k:05d}-of-{len(plan.files):05d}.safetensors" for k in range(1, len(plan.files) + 1)])
    assert len(assign([("a", 8, True)], 4).files) == 1  # ranks without a tensor write no file


def test_tensors_one_rank_holds_whole_are_written_by_that_rank_and_count_in_its_load():
    """MoE experts split from a fused tensor's dim-0 shard: no gather, their holder writes them."""
    sizes = [("e0", 400, False), ("e1", 400, False), ("norm", 10, False), ("embed", 500, True), ("head", 500, True)]
    plan = assign(sizes, 2, holders={"e0": 0, "e1": 1})
    assert plan.owner == {"e0": 0, "e1": 1, "norm": 0, "embed": 1, "head": 0}


def _sharded_run(root: Path, state: dict[str, torch.Tensor], edit=None) -> tuple[str, Path]:
    """A run whose version 1 is a sharded anchor (3 shards + index); `edit(folder)` may change the
    files first; the commit records what is then stored (a hostile writer's record)."""
    stage = root / "stage"
    write_anchor(state, stage, version=1, max_shard_bytes=32768)  # embed | q, up, norm | lm_head
    if edit is not None:
        edit(stage)
    url = str(root / "run")
    store = open_store(url, create=True)
    prefix = anchor_prefix(1, 1, "0123456789ab")
    files = sorted(stage.iterdir())
    store.put_many([(prefix + f.name, f) for f in files])
    anchor = [ObjectRef(prefix + f.name, f.stat().st_size, file_digest(f)) for f in files]
    index = json.loads((stage / INDEX_NAME).read_text()) if (stage / INDEX_NAME).exists() else {}
    sd = index.get("metadata", {}).get("sparsesync.state_digest", "0" * 16)
    rec = CommitRecord(version=1, epoch=1, writer="w", state_digest=sd, created_at=time.time(), anchor=anchor)
    store.put(commit_key(1, 1), rec.to_json())
    return url, stage


def test_a_sharded_anchor_in_a_bucket_reconstructs_and_follows_bit_exact(tmp_path):
    """Fails on the old reader, which dropped the index and refused every sharded anchor."""
    state = make_state(0)
    url, stage = _sharded_run(tmp_path, state)
    assert len([p for p in stage.iterdir() if p.suffix == ".safetensors"]) == 3
    _rec, got, _d = Run(url).reconstruct()
    assert_bit_equal(got, state)
    f = Follower(url)
    assert f.sync_once() == 1
    assert_bit_equal(f.mirror, state)


def _index_edit(change):  # type: ignore[no-untyped-def]
    def edit(stage: Path) -> None:
        index = json.loads((stage / INDEX_NAME).read_text())
        change(index)
        (stage / INDEX_NAME).write_text(json.dumps(index))
    return edit


def _move_to_missing(index: dict) -> None:
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "model-00004-of-00004.safetensors"


def _traverse(index: dict) -> None:
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = "../" + index["weight_map"][name]


def _swap_homes(index: dict) -> None:
    wm = index["weight_map"]
    a, b = sorted(wm, key=lambda n: wm[n])[0], sorted(wm, key=lambda n: wm[n])[-1]
    wm[a], wm[b] = wm[b], wm[a]


def _other_digest(index: dict) -> None:
    index["metadata"]["sparsesync.state_digest"] = "0" * 16


def _overlap(stage: Path) -> None:
    """Shard 2 holds shard 1's tensor too (with its digest): two files claim one tensor."""
    from safetensors import safe_open

    p1, p2 = stage / "model-00001-of-00003.safetensors", stage / "model-00002-of-00003.safetensors"
    with safe_open(str(p1), "pt") as f1, safe_open(str(p2), "pt") as f2:
        meta = f2.metadata()
        t = {k: f2.get_tensor(k) for k in f2.keys()}
        extra = sorted(f1.keys())[0]
        t[extra] = f1.get_tensor(extra)
        digests = {
            **json.loads(meta["sparsesync.digests"]),
            extra: json.loads(f1.metadata()["sparsesync.digests"])[extra],
        }
    save_file(t, str(p2), metadata={**meta, "sparsesync.digests": json.dumps(digests)})


def _other_weights(stage: Path) -> None:
    """A shard rewritten with other values but its old digests in its metadata."""
    from safetensors import safe_open

    p = stage / "model-00003-of-00003.safetensors"
    with safe_open(str(p), "pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) + 1 for k in f.keys()}
    save_file(t, str(p), metadata=meta)


@pytest.mark.parametrize(
    "edit,error,words",
    [
        (_index_edit(_move_to_missing), PatchFormatError, "weight_map does not match"),
        (_index_edit(_traverse), PatchFormatError, "weight_map does not match"),
        (_index_edit(_swap_homes), PatchFormatError, "in other files than the ones holding them"),
        (_index_edit(_other_digest), DigestMismatchError, "state digest"),
        (_overlap, PatchFormatError, "appears in two shards"),
        (_other_weights, DigestMismatchError, "digest"),
    ],
    ids=[
        "index-names-missing-file",
        "index-traversal-name",
        "index-wrong-homes",
        "index-state-digest",
        "overlapping-tensors",
        "shard-with-stale-digests",
    ],
)
def test_hostile_sharded_anchors_fail_loudly(tmp_path, edit, error, words):
    url, _ = _sharded_run(tmp_path, make_state(0), edit)
    run = Run(url)
    with pytest.raises(error, match=words):
        run.reconstruct()
    f = Follower(url)  # a follower never serves it: nothing to load, and it says why
    assert f.sync_once() is None and f.current_version is None and f.status().state == "degraded"


def test_anchor_bytes_that_do_not_match_their_commit_are_refused(tmp_path):
    url, _ = _sharded_run(tmp_path, make_state(0))
    rec = Run(url).commit(1)
    victim = Path(url) / rec.anchor[1].key
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError, match="anchor file .* is corrupt"):
        Run(url).reconstruct()


@pytest.mark.parametrize(
    "names,reason",
    [
        (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], "neither model.safetensors alone"),
        (
            ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", INDEX_NAME],
            "neither model.safetensors alone",
        ),
        (
            ["model-00001-of-00002.safetensors", "model-00002-of-00003.safetensors", INDEX_NAME],
            "neither model.safetensors alone",
        ),
        (["model.safetensors", INDEX_NAME], "neither model.safetensors alone"),
        (["../model.safetensors"], "is not a anchor object name"),
        (["..", "model.safetensors"], "is not a anchor object name"),
        (["weights.bin"], "is not a anchor object name"),
    ],
)
def test_commit_records_name_only_transformers_anchor_files(tmp_path, names, reason):
    prefix = anchor_prefix(1, 1, "0123456789ab")
    raw = {
        "version": 1,
        "epoch": 1,
        "writer": "w",
        "state_digest": "0" * 16,
        "created_at": 1.0,
        "format": "sparsesync-commit/1",
        "anchor": [{"key": prefix + n, "size": 1, "xxh3": "0" * 16} for n in names],
    }
    with pytest.raises(MalformedCommitError, match=reason):
        CommitRecord.from_json(json.dumps(raw).encode(), commit_key(1, 1))
    raw["anchor"] = [
        {"key": prefix + n, "size": 1, "xxh3": "0" * 16}
        for n in ("model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors", INDEX_NAME)
    ]
    assert len(CommitRecord.from_json(json.dumps(raw).encode(), commit_key(1, 1)).anchor) == 3


def test_anchors_in_two_folders_are_refused():
    raw = {
        "version": 1,
        "epoch": 1,
        "writer": "w",
        "state_digest": "0" * 16,
        "created_at": 1.0,
        "format": "sparsesync-commit/1",
        "anchor": [
            {"key": anchor_prefix(1, 1, uid) + n, "size": 1, "xxh3": "0" * 16}
            for uid, n in (
                ("aa", "model-00001-of-00002.safetensors"),
                ("bb", "model-00002-of-00002.safetensors"),
                ("aa", INDEX_NAME),
            )
        ],
    }
    with pytest.raises(MalformedCommitError, match="more than one folder"):
        CommitRecord.from_json(json.dumps(raw).encode(), commit_key(1, 1))


def _gather_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of test_gather_rows_*: its torch.chunk rows of each tensor, gathered to an owner."""
    import torch.distributed as dist

    from sparsesync.protocol.writer.anchor_shards import gather_rows
    from sparsesync.protocol.writer.ranks import shard_rows

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        got = {}
        for name, t in _gather_cases().items():
            owner = len(name) % world
            start, stop = shard_rows(t.shape[0], rank, world)
            whole = gather_rows(t[start:stop], t.shape, t.dtype, owner, rank=rank, world=world,
                                group=dist.group.WORLD, ranks=list(range(world)))
            assert (whole is not None) == (rank == owner)
            if whole is not None:
                got[name] = whole
        save_file(got, f"{out}/rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def _gather_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"seven": torch.randn(7, 5, generator=g).to(torch.bfloat16),  # rows 3, 3, 1
            "two": torch.randn(2, 3, generator=g),  # rows 1, 1 and none on the third rank
            "vector": torch.randn(11, generator=g).to(torch.float16), "empty": torch.zeros(0, 4)}


def test_gather_rows_brings_uneven_shards_whole_to_their_owner_alone(tmp_path):
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gather_rank, args=(3, port, str(tmp_path)), nprocs=3, join=True)
    got = {k: v for r in range(3) for k, v in load_file(tmp_path / f"rank{r}.safetensors").items()}
    assert_bit_equal(got, _gather_cases())
