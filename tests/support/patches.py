"""Codec test helpers (from the former tests/test_codec.py, names kept so the tests read as before):
random (base, target) pairs with special values, a checked round trip, patches forced to one
encoding, the golden patch, small encoded cases and a raw (uncompressed) form, and `_rejects`:
the error names what it must and no tensor changed."""

from __future__ import annotations

import pytest
import torch

from sparsesync.codec import (
    DEFAULT_ALGO,
    _container,
    apply_patch,
    diff_state,
    encode_changes,
    read_patch,
    state_digest,
    tensor_digest,
    tensor_digests,
)
from sparsesync.codec import _encodings as E
from sparsesync.codec.diff import TensorChange, bits_view, np_uint_dtype, to_np_bits
from sparsesync.codec.patch import EncodedTensor, assemble_patch

DTYPES = [torch.bfloat16, torch.float16, torch.float32] + [
    d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d
]


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


# bf16: +-0, +-inf, NaNs, subnormals, max
SPECIAL16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x0001, 0x8001, 0x7F7F]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), k


def make_pair(
    seed: int, dtype: torch.dtype, shape: tuple[int, ...], density: float, special: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.empty((), dtype=dtype).element_size()
    base = (
        (torch.randn(shape, generator=g) * 0.02).to(dtype)
        if dtype.is_floating_point and w > 1
        else torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    )
    ib = bits(base).reshape(-1).clone()
    n = ib.numel()
    k = int(round(density * n))
    tgt = ib.clone()
    if k:
        idx = torch.randperm(n, generator=g)[:k]
        step = torch.randint(1, 4, (k,), generator=g) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
        if w == 1:
            tgt[idx] = (tgt[idx].to(torch.int32) + step).remainder(256).to(torch.uint8)
        else:
            tgt[idx] = (tgt[idx].to(torch.int64) + step).to(tgt.dtype)
        big = torch.rand(k, generator=g) < 0.05  # some large jumps (escapes)
        tgt[idx[big]] = torch.randint(0, 1 << min(8 * w - 1, 15), (int(big.sum()),), generator=g).to(tgt.dtype)
    if special and w == 2 and n:
        sp = torch.tensor([x - 65536 if x >= 32768 else x for x in SPECIAL16], dtype=torch.int16)
        m = min(n, sp.numel())
        ib[:m] = sp[:m]
        tgt[:m] = sp.roll(1)[:m]
    return ib.view(dtype).reshape(shape), tgt.view(dtype).reshape(shape)


def roundtrip(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *, with_base: bool = True) -> bytes:
    changes = diff_state(base, target)
    bd, td = tensor_digests(base), tensor_digests(target)
    data = encode_changes(
        changes, base_version=3, target_version=4, base_digests=bd, target_digests=td,
        base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base if with_base else None,
    )
    work = {k: v.clone() for k, v in base.items()}
    apply_patch(read_patch(data), work)
    assert_bit_equal(work, target)
    return data


def _forced(
    change: TensorChange, base: torch.Tensor, pos: str, val: str, thresholds: list[int], algo: str = DEFAULT_ALGO
) -> bytes:
    st_name = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}[change.dtype]
    ctx = E.Ctx("x", st_name, np_uint_dtype(change.dtype), change.numel, change.n_changed, None)
    base_full = to_np_bits(bits_view(base))
    idx = change.indices
    if pos == "gaps":
        pp, ps = E._gaps_enc(idx, ctx, thresholds, change.base_bits, base_full)
    else:
        pp, ps = E.POSITIONS[pos][0](idx, ctx)
    if pos == "dense":
        tgt = base_full.copy()
        tgt[idx] = change.target_bits
        vp, vs = (
            E._delta_enc(base_full, tgt, ctx, thresholds) if val == "delta" else E._raw_val_enc(base_full, tgt, ctx)
        )
    else:
        vp, vs = (
            E._delta_enc(change.base_bits, change.target_bits, ctx, thresholds)
            if val == "delta"
            else E._raw_val_enc(change.base_bits, change.target_bits, ctx)
        )
    enc = {"x": EncodedTensor(st_name, change.shape, change.n_changed, pos, pp, val, vp, {**ps, **vs})}
    d = tensor_digest(base, algo)
    return assemble_patch(
        enc,
        base_version=0,
        target_version=1,
        base_digests={"x": d},
        target_digests={"x": d[:-16] + "0" * 16},
        base_state_digest=d,
        target_state_digest=d,
    )


