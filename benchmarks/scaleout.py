"""Per-rank cost of the distributed publisher: diff+encode time and snapshot memory at world size 1, 2, 4.

One 0.6B-shaped model (benchmarks/_codec_data.py: Qwen3-like bf16 weights, one AdamW step with
fp32 master weights at `--lr`), split over N ranks the way FSDP2 `fully_shard` splits every
parameter (dim-0 rows, torch.chunk). For each rank, exactly what the sharded publisher (`writer.sharded`) runs on
that rank: a `PartedSnapshot` of only its rows (units `name[start:stop]`, grouped into parts of
`--part-bytes`), then `diff_encode` of the next version against it; and the rank's file of a
sharded anchor (`anchor_shards.assign`: the whole tensors it writes, their bytes and the time to
write them; the gather before it is a collective, not measured here). The ranks are measured one
after another in this process (this machine has 2 cores, shared), so each rank's figure is its
own work without contention: what it costs a rank that has its own cores.

    .venv/bin/python benchmarks/scaleout.py                     # 0.6B, world sizes 1,2,4
    .venv/bin/python benchmarks/scaleout.py --params 50e6 --worlds 1,2
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import make_weights, qwen_like_shapes, step  # noqa: E402

from sparsesync.codec.anchor import write_anchor_shard  # noqa: E402
from sparsesync.protocol.records import Unit  # noqa: E402
from sparsesync.protocol.writer.anchor_shards import assign  # noqa: E402
from sparsesync.protocol.writer.parts import PartedSnapshot, group_by_bytes  # noqa: E402
from sparsesync.protocol.writer.ranks import shard_rows  # noqa: E402


def rank_share(
    state: dict[str, torch.Tensor], rank: int, world: int
) -> tuple[dict[str, torch.Tensor], dict[str, Unit]]:
    """{unit key: rows of this rank} (views) and the units, as `writer.ranks.local_units` makes them."""
    out, units = {}, {}
    for name, t in state.items():
        start, stop = shard_rows(t.shape[0], rank, world)
        if stop > start:
            u = Unit(name, (start, stop)) if world > 1 else Unit(name)
            out[u.key], units[u.key] = t[start:stop], u
    return out, units


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.6e9)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--part-bytes", type=int, default=256 << 20)
    ap.add_argument("--repeats", type=int, default=2, help="diff+encode runs per rank (median reported)")
    ap.add_argument("--json", default="benchmarks/results/scaleout.json")
    args = ap.parse_args()
    shapes = qwen_like_shapes(args.params)
    base = make_weights(shapes, seed=0)
    n = sum(t.numel() for t in base.values())
    nexts = [step(base, args.lr, master=True, seed=s + 1) for s in range(args.repeats)]
    print(
        f"model: {n / 1e6:.0f}M params ({2 * n / 1e9:.2f} GB bf16), {len(shapes)} tensors; AdamW lr {args.lr:g}, "
        f"fp32 master weights; parts of {args.part_bytes >> 20} MiB; ranks measured one after another (2 shared cores)"
    )
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="scaleout-anchor-"))
    for world in [int(w) for w in args.worlds.split(",")]:
        per_rank = []
        plan = assign([(k, t.numel() * t.element_size(), True) for k, t in base.items()], world)
        for rank in range(world):
            mine = {k: base[k] for k in plan.names(rank)}
            t0 = time.perf_counter()
            write_anchor_shard(mine, tmp / "shard.safetensors", version=1)
            anchor_write_s = time.perf_counter() - t0
            (tmp / "shard.safetensors").unlink()
            anchor_bytes = sum(t.numel() * t.element_size() for t in mine.values())
            local, units = rank_share(base, rank, world)
            groups = [[units[k] for k in g] for g in group_by_bytes(local, args.part_bytes)]
            t0 = time.perf_counter()
            snap = PartedSnapshot(groups, local, 1)
            snapshot_s = time.perf_counter() - t0
            times, nbytes, changed = [], 0, 0
            for i, nxt in enumerate(nexts):
                if i:  # back to the base: every repeat diffs the same base against a fresh step
                    snap = PartedSnapshot(groups, local, 1)
                cur, _ = rank_share(nxt, rank, world)
                t0 = time.perf_counter()
                parts = snap.diff_encode(cur, 2)
                times.append(time.perf_counter() - t0)
                nbytes = sum(len(p.patch.data) for p in parts)
                changed = sum(p.patch.stats.n_changed for p in parts)
            per_rank.append(
                {
                    "rank": rank,
                    "diff_encode_s": statistics.median(times),
                    "snapshot_bytes": snap.nbytes,
                    "snapshot_s": snapshot_s,
                    "patch_bytes": nbytes,
                    "n_changed": changed,
                    "parts": len(groups),
                    "anchor_bytes": anchor_bytes,
                    "anchor_write_s": anchor_write_s,
                }
            )
            del snap, local
            gc.collect()
        worst = max(r["diff_encode_s"] for r in per_rank)
        row = {"world": world, "ranks": per_rank, "max_rank_diff_encode_s": worst,
               "max_rank_snapshot_bytes": max(r["snapshot_bytes"] for r in per_rank),
               "total_patch_bytes": sum(r["patch_bytes"] for r in per_rank),
               "max_rank_anchor_bytes": max(r["anchor_bytes"] for r in per_rank),
               "max_rank_anchor_write_s": max(r["anchor_write_s"] for r in per_rank)}
        rows.append(row)
        base_row = rows[0]
        print(
            f"world {world}: per-rank diff+encode max {worst:.3f} s (mean "
            f"{statistics.mean(r['diff_encode_s'] for r in per_rank):.3f} s; "
            f"{base_row['max_rank_diff_encode_s'] / worst:.2f}x below world {base_row['world']}), snapshot per rank "
            f"{row['max_rank_snapshot_bytes'] / 1e9:.3f} GB, patch bytes all ranks "
            f"{row['total_patch_bytes'] / 1e6:.2f} MB "
            f"({row['total_patch_bytes'] / base_row['total_patch_bytes']:.4f}x world {base_row['world']}); anchor file "
            "per rank "
            f"max {row['max_rank_anchor_bytes'] / 1e9:.3f} GB written in {row['max_rank_anchor_write_s']:.2f} s",
            flush=True,
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(
                json.dumps({"params": n, "lr": args.lr, "part_bytes": args.part_bytes, "rows": rows}, indent=1)
            )


    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
