"""`python -m env_space [--host H] [--port P] ...`: serve the environment with uvicorn.

Every flag has an environment variable (see config.py and README.md); flags win. The process
exits 2 with one line on stderr when a setting is invalid.
"""

from __future__ import annotations

import argparse
import sys

from env_space.config import ServerConfig
from env_space.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m env_space", description="Serve the sparsesync RL environment.")
    p.add_argument("--host", help="bind address (ENV_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (ENV_PORT or PORT, default 8000)")
    p.add_argument("--task", dest="default_task", help="default task: wordle|repeat (ENV_TASK)")
    p.add_argument("--max-sessions", type=int, help="live HTTP sessions at most (ENV_MAX_SESSIONS)")
    p.add_argument("--idle-timeout", dest="idle_timeout_s", type=float, help="seconds (ENV_IDLE_TIMEOUT_S)")
    p.add_argument("--max-body-bytes", type=int, help="request size limit (ENV_MAX_BODY_BYTES)")
    p.add_argument("--log-level", help="uvicorn log level (ENV_LOG_LEVEL)")
    p.add_argument("--max-sessions-per-client", type=int, help="live HTTP sessions per client "
                   "(ENV_MAX_SESSIONS_PER_CLIENT, default half of --max-sessions)")
    p.add_argument("--replace-idle", dest="replace_idle_s", type=float, help="seconds: a client at its cap "
                   "replaces its own session idle this long (ENV_REPLACE_IDLE_S, default 30)")
    p.add_argument("--trusted-proxies", help="reverse proxies whose X-Forwarded-For names the client: "
                   "addresses or networks, comma-separated, or * (ENV_TRUSTED_PROXIES, default none)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health (ENV_API_KEY)")
    args = p.parse_args(argv)
    try:
        config = ServerConfig.from_env(**vars(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from env_space.server import build_app

    if config.open_to_network:
        print(f"warning: no API key: anyone who can reach {config.host}:{config.port} may use this server "
              "(set ENV_API_KEY, or bind 127.0.0.1)", file=sys.stderr)
    # proxy_headers=False: uvicorn would believe X-Forwarded-For from loopback; clients.py decides
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=config.log_level,
                ws_max_size=config.max_body_bytes, timeout_graceful_shutdown=5, proxy_headers=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
