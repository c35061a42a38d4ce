"""The "xxh3b" digest's two GPU implementations on a real CUDA device, bit-equal to the C codec.

The same cases as the CPU interpreter's run in tests/codec/test_blocks_triton.py (NaN payloads,
-0.0, subnormals, empty and one-element tensors, non-contiguous views, bf16/fp16/fp32, block and
stripe boundaries, several launches), hashed on CUDA by the Triton kernel (`blocks_triton`), by
torch operations (`blocks_torch`) and by `tensor_digest` (which must pick the Triton kernel when
triton imports), and one tensor of more than 2^31 elements (2 GiB + 100 bytes), which the
interpreter cannot afford. Marked `gpu`; each skips, naming the reason, without CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparsesync.codec import device_blocks, digest
from sparsesync.codec.blocks_torch import tensor_digest_torch
from tests.support.triton_cases import VARIANTS, cases

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not HAS_CUDA,
        reason="needs a CUDA device (torch.cuda.is_available() is False); run scripts/gpu_check.sh on a GPU machine",
    ),
]
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (CUDA builds of torch bring it)")


@pytest.mark.parametrize("name", list(cases()))
def test_gpu_digests_equal_the_c_digest(name):
    t = cases()[name]
    want = digest.tensor_digest(t, "xxh3b")
    # the same view (strides, storage offset) of a CUDA copy of its whole storage
    whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).cuda()
    g = whole.as_strided(t.shape, t.stride(), t.storage_offset())
    assert tensor_digest_torch(g) == want
    assert digest.tensor_digest(g, "xxh3b") == want
    if HAS_TRITON:
        from sparsesync.codec.blocks_digest import combine
        from sparsesync.codec.blocks_triton import block_digests_triton

        nbytes = t.numel() * t.element_size()
        for kw in [{}, *VARIANTS.get(name, [])]:
            got = combine(block_digests_triton(g, **kw).cpu().numpy().view("<u8"), nbytes)
            assert got == want, (name, kw)


@NEEDS_TRITON
def test_cuda_tensors_are_hashed_by_the_triton_kernel():
    from sparsesync.codec.blocks_triton import block_digests_triton

    digest.tensor_digest(torch.ones(10, device="cuda"), "xxh3b")
    assert device_blocks.cuda_impl() is block_digests_triton  # it ran, and did not fall back to torch


@NEEDS_TRITON
def test_a_tensor_of_more_than_2_31_elements():
    from sparsesync.codec.blocks_triton import tensor_digest_triton

    n = (1 << 31) + 100
    if torch.cuda.get_device_properties(0).total_memory < 3 * n:
        pytest.skip(f"needs about {3 * n >> 30} GiB of GPU memory (CUDA device too small)")
    g = torch.empty(n, dtype=torch.uint8, device="cuda")
    g.view(-1)[: n - n % 8].view(torch.int64).copy_(torch.arange((n - n % 8) // 8, device="cuda"))
    g[-100:] = 7
    want = digest.tensor_digest(g.cpu(), "xxh3b")
    assert tensor_digest_triton(g) == want
    assert tensor_digest_triton(g[1:]) == digest.tensor_digest(g[1:].cpu(), "xxh3b")  # unaligned: cloned


@NEEDS_TRITON
def test_the_device_publish_path_hashes_with_the_triton_kernel(monkeypatch):
    """`device_changes.block_digests_many` (a publish from CUDA weights) goes through
    `device_blocks`: the Triton kernel runs (the flag only it sets) and the digests are the C codec's."""
    from sparsesync.codec.blocks_digest import block_digests
    from sparsesync.codec.device_changes import block_digests_many

    monkeypatch.setattr(device_blocks, "_cuda_impl_ran", False)
    ts = [cases()[n] for n in ("bf16-1", "bf16-32769", "bytes-262114", "view-transpose")]
    got = block_digests_many([t.cuda() for t in ts], batch_bytes=1 << 17)  # batched and alone, both
    assert device_blocks._cuda_impl_ran
    for t, d in zip(ts, got, strict=True):
        assert d.cpu().numpy().view("<u8").tolist() == block_digests(t.contiguous().view(torch.uint8).numpy()).tolist()
