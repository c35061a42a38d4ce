"""End-to-end version lag: publish() call -> every follower applied and verified the version.

Sparse sync (sparsesync's publisher and followers) side by side with syncing the full
checkpoint through the same store in the same run, with 1, 4 and 8 followers, on the local
store, on S3 over loopback (moto's server), and on S3 behind a link limited to
`--link-mbit` in each direction, shared by all connections ("s3-wan": what a replica in another
region sees; a loopback TCP proxy paces the bytes with one token bucket per direction; before
2026-11-26 the pace was per connection, see benchmarks/results/measured_history.md). On S3 the
full checkpoint goes up through the product's own multipart upload (S3Store.put of a file
over 64 MiB: boto3's multipart upload in its default 8 MiB parts, 8 at a time), as the
publisher's large objects do. Followers run in their own processes, as replicas do, and so does
the S3 service (with its proxy). All of them share this machine's cores, which real replicas
on their own machines do not: with several followers the lag here includes waiting for CPU. Also
reports how long the trainer was blocked per step and the bytes it uploaded. The first
`--warmup` deltas are applied but not timed (each process's first decode runs cold), the same
for both modes. Each version is one AdamW step at `--lr` with fp32 master weights on realistic
bf16 weights (the codec benchmark's generator, benchmarks/_codec_data.py: about 1.6% of
elements change at 1e-6).

    .venv/bin/python benchmarks/protocol_lag.py                      # 0.6B params, all stores
    .venv/bin/python benchmarks/protocol_lag.py --params 50e6 --followers 1,2 --store local
    .venv/bin/python benchmarks/protocol_lag.py --modes sparse,parts,full --followers 1 --pin   # issue 15
    .venv/bin/python benchmarks/protocol_lag.py ... --effort speed   # the codec without class-conditioned coding

Modes: `sparse` one delta file per version (`part_bytes=0`), `parts` the version in parts of
`--part-bytes` uploaded as each is encoded (followers fetch and decode parts concurrently),
`full` the whole checkpoint. With `--pin` the trainer (this process) runs on core 0 and every
follower on core 1 (`os.sched_setaffinity`, what `taskset` does), so they behave like separate
machines, and the S3 service (moto and the paced proxy: the store and the network, neither the
trainer's work nor a follower's) runs on core 1 beside the followers (`--store-core trainer`:
on core 0 beside the trainer; `any`: on either); without `--pin` everything shares every core. For each sparse mode it
also reports the trainer's diff+encode time, the follower's fetch+decode+apply time, and the issue's lag bound
1.3 x max(encode, decode+apply) + transfer (transfer: bytes over `--link-mbit` on s3-wan, else 0).
In parts mode the follower decodes most parts before the commit, so its fetch+decode+apply
after the commit is only part of its work: each sparse row also reports the CPU seconds per
version of the busiest follower process (all its work: polls, fetches, decode, hashing, writes)
and of the S3 service process, and the bound computed with the follower's CPU instead, and
splits the lag at the commit: when the publisher stored the commit record (after publish() was
called) and how long the follower took from then to applied (medians).
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
# the codec benchmark's realistic AdamW deltas
from _codec_data import make_weights, qwen_like_shapes, step  # noqa: E402


# -- the S3 service (its own process, as a real store is: not sharing the trainer's CPU time) --
def _s3_service(link_bps: float | None, ready, stop, core: int | None = None) -> None:  # type: ignore[no-untyped-def]
    """moto's S3 server on loopback, behind a paced TCP proxy when `link_bps` is set."""
    _pin(core)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = None
    if link_bps:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.support.tcp_proxy import TcpProxy

        proxy = TcpProxy(host, port, rate=link_bps).start()
        host, port = "127.0.0.1", proxy.port
    ready.put(f"http://{host}:{port}")
    stop.wait()
    server.stop()


def _cpu_s(pids: list[int | None]) -> list[float]:
    """CPU seconds (user + system) each process has used so far (0 for None)."""
    import psutil

    return [sum(psutil.Process(p).cpu_times()[:2]) if p else 0.0 for p in pids]


