"""Host memory of replicas, the publisher and `pull` against the model's bytes (issue 42).

For each model size (Qwen3-shaped bf16 models from `sparsesync.tiny_model`, hidden x layers):

1. a publisher process loads the model (the caller's state, anonymous memory), then publishes
   version 0 (an anchor) and `--versions` deltas (1% of the elements of every tensor move per
   version, in place, as an optimizer step would) into a source bucket;
2. each replica process (`embedded`, `vllm`: `inference_space.replica.build_replica`, vLLM with
   `--kv-cache-mib 64`) follows a live bucket into which this script makes the source's versions
   visible one at a time (hard links of the version's objects, then its commit record); lag is
   the time from the commit appearing to the replica serving it, pause is the engine's;
3. `sparsesync pull` materializes the newest version of the source bucket.

Every measured process is a subprocess of this script, sampled from outside every 20 ms
(`/proc/<pid>/status`: VmRSS, VmHWM, RssAnon, RssFile, RssShmem) and, after each version, for
files on tmpfs it keeps open but has not mapped (mapped ones are in RssShmem already).
"Non-evictable" = RssAnon + RssShmem + those tmpfs files: what the OS cannot page out or drop.
Figures are in copies of the model: (figure - the same figure of the same role run on a 1 MB
model of the same shape, i.e. the interpreter, libraries, vLLM's KV cache) / model bytes.

    git archive MAIN_COMMIT | tar -x -C /var/tmp/main && (cd /var/tmp/main && python sparsesync/codec/_build.py)
    nice .venv/bin/python benchmarks/replica_memory.py --tree /var/tmp/main \
        --out benchmarks/results/replica_memory_baseline.json
    nice .venv/bin/python benchmarks/replica_memory.py --baseline-tree /var/tmp/main [--sizes 1024x5,2048x5,2560x8] \
        [--vllm-sizes 1024x5,2048x5] [--out benchmarks/results/replica_memory.json]

`--tree` picks the source tree the workers import (this script's by default). With
`--baseline-tree`, every role also runs on that tree in the same run (baseline first, per size),
and the output carries its figures (`baseline`) and whether each target of issue 42 is met
against them (`targets`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the apps: folders of the checkout, not the wheel

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
OVERHEAD_SIZE = "128x2"  # the 1 MB model: each role's fixed memory, subtracted from the figures


# -- sampling (this process, reading another's /proc) -------------------------------------
def read_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _tmpfs_mounts() -> list[str]:
    mounts = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] in ("tmpfs", "ramfs", "shm"):
                mounts.append(parts[1])
    return sorted(mounts, key=len, reverse=True)


def tmpfs_held(pid: int, mounts: list[str]) -> int:
    """Bytes of files on tmpfs the process holds open but has not mapped (deleted or not)."""
    mapped = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    mapped.add(parts[5].strip().removesuffix(" (deleted)"))
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    total = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)")
            if target in mapped or not target.startswith("/") or not any(target.startswith(m + "/") for m in mounts):
                continue
            total += os.stat(f"/proc/{pid}/fd/{fd}").st_size
        except OSError:
            continue
    return total


class Sampler:
    """Peaks of a process's memory figures, sampled every `period` seconds."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        self.pid, self.period = pid, period
        self.peak: dict[str, int] = {}
        self.peak_at: dict[str, float] = {}  # unix time of each peak
        self.mounts = _tmpfs_mounts()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period)

    def sample(self) -> dict[str, int]:
        st = read_status(self.pid)
        if st:
            st["nonevictable"] = st.get("RssAnon", 0) + st.get("RssShmem", 0)
            for k, v in st.items():
                if v > self.peak.get(k, -1):
                    self.peak[k], self.peak_at[k] = v, time.time()
        return st

    def snapshot(self) -> dict[str, int]:
        """Figures now, with tmpfs files held (counted as non-evictable)."""
        st = self.sample()
        st["tmpfs_held"] = tmpfs_held(self.pid, self.mounts)
        st["nonevictable"] = st.get("RssAnon", 0) + st.get("RssShmem", 0) + st["tmpfs_held"]
        self.peak["nonevictable"] = max(self.peak.get("nonevictable", 0), st["nonevictable"])
        return st

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {**self.peak, "at": dict(self.peak_at)}


