"""Digests of tensor bytes, in one of two algorithms (docs/format.md, "Digests"):

- "xxh3b" (what new runs write): XXH3-64 of each 64 KiB block, combined by XXH3-64 over the
  block digests and the length (`blocks_digest`; a GPU computes it with the Triton kernel
  `blocks_triton`, or `blocks_torch` where triton is absent), written
  `xxh3b:` + 16 lowercase hex digits;
- "xxh3" (runs written before it, still read): XXH3-64 of the whole byte stream, 16 bare hex
  digits.

A digest names its algorithm by its form (`algo_of`), so a reader checks a recorded digest with
the algorithm that made it: `tensor_digest(t, algo_of(recorded))`. Every function here takes
`algo` (default `DEFAULT_ALGO`, what a writer records).

Guarantee: two tensors of the same dtype and shape have the same `tensor_digest` (in one
algorithm) iff (up to 64-bit collisions, ~2^-63 per pair) their bit patterns are identical. NaN
payloads, -0.0 and every other bit pattern count. The digest is for integrity (truncation,
corruption, applying a patch to the wrong base), not authentication: anyone can forge it.

Object bytes (patch files, anchor files, checkpoint files) are digested the same way
(`bytes_digest`, `file_digest`, always plain "xxh3"): the `xxh3` a commit record names each object by.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

from sparsesync.codec import _native, _parallel, blocks_digest

LEGACY_ALGO = "xxh3"  # XXH3-64 of the whole stream: 16 bare hex digits
BLOCKS_ALGO = "xxh3b"  # block-parallel: "xxh3b:" + 16 hex digits
DEFAULT_ALGO = BLOCKS_ALGO  # what writers record
ALGOS = (LEGACY_ALGO, BLOCKS_ALGO)
_HEX = set("0123456789abcdef")
_BLOCKS_LEN = len(blocks_digest.PREFIX) + 16
_BLOCKS_RUN = re.compile(f"(?:{re.escape(blocks_digest.PREFIX)}[0-9a-f]{{16}})*")

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("sparsesync.codec needs a little-endian host")

_HASH_CHUNK = 64 << 20  # bytes hashed per update, bounds the host copy of a CUDA tensor
# bytes written and then hashed together by `put_and_digest` (they stay in cache; whole xxh3b blocks)
_PUT_BLOCK = 2 << 20


def algo_of(digest: str) -> str:
    """The algorithm a digest string was made with ("xxh3" or "xxh3b"); ValueError for a string
    that is neither form."""
    body, algo = (
        (digest[len(blocks_digest.PREFIX) :], BLOCKS_ALGO)
        if digest.startswith(blocks_digest.PREFIX)
        else (digest, LEGACY_ALGO)
    )
    if len(body) != 16 or not set(body) <= _HEX:
        raise ValueError(f"digest {digest!r:.40}, expected 16 lowercase hex digits, optionally after 'xxh3b:'")
    return algo


def all_blocks(digests: Sequence[object]) -> bool:
    """Whether every item is an "xxh3b" digest string (what `algo_of` accepts as one), checked
    in one pass over them all: a version's hundreds of small tensors cost no Python each."""
    try:
        joined = "".join(digests)  # type: ignore[arg-type]  # TypeError for anything but strings
    except TypeError:
        return False
    return set(map(len, digests)) <= {_BLOCKS_LEN} and _BLOCKS_RUN.fullmatch(joined) is not None  # type: ignore[arg-type]


def is_digest(digest: object) -> bool:
    """Whether `digest` is a digest string of either algorithm."""
    try:
        return isinstance(digest, str) and bool(algo_of(digest))
    except ValueError:
        return False


def _check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ValueError(f"digest algorithm {algo!r}, expected one of {', '.join(ALGOS)}")