def _golden_patch(algo: str = "xxh3") -> bytes:
    """The worked example of docs/format.md: format 3 with "xxh3" digests (format 4 with "xxh3b")."""
    base = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.0, 8.0, 0.25], dtype=torch.bfloat16)
    tgt = base.clone()
    bits(tgt)[[1, 4, 5]] += torch.tensor([1, -1, 1], dtype=torch.int16)
    ch = diff_state({"w": base}, {"w": tgt})
    bd, td = tensor_digests({"w": base}, algo), tensor_digests({"w": tgt}, algo)
    return encode_changes(
        ch,
        base_version=7,
        target_version=8,
        base_digests=bd,
        target_digests=td,
        base_state_digest=state_digest(bd),
        target_state_digest=state_digest(td),
    )


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _encode(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *, with_base: bool = True) -> bytes:
    bd, td = tensor_digests(base), tensor_digests(target)
    return encode_changes(
        diff_state(base, target), base_version=3, target_version=4, base_digests=bd, target_digests=td,
        base_state_digest=state_digest(bd), target_state_digest=state_digest(td), base=base if with_base else None,
    )


def _case() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two tensors: 'a' (valid everywhere, sorted first: it would be written first) and 'x'
    (the one the tests break)."""
    ba, ta = make_pair(11, torch.bfloat16, (40, 50), 0.05)
    bx, tx = make_pair(12, torch.bfloat16, (60, 70), 0.05)
    return {"a": ba, "x": bx}, {"a": ta, "x": tx}


def _raw_patch(base: dict[str, torch.Tensor], target: dict[str, torch.Tensor], *, short_values: str = "") -> bytes:
    """Every tensor as raw_i32 positions + raw values (the TRL/vLLM form), with true digests.
    `short_values` names a tensor whose values stream loses its last element."""
    enc = {}
    for name, ch in diff_state(base, target).items():
        st_name = _container.st_dtype_name(ch.dtype)
        vals = ch.target_bits[:-1] if name == short_values else ch.target_bits
        enc[name] = EncodedTensor(st_name, ch.shape, ch.n_changed, "raw_i32", {}, "raw", {}, {
            "indices": ("I32", (ch.n_changed,), ch.indices.astype("<i4").tobytes()),
            "values": (st_name, (vals.size,), vals.tobytes()),
        })
    bd, td = tensor_digests(base), tensor_digests(target)
    return assemble_patch(
        enc,
        base_version=3,
        target_version=4,
        base_digests=bd,
        target_digests=td,
        base_state_digest=state_digest(bd),
        target_state_digest=state_digest(td),
    )


def _span(data: bytes, key: str) -> tuple[int, int]:
    """Absolute byte range of stream `key` ('<tensor>::<role>') in the file."""
    s = read_patch(data)._streams[key]
    return s.start, s.end


def _rejects(data: bytes, tensors: dict[str, torch.Tensor], exc: type[Exception], *needles: str) -> Exception:
    """read + apply `data` raises `exc` whose message holds every needle; tensors keep every bit."""
    before = _clone(tensors)
    with pytest.raises(exc) as e:
        apply_patch(read_patch(data), tensors)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
    assert_bit_equal(tensors, before)
    return e.value


def _classed_case() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A pure-bf16 step: changes depend on the base magnitude, so the class-conditioned codes win."""
    g = torch.Generator().manual_seed(0)
    b = (torch.randn(64, 128, generator=g) * 0.02).to(torch.bfloat16)
    return {"w": b}, {"w": (b.float() - torch.randn(b.shape, generator=g).clamp(-1, 1) * 2e-5).to(torch.bfloat16)}
