"""Small tensors (issue 51): publish-to-applied of a LoRA-shaped state against safetensors save + load.

(a) adapter-shaped: r=16 on q, k, v, o, gate, up, down of 28 decoder layers of a Qwen3-0.6B-shaped
    model (hidden 1024; A = (16, in), B = (out, 16)): 392 bf16 tensors, 10.1M parameters. Each
    version changes `density` of the elements (x1.01 + 1e-3 in bf16). Timed: `Publisher.publish`
    (local folder) -> `flush` -> a `Follower` (no engine, same process) `sync_once` serves the
    version (fetched, decoded, applied, digests checked). Baseline, interleaved rep by rep in the
    same process: `save_file` + `load_file` of the whole state in the same temporary folder.
(b) fixed cost: a 400-tensor state (the 392 above plus 8 (1024,) tensors) with ONE element
    changed per version, publish to applied (issue 51 target 2: at most 20 ms).

Each version's CPU time (`time.process_time`: every thread of the one process holding the
Publisher and the Follower) is recorded beside its wall time: on a shared machine, load from
other processes skews it far less.

Tensor names use `.la.weight` / `.lb.weight` (names with `lora_A` / `lora_B` would make the
Publisher treat the state as a PEFT adapter run). Every repetition is recorded; figures are
medians with min/max. The machine may be shared: the load average is recorded at start and end.

    python benchmarks/small_tensors.py                      # this tree, 7 reps
    python benchmarks/small_tensors.py --against /tmp/base --rounds 2  # PYTHONPATH=/tmp/base vs this tree, case by case
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"q_proj": (2048, 1024), "k_proj": (1024, 1024), "v_proj": (1024, 1024), "o_proj": (1024, 2048),
          "gate_proj": (3072, 1024), "up_proj": (3072, 1024), "down_proj": (1024, 3072)}


def adapter_state(extra: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """392 bf16 tensors (plus `extra` (1024,) ones), 10.1M parameters."""
    g = torch.Generator().manual_seed(seed)
    st = {}
    for layer in range(28):
        for m, (o, i) in SHAPES.items():
            p = f"model.layers.{layer}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}"
            st[f"{p}.la.weight"] = (torch.randn(16, i, generator=g) * 0.02).to(torch.bfloat16)
            st[f"{p}.lb.weight"] = (torch.randn(o, 16, generator=g) * 0.02).to(torch.bfloat16)
    for j in range(extra):
        st[f"model.extra.{j}.weight"] = torch.ones(1024, dtype=torch.bfloat16)
    return st


def perturb(st: dict[str, torch.Tensor], density: float, g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for k, t in st.items():
        m = torch.rand(t.shape, generator=g) < density
        u = t.clone()
        u[m] = (u[m].float() * 1.01 + 1e-3).to(torch.bfloat16)
        out[k] = u
    return out


def one_element(st: dict[str, torch.Tensor], v: int) -> dict[str, torch.Tensor]:
    out = dict(st)
    name = sorted(st)[v % len(st)]
    u = st[name].clone()
    u.view(-1)[v % u.numel()] += 1.0
    out[name] = u
    return out


def run_case(case: str, density: float, reps: int) -> dict:
    """Times of `reps` versions (after one untimed warm-up delta) and of the baseline, interleaved."""
    from sparsesync import Follower, Publisher  # the front door: the same in trees before and after the protocol moves

    st = adapter_state(extra=8 if case == "fixed" else 0)
    g = torch.Generator().manual_seed(1)
    times, base_times, cpu, base_cpu = [], [], [], []
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory() as d:
        pub = Publisher(d + "/run")
        pub.publish(st, 0)
        pub.flush()
        f = Follower(d + "/run")
        assert f.sync_once() == 0
        cur = st
        for v in range(1, reps + 2):
            cur = one_element(cur, v) if case == "fixed" else perturb(cur, density, g)
            t0, c0 = time.perf_counter(), time.process_time()
            pub.publish(cur, v)
            pub.flush()
            while f.sync_once() != v:
                pass
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            t0, c0 = time.perf_counter(), time.process_time()
            save_file(cur, d + "/full.safetensors")
            back = load_file(d + "/full.safetensors")
            bt, bc = time.perf_counter() - t0, time.process_time() - c0
            assert all(torch.equal(back[k], cur[k]) for k in cur)
            if v > 1:  # v=1: warm-up
                times.append(dt)
                base_times.append(bt)
                cpu.append(dc)
                base_cpu.append(bc)
        assert all(torch.equal(f.mirror[k], cur[k]) for k in cur)  # the replica holds the last version, bit for bit
        pub.close()
        f.stop()
    return {"case": case, "density": density, "tensors": len(st), "params": sum(t.numel() for t in st.values()),
            "publish_to_applied_s": times, "save_load_s": base_times,
            "publish_to_applied_cpu_s": cpu, "save_load_cpu_s": base_cpu,
            # this process's peak resident memory (KiB -> MB) when the state was built, and at the end
            "peak_rss_mb": [rss0 / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]}


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def cases(args: argparse.Namespace) -> list[tuple[str, float]]:
    return [("adapter", d) for d in args.densities] + ([("fixed", 0.0)] if not args.no_fixed else [])


def child(args: argparse.Namespace) -> None:
    case, density = args.child.split(":")
    print(json.dumps(run_case(case, float(density), args.reps)))


def git_head(path: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip() + (
        "+dirty"
        if subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        else ""
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7, help="timed versions per case and round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds over the cases (with --against: each case in both trees, one after the other)",
    )
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.1, 0.5])
    ap.add_argument("--no-fixed", action="store_true", help="leave out case (b)")
    ap.add_argument("--against", type=Path, help="a checkout of the baseline tree (its extension built)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # "case:density": run one case in this process
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    trees = {"this": ROOT} if args.against is None else {"base": args.against.resolve(), "this": ROOT}
    record: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commits": {k: git_head(p) for k, p in trees.items()},
        "loadavg_start": os.getloadavg(),
        "cpus": os.cpu_count(),
        "runs": {k: [] for k in trees},
        "note": "shared machine (other jobs running): see loadavg; figures are medians over reps with min/max",
    }
    # one process per (round, case, tree), the trees alternating case by case (their order
    # flipped every round), so that both see the same load
    for rnd in range(args.rounds):
        for c, d in cases(args):
            for label in (list(trees) if rnd % 2 == 0 else list(trees)[::-1]):
                env = {**os.environ, "PYTHONPATH": str(trees[label])}
                p = subprocess.run([sys.executable, __file__, "--child", f"{c}:{d}", "--reps", str(args.reps)], env=env,
                                   capture_output=True, text=True, cwd=trees[label])
                if p.returncode:
                    sys.exit(f"{label} failed:\n{p.stderr[-3000:]}")
                record["runs"][label].append(
                    {**json.loads(p.stdout.strip().splitlines()[-1]), "round": rnd, "loadavg": os.getloadavg()}
                )
    record["loadavg_end"] = os.getloadavg()
    table: dict[str, dict] = {}
    for label, runs in record["runs"].items():
        for c, d in cases(args):
            mine = [r for r in runs if r["case"] == c and r["density"] == d]
            t = [x for r in mine for x in r["publish_to_applied_s"]]
            b = [x for r in mine for x in r["save_load_s"]]
            tc = [x for r in mine for x in r.get("publish_to_applied_cpu_s", [])]
            bc = [x for r in mine for x in r.get("save_load_cpu_s", [])]
            key = f"{c} {d:g}" if c == "adapter" else "fixed 1 element"
            row = table.setdefault(key, {})
            row[label] = {"publish_to_applied_s": summary(t), "save_load_s": summary(b),
                          "ratio_median": statistics.median(t) / statistics.median(b),
                          "ratio_per_rep": summary([x / y for x, y in zip(t, b)])}
            rss = [r["peak_rss_mb"][1] - r["peak_rss_mb"][0] for r in mine if "peak_rss_mb" in r]
            if rss:  # peak memory the versions added to the process, the most over its runs
                row[label]["peak_rss_added_mb"] = max(rss)
            if tc:  # CPU seconds of this process (all its threads): what load from other processes skews least
                row[label].update({"publish_to_applied_cpu_s": summary(tc), "save_load_cpu_s": summary(bc),
                                   "cpu_ratio_median": statistics.median(tc) / statistics.median(bc)})
            print(
                f"{key:18s} {label:5s} publish->applied {statistics.median(t) * 1e3:7.1f} ms "
                f"[{min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}]"
                f"  save+load {statistics.median(b) * 1e3:6.1f} ms [{min(b) * 1e3:.1f}-{max(b) * 1e3:.1f}]  ratio "
                f"{row[label]['ratio_median']:.2f}"
                + (f"  | CPU {statistics.median(tc) * 1e3:.1f} ms [{min(tc) * 1e3:.1f}-{max(tc) * 1e3:.1f}] vs "
                   f"{statistics.median(bc) * 1e3:.1f} ms, ratio {row[label]['cpu_ratio_median']:.2f}" if tc else "")
                + (f"  | peak RSS +{max(rss):.0f} MB" if rss else "")
            )
    if "base" in trees:
        for key, row in table.items():
            r = row["this"]["publish_to_applied_s"]["median"] / row["base"]["publish_to_applied_s"]["median"]
            row["this_over_base_median"] = r
            rc = row["this"]["publish_to_applied_cpu_s"]["median"] / row["base"]["publish_to_applied_cpu_s"]["median"]
            row["this_over_base_cpu_median"] = rc
            print(f"{key:18s} this/base publish->applied: {r:.2f} (wall), {rc:.2f} (CPU)")
    record["summary"] = table
    print("load average start", record["loadavg_start"], "end", record["loadavg_end"])
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
