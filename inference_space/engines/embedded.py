"""The embedded engine: a transformers model in this process (no vLLM; laptops, CPU, the demo).

Guarantees (on top of `base.Engine`'s): the engine takes the checkpoint's own key set (what
`save_pretrained` wrote into the model folder) and maps each checkpoint tensor onto a view of
the live runtime parameter that holds it: a tied LM head is the embedding's storage, and
transformers' runtime-fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`)
are sliced per expert; every view is checked against the checkpoint at start. Sparse updates
are written in place through those views (`index_put_` on the flat view, under `no_grad`),
then read back from the same parameters the forward pass uses and compared bit for bit with
the version (the tied head must still share the embedding's storage). Generation is a plain
KV-cached decoding loop: greedy at temperature 0, otherwise temperature + top-k, min-p and top-p sampling (after the
repetition penalty, which also applies to greedy decoding) from
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
from sparsesync.checkpoint import EXPERT_KEY, TIED_ALIASES
from sparsesync.errors import EngineCheckError, EngineError


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
        self._sd = _checkpoint_views(self.model, self.model_dir)  # checkpoint name -> live view of a parameter
        self._specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in self._sd.items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            self._aliases = {a: c for a, c in TIED_ALIASES.items() if c in self._sd and a not in self._sd}
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

    @property
    def max_model_len(self) -> int:
        return int(self.model.config.max_position_embeddings)

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
        tops: list[list[dict[int, float]]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n
        stop_texts: list[str | None] = [None] * n  # text cut before a stop string
        cut: str | None = None
        past = None
        step_ids = input_ids
        for _ in range(max_new):
            if (cut := self._cut_reason()) is not None:
                finish = [f or "abort" for f in finish]
                break
            out = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            raw_logp = torch.log_softmax(logits, dim=-1)
            if params.repetition_penalty != 1.0:  # as transformers and vLLM: divide positive logits, multiply negative
                logits = logits.clone()
                for i in range(n):
                    seen = torch.tensor(prompt_ids + tokens[i], dtype=torch.long, device=logits.device).unique()
                    row = logits[i, seen]
                    logits[i, seen] = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            next_ids = self._sample(logits, params, gen)
            for i in range(n):
                if finish[i] is not None:
                    continue
                tok = int(next_ids[i])
                tokens[i].append(tok)
                logps[i].append(float(raw_logp[i, tok]))
                if params.logprobs:
                    best = int(raw_logp[i].argmax())
                    tops[i].append({best: float(raw_logp[i, best])})
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
            result.append(Completion(i, text, list(prompt_ids), tokens[i], logps[i], reason, None,
                                     stop_reason=cut if reason == "abort" else None,
                                     top_logprobs=tops[i] if params.logprobs else None))
        return result

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if params.temperature == 0.0:
            return logits.argmax(dim=-1).cpu()
        probs = torch.softmax(logits / params.temperature, dim=-1).cpu()
        if params.top_k > 0 and params.top_k < probs.shape[-1]:
            kth = probs.topk(params.top_k, dim=-1).values[:, -1:]
            probs = probs * (probs >= kth)
        if params.min_p > 0.0:
            probs = probs * (probs >= params.min_p * probs.max(dim=-1, keepdim=True).values)
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
        self._check(tensors)

    @torch.no_grad()
    def _apply_sparse(self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]) -> None:
        for name, upd in updates.items():
            dst = self._sd[name]
            flat = dst.view(-1)
            flat.index_put_((upd.indices.to(dst.device),), upd.values.to(dst.device))
        self._check(full)

    def _check(self, want: Mapping[str, torch.Tensor]) -> None:
        """The engine-side proof: the parameters the forward pass reads hold `want`, bit for bit."""
        bad = self._mismatches({n: self._sd[n].detach().cpu() for n in want}, {n: t.cpu() for n, t in want.items()})
        head, emb = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if self._aliases and head is not None and head.weight.data_ptr() != emb.weight.data_ptr():
            bad.append("lm_head.weight (no longer tied to the embedding)")
        if bad:
            raise EngineCheckError(
                f"embedded engine: {len(bad)} tensor(s) read back differ from the version: {', '.join(bad[:5])}",
                hint="the replica reloads the version from its verified copy",
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._sd.items()}


def _checkpoint_views(model: Any, model_dir: Path) -> dict[str, torch.Tensor]:
    """Checkpoint name -> a view of the live parameter holding it (see module docstring)."""
    from safetensors import safe_open

    runtime = model.state_dict()  # detached views sharing the parameters' storage
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(runtime))  # checkpoint names (some copies)
    except ImportError:  # transformers 4: runtime names are the checkpoint's
        reverted = dict(runtime)
    names: list[str] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names += list(sf.keys())
    if not names:  # no safetensors (e.g. .bin): the runtime key set without tied aliases
        names = [n for n in reverted if not (n in TIED_ALIASES and getattr(model.config, "tie_word_embeddings", False))]
    storages = {t.untyped_storage().data_ptr() for t in runtime.values()}
    views, problems = {}, []
    for name in names:
        ref = reverted.get(name)
        view = ref if ref is not None and ref.untyped_storage().data_ptr() in storages else _expert_view(name, runtime)
        if view is None or ref is None or view.shape != ref.shape or not torch.equal(view, ref):
            problems.append(name)
            continue
        views[name] = view
    if problems:
        raise EngineError(
            f"cannot map {len(problems)} checkpoint tensor(s) of {model_dir} onto the model's runtime layout: {', '.join(problems[:5])}",
            hint="this architecture's runtime layout is not supported by the embedded engine; use --engine vllm",
        )
    return views


def _expert_view(name: str, runtime: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """One expert's tensor inside transformers' runtime-fused experts (gate rows, then up rows)."""
    m = EXPERT_KEY.match(name)
    if m is None:
        return None
    e, proj = int(m["e"]), m["proj"]
    if proj in ("down_proj", "w2"):
        fused = runtime.get(f"{m['layer']}.down_proj")
        return None if fused is None else fused[e]
    fused = runtime.get(f"{m['layer']}.gate_up_proj")
    if fused is None:
        return None
    half = fused.shape[1] // 2
    return fused[e, :half] if proj in ("gate_proj", "w1") else fused[e, half:]