class Worker:
    """A measured subprocess speaking line protocol on stdout (lines starting with '@')."""

    def __init__(self, args: list[str], log: Path, tree: Path, env: dict[str, str] | None = None) -> None:
        """`tree`: the source tree whose sparsesync and inference_space the worker imports; `env`: more variables."""
        env = dict(
            os.environ, PYTHONPATH=str(tree), VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", **(env or {})
        )
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "_worker", *args],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.sampler = Sampler(self.proc.pid)

    def expect(self, tag: str, timeout: float = 300) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise SystemExit(f"worker died waiting for {tag}; see {self.log.name}")
            if line.startswith("@"):
                parts = line[1:].split()
                if parts[0] == tag:
                    return parts[1:]
        raise SystemExit(f"timed out waiting for {tag}; see {self.log.name}")

    def close(self) -> dict[str, int]:
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        peak = self.sampler.stop()
        self.log.close()
        return peak


# -- worker side ----------------------------------------------------------------------------
def _say(*parts: object) -> None:
    print("@" + " ".join(str(p) for p in parts), flush=True)


def _reset_peak() -> None:
    """Reset this process's VmHWM to its current RSS (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def worker_publish(model_dir: str, bucket: str, versions: int) -> None:
    import torch
    from safetensors.torch import load_file

    from sparsesync.protocol.writer.publisher import Publisher

    # the caller's state
    state = {k: v.clone() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    g = torch.Generator().manual_seed(1)
    _reset_peak()  # the peak from here on: the publisher's, beside the caller's state
    time.sleep(0.3)
    _say("READY")
    with Publisher(bucket, anchor_every=0) as pub:
        for v in range(versions + 1):
            if v:
                with torch.no_grad():
                    for name in sorted(state):
                        flat = state[name].view(-1)
                        n = max(1, flat.numel() // 100)
                        idx = torch.randint(0, flat.numel(), (n,), generator=g)
                        flat[idx] = (flat[idx].float() + torch.randn(n, generator=g) * 0.02).to(flat.dtype)
            t0 = time.perf_counter()
            pub.publish(state, v)
            pub.flush()
            _say("PUBLISHED", v, time.perf_counter() - t0)
    _say("DONE")


def worker_replica(engine: str, model_dir: str, bucket: str, versions: int) -> None:
    from inference_space.engines import SamplingParams
    from inference_space.replica import ReplicaConfig, build_replica

    replica = build_replica(
        ReplicaConfig(model=model_dir, bucket=bucket, engine=engine, kv_cache_mib=64, poll_interval=0.05)
    )
    follower = replica.follower
    assert follower is not None
    follower.max_poll_interval = 0.1
    replica.engine.generate("Count to 5:", SamplingParams(max_tokens=8, temperature=0.0))
    replica.start()
    _say("READY")
    for v in range(versions + 1):
        deadline = time.monotonic() + 300
        while follower.current_version is None or follower.current_version < v:  # (wait_for_version(0) waits on main)
            if time.monotonic() > deadline:
                raise TimeoutError(f"version {v} not served: {follower.status()}")
            time.sleep(0.002)
        t = time.time()
        st = follower.status()
        _say("SERVED", v, t, replica.engine.pauses.last_ms, st.last_fetch_s)
    out = replica.engine.generate("Count to 5:", SamplingParams(max_tokens=8, temperature=0.0))
    _say("GENERATED", len(out[0].token_ids))
    replica.close()
    _say("DONE")


def worker_pull(bucket: str, dest: str) -> None:
    from sparsesync.cli import main

    sys.argv = ["sparsesync", "pull", bucket, dest]
    try:
        main()
    except SystemExit as e:
        if e.code:
            raise
    _say("DONE")


# -- orchestration -------------------------------------------------------------------------
def model_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            n = 1
            for d in sl.get_shape():
                n *= d
            total += n * 2
    return total


def _commit_objects(src: Path) -> list[tuple[int, str, list[str]]]:
    """(version, commit key, keys of the objects it references), oldest first."""
    from sparsesync.protocol.run import Run

    out = []
    for rec in Run(str(src)).commits():
        keys = [o.key for o in rec.objects()] + [f.key for f in rec.files]
        ckey = next(
            k
            for k in (p.relative_to(src).as_posix() for p in (src / "commits").iterdir())
            if k.startswith(f"commits/v{rec.version:010d}-")
        )
        out.append((rec.version, ckey, keys))
    return out


def _link(src: Path, dst: Path, key: str) -> None:
    (dst / key).parent.mkdir(parents=True, exist_ok=True)
    if not (dst / key).exists():
        os.link(src / key, dst / key)


def run_publisher(model: Path, bucket: Path, versions: int, logs: Path, tree: Path) -> dict[str, Any]:
    w = Worker(["publish", str(model), str(bucket), str(versions)], logs / "publisher.log", tree)
    w.expect("READY")
    state = w.sampler.snapshot()
    w.sampler.peak = {}
    times, after = [], {}
    for v in range(versions + 1):
        times.append(float(w.expect("PUBLISHED")[1]))
        after[v] = w.sampler.snapshot()
    w.expect("DONE")
    peak = w.close()
    return {"caller_state": state, "after": {1: after[1], versions: after[versions]}, "peak": peak, "publish_s": times}


# replica roles: role -> (engine, extra environment). `embedded_anon_mirror`: the embedded replica
# with its mirror in anonymous memory (what the file map costs or saves, measured in the same run)
REPLICAS = {
    "embedded": ("embedded", {}),
    "vllm": ("vllm", {}),
    "embedded_anon_mirror": ("embedded", {"SPARSESYNC_MIRROR_DIR": "memory"}),
}


def run_replica(role: str, model: Path, src: Path, live: Path, versions: int, logs: Path, tree: Path) -> dict[str, Any]:
    engine, env = REPLICAS[role]
    if live.exists():
        shutil.rmtree(live)
    (live / "writers").mkdir(parents=True)
    for p in (src / "writers").iterdir():
        os.link(p, live / "writers" / p.name)
    t_start = time.time()
    w = Worker(["replica", engine, str(model), str(live), str(versions)], logs / f"replica-{role}.log", tree, env)
    w.expect("READY")
    t_ready = time.time()
    startup_s = t_ready - t_start
    started = w.sampler.snapshot()
    rows, after = [], {}
    for v, ckey, keys in _commit_objects(src):
        for k in keys:
            _link(src, live, k)
        t_commit = time.time()
        _link(src, live, ckey)
        _, t_served, pause_ms, fetch_s = w.expect("SERVED")
        time.sleep(0.3)
        after[v] = w.sampler.snapshot()
        rows.append(
            {
                "version": v,
                "commit_at": t_commit - t_ready,
                "lag_s": float(t_served) - t_commit,
                "pause_ms": float(pause_ms),
                "fetch_s": None if fetch_s == "None" else float(fetch_s),
                "rss": after[v]["VmRSS"],
                "nonevictable": after[v]["nonevictable"],
            }
        )
    w.expect("GENERATED")
    w.expect("DONE")
    peak = w.close()
    # seconds after READY (negative: during start-up)
    peak["at"] = {k: round(t - t_ready, 3) for k, t in peak["at"].items()}
    return {
        "startup_s": startup_s,
        "started": started,
        "after": {1: after[1], versions: after[versions]},
        "peak": peak,
        "rows": rows,
    }


def run_pull(src: Path, work: Path, logs: Path, tree: Path) -> dict[str, Any]:
    dest = work / "pulled"
    t0 = time.time()
    w = Worker(["pull", str(src), str(dest)], logs / "pull.log", tree)
    w.expect("DONE")
    peak = w.close()
    shutil.rmtree(dest, ignore_errors=True)
    return {"peak": peak, "seconds": time.time() - t0}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(size: str, nbytes: int, res: dict[str, Any], over: dict[str, Any], versions: int) -> dict[str, Any]:
    """The figures the issue asks for, in copies of the model: each memory figure less the same
    figure of the same role on the 1 MB model (`over`: the interpreter, libraries, vLLM's KV cache
    and buffers), divided by the model's bytes."""
    out: dict[str, Any] = {"size": size, "model_bytes": nbytes}

    def c(b: int, ob: int) -> float:
        return round((b - ob) / nbytes, 3)

    if "publisher" in res:
        p, o = res["publisher"], over["publisher"]
        base, obase = p["caller_state"]["VmRSS"], o["caller_state"]["VmRSS"]
        out["publisher"] = {
            "beyond_state_steady": c(p["after"][versions]["VmRSS"] - base, o["after"][versions]["VmRSS"] - obase),
            "beyond_state_peak": c(p["peak"]["VmHWM"] - base, o["peak"]["VmHWM"] - obase),
            "nonevictable_beyond_state_peak": c(p["peak"]["nonevictable"] - p["caller_state"]["nonevictable"],
                                                o["peak"]["nonevictable"] - o["caller_state"]["nonevictable"]),
            "publish_s_mean": round(_mean(p["publish_s"][1:]), 3),
        }
    for eng in REPLICAS:
        if eng not in res or eng not in over:
            continue
        r, o = res[eng], over[eng]
        deltas = [row for row in r["rows"] if row["version"] >= 1]
        a1, a10, o1, o10 = r["after"][1], r["after"][versions], o["after"][1], o["after"][versions]
        out[eng] = {
            "rss_steady": c(a10["VmRSS"], o10["VmRSS"]),
            "rss_peak": c(r["peak"]["VmHWM"], o["peak"]["VmHWM"]),
            "nonevictable_steady": c(a10["nonevictable"], o10["nonevictable"]),
            "nonevictable_peak": c(r["peak"]["nonevictable"], o["peak"]["nonevictable"]),
            "rss_anon_steady": c(a10["RssAnon"], o10["RssAnon"]),
            "rss_file_steady": c(a10["RssFile"], o10["RssFile"]),
            "rss_shmem_steady": c(a10["RssShmem"], o10["RssShmem"]),
            "tmpfs_held_steady": c(a10["tmpfs_held"], o10["tmpfs_held"]),
            "rss_after_1": c(a1["VmRSS"], o1["VmRSS"]),
            f"rss_after_{versions}": c(a10["VmRSS"], o10["VmRSS"]),
            # growth from version 1 to the last, relative to the model-related RSS after version 1
            "growth_1_to_last": round((a10["VmRSS"] - a1["VmRSS"]) / max(a1["VmRSS"] - o1["VmRSS"], 1), 4),
            "lag_s_mean": round(_mean([row["lag_s"] for row in deltas]), 4),
            "pause_ms_mean": round(_mean([row["pause_ms"] for row in deltas]), 2),
            "anchor_lag_s": round(r["rows"][0]["lag_s"], 3),
            "startup_s": round(r["startup_s"], 1),
            "raw_mb": {"rss_after_1": a1["VmRSS"] >> 20, f"rss_after_{versions}": a10["VmRSS"] >> 20,
                       "rss_peak": r["peak"]["VmHWM"] >> 20, "nonevictable_after_last": a10["nonevictable"] >> 20,
                       "overhead_rss_after_last": o10["VmRSS"] >> 20},
        }
    if "pull" in res:
        p, o = res["pull"]["peak"], over["pull"]["peak"]
        out["pull"] = {
            "rss_peak": c(p["VmHWM"], o["VmHWM"]),
            "nonevictable_peak": c(p["nonevictable"], o["nonevictable"]),
            "seconds": round(res["pull"]["seconds"], 1),
        }
    return out


