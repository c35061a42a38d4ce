"""The block-parallel tensor digest "xxh3b": the C codec's block hashes against xxhash's XXH3-64
of each padded block, docs/format.md's test vectors, and the torch implementation bit-equal to
the C one over the edge cases (NaN payloads, -0.0, subnormals, empty and one-element tensors,
non-contiguous views, bf16/fp16/fp32, block boundaries). If the two implementations ever
diverge, these fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsesync.codec import _native
from sparsesync.codec.blocks_digest import BLOCK, Hasher, block_digests, digest_bytes
from sparsesync.codec.blocks_torch import block_digests_torch, tensor_digest_torch
from sparsesync.codec.digest import (
    algo_of,
    digest_after_put,
    put_and_digest,
    put_and_digests,
    state_digest,
    tensor_digest,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {2: torch.int16, 4: torch.int32}


def _pattern(n: int) -> bytes:
    """The test vectors' bytes: byte i is i mod 251."""
    return bytes(i % 251 for i in range(n))


# docs/format.md, "Digests": bytes in, digest out (keep the two lists equal)
VECTORS = [
    (b"", "xxh3b:c77b3abb6f87acd9"),
    (bytes.fromhex("803f"), "xxh3b:5dae80da45ba756c"),  # one bf16 element, 1.0
    (_pattern(BLOCK), "xxh3b:08a8a84bc34d3b3b"),  # exactly one block
    (_pattern(BLOCK + 1), "xxh3b:0c9aabde6c7dd330"),  # one block and one byte
]


def _reference(data: bytes) -> str:
    """The definition, with xxhash only: XXH3-64 of each zero-padded block, then of their
    little-endian u64s and the length."""
    blocks = [data[i : i + BLOCK].ljust(BLOCK, b"\0") for i in range(0, len(data), BLOCK)]
    hs = b"".join(xxhash.xxh3_64_intdigest(b).to_bytes(8, "little") for b in blocks)
    return "xxh3b:" + xxhash.xxh3_64_hexdigest(hs + len(data).to_bytes(8, "little"))


@pytest.mark.parametrize("data,want", VECTORS, ids=["empty", "one-element", "one-block", "block+1"])
def test_vectors_of_the_format_document(data, want):
    assert _reference(data) == want
    assert digest_bytes(data) == want
    assert (
        tensor_digest_torch(
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        )
        == want
    )


