"""Which implementation computes the "xxh3b" block digests of a tensor on its own device.

CUDA tensors: the Triton kernel (`blocks_triton`) where triton imports (torch's CUDA builds bring
it), else torch operations (`blocks_torch`); any other non-CPU device: torch operations. triton
is imported on the first CUDA tensor only, so a CPU-only process never loads it. If the kernel
fails on its first use in a process (triton finds no C compiler for its launcher, or does not
support the GPU), torch operations give that digest and every later one, with a warning; once the
kernel has run, its failures are raised.

Guarantee: the same bits whichever implementation runs (they are bit-identical to the C codec:
tests/codec/test_blocks_digest.py and test_blocks_triton.py compare them); only the block digests,
8 bytes per 64 KiB, come back to the host for `tensor_digest_device`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from sparsesync.codec.blocks_digest import combine
from sparsesync.codec.blocks_torch import block_digests_torch

log = logging.getLogger(__name__)

BlockDigests = Callable[[torch.Tensor], torch.Tensor]
_cuda_impl: BlockDigests | None = None  # chosen on the first CUDA tensor
_cuda_impl_ran = False  # it has given block digests in this process


def cuda_impl() -> BlockDigests:
    """The block-digest function CUDA tensors get: `blocks_triton.block_digests_triton` where
    triton imports, else `blocks_torch.block_digests_torch` (imported here, on first use)."""
    global _cuda_impl
    if _cuda_impl is None:
        try:
            from sparsesync.codec.blocks_triton import block_digests_triton

            _cuda_impl = block_digests_triton
        except ImportError:
            _cuda_impl = block_digests_torch
    return _cuda_impl


def block_digests_device(t: torch.Tensor, torch_chunk_blocks: int = 256) -> torch.Tensor:
    """XXH3-64 of each 64 KiB block of `t`'s bytes (the last zero-padded), int64 on `t`'s device
    (a non-CPU device; a CPU tensor is hashed by torch operations too, as in tests).
    `torch_chunk_blocks`: blocks per call where torch operations run."""
    if t.device.type != "cuda":
        return block_digests_torch(t, torch_chunk_blocks)
    return _first_use_falls_back(cuda_impl(), t, torch_chunk_blocks)


def _first_use_falls_back(impl: BlockDigests, t: torch.Tensor, torch_chunk_blocks: int) -> torch.Tensor:
    """`impl(t)`; on the Triton kernel's first failure in this process, torch operations."""
    global _cuda_impl, _cuda_impl_ran
    if impl is block_digests_torch:
        return block_digests_torch(t, torch_chunk_blocks)
    if _cuda_impl_ran:
        return impl(t)
    try:
        out = impl(t)
    except Exception as e:  # noqa: BLE001 - it could not compile or launch: the same digests by torch
        log.warning("xxh3b: the Triton kernel failed on its first use (%s: %s); hashing CUDA tensors with "
                    "torch operations instead (the same digests, slower)", type(e).__name__, e)
        _cuda_impl = block_digests_torch
        return block_digests_torch(t, torch_chunk_blocks)
    _cuda_impl_ran = True
    return out


def tensor_digest_device(t: torch.Tensor) -> str:
    """The "xxh3b" digest of a non-CPU tensor, computed on its device (`block_digests_device`;
    one device->host copy of 8 bytes per block)."""
    nbytes = t.numel() * t.element_size()
    return combine(block_digests_device(t).cpu().numpy().view(np.uint64), nbytes)
