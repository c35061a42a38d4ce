"""The part of a vLLM model's state an update did not send, checked before the version is reported.

Runs inside vLLM's worker, after a dense update's own read-back (`backend.py`), on a single rank.
Something in the process may have changed a tensor no update touched (an in-place `zero_()`, a
Parameter replaced on a module), and a check of only what was sent would then label the new
version over those bits. So every checkpoint tensor not sent is checked against the version
(`verify`: name -> [digest, dtype], the version's `tensor_digest` of it and its dtype):

- read from a parameter by the forward pass (norms, embeddings, biases, MoE experts, linears
  whose kernel multiplies with the parameter): read from the live module tree at check time
  (`readback.local_pair`: fused rows sliced, experts unpacked, vocab padding cut) and hashed;
  the digest must equal the version's. A copy held wider than the checkpoint (an fp32 bias of a
  bf16 model) is narrowed first, and must round-trip exactly;
- read through a packed CPU kernel (a copy the parameter no longer reaches): the module and its
  kernel object must be the very ones the last passing read-back of that layer verified
  (`remember`); the packed bytes themselves are not read again (that costs a prefill of the
  layer's input width; see docs/protocol.md). A layer not verified so since start fails;
- a tied LM head (no checkpoint tensor of its own) when the embedding was not sent: its packed
  kernel by identity as above, or, read from its parameter, its digest against the embedding's.

Returns one message per tensor that fails; the caller raises `EngineCheckError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sparsesync.codec import algo_of, tensor_digest
from sparsesync.integrations.vllm import readback
from sparsesync.integrations.vllm.layout import Layout, Location

Kernels = dict[str, tuple[torch.nn.Module, Any]]  # module name -> (module, its packed kernel) as last verified


def remember(model: torch.nn.Module, loc: Location, kernels: Kernels) -> None:
    """After a read-back of `loc` passed: its layer's packed kernel is the verified one."""
    try:
        mod = readback.module_of(model, loc)
    except KeyError:
        return
    remember_module(mod, loc.module, kernels)


def remember_module(mod: torch.nn.Module, name: str, kernels: Kernels) -> None:
    if hasattr(mod, "cpu_linear"):
        kernels[name] = (mod, mod.cpu_linear)


def _kernel_problem(mod: torch.nn.Module, name: str, what: str, kernels: Kernels) -> list[str]:
    held = kernels.get(name)
    if held is not None and held[0] is mod and held[1] is getattr(mod, "cpu_linear", None):
        return []
    return [f"{what}: the packed CPU kernel of '{name}' is not the one last read back and verified"]


def _as_checkpoint(got: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`got` in the checkpoint's dtype when that is exact (None: it is not)."""
    if got.dtype == dtype:
        return got
    narrow = got.to(dtype)
    return narrow if torch.equal(readback.bits(narrow.to(got.dtype)), readback.bits(got)) else None


def check(model: torch.nn.Module, layout: Layout, verify: Mapping[str, Any], kernels: Kernels) -> list[str]:
    """One message per tensor of `verify` the forward pass does not read as the version holds it."""
    problems: list[str] = []
    cache: dict[tuple[int, str, str], torch.Tensor] = {}
    located = sorted(((n, layout.locate(n)) for n in verify), key=lambda nl: (nl[1].module, nl[1].param))
    for name, loc in located:
        digest, dtype = verify[name][0], getattr(torch, str(verify[name][1]).removeprefix("torch."))
        if cache and next(iter(cache))[1:] != (loc.module, loc.param):
            cache.clear()
        try:
            mod = readback.module_of(model, loc)
            if readback.through_kernel(mod, loc):
                problems += _kernel_problem(mod, loc.module, f"tensor '{name}'", kernels)
                continue
            got, _ = readback.local_pair(model, loc, torch.empty(layout.shapes[name], device="meta"), 0, 1, cache)
        except (KeyError, RuntimeError, IndexError, ValueError, AttributeError) as e:
            problems.append(f"tensor '{name}': cannot read it back ({e})")
            continue
        held = _as_checkpoint(got.detach().to("cpu"), dtype)
        if (
            held is None
            or tuple(held.shape) != tuple(layout.shapes[name])
            or tensor_digest(held, algo_of(digest)) != digest
        ):
            problems.append(
                f"tensor '{name}': not sent by this update, and the engine's copy ({loc.module}.{loc.param}) "
                "differs from the version (changed since it was last verified)"
            )
    return problems + _tied_head(model, layout, verify, kernels)


def _tied_head(model: torch.nn.Module, layout: Layout, verify: Mapping[str, Any], kernels: Kernels) -> list[str]:
    head = getattr(model, "lm_head", None)
    embed = next((n for n in verify if n.endswith("embed_tokens.weight")), None)
    if head is None or not hasattr(head, "weight") or "lm_head.weight" in layout.shapes or embed is None:
        return []
    loc = Location("lm_head", "weight", "vocab")
    try:
        if readback.through_kernel(head, loc):
            return _kernel_problem(head, "lm_head", "tied LM head", kernels)
        got, _ = readback.local_pair(model, loc, torch.empty(layout.shapes[embed], device="meta"), 0, 1)
    except (KeyError, RuntimeError, IndexError, ValueError, AttributeError) as e:
        return [f"tied LM head: cannot read it back ({e})"]
    held = _as_checkpoint(got.detach().to("cpu"), got.dtype)
    if held is None or tensor_digest(held, algo_of(verify[embed][0])) != verify[embed][0]:
        return [f"tied LM head: differs from '{embed}' (changed since it was last verified)"]
    return []
