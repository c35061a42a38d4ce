"""Read a vLLM model's weights back, in checkpoint coordinates, from what its forward pass reads.

Runs inside vLLM's worker. Digests of a CPU copy prove nothing about the engine: on CPU vLLM
repacks linear weights into opaque kernel handles (oneDNN, sgl) and MoE experts into a
kernel layout, and a tied LM head is packed apart from the embedding it ties to. So:

- a linear layer whose CPU kernel (`cpu_linear`) holds a packed copy (oneDNN, sgl) is read by
  calling that kernel on an identity matrix: `cpu_linear(I_K) = W^T`, exact in bf16 (one
  product per output element, accumulated in fp32), so it returns the very values the forward
  pass multiplies with. Cost: like a prefill of K tokens through that layer, once per fused
  layer. A kernel that multiplies with the parameter it is handed (vLLM's F.linear fallback,
  detected with a one-row probe) is read from the parameter;
- CPU-prepacked MoE experts are unpacked with the permutation of vLLM's own prepack op
  (derived once per shape by packing position digits; checked to be a permutation);
- everything else (embeddings, norms, GPU weights) is the parameter itself.

`check(model, layout, expected)` compares every element of every expected tensor with the
engine's by bit pattern (both viewed as integers of their width; an engine copy held wider than
the checkpoint, e.g. an fp32 bias of a bf16 model, is compared with the checkpoint's values
widened, which is exact), so -0.0 differs from 0.0 and every NaN payload and subnormal counts.
One exception, only for a layer read through its packed CPU kernel (the identity product):
a product cannot show the sign of a zero nor a subnormal the kernel flushes (nor can the
forward pass, which computes through the same kernel), so there -0.0, +0.0 and subnormals all
compare as +0.0 on both sides, every other bit pattern exactly. It returns one message per
mismatching tensor. Tensor parallelism: each rank compares its own shard. Memory: one parameter's read at a time (a
probed layer's W is written block by block into one tensor) and comparisons in blocks of `_COMPARE_ELEMS` elements,
never a whole-model or whole-tensor float temporary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from sparsesync.integrations.vllm.layout import Layout, Location
from sparsesync.protocol.follower.mirror import pager, release_freed_memory

# a vLLM layer or model: what its kernels set at run time (cpu_linear, w13_weight, num_heads, load_weights, ...)
# is not declared on nn.Module, so it is read as Any
Layer = Any

_PROBE_ROWS = 1024  # identity rows per kernel call (bounds the probe's memory)
_COMPARE_ELEMS = 1 << 18  # elements compared at once (bounds the comparison's float temporaries)
_PERMS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def module_of(model: torch.nn.Module, loc: Location) -> Layer:
    try:
        mod = model.get_submodule(loc.module)
    except AttributeError as e:
        raise KeyError(f"vLLM model has no module '{loc.module}'") from e
    for child in mod.modules():  # itself first; MoE: the params sit on a child (`experts.routed_experts`)
        if loc.param in dict(child.named_parameters(recurse=False)):
            return child
    raise KeyError(f"vLLM module '{loc.module}' has no parameter '{loc.param}'")


def _probe(mod: Layer, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """W [N, K] as the layer's CPU kernel computes with it, written block by block into one
    tensor (memory: W once, plus one block of identity rows and its product)."""
    w: torch.Tensor | None = None
    for start in range(0, k, _PROBE_ROWS):
        eye = torch.zeros(min(_PROBE_ROWS, k - start), k, dtype=dtype, device=device)
        eye[:, start : start + eye.shape[0]].fill_diagonal_(1)
        out = mod.cpu_linear(eye, mod.weight, None)
        if w is None:
            w = torch.empty(out.shape[1], k, dtype=dtype, device=device)
        w[:, start : start + eye.shape[0]] = out.t()
        del eye, out
    assert w is not None
    return w


def cpu_experts(mod: torch.nn.Module) -> Any:
    """The CPU experts implementation that prepacked `mod`'s weights (None: not prepacked)."""
    seen: set[int] = set()
    stack = [getattr(mod, "quant_method", None)]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen or len(seen) > 64:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, "isa", None), str) and hasattr(obj, "_use_zentorch"):
            return None if obj._use_zentorch else obj
        for attr in ("moe_kernel", "impl", "fused_experts", "experts", "kernel"):
            stack.append(getattr(obj, attr, None))
    return None


def _prepack_perm(shape: tuple[int, ...], isa: str) -> torch.Tensor:
    """src[j]: the logical flat index that vLLM's MoE prepack puts at packed position j."""
    key = (shape, isa)
    if key not in _PERMS:
        n = math.prod(shape)
        pos = torch.arange(n, dtype=torch.int64)
        src = torch.zeros(n, dtype=torch.int64)
        for k in range(max(1, math.ceil(math.log(max(n, 2), 256)))):
            digits = ((pos >> (8 * k)) & 255).to(torch.bfloat16).view(shape)  # 0..255: exact in bf16
            out = torch.empty_like(digits)
            torch.ops._C.prepack_moe_weight(digits, out, isa)
            src += out.reshape(-1).to(torch.int64) << (8 * k)
        if not torch.equal(torch.sort(src).values, pos):
            raise RuntimeError(
                f"vLLM's MoE prepack ({isa}) of shape {list(shape)} is not a permutation: cannot read it back"
            )
        _PERMS[key] = src
    return _PERMS[key]


