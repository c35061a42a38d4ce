"""The vLLM engine: a vLLM `LLM` driven through its weight-transfer API with the sparsesync backend.

Guarantees (on top of `base.Engine`'s):
- Weights reach vLLM only through `init_weight_transfer_engine` / `start_weight_update` /
  `update_weights` / `finish_weight_update(weight_version=...)`, with `finish` in a `finally`,
  and vLLM's own weight version (`LLM.get_weight_version()`, and the per-token spans vLLM
  attaches to each output) moves only when an update succeeded.
- On GPU, a sparse version is written in place through vLLM's checkpoint-coordinate patch
  loader (`mode="sparse"`). On CPU (`mode="reload"`) the changed tensors go through the
  layerwise reload path, together with the other checkpoint tensors of every vLLM layer they
  touch (q/k/v of a fused qkv_proj, gate/up of gate_up_proj), taken from a CPU copy of the
  served weights that this engine keeps, so no layer is ever reloaded half-way.
- Single-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"): starts in
  seconds, and updates are handed over in memory.
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

from inference_space.engines.base import Completion, Engine, FinishReason, SamplingParams, TensorSpec
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import EngineError

log = logging.getLogger(__name__)

# names of fused vLLM modules -> the checkpoint modules they pack (Llama/Qwen/Mistral family);
# replaced by the model's own `packed_modules_mapping` when vLLM exposes one
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


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


def _packed_mapping(worker: Any) -> dict[str, list[str]]:
    """Runs in the worker (collective_rpc): the model's fused-module table."""
    model = worker.model_runner.get_model()
    return {k: list(v) for k, v in dict(getattr(model, "packed_modules_mapping", {}) or {}).items()}


def _read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors files in {model_dir}", hint="--model must be a safetensors model folder")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class VllmEngine(Engine):
    """A vLLM `LLM` whose weights follow a run (see module docstring)."""

    name = "vllm"

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
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(model_dir)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:
            raise EngineError("the vllm engine needs vLLM", hint="pip install 'sparsesync[vllm]' (see scripts/setup.sh)") from e
        from inference_space.engines import vllm_plugin

        vllm_plugin.register()
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        on_cpu = current_platform.is_cpu()
        if mode == "auto":
            mode = "reload" if on_cpu else "sparse"
        if mode not in ("reload", "sparse"):
            raise EngineError(f"vllm mode '{mode}': expected 'auto', 'reload' or 'sparse'")
        if mode == "sparse" and on_cpu:
            raise EngineError("vllm mode 'sparse' needs a GPU", hint="use mode 'reload' (the default on CPU)")
        self.mode = mode
        self._state = _read_checkpoint(self.model_dir)  # what vLLM serves, checkpoint coordinates
        self._specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in self._state.items()}
        kw: dict[str, Any] = dict(
            model=str(self.model_dir),
            distributed_executor_backend="uni",
            weight_transfer_config={"backend": vllm_plugin.BACKEND},
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
        except Exception as e:  # noqa: BLE001 - vLLM raises many kinds; name the model
            raise EngineError(f"vLLM could not load {self.model_dir}: {e}", hint="see the vLLM log above") from e
        self.llm.init_weight_transfer_engine({"init_info": {}})
        self.tokenizer = self.llm.get_tokenizer()
        try:
            packed = self.llm.collective_rpc(_packed_mapping)[0] or DEFAULT_PACKED
        except Exception:  # noqa: BLE001 - multi-process engines may refuse callables
            packed = DEFAULT_PACKED
        self._fused = {part: fused for fused, parts in packed.items() for part in parts}
        self._groups: dict[str, list[str]] = {}
        for name in self._state:
            self._groups.setdefault(self._group_key(name), []).append(name)
        self._vocab = int(self.llm.llm_engine.model_config.get_vocab_size())

    def _group_key(self, name: str) -> str:
        """The vLLM layer a checkpoint tensor loads into (its module, fused names folded)."""
        parts = name.split(".")[:-1]
        if parts and parts[-1] in self._fused:
            parts[-1] = self._fused[parts[-1]]
        return ".".join(parts)

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
            logprobs=0,  # the sampled token's logprob only
        )
        try:
            (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], sp, use_tqdm=False)
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
            result.append(Completion(c.index, c.text, list(prompt_ids), ids, logps, reason, None))
        return result

    # -- weights ------------------------------------------------------------------------
    def _transfer(self, version: int, kind: str, payload: dict[str, Any]) -> None:
        from inference_space.engines.vllm_backend import stage, unstage

        handle = stage(payload)
        ok = False
        try:
            self.llm.start_weight_update()
            try:
                self.llm.update_weights({"update_info": {"kind": kind, "handle": handle}})
                ok = True
            finally:
                try:
                    self.llm.finish_weight_update(weight_version=str(version) if ok else None)
                except RuntimeError:
                    if ok:
                        raise  # a failed update already closed the session in the worker
        finally:
            unstage(handle)

    @torch.no_grad()
    def _load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self._state[name].copy_(t)
        self._transfer(version, "dense", {"tensors": dict(self._state)})

    @torch.no_grad()
    def _apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]) -> None:
        for name, upd in updates.items():
            self._state[name].view(-1).index_put_((upd.indices,), upd.values)
        if self.mode == "sparse":
            payload = {
                "updates": {n: (u.indices, u.values) for n, u in updates.items()},
                "shapes": {n: self._specs[n].shape for n in updates},
            }
            self._transfer(version, "sparse", payload)
        else:
            names = sorted({m for n in updates for m in self._groups[self._group_key(n)]})
            self._transfer(version, "dense", {"tensors": {n: self._state[n] for n in names}})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights handed to vLLM (checkpoint coordinates; vLLM's own tensors are repacked)."""
        return {k: v.clone() for k, v in self._state.items()}

    def vllm_weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def close(self) -> None:
        """Drop the engine. Not `engine_core.shutdown()`: in single-process mode that tears down
        vLLM's process-global parallel state, which other engines in this process still use."""
        if getattr(self, "llm", None) is not None:
            self.llm = None
            import gc

            gc.collect()
