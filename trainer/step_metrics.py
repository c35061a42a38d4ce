"""What each training step reports beside its loss: the replicas' status, polled in the background
so the learner never waits on it (`StatusPoller`), the newest commit's sync figures and each
replica's lag, version and pause (`sync_fields`, `replica_fields`), and the gradient norm as a
float on every rank (`grad_norm`). Read-only: nothing here changes the run.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from trainer.replicas import ReplicaPool


class StatusPoller:
    """Polls every replica's /sync in the background so the learner never waits on it."""

    def __init__(self, pool: ReplicaPool, interval_s: float = 1.0) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.latest: dict[str, dict[str, Any] | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="replica-status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.latest = self.pool.sync_status()
            self._stop.wait(self.interval_s)


def grad_norm(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s total norm as a float (a DTensor under FSDP2: the same value on every rank)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def sync_fields(commits: list[dict[str, Any]]) -> dict[str, Any]:
    """Sync metrics of the newest committed delta (None before the first delta)."""
    for m in reversed(commits):
        if "patch_bytes" in m:
            return {"sync_version": m.get("version"), "sync_bytes": m["patch_bytes"],
                    "density": m.get("density"), "n_changed": m.get("n_changed"), "upload_s": m.get("upload_s")}
    return {"sync_version": None, "sync_bytes": None, "density": None, "n_changed": None, "upload_s": None}


def replica_fields(status: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """lag/<i>, version/<i>, pause_s/<i> of each replica (i = its index in the config)."""
    out: dict[str, Any] = {}
    for i, (_url, st) in enumerate(status.items()):
        st = st or {}
        out[f"lag/{i}"] = st.get("lag")
        out[f"replica_version/{i}"] = st.get("current_version")
        out[f"pause_s/{i}"] = st.get("last_apply_s")
    return out