def _kernel_reads_parameter(mod: Layer, p: torch.Tensor) -> bool:
    """Whether the layer's CPU kernel multiplies with the parameter it is handed (vLLM's
    F.linear fallback) rather than a packed copy: a zero weight handed in then gives zeros."""
    if p.numel() == 0 or p.dim() != 2:
        return False
    x = torch.ones(1, p.shape[1], dtype=p.dtype, device=p.device)
    return not bool(mod.cpu_linear(x, torch.zeros_like(p), None).any())


def as_read(
    mod: torch.nn.Module, loc: Location, cache: dict[tuple[int, str, str], torch.Tensor] | None = None
) -> torch.Tensor:
    """The parameter as the forward pass reads it, in vLLM's (unpacked) layout. `cache` keeps
    one read per parameter across the checkpoint tensors fused into it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    key = (id(mod), loc.module, loc.param)
    if cache is not None and key in cache:
        return cache[key]
    value = _as_read(mod, loc, ParallelLMHead)
    if cache is not None:
        cache[key] = value
    return value


def _as_read(mod: torch.nn.Module, loc: Location, head_cls: type) -> torch.Tensor:
    p = getattr(mod, loc.param)
    if loc.param == "weight" and hasattr(mod, "cpu_linear") and (isinstance(mod, head_cls) or not _is_embedding(mod)):
        if _kernel_reads_parameter(mod, p):
            return p.detach()
        return _probe(mod, _input_size(mod, p), p.dtype, p.device)
    if loc.kind in ("expert_w13", "expert_w2"):
        impl = cpu_experts(mod)
        if impl is not None:
            src = _prepack_perm(tuple(p.shape), impl.isa)
            flat = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            flat[src] = p.detach().reshape(-1)
            return flat.view(p.shape)
    return p.detach()


def _input_size(mod: torch.nn.Module, p: torch.Tensor) -> int:
    """K of a packed linear (the rank's input features). Column/row-parallel layers say
    `input_size_per_partition`; a replicated one (a MoE router, `GateLinear`) only `input_size`;
    the packed parameter itself is empty, so its shape says nothing."""
    for attr in ("input_size_per_partition", "input_size", "embedding_dim"):
        k = int(getattr(mod, attr, 0) or 0)
        if k > 0:
            return k
    if p.dim() == 2 and p.shape[-1] > 0:
        return int(p.shape[-1])
    raise RuntimeError(f"{type(mod).__name__}: packed by its CPU kernel and its input size is unknown")


def _is_embedding(mod: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return isinstance(mod, VocabParallelEmbedding)


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t if size == 1 else t.chunk(size, dim=dim)[rank]


def _local_expected(mod: torch.nn.Module, loc: Location, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The rank's shard of a full checkpoint tensor (identity without tensor parallelism)."""
    if size == 1:
        return t
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    if isinstance(mod, QKVParallelLinear) and loc.part > 0:  # k/v heads may be replicated across ranks
        replicas = int(getattr(mod, "num_kv_head_replicas", 1) or 1)
        return _chunk(t, 0, rank // replicas, size // replicas)
    if isinstance(mod, ColumnParallelLinear):
        return _chunk(t, 0, rank, size) if t.dim() >= 1 else t
    if isinstance(mod, RowParallelLinear):
        return _chunk(t, 1, rank, size) if t.dim() == 2 else t
    if loc.kind == "expert_w13":
        return _chunk(t, 0, rank, size)
    if loc.kind == "expert_w2":
        return _chunk(t, 1, rank, size)
    return t  # replicated (norms, router); vocab shards are cut in `_actual`


def local_pair(
    model: torch.nn.Module,
    loc: Location,
    expected: torch.Tensor,
    rank: int,
    size: int,
    cache: dict[tuple[int, str, str], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine value, expected value), both in the rank's checkpoint coordinates."""
    mod = module_of(model, loc)
    full = as_read(mod, loc, cache)
    exp = _local_expected(mod, loc, expected, rank, size)
    if loc.kind == "vocab":
        start = int(getattr(getattr(mod, "shard_indices", None), "org_vocab_start_index", 0) or 0)
        end = int(
            getattr(getattr(mod, "shard_indices", None), "org_vocab_end_index", expected.shape[0]) or expected.shape[0]
        )
        return full[: end - start], expected[start:end]
    if loc.kind == "fused":
        rows = exp.shape[0]
        row0 = loc.row0 // size if size > 1 else loc.row0
        if size > 1 and loc.part > 0 and hasattr(mod, "num_heads"):  # QKV: offsets of the local q (and k) heads
            q = mod.num_heads * mod.head_size
            row0 = q + (loc.part - 1) * mod.num_kv_heads * mod.head_size
        return full[row0 : row0 + rows], exp
    if loc.kind == "expert_w13":
        e = full[loc.expert]
        rows = exp.shape[0]
        start = 0 if loc.part == 0 else e.shape[0] // 2  # up rows start after the (padded) gate rows
        return e[start : start + rows], exp
    if loc.kind == "expert_w2":
        return full[loc.expert][:, : exp.shape[1]], exp
    return full, exp


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor, *, through_kernel: bool = False) -> torch.Tensor:
    """`t`'s bit patterns as integers of its width (`through_kernel`: -0.0 and subnormals as +0.0
    first, see the module docstring)."""
    if through_kernel and t.is_floating_point():
        t = torch.where(t.abs() < torch.finfo(t.dtype).tiny, torch.zeros_like(t), t)  # -0.0 < tiny too
    t = t.contiguous()
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def same_width(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """`want` in `got`'s dtype when `got` is a wider float (exact); else `want` as it is (a
    narrower or other dtype then differs, loudly)."""
    if (
        got.dtype != want.dtype
        and got.is_floating_point()
        and want.is_floating_point()
        and got.element_size() > want.element_size()
    ):
        return want.to(got.dtype)
    return want


def count_differing(got: torch.Tensor, want: torch.Tensor, *, through_kernel: bool = False) -> int:
    """Elements of two same-shape CPU tensors whose bit patterns differ (`bits`), compared a
    block of dim-0 rows (about `_COMPARE_ELEMS` elements) at a time: temporaries of a whole tensor
    at once were several times its bytes, for the largest tensor of the model. Tensors of
    different dtypes (after `same_width`) differ everywhere."""
    want = same_width(got, want)
    if got.dtype != want.dtype:
        return got.numel()

    def diff(g: torch.Tensor, w: torch.Tensor) -> int:
        return int((bits(g, through_kernel=through_kernel) != bits(w, through_kernel=through_kernel)).sum())

    if got.dim() == 0 or got.numel() == 0:
        return diff(got, want)
    step = max(1, _COMPARE_ELEMS // max(1, got[0].numel()))
    return sum(diff(got[s : s + step], want[s : s + step]) for s in range(0, got.shape[0], step))


def through_kernel(mod: torch.nn.Module, loc: Location) -> bool:
    """Whether `as_read` reads `loc` through the layer's packed CPU kernel (not its parameter)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    p = getattr(mod, loc.param)
    return (
        loc.param == "weight"
        and hasattr(mod, "cpu_linear")
        and (isinstance(mod, ParallelLMHead) or not _is_embedding(mod))
        and not _kernel_reads_parameter(mod, p)
    )


def check(
    model: torch.nn.Module, layout: Layout, expected: Mapping[str, torch.Tensor], *, rank: int = 0, size: int = 1
) -> list[str]:
    """One message per tensor of `expected` (checkpoint names) the engine does not compute with."""
    problems = []
    cache: dict[tuple[int, str, str], torch.Tensor] = {}
    # grouped by the parameter they are read from, so the cache holds one parameter's read at a
    # time (a read of every parameter at once is another copy of the model)
    located = sorted(((name, layout.locate(name)) for name in expected), key=lambda nl: (nl[1].module, nl[1].param))
    drop = pager(expected.values())  # what was read of the follower's mirror leaves RSS once compared
    done: list[torch.Tensor] = []
    for name, loc in located:
        want = expected[name]
        if cache and next(iter(cache))[1:] != (loc.module, loc.param):
            cache.clear()
            release_freed_memory()  # the last parameter's read and probe blocks, back to the OS
            for t in done:
                drop(t)
            done.clear()
        done.append(want)
        try:
            got, exp = local_pair(model, loc, want.to(torch.device("cpu")), rank, size, cache)
        # a layout this read-back does not know: loud, named
        except (KeyError, RuntimeError, IndexError, ValueError) as e:
            problems.append(f"tensor '{name}': cannot read it back ({e})")
            continue
        got = got.to("cpu")
        if tuple(got.shape) != tuple(exp.shape):
            problems.append(f"tensor '{name}': engine holds shape {list(got.shape)}, expected {list(exp.shape)}")
            continue
        if n := count_differing(got, exp, through_kernel=through_kernel(module_of(model, loc), loc)):
            problems.append(
                f"tensor '{name}': {n} of {exp.numel()} elements differ from the version ({loc.module}.{loc.param})"
            )
    return problems


def check_tied_head(model: torch.nn.Module, embed: torch.Tensor, *, rank: int = 0, size: int = 1) -> list[str]:
    """For a tied model: the LM head the logits use equals the embedding `embed`."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "weight"):
        return []
    loc = Location("lm_head", "weight", "vocab")
    got, exp = local_pair(model, loc, embed.to("cpu"), rank, size)
    if n := count_differing(got.to("cpu"), exp, through_kernel=through_kernel(head, loc)):
        return [f"tied LM head: {n} of {exp.numel()} elements differ from 'model.embed_tokens.weight'"]
    return []