@contextlib.contextmanager
def bench_store(
    kind: str, link_bps: float | None = None, core: int | None = None
) -> Iterator[tuple[str, dict[str, str], int | None]]:
    """(base URL, env for child processes, the S3 service's pid or None) of a fresh store: "local" (a temp folder) or S3
    (moto's server in its own process on `core` if given, else on every core, paced to
    `link_bps` when given); removed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="sparsesync-bench-"))
    service, stop = None, None
    try:
        if kind == "local":
            yield f"file://{tmp}", {}, None
            return
        import boto3

        ctx = mp.get_context("spawn")
        ready, stop = ctx.Queue(), ctx.Event()
        service = ctx.Process(target=_s3_service, args=(link_bps, ready, stop, core), daemon=True)
        service.start()
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": ready.get(timeout=120)}
        os.environ.update(env)
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket="bench")
        yield "s3://bench/runs", env, service.pid
    finally:
        if service is not None and stop is not None:
            stop.set()
            service.join(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


# -- followers (each in its own process) ---------------------------------------------------
def _pin(core: int | None) -> None:
    """Run this process on `core` only; None: on every core of the machine (a child spawned by a
    pinned process would otherwise inherit its parent's core)."""
    os.sched_setaffinity(0, {core} if core is not None else range(os.cpu_count() or 1))


def _sparse_follower(url: str, n_versions: int, ready, results, env: dict, core: int | None = None,
                     max_poll: float = 0.1, poll: float = 0.02) -> None:
    os.environ.update(env)
    _pin(core)
    from sparsesync.protocol.follower.follower import Follower

    # the product's own poll loop (`Follower.start`): `--poll` (20 ms) between polls while versions
    # or their parts arrive, backing off to `--max-poll` while the store is quiet
    f = Follower(url, poll_interval=poll, max_poll_interval=max_poll)
    f.sync_once()
    ready.put(f.current_version)
    seen = f.current_version
    f.start()
    while seen < n_versions:
        f.wait_for_version(seen + 1, timeout=600)
        st = f.status()
        seen = st.current_version
        results.put((seen, st.last_apply_at, st.last_fetch_s))
    f.stop()


def _full_follower(url: str, n_versions: int, ready, results, env: dict, core: int | None = None,
                   max_poll: float = 0.1, poll: float = 0.02) -> None:
    os.environ.update(env)
    _pin(core)
    from safetensors.torch import load

    from sparsesync.codec import state_digest, tensor_digests
    from sparsesync.store import open_store

    store = open_store(url)
    weights: dict[str, torch.Tensor] | None = None
    ready.put(0)
    seen, wait = 0, poll
    while seen < n_versions:
        done = sorted(int(o.key.split("/")[1][1:]) for o in store.list("full-done/"))
        nxt = [v for v in done if v > seen]
        if not nxt:  # the sparse follower's backoff: `poll`, growing 1.5x up to max_poll while nothing is new
            time.sleep(wait)
            wait = min(wait * 1.5, max_poll)
            continue
        wait = poll
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
        results.put((v, time.time(), None))


def _note_commits(store, written: dict[int, float]) -> None:  # type: ignore[no-untyped-def]
    """Record in `written` when each commit record `store` writes is stored (unix time by version):
    the publisher's store, wrapped, so the lag splits into the trainer's part (publish() to
    its commit) and the follower's (the commit to applied)."""
    from sparsesync.protocol.keys import parse_commit_key

    put = store.put

    def timed_put(key, data):  # type: ignore[no-untyped-def]
        put(key, data)
        if (parsed := parse_commit_key(key)) is not None:
            written[parsed[0]] = time.time()

    store.put = timed_put


def versions(shapes, n_versions: int, lr: float) -> list[dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """The weights of versions 1..n_versions (one AdamW step each), made once for every cell."""
    seq = [make_weights(shapes, seed=0)]
    for v in range(2, n_versions + 1):
        seq.append(step(seq[-1], lr, master=True, seed=v))  # one AdamW step with fp32 master weights
    return seq


def bench(
    store_url: str,
    n_followers: int,
    seq,
    n_versions: int,
    env: dict,
    lr: float,
    warmup: int,  # type: ignore[no-untyped-def]
    modes: tuple[str, ...] = ("sparse", "full"),
    part_bytes: int = 256 << 20,
    pin: bool = False,
    effort: str = "size",
    max_poll: float = 0.1,
    poll: float = 0.02,
    store_pid: int | None = None,
) -> dict:
    from safetensors.torch import save, save_file

    from sparsesync.codec import state_digest, tensor_digests
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import open_store

    ctx = mp.get_context("spawn")
    out = {}
    for mode in modes:
        url = f"{store_url.rstrip('/')}/{mode}-{n_followers}-{time.time_ns()}"
        store = open_store(url, create=True)
        committed: dict[int, float] = {}
        _note_commits(store, committed)
        state = seq[0]
        pub = (
            Publisher(
                store,
                anchor_every=1000,
                anchor_fraction=1e9,
                part_bytes=part_bytes if mode == "parts" else 0,
                effort=effort,
            )
            if mode != "full"
            else None
        )
        # version 1: the starting point every follower loads before timing starts
        if pub:
            pub.publish(state, 1)
            pub.flush()
        ready, results = ctx.Queue(), ctx.Queue()
        target = _full_follower if mode == "full" else _sparse_follower
        procs = [
            ctx.Process(target=target, args=(url, n_versions, ready, results, env, 1 if pin else None, max_poll, poll))
            for _ in range(n_followers)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=600)
        lags, blocked, uploaded, encode, follower, to_commit, after_commit = [], [], 0, [], [], [], []
        watched = [p.pid for p in procs] + [store_pid]
        for v in range(2, n_versions + 1):
            state = seq[v - 1]
            if v == 2 + warmup:  # CPU used by each follower and the store over the timed versions
                cpu0 = _cpu_s(watched)
            t_call = time.time()
            if pub:
                pub.publish(state, v)
                was_blocked = time.time() - t_call
                pub.flush()
                uploaded += pub.metrics[-1]["patch_bytes"]
                enc_s = pub.metrics[-1]["diff_s"] + pub.metrics[-1]["encode_s"]
            elif store_url.startswith("s3://"):  # the product's multipart upload of a file
                ckpt = Path(tempfile.mkdtemp(prefix="sparsesync-full-")) / "model.safetensors"
                save_file(state, ckpt)
                was_blocked = time.time() - t_call
                store.put(f"full/v{v:06d}.safetensors", ckpt)
                uploaded += ckpt.stat().st_size
                store.put(f"full-done/v{v:06d}", state_digest(tensor_digests(state)).encode())
                shutil.rmtree(ckpt.parent, ignore_errors=True)
            else:
                data = save(state)
                was_blocked = time.time() - t_call
                store.put(f"full/v{v:06d}.safetensors", data)
                uploaded += len(data)
                store.put(f"full-done/v{v:06d}", state_digest(tensor_digests(state)).encode())
                del data
            applied, fetch_s = [], []
            while len(applied) < n_followers:
                ver, t, fs = results.get(timeout=600)
                if ver == v:
                    applied.append(t)
                    fetch_s.append(fs)
            if v >= 2 + warmup:  # the first deltas run cold (first decode in each process): not timed
                lags.append(max(applied) - t_call)
                blocked.append(was_blocked)
                if pub:
                    encode.append(enc_s)
                    follower.append(max(fetch_s))
                    to_commit.append(committed[v] - t_call)
                    after_commit.append(max(applied) - committed[v])
        timed = n_versions - 1 - warmup
        cpu = [(b - a) / timed for a, b in zip(cpu0, _cpu_s(watched))]
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if pub:
            pub.close()
        out[mode] = {
            "lag_s": statistics.median(lags), "lags_s": lags, "blocked_s": statistics.median(blocked),
            "uploaded_per_version": uploaded / (n_versions - 1),
            "follower_cpu_s": max(cpu[:-1]), "store_cpu_s": cpu[-1],  # per timed version (the busiest follower)
        }
        if pub:  # trainer diff+encode; follower fetch+verify+decode+apply to its mirror (median)
            out[mode].update(encode_s=statistics.median(encode), follower_s=statistics.median(follower),
                             commit_s=statistics.median(to_commit), after_commit_s=statistics.median(after_commit))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.6e9)
    ap.add_argument("--followers", default="1,4,8")
    ap.add_argument("--versions", type=int, default=5, help="versions per measurement (the first is the start)")
    ap.add_argument("--warmup", type=int, default=1, help="deltas after the start that are applied but not timed")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of each step (fp32 master weights)")
    ap.add_argument("--store", default="local,s3,s3-wan", help="comma-separated: local, s3, s3-wan")
    ap.add_argument(
        "--link-mbit",
        type=float,
        default=500.0,
        help="s3-wan: Mbit/s of the link in each direction, shared by all its connections",
    )
    ap.add_argument("--modes", default="sparse,full", help="comma-separated: sparse (one file), parts, full")
    ap.add_argument("--part-bytes", type=int, default=256 << 20, help="parts mode: tensor bytes per part")
    ap.add_argument(
        "--effort",
        default="size",
        help="the publisher's codec effort: size (default) or speed (sparsesync.codec.Effort)",
    )
    ap.add_argument(
        "--max-poll",
        type=float,
        default=0.1,
        help="followers: longest wait between polls while nothing is new (the product's poll loop; 20 ms while parts "
             "arrive)",
    )
    ap.add_argument(
        "--poll",
        type=float,
        default=0.02,
        help="followers: wait between polls while a version streams in (the product's poll_interval)",
    )
    ap.add_argument(
        "--pin", action="store_true", help="trainer on core 0, followers and the S3 service on core 1 (like taskset)"
    )
    ap.add_argument("--store-core", default="follower", choices=["follower", "trainer", "any"],
                    help="with --pin: where the S3 service runs (a third machine in reality; this box has two cores): "
                         "beside the followers (default), beside the trainer, or on either core")
    ap.add_argument("--json", default="benchmarks/results/protocol_lag.json", help="where to write results")
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    shapes = qwen_like_shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes.values())
    print(
        f"model: {n / 1e6:.0f}M params ({2 * n / 1e9:.2f} GB bf16), {len(shapes)} tensors; AdamW lr {args.lr:g} with "
        "fp32 "
        f"master weights; codec effort {args.effort}; {args.versions - 1 - args.warmup} timed versions per cell after "
        f"{args.warmup} warm-up (median reported)"
    )
    rows = []
    modes = tuple(args.modes.split(","))
    if args.pin:
        _pin(0)
    seq = versions(shapes, args.versions, args.lr)
    for kind in args.store.split(","):
        store_core = {"follower": 1, "trainer": 0, "any": None}[args.store_core] if args.pin else None
        with bench_store(kind, args.link_mbit * 1e6 / 8 if kind == "s3-wan" else None, store_core) as (
            base,
            env,
            store_pid,
        ):
            for nf in [int(x) for x in args.followers.split(",")]:
                res = bench(
                    base,
                    nf,
                    seq,
                    args.versions,
                    env,
                    args.lr,
                    args.warmup,
                    modes,
                    args.part_bytes,
                    args.pin,
                    args.effort,
                    args.max_poll,
                    args.poll,
                    store_pid,
                )
                rows.append({"store": kind, "followers": nf, **res})
                if args.json:  # after every cell: a crash later keeps what was measured
                    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.json).write_text(
                        json.dumps(
                            {
                                "params": n,
                                "lr": args.lr,
                                "effort": args.effort,
                                "link_mbit": args.link_mbit,
                                "poll": args.poll,
                                "warmup": args.warmup,
                                "pin": args.pin,
                                "store_core": args.store_core if args.pin else "any",
                                "rows": rows,
                            },
                            indent=1,
                        )
                    )
                link = args.link_mbit * 1e6 / 8 if kind == "s3-wan" else None
                for mode, r in res.items():
                    line = (
                        f"{kind:6} followers={nf} {mode:6}: lag {r['lag_s']:.3f} s, uploads "
                        f"{r['uploaded_per_version'] / 1e6:.2f} MB/version"
                    )
                    if mode != "full":
                        transfer = r["uploaded_per_version"] / link if link else 0.0
                        bound = 1.3 * max(r["encode_s"], r["follower_s"]) + transfer
                        line += (
                            f", trainer blocked {r['blocked_s']:.3f} s, encode {r['encode_s']:.3f} s, follower "
                            "fetch+decode+apply "
                            f"{r['follower_s']:.3f} s, bound 1.3*max+transfer {bound:.3f} s "
                            f"({'met' if r['lag_s'] <= bound else 'NOT met'})"
                        )
                        # in parts mode the follower decodes most parts before the commit: its
                        # fetch+decode+apply above is only the part after the commit; its CPU
                        # seconds per version are all of its work (fetch, decode, hash, write, polls)
                        bound_cpu = 1.3 * max(r["encode_s"], r["follower_cpu_s"]) + transfer
                        line += (
                            f"; follower CPU {r['follower_cpu_s']:.3f} s/version, store CPU {r['store_cpu_s']:.3f} "
                            "s/version, "
                            f"bound with the follower's CPU {bound_cpu:.3f} s "
                            f"({'met' if r['lag_s'] <= bound_cpu else 'NOT met'})"
                        )
                        line += (f"; commit stored {r['commit_s']:.3f} s after publish(), "
                                 f"the follower applied it {r['after_commit_s']:.3f} s later")
                        if "full" in res:
                            line += f", full/{mode} lag {res['full']['lag_s'] / r['lag_s']:.1f}x"
                        if mode == "parts" and "sparse" in res:
                            line += (
                                ", bytes vs one file "
                                f"{r['uploaded_per_version'] / res['sparse']['uploaded_per_version']:.4f}x"
                            )
                    print(line, flush=True)


if __name__ == "__main__":
    main()