def hasher(algo: str = DEFAULT_ALGO) -> xxhash.xxh3_64 | blocks_digest.Hasher:
    """An incremental hasher of `algo` (update, hexdigest); for "xxh3b" every piece but the last
    must be whole 64 KiB blocks."""
    _check_algo(algo)
    return xxhash.xxh3_64() if algo == LEGACY_ALGO else blocks_digest.Hasher()


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy for a contiguous CPU tensor)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def tensor_digest(t: torch.Tensor, algo: str = DEFAULT_ALGO, *, threads: int | None = None) -> str:
    """The `algo` digest of `t`'s raw bytes. "xxh3b": a CPU tensor is hashed by the C codec
    (`threads` across its blocks, None: one per 16 MiB up to the CPUs), any other device's on
    that device (`device_blocks`: a CUDA tensor by the Triton kernel where triton imports, else
    by torch operations; 8 bytes per 64 KiB block come back). "xxh3": a CUDA tensor is copied to
    host in 64 MiB pieces."""
    _check_algo(algo)
    flat = _byte_view(t)
    if algo == BLOCKS_ALGO:
        if flat.device.type == "cpu":
            return blocks_digest.digest_bytes(flat.numpy(), threads)
        from sparsesync.codec.device_blocks import tensor_digest_device  # (imports triton only for CUDA)

        return tensor_digest_device(flat)
    h = xxhash.xxh3_64()
    if flat.device.type == "cpu":
        h.update(flat.numpy().data)
    else:
        for start in range(0, flat.numel(), _HASH_CHUNK):
            h.update(flat[start : start + _HASH_CHUNK].cpu().numpy().data)
    return h.hexdigest()


def put_and_digest(
    dst: np.ndarray, idx: np.ndarray, values: np.ndarray, old: np.ndarray | None = None, algo: str = DEFAULT_ALGO
) -> str:
    """`dst[idx] = values` for a contiguous array of element bits (`idx` sorted, as diffed and
    decoded indices are; the overwritten bits saved into `old` if given), and the digest
    `tensor_digest` gives for `dst` afterwards. Block by block: each block of _PUT_BLOCK bytes
    is hashed right after its writes, while it is in cache, so the tensor is read from memory
    once, not once to write and again to hash. Every index is checked before its block's writes
    (IndexError). Unsorted indices are still each written once, but the digest returned may then
    not match `dst`: every caller checks it against the digest the version carries, loudly."""
    return _put_blocks(dst, idx, values, old, aside=False, algo=algo)[1]


def put_and_digests(dst: np.ndarray, idx: np.ndarray, values: np.ndarray, old: np.ndarray | None = None,
                    algo: str = DEFAULT_ALGO) -> tuple[str, str]:
    """`put_and_digest`, also returning the digest of `dst` as it was before the writes: each
    block is hashed just before its writes as well as after, still in the one pass (a reader
    checks the base it wrote over without a pass of its own, and undoes the writes if it was
    not the base it expected)."""
    before, after = _put_blocks(dst, idx, values, old, aside=False, before=True, algo=algo)
    assert before is not None
    return before, after


