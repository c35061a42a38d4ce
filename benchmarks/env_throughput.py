"""Environment-server throughput: steps per second with N concurrent HTTP sessions.

Starts `python -m env_space` on 127.0.0.1 (a real uvicorn server in its own process), then runs
N concurrent sessions from one asyncio client (httpx.AsyncClient): each resets an episode and
steps until it ends, again and again, for `--seconds`. Counts successful /step answers only; any
non-2xx answer fails the run. Client and server share this machine's cores, so the figure is a
floor for a server with a machine of its own.

    .venv/bin/python benchmarks/env_throughput.py --sessions 64 --seconds 10 --task wordle
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

GUESSES = ["crane", "slate", "pious", "mound", "lucky", "wheat"]


async def _session_loop(client: httpx.AsyncClient, task: str, seed: int, stop: float, counts: list[int]) -> None:
    sid: str | None = None
    while time.perf_counter() < stop:
        r = await client.post("/reset", json={"task": task, "seed": seed, "session_id": sid})
        r.raise_for_status()
        sid = r.json()["session_id"]
        seed += 1000
        done, turn = False, 0
        while not done:
            text = GUESSES[turn % len(GUESSES)] if task == "wordle" else "a" * 8
            r = await client.post("/step", json={"action": {"text": text}, "session_id": sid})
            r.raise_for_status()
            done = r.json()["done"]
            counts[0] += 1
            turn += 1


async def _run(url: str, sessions: int, seconds: float, task: str) -> dict[str, float]:
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        warm = [0]
        await asyncio.gather(
            *[_session_loop(client, task, i, time.perf_counter() + 1.0, warm) for i in range(sessions)]
        )
        counts = [0]
        t0 = time.perf_counter()
        await asyncio.gather(*[_session_loop(client, task, i, t0 + seconds, counts) for i in range(sessions)])
        elapsed = time.perf_counter() - t0
    return {"sessions": sessions, "task": task, "seconds": round(elapsed, 2), "steps": counts[0],
            "steps_per_s": round(counts[0] / elapsed, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--task", choices=["wordle", "repeat"], default="wordle")
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    args = p.parse_args()

    proc = None
    url = args.url
    if url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, ENV_PORT=str(port), ENV_HOST="127.0.0.1", ENV_MAX_SESSIONS=str(max(256, args.sessions)),
                   ENV_LOG_LEVEL="warning")
        proc = subprocess.Popen([sys.executable, "-m", "env_space"], env=env, cwd=Path(__file__).resolve().parents[1])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("env server did not start")
            time.sleep(0.2)
    try:
        result = asyncio.run(_run(url, args.sessions, args.seconds, args.task))
        result["cpu_cores"] = os.cpu_count() or 0
        print(json.dumps(result))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
