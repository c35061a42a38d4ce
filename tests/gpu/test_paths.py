"""Every CUDA branch of the codec and the protocol, compared bit for bit with the CPU path.

Where the code is device-agnostic torch, each test is parametrized over ["cpu", "cuda"]: the
CPU case runs in CI (the logic), the CUDA case is marked `gpu` and skips, naming the reason,
where no CUDA device is visible. scripts/gpu_check.sh runs `pytest -m gpu` over these files on a
GPU machine. Covered: `diff._changed_slice` (bf16, fp16, fp32, uint8; NaN payloads, inf, -0.0,
subnormals; unaligned slices; no change and every element changed), `diff_state` with the
snapshot and the live weights on either device (the CPU-snapshot/CUDA-weights pair is a GPU
trainer's default: the Publisher keeps its snapshot in host memory), the CUDA flush of many
slices, `Snapshot(device="cuda")`, `tensor_digest` of CUDA tensors (also non-contiguous and
across its 64 MiB host pieces), `apply_patch` into CUDA tensors (all-or-nothing: a corrupt
stream in a later tensor writes nothing, a wrong target digest undoes every tensor, a base
mismatch writes nothing), and the Publisher: a CUDA state gives the same patch bytes as the
same state on CPU. The engine, trainer and FSDP2 paths are in tests/gpu/test_stack.py.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from sparsesync.codec import Snapshot, apply_patch, diff_state, read_patch, tensor_digest
from sparsesync.codec import digest as digest_mod
from sparsesync.codec.diff import _changed_slice, _changed_slice_np, bits_view, to_np_bits
from sparsesync.codec.patch import assemble_patch, encode_tensors
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError
from sparsesync.protocol.run import Run
from sparsesync.protocol.writer.publisher import Publisher

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); run scripts/gpu_check.sh on a GPU machine"
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)])
DEVICES = ["cpu", CUDA]
# (snapshot device, live weights device): both CPU (CI), CPU snapshot + CUDA weights (a GPU
# trainer's default), both CUDA (Snapshot(device="cuda")), CUDA snapshot + CPU weights
PAIRS = [
    ("cpu", "cpu"),
    pytest.param(
        "cpu", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)], id="cpu-cuda"
    ),
    pytest.param(
        "cuda", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)], id="cuda-cuda"
    ),
    pytest.param(
        "cuda", "cpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)], id="cuda-cpu"
    ),
]
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# bit patterns every float path must keep apart: +-0, +-inf, quiet and signalling NaNs with
# payloads, the smallest and largest subnormals, the largest finite
SPECIAL_BF16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFC5, 0x7F81, 0x0001, 0x007F, 0x8001, 0x7F7F]
SPECIAL_F32 = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800001,
               0x00000001, 0x007FFFFF, 0x80000001, 0x7F7FFFFF]


def _from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size()
    arr = np.array(bits, dtype={2: np.uint16, 4: np.uint32}[width])
    return torch.from_numpy(arr.view({2: np.int16, 4: np.int32}[width]).copy()).view(dtype)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model's worth of tensors: bf16 matrices, an fp32 (master-precision) norm, an fp16
    and a uint8 tensor, odd element counts (not a multiple of the 4 lanes of a 64-bit word), a
    0-d scalar, an empty tensor, and special values everywhere."""
    g = torch.Generator().manual_seed(seed)
    s = {
        "embed": (torch.randn(67, 33, generator=g) * 0.02).to(torch.bfloat16),
        "q_proj": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16),
        "norm32": torch.randn(129, generator=g).abs() + 0.5,
        "half": (torch.randn(7, 11, generator=g) * 0.1).to(torch.float16),
        "bytes": torch.randint(0, 256, (1001,), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(0.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 8, dtype=torch.bfloat16),
    }
    s["embed"].view(-1)[: len(SPECIAL_BF16)] = _from_bits(SPECIAL_BF16, torch.bfloat16)
    s["norm32"][-len(SPECIAL_F32):] = _from_bits(SPECIAL_F32, torch.float32)
    return s


