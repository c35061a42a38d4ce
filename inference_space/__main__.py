"""Start a replica: `python -m inference_space --model DIR --bucket URL --engine embedded|vllm`.

Every flag has an environment variable (used by the Space, where the flags are not set); a
flag wins over its variable. See inference_space/README.md for the table. Exits with one
clear line (and status 2) when the configuration is wrong.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from inference_space.replica import ReplicaConfig
from sparsesync.access import check_access, is_set
from sparsesync.errors import SparsesyncError

if TYPE_CHECKING:
    from inference_space.replica import Replica

ENV = {  # flag -> environment variable
    "model": "SPARSESYNC_MODEL",
    "bucket": "SPARSESYNC_BUCKET",
    "run": "SPARSESYNC_RUN",
    "engine": "SPARSESYNC_ENGINE",
    "host": "HOST",
    "port": "PORT",
    "poll_interval": "SPARSESYNC_POLL_INTERVAL",
    "served_model_name": "SPARSESYNC_SERVED_MODEL_NAME",
    "kv_cache_mib": "SPARSESYNC_KV_CACHE_MIB",
    "gpu_memory_utilization": "SPARSESYNC_GPU_MEMORY_UTILIZATION",
    "tensor_parallel_size": "SPARSESYNC_TENSOR_PARALLEL_SIZE",
    "vllm_apply": "SPARSESYNC_VLLM_APPLY",
    "device": "SPARSESYNC_DEVICE",
    "mirror_dir": "SPARSESYNC_MIRROR_DIR",
    "log_level": "SPARSESYNC_LOG_LEVEL",
    "api_key": "SPARSESYNC_API_KEY",
    "allow_no_key": "SPARSESYNC_ALLOW_NO_KEY",
    "max_body_bytes": "SPARSESYNC_MAX_BODY_BYTES",
    "request_timeout": "SPARSESYNC_REQUEST_TIMEOUT_S",
    "max_hold": "SPARSESYNC_MAX_HOLD_S",
}


def parse_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> tuple[ReplicaConfig, str]:
    """Flags, then environment variables, then defaults; returns (config, log level)."""
    env = dict(os.environ if environ is None else environ)
    p = argparse.ArgumentParser(prog="python -m inference_space", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (transformers/safetensors) [SPARSESYNC_MODEL]")
    p.add_argument(
        "--bucket", help="run URL to follow: folder, file://, s3://, hf://buckets/NS/NAME/PREFIX [SPARSESYNC_BUCKET]"
    )
    p.add_argument("--run", help="run name, appended to the bucket URL as a path segment [SPARSESYNC_RUN]")
    p.add_argument(
        "--engine", choices=["embedded", "vllm"], help="inference engine (default embedded) [SPARSESYNC_ENGINE]"
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1; the Space uses 0.0.0.0) [HOST]")
    p.add_argument("--port", type=int, help="port (default 8000) [PORT]")
    p.add_argument(
        "--poll-interval", type=float, help="seconds between commit listings (default 1) [SPARSESYNC_POLL_INTERVAL]"
    )
    p.add_argument("--served-model-name", help="model name reported by the API [SPARSESYNC_SERVED_MODEL_NAME]")
    p.add_argument("--kv-cache-mib", type=int, help="vLLM KV cache size in MiB (default 192) [SPARSESYNC_KV_CACHE_MIB]")
    p.add_argument(
        "--gpu-memory-utilization", type=float, help="vLLM on GPU: memory fraction [SPARSESYNC_GPU_MEMORY_UTILIZATION]"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="vLLM: GPUs (or CPU workers) per replica, default 1 [SPARSESYNC_TENSOR_PARALLEL_SIZE]",
    )
    p.add_argument("--vllm-apply", help="vLLM: how versions reach the engine: auto (= reload, CPU and GPU), reload, or "
                   "sparse (GPU only, in place; not yet run on a GPU) [SPARSESYNC_VLLM_APPLY]")
    p.add_argument("--device", help="embedded engine: torch device, e.g. cuda, cuda:1, cpu (default cuda when one is "
                   "available, else cpu) [SPARSESYNC_DEVICE]")
    p.add_argument(
        "--mirror-dir",
        help="folder on local disk (not tmpfs) for the follower's file-backed copy of the weights "
        "(default ~/.cache/sparsesync/mirror) [SPARSESYNC_MIRROR_DIR]",
    )
    p.add_argument("--log-level", help="logging level (default INFO) [SPARSESYNC_LOG_LEVEL]")
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every route but /health; at least 8 characters "
        "[SPARSESYNC_API_KEY]",
    )
    p.add_argument(
        "--allow-no-key",
        action="store_const",
        const="1",
        help="serve with no API key on an address other than "
        "loopback (refused otherwise): anyone who reaches it can use it [SPARSESYNC_ALLOW_NO_KEY=1]",
    )
    p.add_argument(
        "--max-body-bytes", type=int, help="request body cap, 413 above (default 8 MiB) [SPARSESYNC_MAX_BODY_BYTES]"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        help="seconds a batch may run, then cut; 0: never (default 600) [SPARSESYNC_REQUEST_TIMEOUT_S]",
    )
    p.add_argument(
        "--max-hold",
        type=float,
        help="seconds a batch may keep a committed version waiting, then cut; 0: never (default 60) "
             "[SPARSESYNC_MAX_HOLD_S]",
    )
    args = vars(p.parse_args(argv))
    for key, var in ENV.items():
        if args.get(key) in (None, "") and env.get(var):
            args[key] = env[var]
    if not args.get("model"):
        raise SparsesyncError("no model given", hint="pass --model DIR or set SPARSESYNC_MODEL")
    engine = args.get("engine") or "embedded"
    if engine not in ("embedded", "vllm"):
        raise SparsesyncError(
            f"engine '{engine}': expected 'embedded' or 'vllm'", hint="set SPARSESYNC_ENGINE=embedded|vllm"
        )
    vllm_apply = str(args.get("vllm_apply") or "auto")
    if vllm_apply not in ("auto", "reload", "sparse"):
        raise SparsesyncError(
            f"vllm apply mode '{vllm_apply}': expected auto, reload or sparse", hint="--vllm-apply auto|reload|sparse"
        )
    device = _device(args.get("device") or None)
    host = str(args.get("host") or "127.0.0.1")
    bucket = args.get("bucket") or None
    if bucket and args.get("run"):
        bucket = bucket.rstrip("/") + "/" + str(args["run"]).strip("/")
    try:
        cfg = ReplicaConfig(
            model=str(args["model"]),
            bucket=bucket,
            engine=engine,
            host=host,
            port=int(args.get("port") or 8000),
            poll_interval=float(args.get("poll_interval") or 1.0),
            served_model_name=args.get("served_model_name") or None,
            kv_cache_mib=int(args.get("kv_cache_mib") or 192),
            gpu_memory_utilization=float(args["gpu_memory_utilization"])
            if args.get("gpu_memory_utilization")
            else None,
            tensor_parallel_size=int(args.get("tensor_parallel_size") or 1),
            api_key=check_access(
                args.get("api_key") or None,
                host,
                allow_open=is_set(args.get("allow_no_key")),
                setting="--api-key / SPARSESYNC_API_KEY",
                open_setting="SPARSESYNC_ALLOW_NO_KEY",
                what="replica",
            ),
            max_body_bytes=int(args.get("max_body_bytes") or 8 << 20),
            request_timeout_s=_seconds(args.get("request_timeout"), 600.0),
            max_hold_s=_seconds(args.get("max_hold"), 60.0),
            vllm_apply=vllm_apply,
            device=device,
            mirror_dir=args.get("mirror_dir") or None,
        )
        if cfg.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={cfg.max_body_bytes}: must be >= 1024")
        if cfg.tensor_parallel_size < 1 or (cfg.tensor_parallel_size > 1 and engine != "vllm"):
            raise ValueError(
                f"tensor_parallel_size={cfg.tensor_parallel_size}: must be >= 1, and > 1 only with --engine vllm"
            )
    except ValueError as e:
        raise SparsesyncError(f"bad configuration value: {e}", hint="check the flags and SPARSESYNC_* variables") from e
    return cfg, str(args.get("log_level") or "INFO").upper()


def _seconds(value: object, default: float) -> float | None:
    """A time bound from a flag or variable: unset is `default`, 0 is None (no bound)."""
    if value in (None, ""):
        return default
    s = float(value)  # type: ignore[arg-type]
    if not s >= 0:
        raise ValueError(f"{value!r}: seconds must be >= 0 (0: no bound)")
    return s or None


def _device(name: str | None) -> str:
    """The embedded engine's torch device: `name`, or cuda when this machine has one, else cpu."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise SparsesyncError(f"device '{name}': not a torch device ({e})", hint="--device cuda, cuda:N or cpu") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparsesyncError(
            f"device '{name}': this machine has no CUDA device", hint="--device cpu, or run on a GPU machine"
        )
    return name


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, level = parse_config(argv)
    except SparsesyncError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from inference_space.replica import build_replica
    from inference_space.server import create_app

    try:
        replica = build_replica(cfg)
    except SparsesyncError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(replica, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes)
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=level.lower(),
                                timeout_graceful_shutdown=GRACE_S)
        _serve(config, replica)
    finally:
        replica.close()
    return 0


GRACE_S = 10  # SIGTERM: in-flight responses get this long to finish (their batches are cut at once)
STOP_DEADLINE_S = 25  # SIGTERM: the process is gone by then, whatever still runs (a container gets 30 s)


def _serve(config: Any, replica: Replica) -> None:
    """uvicorn's server, whose SIGTERM / SIGINT also cuts the engine's batches (`Engine.stop_serving`)
    and arms a last-resort exit: the process ends within `STOP_DEADLINE_S` of the signal even
    when an engine cannot stop a batch part-way (vLLM's blocking generate)."""
    import threading

    import uvicorn

    def last_resort() -> None:
        logging.getLogger(__name__).error("still running %d s after the stop signal: exiting now", STOP_DEADLINE_S)
        logging.shutdown()
        os._exit(1)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if not replica.engine.stopping:
                replica.engine.stop_serving()
                timer = threading.Timer(STOP_DEADLINE_S, last_resort)
                timer.daemon = True  # never what keeps the process alive
                timer.start()

    Server(config).run()


if __name__ == "__main__":
    sys.exit(main())
