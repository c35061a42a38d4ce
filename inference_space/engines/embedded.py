"""The embedded engine: a transformers model in this process (no vLLM; laptops, CPU, the demo).

Guarantees (on top of `base.Engine`'s): the engine takes the checkpoint's own key set (what
`save_pretrained` wrote into the model folder) and maps each checkpoint tensor onto a view of
the live runtime parameter that holds it: a tied LM head is the embedding's storage, and
transformers' runtime-fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`)
are sliced per expert; every view is checked against the checkpoint at start. Sparse updates
are written in place through those views (`index_put_` on the flat view, under `no_grad`).
Then, before the version is reported, the whole state is checked: every checkpoint tensor,
read from the live model, is hashed (`tensor_digest`, in parallel) and compared with the
version's digest of it (given by the follower; else the digest of the tensor it was sent, or
for an untouched tensor the one recorded at the last check that passed), so a tensor changed
in place behind the engine's back (`p.data.zero_()`) fails the check however it changed,
touched by the update or not. Views are resolved from the live module tree
(`named_parameters`/`named_buffers`) at every update and check, never cached: a parameter or
buffer replaced on the model (`layer.weight = nn.Parameter(...)`: judged by the identity of the
tensor object and of its storage, and by its address, so a new tensor at the old address is
seen), a head untied from the embedding, or a rewritten buffer (rotary tables, compared with a
copy) fails the check (`EngineCheckError`), and only a full load (which writes into whatever the
model then holds, ties intact) recovers. Generation is a plain
KV-cached decoding loop: greedy at temperature 0, otherwise temperature + top-k, min-p and top-p sampling (after the
repetition penalty, which also applies to greedy decoding) from
a generator seeded with the request's seed, so a request with a seed is reproducible on one
version.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from inference_space.engines.base import Engine, TensorSpec
from inference_space.engines.sampling import Completion, FinishReason, SamplingParams
from sparsesync.checkpoint import EXPERT_KEY, TIED_ALIASES
from sparsesync.codec import tensor_digest, tensor_digests
from sparsesync.codec.apply import SparseUpdate
from sparsesync.codec.device_apply import device_digests
from sparsesync.errors import EngineCheckError, EngineError


class EmbeddedEngine(Engine):
    """A transformers causal LM served from this process (see module docstring)."""

    name = "embedded"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", threads: int | None = None,
                 device_state: bool | None = None) -> None:
        """`device_state`: the follower writes versions straight into the model's tensors and keeps no host
        mirror (`holds_device_state`); None: on a GPU (any device but the CPU) yes, on the CPU no."""
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
            raise EngineError(
                f"cannot load the model in {self.model_dir}: {e}", hint="--model must be a transformers model folder"
            ) from e
        self.device = torch.device(device)
        self.holds_device_state = self.device.type != "cpu" if device_state is None else device_state
        views = _checkpoint_views(self.model, self.model_dir)  # checkpoint name -> view of a parameter at start
        self._live = _LiveMap(self.model, views)  # resolved from the live model at every update and check
        self._specs = {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in views.items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            self._aliases = {a: c for a, c in TIED_ALIASES.items() if c in views and a not in views}
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
        rows = _Rows(n, params, self.tokenizer, self._eos)
        cut: str | None = None
        past = None
        step_ids = input_ids
        for _ in range(max_new):
            if (cut := self._cut_reason()) is not None:
                rows.finish = [f or "abort" for f in rows.finish]
                break
            out = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            raw_logp = torch.log_softmax(logits, dim=-1)
            if params.repetition_penalty != 1.0:
                logits = _penalized(logits, prompt_ids, rows.tokens, params.repetition_penalty)
            next_ids = self._sample(logits, params, gen)
            for i in range(n):
                rows.take(i, int(next_ids[i]), raw_logp)
            if all(f is not None for f in rows.finish):
                break
            step_ids = next_ids.view(n, 1).to(self.device)
        return rows.completions(prompt_ids, cut)

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
        self._live.adopt(self.model)  # a full load writes whatever parameters the model now holds
        views = self._live.views(self.model)
        for name, t in tensors.items():
            views[name].copy_(t)
        self._check(tensors)

    @torch.no_grad()
    def _apply_sparse(
        self, version: int, updates: Mapping[str, SparseUpdate], full: Mapping[str, torch.Tensor]
    ) -> None:
        self._raise(self._live.tampered(self.model))  # nothing is written into a replaced parameter
        views = self._live.views(self.model)
        for name, upd in updates.items():
            dst = views[name]
            flat = dst.view(-1)
            flat.index_put_((upd.indices.to(dst.device),), upd.values.to(dst.device))
        self._check(full)

    def device_tensors(self) -> dict[str, torch.Tensor]:
        return self._live.views(self.model)

    def _live_tensors(self, *, full: bool) -> dict[str, torch.Tensor]:
        if full:
            self._live.adopt(self.model)  # a full load writes whatever parameters the model now holds
        else:
            self._raise(self._live.tampered(self.model))  # nothing is written into a replaced parameter
        return self._live.views(self.model)

    def _check_live(self) -> None:
        self._check({})

    def _check(self, want: Mapping[str, torch.Tensor]) -> None:
        """The engine-side proof, read from the model's live parameters at check time: no
        parameter or buffer the forward pass reads was replaced, untied or rewritten behind the
        engine's back, and every checkpoint tensor holds the version's bits: its digest equals the
        version's (`self._told`), else that of its value in `want`, else (untouched) the one
        recorded when it was last verified. Records the digests once all of it passed."""
        bad = self._live.tampered(self.model)
        views = self._live.views(self.model)
        # every tensor the forward pass reads, from the live model (on a GPU: hashed there, read back at once)
        got = tensor_digests(views) if self.device.type == "cpu" else device_digests(views)
        for name, view in views.items():
            spec = self._specs[name]
            want_digest = self._told.get(name) or (
                tensor_digest(want[name]) if name in want else self._live.verified.get(name)
            )
            if tuple(view.shape) != spec.shape or view.dtype != spec.dtype or got[name] != want_digest:
                bad.append(name if name in want else f"{name} (not in this update: changed since it was last verified)")
        self._raise(bad)
        self._live.verified = got

    @staticmethod
    def _raise(bad: list[str]) -> None:
        if bad:
            raise EngineCheckError(
                f"embedded engine: {len(bad)} tensor(s) read back differ from the version: {', '.join(bad[:5])}",
                hint="the replica reloads the version from its verified copy",
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self._live.views(self.model).items()}


class _LiveMap:
    """Checkpoint names -> where the live model holds them, resolved again at every use.

    Records at start (and at each full load, `adopt`) every parameter and buffer the forward
    pass reads (the tensor object, its storage object and its address), which of them share
    storage (a tied head), and a copy of the buffers that are not checkpoint tensors (rotary
    tables); `tampered` reports any that was replaced, untied, or (buffers) rewritten since.
    `verified`: each checkpoint tensor's digest as last checked (at start: as loaded)."""

    def __init__(self, model: Any, views: Mapping[str, torch.Tensor]) -> None:
        live = _tensors(model)
        at: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
        for key, t in live.items():
            at.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()), key)
        self.where: dict[str, tuple[str, str | None, int]] = {}  # name -> (runtime key, expert part, expert)
        # name -> (shape, stride, offset) in its key
        self.strided: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
        for name, v in views.items():
            m = EXPERT_KEY.match(name)
            if m is not None and name not in live:
                part = (
                    "down" if m["proj"] in ("down_proj", "w2") else "gate" if m["proj"] in ("gate_proj", "w1") else "up"
                )
                self.where[name] = (
                    f"{m['layer']}.{'down_proj' if part == 'down' else 'gate_up_proj'}",
                    part,
                    int(m["e"]),
                )
            elif name in live and live[name].data_ptr() == v.data_ptr() and live[name].shape == v.shape:
                self.where[name] = (name, None, 0)
            else:
                key = at.get((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride()))
                if key is None:  # a slice of a runtime tensor (a conversion that fuses on load): kept by its strides
                    key = next(
                        k for k, t in live.items() if t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                    )
                    self.strided[name] = (tuple(v.shape), v.stride(), v.storage_offset())
                self.where[name] = (key, None, 0)
        groups: dict[int, list[str]] = {}
        for key, t in live.items():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(key)
        self.shared = [sorted(g) for g in groups.values() if len(g) > 1]
        ckpt_keys = {k for k, _, _ in self.where.values()}
        self.volatile = _volatile_buffers(model)
        self.buffers = {k: b.detach().clone() for k, b in model.named_buffers(remove_duplicate=False)
                        if k not in ckpt_keys and k not in self.volatile}
        self.adopt(model)
        self.verified: dict[str, str] = tensor_digests(self.views(model))

    def adopt(self, model: Any) -> None:
        self.held = {k: _identity(t) for k, t in _tensors(model).items() if k not in self.volatile}

    def views(self, model: Any) -> dict[str, torch.Tensor]:
        live = _tensors(model)
        out = {}
        for name, (key, part, e) in self.where.items():
            t = live[key]
            if name in self.strided:
                shape, stride, offset = self.strided[name]
                out[name] = t.as_strided(shape, stride, offset)
            elif part is None:
                out[name] = t
            elif part == "down":
                out[name] = t[e]
            else:
                half = t.shape[1] // 2
                out[name] = t[e, :half] if part == "gate" else t[e, half:]
        return out

    def tampered(self, model: Any) -> list[str]:
        live = _tensors(model)
        bad = [
            f"{k} (replaced since the engine mapped it)"
            for k, held in self.held.items()
            if k not in live or not _same(held, live[k])
        ]
        bad += [
            f"{k} (not a tensor of the model the engine mapped)"
            for k in live
            if k not in self.held and k not in self.volatile
        ]
        for group in self.shared:
            if len({live[k].untyped_storage().data_ptr() for k in group if k in live}) > 1:
                bad.append(f"{group[-1]} (no longer shares storage with {', '.join(group[:-1])})")
        for k, ref in self.buffers.items():
            b = live.get(k)
            if b is not None and (b.shape != ref.shape or not torch.equal(b.detach(), ref)):
                bad.append(f"{k} (buffer rewritten since the engine started)")
        return bad


