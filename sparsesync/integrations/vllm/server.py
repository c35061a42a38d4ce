"""vLLM's own OpenAI server follows a run from inside its API-server process (an endpoint plugin).

    VLLM_PLUGINS=sparsesync SPARSESYNC_BUCKET=hf://buckets/NS/NAME/RUN \\
      vllm serve MODEL --weight-transfer-config '{"backend": "sparsesync"}'

vLLM 0.32 loads `vllm.endpoint_plugins` entry points in the API-server process only, and only
those named in `VLLM_PLUGINS` (a security posture: they add routes). `SparsesyncEndpoint` is
ours: it adds `GET /sync` (the follower's status, as the replica app reports it) and, when
`SPARSESYNC_BUCKET` names a run (plus `SPARSESYNC_RUN`, appended), starts a `FollowRunner` on
background threads that drives the server's own engine client: `pause_generation`,
`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update(weight_version)`, `reset_prefix_cache`, `resume_generation`, the very
calls vLLM's dev-mode HTTP routes make (no `VLLM_SERVER_DEV_MODE` needed). The run cannot be
named inside `--weight-transfer-config`: vLLM's `WeightTransferConfig` forbids keys other than
`backend`. The general plugin (`plugin.register`) registers the backend in the engine's
processes. Guarantees: those of `follow.ServerHook`; `/weight_info` reports the version served
(`weight_version`, a string); a server configured to follow but missing the weight-transfer
backend refuses to start (`ConfigError`); a server stopped (Ctrl-C, SIGTERM) stops following
before its engine stops, so no apply is in flight when the engine goes (`stop_first`).

Access: `/sync` takes the keys vLLM's `--api-key` (or `VLLM_API_KEY`) sets, as vLLM's own `/v1`
routes do (`Authorization: Bearer KEY`; 401 `{"error": "Unauthorized"}` otherwise, vLLM's
answer). A server asked to follow a run on an address other than loopback (vLLM binds every
interface by default) with no key refuses to start (`sparsesync.access.check_access`, naming the
fix) unless `SPARSESYNC_ALLOW_NO_KEY=1` says to serve it open, which it then logs as a warning.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from argparse import Namespace
from collections.abc import Coroutine
from typing import Any

from fastapi import Request  # at module level: the route's annotations are resolved from these globals

from sparsesync.access import bearer_matches, check_access, check_key, is_set
from sparsesync.errors import ConfigError
from sparsesync.integrations.vllm.follow import (
    FollowRunner,
    bucket_from_env,
    pause_mode_from_env,
    poll_interval_from_env,
    remote_engine,
)

log = logging.getLogger(__name__)

NAME = "sparsesync"
CALL_TIMEOUT_S = 900.0  # one engine call at most (a pause waits for in-flight requests)


class AsyncEngineControl:
    """`follow.EngineControl` over vLLM's async engine client, called from a thread other than
    the server's event loop (each call is scheduled on that loop and waited for)."""

    def __init__(self, engine_client: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = CALL_TIMEOUT_S) -> None:
        from vllm.platforms import current_platform

        self.client = engine_client
        self.loop = loop
        self.timeout_s = timeout_s
        self.device_type = str(current_platform.device_type)
        self.llm_engine = remote_engine()

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the vLLM server's event loop is closed (shutting down)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def collective_rpc(self, fn: Any) -> list[Any]:
        """WeightSync's one RPC asks the worker for the model's fused-module table; callables do
        not cross to the engine process, so it is read from the model class in this process."""
        from vllm.model_executor.models.registry import ModelRegistry

        mc = self.client.model_config
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, model_config=mc)
        return [{k: list(v) for k, v in dict(getattr(cls, "packed_modules_mapping", {}) or {}).items()}]

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=request["init_info"])))

    def start_weight_update(self) -> None:
        self._run(self.client.start_weight_update())

    def update_weights(self, request: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.client.update_weights(WeightTransferUpdateRequest(update_info=request["update_info"])))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.client.finish_weight_update(weight_version))

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.client.reset_prefix_cache()))

    def pause(self, mode: str) -> None:
        self._run(self.client.pause_generation(mode=mode, clear_cache=False))

    def resume(self) -> None:
        self._run(self.client.resume_generation())

    def weight_version(self) -> str | None:
        return self._run(self.client.get_weight_version())


def api_keys(args: Namespace | None) -> list[str]:
    """The keys vLLM's server requires on /v1 (its own rule: `--api-key`, else VLLM_API_KEY)."""
    given = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    return [k for k in ([given] if isinstance(given, str) else given) if k]


