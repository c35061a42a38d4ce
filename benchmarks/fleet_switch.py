"""Switch spread: how far apart in time the replicas of a fleet go live with each version.

Three (`--replicas`) follower processes with heartbeats follow one run while a Publisher writes
`--versions` versions, one every `--every` seconds (AdamW steps at lr 1e-6 on Qwen-like bf16
weights, benchmarks/_codec_data.py). For every version applied by all replicas, the spread is
the last replica's apply time minus the first's (wall clock of this one machine, taken in the
engine hook, i.e. when the engine switches). Measured twice on the same store, poll interval
and weights: replicas that apply as soon as they have staged (independent), and with
coordinated switching (stage, report "staged", apply at the switch record's apply_at, written
by the replicas' all-staged rule). Also reports the lag from publish() to the last replica
applying, which coordination lengthens by the switch lead. Stores: the local folder, and S3
over loopback (moto's server in its own process).

    .venv/bin/python benchmarks/fleet_switch.py                       # local and s3, 20 versions
    .venv/bin/python benchmarks/fleet_switch.py --store local --versions 5

Writes benchmarks/results/fleet_switch.json and prints a table. Every process shares this
machine's cores, so staging times vary more here than on replicas with their own machines.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import make_weights, qwen_like_shapes, step  # noqa: E402 - realistic AdamW deltas
from protocol_lag import bench_store  # noqa: E402 - a temp folder, or moto's S3 server in its own process


class _TimedHook:
    """No engine: reports when each version would go live (the hook is the switch)."""

    def __init__(self, replica: str, results) -> None:  # type: ignore[no-untyped-def]
        self.replica, self.results = replica, results

    def load_full(self, version, tensors) -> None:  # type: ignore[no-untyped-def]
        self.results.put((self.replica, version, time.time()))

    def apply_sparse(self, version, updates, full) -> None:  # type: ignore[no-untyped-def]
        self.results.put((self.replica, version, time.time()))


def _replica(url: str, replica: str, coordinated: bool, poll_s: float, results, stop, env: dict) -> None:
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING, format=f"{replica} %(asctime)s %(name)s: %(message)s")
    from sparsesync.protocol.follower.fleet_member import FleetOptions
    from sparsesync.protocol.follower.follower import Follower

    fleet = FleetOptions(replica_id=replica, interval_s=1.0, engine="bench", coordinated=coordinated,
                         switch_deadline_s=30.0)
    f = Follower(url, _TimedHook(replica, results), poll_interval=poll_s, max_poll_interval=poll_s, fleet=fleet)
    f.start()
    stop.wait()
    f.stop()


def bench(base: str, shapes, args, coordinated: bool, env: dict) -> dict:  # type: ignore[no-untyped-def]
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import open_store

    ctx = mp.get_context("spawn")
    url = f"{base.rstrip('/')}/{'coordinated' if coordinated else 'independent'}-{time.time_ns()}"
    pub = Publisher(open_store(url, create=True), anchor_every=1000, anchor_fraction=1e9)
    state = make_weights(shapes, seed=0)
    pub.publish(state, 1)
    pub.flush()
    results, stop = ctx.Queue(), ctx.Event()
    names = [f"r{i}" for i in range(args.replicas)]
    procs = [ctx.Process(target=_replica, args=(url, n, coordinated, args.poll, results, stop, env)) for n in names]
    for p in procs:
        p.start()
    applied: dict[int, dict[str, float]] = {}

    def drain(until_version: int, timeout: float) -> None:
        deadline = time.time() + timeout
        while len(applied.get(until_version, {})) < len(names) and time.time() < deadline:
            try:
                name, v, t = results.get(timeout=0.1)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            applied.setdefault(v, {})[name] = t

    t0 = time.time()
    drain(1, 300)
    pub.wait_for_fleet(1, len(names), timeout=60)  # every heartbeat is up before timing starts
    print(f"  {len(names)} replicas serve version 1 after {time.time() - t0:.1f} s", flush=True)
    published: dict[int, float] = {}
    last = args.versions + 1
    for v in range(2, last + 1):
        t_next = time.time() + args.every
        state = step(state, 1e-6, master=True, seed=v)
        published[v] = time.time()
        pub.publish(state, v)
        drain(-1, max(t_next - time.time(), 0))  # collect while waiting for the next step
    pub.flush()
    drain(last, 120)
    stop.set()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    pub.close()
    full = [v for v in range(2, last + 1) if len(applied.get(v, {})) == len(names)]
    spreads = [max(applied[v].values()) - min(applied[v].values()) for v in full]
    lags = [max(applied[v].values()) - published[v] for v in full]
    return {
        "mode": "coordinated" if coordinated else "independent", "versions_timed": len(full),
        "versions_skipped": (last - 1) - len(full),  # a replica went straight past it (coalesced or caught up)
        "spread_s": _stats(spreads), "lag_s": _stats(lags), "spreads": spreads,
    }


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1],
            "mean": statistics.fmean(s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=5e6)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--versions", type=int, default=20, help="timed versions per mode")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between published versions")
    ap.add_argument("--poll", type=float, default=0.5, help="replicas' poll interval (seconds)")
    ap.add_argument("--store", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--modes", default="independent,coordinated", help="comma-separated: independent, coordinated")
    ap.add_argument("--json", default="benchmarks/results/fleet_switch.json", help="where to write results")
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    shapes = qwen_like_shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"model: {n / 1e6:.0f}M params, {len(shapes)} tensors; {args.replicas} replicas polling every {args.poll} s; "
          f"a version every {args.every} s; {args.versions} versions per mode")
    rows = []
    for kind in args.store.split(","):
        with bench_store(kind) as (base, env, _):
            for coordinated in [m == "coordinated" for m in args.modes.split(",")]:
                res = {"store": kind, **bench(base, shapes, args, coordinated, env)}
                rows.append(res)
                if args.json:  # after every cell: a crash later keeps what was measured
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps({"params": n, "replicas": args.replicas, "poll_s": args.poll,
                                                           "every_s": args.every, "rows": rows}, indent=1))
                sp, lg = res["spread_s"], res["lag_s"]
                print(
                    f"{kind:5} {res['mode']:11}: spread median {sp['median'] * 1e3:7.1f} ms, p90 "
                    f"{sp['p90'] * 1e3:7.1f} ms, "
                    f"max {sp['max'] * 1e3:7.1f} ms | publish->last apply median {lg['median']:.2f} s "
                    f"({res['versions_timed']} versions, {res['versions_skipped']} skipped)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
