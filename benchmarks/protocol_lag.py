"""End-to-end version lag: publish() call -> every follower applied and verified the version.

Sparse sync (sparsesync's publisher and followers) side by side with syncing the full
checkpoint through the same store in the same run, with 1, 4 and 8 followers, on the local
store, on S3 over loopback (moto's server), and on S3 behind a link limited to
`--link-mbit` per connection ("s3-wan": what a replica in another region sees; a loopback
TCP proxy paces the bytes). Followers run in their own processes, as replicas do, and so does
the S3 service (with its proxy). All of them share this machine's cores, which real replicas
on their own machines do not: with several followers the lag here includes waiting for CPU. Also
reports how long the trainer was blocked per step and the bytes it uploaded. The first
`--warmup` deltas are applied but not timed (each process's first decode runs cold), the same
for both modes. Each version is one AdamW step at `--lr` with fp32 master weights on realistic
bf16 weights (the codec benchmark's generator, benchmarks/_codec_data.py: about 1.6% of
elements change at 1e-6).

    .venv/bin/python benchmarks/protocol_lag.py                      # 0.6B params, all stores
    .venv/bin/python benchmarks/protocol_lag.py --params 50e6 --followers 1,2 --store local
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import make_weights, qwen_like_shapes, step  # noqa: E402 - the codec benchmark's realistic AdamW deltas


# -- the S3 service (its own process, as a real store is: not sharing the trainer's CPU time) --
def _s3_service(link_bps: float | None, ready, stop) -> None:  # type: ignore[no-untyped-def]
    """moto's S3 server on loopback, behind a paced TCP proxy when `link_bps` is set."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = None
    if link_bps:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.tcp_proxy import TcpProxy

        proxy = TcpProxy(host, port, rate=link_bps).start()
        host, port = "127.0.0.1", proxy.port
    ready.put(f"http://{host}:{port}")
    stop.wait()
    server.stop()


