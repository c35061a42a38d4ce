"""The embedded engine: a transformers model in this process (no vLLM; laptops, CPU, the demo).

Guarantees (on top of `base.Engine`'s): sparse updates are written in place into the model's
parameters (`index_put_` on the flat view, under `no_grad`), so after an update the model's
`state_dict()` is bit-identical to the trainer's state of that version. Generation is a plain
KV-cached decoding loop: greedy at temperature 0, otherwise temperature + top-p sampling from
a generator seeded with the request's seed, so a request with a seed is reproducible on one
version.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inference_space.engines.base import Completion, Engine, FinishReason, SamplingParams, TensorSpec
from sparsesync.codec.apply import SparseUpdate
from sparsesync.errors import EngineError


class EmbeddedEngine(Engine):
    """A transformers causal LM served from this process (see module docstring)."""

    name = "embedded"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", threads: int | None = None) -> None:
        super().__init__(model_dir)
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as e:  # pragma: no cover - depends on the install
            raise EngineError(
                "the embedded engine needs transformers", hint="pip install 'sparsesync[embedded]'"
            ) from e
        if threads:
            torch.set_num_threads(threads)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype="auto").to(device).eval()
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot load the model in {self.model_dir}: {e}", hint="--model must be a transformers model folder") from e
        self.device = torch.device(device)
        sd = self.model.state_dict()  # detached views sharing the parameters' storage
        self._specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in sd.items()}
        self._sd = sd  # name -> live tensor (views of the parameters)
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self._eos.add(self.tokenizer.eos_token_id)

    # -- text ---------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    # -- generation ---------------------------------------------------------------------
    @torch.no_grad()
    def _generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        n = params.n
        gen = torch.Generator(device="cpu")
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        input_ids = torch.tensor([prompt_ids] * n, device=self.device)
        max_new = min(params.max_tokens, self.model.config.max_position_embeddings - len(prompt_ids))
        if max_new <= 0:
            raise EngineError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the model's context of "
                f"{self.model.config.max_position_embeddings}",
                hint="send a shorter prompt",
            )
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n
        stop_texts: list[str | None] = [None] * n  # text cut before a stop string
        past = None
        step_ids = input_ids
        for _ in range(max_new):
            out = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            raw_logp = torch.log_softmax(logits, dim=-1)
            next_ids = self._sample(logits, params, gen)
            for i in range(n):
                if finish[i] is not None:
                    continue
                tok = int(next_ids[i])
                tokens[i].append(tok)
                logps[i].append(float(raw_logp[i, tok]))
                if tok in self._eos and not params.ignore_eos:
                    finish[i] = "stop"
                elif params.stop:
                    text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
                    cut = min((p for p in (text.find(s) for s in params.stop) if p >= 0), default=-1)
                    if cut >= 0:
                        finish[i], stop_texts[i] = "stop", text[:cut]
            if all(f is not None for f in finish):
                break
            step_ids = next_ids.view(n, 1).to(self.device)
        result = []
        for i in range(n):
            reason: FinishReason = finish[i] or "length"
            text = stop_texts[i]
            if text is None:
                body = tokens[i][:-1] if reason == "stop" and tokens[i] and tokens[i][-1] in self._eos else tokens[i]
                text = self.tokenizer.decode(body, skip_special_tokens=True)
            result.append(Completion(i, text, list(prompt_ids), tokens[i], logps[i], reason, None))
        return result

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if params.temperature == 0.0:
            return logits.argmax(dim=-1).cpu()
        probs = torch.softmax(logits / params.temperature, dim=-1).cpu()
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(dim=-1) - sorted_p < params.top_p  # always keeps the top token
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        return torch.multinomial(probs, 1, generator=gen).view(-1)

    # -- weights ------------------------------------------------------------------------
    @torch.no_grad()
    def _load_full(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self._sd[name].copy_(t)

    @torch.no_grad()
    def _apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]) -> None:
        for name, upd in updates.items():
            dst = self._sd[name]
            flat = dst.view(-1)
            flat.index_put_((upd.indices.to(dst.device),), upd.values.to(dst.device))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._sd.items()}
