"""The tensors tests/codec/test_blocks_triton.py hashes with the Triton kernel, and the child
process that hashes them under Triton's CPU interpreter.

`cases()` builds the same tensors in any process (seeded). Run as
`TRITON_INTERPRET=1 python -m tests.support.triton_cases`, it imports the kernel (so it is
decorated for the interpreter: the variable must be set before triton's `jit` runs, and only in
this child, never in the test process where vLLM and torch run) and prints one JSON object:
`{"interpret": bool, "seconds": float, "digests": {case: {variant: digest}}}`; the variants are
the default launch and, for a few cases, other `rounds` per step, other `warps` per program and a
cut into several launches.
The interpreter runs about 0.1 s per 64 KiB block: the cases hold about 80 blocks in all.
"""

from __future__ import annotations

import json
import os
import time

import torch

BLOCK = 65536
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT = {2: torch.int16, 4: torch.int32}


def special(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """`n` random elements with NaN payloads, -0.0, subnormals and infinities among the first."""
    g = torch.Generator().manual_seed(seed)
    w = torch.finfo(dtype).bits // 8
    bits = torch.randint(-(1 << (8 * w - 1)), 1 << (8 * w - 1), (n,), generator=g, dtype=torch.int64).to(INT[w])
    values = {  # quiet and signalling NaN payloads, -0.0, the smallest subnormals (+, -), +inf, +0.0
        2: [0x7FC1, 0x7E01 if dtype == torch.float16 else 0x7F81, -32768, 0x0001, -32767, 0x7C00, 0x0],
        4: [0x7FC00001, 0x7F800001, -(1 << 31), 0x00000001, -(1 << 31) + 1, 0x7F800000, 0x0],
    }[w]
    m = min(n, len(values))
    bits[:m] = torch.tensor(values[:m], dtype=INT[w])
    return bits.view(dtype)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


def cases() -> dict[str, torch.Tensor]:
    """Name -> tensor: dtypes x sizes around one block with special values, byte sizes around
    block and stripe boundaries, random data over several blocks, and non-contiguous views."""
    out: dict[str, torch.Tensor] = {}
    for name, dt in DTYPES.items():
        per = BLOCK // (torch.finfo(dt).bits // 8)  # elements per block
        for numel in (0, 1, 2, per - 1, per, per + 1):
            out[f"{name}-{numel}"] = special(dt, numel, numel + 7)
    for n in (BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 100, 3 * BLOCK + BLOCK - 30):
        out[f"bytes-{n}"] = _random_bytes(n, n)  # 100: a partial first stripe; -30: a partial last one
    out["random-fp32-5-blocks"] = special(torch.float32, 5 * BLOCK // 4 + 3, 11)
    base = special(torch.bfloat16, 300 * 257, 3).reshape(300, 257)
    out.update({
        "view-transpose": base.t(),
        "view-step": base[:, ::3],
        "view-rows": base[7:250],
        "view-column": base[:, 5],
        "view-odd-offset": base.reshape(-1)[1:40001],  # storage starts 2 bytes in: not 8-byte aligned
        "view-fp32-transpose": special(torch.float32, 130 * 257, 5).reshape(130, 257).t(),
    })
    return out


VARIANTS = {  # case -> the keyword sets of block_digests_triton tried on it besides the default
    "random-fp32-5-blocks": [{"launch_blocks": 1}, {"launch_blocks": 2}, {"rounds": 1}, {"rounds": 64}],
    "bytes-65537": [{"rounds": 4}, {"rounds": 16}, {"rounds": 16, "warps": 8}, {"launch_blocks": 1}],
}


def main() -> None:
    import numpy as np

    from sparsesync.codec.blocks_digest import combine
    from sparsesync.codec.blocks_triton import block_digests_triton

    t0 = time.perf_counter()
    digests: dict[str, dict[str, str]] = {}
    for name, t in cases().items():
        nbytes = t.numel() * t.element_size()
        got = {"default": combine(block_digests_triton(t).numpy().view(np.uint64), nbytes)}
        for kw in VARIANTS.get(name, []):
            label = ",".join(f"{k}={v}" for k, v in kw.items())
            got[label] = combine(block_digests_triton(t, **kw).numpy().view(np.uint64), nbytes)
        digests[name] = got
    print(json.dumps({
        "interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "seconds": time.perf_counter() - t0,
        "digests": digests,
    }))


if __name__ == "__main__":
    main()