def _identity(t: torch.Tensor) -> tuple[Any, Any, int]:
    """What makes a live tensor the one the engine mapped: the object, its storage object
    (weakly held: a freed one reads as gone) and its address."""
    return weakref.ref(t), weakref.ref(t.untyped_storage()), t.data_ptr()


def _same(held: tuple[Any, Any, int], t: torch.Tensor) -> bool:
    obj, storage, ptr = held
    return obj() is t and storage() is t.untyped_storage() and t.data_ptr() == ptr


def _volatile_buffers(model: Any) -> set[str]:
    """Buffers the model itself swaps while generating: dynamic and long RoPE tables (transformers
    re-registers `inv_freq` by sequence length). Derived from the config, never from a version."""
    out = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        rope = getattr(mod, "rope_type", None)
        kinds = list(rope.values()) if isinstance(rope, dict) else [rope]
        if any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds):
            out.update(f"{mod_name}.{b}" if mod_name else b for b, _ in mod.named_buffers(recurse=False))
            out.update(
                f"{mod_name}.{k}_inv_freq" if mod_name else f"{k}_inv_freq"
                for k in (rope if isinstance(rope, dict) else {})
            )
    return out


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the live model, tied names included."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


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
            f"cannot map {len(problems)} checkpoint tensor(s) of {model_dir} onto the model's runtime layout: "
            f"{', '.join(problems[:5])}",
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


