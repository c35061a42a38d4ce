"""The one place where exceptions become what a CLI user reads.

Every failure prints as one line `error: <what>` plus `fix: <hint>`, exit status 1: our
SparsesyncErrors with their hint (the library's, `sparsesync/errors.py`, and the apps' the CLI
runs, `trainer/errors.py` and `sparsesync/deploy/errors.py`, all subclasses), OS errors (read-only folder, full disk)
with the fix their errno calls for, and anything unexpected (a bug) named by its type. `SPARSESYNC_DEBUG=1` shows
the traceback instead. Secrets are redacted from every message we print: tokens, the values of
secret environment variables, URL userinfo and key-bearing query parameters.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from sparsesync.store.retry import redact as _redact_patterns

err_console = Console(stderr=True, highlight=False)
_SECRET_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def redact(text: str) -> str:
    """`text` with anything token-like (and the values of secret env vars) masked."""
    return _redact_patterns(text, tuple(os.environ.get(v) for v in _SECRET_VARS if len(os.environ.get(v) or "") >= 6))


def debug() -> bool:
    return os.environ.get("SPARSESYNC_DEBUG", "") not in ("", "0", "false")


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def fail(message: str, hint: str = "") -> NoReturn:
    err_console.print(f"[bold red]error:[/] {escape(redact(_one_line(message)))}", soft_wrap=True)
    if hint:
        err_console.print(f"[bold]fix:[/] {escape(redact(_one_line(hint)))}", soft_wrap=True)
    raise SystemExit(1)


def _os_hint(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "free disk space (or raise the file size limit) and run the command again"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "the path must be writable by this user; choose another one"
    return "check the paths given; set SPARSESYNC_DEBUG=1 for the traceback"


def run_guarded(fn: Callable[[], object]) -> None:
    """Run the CLI, turning every exception into one clear line and a non-zero exit."""
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
    except OSError as e:
        if debug():
            raise
        fail(f"{type(e).__name__}: {e}", _os_hint(e))
    except Exception as e:  # a bug or an unexpected library error: still one line
        if debug():
            raise
        fail(f"unexpected {type(e).__name__}: {e}", "set SPARSESYNC_DEBUG=1 for the traceback, and report it")
