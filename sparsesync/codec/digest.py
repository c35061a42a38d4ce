"""Digests of tensor bytes: xxh3_64 over the raw C-contiguous little-endian bytes.

Guarantee: two tensors of the same dtype and shape have the same `tensor_digest` iff (up to
xxh3_64 collisions, ~2^-64 per pair) their bit patterns are identical. NaN payloads, -0.0 and
every other bit pattern count. The digest is for integrity (truncation, corruption, applying a
patch to the wrong base), not authentication: anyone can forge it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import torch
import xxhash

from sparsesync.codec import _parallel

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("sparsesync.codec needs a little-endian host")

_HASH_CHUNK = 64 << 20  # bytes hashed per update, bounds the host copy of a CUDA tensor


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy for a contiguous CPU tensor)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3_64 hex digest of `t`'s raw bytes (a CUDA tensor is copied to host in 64 MiB pieces)."""
    h = xxhash.xxh3_64()
    flat = _byte_view(t)
    if flat.device.type == "cpu":
        h.update(memoryview(flat.numpy()))
    else:
        for start in range(0, flat.numel(), _HASH_CHUNK):
            h.update(memoryview(flat[start : start + _HASH_CHUNK].cpu().numpy()))
    return h.hexdigest()


def tensor_digests(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """`tensor_digest` of every tensor in `state`, by name (hashed in parallel on the codec's
    "tensors" pool: do not call it from a task of that pool)."""
    names = list(state)
    return dict(zip(names, _parallel.map_ordered(lambda n: tensor_digest(state[n]), names)))


def state_digest(digests: Mapping[str, str]) -> str:
    """One digest identifying a whole version: xxh3_64 over the sorted `name\\0digest\\n` lines."""
    h = xxhash.xxh3_64()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return h.hexdigest()
