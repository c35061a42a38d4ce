"""The small interface every inference engine behind a replica implements.

An engine generates completions (token ids, per-token logprobs of the sampled tokens, finish
reason) and is the follower's `ApplyHook`. Guarantee (the in-flight policy): generation and
weight updates never overlap. The engine holds one gate; a weight update waits for the batch
that is running to finish, blocks new batches while it writes (that is the replica's pause),
then lets them run on the new weights. So a completion is produced by exactly one weight
version, and the `weight_version` it reports is the version that produced every one of its
tokens; its `state_digest` (the commit's state digest of that version, as the follower handed it
over with the weights) is read under the same gate, so the pair names one commit even when a
rewind committed the version number again with other weights. Updates are preferred over new batches (a steady stream
of requests cannot starve them).

Every update is validated against the engine's checkpoint layout (names, shapes, dtypes,
index ranges, value counts, finite values) before any engine code sees it
(`WeightUpdateError`). The layout is the checkpoint's own key set (what `save_pretrained`
writes); a tied model's LM head may also arrive under its alias (`lm_head.weight`), and is
then accepted only when it equals the embedding it ties to.

The engine-side proof: after writing, inside the pause, each engine reads the weights its
forward pass computes with back in checkpoint coordinates and compares them with the version
(`_apply_sparse`/`_load_full` raise `EngineCheckError` on a mismatch). An engine whose write
failed or whose read-back differs reports `weight_version` None and `check_error` until a
later load succeeds: it never labels output with a version it does not hold.

Bounded hold: a batch that runs while a committed version waits longer than `max_hold_s`, or
that runs past `request_timeout_s`, is cut at its next decoding step: its unfinished completions
end with finish reason "abort" and `stop_reason` "weight_update" or "request_timeout" (engines
that cannot stop a batch part-way, i.e. vLLM's blocking `LLM.generate`, ignore both). After
`stop_serving()` (the server got SIGTERM) the running batch is cut the same way (`stop_reason`
"shutdown") and batches not yet started are refused, so no request keeps the process alive.

What the read-back covers: a full load checks every tensor. A sparse update is refused
(`EngineCheckError`, so the caller reloads fully) when the engine cannot vouch for the rest:
after any failed write or check every tensor is stale until a full load passed, and a caller
that names the update's `base_version` (the follower does) is refused when the engine holds another version. Beyond
the tensors an update touches, something in the process may have changed any other one (an
in-place `zero_()`, a replaced Parameter): so the caller may hand over the version's per-tensor
digests (`digests=`, every checkpoint tensor; the follower does), and each engine checks the
whole state it serves against them before the version is reported (the embedded engine hashes
every live tensor; vLLM: see `integrations.vllm.backend`). Engines without them check what they
last verified.

An engine that holds verified state on its device (`holds_device_state`: the embedded engine on a
GPU) takes versions through `write_in_place`: the follower writes into its live tensors inside the
pause, then the whole-state check runs as above before the version is served.

Logprobs are those of the model's raw distribution (log-softmax of the unprocessed logits,
vLLM's default "raw_logprobs"), one per sampled token; with `SamplingParams.logprobs` k (up to
20) also the k most likely tokens' (OpenAI's top logprobs).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from inference_space.engines.sampling import Completion, SamplingParams
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import ConfigError, EngineCheckError, EngineError, WeightUpdateError, dtype_hint, some_of
from sparsesync.protocol.follower.hooks import ApplyHook, InPlaceWrite


@dataclass
class PauseStats:
    """How long generation was blocked by weight updates."""

    count: int = 0
    last_ms: float | None = None
    mean_ms: float | None = None
    max_ms: float | None = None
    last_wait_ms: float | None = None  # time the last update waited for the running batch
    total_ms: float = 0.0

    def add(self, pause_ms: float, wait_ms: float) -> None:
        self.count += 1
        self.total_ms += pause_ms
        self.last_ms = pause_ms
        self.mean_ms = self.total_ms / self.count
        self.max_ms = pause_ms if self.max_ms is None else max(self.max_ms, pause_ms)
        self.last_wait_ms = wait_ms

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Gate:
    """One batch at a time, or one update; waiting updates go before waiting batches."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._updates_waiting = 0
        self.update_waiting_since: float | None = None  # monotonic time the oldest waiting update arrived

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @contextmanager
    def batch(self, stopping: Callable[[], bool] = lambda: False) -> Iterator[None]:
        with self._cond:
            while (self._busy or self._updates_waiting) and not stopping():
                self._cond.wait()
            if stopping():
                raise EngineError("the replica is shutting down", hint="send the request to another replica")
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    @contextmanager
    def update(self) -> Iterator[float]:
        """Yields the seconds spent waiting for the running batch."""
        t0 = time.perf_counter()
        with self._cond:
            self._updates_waiting += 1
            if self.update_waiting_since is None:
                self.update_waiting_since = time.monotonic()
            try:
                while self._busy:
                    self._cond.wait()
            finally:
                self._updates_waiting -= 1
                if not self._updates_waiting:
                    self.update_waiting_since = None
            self._busy = True
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


