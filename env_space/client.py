"""`EnvClient`: the plain-HTTP client a trainer uses to play episodes on the environment server.

Needs only httpx (no OpenEnv, no FastAPI). One client is safe to share between threads (httpx's
connection pool is); each episode is identified by the session id that `reset` returns.

    with EnvClient("http://127.0.0.1:8000") as env:
        sid, obs = env.reset(task="repeat", seed=0)
        obs, reward, done = env.step(sid, "aaaa")

Guarantee: a refusal from the server raises `EnvClientError` carrying the HTTP status, the
server's stable error code and its message; a 503 (server full) is retried `retries` times with
a short back-off before it is raised.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

SESSION_HEADER = "X-Session-Id"


class EnvClientError(RuntimeError):
    """The server refused a request (`status`, `code` as in env_space/errors.py) or was unreachable."""

    def __init__(self, message: str, *, status: int = 0, code: str = "", hint: str = "") -> None:
        super().__init__(f"{message} ({hint})" if hint else message)
        self.status = status
        self.code = code
        self.hint = hint


class EnvClient:
    """HTTP client for env_space's session API (`/reset`, `/step`, `/state`, `/sessions`)."""

    def __init__(self, base_url: str, *, timeout: float = 30.0, retries: int = 3,
                 headers: dict[str, str] | None = None, api_key: str | None = None) -> None:
        """`api_key`: the server's ENV_API_KEY, sent as `Authorization: Bearer` (when `headers`
        already carry an Authorization header, e.g. a private Space's HF token, as `X-API-Key`)."""
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        headers = dict(headers or {})
        if api_key:
            has_auth = any(k.lower() == "authorization" for k in headers)
            headers["X-API-Key" if has_auth else "Authorization"] = api_key if has_auth else f"Bearer {api_key}"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def reset(self, task: str | None = None, seed: int | None = None, *,
              session_id: str | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns (session_id, observation). `observation["prompt"]` is the text."""
        body: dict[str, Any] = {"seed": seed}
        if task is not None:
            body["task"] = task
        if session_id is not None:
            body["session_id"] = session_id
        data = self._request("POST", "/reset", json=body)
        return data["session_id"], data["observation"]

    def step(self, session_id: str, text: str) -> tuple[dict[str, Any], float, bool]:
        """Send one action; returns (observation, reward, done)."""
        data = self._request("POST", "/step", json={"action": {"text": text}, "session_id": session_id})
        return data["observation"], float(data["reward"]), bool(data["done"])

    def state(self, session_id: str) -> dict[str, Any]:
        return self._request("GET", "/state", params={"session_id": session_id})

    def close_session(self, session_id: str) -> None:
        self._request("DELETE", f"/sessions/{session_id}")

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EnvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(method, path, **kwargs)
            except httpx.HTTPError as e:
                raise EnvClientError(f"{method} {self.base_url}{path}: {type(e).__name__}: {e}",
                                     hint="is the environment server running at this URL?") from e
            if resp.status_code == 503 and attempt < self.retries:
                time.sleep(min(float(resp.headers.get("Retry-After", "1")), 5.0) * (attempt + 1) * 0.25)
                continue
            break
        if resp.status_code >= 400:
            try:
                err = resp.json()
            except ValueError:
                err = {"detail": resp.text[:200]}
            detail = err.get("detail")
            raise EnvClientError(f"{method} {path}: HTTP {resp.status_code}: {detail}", status=resp.status_code,
                                 code=str(err.get("error", "")), hint=str(err.get("hint", "")))
        return resp.json()
