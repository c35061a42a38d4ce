"""The tensor digest "xxh3b" as one Triton kernel: every 64 KiB block hashed in one pass.

The same definition as `blocks_digest` (docs/format.md, "Digests"): XXH3-64's long-input path
over each 65536-byte block (the last one zero-padded), in 64-bit lanes. One program hashes one
block: it reads `ROUNDS` rounds of 1024 bytes at a time (16 stripes of 8 lanes), adds each
round's 16 stripes into per-round sums (inside a round the stripes only add into the
accumulators), then folds those sums into the 8 accumulators round by round with XXH3's scramble
between rounds; the last round's final stripe (the block's last 64 bytes, with the secret at
offset 121) and the merge and avalanche follow XXH3 exactly. The tensor's bytes are read once;
only the block digests (8 bytes per 64 KiB) come back to the host, where `blocks_digest.combine`
takes the final XXH3-64 over them and the length.

Guarantee: `tensor_digest_triton(t)` == `digest.tensor_digest(t, "xxh3b")` (the C codec) for
every dtype, shape, bit pattern and layout (non-contiguous views are read in C order);
tests/codec/test_blocks_triton.py checks it under Triton's CPU interpreter (TRITON_INTERPRET=1).
Index arithmetic: one launch covers at most `_MAX_LAUNCH_BLOCKS` blocks, so every offset inside
the kernel stays below 2^31 words even in 32-bit arithmetic, and the block offset is widened to
64 bits before it is scaled; larger tensors are cut into launches by torch slicing (64-bit).
Importing this module imports triton: `codec.digest` imports it only for CUDA tensors, so the
CPU path needs no triton.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from sparsesync.codec.blocks_digest import BLOCK, combine, n_blocks
from sparsesync.codec.blocks_torch import (
    _ACC0,
    _LAST_KEY,
    _MERGE_KEY,
    _P32_1,
    _P64_1,
    _SCRAMBLE_KEY,
    _STRIPE_KEYS,
    _s64,
)

WORDS = BLOCK // 8  # 8192 u64 words per block: 64 rounds x 16 stripes x 8 lanes
ROUNDS = 8  # rounds one program loads at once (8 KiB); a power of two dividing 64
WARPS = 4  # warps per program (with ROUNDS = 8: 52 registers a thread on sm_90, nothing spilled)
_MAX_LAUNCH_BLOCKS = 1 << 17  # 2^17 blocks x 8192 words = 2^30 words (8 GiB) per launch at most
# the constants table the kernel reads (int64 bits of u64 values), rows of 8:
# 0..15 stripe s's key, 16 the last stripe's, 17 the scramble key, 18 the merge key,
# 19 the initial accumulators, 20 [P32_1, avalanche multiplier, BLOCK * P64_1, 0...]
_TABLE = [
    *_STRIPE_KEYS,
    _LAST_KEY,
    _SCRAMBLE_KEY,
    _MERGE_KEY,
    _ACC0,
    [_P32_1, _s64(0x165667919E3779F9), _s64(BLOCK * _P64_1), 0, 0, 0, 0, 0],
]
_tables: dict[torch.device, torch.Tensor] = {}


def _table(dev: torch.device) -> torch.Tensor:
    tab = _tables.get(dev)
    if tab is None:
        tab = _tables[dev] = torch.tensor(_TABLE, dtype=torch.int64, device=dev)
    return tab


@triton.jit
def _u64(x):
    return x.to(tl.uint64, bitcast=True)


@triton.jit
def _mul_lohi(x):
    """(x mod 2^32) * (x >> 32): the 32x32 -> 64-bit product of XXH3's accumulate."""
    return (x & 0xFFFFFFFF) * (x >> 32)


@triton.jit
def _fold(a, b):
    """Low ^ high 64 bits of the 128-bit product a * b, from 32-bit halves (u64)."""
    a0 = a & 0xFFFFFFFF
    a1 = a >> 32
    b0 = b & 0xFFFFFFFF
    b1 = b >> 32
    lo_lo = a0 * b0
    hi_lo = a1 * b0
    lo_hi = a0 * b1
    hi_hi = a1 * b1
    cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFF) + lo_hi
    upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
    lower = (cross << 32) | (lo_lo & 0xFFFFFFFF)
    return lower ^ upper


