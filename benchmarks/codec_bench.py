"""Codec benchmark: patch size and throughput on realistic RL deltas, side by side with a
plain TRL-style extraction (torch nonzero + gather + safetensors save) in the same run.

    nice .venv/bin/python benchmarks/codec_bench.py                 # 0.6B params (~8 GB RAM, ~3-5 min on 2 cores)
    nice .venv/bin/python benchmarks/codec_bench.py --params 5e7    # quick
    # speed sweep:
    nice .venv/bin/python benchmarks/codec_bench.py --lrs '' --modes master --densities 0.001,0.003,0.01,0.03,0.1
    # both sides on one thread (fair on a loaded machine):
    nice .venv/bin/python benchmarks/codec_bench.py --threads 1 ...
    nice .venv/bin/python benchmarks/codec_bench.py --effort size,speed ...   # the codec's two efforts side by side

Writes benchmarks/results/codec_bench.json (override with --json) and prints a table.

Reports, per training mode (fp32 master weights / pure bf16) and learning rate (--lrs, plus one
per target density of --densities, found by bisection on a small model of the same shape): density, bytes
per changed element for TRL's prototype encodings (int32 index + bf16 = 6 B; uint16 gap + bf16
= 4 B), the position entropy bound (per tensor; and conditioned on the base's exponent), ours;
diff+encode and decode+apply throughput in GB of model weights per second.

Timings are the best of --reps runs (medians and every run are in the JSON too), ours and the
TRL-style extraction interleaved, so that load from other processes on a shared machine skews
neither side; which goes first alternates. `paired_ratio_median` is the median over reps of ours
over the extraction of the same rep: the pairs ran back to back, so slow phases of a shared
machine cancel out of it, where they can decide a ratio of two separate bests. The writer's
snapshot (its full copy of the base) exists before the timer starts, as it does in training.
`decode_apply_s` is `apply_patch(read_patch(data), weights)` from the bytes: read, decode and
validate, write in place while hashing every touched tensor before and after its writes, and
compare with the base and target digests. `follower_apply_s` is the same with
`check_base_digest=False`, as the protocol's follower applies (its mirror was verified when it
was last written); `decode_validate_s` is the read and decode alone (nothing written).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import make_weights, provenance, qwen_like_shapes, step  # noqa: E402

from sparsesync.codec import Snapshot, apply_patch, decode_patch, read_patch  # noqa: E402
from sparsesync.codec._encodings import key_of  # noqa: E402


def _h(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1 - 1e-16)
    return -(p * np.log2(p) + (1 - p) * np.log2(1 - p))


def entropy_bounds(base: dict[str, torch.Tensor], changes: dict) -> tuple[float, float, float]:
    """Bits (position entropy per tensor, same conditioned on the base's 7-bit magnitude key,
    value-delta entropy per tensor), summed over tensors."""
    pos = cond = val = 0.0
    for name, ch in changes.items():
        numel = ch.numel
        pos += numel * float(_h(np.array(ch.n_changed / numel)))
        bits = base[name].reshape(-1).view(torch.int16 if base[name].element_size() == 2 else torch.int32).numpy()
        bits = bits.view(np.uint16 if bits.itemsize == 2 else np.uint32)
        tot = np.bincount(key_of(bits), minlength=128)
        chg = np.bincount(key_of(ch.base_bits), minlength=128)
        m = tot > 0
        cond += float((tot[m] * _h(chg[m] / tot[m])).sum())
        d = ch.target_bits.astype(np.int64) - ch.base_bits.astype(np.int64)
        _, c = np.unique(d, return_counts=True)
        p = c / c.sum()
        val += float(-(c * np.log2(p)).sum())
    return pos, cond, val


def trl_extract(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> bytes:
    """The plain baseline: bitwise compare, nonzero, gather, save int32 indices + bf16 values."""
    out = {}
    for name, b in base.items():
        t = target[name]
        ib, it = (
            b.reshape(-1).view(torch.int16 if b.element_size() == 2 else torch.int32),
            t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32),
        )
        idx = torch.nonzero(ib != it).squeeze(1)
        if idx.numel():
            out[name + ".indices"] = idx.to(torch.int32)
            out[name + ".values"] = t.reshape(-1)[idx]
    return st_save(out)


def trl_apply(data: bytes, tensors: dict[str, torch.Tensor]) -> None:
    d = st_load(data)
    for key, idx in d.items():
        if key.endswith(".indices"):
            name = key[: -len(".indices")]
            tensors[name].view(-1)[idx.long()] = d[name + ".values"]


def lr_for_density(mode: str, density: float, seed: int) -> float:
    """The learning rate at which one `step` changes about `density` of the elements of a
    5M-parameter model of the same shape and weight distribution (bisection in log lr)."""
    small = make_weights(qwen_like_shapes(5e6), seed)
    n = sum(t.numel() for t in small.values())
    lo, hi = math.log(1e-10), math.log(1e-2)
    for _ in range(12):
        mid = (lo + hi) / 2
        stepped = step(small, math.exp(mid), master=(mode == "master"), seed=seed + 1)
        got = (
            sum(
                int((a.view(torch.int16) != b.view(torch.int16)).sum())
                for a, b in zip(small.values(), stepped.values())
            )
            / n
        )
        lo, hi = (mid, hi) if got < density else (lo, mid)
    # with master weights a step changes some elements at any lr (ties of the residual at a power of two)
    if hi < math.log(1e-9):
        print(
            f"density {density} is below what mode {mode} reaches at any learning rate: its cell runs at the floor",
            flush=True,
        )
    return float(f"{math.exp((lo + hi) / 2):.3g}")


def run(
    params: float, lrs_by_mode: dict[str, list[float]], seed: int, reps: int = 3, efforts: tuple[str, ...] = ("size",)
) -> list[dict]:
    shapes = qwen_like_shapes(params)
    base = make_weights(shapes, seed)
    n_params = sum(t.numel() for t in base.values())
    model_gb = sum(t.numel() * t.element_size() for t in base.values()) / 1e9
    print(
        f"model: {n_params / 1e6:.1f}M params, {model_gb:.2f} GB bf16, {len(base)} tensors, torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    rows = []
    for mode, lrs in lrs_by_mode.items():
        for lr in lrs:
            target = step(base, lr, master=(mode == "master"), seed=seed + 1)
            for effort in efforts:
                gc.collect()
                # ours: diff + encode (the snapshot is the writer's copy of the base), interleaved with
                # the TRL-style extraction, which goes first in every other rep (neither side always
                # runs right after the snapshot is built); best of `reps`, and the median of the
                # per-rep ratios (each pair ran back to back: drift of the machine cancels)
                t_ours = t_trl = float("inf")
                all_ours, all_trl = [], []
                for i in range(reps):
                    trl = enc = None  # both sides' previous results freed before either runs
                    snap = Snapshot(base, 0, effort=effort)
                    for side in ("ours", "trl") if i % 2 == 0 else ("trl", "ours"):
                        if side == "ours":
                            gc.collect()
                            t0 = time.perf_counter()
                            enc = snap.diff_encode(target, 1)
                            dt = time.perf_counter() - t0
                            all_ours.append(dt)
                            if dt < t_ours:  # the diff/encode split of the best run
                                t_ours, stats = dt, enc.stats
                        else:
                            gc.collect()
                            t0 = time.perf_counter()
                            trl = trl_extract(base, target)
                            all_trl.append(time.perf_counter() - t0)
                            t_trl = min(t_trl, all_trl[-1])
                n = enc.stats.n_changed
                pos_b, cond_b, val_b = entropy_bounds(base, enc.changes)
                gaps16 = 0
                for ch in enc.changes.values():
                    g = np.diff(ch.indices, prepend=0)
                    gaps16 += int((g >= 65536).sum())
                # decode + apply (ours: validate everything, write, check the base and target
                # digests; the follower's: the same without the base digest), the decode alone, and
                # the TRL-style apply; best of `reps`
                t_apply = t_follow = t_dec = t_trl_apply = float("inf")
                for _ in range(reps):
                    for check_base in (True, False):
                        work = {k: v.clone() for k, v in base.items()}
                        gc.collect()
                        t0 = time.perf_counter()
                        patch = read_patch(enc.data)
                        apply_patch(patch, work, check_base_digest=check_base)
                        dt = time.perf_counter() - t0
                        if check_base:
                            t_apply = min(t_apply, dt)
                        else:
                            t_follow = min(t_follow, dt)
                        ok = all(torch.equal(work[k].view(torch.uint8), snap.state[k].view(torch.uint8)) for k in work)
                        del work
                    gc.collect()
                    t0 = time.perf_counter()
                    decode_patch(read_patch(enc.data), base, check_base_digest=False)
                    t_dec = min(t_dec, time.perf_counter() - t0)
                    work2 = {k: v.clone() for k, v in base.items()}
                    gc.collect()
                    t0 = time.perf_counter()
                    trl_apply(trl, work2)
                    t_trl_apply = min(t_trl_apply, time.perf_counter() - t0)
                    del work2
                sizes: dict[str, int] = {}
                for e in patch.header.tensors.values():
                    for role, sz in e.stream_sizes.items():
                        kind = (
                            "positions"
                            if role in ("indices", "gaps", "gaps_escape", "gaps_low", "bitmap")
                            else "values"
                        )
                        sizes[kind] = sizes.get(kind, 0) + sz
                header = len(enc.data) - sum(sizes.values())
                row = {
                    "mode": mode,
                    "effort": effort,
                    "lr": lr,
                    "density": n / n_params,
                    "n_changed": n,
                    "trl_int32_bf16_B": (len(trl)) / n,
                    "trl_gap16_bf16_B": (4 * n + 6 * gaps16) / n,
                    "pos_entropy_B": pos_b / 8 / n,
                    "pos_entropy_cond_exp_B": cond_b / 8 / n,
                    "value_entropy_B": val_b / 8 / n,
                    "ours_B": len(enc.data) / n,
                    "ours_positions_B": sizes.get("positions", 0) / n,
                    "ours_values_B": sizes.get("values", 0) / n,
                    "ours_header_B": header / n,
                    "diff_encode_GBps": model_gb / t_ours,
                    "diff_encode_s": t_ours,
                    "diff_s": stats.diff_s,
                    "encode_s": stats.encode_s,
                    "trl_extract_s": t_trl,
                    "diff_encode_median_s": statistics.median(all_ours),
                    "trl_extract_median_s": statistics.median(all_trl),
                    "paired_ratio_median": statistics.median(o / t for o, t in zip(all_ours, all_trl)),
                    "diff_encode_all_s": all_ours,
                    "trl_extract_all_s": all_trl,
                    "trl_extract_GBps": model_gb / t_trl,
                    "decode_apply_s": t_apply,
                    "decode_validate_s": t_dec,
                    "follower_apply_s": t_follow,
                    "decode_apply_GBps": model_gb / t_apply,
                    "trl_apply_s": t_trl_apply,
                    "bit_exact": ok,
                    "reps": reps,
                }
                rows.append(row)
                print(
                    json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}),
                    flush=True,
                )
                del snap, enc, patch, trl
                gc.collect()
            del target
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.6e9, help="model size in parameters (default 0.6e9)")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated AdamW learning rates")
    ap.add_argument("--modes", default="master,bf16", help="master (fp32 master weights) and/or bf16 (pure bf16)")
    ap.add_argument(
        "--densities",
        default="",
        help="comma-separated target densities (e.g. 0.001,0.01,0.1): one learning rate each, per mode",
    )
    ap.add_argument(
        "--effort",
        default="size",
        help="comma-separated: size (default: smallest patches), speed (no class-conditioned coding)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="threads for both sides (torch and the codec's pools); default: torch's default and the codec's",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (best is reported; medians in the JSON)")
    ap.add_argument(
        "--json",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "codec_bench.json",
        help="write the rows here",
    )
    a = ap.parse_args()
    if a.threads:  # before the codec's pools start
        torch.set_num_threads(a.threads)
        os.environ["SPARSESYNC_CODEC_THREADS"] = str(a.threads)
    t_start = time.perf_counter()
    lrs_by_mode = {
        mode: [float(x) for x in a.lrs.split(",") if x]
        + [lr_for_density(mode, float(d), a.seed) for d in a.densities.split(",") if d]
        for mode in a.modes.split(",")
    }
    print(f"learning rates: {lrs_by_mode}", flush=True)
    rows = run(a.params, lrs_by_mode, a.seed, a.reps, tuple(a.effort.split(",")))
    print(
        "\nbytes per changed element (B): TRL6 = int32 index + bf16, TRL4 = uint16 gap + bf16, H(pos) = position "
        "entropy per tensor,"
    )
    print(
        "H|exp = same conditioned on the base's exponent, ours = whole patch file (pos + val + header); throughput in "
        "GB of bf16 weights/s"
    )
    hdr = (
        f"{'mode':7} {'effort':6} {'lr':>7} {'density':>8} {'TRL6':>6} {'TRL4':>6} {'H(pos)':>7} {'H|exp':>7} "
        f"{'ours':>6} {'pos':>5} {'val':>5} {'hdr':>5} {'ours GB/s':>9} {'TRL GB/s':>8} {'apply s':>7} "
        f"{'TRL apply s':>11}"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['mode']:7} {r['effort']:6} {r['lr']:7.0e} {r['density']:8.4f} {r['trl_int32_bf16_B']:6.2f} "
            f"{r['trl_gap16_bf16_B']:6.2f} {r['pos_entropy_B']:7.3f} {r['pos_entropy_cond_exp_B']:7.3f} "
            f"{r['ours_B']:6.3f} {r['ours_positions_B']:5.2f} {r['ours_values_B']:5.2f} {r['ours_header_B']:5.2f} "
            f"{r['diff_encode_GBps']:9.2f} {r['trl_extract_GBps']:8.2f} {r['decode_apply_s']:7.2f} "
            f"{r['trl_apply_s']:11.2f}"
        )
    a.json.parent.mkdir(parents=True, exist_ok=True)
    env = {
        "params": a.params,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "codec_threads": os.environ.get("SPARSESYNC_CODEC_THREADS", "default"),
        "cpus": os.cpu_count(),
        "wall_s": time.perf_counter() - t_start,
    }
    a.json.write_text(json.dumps({**provenance(), "env": env, "rows": rows}, indent=1))
    print(
        "\nseconds for the whole model (best / median of --reps, ours and TRL-style interleaved; ratio of the bests, "
        "and median of the per-rep ratios):"
    )
    print(
        f"{'mode':7} {'effort':6} {'lr':>7} {'density':>8} {'diff+encode':>16} {'TRL extract':>16} {'ratio':>6} "
        f"{'paired':>6} {'decode+apply':>12} {'no base chk':>11} {'TRL apply':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:7} {r['effort']:6} {r['lr']:7.0e} {r['density']:8.4f} {r['diff_encode_s']:7.2f} / "
            f"{r['diff_encode_median_s']:5.2f} {r['trl_extract_s']:7.2f} / {r['trl_extract_median_s']:5.2f} "
            f"{r['diff_encode_s'] / r['trl_extract_s']:6.2f} {r['paired_ratio_median']:6.2f} "
            f"{r['decode_apply_s']:12.2f} {r['follower_apply_s']:11.2f} {r['trl_apply_s']:9.2f}"
        )
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
