"""The block-parallel tensor digest "xxh3b" on the CPU (the C codec's `block_digests`).

Definition (normative text in docs/format.md, "Digests"): split the tensor's raw bytes (C order,
little-endian) into blocks of BLOCK = 65536 bytes, the last one padded with zero bytes to BLOCK;
h_i = XXH3-64 (seed 0) of block i; the digest is XXH3-64 of `LE64(h_0) .. LE64(h_{k-1}) ||
LE64(byte length)`, written `xxh3b:` + 16 lowercase hex digits. The blocks are independent, so
a GPU (`blocks_triton`, or `blocks_torch`) or several CPU threads hash them at once, at memory
speed; the length in the final hash keeps a tensor and the same bytes followed by zeros apart.

Guarantee: `digest_bytes(buf)` equals `blocks_torch.tensor_digest_torch` and
`blocks_triton.tensor_digest_triton` of the same bytes on every device (the tests compare them),
and `Hasher` fed the same bytes in any cut at block boundaries gives the same digest. Integrity,
not authentication (as for "xxh3").
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from sparsesync.codec import _native

BLOCK = 65536  # bytes per block (native/blocks.c's BLK)
PREFIX = "xxh3b:"  # how a digest of this algorithm is written (a legacy "xxh3" digest is 16 bare hex digits)
_LEN = struct.Struct("<Q")
_THREAD_BYTES = 16 << 20  # a thread per this many bytes of one tensor, when threads are asked for


def n_blocks(nbytes: int) -> int:
    """Blocks of a tensor of `nbytes` bytes."""
    return -(-nbytes // BLOCK)


def combine(block_digests: np.ndarray, nbytes: int) -> str:
    """The digest from the blocks' XXH3-64 values (uint64, in order) and the byte length."""
    return PREFIX + xxhash.xxh3_64_hexdigest(
        np.ascontiguousarray(block_digests, dtype="<u8").tobytes() + _LEN.pack(nbytes)
    )


def auto_threads(nbytes: int) -> int:
    """Threads `digest_bytes` uses for `nbytes` when not told: one per 16 MiB, at most the CPUs
    this process may run on (and SPARSESYNC_CODEC_THREADS, when set)."""
    env = os.environ.get("SPARSESYNC_CODEC_THREADS", "")
    cpus = (
        int(env)
        if env.isdigit()
        else len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1
    )
    return max(1, min(cpus, nbytes // _THREAD_BYTES))


def _bytes(buf: np.ndarray | memoryview | bytes) -> memoryview:
    """`buf`'s bytes, not copied (TypeError if they are not contiguous)."""
    return (buf.data if isinstance(buf, np.ndarray) else memoryview(buf)).cast("B")


def block_digests(buf: np.ndarray | memoryview | bytes, threads: int = 1, hw: int = -1) -> np.ndarray:
    """XXH3-64 of each block of `buf` (the last zero-padded), uint64; the GIL is released."""
    mv = _bytes(buf)
    out = np.empty(n_blocks(mv.nbytes), dtype=np.uint64)
    _native.block_digests(mv, out, threads, hw)
    return out


def digest_bytes(buf: np.ndarray | memoryview | bytes, threads: int | None = None) -> str:
    """The "xxh3b" digest of `buf`'s bytes (`threads`: None picks `auto_threads`)."""
    mv = _bytes(buf)
    n = mv.nbytes
    out = np.empty(-(-n // BLOCK), dtype=np.uint64)
    _native.block_digests(mv, out, (auto_threads(n) if n >= 2 * _THREAD_BYTES else 1) if threads is None else threads)
    return PREFIX + xxhash.xxh3_64_hexdigest(out.tobytes() + _LEN.pack(n))


def combine_many(blocks: np.ndarray, nbytes: Sequence[int] | np.ndarray) -> list[str]:
    """The digests of consecutive tensors from their blocks laid end to end (`members_blocks`'s
    layout) and their byte lengths (one hash call per tensor, nothing else)."""
    raw = np.ascontiguousarray(blocks, dtype="<u8").tobytes()
    lens = np.asarray(nbytes, dtype=np.int64)
    ends = np.cumsum(-(-lens // BLOCK) * 8).tolist()
    lb = lens.astype("<u8").tobytes()
    h = xxhash.xxh3_64_hexdigest
    return [PREFIX + h(raw[a:b] + lb[8 * i : 8 * i + 8]) for i, (a, b) in enumerate(zip([0, *ends], ends))]


def digests_many(bufs: Sequence[np.ndarray]) -> list[str]:
    """`digest_bytes` of each buffer (C-contiguous), hashed in one native call (no Python per
    block; for the many small tensors of a group)."""
    nbytes = [b.nbytes for b in bufs]
    out = np.empty(sum(n_blocks(n) for n in nbytes), dtype=np.uint64)
    _native.members_blocks(list(bufs), out)
    return combine_many(out, nbytes)


class Hasher:
    """Incremental "xxh3b" over bytes given in pieces, each a whole number of blocks but the
    last (ValueError otherwise): same update/hexdigest surface as `xxhash.xxh3_64`."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._nbytes = 0

    def update(self, buf: np.ndarray | memoryview | bytes) -> None:
        mv = _bytes(buf)
        if self._nbytes % BLOCK:
            raise ValueError(
                f"xxh3b: {self._nbytes} bytes hashed so far are not a whole number of {BLOCK}-byte blocks; "
                "only the last piece may be shorter"
            )
        self._parts.append(block_digests(mv))
        self._nbytes += mv.nbytes

    def hexdigest(self) -> str:
        parts = self._parts
        return combine(np.concatenate(parts) if parts else np.empty(0, np.uint64), self._nbytes)