@contextlib.contextmanager
def bench_store(kind: str, link_bps: float | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """(base URL, env for child processes) of a fresh store: "local" (a temp folder) or S3
    (moto's server in its own process, paced to `link_bps` when given); removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="sparsesync-bench-"))
    service, stop = None, None
    try:
        if kind == "local":
            yield f"file://{tmp}", {}
            return
        import boto3

        ctx = mp.get_context("spawn")
        ready, stop = ctx.Queue(), ctx.Event()
        service = ctx.Process(target=_s3_service, args=(link_bps, ready, stop), daemon=True)
        service.start()
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": ready.get(timeout=120)}
        os.environ.update(env)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
        yield "s3://bench/runs", env
    finally:
        if service is not None and stop is not None:
            stop.set()
            service.join(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


# -- followers (each in its own process) ---------------------------------------------------
def _sparse_follower(url: str, n_versions: int, ready, results, env: dict) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(env)
    from sparsesync.protocol.follower import Follower

    f = Follower(url, poll_interval=0.02, max_poll_interval=0.05)
    f.sync_once()
    ready.put(f.current_version)
    seen = f.current_version
    while seen < n_versions:
        f.sync_once()
        if f.current_version != seen:
            seen = f.current_version
            results.put((seen, time.time()))
        else:
            time.sleep(0.01)


def _full_follower(url: str, n_versions: int, ready, results, env: dict) -> None:  # type: ignore[no-untyped-def]
    os.environ.update(env)
    from safetensors.torch import load

    from sparsesync.codec import state_digest, tensor_digests
    from sparsesync.store import open_store

    store = open_store(url)
    weights: dict[str, torch.Tensor] | None = None
    ready.put(0)
    seen = 0
    while seen < n_versions:
        done = sorted(int(o.key.split("/")[1][1:]) for o in store.list("full-done/"))
        nxt = [v for v in done if v > seen]
        if not nxt:
            time.sleep(0.01)
            continue
        v = nxt[-1]
        expected = store.get(f"full-done/v{v:06d}").decode()
        state = load(store.get(f"full/v{v:06d}.safetensors"))
        if weights is None:
            weights = state
        else:
            for k, t in state.items():
                weights[k].copy_(t)
        assert state_digest(tensor_digests(weights)) == expected, "full checkpoint digest mismatch"
        seen = v
        results.put((v, time.time()))


def bench(store_url: str, n_followers: int, shapes, n_versions: int, env: dict, lr: float, warmup: int) -> dict:  # type: ignore[no-untyped-def]
    from safetensors.torch import save

    from sparsesync.codec import state_digest, tensor_digests
    from sparsesync.protocol.publisher import Publisher
    from sparsesync.store import open_store

    ctx = mp.get_context("spawn")
    out = {}
    for mode in ("sparse", "full"):
        url = f"{store_url.rstrip('/')}/{mode}-{n_followers}-{time.time_ns()}"
        store = open_store(url, create=True)
        state = make_weights(shapes, seed=0)
        pub = Publisher(store, anchor_every=1000, anchor_fraction=1e9) if mode == "sparse" else None
        # version 1: the starting point every follower loads before timing starts
        if pub:
            pub.publish(state, 1)
            pub.flush()
        ready, results = ctx.Queue(), ctx.Queue()
        target = _sparse_follower if mode == "sparse" else _full_follower
        procs = [ctx.Process(target=target, args=(url, n_versions, ready, results, env)) for _ in range(n_followers)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=600)
        lags, blocked, uploaded = [], [], 0
        for v in range(2, n_versions + 1):
            state = step(state, lr, master=True, seed=v)  # one AdamW step with fp32 master weights
            t_call = time.time()
            if pub:
                pub.publish(state, v)
                was_blocked = time.time() - t_call
                pub.flush()
                uploaded += pub.metrics[-1]["patch_bytes"]
            else:
                data = save(state)
                was_blocked = time.time() - t_call
                store.put(f"full/v{v:06d}.safetensors", data)
                uploaded += len(data)
                store.put(f"full-done/v{v:06d}", state_digest(tensor_digests(state)).encode())
                del data
            applied = []
            while len(applied) < n_followers:
                ver, t = results.get(timeout=600)
                if ver == v:
                    applied.append(t)
            if v >= 2 + warmup:  # the first deltas run cold (first decode in each process): not timed
                lags.append(max(applied) - t_call)
                blocked.append(was_blocked)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if pub:
            pub.close()
        out[mode] = {
            "lag_s": statistics.median(lags), "lags_s": lags, "blocked_s": statistics.median(blocked),
            "uploaded_per_version": uploaded / (n_versions - 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.6e9)
    ap.add_argument("--followers", default="1,4,8")
    ap.add_argument("--versions", type=int, default=5, help="versions per measurement (the first is the start)")
    ap.add_argument("--warmup", type=int, default=1, help="deltas after the start that are applied but not timed")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of each step (fp32 master weights)")
    ap.add_argument("--store", default="local,s3,s3-wan", help="comma-separated: local, s3, s3-wan")
    ap.add_argument("--link-mbit", type=float, default=500.0, help="s3-wan: Mbit/s per connection")
    ap.add_argument("--json", default="benchmarks/results/protocol_lag.json", help="where to write results")
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    shapes = qwen_like_shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"model: {n / 1e6:.0f}M params ({2 * n / 1e9:.2f} GB bf16), {len(shapes)} tensors; AdamW lr {args.lr:g} with fp32 "
          f"master weights; {args.versions - 1 - args.warmup} timed versions per cell after {args.warmup} warm-up (median reported)")
    rows = []
    for kind in args.store.split(","):
        with bench_store(kind, args.link_mbit * 1e6 / 8 if kind == "s3-wan" else None) as (base, env):
            for nf in [int(x) for x in args.followers.split(",")]:
                res = bench(base, nf, shapes, args.versions, env, args.lr, args.warmup)
                s, f = res["sparse"], res["full"]
                rows.append({"store": kind, "followers": nf, "sparse": s, "full": f})
                if args.json:  # after every cell: a crash later keeps what was measured
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(json.dumps({"params": n, "lr": args.lr, "link_mbit": args.link_mbit, "warmup": args.warmup, "rows": rows}, indent=1))
                print(f"{kind:5} followers={nf}: sparse lag {s['lag_s']:.3f} s (trainer blocked {s['blocked_s']:.3f} s, "
                      f"uploads {s['uploaded_per_version'] / 1e6:.1f} MB/version) | full lag {f['lag_s']:.3f} s "
                      f"(uploads {f['uploaded_per_version'] / 1e6:.0f} MB/version) | full/sparse lag "
                      f"{f['lag_s'] / s['lag_s']:.1f}x", flush=True)


if __name__ == "__main__":
    main()
