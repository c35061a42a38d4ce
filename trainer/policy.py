"""The policy model the trainer trains and publishes: where it runs, in which precision, what
replicas receive.

Guarantee: `publish_state` is the exact `dtype` cast of the model's tensors (every state-dict
tensor; a PEFT model: every adapter tensor), and what `load_policy` returns is the model as
loaded, so a replica started from the same folder already holds version 0 bit for bit. Used by
the training loop (`train.py`) and the LoRA set-up (`lora.py`); imports neither.
"""

from __future__ import annotations

import torch

from sparsesync.checkpoint import map_tied
from sparsesync.errors import ConfigError
from trainer.config import TrainerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_precision(cfg: TrainerConfig) -> tuple[torch.device, torch.dtype, torch.dtype]:
    """(device, master dtype, publish dtype) for this machine."""
    m = cfg.model
    if m.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[model] device = 'cuda' but no CUDA device is visible", hint="set device = 'auto' or 'cpu'")
    device = torch.device("cuda" if m.device == "cuda" or (m.device == "auto" and torch.cuda.is_available()) else "cpu")
    if m.master_dtype == "auto":
        master = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        master = _DTYPES[m.master_dtype]
    return device, master, _DTYPES[m.publish_dtype]


def load_policy(cfg: TrainerConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model from a local folder or the Hub, in `dtype` on `device`, in train mode."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype, revision=cfg.model.revision)
    except OSError as e:
        raise ConfigError(f"[model] path = {cfg.model.path!r}: cannot load a model from it ({e})",
                          hint="pass a folder with config.json + safetensors, or a Hub model id (needs network)") from e
    model.to(device)
    model.train()
    return model


def publish_state(model: torch.nn.Module, dtype: torch.dtype, *, cast: bool = True) -> dict[str, torch.Tensor]:
    """The weights replicas receive: every state-dict tensor (a PEFT model: every adapter tensor)
    cast to `dtype`, contiguous, on CPU; names tied to one tensor (a tied LM head) stay one
    tensor, which the publisher sends once. `cast=False` (only where `publisher_casts`): the
    model's own tensors, for a `Publisher(dtype=dtype)` that casts them one at a time (no cast
    copy of the whole model; the same bytes)."""
    from sparsesync.lora.bridge import adapter_tensors, is_peft_model

    if not cast:
        return model.state_dict()  # tied names share one tensor: the publisher keeps it once
    state = adapter_tensors(model) if is_peft_model(model) else model.state_dict()
    return map_tied(state, lambda t: t.detach().to(dtype=dtype).contiguous().cpu())


def publisher_casts(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the publisher can cast `model`'s weights to `dtype` itself (`Publisher(dtype=...)`,
    `publish_state(cast=False)`): full weights (not a PEFT adapter) of floating tensors only, on
    the CPU, in another dtype than `dtype` (an fp32 master published as bf16)."""
    from sparsesync.lora.bridge import is_peft_model

    if is_peft_model(model):
        return False
    tensors = list(model.state_dict().values())
    return (all(t.is_floating_point() and t.device.type == "cpu" for t in tensors)
            and any(t.dtype != dtype for t in tensors))
