"""A sidecar that makes a running vLLM OpenAI server follow a run over vLLM's HTTP routes.

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "sparsesync"}'
    sparsesync follow --vllm http://127.0.0.1:8000 --bucket hf://buckets/NS/NAME/RUN --model MODEL

Both flags of the server are needed: without `--weight-transfer-config` vLLM answers the first
update with HTTP 500 "Weight transfer not configured", which `follow` reports with that fix.

For servers that cannot load the endpoint plugin (`server.py`; e.g. `VLLM_PLUGINS` is managed
elsewhere). vLLM mounts the routes this drives (`/pause`, `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/reset_prefix_cache`,
`/resume`, `/weight_info`) only with `VLLM_SERVER_DEV_MODE=1`, and they carry no
authentication: keep that port private. The sidecar must run on the server's machine (or pod):
updates are handed over as files under /dev/shm, which the server's workers read.
Guarantees: those of `follow.ServerHook`; every HTTP failure (refused connection, timeout,
non-2xx answer) is an `EngineError` naming the route and the server, never a hang.
"""

from __future__ import annotations

from typing import Any

from sparsesync.errors import EngineError
from sparsesync.integrations.vllm.follow import FollowRunner, remote_engine

DEV_MODE_HINT = "start the vLLM server with VLLM_SERVER_DEV_MODE=1 (it mounts the weight-transfer routes)"
BACKEND_HINT = """start the vLLM server with --weight-transfer-config '{"backend": "sparsesync"}'"""


def failure_hint(body: str) -> str:
    """The fix for a vLLM server's error answer: its weight-transfer backend missing, or its log."""
    text = body.lower()
    if "weight transfer not configured" in text or "weight_transfer_config" in text:
        return BACKEND_HINT
    return "see the vLLM server log"


class HttpEngineControl:
    """`follow.EngineControl` over a vLLM server's HTTP routes."""

    device_type = None  # not known over HTTP: updates go as complete reload groups (every device)

    def __init__(self, url: str, *, timeout_s: float = 900.0) -> None:
        try:
            import httpx
        except ImportError as e:
            raise EngineError("the vLLM sidecar needs httpx", hint="pip install httpx") from e
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)
        self._errors = (httpx.HTTPError,)
        self.llm_engine = remote_engine()

    def _call(self, method: str, route: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, route, **kw)
        except self._errors as e:
            raise EngineError(f"vLLM server {self.url}: {method} {route} failed: {type(e).__name__}: {e}",
                              hint="is the server up and reachable from here?") from e
        if r.status_code == 404:
            raise EngineError(f"vLLM server {self.url} has no route {route}", hint=DEV_MODE_HINT)
        if r.status_code >= 400:
            raise EngineError(f"vLLM server {self.url}: {method} {route} answered {r.status_code}: {r.text[:500]}",
                              hint=failure_hint(r.text))
        return r.json() if r.content else None

    def check(self) -> None:
        """Fail early, with the fix, when the server lacks the weight-transfer routes."""
        self._call("GET", "/weight_info")

    def collective_rpc(self, fn: Any) -> list[Any]:
        raise EngineError("callables cannot be sent over HTTP")  # WeightSync then uses the default fused-module table

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", json={"init_info": request["init_info"]})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update")

    def update_weights(self, request: dict[str, Any]) -> None:
        self._call("POST", "/update_weights", json={"update_info": request["update_info"]})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("POST", "/finish_weight_update", json={"weight_version": weight_version})

    def reset_prefix_cache(self) -> bool:
        return bool((self._call("POST", "/reset_prefix_cache") or {}).get("success"))

    def pause(self, mode: str) -> None:
        self._call("POST", "/pause", params={"mode": mode, "clear_cache": "false"})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def weight_version(self) -> str | None:
        return (self._call("GET", "/weight_info") or {}).get("weight_version")

    def close(self) -> None:
        self._http.close()


def sidecar_runner(url: str, bucket: str, model: str, *, poll_interval: float = 1.0, pause_mode: str = "wait",
                   revision: str | None = None) -> FollowRunner:
    """A `FollowRunner` driving the server at `url` (checked before anything else)."""
    probe = HttpEngineControl(url, timeout_s=10.0)
    try:
        probe.check()
    finally:
        probe.close()

    def control() -> HttpEngineControl:
        return HttpEngineControl(url)

    return FollowRunner(control, bucket, model, revision=revision, poll_interval=poll_interval, pause_mode=pause_mode)
