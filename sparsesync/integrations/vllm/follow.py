"""Make a running vLLM OpenAI server follow a run: the apply hook both ways of driving it share.

vLLM's own server (`vllm serve` / `python -m vllm.entrypoints.openai.api_server`) is driven
either from inside its API-server process (`server.py`: the `vllm.endpoint_plugins` entry
point, calling the engine client) or from a sidecar process (`sidecar.py`: vLLM's HTTP
weight-transfer routes). Both hand this module an `EngineControl`; `ServerHook` turns it into
the follower's `ApplyHook`. Guarantees, on top of `apply.WeightSync`'s (weights only through
vLLM's weight-transfer API with `finish` in a `finally`, the worker's read-back of what the
forward pass reads, the prefix cache reset on every switch, vLLM's `weight_version` set only
when the update and its read-back passed):

- An update is checked against the served checkpoint's layout (names, shapes, dtypes) before
  vLLM sees any of it (`WeightUpdateError`).
- vLLM is paused only for the apply, with `mode="wait"` by default: in-flight requests finish on
  the old weights and queued ones start on the new, so every completion comes from one weight
  version (`SPARSESYNC_VLLM_PAUSE=keep` freezes them instead: no wait, but a completion may
  then span two versions). `resume` runs in a `finally`.
- The server's engine is always another process than the driver, so every update is handed
  over as a safetensors file under /dev/shm that every worker reads (tensor parallel included);
  the driver and the server must share that folder (same machine or pod).
- A failed apply leaves `weight_version` None and `check_error` set (the follower then reloads
  the whole model, and reports "degraded" if that fails too).

`FollowRunner` puts it together: the served checkpoint read once (the follower's starting
layout), a `ServerHook`, and a `Follower` with fleet heartbeats, set up and run on background
threads so the server answers from its first second.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from sparsesync.checkpoint import TIED_ALIASES
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import ConfigError, EngineCheckError, EngineError, WeightUpdateError, dtype_hint, some_of
from sparsesync.protocol.follower.follower import Follower
from sparsesync.protocol.follower.hooks import ApplyHook

log = logging.getLogger(__name__)

PAUSE_MODES = ("wait", "keep")
CHECK_FAILED = "computes with weights that differ"  # EngineCheckError's message (backend.py)


class EngineControl(Protocol):
    """What `WeightSync` calls on an `LLM`, plus the server's pause and version, as blocking calls."""

    llm_engine: Any  # `.vllm_config.parallel_config` (WeightSync reads it; see `remote_engine`)

    def collective_rpc(self, fn: Any) -> list[Any]: ...
    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, request: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def pause(self, mode: str) -> None: ...
    def resume(self) -> None: ...
    def weight_version(self) -> str | None: ...


class _Parallel:
    """A parallel config that no single-process engine has: WeightSync then stages files."""

    distributed_executor_backend = "mp"
    world_size = 0


class _Config:
    parallel_config = _Parallel()


class _Engine:
    vllm_config = _Config()


def remote_engine() -> Any:
    """The `llm_engine` an `EngineControl` exposes: the server's engine is another process."""
    return _Engine()