def _penalized(logits: torch.Tensor, prompt_ids: list[int], tokens: list[list[int]], penalty: float) -> torch.Tensor:
    """`logits` with each row's repetition penalty applied, as transformers and vLLM do: positive
    logits of tokens seen (prompt or completion) divided by `penalty`, negative ones multiplied."""
    logits = logits.clone()
    for i, row_tokens in enumerate(tokens):
        seen = torch.tensor(prompt_ids + row_tokens, dtype=torch.long, device=logits.device).unique()
        row = logits[i, seen]
        logits[i, seen] = torch.where(row > 0, row / penalty, row * penalty)
    return logits


class _Rows:
    """The `n` completions of one request while they are generated: each row's tokens, logprobs
    and top logprobs, and why it finished (a stop string cuts its text there)."""

    def __init__(self, n: int, params: SamplingParams, tokenizer: Any, eos: Any) -> None:
        self.params, self.tokenizer, self.eos = params, tokenizer, eos
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logps: list[list[float]] = [[] for _ in range(n)]
        self.tops: list[list[dict[int, float]]] = [[] for _ in range(n)]
        self.finish: list[FinishReason | None] = [None] * n
        self.stop_texts: list[str | None] = [None] * n  # text cut before a stop string
        self.stop_hit: list[str | None] = [None] * n  # the stop string that ended it (vLLM's stop_reason)

    def take(self, i: int, tok: int, raw_logp: torch.Tensor) -> None:
        """Row `i` takes its next token `tok` (nothing once it finished)."""
        params = self.params
        if self.finish[i] is not None:
            return
        self.tokens[i].append(tok)
        self.logps[i].append(float(raw_logp[i, tok]))
        if params.logprobs:  # the k most likely, most likely first
            vals, idx = raw_logp[i].topk(params.logprobs)
            self.tops[i].append(dict(zip(idx.tolist(), vals.tolist(), strict=True)))
        if tok in self.eos and not params.ignore_eos:
            self.finish[i] = "stop"
        elif params.stop:
            text = self.tokenizer.decode(self.tokens[i], skip_special_tokens=True)
            hits = [(p, s) for s in params.stop if (p := text.find(s)) >= 0]
            if hits:
                at, self.stop_hit[i] = min(hits, key=lambda h: h[0])
                self.finish[i], self.stop_texts[i] = "stop", text[:at]

    def completions(self, prompt_ids: list[int], cut: str | None) -> list[Completion]:
        """The finished rows (`cut`: why the batch was cut, its rows' stop reason)."""
        result = []
        for i, tokens in enumerate(self.tokens):
            reason: FinishReason = self.finish[i] or "length"
            text = self.stop_texts[i]
            if text is None:
                body = tokens[:-1] if reason == "stop" and tokens and tokens[-1] in self.eos else tokens
                text = self.tokenizer.decode(body, skip_special_tokens=True)
            result.append(Completion(i, text, list(prompt_ids), tokens, self.logps[i], reason, None,
                                     stop_reason=cut if reason == "abort" else self.stop_hit[i],
                                     top_logprobs=self.tops[i] if self.params.logprobs else None))
        return result
