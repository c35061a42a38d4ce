"""The tensor digest "xxh3b" in torch operations, on whatever device the tensor is on.

The same definition as `blocks_digest` (docs/format.md, "Digests"), computed without a host
copy of the tensor: XXH3-64's long-input path over each 65536-byte block written as int64
tensor arithmetic (wrapping adds and multiplies, shifts masked to be logical). Inside one
block, the 16 stripes between two scrambles only add into the accumulators, so every stripe of
every block is computed at once and summed; the 63 scrambles are applied to all blocks
together. Only the block digests (8 bytes per 64 KiB) come to the host, where the final
XXH3-64 over them and the length is taken, as `blocks_digest.combine` takes it.

Guarantee: `tensor_digest_torch(t)` == `digest.tensor_digest(t, "xxh3b")` for every dtype, shape,
bit pattern (NaN payloads, -0.0, subnormals) and layout (non-contiguous views are read in C
order), on CPU and CUDA; tests/codec/test_blocks_digest.py compares them over those cases.
Temporaries: about 4x the bytes of `chunk_blocks` blocks at a time.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from sparsesync.codec.blocks_digest import BLOCK, combine, n_blocks

_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d3165526 29d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e".replace(" ", "")
)
_M32 = 0xFFFFFFFF


def _s64(x: int) -> int:
    """A u64 constant as the int64 with the same bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _key(off: int, n: int = 8) -> list[int]:
    return [_s64(int.from_bytes(_SECRET[off + 8 * i : off + 8 * i + 8], "little")) for i in range(n)]


_P32_1 = 0x9E3779B1
_P64_1 = 0x9E3779B185EBCA87
_ACC0 = [_s64(x) for x in (0xC2B2AE3D, _P64_1, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x85EBCA77,
                           0x27D4EB2F165667C5, _P32_1)]
_STRIPE_KEYS = [_key(8 * s) for s in range(16)]  # stripe s of a 1024-byte round reads the secret from 8 * s
_LAST_KEY = _key(121)  # the block's last stripe
_SCRAMBLE_KEY = _key(128)
_MERGE_KEY = _key(11)
_SWAP = [i ^ 1 for i in range(8)]  # lane i's data adds into accumulator i ^ 1


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mul_lohi(x: torch.Tensor) -> torch.Tensor:
    """(x mod 2^32) * (x >> 32), as u64 bits."""
    return (x & _M32) * _shr(x, 32)


def _fold(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Low ^ high 64 bits of the 128-bit product a * b (u64 bits), from 32-bit halves."""
    a0, a1, b0, b1 = a & _M32, _shr(a, 32), b & _M32, _shr(b, 32)
    lo_lo, hi_lo, lo_hi, hi_hi = a0 * b0, a1 * b0, a0 * b1, a1 * b1
    cross = _shr(lo_lo, 32) + (hi_lo & _M32) + lo_hi
    upper = _shr(hi_lo, 32) + _shr(cross, 32) + hi_hi
    lower = (cross & _M32) * (1 << 32) | (lo_lo & _M32)
    return lower ^ upper


@functools.lru_cache(maxsize=8)
def _constants(dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The secret's keys, the lane swap and the initial accumulators as tensors on `dev`, made
    once per device: building them per call is a host->device copy that waits for the device."""

    def i64(x: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=dev)

    return i64(_STRIPE_KEYS), i64(_SWAP), i64(_LAST_KEY), i64(_ACC0), i64(_SCRAMBLE_KEY), i64(_MERGE_KEY)


def _blocks(words: torch.Tensor) -> torch.Tensor:
    """XXH3-64 of each block: `words` int64 (k, 64, 16, 8) (block, round, stripe, lane) ->
    int64 (k,) with the digests' bits."""
    keys, swap, last_key, acc0, scr, mk = _constants(words.device)
    contrib = _mul_lohi(words ^ keys) + words[..., swap]  # (k, 64, 16, 8): what each stripe adds
    per_round = contrib[:, :63].sum(dim=2)  # rounds 0..62: all 16 stripes (int64 sums wrap, as u64 adds do)
    last = words[:, 63, 15]
    final = (
        contrib[:, 63, :15].sum(dim=1)
        + _mul_lohi(last ^ last_key)
        + last[:, swap]
    )
    acc = acc0.expand(words.shape[0], 8).clone()
    for r in range(63):
        acc += per_round[:, r]
        acc = ((acc ^ _shr(acc, 47)) ^ scr) * _P32_1
    acc += final
    mixed = acc ^ mk
    h = _fold(mixed[:, 0::2], mixed[:, 1::2]).sum(dim=1) + _s64(BLOCK * _P64_1)
    h = h ^ _shr(h, 37)
    h = h * _s64(0x165667919E3779F9)
    return h ^ _shr(h, 32)


def block_digests_torch(t: torch.Tensor, chunk_blocks: int = 256) -> torch.Tensor:
    """XXH3-64 of each 65536-byte block of `t`'s bytes (the last zero-padded), as int64 on
    `t`'s device (the bits of the uint64 digests)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    full = n // BLOCK
    out = torch.empty(n_blocks(n), dtype=torch.int64, device=flat.device)
    body = flat[: full * BLOCK]
    if full and body.data_ptr() % 8:  # a view at an odd byte offset: int64 needs aligned storage
        body = body.clone()
    for lo in range(0, full, chunk_blocks):
        hi = min(full, lo + chunk_blocks)
        out[lo:hi] = _blocks(body[lo * BLOCK : hi * BLOCK].view(torch.int64).view(hi - lo, 64, 16, 8))
    if n % BLOCK:
        pad = torch.zeros(BLOCK, dtype=torch.uint8, device=flat.device)
        pad[: n - full * BLOCK] = flat[full * BLOCK :]
        out[full:] = _blocks(pad.view(torch.int64).view(1, 64, 16, 8))
    return out


def tensor_digest_torch(t: torch.Tensor, chunk_blocks: int = 256) -> str:
    """The "xxh3b" digest of `t` computed on its own device (one copy of 8 bytes per block to
    the host)."""
    nbytes = t.numel() * t.element_size()
    return combine(block_digests_torch(t, chunk_blocks).cpu().numpy().view(np.uint64), nbytes)
