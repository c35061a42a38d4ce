"""The environment-server Space (`env_space/`): its `SpaceSpec`, rendered by `space.py`.

The rendered folder is the Docker build context: `Dockerfile`, `README.md` (the Space card),
`requirements.txt` (OpenEnv and the server's runtime dependencies, pinned to what this install
runs), the `env_space/` package with its word lists, and the `sparsesync/` package (the server
reads only its standard-library parts: the request-body cap of `sparsesync.access`, shared with the
replica; nothing of it is compiled or installed). It boots locally as a plain process too:
`cd <folder> && ENV_...=... python -m env_space`.

Guarantee: the server's configuration travels as Space variables (`ENV_*`, the same names
`python -m env_space` reads); its API key, when given (the CLI generates one for a public
Space), only as the Space secret `ENV_API_KEY`. No HF token is set: the server reads nothing.
A Space is reached only through the Hub's proxy, so `ENV_TRUSTED_PROXIES=*`: the server tells
clients apart by the address that proxy appends to `X-Forwarded-For`, not by the proxy's own.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from sparsesync.deploy.errors import DeployError
from sparsesync.deploy.space import DEFAULT_IGNORE, SpaceSpec

APP_PORT = 8000


def app_dir() -> Path:
    """The env_space package folder of the checkout (`sparsesync.apps`; light import: it loads nothing heavy)."""
    from sparsesync.apps import import_app

    return Path(import_app("env_space").__file__ or "").resolve().parent


def _library_dir() -> Path:
    import sparsesync

    return Path(sparsesync.__file__).resolve().parent


def requirements() -> str:
    """The Space's requirements.txt: OpenEnv pinned to the installed version, plus the server deps."""
    def pin(dist: str, floor: str) -> str:
        try:
            return f"{dist}=={metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            return f"{dist}>={floor}"

    return "\n".join([pin("openenv", "0.10.0"), pin("fastapi", "0.116"), pin("uvicorn", "0.30"),
                      pin("httpx", "0.28.1"), pin("pydantic", "2.7")]) + "\n"


def env_space_spec(space_id: str, *, hardware: str = "cpu-basic", private: bool = True, region: str | None = None,
                   task: str = "wordle", max_sessions: int = 256, idle_timeout_s: float = 300.0,
                   max_body_bytes: int = 65536, api_key: str | None = None) -> SpaceSpec:
    """The Space that serves env_space with these settings."""
    app_dir()  # the checkout's env_space/, or ConfigError
    from env_space import TASKS

    if task not in TASKS:
        raise DeployError(f"unknown task {task!r}", space_id=space_id, hint=f"use one of: {', '.join(TASKS)}")
    if max_sessions < 1 or idle_timeout_s <= 0:
        raise DeployError(f"max_sessions={max_sessions}, idle_timeout_s={idle_timeout_s}: both must be positive",
                          space_id=space_id)
    src = app_dir()
    name = space_id.split("/")[-1]
    return SpaceSpec(
        space_id=space_id,
        sources={"env_space": src, "sparsesync": _library_dir(), "Dockerfile": src / "Dockerfile"},
        readme=src / "README.md",
        card={"title": f"{name} (sparsesync env)", "app_port": APP_PORT},
        extra_files={"requirements.txt": requirements()},
        variables={"ENV_TASK": task, "ENV_MAX_SESSIONS": str(max_sessions),
                   "ENV_IDLE_TIMEOUT_S": f"{idle_timeout_s:g}", "ENV_MAX_BODY_BYTES": str(max_body_bytes),
                   "ENV_TRUSTED_PROXIES": "*"},
        secrets={"ENV_API_KEY": api_key} if api_key else {},
        hardware=hardware,
        private=private,
        region=region,
        # the package copy leaves out what lives at the Space root
        ignore=(*DEFAULT_IGNORE, "Dockerfile", "README.md"),
    )