def digest_after_put(src: np.ndarray, idx: np.ndarray, values: np.ndarray, algo: str = DEFAULT_ALGO) -> str:
    """The digest `put_and_digest(src, idx, values)` would return, with `src` left untouched:
    each block of _PUT_BLOCK bytes is copied to a scratch buffer, written there and hashed
    (`idx` sorted; IndexError for an index out of range). A reader that decoded a change ahead
    of time uses it to check the result before it writes anything."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if idx.size and (idx[0] < 0 or idx[-1] >= src.size):
        raise IndexError(f"index {int(idx[0] if idx[0] < 0 else idx[-1])} out of range for {src.size} elements")
    return _put_blocks(src, idx, values, None, aside=True, algo=algo)[1]


def _put_blocks(dst: np.ndarray, idx: np.ndarray, values: np.ndarray, old: np.ndarray | None, *, aside: bool,
                before: bool = False, algo: str = DEFAULT_ALGO) -> tuple[str | None, str]:
    """The walk the functions above make: for each block of _PUT_BLOCK bytes, the writes of
    `idx` that fall in it, then its hash; returns (digest before the writes if `before`, else
    None; digest after). `aside`: the writes go to a scratch copy of the block (`dst` is not
    touched), else into `dst` (the overwritten bits into `old` if given)."""
    idx, values = np.ascontiguousarray(idx, dtype=np.int64), np.ascontiguousarray(values).view(dst.dtype)
    w, flat = dst.itemsize, dst.reshape(-1)
    per = max(1, _PUT_BLOCK // w)
    # where each block's indices end; made non-decreasing so that every index is written once
    # even if `idx` is not sorted
    cuts = np.maximum.accumulate(
        np.append(np.searchsorted(idx, np.arange(per, flat.size, per, dtype=np.int64)), idx.size)
    ).tolist()
    scratch = np.empty(min(per, flat.size) if aside else 0, dtype=dst.dtype)
    keep = np.empty(0, dtype=dst.dtype)
    h, h0 = hasher(algo), hasher(algo) if before else None
    lo = 0
    for b, hi in enumerate(cuts):
        block = src = flat[b * per : (b + 1) * per]
        if h0 is not None:
            h0.update(src.view(np.uint8).data)
        if hi > lo and aside:
            block = scratch[: src.size]
            block[:] = src
            _native.put(block, w, idx[lo:hi] - b * per, values[lo:hi], keep)
        elif hi > lo:
            _native.put(dst, w, idx[lo:hi], values[lo:hi], keep if old is None else old[lo:hi])
        h.update(block.view(np.uint8).data)
        lo = hi
    return (h0.hexdigest() if h0 is not None else None), h.hexdigest()


def tensor_digests(state: Mapping[str, torch.Tensor], algo: str | Mapping[str, str] = DEFAULT_ALGO) -> dict[str, str]:
    """`tensor_digest` of every tensor in `state`, by name (hashed in parallel on the codec's
    "tensors" pool: do not call it from a task of that pool). `algo`: one for all, or a map
    name -> algorithm (`algos_of` of the digests they will be compared with)."""
    names = list(state)
    pick = (lambda n: algo) if isinstance(algo, str) else algo.__getitem__
    return dict(zip(names, _parallel.map_ordered(lambda n: tensor_digest(state[n], pick(n), threads=1), names)))


def algos_of(digests: Mapping[str, str]) -> dict[str, str]:
    """name -> the algorithm of its digest (`algo_of`)."""
    if all_blocks(list(digests.values())):
        return dict.fromkeys(digests, BLOCKS_ALGO)
    return {n: algo_of(d) for n, d in digests.items()}


def state_digest(digests: Mapping[str, str]) -> str:
    """One digest identifying a whole version: XXH3-64 over the sorted `name\\0digest\\n` lines,
    in the form of the tensors' algorithm ("xxh3b:" prefixed when they are "xxh3b"; no tensors:
    `DEFAULT_ALGO`). ValueError if the digests mix algorithms."""
    vals = list(digests.values())
    algos = {BLOCKS_ALGO} if vals and all_blocks(vals) else {algo_of(d) for d in vals}
    if len(algos) > 1:
        raise ValueError(
            f"state digest over digests of algorithms {sorted(algos)}: a version's digests must all be one algorithm"
        )
    # hashed at once: XXH3 of the concatenation is what feeding the lines one by one gives
    lines = "".join([f"{name}\0{digests[name]}\n" for name in sorted(digests)]).encode()
    algo = algos.pop() if algos else DEFAULT_ALGO
    return (blocks_digest.PREFIX if algo == BLOCKS_ALGO else "") + xxhash.xxh3_64_hexdigest(lines)


def bytes_digest(data: bytes) -> str:
    """The digest commit records use for object bytes (xxh3_64 hex)."""
    return xxhash.xxh3_64_hexdigest(data)


def file_digest(path: Path, chunk: int = 4 << 20) -> str:
    """`bytes_digest` of a file's bytes, read into one reused buffer of `chunk` bytes (memory:
    that buffer, whatever the file's size; a fresh block per read kept two alive at once)."""
    h = xxhash.xxh3_64()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
