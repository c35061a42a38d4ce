"""The apps a trainer test runs beside it, as real processes: the RL environment server (the
`repeat` task) and one embedded replica following a bucket, both on 127.0.0.1 and healthy before
this returns."""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.processes import Child, ProcessSet, free_port


def start_env_and_replica(procs: ProcessSet, model: Path, bucket: str) -> tuple[Child, Child]:
    """Start the env server and an embedded replica of `model` following `bucket` (poll 0.2 s)
    in `procs`; return (env, replica) once both answer /health (120 s at most)."""
    py = sys.executable
    port = free_port()
    env = procs.start("env", [py, "-m", "env_space", "--host", "127.0.0.1", "--port", str(port), "--task", "repeat"],
                      url=f"http://127.0.0.1:{port}")
    port = free_port()
    replica = procs.start("replica", [py, "-m", "inference_space", "--model", str(model), "--bucket", bucket,
                                      "--engine", "embedded", "--host", "127.0.0.1", "--port", str(port),
                                      "--poll-interval", "0.2", "--log-level", "WARNING"],
                          url=f"http://127.0.0.1:{port}")
    procs.wait_healthy([env, replica], 120)
    return env, replica
