"""Child processes of the local run: start, wait until healthy, and always stop them.

Each child runs in its own process group (`start_new_session`), writes stdout+stderr to a log
file, and on Linux is also tied to its parent with `PR_SET_PDEATHSIG` so it gets SIGTERM if
the parent dies without cleaning up (e.g. SIGKILL).

Guarantee: leaving a `ProcessSet` (normally, by exception, or by Ctrl-C / SIGTERM, which
`ProcessSet` turns into KeyboardInterrupt while it is active) sends SIGTERM to every child's
process group, waits up to `grace_s`, then SIGKILLs what is left, so no child outlives the run.
A Ctrl-C or SIGTERM also starts a deadline (`exit_deadline_s`): if this process has not exited
by then (cleanup stuck on a request, a lock, a thread), every child's group is SIGKILLed and the
process exits with status 130 at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from trainer.errors import DemoCheckError

_PR_SET_PDEATHSIG = 1
_LIBC = None
if sys.platform.startswith("linux"):  # loaded here, not in the forked child (no dlopen after fork)
    with contextlib.suppress(OSError):
        _LIBC = ctypes.CDLL(None, use_errno=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec: one system call
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class Child:
    """One started process and where its output goes."""

    name: str
    argv: list[str]
    log_path: Path
    url: str = ""  # base URL when it is an HTTP server
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ProcessSet:
    """Starts children and guarantees they are stopped (see module docstring)."""

    def __init__(self, log_dir: Path, *, env: dict[str, str] | None = None, grace_s: float = 10.0,
                 exit_deadline_s: float = 30.0) -> None:
        self.log_dir = log_dir
        self.env = {**os.environ, **(env or {})}
        self.grace_s = grace_s
        self.exit_deadline_s = exit_deadline_s
        self.children: list[Child] = []
        self._old_handlers: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> ProcessSet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # only possible on the main thread
                self._old_handlers[sig] = signal.signal(sig, self._interrupted)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        for sig, old in self._old_handlers.items():
            if old is not None:  # None: the old handler was not set from Python and cannot be restored
                with contextlib.suppress(ValueError):
                    signal.signal(sig, old)

    def _interrupted(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-C / SIGTERM: start the exit deadline (once), then unwind as KeyboardInterrupt."""
        if self._deadline is None:
            self._deadline = threading.Timer(self.exit_deadline_s, self._force_exit)
            self._deadline.daemon = True
            self._deadline.start()
        raise KeyboardInterrupt(f"signal {signum}")

    def _force_exit(self) -> None:
        """The cleanup after an interrupt overran its deadline: kill every child, exit now."""
        sys.stderr.write(f"still stopping {self.exit_deadline_s:.0f} s after the interrupt: killing every child and "
                         "exiting; where each thread was:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for c in self.children:
            if c.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        os._exit(130)

    def start(self, name: str, argv: list[str], *, url: str = "", env: dict[str, str] | None = None) -> Child:
        """Start `argv` (a new process group, output to `<log_dir>/<name>.log`)."""
        child = Child(name, argv, self.log_dir / f"{name}.log", url=url)
        log = child.log_path.open("wb")
        try:
            child.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})}, start_new_session=True,
                preexec_fn=_die_with_parent if _LIBC is not None else None,
            )
        finally:
            log.close()
        self.children.append(child)
        return child

    def wait_healthy(self, children: list[Child], timeout_s: float, path: str = "/health") -> None:
        """Block until every child answers GET `path` with 200; DemoCheckError if one dies or times out."""
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                for c in list(pending):
                    if not c.alive():
                        raise DemoCheckError(
                            f"{c.name} exited with status {c.proc.returncode if c.proc else '?'} while starting; "
                            f"last lines of {c.log_path}:\n{c.log_tail()}", check="startup")
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(c.url + path).status_code == 200:
                            pending.remove(c)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise DemoCheckError(f"{names} did not become healthy within {timeout_s:.0f} s "
                                         f"(logs in {self.log_dir})", check="startup")
                if pending:
                    time.sleep(0.2)

    def check_alive(self) -> None:
        """DemoCheckError naming the first child that exited."""
        for c in self.children:
            if not c.alive():
                raise DemoCheckError(f"{c.name} exited unexpectedly (status {c.proc.returncode if c.proc else '?'}); "
                                     f"last lines of {c.log_path}:\n{c.log_tail()}", check="processes")

    def stop(self, child: Child) -> None:
        """SIGTERM the child's process group, SIGKILL it after `grace_s`."""
        if child.proc is None or child.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGTERM)
        try:
            child.proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait(timeout=5)

    def stop_all(self) -> None:
        # signal every group first, then wait: children shut down in parallel
        for c in self.children:
            if c.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        for c in self.children:
            self.stop(c)

