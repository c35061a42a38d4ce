"""The embedded engine's pause on the CPU for a 0.6B-shaped model, one source tree against another.

The model of `gpu_bench.bench_pause` (the tiny Qwen3's vocabulary, hidden 1024, 64 layers: about
0.6B parameters, random init, bf16), the engine on the CPU. Each version moves 1% of the
elements of a fraction of the tensors (`--fractions`; 1.0 is every tensor) and is handed to the
engine as the follower hands it over: `apply_sparse(version, updates, full)` with the touched
tensors' new values, plus `digests=` (the version's per-tensor digests, every tensor) when the
engine takes them (`takes_digests`). The pause is `PauseStats.last_ms` (the write and the
engine-side check under the gate). Each tree (`--trees`: source roots, e.g. /work/main and this
worktree) runs in its own process, one after the other per repetition, so every tree is measured
in the same run on the same machine state:

    .venv/bin/python benchmarks/replica_pause_cpu.py --trees ../main,. --reps 2

Writes benchmarks/results/replica_pause_cpu.json (every pause, each tree's commit, "-dirty" when
it had uncommitted changes) and prints each tree's min and median pause and their ratios to the
first tree's (on a shared machine the min is the least disturbed figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CELL = r"""
import json, sys, tempfile, time, torch
from pathlib import Path
from inference_space.engines.embedded import EmbeddedEngine
from sparsesync.codec import tensor_digests
from sparsesync.codec.apply import SparseUpdate
from sparsesync.tiny_model import arch_config, build_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

hidden, layers, fractions, versions, model_dir = json.loads(sys.argv[1])
model_dir = Path(model_dir)
if not (model_dir / "config.json").exists():
    build_tiny_model(model_dir)
    small = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    cfg = arch_config("qwen3", small.vocab_size, small.eos_token_id, hidden=hidden, layers=layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = small.eos_token_id
    model.save_pretrained(model_dir)
    del model
engine = EmbeddedEngine(model_dir)
mirror = engine.state_dict()
names = sorted(mirror)
digests = tensor_digests(mirror)
told = getattr(engine, "takes_digests", False)
g = torch.Generator().manual_seed(0)
rows = []
v = 0
for frac in fractions:
    pauses = []
    for _ in range(versions):
        v += 1
        pick = [n for n in names if torch.rand((), generator=g) < frac] or [names[0]]
        updates = {}
        for n in pick:
            flat = mirror[n].view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)].sort().values
            vals = (flat[idx].float() + 0.01).to(flat.dtype)
            flat[idx] = vals
            updates[n] = SparseUpdate(idx, vals)
        digests.update(tensor_digests({n: mirror[n] for n in pick}))
        kw = {"digests": dict(digests)} if told else {}
        engine.apply_sparse(v, updates, {n: mirror[n] for n in pick}, **kw)
        assert engine.weight_version == v
        pauses.append(engine.pauses.last_ms)
    rows.append({"tensor_fraction": frac, "tensors_touched_last": len(pick), "pause_ms": pauses})
n_params = sum(t.numel() for t in mirror.values())
print("ROWS" + json.dumps({"params": n_params, "tensors": len(names), "digests_given": told, "rows": rows}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trees",
        default=str(Path(__file__).resolve().parents[1]),
        help="source roots, comma-separated (default: this one)",
    )
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--fractions", default="1.0,0.25,0.05")
    ap.add_argument("--versions", type=int, default=3, help="versions per fraction, per repetition")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "replica_pause_cpu.json"))
    a = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in a.trees.split(",")]
    fractions = [float(f) for f in a.fractions.split(",")]
    results: dict[str, list] = {t: [] for t in trees}
    commits = {
        t: subprocess.run(
            ["git", "-C", t, "describe", "--always", "--dirty", "--abbrev=40"], capture_output=True, text=True
        ).stdout.strip()
        for t in trees
    }  # "-dirty": the tree had uncommitted changes when measured
    with tempfile.TemporaryDirectory() as tmp:
        arg = json.dumps([a.hidden, a.layers, fractions, a.versions, str(Path(tmp) / "model")])
        for rep in range(a.reps):
            for t in trees:
                env = {**os.environ, "PYTHONPATH": t}
                proc = subprocess.run(
                    [sys.executable, "-c", CELL, arg], capture_output=True, text=True, env=env, cwd=t, timeout=3600
                )
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROWS")]
                if proc.returncode != 0 or not line:
                    raise SystemExit(f"{t} failed:\n{proc.stderr[-3000:]}")
                results[t].append(json.loads(line[0][4:]))
                print(f"rep {rep} {t}: done", flush=True)
    out = {
        "command": " ".join(sys.argv),
        "commits": commits,
        "hidden": a.hidden,
        "layers": a.layers,
        "results": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    first = trees[0]
    print(
        f"{'tree':40} {'digests':>7} {'fraction':>8} {'pause ms min / median (all reps)':>32} "
        f"{'vs first (min, median)':>22}"
    )
    for t in trees:
        for i, frac in enumerate(fractions):
            xs = [p for r in results[t] for p in r["rows"][i]["pause_ms"]]
            base = [p for r in results[first] for p in r["rows"][i]["pause_ms"]]
            print(
                f"{t[-40:]:40} {str(results[t][0]['digests_given']):>7} {frac:8.2f} {min(xs):15.1f} / "
                f"{statistics.median(xs):14.1f} "
                f"{min(xs) / min(base):10.2f}, {statistics.median(xs) / statistics.median(base):9.2f}"
            )


if __name__ == "__main__":
    main()