def bucket_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The run to follow: `SPARSESYNC_BUCKET`, plus `/SPARSESYNC_RUN` when set (None: neither)."""
    env = os.environ if environ is None else environ
    bucket = (env.get("SPARSESYNC_BUCKET") or "").strip()
    if not bucket:
        return None
    run = (env.get("SPARSESYNC_RUN") or "").strip("/ ")
    return bucket.rstrip("/") + "/" + run if run else bucket


def poll_interval_from_env(environ: Mapping[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = (env.get("SPARSESYNC_POLL_INTERVAL") or "1").strip()
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"SPARSESYNC_POLL_INTERVAL={raw!r}: expected a positive number of seconds")
    return value


def pause_mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    mode = (env.get("SPARSESYNC_VLLM_PAUSE") or "wait").strip()
    if mode not in PAUSE_MODES:
        raise ConfigError(f"SPARSESYNC_VLLM_PAUSE={mode!r}: expected one of {', '.join(PAUSE_MODES)}",
                          hint="wait: one weight version per completion (default); keep: no wait")
    return mode


def engine_failure(what: str, e: Exception) -> EngineError:
    """A failure reported by the server (any exception type) as a domain error naming the step."""
    if isinstance(e, EngineError):
        return e
    msg = f"vLLM server: {what} failed: {e}"
    if CHECK_FAILED in str(e):
        return EngineCheckError(msg, hint="the update did not reach the forward pass; the follower reloads the version")
    return EngineError(msg, hint="see the vLLM server log")


class ServerHook(ApplyHook):
    """The follower's `ApplyHook` for a vLLM server reached through `control` (see module docstring)."""

    name = "vllm"
    # an update reads the touched tensors of the mirror once (sparsesync.protocol.follower.hooks)
    pages_out_mirror = True
    takes_digests = True  # the version's per-tensor digests: the worker checks the tensors not sent against them

    def __init__(self, control: EngineControl, state: dict[str, torch.Tensor], *, run_url: str = "",
                 pause_mode: str = "wait", check: bool = True) -> None:
        from sparsesync.integrations.vllm.apply import WeightSync

        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode {pause_mode!r}: expected one of {', '.join(PAUSE_MODES)}")
        self.control = control
        self.pause_mode = pause_mode
        self.state = state  # the served checkpoint's layout (names, shapes, dtypes); its data is never written
        # in-place sparse patches on a GPU server; elsewhere (CPU, or a device not known) complete
        # reload groups, which every device supports
        mode = "sparse" if getattr(control, "device_type", None) == "cuda" else "reload"
        self.sync = WeightSync(control, state, mode=mode, check=check, run_url=run_url)
        self.sync.in_memory = False  # the engine core is another process: always hand over a file
        self.weight_version: int | None = None
        self.check_error: str | None = None
        self.pauses: list[float] = []  # milliseconds the server was paused, per apply
        self._lock = threading.Lock()

    # -- ApplyHook ----------------------------------------------------------------------
    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor], *, state_digest: str | None = None,
                  digests: Mapping[str, str] | None = None) -> None:
        tensors = self._drop_aliases(tensors)
        missing = sorted(set(self.state) - set(tensors))
        self._check_layout(tensors, [f"tensor '{n}': missing" for n in missing])
        self._apply(version, lambda: self.sync.load(version, tensors, digests))

    def apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor], *,
                     base_version: int | None = None, state_digest: str | None = None,
                     digests: Mapping[str, str] | None = None) -> None:
        full = self._drop_aliases(full)
        updates = {k: v for k, v in updates.items() if k in full}
        self._check_layout(full, [])
        self._apply(version, lambda: self.sync.patch(version, updates, digests, full=full))

    # -- internals ----------------------------------------------------------------------
    def _drop_aliases(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A tied LM head arriving under its alias is the embedding: drop it when it equals it."""
        out = dict(tensors)
        for alias, canonical in TIED_ALIASES.items():
            if alias in out and alias not in self.state and canonical in self.state:
                if canonical in out and not torch.equal(out[alias], out[canonical]):
                    raise WeightUpdateError(f"tensor '{alias}': differs from '{canonical}', but the model ties them",
                                            hint="publish the model the server serves")
                out.pop(alias)
        return out

    def _check_layout(self, tensors: Mapping[str, torch.Tensor], problems: list[str]) -> None:
        for name, t in tensors.items():
            ref = self.state.get(name)
            if ref is None:
                problems.append(f"tensor '{name}': not a weight of the model the vLLM server serves")
            elif tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
                problems.append(f"tensor '{name}': {t.dtype} {list(t.shape)}, expected {ref.dtype} {list(ref.shape)}")
        if problems:
            raise WeightUpdateError("update rejected: " + some_of(problems),
                                    hint=dtype_hint(tensors, {k: v.dtype for k, v in self.state.items()}, "vLLM server")
                                    or "the run was published from another model; start the server with that model")

    def _apply(self, version: int, write: Callable[[], object]) -> None:
        with self._lock:
            t0 = time.perf_counter()
            self.control.pause(self.pause_mode)
            try:
                write()
            except Exception as e:  # the server reports any kind
                err = engine_failure(f"update to version {version}", e)
                self.weight_version, self.check_error = None, str(err)
                raise err from e
            finally:
                self.control.resume()
                self.pauses.append((time.perf_counter() - t0) * 1e3)
            self.weight_version, self.check_error = version, None
            log.info("vLLM server serves version %d (paused %.0f ms)", version, self.pauses[-1])



def resolve_model(model: str, revision: str | None = None) -> Path:
    """The checkpoint folder the server loaded: `model` itself, or the Hub snapshot of that id
    (weights and JSON files only; vLLM downloaded them already, so this reads the cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise ConfigError(f"model {model!r} is neither a folder nor a Hub model id", hint="serve a folder or NS/NAME")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"]))


class FollowRunner:
    """A follower that keeps one vLLM server at the newest version of a run, with heartbeats.

    `control` builds the `EngineControl` (called on the runner's thread: it may block on the
    server). Setup (reading the checkpoint, `init_weight_transfer_engine`) and following run on
    background threads, so the server keeps serving from its start; a setup failure is logged
    and reported by `status()` as state "failed" (the server keeps its startup weights)."""

    def __init__(self, control: Callable[[], EngineControl], bucket: str, model: str, *, revision: str | None = None,
                 poll_interval: float = 1.0, pause_mode: str = "wait", check: bool = True) -> None:
        if poll_interval <= 0:
            raise ConfigError(f"poll interval {poll_interval}: must be positive")
        self._control = control
        self.bucket = bucket
        self.model = model
        self.revision = revision
        self.poll_interval = poll_interval
        self.pause_mode = pause_mode
        self.check = check
        self.hook: ServerHook | None = None
        self.follower: Follower | None = None
        self.setup_error: str | None = None
        self.started_at = time.time()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False

    def setup(self) -> None:
        """Read the served checkpoint, open the weight-transfer engine, attach the follower."""
        from sparsesync.checkpoint import load_checkpoint
        from sparsesync.protocol.follower.fleet_member import FleetOptions

        try:
            state = load_checkpoint(resolve_model(self.model, self.revision))
            self.hook = ServerHook(
                self._control(), state, run_url=self.bucket, pause_mode=self.pause_mode, check=self.check
            )
            self.follower = Follower(self.bucket, hook=self.hook, poll_interval=self.poll_interval,
                                     fleet=FleetOptions(engine=self.hook.name))
        except Exception as e:  # report it; the server keeps serving its startup weights
            self.setup_error = str(engine_failure("sparsesync follower setup", e))
            raise
        finally:
            self._ready.set()

    def start(self) -> None:
        """Set up and follow on background threads (returns at once)."""
        def run() -> None:
            try:
                self.setup()
            except Exception:  # recorded in setup_error
                log.exception("sparsesync: the vLLM server will not follow %s", self.bucket)
                return
            assert self.follower is not None
            with self._stop_lock:
                if self._stopped:  # the server is shutting down already
                    return
                self.follower.start()
            log.info("sparsesync: the vLLM server follows %s", self.bucket)

        self._thread = threading.Thread(target=run, name="sparsesync-vllm-setup", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def stop(self) -> None:
        """Stop following (idempotent): returns once no engine call of the follower is in flight."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self.follower is not None:
            self.follower.stop()

    def status(self) -> dict[str, Any]:
        """The follower's status, as the replica app's `/sync` reports it."""
        if self.follower is None:
            st: dict[str, Any] = {
                "url": self.bucket,
                "current_version": None,
                "state": "failed" if self.setup_error else "starting",
                "last_error": self.setup_error,
            }
        else:
            st = self.follower.status().to_dict()
        hook = self.hook
        if hook is not None and hook.check_error is not None:
            st.update(state="degraded", last_error=hook.check_error)
        pauses = hook.pauses if hook is not None else []
        st.update(
            serving_version=hook.weight_version if hook is not None else None,
            engine="vllm",
            pause_count=len(pauses),
            pause_last_ms=pauses[-1] if pauses else None,
            pause_max_ms=max(pauses) if pauses else None,
            uptime_s=time.time() - self.started_at,
        )
        return st