@triton.jit
def _xxh3b_blocks_kernel(words_ptr, table_ptr, out_ptr, R: tl.constexpr):
    """out[b] = XXH3-64 of block b of `words_ptr` (8192 int64 words per block)."""
    blk = tl.program_id(0).to(tl.int64)  # widened before scaling: no 32-bit product anywhere
    base = words_ptr + blk * 8192
    r = tl.arange(0, R)[:, None, None]  # round within a step
    s = tl.arange(0, 16)[None, :, None]  # stripe within a round
    i = tl.arange(0, 8)[None, None, :]  # lane within a stripe
    lanes = tl.arange(0, 8)
    scr = _u64(tl.load(table_ptr + 17 * 8 + lanes))
    p32 = _u64(tl.load(table_ptr + 20 * 8))
    acc = _u64(tl.load(table_ptr + 19 * 8 + lanes))
    key = _u64(tl.load(table_ptr + s * 8 + i))  # (1, 16, 8): stripe s reads the secret from 8 * s
    last_key = _u64(tl.load(table_ptr + 16 * 8 + i))  # (1, 1, 8): the block's last stripe, from 121
    sel = tl.arange(0, R)[:, None]
    for step in range(64 // R):
        rnd = step * R + r
        w = _u64(tl.load(base + rnd * 128 + s * 8 + i))  # (R, 16, 8): R rounds of 1 KiB
        k = tl.where((rnd == 63) & (s == 15), last_key, key)
        # lane i's data adds into accumulator i ^ 1: swap the lanes of each pair
        even, odd = tl.split(tl.reshape(w, (R, 16, 4, 2)))
        swapped = tl.reshape(tl.join(odd, even), (R, 16, 8))
        per_round = tl.sum(_mul_lohi(w ^ k) + swapped, axis=1)  # (R, 8): u64 sums wrap as XXH3's adds do
        for q in tl.static_range(R):
            acc += tl.sum(tl.where(sel == q, per_round, 0), axis=0)
            scrambled = ((acc ^ (acc >> 47)) ^ scr) * p32
            acc = tl.where(step * R + q < 63, scrambled, acc)  # no scramble after the last round
    mixed = acc ^ _u64(tl.load(table_ptr + 18 * 8 + lanes))
    lo, hi = tl.split(tl.reshape(mixed, (4, 2)))
    h = tl.sum(_fold(lo, hi), axis=0) + _u64(tl.load(table_ptr + 20 * 8 + 2))
    h = h ^ (h >> 37)
    h = h * _u64(tl.load(table_ptr + 20 * 8 + 1))
    h = h ^ (h >> 32)
    tl.store(out_ptr + blk, h.to(tl.int64, bitcast=True))


def _launch(words: torch.Tensor, out: torch.Tensor, rounds: int, warps: int) -> None:
    """Hash `words` (int64, a whole number of blocks) into `out` (int64, one per block)."""
    k = out.numel()
    assert words.numel() == k * WORDS and k <= _MAX_LAUNCH_BLOCKS, (words.numel(), k)
    _xxh3b_blocks_kernel[(k,)](words, _table(words.device), out, R=rounds, num_warps=warps)


def block_digests_triton(
    t: torch.Tensor, rounds: int = ROUNDS, launch_blocks: int = _MAX_LAUNCH_BLOCKS, warps: int = WARPS
) -> torch.Tensor:
    """XXH3-64 of each 65536-byte block of `t`'s bytes (the last zero-padded), as int64 on
    `t`'s device (the bits of the uint64 digests). `rounds` per step and `warps` per program
    change the speed only; `launch_blocks`: blocks per kernel launch (at most 2^17; smaller only
    to test the cut)."""
    if rounds not in (1, 2, 4, 8, 16, 32, 64):
        raise ValueError(f"rounds={rounds}: a power of two dividing 64")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps={warps}: 1, 2, 4, 8 or 16")
    if not 1 <= launch_blocks <= _MAX_LAUNCH_BLOCKS:
        raise ValueError(f"launch_blocks={launch_blocks}: between 1 and {_MAX_LAUNCH_BLOCKS}")
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    full = n // BLOCK
    out = torch.empty(n_blocks(n), dtype=torch.int64, device=flat.device)
    body = flat[: full * BLOCK]
    if full and body.data_ptr() % 8:  # a view at an odd byte offset: int64 loads need aligned storage
        body = body.clone()
    words = body.view(torch.int64)
    # triton launches on the current device: make it the tensor's (cuda:1 while cuda:0 is current)
    with torch.cuda.device(flat.device) if flat.device.type == "cuda" else contextlib.nullcontext():
        for lo in range(0, full, launch_blocks):
            hi = min(full, lo + launch_blocks)
            _launch(words[lo * WORDS : hi * WORDS], out[lo:hi], rounds, warps)
        if n % BLOCK:
            pad = torch.zeros(BLOCK, dtype=torch.uint8, device=flat.device)
            pad[: n - full * BLOCK] = flat[full * BLOCK :]
            _launch(pad.view(torch.int64), out[full:], rounds, warps)
    return out


def tensor_digest_triton(t: torch.Tensor, rounds: int = ROUNDS, warps: int = WARPS) -> str:
    """The "xxh3b" digest of `t` computed on its own device by the Triton kernel (one copy of
    8 bytes per block to the host)."""
    nbytes = t.numel() * t.element_size()
    return combine(block_digests_triton(t, rounds, warps=warps).cpu().numpy().view(np.uint64), nbytes)
