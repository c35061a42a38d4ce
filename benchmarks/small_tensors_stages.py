"""Stages of one version of benchmarks/small_tensors.py's states, in process (no store, no threads
of the protocol): `Snapshot.diff_encode`, `read_patch`, `apply_patch`, medians over `--reps`
versions after one warm-up. Finer than publish-to-applied, whose spread on a shared machine hides
changes of a few ms; run it alternately against a baseline tree:

    for i in 1 2 3; do for t in /tmp/base $PWD; do PYTHONPATH=$t python benchmarks/small_tensors_stages.py; done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from small_tensors import adapter_state, one_element, perturb  # noqa: E402

from sparsesync.codec import apply_patch, read_patch  # noqa: E402
from sparsesync.codec.snapshot import Snapshot  # noqa: E402


def stages(case: str, density: float, reps: int) -> dict[str, float]:
    st = adapter_state(extra=8 if case == "fixed" else 0)
    snap, replica = Snapshot(st, 0), {k: v.clone() for k, v in st.items()}
    g, cur, rows = torch.Generator().manual_seed(1), st, []
    for v in range(1, reps + 2):
        cur = one_element(cur, v) if case == "fixed" else perturb(cur, density, g)
        t0 = time.perf_counter()
        p = snap.diff_encode(cur, v)
        t1 = time.perf_counter()
        patch = read_patch(p.data)
        t2 = time.perf_counter()
        apply_patch(patch, replica)
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, len(p.data)))
    assert all(torch.equal(replica[k], cur[k]) for k in cur)
    rows = rows[1:]
    return {k: statistics.median(r[i] for r in rows) * (1 if k == "patch_bytes" else 1e3)
            for i, k in enumerate(["diff_encode_ms", "read_patch_ms", "apply_ms", "patch_bytes"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import sparsesync
    print(json.dumps({"tree": str(Path(sparsesync.__file__).parent.parent), "fixed": stages("fixed", 0.0, args.reps),
                      "adapter 0.01": stages("adapter", 0.01, args.reps)}))


if __name__ == "__main__":
    main()
