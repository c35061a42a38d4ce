"""Pause per sync and version lag of a replica following the tiny model (CPU; embedded and vLLM).

A Publisher writes N versions (bf16 perturbations of the tiny Qwen3) to a local bucket while a
replica (engine + Follower thread, poll interval 50 ms) follows it and a client thread keeps
generating. Per version it records: the pause (engine blocked for the apply), the wait of the
update for the running batch, the follower's fetch+verify+decode time, and the lag from the
commit to the replica serving it (seconds). Version lag is sampled every 10 ms.

    .venv/bin/python benchmarks/replica_sync.py [--engines embedded,vllm] [--versions 20]

Writes benchmarks/results/replica_sync.json and prints a table.

`--pause-matrix` instead measures the pause of one engine (no client, no follower thread: the
apply alone, which is all the pause is; fetch, decode and verify happen before it) against
model size (`--sizes`, hidden x layers of the tiny Qwen3) and changed fraction (share of the
tensors a version touches, 1% of the elements of each), with the engine-side read-back on and
off, one process per engine kind and size:

    .venv/bin/python benchmarks/replica_sync.py --pause-matrix --engines vllm --sizes 128x2,512x8

Writes benchmarks/results/replica_pause.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the apps: folders of the checkout, not the wheel

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "max": xs[-1]} if xs else {}


def bench(engine_kind: str, model_dir: Path, work: Path, versions: int, interval_s: float) -> dict:
    from inference_space.engines import SamplingParams, make_engine
    from sparsesync.protocol.follower.follower import Follower
    from sparsesync.protocol.writer.publisher import Publisher
    from tests.support.model_steps import PROMPTS, Trainer

    bucket = str(work / f"bucket-{engine_kind}")
    engine = make_engine(engine_kind, model_dir)
    follower = Follower(bucket, hook=engine, poll_interval=0.05, max_poll_interval=0.05)
    trainer = Trainer(model_dir, seed=0)
    engine.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0))  # warm-up (vLLM compiles on first use)
    stop = threading.Event()
    generated = [0]

    def client() -> None:
        while not stop.is_set():
            engine.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0))
            generated[0] += 1

    lags_v: list[int] = []

    def sampler() -> None:
        while not stop.is_set():
            lag = follower.status().lag
            if lag is not None:
                lags_v.append(lag)
            time.sleep(0.01)

    rows = []
    threads = [threading.Thread(target=client, daemon=True), threading.Thread(target=sampler, daemon=True)]
    with Publisher(bucket, anchor_every=0) as pub:
        pub.publish(trainer.step(), 0)
        pub.flush()
        follower.sync_once()
        follower.start()
        for t in threads:
            t.start()
        for step in range(1, versions + 1):
            state = trainer.step(density=0.01, scale=0.02)
            t0 = time.perf_counter()
            v = pub.publish(state, step)
            pub.flush()
            t_commit = time.perf_counter()
            follower.wait_for_version(v, timeout=60)
            t_served = time.perf_counter()
            st = follower.status()
            rows.append({
                "version": v,
                "publish_s": t_commit - t0,
                "lag_s": t_served - t_commit,
                "fetch_s": st.last_fetch_s,
                "pause_ms": engine.pauses.last_ms,
                "wait_ms": engine.pauses.last_wait_ms,
            })
            time.sleep(interval_s)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    follower.stop()
    return {
        "engine": engine_kind,
        "versions": versions,
        "pause_ms": _stats([r["pause_ms"] for r in rows]),
        "wait_for_batch_ms": _stats([r["wait_ms"] for r in rows]),
        "fetch_verify_decode_ms": _stats([r["fetch_s"] * 1e3 for r in rows]),
        "commit_to_served_ms": _stats([r["lag_s"] * 1e3 for r in rows]),
        "version_lag_samples": _stats([float(x) for x in lags_v]),
        "generations_during_run": generated[0],
        "rows": rows,
    }


def pause_cell(
    engine_kind: str, hidden: int, layers: int, fractions: list[float], versions: int, work: Path
) -> list[dict]:
    """Pause per version for each changed fraction, read-back on and off (one engine each)."""
    from inference_space.engines import make_engine
    from sparsesync.protocol.follower.follower import Follower
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.tiny_model import build_tiny_model
    from tests.support.model_steps import Trainer

    model_dir = build_tiny_model(work / f"m{hidden}x{layers}", seed=0, hidden=hidden, layers=layers)
    n_params = sum(t.numel() for t in Trainer(model_dir).state.values())
    rows = []
    for check in (True, False):
        kw = {"check": check, "kv_cache_memory_bytes": 32 << 20} if engine_kind == "vllm" else {}
        engine = make_engine(engine_kind, model_dir, **kw)
        if engine_kind == "embedded" and not check:
            engine._check = lambda want: None  # type: ignore[method-assign]  # the read-back, switched off
        for frac in fractions:
            bucket = str(work / f"b-{engine_kind}-{hidden}-{layers}-{check}-{frac}")
            trainer = Trainer(model_dir, seed=1)
            follower = Follower(bucket, hook=engine)
            pauses, sent = [], []
            with Publisher(bucket, anchor_every=0) as pub:
                pub.publish(trainer.state, 0)
                pub.flush()
                follower.sync_once()
                for step in range(1, versions + 1):
                    pub.publish(trainer.step(density=0.01, scale=0.02, tensor_fraction=frac), step)
                    pub.flush()
                    follower.sync_once()
                    pauses.append(engine.pauses.last_ms)
                    sent.append(len(getattr(engine, "last_sent", [])))
            rows.append({
                "engine": engine_kind, "hidden": hidden, "layers": layers, "params": n_params, "check": check,
                "tensor_fraction": frac, "pause_ms": _stats(pauses),
                "tensors_sent": statistics.fmean(sent) if sent else None, "tensors_total": len(trainer.state),
            })
        engine.close()
    return rows


def pause_matrix(
    engines: list[str], sizes: list[tuple[int, int]], fractions: list[float], versions: int, out: Path
) -> None:
    import subprocess
    import sys

    rows: list[dict] = []
    for kind in engines:
        for hidden, layers in sizes:  # one process each: single-process vLLM engines share global state
            code = (
                "import json, sys, tempfile; from pathlib import Path; from benchmarks.replica_sync import pause_cell\n"
                f"with tempfile.TemporaryDirectory() as t: print('ROWS' + json.dumps(pause_cell({kind!r}, {hidden}, "
                f"{layers}, {fractions!r}, {versions}, Path(t))))"
            )
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS")]
            if proc.returncode != 0 or not line:
                raise SystemExit(f"{kind} {hidden}x{layers} failed:\n{proc.stderr[-3000:]}")
            rows += json.loads(line[0][4:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(
        f"{'engine':9} {'params':>10} {'tensors':>8} {'sent':>6} {'check':>6} {'pause ms (mean/p50/max)':>26}  "
        "pause/pause(frac 1.0, same run)"
    )
    for r in rows:
        full = next(
            x
            for x in rows
            if x["engine"] == r["engine"]
            and x["hidden"] == r["hidden"]
            and x["check"] == r["check"]
            and x["tensor_fraction"] == max(fractions)
        )
        p = r["pause_ms"]
        print(
            f"{r['engine']:9} {r['params']:>10} {r['tensor_fraction']:>8.2f} {r['tensors_sent'] or 0:>6.0f} "
            f"{str(r['check']):>6} "
            f"{p['mean']:8.1f}/{p['p50']:7.1f}/{p['max']:7.1f}   {p['mean'] / full['pause_ms']['mean']:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pause-matrix", action="store_true", help="pause vs model size and changed fraction (see docstring)"
    )
    ap.add_argument("--sizes", default="128x2,512x8", help="hidden x layers of each model (--pause-matrix)")
    ap.add_argument("--fractions", default="0.05,0.25,1.0", help="share of tensors a version touches (--pause-matrix)")
    ap.add_argument("--engines", default="embedded,vllm")
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between published versions")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "replica_sync.json"))
    args = ap.parse_args()
    if args.pause_matrix:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
        fractions = [float(f) for f in args.fractions.split(",")]
        pause_matrix(
            args.engines.split(","),
            sizes,
            fractions,
            min(args.versions, 5),
            Path(args.out).with_name("replica_pause.json"),
        )
        return
    from sparsesync.tiny_model import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "tiny", seed=0)
        for kind in args.engines.split(","):
            results.append(bench(kind, model_dir, work, args.versions, args.interval))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(
        f"{'engine':10} {'pause ms (mean/p50/max)':>26} {'fetch ms (mean)':>16} {'commit->served ms (mean/max)':>30} "
        f"{'version lag (mean/max)':>24}"
    )
    for r in results:
        p, f, c, lv = r["pause_ms"], r["fetch_verify_decode_ms"], r["commit_to_served_ms"], r["version_lag_samples"]
        print(f"{r['engine']:10} {p['mean']:8.1f}/{p['p50']:6.1f}/{p['max']:7.1f}   {f['mean']:14.1f}   "
              f"{c['mean']:14.1f}/{c['max']:8.1f}   {lv.get('mean', 0):12.2f}/{lv.get('max', 0):4.0f}")


if __name__ == "__main__":
    main()