def judge(rows: list[dict[str, Any]], base_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of issue 42, per size: met or not, with the figure and the baseline's."""
    base = {r["size"]: r for r in base_rows}
    out = []

    def add(size: str, what: str, figure: float, bound: float, baseline: float | None, met: bool) -> None:
        out.append({"size": size, "target": what, "figure": figure, "bound": bound, "baseline": baseline, "met": met})

    for r in rows:
        b = base.get(r["size"], {})
        g = lambda k, f: b.get(k, {}).get(f)  # noqa: E731
        if "embedded" in r:
            e = r["embedded"]
            add(
                r["size"],
                "embedded non-evictable (steady, peak)",
                max(e["nonevictable_steady"], e["nonevictable_peak"]),
                1.15,
                g("embedded", "nonevictable_peak"),
                max(e["nonevictable_steady"], e["nonevictable_peak"]) <= 1.15,
            )
        if "vllm" in r:
            e = r["vllm"]
            add(
                r["size"],
                "vLLM non-evictable (steady, peak)",
                max(e["nonevictable_steady"], e["nonevictable_peak"]),
                1.6,
                g("vllm", "nonevictable_peak"),
                max(e["nonevictable_steady"], e["nonevictable_peak"]) <= 1.6,
            )
        for eng in ("embedded", "vllm"):
            if eng not in r:
                continue
            e = r[eng]
            add(r["size"], f"{eng} total RSS peak", e["rss_peak"], 2.1, g(eng, "rss_peak"), e["rss_peak"] <= 2.1)
            add(
                r["size"],
                f"{eng} RSS growth version 1 -> last",
                e["growth_1_to_last"],
                0.05,
                g(eng, "growth_1_to_last"),
                abs(e["growth_1_to_last"]) <= 0.05,
            )
            for k in ("lag_s_mean", "pause_ms_mean"):
                bv = g(eng, k)
                if bv:
                    add(r["size"], f"{eng} {k} vs baseline (ratio)", round(e[k] / bv, 3), 1.10, bv, e[k] <= 1.10 * bv)
        if "publisher" in r:
            p = r["publisher"]
            add(
                r["size"],
                "publisher beyond caller's state (peak)",
                p["beyond_state_peak"],
                1.15,
                g("publisher", "beyond_state_peak"),
                p["beyond_state_peak"] <= 1.15,
            )
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        role, rest = sys.argv[2], sys.argv[3:]
        if role == "publish":
            worker_publish(rest[0], rest[1], int(rest[2]))
        elif role == "replica":
            worker_replica(rest[0], rest[1], rest[2], int(rest[3]))
        else:
            worker_pull(rest[0], rest[1])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024x5,2048x5,2560x8", help="hidden x layers of each model, smallest first")
    ap.add_argument("--vllm-sizes", default="1024x5,2048x5,2560x8", help="sizes the vLLM replica runs at")
    ap.add_argument(
        "--roles", default="publisher,embedded,vllm,pull", help=f"of publisher, pull, {', '.join(REPLICAS)}"
    )
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--work", default="/var/tmp/sparsesync-replica-memory", help="on disk, not tmpfs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "replica_memory.json"))
    ap.add_argument("--tree", default=str(ROOT), help="the source tree measured (default: this one)")
    ap.add_argument(
        "--baseline-tree",
        default=None,
        help="another source tree (e.g. `git archive` of main): every role also runs on it, in the same run, and "
        "the targets are judged against its figures",
    )
    args = ap.parse_args()
    roles = args.roles.split(",")
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw: dict[str, Any] = {}
    t_all = time.time()
    from sparsesync.tiny_model import build_tiny_model

    trees = {"branch": Path(args.tree).resolve()}
    if args.baseline_tree:
        # each role: baseline first, same run
        trees = {"baseline": Path(args.baseline_tree).resolve(), "branch": Path(args.tree).resolve()}
    over: dict[str, dict[str, Any]] = {}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
    for size in [OVERHEAD_SIZE, *args.sizes.split(",")]:
        hidden, layers = (int(x) for x in size.split("x"))
        sdir = work / size
        model = build_tiny_model(sdir / "model", seed=0, hidden=hidden, layers=layers)
        nbytes = model_bytes(model)
        src = sdir / "source"
        res: dict[str, dict[str, Any]] = {k: {} for k in trees}
        print(f"[{time.time() - t_all:6.0f}s] {size}: {nbytes / 1e6:.0f} MB", flush=True)
        for tag, tree in trees.items():
            (sdir / tag).mkdir(parents=True)
            bucket = src if not src.exists() else sdir / f"source-{tag}"  # replicas follow the first one
            res[tag]["publisher"] = run_publisher(model, bucket, args.versions, sdir / tag, tree)
        for role in (*REPLICAS, "pull"):
            if role not in roles or (
                role == "vllm" and size not in args.vllm_sizes.split(",") and size != OVERHEAD_SIZE
            ):
                continue
            for tag, tree in trees.items():
                if role == "embedded_anon_mirror" and tag == "baseline":
                    continue  # the baseline has no file-backed mirror to compare with
                if role == "pull":
                    res[tag]["pull"] = run_pull(src, sdir, sdir / tag, tree)
                else:
                    res[tag][role] = run_replica(
                        role, model, src, sdir / f"live-{role}", args.versions, sdir / tag, tree
                    )
                print(f"[{time.time() - t_all:6.0f}s]   {role} ({tag}) done", flush=True)
        for tag in trees:
            if "publisher" not in roles:
                del res[tag]["publisher"]
            raw.setdefault(tag, {})[size] = res[tag]
            if size == OVERHEAD_SIZE:
                over[tag] = res[tag]
            else:
                row = summarize(size, nbytes, res[tag], over[tag], args.versions)
                print(tag, json.dumps(row), flush=True)
                rows[tag].append(row)
            for p in (sdir / tag).glob("*.log"):
                shutil.copy(p, work / f"{size}-{tag}-{p.name}")
        shutil.rmtree(sdir, ignore_errors=True)
    result: dict[str, Any] = {
        "what": "host memory against model bytes (copies), issue 42; see benchmarks/replica_memory.py",
        "command": " ".join(sys.argv),
        "versions": args.versions,
        "wall_s": round(time.time() - t_all, 1),
        "rows": rows["branch"],
    }
    if "baseline" in rows:
        result["baseline_tree"] = args.baseline_tree
        result["baseline"] = rows["baseline"]
        result["targets"] = judge(rows["branch"], rows["baseline"])
    result["raw"] = raw
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    for r in result.get("targets", []):
        print(
            f"{r['size']:8} {r['target']:45} {r['figure']!s:>8} (bound {r['bound']}, baseline {r['baseline']}) "
            f"{'met' if r['met'] else 'NOT MET'}"
        )


if __name__ == "__main__":
    main()