@dataclass(frozen=True)
class TensorSpec:
    """What the engine expects of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Engine(ApplyHook, ABC):
    """An inference engine that follows a run (see the module docstring for its guarantees)."""

    name: str = "engine"

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._gate = _Gate()
        self._version: int | None = None
        self._digest: str | None = None  # state digest of `_version` (None: not told, or no version)
        self._specs: dict[str, TensorSpec] = {}  # checkpoint layout, set by subclasses at load
        self._aliases: dict[str, str] = {}  # tied alias -> the checkpoint tensor it equals
        self.check_error: str | None = None  # why the served weights are not a verified version
        self._stale: set[str] = set()  # tensors not verified since a failed write (all of them, then)
        self._told: Mapping[str, str] = {}  # the per-tensor digests of the version being written (`digests=`)
        self.pauses = PauseStats()
        self.max_hold_s: float | None = None  # a batch holding a waiting update this long is cut (None: never)
        self.request_timeout_s: float | None = None  # a batch running this long is cut (None: never)
        self._batch_started = 0.0
        self.stopping = False  # set by `stop_serving`: the running batch is cut, no new one starts

    def stop_serving(self) -> None:
        """The server is stopping: cut the running batch at its next decoding step (finish "abort",
        `stop_reason` "shutdown") and refuse every batch not yet started (`EngineError`)."""
        self.stopping = True
        self._gate.wake()

    # -- generation ---------------------------------------------------------------------
    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def state_digest(self) -> str | None:
        """The commit's state digest of the version served (None before one, or when not told)."""
        return self._digest

    @property
    def model_name(self) -> str:
        return self.model_dir.name

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Prompt token ids for a chat (with the generation prompt appended)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Prompt plus completion tokens, at most."""

    def generate(self, prompt: str | list[int], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of one prompt, all from one weight version."""
        params.validate()
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        with self._gate.batch(lambda: self.stopping):
            version, digest = self._version, self._digest
            self._batch_started = time.monotonic()
            outs = self._generate(ids, params)
        for c in outs:
            c.weight_version, c.state_digest = version, digest
        return outs

    @abstractmethod
    def _generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """Runs under the gate (no update can happen meanwhile); weight_version is set by the caller.
        Engines that decode step by step call `_cut_reason()` between steps."""

    def _cut_reason(self) -> str | None:
        """Why the running batch must stop now ("weight_update", "request_timeout"), or None."""
        if self.stopping:
            return "shutdown"
        now = time.monotonic()
        waiting = self._gate.update_waiting_since
        if self.max_hold_s is not None and waiting is not None and now - waiting > self.max_hold_s:
            return "weight_update"
        if self.request_timeout_s is not None and now - self._batch_started > self.request_timeout_s:
            return "request_timeout"
        return None

    # -- the ApplyHook ------------------------------------------------------------------
    takes_state_digest = True  # the follower hands over each version's state digest (`state_digest=`)
    takes_digests = True  # ... and its per-tensor digests (`digests=`), for the whole-state check
    takes_base_version = True  # ... and the version a delta is from (`base_version=`): refused unless held

    def load_full(self, version: int, tensors: Mapping[str, torch.Tensor], *, state_digest: str | None = None,
                  digests: Mapping[str, str] | None = None) -> None:
        """Replace every weight with `tensors` (checkpoint names), check them, then serve `version`
        (whose commit's state digest is `state_digest`, reported with every completion; `digests`:
        the version's per-tensor digests, if known)."""
        self._validate_full(tensors)
        tensors = {k: v for k, v in tensors.items() if k not in self._aliases}
        with self._gate.update() as waited_s:
            t0 = time.perf_counter()
            self._told = digests or {}
            self._guarded(version, lambda: self._load_full(version, tensors), state_digest)
            self.pauses.add((time.perf_counter() - t0) * 1e3, waited_s * 1e3)

    def apply_sparse(
        self,
        version: int,
        updates: Mapping[str, SparseUpdate],
        full: Mapping[str, torch.Tensor],
        *,
        base_version: int | None = None,
        state_digest: str | None = None,
        digests: Mapping[str, str] | None = None,
    ) -> None:
        """Write the changed elements of one verified version in place, check them, then serve `version`.

        `full`: the version's value of every touched tensor (and of any stale one, see above).
        `base_version`: the version the update is relative to; when given and the engine holds
        another (or none), the update is refused with `EngineCheckError` and nothing is written.
        `digests`: the version's per-tensor digests (every tensor), for the whole-state check."""
        self._validate_sparse(updates, full)
        updates = {k: v for k, v in updates.items() if k not in self._aliases}
        full = {k: v for k, v in full.items() if k not in self._aliases}
        with self._gate.update() as waited_s:
            t0 = time.perf_counter()
            self._told = digests or {}
            self._guarded(version, lambda: self._sparse_if_sound(version, updates, full, base_version), state_digest)
            self.pauses.add((time.perf_counter() - t0) * 1e3, waited_s * 1e3)

    def write_in_place(self, version: int, write: InPlaceWrite, *, base_version: int | None,
                       state_digest: str | None = None) -> None:
        """(`holds_device_state`) Inside the pause: `write` brings the live tensors to `version`
        (a delta from `base_version`, refused unless held; None: a full load) and returns its digests,
        against which the whole live state is checked before `version` is served."""
        with self._gate.update() as waited_s, torch.no_grad():
            t0 = time.perf_counter()
            self._guarded(version, lambda: self._write_live(version, write, base_version), state_digest)
            self.pauses.add((time.perf_counter() - t0) * 1e3, waited_s * 1e3)

    def _write_live(self, version: int, write: InPlaceWrite, base_version: int | None) -> None:
        if base_version is not None and (base_version != self._version or self._stale):
            known = self._version is not None and not self._stale
            held = f"version {self._version}" if known else "no verified version"
            raise EngineCheckError(
                f"{self.name} engine: version {version} is a delta from version {base_version}, but it holds {held}",
                hint="the replica reloads the version from an anchor",
            )
        self._told = write(self._live_tensors(full=base_version is None))
        self._check_live()

    def _live_tensors(self, *, full: bool) -> Mapping[str, torch.Tensor]:
        """(`holds_device_state`) The live tensors by checkpoint name (`full`: for a full load)."""
        raise NotImplementedError(f"{type(self).__name__} does not hold device state")

    def _check_live(self) -> None:
        """(`holds_device_state`) The whole-state check against `self._told` (EngineCheckError)."""
        raise NotImplementedError(f"{type(self).__name__} does not hold device state")

    def _sparse_if_sound(
        self,
        version: int,
        updates: Mapping[str, SparseUpdate],
        full: Mapping[str, torch.Tensor],
        base_version: int | None,
    ) -> None:
        if base_version is not None and base_version != self._version:
            raise EngineCheckError(
                f"{self.name} engine: version {version} is a delta from version {base_version}, but the engine holds "
                f"{'no verified version' if self._version is None else f'version {self._version}'}",
                hint="the replica reloads the version in full",
            )
        unverifiable = sorted(self._stale - set(full))
        if unverifiable:
            raise EngineCheckError(
                f"{self.name} engine: {len(unverifiable)} tensor(s) are unverified since a failed update "
                f"({', '.join(unverifiable[:3])}); a sparse update to version {version} cannot vouch for them",
                hint="the replica reloads the version in full",
            )
        self._apply_sparse(version, updates, full)

    def _guarded(self, version: int, write, digest: str | None = None) -> None:  # type: ignore[no-untyped-def]
        """Run a write (under the gate); the version moves only when it and its read-back passed.
        Any failure leaves every tensor stale until a full load passes its check."""
        try:
            write()
        except EngineCheckError as e:
            self._version, self._digest, self.check_error, self._stale = None, None, str(e), set(self._specs)
            raise
        except Exception as e:
            self._version, self._digest = None, None
            self.check_error, self._stale = f"update to version {version} failed half-way: {e}", set(self._specs)
            raise
        self._version, self._digest, self.check_error, self._stale = version, digest, None, set()

    @staticmethod
    def _mismatches(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> list[str]:
        """Tensors of `want` whose bits `got` (the engine's read-back) does not hold."""
        bad = []
        for name, w in want.items():
            g = got[name]
            if (
                g.shape != w.shape
                or g.dtype != w.dtype
                or not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).contiguous().view(torch.uint8))
            ):
                bad.append(name)
        return bad

    @abstractmethod
    def _load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def _apply_sparse(
        self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]
    ) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine serves, in checkpoint coordinates (CPU copies)."""
        raise NotImplementedError(f"{type(self).__name__} cannot export its weights")

    def close(self) -> None:
        """Release the engine (threads, memory)."""

    # -- validation (before the engine sees anything) -----------------------------------
    def _spec(self, name: str) -> TensorSpec:
        spec = self._specs.get(self._aliases.get(name, name))
        if spec is None:
            raise WeightUpdateError(
                f"tensor '{name}': not a weight of the model in {self.model_dir}",
                hint="the run was published from a different model; start the replica with that model",
            )
        return spec

    def _validate_full(self, tensors: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self._specs) - set(tensors))
        problems = [f"tensor '{n}': missing" for n in missing]
        for name, t in tensors.items():
            spec = self._spec(name)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                problems.append(f"tensor '{name}': {t.dtype} {list(t.shape)}, expected {spec.dtype} {list(spec.shape)}")
        problems += self._alias_problems(tensors)
        if problems:
            raise WeightUpdateError("full load rejected: " + some_of(problems),
                                    hint=dtype_hint(tensors, {k: s.dtype for k, s in self._specs.items()}, "replica")
                                    or "publish the model the replica serves")

    def _alias_problems(self, full: Mapping[str, torch.Tensor]) -> list[str]:
        problems = []
        for alias, canonical in self._aliases.items():
            if alias in full and (canonical not in full or not torch.equal(full[alias], full[canonical])):
                problems.append(f"tensor '{alias}': differs from '{canonical}', but the model ties them")
        return problems

    def _validate_sparse(self, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]) -> None:
        problems = []
        for name, upd in updates.items():
            spec = self._spec(name)
            f = full.get(name)
            if f is None:
                problems.append(f"tensor '{name}': no full value given")
            elif tuple(f.shape) != spec.shape or f.dtype != spec.dtype:
                problems.append(f"tensor '{name}': {f.dtype} {list(f.shape)}, expected {spec.dtype} {list(spec.shape)}")
            idx, val = upd.indices, upd.values
            if idx.dtype != torch.int64 or idx.dim() != 1 or val.dim() != 1 or idx.numel() != val.numel():
                problems.append(f"tensor '{name}': indices must be 1-D int64 with one value each")
                continue
            if val.dtype != spec.dtype:
                problems.append(f"tensor '{name}': values are {val.dtype}, expected {spec.dtype}")
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= spec.numel):
                problems.append(f"tensor '{name}': index outside [0, {spec.numel})")
            if val.is_floating_point() and val.numel() and not bool(torch.isfinite(val).all()):
                problems.append(f"tensor '{name}': non-finite values")
        problems += self._alias_problems(full)
        if problems:
            raise WeightUpdateError(
                "sparse update rejected: " + some_of(problems), hint="the patch does not fit this model"
            )
