"""The publisher of an fp32 master published as bf16 (issue 42, item 4): peak host memory beyond
the caller's fp32 state, in bf16 copies of the model, and seconds per publish, casting the whole
state first (what callers did) against `Publisher(dtype=torch.bfloat16)` (one tensor at a time).

Each (size, mode) runs in a fresh process: it builds a Qwen3-shaped fp32 state (vocab 32000,
untied head), resets the peak (VmHWM, Linux clear_refs), publishes version 0 and `--versions`
sparse steps (every 100th element of each tensor) to a local bucket, flushing each, and reports
VmHWM minus the RSS after the state was built.

    python benchmarks/publisher_fp32.py --sizes 768x4,1536x6 --versions 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0]) << 10
    return out


def worker(size: str, mode: str, versions: int) -> None:
    import torch

    from sparsesync.protocol.writer.publisher import Publisher

    hidden, layers = map(int, size.split("x"))
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (32000, hidden),
        "lm_head.weight": (32000, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (3 * hidden, hidden),
            p + "mlp.up_proj.weight": (3 * hidden, hidden),
            p + "mlp.down_proj.weight": (hidden, 3 * hidden),
            p + "input_layernorm.weight": (hidden,),
        }
    # no freed temporaries in the baseline
    state = {n: torch.empty(s).normal_(0, 0.02, generator=g) for n, s in shapes.items()}
    bf16_bytes = sum(t.numel() * 2 for t in state.values())
    Path("/proc/self/clear_refs").write_text("5")
    base = _status()["VmRSS"]
    times = []
    with tempfile.TemporaryDirectory() as bucket, \
            Publisher(bucket, anchor_every=0, dtype=torch.bfloat16 if mode == "dtype" else None) as pub:
        for v in range(versions + 1):
            if v:
                with torch.no_grad():
                    for t in state.values():
                        # distinct elements: deterministic
                        part = t.view(-1)[int(torch.randint(0, 100, (1,), generator=g)) :: 100]
                        part += torch.randn(part.numel(), generator=g) * 1e-3
            t0 = time.perf_counter()
            if mode == "cast-first":
                pub.publish({n: t.to(torch.bfloat16) for n, t in state.items()}, v)
            else:
                pub.publish(state, v)
            pub.flush()
            times.append(time.perf_counter() - t0)
        digest = pub.state_digest
    st = _status()
    print(json.dumps({"size": size, "mode": mode, "bf16_bytes": bf16_bytes,
                      "beyond_state_peak": round((st["VmHWM"] - base) / bf16_bytes, 3),
                      "publish_s_first": round(times[0], 3),
                      "publish_s_delta_mean": round(sum(times[1:]) / max(1, len(times) - 1), 3),
                      "state_digest": digest}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="768x4,1536x6", help="hidden x layers, smallest first")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "publisher_fp32.json"))
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.versions)
        return
    rows = []
    for size in args.sizes.split(","):
        for mode in ("cast-first", "dtype"):
            out = subprocess.run([sys.executable, __file__, "--versions", str(args.versions), "--worker", size, mode],
                                 check=True, capture_output=True, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout  # this tree's sparsesync
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    for a, b in zip(rows[::2], rows[1::2]):
        assert a["state_digest"] == b["state_digest"], f"{a['size']}: the two modes published different weights"
    Path(args.out).write_text(json.dumps({"versions": args.versions, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
