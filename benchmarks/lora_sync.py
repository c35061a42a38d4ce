"""LoRA runs: per-version bytes and lag of adapter-delta sync against the other ways to ship a LoRA step.

A 0.6B Qwen3-shaped base (benchmarks/_codec_data.py: realistic bf16 weights) with an r=16
adapter on every linear layer (q, k, v, o, gate, up, down of every block: 7 x 2 = 14 tensors per
layer). The adapter starts as after some training (A ~ kaiming-uniform, B ~ N(0, `--b-std`)) and
takes AdamW steps at `--lr` (fp32 master adapter, the steady-state Adam direction per element of
_codec_data.adam_direction). Each version is shipped as:

- adapter-delta bf16: sparsesync's delta of the bf16-cast adapter (what `Publisher.publish` of
  a PeftModel cast to bf16 sends; the trainer's `[lora]` does this);
- adapter-delta fp32: sparsesync's delta of the fp32 adapter (PEFT's default adapter dtype);
- (a) full adapter bf16: the whole adapter as one safetensors file every step;
- (b) merged-weight sparse sync: sparsesync's delta of the merged bf16 weights W + (alpha/r) B A
  (what syncing merged weights, today's TRL path, sends);
- (c) full model: the whole bf16 merged model every step.

Lag: publish() call -> a follower (same process, local folder, no engine) applied and verified
the version, median over the versions after the first delta (anchors not timed); for (a) and (c)
the same write + read + digest of one safetensors file. Also: the density of adapter changes per
step, and the fixed bytes per touched tensor (a delta touching one element in every adapter
tensor, minus the bytes of those elements' values and positions).

    .venv/bin/python benchmarks/lora_sync.py                   # 0.6B base, r=16, lr 1e-5 and 1e-4
    .venv/bin/python benchmarks/lora_sync.py --params 50e6 --versions 3
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import adam_direction, make_weights, provenance, qwen_like_shapes  # noqa: E402

from sparsesync.codec import Snapshot, tensor_digests  # noqa: E402
from sparsesync.lora.bridge import base_digest  # noqa: E402
from sparsesync.lora.meta import AdapterMeta  # noqa: E402
from sparsesync.protocol.follower.follower import Follower  # noqa: E402
from sparsesync.protocol.writer.publisher import Publisher  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shapes(base: dict[str, tuple[int, ...]], r: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """PEFT name -> (base weight it adapts, shape) for an r-rank adapter on every linear layer."""
    out = {}
    for name, shape in base.items():
        mod = name.removesuffix(".weight")
        if len(shape) == 2 and mod.rsplit(".", 1)[-1] in TARGETS:
            out[f"base_model.model.{mod}.lora_A.weight"] = (name, (r, shape[1]))
            out[f"base_model.model.{mod}.lora_B.weight"] = (name, (shape[0], r))
    return out


def init_adapter(shapes: dict[str, tuple[str, tuple[int, ...]]], b_std: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (_w, shape) in shapes.items():
        if ".lora_A." in name:
            bound = 1 / math.sqrt(shape[1])
            out[name] = torch.empty(shape).uniform_(-bound, bound, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) * b_std
    return out


def adam_step(adapter: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v - lr * adam_direction(tuple(v.shape), g) for k, v in adapter.items()}


def merged(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], shapes, scale: float
) -> dict[str, torch.Tensor]:
    """The bf16 weights with the adapter merged (as peft's merge_adapter: W + scale * B @ A in fp32, rounded)."""
    out = dict(base)
    for name, (w, _s) in shapes.items():
        if ".lora_A." in name:
            b = adapter[name.replace(".lora_A.", ".lora_B.")]
            out[w] = (base[w].float() + scale * (b @ adapter[name])).to(torch.bfloat16)
    return out


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype).contiguous() for k, v in state.items()}


def sparse_sync(versions: Callable[[int], dict[str, torch.Tensor]], n: int, root: Path,
                adapter: AdapterMeta | None = None) -> dict[str, float]:
    """Publish versions 0..n through a local run with a follower (versions built one at a time);
    bytes, density and lag of the deltas (the first delta's lag is not timed: cold caches)."""
    url = str(root / "run")
    follower = Follower(url, adapter=adapter)
    lags, sizes, dens = [], [], []
    with Publisher(url, anchor_every=0, anchor_fraction=1e9, queue_size=1, adapter=adapter) as pub:
        for v in range(n + 1):
            state = versions(v)
            t0 = time.perf_counter()
            pub.publish(state, v)
            pub.flush()
            assert follower.sync_once() == v
            lag = time.perf_counter() - t0
            if v == 0:
                continue
            m = pub.metrics[-1]
            sizes.append(m["patch_bytes"])
            dens.append(m["density"])
            lags.append(lag)
    assert tensor_digests(follower.mirror) == tensor_digests(state)
    follower.stop()
    del follower
    shutil.rmtree(root / "run", ignore_errors=True)
    return {"bytes_median": statistics.median(sizes), "density_median": statistics.median(dens),
            "density_min": min(dens), "density_max": max(dens), "lag_s_median": statistics.median(lags[1:] or lags)}


