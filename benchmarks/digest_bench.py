"""Tensor digest benchmark: the block-parallel "xxh3b" against the whole-stream "xxh3" it
replaces, in the same process, interleaved (which goes first alternates per rep).

    nice .venv/bin/python benchmarks/digest_bench.py                  # 0.6B params (~5 GB RAM)
    nice .venv/bin/python benchmarks/digest_bench.py --params 5e7     # quick

Three measurements over the tensors of a Qwen3-like model (`_codec_data`):
- `digest`: `tensor_digests(state, algo)` over the whole model (the codec's "tensors" pool, one
  thread per tensor), and `tensor_digest(t, algo)` of the largest tensor alone (xxh3b: C threads
  across its blocks; xxh3: one stream);
- `encode`: `Snapshot.diff_encode` of one AdamW step (the snapshot advances while hashing
  every touched tensor: `put_and_digest`), snapshot built outside the timer;
- `apply`: `apply_patch(read_patch(data), weights)` of that patch (hashing before and after).
Each reports the median and the spread (min, max) of --reps timings per algorithm, and
`ratio_median` = median over reps of new / old for the pair run back to back.
Writes benchmarks/results/digest_bench.json (override with --json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _codec_data import make_weights, provenance, qwen_like_shapes, step  # noqa: E402

from sparsesync.codec import Snapshot, apply_patch, read_patch  # noqa: E402
from sparsesync.codec.digest import tensor_digest, tensor_digests  # noqa: E402

ALGOS = ("xxh3", "xxh3b")  # old, new


def _pairs(reps: int, fns: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    """Each fn timed `reps` times, old and new back to back, the first of the pair alternating."""
    out: dict[str, list[float]] = {a: [] for a in fns}
    for r in range(reps):
        for a in (ALGOS if r % 2 == 0 else ALGOS[::-1]):
            gc.collect()
            t0 = time.perf_counter()
            fns[a]()
            out[a].append(time.perf_counter() - t0)
    return out


def _summary(times: dict[str, list[float]], nbytes: int) -> dict[str, object]:
    old, new = times[ALGOS[0]], times[ALGOS[1]]
    row: dict[str, object] = {}
    for a, ts in times.items():
        med = statistics.median(ts)
        row[a] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "GBps_median": nbytes / med / 1e9, "all_s": ts}
    row["ratio_median"] = statistics.median(n / o for n, o in zip(new, old, strict=True))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=0.6e9, help="model size in parameters (default 0.6e9)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per algorithm")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the step encoded and applied")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "digest_bench.json")
    args = ap.parse_args()

    weights = make_weights(qwen_like_shapes(args.params))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    big = max(weights.values(), key=lambda t: t.numel())
    rows: dict[str, object] = {
        "params": args.params,
        "model_bytes": nbytes,
        "largest_tensor_bytes": big.numel() * big.element_size(),
        "torch_threads": torch.get_num_threads(),
        "reps": args.reps,
    }
    rows["digest_model"] = _summary(
        _pairs(args.reps, {a: (lambda a=a: tensor_digests(weights, a)) for a in ALGOS}), nbytes
    )
    rows["digest_largest"] = _summary(_pairs(args.reps, {a: (lambda a=a: tensor_digest(big, a)) for a in ALGOS}),
                                      big.numel() * big.element_size())
    target = step(weights, args.lr, master=True)
    snaps = {a: Snapshot(weights, 0, algo=a) for a in ALGOS}
    patches: dict[str, bytes] = {}
    enc: dict[str, list[float]] = {a: [] for a in ALGOS}
    for r in range(args.reps):  # the snapshot goes 0 -> 1 and back each rep: the same work every time
        for a in (ALGOS if r % 2 == 0 else ALGOS[::-1]):
            gc.collect()
            t0 = time.perf_counter()
            p = snaps[a].diff_encode(target, 2 * r + 1)
            enc[a].append(time.perf_counter() - t0)
            patches[a] = p.data
            snaps[a].diff_encode(weights, 2 * r + 2)
    rows["encode"] = _summary(enc, nbytes)
    del snaps
    gc.collect()
    work = {a: {k: t.clone() for k, t in weights.items()} for a in ALGOS}
    undo = {a: read_patch(patches[a]) for a in ALGOS}
    app: dict[str, list[float]] = {a: [] for a in ALGOS}
    for r in range(args.reps):
        for a in (ALGOS if r % 2 == 0 else ALGOS[::-1]):
            gc.collect()
            t0 = time.perf_counter()
            apply_patch(read_patch(patches[a]), work[a])
            app[a].append(time.perf_counter() - t0)
            for name, e in undo[a].header.tensors.items():  # back to the base, outside the timer
                work[a][name].copy_(weights[name])
            del e
    rows["apply"] = _summary(app, nbytes)
    rows["patch_bytes"] = {a: len(patches[a]) for a in ALGOS}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**provenance(), **rows}, indent=2) + "\n")
    print(
        f"model {nbytes / 1e9:.2f} GB, largest tensor {rows['largest_tensor_bytes'] / 1e6:.0f} MB, {args.reps} reps "
        "(median, [min, max])"
    )
    for what in ("digest_model", "digest_largest", "encode", "apply"):
        r = rows[what]
        cells = "  ".join(
            f"{a}: {r[a]['median_s'] * 1e3:8.1f} ms [{r[a]['min_s'] * 1e3:.1f}, {r[a]['max_s'] * 1e3:.1f}]"
            for a in ALGOS
        )
        print(f"{what:15s} {cells}  new/old median {r['ratio_median']:.3f}")


if __name__ == "__main__":
    main()
