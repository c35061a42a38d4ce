"""The README's demo figures, from real runs of `sparsesync demo --json`: reward at the start and
end, the per-step patch against the full model, wall and training time, for several seeds, and
the same for `--lora`. Writes benchmarks/results/demo_full.json and demo_lora.json (each run's
summary and the machine), which README.md quotes and tests/test_readme_figures.py checks.

    python benchmarks/demo_figures.py       # 3 full-weight seeds, 1 LoRA run, 2 step-time pairs: 6-60 min on 2 cores
    python benchmarks/demo_figures.py --seeds 0 --lora-seeds '' --step-time-steps 0
    python benchmarks/demo_figures.py --only-step-time     # only the LoRA/full step-time pairs
    python benchmarks/demo_figures.py --seeds 0 --lora-seeds '' --step-time-steps 0 --full-name demo_check
                                            # the default `sparsesync demo` once, beside the 3-seed figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the apps: folders of the checkout, not the wheel
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import provenance  # noqa: E402 - the command and commit a results file records

RESULTS = Path(__file__).resolve().parent / "results"


def run_one(seed: int, steps: int, lora: bool, min_reward_gain: float | None = None) -> dict[str, Any]:
    """One `sparsesync demo` run in its own process; its report's figures."""
    from trainer.demo import reward_window

    with tempfile.TemporaryDirectory(prefix="demo-figures-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-c", "from sparsesync.cli import main; main()", "demo", "--steps", str(steps),
               "--seed", str(seed), "--no-progress", "--json", str(out), *(["--lora"] if lora else []),
               *(["--min-reward-gain", str(min_reward_gain)] if min_reward_gain is not None else [])]
        t0, load0 = time.time(), os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t0
        if proc.returncode != 0:
            raise SystemExit(f"demo (seed {seed}, lora={lora}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rep = json.loads(out.read_text())
    deltas = [c for c in rep["commits"] if c.get("patch_bytes")]
    fracs = [c["patch_bytes"] / rep["full_bytes"] for c in deltas]
    return {
        "seed": seed, "steps": steps, "lora": lora, "command": " ".join(["sparsesync", *cmd[3:]]),
        "reward_start": rep["reward_start"], "reward_end": rep["reward_end"],
        "reward_window_steps": reward_window([{}] * steps),
        "patch_over_full_median": statistics.median(fracs),
        "patch_over_full_min": min(fracs), "patch_over_full_max": max(fracs),
        "changed_elements_median": statistics.median(c["density"] for c in deltas),
        "changed_elements_min": min(c["density"] for c in deltas),
        "changed_elements_max": max(c["density"] for c in deltas),
        "full_bytes": rep["full_bytes"], "final_version": rep["final_version"],
        "checks_ok": all(c["ok"] for c in rep["checks"].values()),
        "load_avg_1m": [load0, os.getloadavg()[0]],  # at start and end: other jobs on the machine slow it
        "wall_s": wall, "train_s": rep["train_s"], "train_s_per_step": rep["train_s"] / steps,
        # medians over the steps after the first 3 (warm-up): the optimizer step (forward, backward,
        # optimizer: PEFT's cost in a LoRA run) and the publish (sparsesync's diff+encode on the trainer)
        "optimizer_step_s_median": statistics.median(r["train_s"] for r in rep["steps"][3:]),
        "publish_s_median": statistics.median(r["publish_s"] for r in rep["steps"][3:]),
    }


def machine() -> dict[str, Any]:
    import torch

    return {"cpus": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0], "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="full-weight runs, one per seed")
    ap.add_argument("--lora-seeds", default="0", help="LoRA runs, one per seed ('' for none)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--full-name", default="demo_full", help="file name (no .json) of the full-weight runs' results")
    ap.add_argument("--step-time-steps", type=int, default=30,
                    help="also time a LoRA step against a full-weight step: full, LoRA, full, LoRA runs of this many "
                         "steps back to back (0: skip); the ratio goes into demo_lora.json")
    ap.add_argument("--only-step-time", action="store_true", help="only the step-time pairs (updates demo_lora.json)")
    args = ap.parse_args()
    if args.step_time_steps:
        pairs = []
        for _ in range(2):  # interleaved, so a slow phase of the machine hits both sides
            # (too few steps for the reward check: only the step time is read)
            f, lo = run_one(0, args.step_time_steps, False, -1.0), run_one(0, args.step_time_steps, True, -1.0)
            pairs.append(
                {
                    "full_train_s_per_step": f["train_s_per_step"],
                    "lora_train_s_per_step": lo["train_s_per_step"],
                    "ratio": lo["train_s_per_step"] / f["train_s_per_step"],
                    **{f"{k}_{part}": r[f"{part}_median"] for k, r in (("full", f), ("lora", lo))
                       for part in ("optimizer_step_s", "publish_s")},
                    "load_avg_1m": [f["load_avg_1m"], lo["load_avg_1m"]],
                }
            )
            print(
                f"step time ({args.step_time_steps} steps): LoRA {lo['train_s_per_step']:.3f} s, full "
                f"{f['train_s_per_step']:.3f} s, "
                f"ratio {pairs[-1]['ratio']:.2f}; per step (median) optimizer step LoRA "
                f"{lo['optimizer_step_s_median']:.3f} s, full {f['optimizer_step_s_median']:.3f} s; publish LoRA "
                f"{lo['publish_s_median'] * 1e3:.1f} ms, full {f['publish_s_median'] * 1e3:.1f} ms",
                flush=True,
            )
        step_time = {"steps": args.step_time_steps, "pairs": pairs,
                     "ratio_median": statistics.median(p["ratio"] for p in pairs),
                     "date": time.strftime("%Y-%m-%d", time.gmtime()), **provenance()}
        lora_file = args.out / "demo_lora.json"
        if args.only_step_time and lora_file.is_file():
            d = json.loads(lora_file.read_text())
            d["step_time"] = step_time
            d["summary"].pop("train_s_per_step_over_full", None)  # (an older version compared runs at different loads)
            lora_file.write_text(json.dumps(d, indent=2) + "\n")
            print(f"updated {lora_file}")
            return
    for name, seeds, lora in ((args.full_name, args.seeds, False), ("demo_lora", args.lora_seeds, True)):
        if not seeds.strip():
            continue
        info = machine()
        runs = []
        for s in (int(x) for x in seeds.split(",")):
            runs.append(run_one(s, args.steps, lora))
            r = runs[-1]
            print(f"{name} seed {s}: reward {r['reward_start']:.3f} -> {r['reward_end']:.3f}, patch median "
                  f"{r['patch_over_full_median']:.1%} of full, {r['wall_s']:.0f} s wall, {r['train_s']:.0f} s training",
                  flush=True)
        summary = {
            "reward_start": [min(r["reward_start"] for r in runs), max(r["reward_start"] for r in runs)],
            "reward_end": [min(r["reward_end"] for r in runs), max(r["reward_end"] for r in runs)],
            "patch_over_full_median": [
                min(r["patch_over_full_median"] for r in runs),
                max(r["patch_over_full_median"] for r in runs),
            ],
            "changed_elements": [
                min(r["changed_elements_min"] for r in runs),
                max(r["changed_elements_max"] for r in runs),
            ],
            "wall_s": [min(r["wall_s"] for r in runs), max(r["wall_s"] for r in runs)],
            "train_s_per_step": [min(r["train_s_per_step"] for r in runs), max(r["train_s_per_step"] for r in runs)],
        }
        out = {"machine": info, "summary": summary, "runs": runs}
        if lora and args.step_time_steps:
            out["step_time"] = step_time
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out / f'{name}.json'}")


if __name__ == "__main__":
    main()