def full_file_sync(versions: Callable[[int], dict[str, torch.Tensor]], n: int, root: Path) -> dict[str, float]:
    """Versions 1..n each as one whole safetensors file: write, read back, digest (the dense baseline)."""
    lags, sizes = [], []
    for v in range(1, n + 1):
        state = versions(v)
        f = root / f"full-{v}.safetensors"
        t0 = time.perf_counter()
        save_file(state, str(f))
        back = load_file(str(f))
        tensor_digests(back)
        lags.append(time.perf_counter() - t0)
        sizes.append(f.stat().st_size)
        del back
        f.unlink()
    return {"bytes_median": statistics.median(sizes), "lag_s_median": statistics.median(lags)}


def fixed_bytes_per_tensor(adapter: dict[str, torch.Tensor]) -> dict[str, float]:
    """A delta that changes one element of every tensor: bytes per touched tensor beyond its one value."""
    snap = Snapshot(adapter, 0)
    moved = {}
    for k, v in adapter.items():
        t = v.clone()
        t.view(-1)[0] = -t.view(-1)[0] if t.view(-1)[0] != 0 else 1.0
        moved[k] = t
    enc = snap.diff_encode(moved, 1)
    n, item = len(adapter), next(iter(adapter.values())).element_size()
    return {"tensors": n, "patch_bytes": len(enc.data), "bytes_per_tensor": len(enc.data) / n,
            "fixed_bytes_per_tensor": (len(enc.data) - n * item) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=0.6e9)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lr", default="1e-5,1e-4", help="comma-separated AdamW learning rates (LoRA RL: 1e-5..1e-4)")
    ap.add_argument("--b-std", type=float, default=1e-2, help="std of B after some training (init: 0; ~lr x steps)")
    ap.add_argument("--versions", type=int, default=5, help="deltas per variant (after version 0)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lora_sync.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    shapes = qwen_like_shapes(args.params)
    t0 = time.perf_counter()
    base = make_weights(shapes)
    lshapes = lora_shapes(shapes, args.rank)
    n_base = sum(t.numel() for t in base.values())
    n_lora = sum(math.prod(s) for _w, s in lshapes.values())
    print(f"base: {n_base / 1e6:.0f}M params, {len(base)} tensors; adapter r={args.rank}: {len(lshapes)} tensors, "
          f"{n_lora / 1e6:.2f}M params ({2 * n_lora / 1e6:.1f} MB bf16); built in {time.perf_counter() - t0:.0f} s")
    result: dict[str, object] = {"params": n_base, "adapter_params": n_lora, "adapter_tensors": len(lshapes),
                                 "rank": args.rank, "alpha": args.alpha, "versions": args.versions, "by_lr": {}}
    root = Path(tempfile.mkdtemp(prefix="sparsesync-lora-bench-"))
    try:
        adapter0 = init_adapter(lshapes, args.b_std, seed=0)
        meta = AdapterMeta(
            "qwen3-like",
            base_digest(base),
            {"peft_type": "LORA", "r": args.rank, "lora_alpha": args.alpha, "target_modules": list(TARGETS)},
        )
        result["fixed_bytes"] = fixed_bytes_per_tensor(cast(adapter0, torch.bfloat16))
        print(f"fixed cost per touched tensor: {result['fixed_bytes']}")
        for lr in [float(x) for x in args.lr.split(",")]:
            masters = [adapter0]
            for v in range(args.versions):
                masters.append(adam_step(masters[-1], lr, seed=100 + v))
            row: dict[str, object] = {}
            n = args.versions
            row["adapter_delta_bf16"] = sparse_sync(lambda v: cast(masters[v], torch.bfloat16), n, root,
                                                    replace(meta, dtype="bfloat16"))
            row["adapter_delta_fp32"] = sparse_sync(lambda v: masters[v], n, root, replace(meta, dtype="float32"))
            row["a_full_adapter_bf16"] = full_file_sync(lambda v: cast(masters[v], torch.bfloat16), n, root)
            scale = args.alpha / args.rank

            def merged_version(v: int) -> dict[str, torch.Tensor]:
                return merged(base, cast(masters[v], torch.bfloat16), lshapes, scale)

            row["b_merged_sparse"] = sparse_sync(merged_version, n, root)
            row["c_full_model_bf16"] = full_file_sync(merged_version, min(n, 2), root)
            result["by_lr"][str(lr)] = row  # type: ignore[index]
            ref = row["adapter_delta_bf16"]["bytes_median"]  # type: ignore[index]
            print(f"lr {lr:g}:")
            for k, m in row.items():
                extra = (
                    f", density {m['density_median']:.2%} ({m['density_min']:.2%}-{m['density_max']:.2%})"
                    if "density_median" in m
                    else ""
                )
                print(f"  {k:22s} {m['bytes_median'] / 1e6:9.3f} MB/version ({m['bytes_median'] / ref:8.1f}x "
                      "adapter-delta bf16), "  # type: ignore[index]
                      f"lag {m['lag_s_median']:.2f} s{extra}")  # type: ignore[index]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result.update(provenance(), date=time.strftime("%Y-%m-%d", time.gmtime()))
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
