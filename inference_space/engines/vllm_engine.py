"""The vLLM engine: a vLLM `LLM` that follows a run through `sparsesync.integrations.vllm`.

Guarantees (on top of `base.Engine`'s), all from `integrations.vllm.apply.WeightSync`: weights
reach vLLM only through its weight-transfer API, with `finish` in a `finally`; vLLM's own
weight version moves only when an update succeeded and the worker's read-back of the weights
the forward pass uses matched the version, both what the update sent and (single rank) the rest
of the state as `integrations.vllm.unchanged` checks it (`EngineCheckError` otherwise); the prefix cache is
reset on every version switch; on CPU (`mode="reload"`) complete fused groups of only the
touched layers are reloaded and a tied LM head is repacked from the new embedding. The reload
path is what `mode="auto"` (the default) picks on CPU and on GPU alike: it is the one the tests
run. `mode="sparse"` (GPU only, an explicit opt-in: `--vllm-apply sparse`) writes versions in
place in checkpoint coordinates through `load_checkpoint_weight_patches`; it has not yet run on
a GPU here.
Single-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"): starts in
seconds, updates are handed over in memory. `tensor_parallel_size > 1` uses the
multiprocessing executor, and updates reach every worker as a file under /dev/shm; on CPU the
workers' threads are bound to disjoint cores (`VLLM_CPU_OMP_THREADS_BIND`, unless set).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from inference_space.engines.base import Engine, TensorSpec
from inference_space.engines.sampling import Completion, FinishReason, SamplingParams
from sparsesync.checkpoint import TIED_ALIASES, load_checkpoint
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import EngineCheckError, EngineError

log = logging.getLogger(__name__)



@contextlib.contextmanager
def _flask_proxies_resolvable() -> Iterator[None]:
    """vLLM 0.32's CPU kernel registration scans every attribute of every imported module with
    `hasattr(value, "__dict__")`; flask's context proxies (`flask.request`, `current_app`)
    raise RuntimeError there outside a request, which kills the engine start whenever flask
    was imported first (moto's S3 server in our tests does; so may a user's app). Inside a
    throwaway request context those proxies resolve and the scan passes them by."""
    flask = sys.modules.get("flask")
    if flask is None:
        yield
        return
    with flask.Flask("sparsesync-vllm-start").test_request_context():
        yield





class VllmEngine(Engine):
    """A vLLM `LLM` whose weights follow a run (see module docstring)."""

    name = "vllm"
    pages_out_mirror = True  # an update reloads what it reads of the mirror once (sparsesync.protocol.follower.hooks)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        mode: str = "auto",
        kv_cache_memory_bytes: int = 192 << 20,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        enforce_eager: bool | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        check: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(model_dir)
        if tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:
            raise EngineError(
                "the vllm engine needs vLLM", hint="pip install 'sparsesync[vllm]' (see scripts/setup.sh)"
            ) from e
        from sparsesync.integrations.vllm import plugin

        plugin.register()
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        on_cpu = current_platform.is_cpu()
        if on_cpu and tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_bind(tensor_parallel_size))
        self.mode = apply_mode(mode, on_cpu=on_cpu)
        startup = load_checkpoint(self.model_dir)  # a file map of the checkpoint: read only where a reload needs it
        self._specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in startup.items()}
        kw: dict[str, Any] = dict(
            model=str(self.model_dir),
            distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",
            tensor_parallel_size=tensor_parallel_size,
            weight_transfer_config={"backend": plugin.BACKEND},
            seed=seed,
            enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
        )
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        if on_cpu or gpu_memory_utilization is None:
            kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        else:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
        kw.update(llm_kwargs)
        try:
            with _flask_proxies_resolvable():
                self.llm = LLM(**kw)
        except Exception as e:  # vLLM raises many kinds; name the model
            raise EngineError(f"vLLM could not load {self.model_dir}: {e}", hint="see the vLLM log above") from e
        from sparsesync.integrations.vllm.apply import WeightSync

        # no copy of the weights of its own: the source is the checkpoint's map, then the follower's mirror
        self.sync = WeightSync(self.llm, startup, mode=self.mode, check=check)
        del startup
        self.tokenizer = self.llm.get_tokenizer()
        self._vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        if getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False):
            self._aliases = {a: c for a, c in TIED_ALIASES.items() if c in self._specs and a not in self._specs}
        self.last_sent: list[str] = []  # checkpoint tensors the last update handed to vLLM
        self._lora_request: Any = None  # the adapter slot every request uses (vllm_adapter.VllmAdapterEngine)

    # -- text ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_model_len(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    # -- generation ---------------------------------------------------------------------
    def _generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            max_tokens=params.max_tokens,
            stop=params.stop or None,
            ignore_eos=params.ignore_eos,
            top_k=params.top_k,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            logprobs=params.logprobs,  # the sampled token's logprob, plus the k most likely ones' (ranks 1..k)
        )
        try:
            (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], sp, use_tqdm=False,
                                       lora_request=self._lora_request)
        except ValueError as e:  # e.g. prompt longer than max_model_len
            raise EngineError(f"vLLM refused the request: {e}", hint="send a shorter prompt or fewer tokens") from e
        result = []
        for c in out.outputs:
            ids = list(c.token_ids)
            logps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs or [], strict=False)]
            spans = {s.version for s in (c.weight_versions or [])}
            if len(spans) > 1:  # cannot happen under the gate; say so loudly if it ever does
                log.error("completion spans weight versions %s", sorted(spans))
            reason: FinishReason = "length" if c.finish_reason == "length" else "stop"
            tops = None
            if params.logprobs:  # vLLM's dict holds the sampled token and the top k (ranks 1..k)
                tops = [
                    dict(
                        sorted(
                            (
                                (t, float(x.logprob))
                                for t, x in lp.items()
                                if x.rank is not None and x.rank <= params.logprobs
                            ),
                            key=lambda kv: -kv[1],
                        )
                    )
                    for lp in c.logprobs or []
                ]
            result.append(Completion(c.index, c.text, list(prompt_ids), ids, logps, reason, None, top_logprobs=tops,
                                     stop_reason=c.stop_reason))
        return result

    # -- weights ------------------------------------------------------------------------
    def _load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        with _check_errors():
            self.sync.load(version, tensors, self._told)
        self.last_sent = sorted(self.sync.source)

    def _apply_sparse(
        self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]
    ) -> None:
        if self._stale:  # after a failure (base.Engine lets this through only with every stale tensor in `full`)
            self._load_full(version, {**self.sync.source, **full})
            return
        with _check_errors():  # the worker also checks every tensor not sent against the version (`digests=`)
            self.last_sent = self.sync.patch(version, updates, self._told, full=full)

    def _transfer(self, version: int, kind: str, payload: dict[str, Any] | None) -> None:
        """One raw update through vLLM's API (tests use it to send what `sync` never would)."""
        with _check_errors():
            self.sync._transfer(version, kind, payload)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights last handed to vLLM (checkpoint coordinates; vLLM's own tensors are repacked),
        copied from the tensors they were read from (the follower's mirror, or the checkpoint)."""
        return {k: v.clone() for k, v in self.sync.source.items()}

    def vllm_weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def close(self) -> None:
        """Drop the engine. Not `engine_core.shutdown()`: in single-process mode that tears down
        vLLM's process-global parallel state, which other engines in this process still use."""
        if getattr(self, "llm", None) is not None:
            self.llm = None
            import gc

            gc.collect()


APPLY_MODES = ("auto", "reload", "sparse")


def apply_mode(mode: str, *, on_cpu: bool) -> str:
    """The update path a vLLM engine uses: "auto" is "reload" on every platform (the path the
    tests run); "sparse" (in place, GPU only) must be asked for and has not yet run on a GPU."""
    if mode not in APPLY_MODES:
        raise EngineError(
            f"vllm apply mode '{mode}': expected one of {', '.join(APPLY_MODES)}",
            hint="--vllm-apply auto|reload|sparse",
        )
    if mode == "sparse" and on_cpu:
        raise EngineError("vllm apply mode 'sparse' needs a GPU", hint="use --vllm-apply reload (what auto picks)")
    return "reload" if mode == "auto" else mode


def _cpu_bind(workers: int) -> str:
    """vLLM-CPU binds each worker to its own NUMA node by default and refuses more workers than
    nodes ("Not enough allowed NUMA nodes"); split this process's cores between the workers."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise EngineError(
            f"tensor_parallel_size={workers} needs at least {workers} CPU cores, this process has {len(cores)}"
        )
    per = len(cores) // workers
    return "|".join(",".join(str(c) for c in cores[i * per : (i + 1) * per]) for i in range(workers))


@contextlib.contextmanager
def _check_errors() -> Iterator[None]:
    """A read-back mismatch in a worker arrives as whatever vLLM wraps it in: keep its class."""
    try:
        yield
    except EngineCheckError:
        raise
    except Exception as e:
        if "EngineCheckError" in type(e).__name__ or "differ from the update" in str(e):
            raise EngineCheckError(str(e)) from e
        raise
