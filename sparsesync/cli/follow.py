"""`sparsesync follow --vllm URL --bucket RUN`: keep a running vLLM OpenAI server at the newest version.

The sidecar way (`sparsesync.integrations.vllm.sidecar`): it drives vLLM's HTTP weight-transfer
routes, mounted only with `VLLM_SERVER_DEV_MODE=1`, and must run on the server's machine
(updates are handed over under /dev/shm). Servers that can load sparsesync's endpoint plugin
follow by themselves instead (`VLLM_PLUGINS=sparsesync SPARSESYNC_BUCKET=RUN vllm serve ...`).
Prints one line per version served; runs until interrupted (or `--until-version`).
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from sparsesync.cli._console import CliConsole

console = CliConsole()


def follow(
    vllm: Annotated[
        str,
        typer.Option(
            "--vllm", help="The vLLM server's URL, e.g. http://127.0.0.1:8000 (started with VLLM_SERVER_DEV_MODE=1)."
        ),
    ],
    bucket: Annotated[
        str,
        typer.Option(
            help="Run URL to follow: a folder, file://..., s3://bucket/prefix or hf://buckets/ns/name/prefix."
        ),
    ],
    model: Annotated[
        str,
        typer.Option(help="The model the server was started with (folder or Hub id): the follower's starting weights."),
    ],
    poll_interval: Annotated[float, typer.Option(help="Seconds between looks at the run.")] = 1.0,
    pause: Annotated[
        str, typer.Option(help="wait: in-flight requests finish first (one version per completion); keep: freeze them.")
    ] = "wait",
    until_version: Annotated[
        int | None, typer.Option(help="Exit once the server serves this version (default: follow forever).")
    ] = None,
) -> None:
    """Make the vLLM server at --vllm follow the run at --bucket (fetch, verify, decode here; apply there)."""
    from sparsesync.errors import ConfigError
    from sparsesync.integrations.vllm.follow import PAUSE_MODES
    from sparsesync.integrations.vllm.sidecar import sidecar_runner

    if pause not in PAUSE_MODES:
        raise ConfigError(f"--pause {pause!r}: expected one of {', '.join(PAUSE_MODES)}")
    runner = sidecar_runner(vllm, bucket, model, poll_interval=poll_interval, pause_mode=pause)
    runner.setup()
    assert runner.follower is not None
    runner.follower.start()
    console.print(f"following {bucket} into the vLLM server at {vllm}")
    shown = None
    try:
        while True:
            st = runner.status()
            if st["serving_version"] != shown or st["state"] == "degraded":
                shown = st["serving_version"]
                err = f"  ({st['last_error']})" if st.get("last_error") else ""
                console.print(f"serving version {shown}  state {st['state']}{err}")
            if until_version is not None and (shown or 0) >= until_version:
                break
            time.sleep(min(poll_interval, 1.0))
    except KeyboardInterrupt:
        pass
    finally:
        runner.stop()
