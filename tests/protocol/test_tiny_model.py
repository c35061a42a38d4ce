"""The tiny test model: deterministic per seed, and transformers loads and runs it."""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("transformers", reason="the tiny model needs transformers (pip install -e '.[embedded]')")

import torch  # noqa: E402

from sparsesync.tiny_model import build_tiny_model  # noqa: E402


def _hashes(d):  # type: ignore[no-untyped-def]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_tiny_model_is_deterministic_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert _hashes(a) == _hashes(b)
    assert _hashes(a)["model.safetensors"] != _hashes(c)["model.safetensors"]

    tok = AutoTokenizer.from_pretrained(a)
    model = AutoModelForCausalLM.from_pretrained(a)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        128,
        2,
        4,
        2,
        32,
    )
    assert cfg.tie_word_embeddings is False and cfg.vocab_size == len(tok) == 512
    assert model.dtype == torch.bfloat16
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() != sd["model.embed_tokens.weight"].data_ptr()

    text = "Repeat the letter x: x x x 0123"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: round-trips
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
