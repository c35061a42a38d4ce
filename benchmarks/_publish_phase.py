"""The trainer's stall in `Publisher.publish()` on device weights, and the lag to a follower
(used by gpu_bench.py; one phase per shape).

A `Publisher` on a local folder whose snapshot sits beside the weights (`snapshot="auto"` on
CUDA: on the GPU when the model fits twice, else pinned host memory; on a CPU run the same
device path forced with `snapshot="device"`) publishes version 0 (an anchor), then each rep
one version, alternating target and base (the same density). Per rep:
- `publish_stall_s`: `publish()` from call to return, with the device synchronized on both sides
  (its extraction, the two reads, the snapshot's advance); the entropy coding is not in it.
- `follower_sync_s`: a `Follower` on the folder (host mirror) syncing that version after
  `flush()` (fetch, decode, checks, apply): the decode side.
- `follower_lag_s`: from the `publish()` call to the follower holding the version
  (stall + background coding + upload + the follower's sync), and
  `lag_over_stall_plus_decode` = lag / (stall + follower_sync_s), per rep (the best in the row).
- `publish_patch_bytes_over_snapshot`: its first patch's size over `Snapshot.diff_encode`'s of the
  same step (1.0 on CPU weights: both paths group small tensors alike; on CUDA weights below
  1.0 when the model has small tensors, which the host snapshot groups only for CPU weights).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparsesync.codec.diff import bits_view
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.writer.publisher import Publisher


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_publish(dev: torch.device, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], reps: int,
                  left: Callable[[], float], row: dict[str, Any], save: Callable[[], None]) -> None:
    """Fill `row` with the publish phase's figures (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-run-") as tmp:
        url = str(Path(tmp) / "run")
        t0 = time.perf_counter()
        pub = Publisher(url, snapshot="auto" if dev.type == "cuda" else "device", anchor_every=0)
        try:
            pub.publish(a, 0)
            pub.flush()
            follower = Follower(url, poll_interval=0.05)
            follower.sync_once()
            row.update(publish_first_s=time.perf_counter() - t0, snapshot_device=pub.snapshot_device)
            stalls: list[float] = []
            lags: list[float] = []
            syncs: list[float] = []
            metrics: list[dict[str, Any]] = []
            pair = (b, a)
            for i in range(reps):
                if i and left() < 3 * lags[0] + 10:
                    row["publish_note"] = f"stopped after {i} reps (budget)"
                    break
                _sync(dev)
                t0 = time.perf_counter()
                pub.publish(pair[i % 2], i + 1)
                _sync(dev)
                t1 = time.perf_counter()
                pub.flush()
                t2 = time.perf_counter()
                got = follower.sync_once()
                t3 = time.perf_counter()
                if got != i + 1:
                    raise RuntimeError(f"the follower reached version {got}, expected {i + 1}")
                stalls.append(t1 - t0)
                lags.append(t3 - t0)
                syncs.append(t3 - t2)
                metrics.append(pub.metrics[-1])
                save()
            last = pair[(len(stalls) - 1) % 2]
            exact = all(torch.equal(bits_view(follower.mirror[k]), bits_view(last[k]).cpu()) for k in last)
        finally:
            pub.close()
    m = metrics[0]
    row.update(
        publish_stall_s=min(stalls), publish_stall_all_s=stalls, follower_sync_s=min(syncs), follower_sync_all_s=syncs,
        follower_lag_s=min(lags), follower_lag_all_s=lags,
        lag_over_stall_plus_decode=min(lag / (s + d) for lag, s, d in zip(lags, stalls, syncs)),
        publish_encode_all_s=[x["encode_s"] for x in metrics], publish_extract_all_s=[x["diff_s"] for x in metrics],
        publish_patch_bytes=m["patch_bytes"], publish_B_per_changed=m["patch_bytes"] / max(1, m["n_changed"]),
        publish_follower_bit_exact=exact,
    )
    if isinstance(row.get("patch_bytes"), int):  # 1.0 on CPU weights (both paths group small tensors)
        row["publish_patch_bytes_over_snapshot"] = m["patch_bytes"] / row["patch_bytes"]
    if isinstance(row.get("trl_extract_s"), float):
        row["publish_stall_over_trl"] = row["publish_stall_s"] / row["trl_extract_s"]
    save()
