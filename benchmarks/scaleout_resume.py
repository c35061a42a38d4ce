"""A sharded run continued at another world size: `resume()` plus a delta, against a new anchor.

One 0.6B-shaped model (benchmarks/_codec_data.py: Qwen3-like bf16 weights, AdamW steps with fp32
master weights at `--lr`). Real gloo ranks on this machine, each holding its dim-0 rows of every
tensor as DTensors (what FSDP2 `fully_shard` gives `state_dict()`), publishing through
`Publisher(url)` to a local folder:

1. `--from` ranks publish version 1 (a sharded anchor) and version 2 (a delta in parts);
2. `--to` ranks, holding version 2, `resume()` (the run's units are the old world's rows, so the
   weights are hashed over them: every tensor gathered to one rank) and publish version 3: a delta;
3. the same `--to` ranks without `resume()` publish version 3 to a copy of the run: an anchor,
   which is what a new writer at another world size published before.

Reports the wall time of each phase (the slowest rank) and the bytes each version 3 uploads.
All ranks share this machine's cores, so times are upper bounds for ranks with their own.

    .venv/bin/python benchmarks/scaleout_resume.py                  # 0.6B, 2 ranks -> 4 ranks
    .venv/bin/python benchmarks/scaleout_resume.py --params 5e7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import make_weights, qwen_like_shapes, step  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, job: dict, out: mp.Queue) -> None:
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.protocol.writer.ranks import shard_rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def sharded(path: str) -> dict[str, DTensor]:  # this rank's rows of every tensor, as DTensors
        state = {}
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no iterator
                sl = f.get_slice(name)
                rows = sl.get_shape()[0]
                start, stop = shard_rows(rows, rank, world)
                state[name] = DTensor.from_local(sl[start:stop].contiguous(), mesh, [Shard(0)], run_check=False)
        return state

    report: dict = {"rank": rank}
    for phase in job["phases"]:
        pub = Publisher(phase["url"], anchor_every=0, anchor_fraction=1e9)
        if phase.get("resume"):
            state = sharded(phase["resume"])
            dist.barrier()
            t0 = time.perf_counter()
            pub.resume(state)
            report["resume_s"] = time.perf_counter() - t0
        for v, path in phase["publish"]:
            state = sharded(path)
            dist.barrier()
            t0 = time.perf_counter()
            pub.publish(state, v)
            pub.flush()
            report[f"{phase['name']}_v{v}_s"] = time.perf_counter() - t0
        pub.close()
    out.put(report)
    dist.destroy_process_group()


def _launch(world: int, job: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return got


def _slowest(reports: list[dict], key: str) -> float:
    return max(r[key] for r in reports)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.6e9)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--from", dest="world_from", type=int, default=2)
    ap.add_argument("--to", dest="world_to", type=int, default=4)
    ap.add_argument("--json", default="benchmarks/results/scaleout_resume.json")
    args = ap.parse_args()
    from safetensors.torch import save_file

    from sparsesync.protocol.run import Run

    tmp = Path(tempfile.mkdtemp(prefix="scaleout-resume-"))
    try:
        weights = [make_weights(qwen_like_shapes(args.params), seed=0)]
        for s in (1, 2):
            weights.append(step(weights[-1], args.lr, master=True, seed=s))
        paths = []
        for i, w in enumerate(weights):
            paths.append(str(tmp / f"v{i + 1}.safetensors"))
            save_file(w, paths[-1])
        n = sum(t.numel() for t in weights[0].values())
        del weights
        print(
            f"model: {n / 1e6:.0f}M params ({2 * n / 1e9:.2f} GB bf16); {args.world_from} ranks -> {args.world_to} "
            "ranks "
            f"(gloo, one machine of {os.cpu_count()} cores shared by all ranks)"
        )
        run, copy = str(tmp / "run"), str(tmp / "run-anchor")
        first = _launch(
            args.world_from, {"phases": [{"name": "first", "url": run, "publish": [(1, paths[0]), (2, paths[1])]}]}
        )
        shutil.copytree(run, copy)
        resumed = _launch(args.world_to, {"phases": [
            {"name": "resumed", "url": run, "resume": paths[1], "publish": [(3, paths[2])]},
            {"name": "anchor", "url": copy, "publish": [(3, paths[2])]},
        ]})
        r3, a3 = Run(run).commit(3), Run(copy).commit(3)
        row = {
            "params": n, "world_from": args.world_from, "world_to": args.world_to, "lr": args.lr,
            "first_anchor_s": _slowest(first, "first_v1_s"), "first_delta_s": _slowest(first, "first_v2_s"),
            "resume_s": _slowest(resumed, "resume_s"), "resumed_v3_s": _slowest(resumed, "resumed_v3_s"),
            "resumed_v3_kind": "delta" if r3.parts and not r3.has_anchor else "anchor",
            "resumed_v3_bytes": sum(o.size for o in r3.delta_objects()) + sum(o.size for o in r3.anchor),
            "anchor_v3_s": _slowest(resumed, "anchor_v3_s"),
            "anchor_v3_kind": "anchor" if a3.has_anchor and not a3.parts else "delta",
            "anchor_v3_bytes": sum(o.size for o in a3.anchor) + sum(o.size for o in a3.delta_objects()),
        }
        print(
            f"{args.world_from} ranks: version 1 (anchor) {row['first_anchor_s']:.2f} s, version 2 (delta) "
            f"{row['first_delta_s']:.2f} s"
        )
        print(
            f"{args.world_to} ranks, resume(): {row['resume_s']:.2f} s, then version 3 is a {row['resumed_v3_kind']}: "
            f"{row['resumed_v3_s']:.2f} s, {row['resumed_v3_bytes'] / 1e6:.2f} MB uploaded"
        )
        print(
            f"{args.world_to} ranks, no resume(): version 3 is an {row['anchor_v3_kind']}: {row['anchor_v3_s']:.2f} s, "
            f"{row['anchor_v3_bytes'] / 1e6:.1f} MB uploaded "
            f"({row['anchor_v3_bytes'] / max(row['resumed_v3_bytes'], 1):.0f}x the delta)"
        )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": [row]}, indent=1))
        print(f"wrote {args.json}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