class SparsesyncEndpoint:
    """The `vllm.endpoint_plugins` entry point `sparsesync` (see module docstring)."""

    name = NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.runner: FollowRunner | None = None

    def attach_router(self, app: Any) -> None:
        from fastapi.responses import JSONResponse

        async def sync_status(request: Request) -> JSONResponse:
            keys = api_keys(getattr(request.app.state, "args", None))
            if keys and not bearer_matches(request.headers, keys):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)  # as vLLM's AuthenticationMiddleware
            if self.runner is None:
                st = {
                    "url": None,
                    "state": "static",
                    "current_version": None,
                    "serving_version": None,
                    "engine": "vllm",
                }
            else:
                st = self.runner.status()
            client = getattr(request.app.state, "engine_client", None)
            st["vllm_weight_version"] = await client.get_weight_version() if client is not None else None
            return JSONResponse(st)

        app.add_api_route("/sync", sync_status, methods=["GET"], summary="sparsesync: the run this server follows")

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        bucket = bucket_from_env()
        if engine_client is None or bucket is None:
            if engine_client is not None:
                log.info("sparsesync: SPARSESYNC_BUCKET is not set; serving the startup weights only")
            return
        keys = api_keys(args)
        try:
            check_access(
                keys[0] if keys else None,
                getattr(args, "host", None),
                allow_open=is_set(os.environ.get("SPARSESYNC_ALLOW_NO_KEY")),
                setting="--api-key / VLLM_API_KEY",
                open_setting="SPARSESYNC_ALLOW_NO_KEY",
                bind_setting="--host 127.0.0.1",
                what="vLLM server following a run",
            )
            for k in keys[1:]:
                check_key(k, "--api-key / VLLM_API_KEY")
        except ConfigError as e:
            log.error("error: %s", e)  # one line to read, whatever vLLM prints of the traceback after it
            raise
        wt = getattr(engine_client.vllm_config, "weight_transfer_config", None)
        if wt is None or wt.backend != NAME:
            raise ConfigError(
                f"SPARSESYNC_BUCKET={bucket} asks this vLLM server to follow a run, but its weight-transfer backend is "
                f"{getattr(wt, 'backend', None)!r}",
                hint="""start it with --weight-transfer-config '{"backend": "sparsesync"}'""",
            )
        if int(getattr(args, "api_server_count", 1) or 1) > 1:
            raise ConfigError(
                "a vLLM server following a run needs one API server process (each would drive the engine)",
                hint="drop --api-server-count, or follow with the sidecar: sparsesync follow --vllm URL",
            )
        loop = asyncio.get_running_loop()
        model_config = engine_client.model_config
        self.runner = FollowRunner(
            lambda: AsyncEngineControl(engine_client, loop),
            bucket,
            str(model_config.model),
            revision=getattr(model_config, "revision", None),
            poll_interval=poll_interval_from_env(),
            pause_mode=pause_mode_from_env(),
        )
        state.sparsesync = self.runner
        self.runner.start()
        stop_first(engine_client, self.runner)
        atexit.register(self.runner.stop)  # the last heartbeat says "stopped"


class _EngineGoneOnShutdown(logging.Filter):
    """Drops vLLM's "AsyncLLM output_handler failed." `EngineDeadError` record once the server
    is shutting down: vLLM stops the engine before it cancels the task that reads the engine's
    outputs, so that task may see the engine gone and log a traceback of a normal stop."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping or record.getMessage() != "AsyncLLM output_handler failed.":
            return True
        exc = record.exc_info[1] if record.exc_info else None
        return type(exc).__name__ != "EngineDeadError"


def stop_first(engine_client: Any, runner: FollowRunner) -> None:
    """Make the server's shutdown stop following before it stops the engine, and stop quietly:
    an apply in flight when the engine goes would fail, and vLLM's output task logs an
    `EngineDeadError` traceback when it sees the engine gone during its own shutdown (Ctrl-C
    while versions arrive). Wraps this one engine client's `shutdown` and filters that one
    record of vLLM's async engine logger from the shutdown on; vLLM itself is unchanged."""
    shutdown = engine_client.shutdown
    quiet = _EngineGoneOnShutdown()
    logging.getLogger("vllm.v1.engine.async_llm").addFilter(quiet)

    def stop_following_then_shut_down(*args: Any, **kwargs: Any) -> Any:
        quiet.stopping = True
        runner.stop()  # waits for an apply in flight (the event loop still runs: vLLM calls this in an executor)
        return shutdown(*args, **kwargs)

    engine_client.shutdown = stop_following_then_shut_down
