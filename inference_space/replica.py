"""A replica: one engine plus the follower that keeps it at the newest committed version.

Guarantees:
- Until the first version is committed (or when no bucket is configured), the engine serves
  the weights from `--model` and reports weight_version null. As soon as a version exists, the
  follower loads the newest anchor into the engine, then applies each delta in place.
- Fetch, verify and decode run on the follower's thread while the engine keeps generating; the
  engine is paused only inside the hook (see `engines.base` for the in-flight policy).
- When the run is a LoRA adapter run (its newest commit at start says so), the engine serves
  the run's base model (checked against its digest) plus the adapter (the LoRA variant of its
  engine, `engines.make_engine(..., adapter=...)`).
- Host memory: the follower's mirror is the replica's only host copy of the weights besides the
  engine's own (the vLLM engine keeps none), in a file map on local disk (`--mirror-dir`,
  `sparsesync.protocol.follower.mirror`); freed memory goes back to the OS after every version.
- A replica whose sync fails (anchor fallback, store unreachable, bad patch, engine failure)
  keeps serving its last good version; `status()` then says state "degraded" with the error.
- `build_replica` opens the bucket once: the run's adapter is read and the follower follows
  through that one store, which the replica closes in `close()`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from inference_space.engines import Engine
from sparsesync.errors import ConfigError
from sparsesync.protocol.follower.fleet_member import FleetOptions
from sparsesync.protocol.follower.follower import Follower
from sparsesync.store import Store


@dataclass
class ReplicaConfig:
    """Everything a replica is started with (CLI flags or environment variables)."""

    model: str  # model folder the engine starts from (and whose layout the run must match)
    bucket: str | None = None  # run URL to follow (folder, file://, s3://, hf://buckets/...); None: serve --model only
    engine: str = "embedded"  # "embedded" | "vllm"
    host: str = "127.0.0.1"
    port: int = 8000
    poll_interval: float = 1.0  # seconds between commit listings (backs off to 15 s when idle)
    served_model_name: str | None = None  # the `model` name reported by the API (default: folder name)
    kv_cache_mib: int = 192  # vLLM only: KV cache size (CPU, or GPU when gpu_memory_utilization unset)
    gpu_memory_utilization: float | None = None  # vLLM on GPU: fraction of memory instead of kv_cache_mib
    tensor_parallel_size: int = 1  # vLLM only: workers per replica (>1: multiprocessing executor, updates via /dev/shm)
    api_key: str | None = field(default=None, repr=False)  # clients send `Authorization: Bearer <key>`; None: open
    max_body_bytes: int = 8 << 20  # larger request bodies get 413 before they are read
    request_timeout_s: float | None = 600.0  # a batch running longer is cut (finish "abort"); None: never
    max_hold_s: float | None = 60.0  # a batch keeping a committed version waiting longer is cut; None: never
    # vLLM only: "auto" (= "reload", CPU and GPU) | "reload" | "sparse" (GPU, opt-in, not yet run on one)
    vllm_apply: str = "auto"
    # embedded engine only: torch device ("cuda", "cuda:1", "cpu"); the CLI defaults to cuda when there is one
    device: str = "cpu"
    # folder on local disk for the follower's file-backed mirror (None: SPARSESYNC_MIRROR_DIR or
    # ~/.cache/sparsesync/mirror)
    mirror_dir: str | None = None


class Replica:
    """An engine following a run (see module docstring)."""

    def __init__(self, engine: Engine, bucket: str | Store | None = None, *, poll_interval: float = 1.0,
                 served_model_name: str | None = None, mirror_dir: str | None = None) -> None:
        """`bucket`: the run to follow, a URL (the follower opens and closes its store) or an open
        `Store` (the replica's from now on: `close()` closes it); None serves the model as is."""
        self.engine = engine
        self.bucket = bucket
        self.model_name = served_model_name or engine.model_name
        self.model_aliases: tuple[str, ...] = ()  # other names requests may use (the Hub id the model came from)
        # heartbeats into the run (and coordinated switching when SPARSESYNC_SWITCH=coordinated)
        fleet = FleetOptions(engine=engine.name)
        self.follower: Follower | None = Follower(
            bucket, hook=engine, poll_interval=poll_interval, fleet=fleet, adapter=getattr(engine, "adapter", None),
            mirror_dir=mirror_dir,
        ) if bucket else None
        self._store = bucket if isinstance(bucket, Store) else None
        self.started_at = time.time()

    def start(self) -> None:
        if self.follower is not None:
            self.follower.start()

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()

    def close(self) -> None:
        self.stop()
        if self._store is not None:
            self._store.close()
        self.engine.close()

    @property
    def weight_version(self) -> int | None:
        return self.engine.weight_version

    def status(self) -> dict[str, Any]:
        """The sync status served at /sync: the follower's view plus the engine's pauses."""
        if self.follower is not None:
            st = self.follower.status().to_dict()
        else:
            st = {
                "url": None, "current_version": None, "newest_version": None, "lag": None,
                "state": "static", "last_error": None, "last_fetch_s": None, "last_apply_s": None,
                "last_apply_at": None, "versions_applied": 0, "anchor_loads": 0,
            }
        if self.engine.check_error is not None:  # the engine does not hold a verified version
            st.update(state="degraded", last_error=self.engine.check_error)
        p = self.engine.pauses
        st.update(
            serving_version=self.engine.weight_version,
            engine=self.engine.name,
            model=self.model_name,
            pause_count=p.count,
            pause_last_ms=p.last_ms,
            pause_mean_ms=p.mean_ms,
            pause_max_ms=p.max_ms,
            pause_last_wait_ms=p.last_wait_ms,
            uptime_s=time.time() - self.started_at,
        )
        return st


def build_replica(cfg: ReplicaConfig) -> Replica:
    """Load the engine for `cfg` and attach a follower (not started)."""
    from inference_space.engines import make_engine

    model = given = cfg.model
    if not Path(model).is_dir():
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
            raise ConfigError(
                f"model {model!r} is neither a folder nor a Hub model id", hint="pass --model DIR or NS/NAME"
            )
        from huggingface_hub import snapshot_download

        model = snapshot_download(model)  # HF_TOKEN from the environment (a Space secret) if private
    cfg = replace(cfg, model=model)
    kwargs: dict[str, Any] = {}
    if cfg.engine == "vllm":
        kwargs = {
            "kv_cache_memory_bytes": cfg.kv_cache_mib << 20,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "mode": cfg.vllm_apply,
        }
    else:
        kwargs = {"device": cfg.device}
    from sparsesync.store import open_store

    store = open_store(cfg.bucket) if cfg.bucket else None  # once: the adapter is read and the run followed through it
    try:
        if store is not None:  # an adapter run: the engine serves its base + adapter (sparsesync.lora.bridge)
            from sparsesync.protocol.adapter_runs import read_run_adapter

            kwargs["adapter"] = read_run_adapter(store)
        engine = make_engine(cfg.engine, cfg.model, **kwargs)
    except BaseException:
        if store is not None:
            store.close()
        raise
    engine.request_timeout_s, engine.max_hold_s = cfg.request_timeout_s, cfg.max_hold_s
    replica = Replica(engine, store, poll_interval=cfg.poll_interval, served_model_name=cfg.served_model_name,
                      mirror_dir=cfg.mirror_dir)
    replica.model_aliases = (given,)
    return replica