@pytest.mark.parametrize("n", [0, 1, 7, 64, 65, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 64 * BLOCK + 3])
def test_c_block_digests_are_xxh3_of_each_padded_block_at_every_level_and_thread_count(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = [xxhash.xxh3_64_intdigest(data[i : i + BLOCK].tobytes().ljust(BLOCK, b"\0")) for i in range(0, n, BLOCK)]
    for hw in [-2, *_native.hw_levels()]:  # -2: the plain scalar C
        for threads in (1, 2, 5):
            assert block_digests(data, threads, hw).tolist() == want, (hw, threads)
    assert digest_bytes(data) == _reference(data.tobytes())


def test_c_block_digests_reject_a_wrong_output_size():
    with pytest.raises(ValueError, match="expected 16"):
        _native.block_digests(np.zeros(BLOCK + 1, np.uint8), np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match="hw level"):
        _native.block_digests(np.zeros(1, np.uint8), np.zeros(1, np.uint64), 1, 9)


def _special(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """`n` random elements with NaN payloads, -0.0, subnormals and infinities among them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.finfo(dtype).bits // 8
    bits = torch.randint(-(1 << (8 * w - 1)), 1 << (8 * w - 1), (n,), generator=g, dtype=torch.int64).to(INT[w])
    special = {2: [0x7FC1, 0x7E01 if dtype == torch.float16 else 0x7F81, -32768, 0x0001, -32767, 0x7C00, 0x0],
               4: [0x7FC00001, 0x7F800001, -(1 << 31), 0x00000001, -(1 << 31) + 1, 0x7F800000, 0x0]}[w]
    m = min(n, len(special))
    bits[:m] = torch.tensor(special[:m], dtype=INT[w])
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "numel", [0, 1, 2, BLOCK // 4 - 1, BLOCK // 4, BLOCK // 4 + 1, BLOCK // 2 - 1, BLOCK // 2, BLOCK // 2 + 1, 70001]
)
def test_torch_equals_c_over_dtypes_sizes_and_special_values(dtype, numel):
    t = _special(dtype, numel, numel)
    want = tensor_digest(t, "xxh3b")
    assert tensor_digest_torch(t) == want
    assert tensor_digest_torch(t, chunk_blocks=1) == want  # chunking changes nothing
    assert want == _reference(t.view(torch.uint8).numpy().tobytes() if numel else b"")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_equals_c_on_non_contiguous_views(dtype):
    base = _special(dtype, 300 * 257, 3).reshape(300, 257)
    views = {
        "transpose": base.t(),
        "step": base[:, ::3],
        "rows": base[7:250],
        "column": base[:, 5],
        "odd offset": base.reshape(-1)[1:40000],
    }
    for what, v in views.items():
        c = tensor_digest(v, "xxh3b")
        assert c == tensor_digest(v.contiguous(), "xxh3b"), what  # the bytes in C order
        assert tensor_digest_torch(v) == c, what


def test_one_bit_anywhere_changes_both_and_trailing_zeros_count():
    x = torch.zeros(BLOCK, dtype=torch.uint8)
    seen = {tensor_digest(x, "xxh3b")}
    for pos in (0, 1, BLOCK // 2, BLOCK - 64, BLOCK - 1):
        y = x.clone()
        y[pos] ^= 0x10
        d = tensor_digest(y, "xxh3b")
        assert tensor_digest_torch(y) == d
        seen.add(d)
    assert len(seen) == 6
    # the tail block is zero-padded, the length keeps x and x + zeros apart
    short = torch.zeros(10, dtype=torch.uint8)
    assert (
        len(
            {
                tensor_digest(short, "xxh3b"),
                tensor_digest(torch.zeros(11, dtype=torch.uint8), "xxh3b"),
                tensor_digest(x, "xxh3b"),
            }
        )
        == 3
    )


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=0, max_size=3 * BLOCK + 9), st.sampled_from([1, 2, 4]))
def test_torch_equals_c_on_any_bytes(data, width):
    data = data[: len(data) - len(data) % width]
    t = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).view(
            {1: torch.uint8, 2: torch.float16, 4: torch.float32}[width]
        )
        if data
        else torch.empty(0)
    )
    assert tensor_digest_torch(t) == tensor_digest(t, "xxh3b") == _reference(data)


def test_torch_block_digests_equal_the_c_ones():
    data = np.random.default_rng(5).integers(0, 256, 5 * BLOCK + 17, dtype=np.uint8)
    got = block_digests_torch(torch.from_numpy(data.copy())).numpy().view(np.uint64)
    assert got.tolist() == block_digests(data).tolist()


def test_hasher_in_pieces_of_whole_blocks_equals_one_pass():
    data = np.random.default_rng(6).integers(0, 256, 4 * BLOCK + 3, dtype=np.uint8)
    h = Hasher()
    for lo, hi in ((0, BLOCK), (BLOCK, 3 * BLOCK), (3 * BLOCK, data.size)):
        h.update(data[lo:hi])
    assert h.hexdigest() == digest_bytes(data)
    h = Hasher()
    h.update(data[:10])
    with pytest.raises(ValueError, match="whole number"):
        h.update(data[10:20])


@pytest.mark.parametrize("algo", ["xxh3", "xxh3b"])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_put_and_digest_in_either_algorithm_equals_hashing_after_the_writes(algo, width):
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    rng = np.random.default_rng(width)
    a = rng.integers(0, 200, (5 << 20) // width + 3, dtype=dt)  # several 2 MiB write blocks and a short tail
    idx = np.sort(rng.choice(a.size, 5000, replace=False)).astype(np.int64)
    vals = rng.integers(0, 200, idx.size, dtype=dt)
    before = tensor_digest(torch.from_numpy(a.view(np.uint8).copy()), algo)
    predicted = digest_after_put(a, idx, vals, algo)
    b = a.copy()
    got_before, got_after = put_and_digests(b, idx, vals, None, algo)
    c = a.copy()
    assert put_and_digest(c, idx, vals, None, algo) == got_after == predicted
    assert got_before == before and got_after == tensor_digest(torch.from_numpy(b.view(np.uint8).copy()), algo)
    assert algo_of(got_after) == algo


def test_digest_forms_name_their_algorithm_and_a_state_never_mixes_them():
    t = torch.arange(10, dtype=torch.float32)
    old, new = tensor_digest(t, "xxh3"), tensor_digest(t, "xxh3b")
    assert old == xxhash.xxh3_64_hexdigest(t.numpy().tobytes()) and len(old) == 16  # the legacy digest, unchanged
    assert (algo_of(old), algo_of(new)) == ("xxh3", "xxh3b") and new.startswith("xxh3b:")
    assert algo_of(state_digest({"t": old})) == "xxh3" and algo_of(state_digest({"t": new})) == "xxh3b"
    with pytest.raises(ValueError, match="algorithms"):
        state_digest({"a": old, "b": new})
    for bad in ("xxh3b:123", "XXH3B:0123456789abcdef", "0123456789ABCDEF", "sha256:0123456789abcdef"):
        with pytest.raises(ValueError, match="expected 16 lowercase hex"):
            algo_of(bad)


def test_a_gpu_kernel_that_fails_on_first_use_hands_over_to_torch(monkeypatch, caplog):
    from sparsesync.codec import device_blocks

    monkeypatch.setattr(device_blocks, "_cuda_impl", None)
    monkeypatch.setattr(device_blocks, "_cuda_impl_ran", False)

    def broken(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    t = _special(torch.bfloat16, 40000, 9)
    want = block_digests(t.view(torch.uint8).numpy()).tolist()
    with caplog.at_level("WARNING", logger="sparsesync.codec.device_blocks"):
        got = device_blocks._first_use_falls_back(broken, t, 256)
    assert got.numpy().view(np.uint64).tolist() == want
    assert "failed on its first use (RuntimeError: Failed to find C compiler" in caplog.text
    assert device_blocks.cuda_impl() is block_digests_torch  # for the rest of the process
    # once the kernel has run, a later failure is not hidden
    monkeypatch.setattr(device_blocks, "_cuda_impl_ran", True)
    with pytest.raises(RuntimeError, match="C compiler"):
        device_blocks._first_use_falls_back(broken, t, 256)
