"""Tiny models of the architectures people train, built locally for tests, demos and benchmarks.

Guarantee: `build_tiny_model(out_dir, seed=s, arch=a)` writes the same bytes for the same seed
and architecture (tokenizer and weights), in a folder that both transformers
(`AutoModelForCausalLM.from_pretrained`) and vLLM (`LLM(model=out_dir)`) load, saved the way
`save_pretrained` saves it (the checkpoint's own key set: a tied LM head is not written,
MoE experts are written one tensor per expert). The architectures (`ARCHS`):

- "qwen3": Qwen3, untied embeddings (the default, and the project's first test model);
- "qwen3-tied": Qwen3 with tied embeddings (Qwen3-0.6B to 4B, Llama-3.2 and Gemma are tied);
- "llama": a Llama-style model (no q/k norms), untied;
- "qwen3-moe": Qwen3-MoE with 4 experts, top-2 routing, in every layer;
- "qwen3-moe-8e": Qwen3-MoE with 8 experts, top-2, `norm_topk_prob` false, in every layer;
- "qwen3-moe-mixed": Qwen3-MoE with 6 experts, top-3, `norm_topk_prob` true, and dense MLP layers
  beside the sparse ones (`decoder_sparse_step` 2 and `mlp_only_layers`): 4 layers, only layer 1
  sparse.

All share hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32 (a head size vLLM's CPU build
accepts). `hidden`/`layers` make bigger models of the same shape for benchmarks. The tokenizer
is a byte-level BPE trained on a small built-in corpus, so any text round-trips.

    python -m sparsesync.tiny_model /tmp/tiny [SEED] [ARCH]   # builds it from the command line
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Lowercase letters, digits, prompt phrases and a few sentences (deterministic)."""
    lines = []
    for c in string.ascii_lowercase:
        lines.append(f"Repeat the letter {c}: " + " ".join([c] * 8))
        lines.append(f"Repeat the letter {c}: " + c * 8)
    for d in string.digits:
        lines.append(f"Count to {d}: " + " ".join(string.digits[: int(d) + 1]))
    lines += [
        "The quick brown fox jumps over the lazy dog.",
        "Answer the question. What is two plus two? Four.",
        "Write a word that starts with the letter a: apple.",
        "Guess the word. The secret word has five letters.",
        "user: hello assistant: hello, how can I help you today?",
        "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "Repeat after me: the weights follow the bucket.",
    ]
    return lines * 4


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def tiny_config(vocab_size: int = VOCAB_SIZE, eos_token_id: int = 0, **overrides: Any) -> Any:
    """The Qwen3 config of the tiny model (hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32)."""
    from transformers import Qwen3Config

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


ARCHS = ("qwen3", "qwen3-tied", "llama", "qwen3-moe", "qwen3-moe-8e", "qwen3-moe-mixed")
# per MoE architecture: (experts, experts per token, norm_topk_prob, decoder_sparse_step, extra dense layers)
_MOE = {"qwen3-moe": (4, 2, True, 1, 0), "qwen3-moe-8e": (8, 2, False, 1, 0), "qwen3-moe-mixed": (6, 3, True, 2, 2)}


def arch_config(
    arch: str, vocab_size: int = VOCAB_SIZE, eos_token_id: int = 0, *, hidden: int = 128, layers: int = 2
) -> Any:
    """The config of one architecture of the matrix (see module docstring)."""
    if arch not in ARCHS:
        raise ValueError(f"tiny model architecture {arch!r}: expected one of {', '.join(ARCHS)}")
    size: dict[str, Any] = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64))
    if arch == "qwen3":
        return tiny_config(vocab_size, eos_token_id, **size)
    if arch == "qwen3-tied":
        return tiny_config(vocab_size, eos_token_id, tie_word_embeddings=True, **size)
    # one dict of keywords, as `tiny_config`: transformers' configs take rope_theta through **kwargs
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, **size)
    from transformers import Qwen3MoeConfig

    experts, top_k, norm, step, extra = _MOE[arch]
    size["num_hidden_layers"] = layers + extra
    # the last layer: dense by mlp_only_layers (the even ones by the step)
    dense = [layers + extra - 1] if extra else []
    moe: dict[str, Any] = dict(moe_intermediate_size=hidden // 2, num_experts=experts, num_experts_per_tok=top_k,
                               decoder_sparse_step=step, mlp_only_layers=dense, norm_topk_prob=norm)
    return Qwen3MoeConfig(**common, **moe, **size)


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    arch: str = "qwen3",
    hidden: int = 128,
    layers: int = 2,
) -> Path:
    """Train the tokenizer, init a tiny model of `arch` with `seed`, save both to `out_dir`; returns it."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = _train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    eos_id = raw.token_to_id("<|endoftext|>")
    config = arch_config(arch, raw.get_vocab_size(), eos_id, hidden=hidden, layers=layers)
    config.dtype = dtype
    torch.manual_seed(seed)  # the only source of randomness in init: same seed, same weights
    gen_state = torch.random.get_rng_state()
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # explicit init: independent of transformers' init order
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    finally:
        torch.random.set_rng_state(gen_state)
    model = model.to(dtype)
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _strip_nondeterminism(out)
    return out


def _strip_nondeterminism(out: Path) -> None:
    """Keep the written files byte-identical across runs (transformers writes its version)."""
    for name in ("config.json", "generation_config.json"):
        p = out / name
        if p.exists():
            d = json.loads(p.read_text())
            d.pop("transformers_version", None)
            p.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    argv = sys.argv[1:]
    print(
        build_tiny_model(
            argv[0] if argv else "tiny-model",
            seed=int(argv[1]) if len(argv) > 1 else 0,
            arch=argv[2] if len(argv) > 2 else "qwen3",
        )
    )
