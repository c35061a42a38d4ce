"""The one place where exceptions become what a CLI user reads.

A SparsesyncError prints as one line `error: <what>` plus `fix: <hint>`, exit status 1.
`SPARSESYNC_DEBUG=1` shows the traceback instead. Anything that looks like a token is
redacted from every message we print.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import NoReturn

from rich.console import Console

_TOKEN_RE = re.compile(r"(hf_[A-Za-z0-9]{8,}|(?i:bearer)\s+[A-Za-z0-9._\-]{8,}|AKIA[0-9A-Z]{12,})")
err_console = Console(stderr=True, highlight=False)


def redact(text: str) -> str:
    """`text` with anything token-like (and the values of secret env vars) masked."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        val = os.environ.get(var)
        if val and len(val) >= 6:
            text = text.replace(val, "***")
    return _TOKEN_RE.sub("***", text)


def debug() -> bool:
    return os.environ.get("SPARSESYNC_DEBUG", "") not in ("", "0", "false")


def fail(message: str, hint: str = "") -> NoReturn:
    err_console.print(f"[bold red]error:[/] {redact(message)}", soft_wrap=True)
    if hint:
        err_console.print(f"[bold]fix:[/] {redact(hint)}", soft_wrap=True)
    raise SystemExit(1)


def run_guarded(fn: Callable[[], object]) -> None:
    """Run the CLI, turning our exceptions into one clear line and a non-zero exit."""
    from sparsesync.errors import SparsesyncError

    try:
        fn()
    except SparsesyncError as e:
        if debug():
            raise
        fail(e.message, e.hint)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise SystemExit(130) from None
    except (OSError, ValueError) as e:
        if debug():
            raise
        fail(f"{type(e).__name__}: {e}", "set SPARSESYNC_DEBUG=1 for the traceback")