def _stepped(state: dict[str, torch.Tensor], seed: int = 1, density: float = 0.05) -> dict[str, torch.Tensor]:
    """`state` after an RL-like step: about `density` of each tensor's elements move by 1-2
    units of their bit pattern, specials turn into each other (NaN payload changes, 0 <-> -0,
    a subnormal moves), one tensor changes entirely and one not at all."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        t = t.clone()
        ints = t.reshape(-1).view(_INT[t.element_size()])
        if name == "q_proj":  # every element changes
            ints += 1
        elif name != "half" and ints.numel():  # "half" stays as it was
            n = max(1, int(ints.numel() * density))
            idx = torch.randint(0, ints.numel(), (n,), generator=g)
            ints[idx] += torch.randint(1, 3, (n,), generator=g, dtype=ints.dtype)
        out[name] = t
    # +-0 swap, -inf, NaN payload change
    out["embed"].view(-1)[:4] = _from_bits([0x8000, 0x0000, 0xFF80, 0x7FC0], torch.bfloat16)
    out["embed"].view(-1)[8:12] = _from_bits([0x0002, 0x007E, 0x8000, 0x7F7E], torch.bfloat16)  # subnormals move
    out["norm32"][-4:] = _from_bits([0x00000002, 0x007FFFFE, 0x00000001, 0x7F7FFFFE], torch.float32)
    return out


def _on(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device, copy=True) for k, v in state.items()}  # a copy on CPU too


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].cpu(), b[k].cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"tensor {k!r} differs"


# -- diff -------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("case", ["some", "none", "all", "specials"])
def test_changed_slice_matches_the_cpu_pass_bit_for_bit(device, dtype, offset, case):
    """`_changed_slice` (the torch path, CUDA's) gives the C pass's positions and bits for slices
    at every alignment (a slice not starting on a 64-bit word falls back to element compare)."""
    g = torch.Generator().manual_seed(offset)
    n = 1037
    width = torch.empty((), dtype=dtype).element_size()
    a = torch.randint(
        -(1 << (8 * width - 1)) if width > 1 else 0,
        (1 << (8 * width - 1)) - 1 if width > 1 else 255,
        (n,),
        generator=g,
        dtype=_INT[width],
    )
    b = a.clone()
    if case == "some":
        idx = torch.randint(0, n, (60,), generator=g)
        b[idx] += 1
        b[-1] -= 1  # the tail past the last whole word
    elif case == "all":
        b += 1
    elif case == "specials" and width in (2, 4):
        sp = torch.from_numpy(
            np.array(SPECIAL_BF16 if width == 2 else SPECIAL_F32, dtype={2: np.uint16, 4: np.uint32}[width])
            .view({2: np.int16, 4: np.int32}[width])
            .copy()
        )
        a[: sp.numel()] = sp
        b[: sp.numel()] = sp.roll(1)
    a, b = a.view(dtype).to(device), b.view(dtype).to(device)
    sa, sb = bits_view(a)[offset:], bits_view(b)[offset:]
    idx, va, vb = _changed_slice(sa, sb)
    want_i, want_a, want_b = _changed_slice_np(to_np_bits(sa.cpu()), to_np_bits(sb.cpu()))
    assert idx.device.type == torch.device(device).type
    np.testing.assert_array_equal(idx.cpu().numpy(), want_i)
    np.testing.assert_array_equal(to_np_bits(va.cpu()), want_a)
    np.testing.assert_array_equal(to_np_bits(vb.cpu()), want_b)
    if case == "none":
        assert idx.numel() == 0
    if case == "all":
        assert idx.numel() == n - offset


@pytest.mark.parametrize(("snap_dev", "live_dev"), PAIRS)
@pytest.mark.parametrize("chunk_bytes", [256 << 20, 64])
def test_diff_state_is_the_same_on_every_device_pair(snap_dev, live_dev, chunk_bytes):
    """Changes found with the snapshot and the weights on any devices (64-byte chunks: many
    slices per tensor and a flush per chunk) equal the all-CPU changes, element for element."""
    base, target = _state(), _stepped(_state())
    want = diff_state(base, target)
    got = diff_state(_on(base, snap_dev), _on(target, live_dev), chunk_bytes=chunk_bytes)
    assert sorted(got) == sorted(want) and "half" not in got and "empty" not in got
    assert got["q_proj"].n_changed == 64 * 64
    for name, w in want.items():
        c = got[name]
        assert (c.dtype, c.shape) == (w.dtype, w.shape)
        np.testing.assert_array_equal(c.indices, w.indices)
        assert c.base_bits.dtype == w.base_bits.dtype
        np.testing.assert_array_equal(c.base_bits, w.base_bits)
        np.testing.assert_array_equal(c.target_bits, w.target_bits)


@pytest.mark.parametrize(("snap_dev", "live_dev"), PAIRS)
def test_snapshot_patch_bytes_and_digests_do_not_depend_on_devices(snap_dev, live_dev):
    """`Snapshot.diff_encode` gives the same patch bytes, digests and advanced snapshot for any
    placement of snapshot and weights, over two steps (the second from the advanced snapshot)."""
    states = [_state()]
    states += [_stepped(states[-1], seed=1), _stepped(states[-1], seed=2)]
    ref = Snapshot(states[0], 0)
    snap = Snapshot(_on(states[0], live_dev), 0, device=snap_dev)
    assert snap.digests == ref.digests and snap.state_digest == ref.state_digest
    assert all(t.device.type == snap_dev for t in snap.state.values())
    for v in (1, 2):
        want = ref.diff_encode(states[v], v)
        got = snap.diff_encode(_on(states[v], live_dev), v)
        assert got.data == want.data, f"version {v}: patch bytes differ"
        assert got.target_digests == want.target_digests and snap.state_digest == ref.state_digest
        _bits_equal(snap.state, states[v])


# -- digests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_digests_equal_the_cpu_digests(device, monkeypatch):
    """A CUDA tensor hashes to its CPU twin's digest: contiguous, non-contiguous (a transpose),
    a slice with a storage offset, and across the 64 MiB host pieces (shrunk here to 1 KiB)."""
    monkeypatch.setattr(digest_mod, "_HASH_CHUNK", 1024)
    s = _state()
    big = torch.randn(3000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)  # 6000 B: 6 pieces
    cases = {**s, "big": big, "transposed": s["q_proj"].t(), "offset": big[3:1001]}
    for name, t in cases.items():
        assert tensor_digest(t.to(device)) == tensor_digest(t.contiguous()), name


# -- apply ------------------------------------------------------------------------------------
def _patch_bytes(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], **wrong_target: str) -> bytes:
    """The patch base -> target, its target digests replaced by `wrong_target` (by tensor)."""
    snap = Snapshot(base, 0)
    changes = diff_state(base, target)
    encoded = encode_tensors(changes, base=base)
    tgt = Snapshot(target, 1)
    return assemble_patch(encoded, base_version=0, target_version=1, base_digests=snap.digests,
                          target_digests={**tgt.digests, **wrong_target}, base_state_digest=snap.state_digest,
                          target_state_digest=tgt.state_digest)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check_base", [True, False])
def test_apply_patch_into_device_tensors_is_bit_exact(device, check_base):
    base, target = _state(), _stepped(_state())
    data = Snapshot(base, 0).diff_encode(target, 1).data
    work = _on(base, device)
    ptrs = {k: v.data_ptr() for k, v in work.items()}
    updates = apply_patch(read_patch(data), work, check_base_digest=check_base)
    _bits_equal(work, target)
    assert {k: v.data_ptr() for k, v in work.items()} == ptrs  # in place
    assert all(u.indices.device.type == "cpu" for u in updates.values())
    # a mixed placement (some tensors on the device, some on the host) too
    mixed = {k: (v.to(device) if i % 2 else v.clone()) for i, (k, v) in enumerate(base.items())}
    apply_patch(read_patch(data), mixed, check_base_digest=check_base)
    _bits_equal(mixed, target)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_patch_into_device_tensors_is_all_or_nothing(device):
    base, target = _state(), _stepped(_state())
    # 1. a target digest that does not match in the LAST tensor (name order): every tensor is
    # written, the check fails, every tensor is put back
    names = sorted(diff_state(base, target))
    data = _patch_bytes(base, target, **{names[-1]: "xxh3b:" + "0" * 16})
    work = _on(base, device)
    with pytest.raises(DigestMismatchError, match="undone"):
        apply_patch(read_patch(data), work)
    _bits_equal(work, base)
    # 2. weights not at the patch's base (one element of one tensor moved): nothing written
    work = _on(base, device)
    flat = work["norm32"].view(-1)
    flat[0] = flat[0] + 1.0
    before = {k: v.clone() for k, v in work.items()}
    with pytest.raises(PatchMismatchError, match="not at base version 0"):
        apply_patch(read_patch(Snapshot(base, 0).diff_encode(target, 1).data), work)
    _bits_equal(work, before)
    # 3. a corrupt stream in a later tensor (by size: decoded after the others): nothing written
    good = Snapshot(base, 0).diff_encode(target, 1).data
    patch = read_patch(good)
    victim = min((e for e in patch.header.tensors.values() if e.numel > 1), key=lambda e: e.numel).name
    bad = _corrupt_stream(good, victim)
    work = _on(base, device)
    with pytest.raises((PatchFormatError, PatchMismatchError, DigestMismatchError)):  # which, depends on the bytes
        apply_patch(read_patch(bad), work, check_base_digest=False)
    _bits_equal(work, base)


def _corrupt_stream(data: bytes, name: str) -> bytes:
    """`data` with the first byte of one of `name`'s streams flipped (the container's table says
    where; the file digest is not checked by `read_patch`, the stream decoders are)."""
    patch = read_patch(data)
    e = patch.header.tensors[name]
    role = next(iter(e.streams))
    raw = bytes(patch.stream(name, role))
    pos = data.find(raw) if raw else -1
    assert pos > 0, "stream not found in the file"
    buf = bytearray(data)
    buf[pos : pos + len(raw)] = bytes(x ^ 0xA5 for x in raw)
    return bytes(buf)


# -- publisher --------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("part_bytes", [0, 4096])
def test_a_device_state_publishes_the_same_patch_bytes_as_on_cpu(device, part_bytes, tmp_path):
    """Publisher (snapshot in host memory, its default) fed the state on `device`: the same
    commits and the same delta/part bytes as from the CPU state, and the run reconstructs it."""
    states = [_state()]
    for v in range(1, 4):
        states.append(_stepped(states[-1], seed=v))
    runs = {}
    for where in ("cpu", device):
        url = str(tmp_path / f"run-{where}-{len(runs)}")
        with Publisher(url, part_bytes=part_bytes, anchor_every=0, anchor_fraction=1e9, writer="w") as pub:
            for v, s in enumerate(states):
                pub.publish(_on(s, where), v + 1)
            pub.flush()
        runs[len(runs)] = Run(url)
    a, b = runs[0].commits(), runs[1].commits()
    assert [c.version for c in a] == [c.version for c in b] == [1, 2, 3, 4]
    for ca, cb in zip(a, b):
        assert ca.state_digest == cb.state_digest
        assert [(o.size, o.xxh3) for o in ca.delta_objects()] == [(o.size, o.xxh3) for o in cb.delta_objects()], (
            ca.version
        )
    _bits_equal(runs[1].reconstruct(4)[1], states[3])


def test_the_special_patterns_are_what_the_tests_claim():
    """The fixtures really hold the specials (a guard against a silent numpy/torch cast)."""
    e = _state()["embed"].reshape(-1)[: len(SPECIAL_BF16)].view(torch.int16).numpy().view(np.uint16)
    assert e.tolist() == SPECIAL_BF16
    f = _state()["norm32"][-len(SPECIAL_F32):].view(torch.int32).numpy().view(np.uint32)
    assert f.tolist() == SPECIAL_F32
    assert struct.pack("<H", SPECIAL_BF16[1]) == b"\x00\x80"
