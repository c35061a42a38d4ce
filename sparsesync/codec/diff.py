"""Bitwise change detection between two versions of a model's tensors.

Guarantee: an element is reported changed iff its bit pattern changed (so -0.0 vs 0.0 and a
changed NaN payload count, an unchanged NaN does not). Works for every dtype by comparing
unsigned-integer views of the element bits, on CPU or CUDA. Memory stays bounded: tensors are
compared in slices of at most `chunk_bytes`, with one host transfer (one device sync) per chunk;
the only full-size data is what the caller passes in.

How: the slice is viewed as 64-bit words (4 bf16 lanes), words are compared and only the
changed words are resolved into lanes. On CPU this is one C pass (`_native.diff_into`) per
slice, slices on the codec's thread pool; on CUDA the same steps run in torch (`nonzero` over
the words).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from sparsesync.codec import _native, _parallel
from sparsesync.errors import PatchMismatchError

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class TensorChange:
    """The changed elements of one tensor between two versions."""

    dtype: torch.dtype  # the tensor's dtype (bf16, fp16, fp32, fp8, ...)
    shape: tuple[int, ...]  # the tensor's shape
    indices: np.ndarray  # int64, sorted, unique flat (C-order) indices of the changed elements
    base_bits: np.ndarray  # bit patterns at `indices` in the base, unsigned ints of the dtype's width
    target_bits: np.ndarray  # bit patterns at `indices` in the target, same dtype as base_bits

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_changed(self) -> int:
        return int(self.indices.size)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s flat element bits as a signed int tensor of the same width (no copy if contiguous)."""
    if t.element_size() not in _INT_VIEW:
        raise PatchMismatchError(f"dtype {t.dtype}: element size {t.element_size()} B, expected 1, 2, 4 or 8")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def np_uint_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy unsigned dtype holding one element's bits of `dtype`."""
    return np.dtype(_NP_UINT[dtype.itemsize])


def to_np_bits(t: torch.Tensor) -> np.ndarray:
    """A CPU int view tensor as its numpy unsigned bits (no copy)."""
    t = t.cpu()
    if t.dtype == torch.uint8:
        return t.numpy()
    return t.numpy().view(_NP_UINT[t.element_size()])


def take_bits(src: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`src[idx]` for contiguous element bits and int64 indices (one C pass, the GIL released;
    IndexError naming the first index out of range)."""
    out = np.empty(idx.size, dtype=src.dtype)
    _native.take(src, src.dtype.itemsize, np.ascontiguousarray(idx, dtype=np.int64), out)
    return out


def put_bits(dst: np.ndarray, idx: np.ndarray, values: np.ndarray, *, keep_old: bool = False) -> np.ndarray | None:
    """`dst[idx] = values` in place (one C pass, the GIL released); every index is checked
    before the first write. With `keep_old`, returns the overwritten bits."""
    old = np.empty(idx.size if keep_old else 0, dtype=dst.dtype)
    _native.put(
        dst,
        dst.dtype.itemsize,
        np.ascontiguousarray(idx, dtype=np.int64),
        np.ascontiguousarray(values).view(dst.dtype),
        old,
    )
    return old if keep_old else None


def check_compatible(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
    """Raise PatchMismatchError naming every missing/extra tensor and every shape/dtype mismatch."""
    problems = []
    missing = sorted(set(base) - set(target))
    extra = sorted(set(target) - set(base))
    if missing:
        problems.append(f"missing from target: {missing}")
    if extra:
        problems.append(f"not in base: {extra}")
    for name in sorted(set(base) & set(target)):
        b, t = base[name], target[name]
        if b.dtype != t.dtype:
            problems.append(f"tensor '{name}': dtype {t.dtype}, expected {b.dtype}")
        if tuple(b.shape) != tuple(t.shape):
            problems.append(f"tensor '{name}': shape {tuple(t.shape)}, expected {tuple(b.shape)}")
    if problems:
        raise PatchMismatchError(
            "base and target states differ in layout: " + "; ".join(problems),
            hint="diff two versions of the same model (same names, shapes and dtypes)",
        )


def _changed_slice_np(a: np.ndarray, b: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_changed_slice` for CPU slices as numpy arrays of the same unsigned dtype, indices plus
    `offset` (one C pass; outputs start at 1/32 of the slice, which covers a typical RL step in
    one go; when they fill, they grow once to the size the density so far predicts for the
    whole slice, so only the part found so far is copied; outputs less than half full are
    copied to their size)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)

    def run(start: int, oi: np.ndarray, oa: np.ndarray, ob: np.ndarray) -> tuple[int, int]:
        return _native.diff_into(a, b, a.itemsize, start, offset, oi, oa, ob)

    return _grown_outputs(run, a.size, a.dtype)


def _grown_outputs(
    run: Callable[[int, np.ndarray, np.ndarray, np.ndarray], tuple[int, int]], n: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The outputs of a resumable native diff over `n` elements: `run(start, out_idx, out_a,
    out_b)` diffs from element `start` until its outputs fill, returning (count, next start);
    the outputs grow as `_changed_slice_np` says."""
    k, start = 0, 0
    cap = min(n, max(4096, n >> 5))
    oi, oa, ob = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=dtype), np.empty(cap, dtype=dtype)
    while True:
        got, start = run(start, oi[k:], oa[k:], ob[k:])
        k += got
        if start >= n:
            break
        cap = min(n, k + int((n - start) * k / max(1, start) * 1.25) + 4096)
        grown = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=dtype), np.empty(cap, dtype=dtype)
        for new, old in zip(grown, (oi, oa, ob)):
            new[:k] = old[:k]
        oi, oa, ob = grown
    return (oi[:k], oa[:k], ob[:k]) if 2 * k >= cap else (oi[:k].copy(), oa[:k].copy(), ob[:k].copy())


def diff_members(
    base: np.ndarray, members: list[np.ndarray], offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_changed_slice_np(base, concatenation of members)` without the concatenation: `base`
    holds the members' concatenation (contiguous element bits), `members` the current bits of
    each (C-contiguous, `base`'s width; `offsets`: where each starts in `base`, then its size).
    Returns the flat indices, both sides' bits and each member's count of changes (int64), from
    one native pass over the member list (`_native.members_diff`, the GIL released)."""
    counts = np.zeros(len(members), dtype=np.int64)
    where = offsets.tolist()
    w = base.itemsize

    def run(start: int, oi: np.ndarray, oa: np.ndarray, ob: np.ndarray) -> tuple[int, int]:
        m = bisect.bisect_right(where, start, 0, len(members)) - 1 if start else 0
        got, m, e = _native.members_diff(base, members, w, m, start - where[m] if start else 0, oi, oa, ob, counts)
        return got, where[m] + e

    i, a, b = _grown_outputs(run, base.size, base.dtype)
    return i, a, b, counts


def _changed_slice(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Changed positions (int64, relative to the slice, sorted) and base/target bits of two slices."""
    esize = a.element_size()
    lanes = 8 // esize
    n = a.numel()
    parts_i, parts_a, parts_b = [], [], []
    nw = n // lanes if lanes > 1 else 0
    if nw and a.storage_offset() % lanes == 0 and b.storage_offset() % lanes == 0:
        wa = a[: nw * lanes].view(torch.int64)
        wb = b[: nw * lanes].view(torch.int64)
        wi = torch.nonzero(wa != wb).squeeze(1)
        if wi.numel():
            la = a[: nw * lanes].view(nw, lanes)[wi]
            lb = b[: nw * lanes].view(nw, lanes)[wi]
            m = la != lb  # (k, lanes): row-major masking keeps the flat order sorted
            pos = (wi.unsqueeze(1) * lanes + torch.arange(lanes, device=a.device))[m]
            parts_i.append(pos)
            parts_a.append(la[m])
            parts_b.append(lb[m])
        start = nw * lanes
    else:
        start = 0
    if start < n:
        ta, tb = a[start:], b[start:]
        pos = torch.nonzero(ta != tb).squeeze(1)
        parts_i.append(pos + start)
        parts_a.append(ta[pos])
        parts_b.append(tb[pos])
    if not parts_i:
        empty = a[:0]
        return torch.empty(0, dtype=torch.int64, device=a.device), empty, empty
    if len(parts_i) == 1:
        return parts_i[0], parts_a[0], parts_b[0]
    return torch.cat(parts_i), torch.cat(parts_a), torch.cat(parts_b)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


CAST_SLICE = 1 << 20  # elements of a target in another dtype cast at once (2 MB of bf16, per thread)


_SCRATCH = threading.local()


def _cast_scratch(dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer of `CAST_SLICE` elements of `dtype`, reused for every slice it casts:
    a fresh tensor per slice left glibc's heap fragmented by the small change arrays kept in
    between (RSS grew by a whole model copy over two versions)."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    if dtype not in bufs:
        bufs[dtype] = torch.empty(CAST_SLICE, dtype=dtype)
    return bufs[dtype]


def diff_cpu_tensor(base: torch.Tensor, target: torch.Tensor, *, chunk_bytes: int = 256 << 20) -> TensorChange | None:
    """The changed elements of one pair of contiguous CPU tensors of the same shape (None if none
    changed); slices of `chunk_bytes` are compared on the codec's chunk pool. A floating `target`
    in another dtype than a floating `base` is compared as `target.to(base.dtype)`, cast one slice
    of at most `CAST_SLICE` elements at a time (no cast copy of the whole tensor)."""
    a = to_np_bits(bits_view(base))
    step = max(8, (chunk_bytes // a.itemsize) // 8 * 8)
    if target.dtype == base.dtype:
        b = to_np_bits(bits_view(target))

        def one(s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return _changed_slice_np(a[s : s + step], b[s : s + step], s)
    else:
        if not (base.is_floating_point() and target.is_floating_point()) or target.numel() != base.numel():
            raise PatchMismatchError(f"cannot compare a {target.dtype} tensor of shape {tuple(target.shape)} "
                                     f"with a {base.dtype} one of shape {tuple(base.shape)}")
        step, src = min(step, CAST_SLICE), target.detach().reshape(-1)

        def one(s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            part = src[s : s + step]
            buf = _cast_scratch(base.dtype)[: part.numel()]
            buf.copy_(part)  # the same rounding as `.to(base.dtype)`
            return _changed_slice_np(a[s : s + step], to_np_bits(bits_view(buf)), s)  # its outputs are copies
    starts = list(range(0, a.size, step))
    found = _parallel.map_ordered(one, starts, "chunks")
    return _change_of(base, found)


def _change_of(t: torch.Tensor, found: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> TensorChange | None:
    """The change of tensor `t` from its slices' (indices, base bits, target bits), in order;
    None if no slice changed."""
    parts = [p for p in found if p[0].size]
    if not parts:
        return None
    return TensorChange(t.dtype, tuple(t.shape), _joined([p[0] for p in parts]).astype(np.int64, copy=False),
                        _joined([p[1] for p in parts]), _joined([p[2] for p in parts]))


# the sliced diff loop (CPU or CUDA, one or two devices, native or torch pass) over one set of per-slice buffers it
# reuses
def diff_state(  # noqa: C901, PLR0915
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    *,
    chunk_bytes: int = 256 << 20,
) -> dict[str, TensorChange]:
    """The changed elements of every tensor with at least one changed element.

    `base` and `target` must hold the same names, shapes and dtypes (else PatchMismatchError
    naming every difference). Tensors may live on CPU or CUDA; when a pair sits on two devices,
    the target is moved to the base's device one slice at a time.
    Work is done in slices of at most `chunk_bytes` bytes per side.
    """
    check_compatible(base, target)
    if chunk_bytes < 8:
        raise ValueError(f"chunk_bytes={chunk_bytes}, expected at least 8")
    out: dict[str, TensorChange] = {}
    # pending slices of one chunk: moved to host together (one sync per chunk on CUDA)
    pending: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    pending_bytes = 0
    results: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    cpu_jobs: list[tuple[str, int, np.ndarray, np.ndarray]] = []  # (name, start, base bits, target bits)

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        if pending[0][2].device.type != "cpu":
            # one copy to host per bit width: torch.cat would promote int16 bits beside int32 ones
            widths: dict[torch.dtype, list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
            for p in pending:
                widths.setdefault(p[3].dtype, []).append(p)
            for group in widths.values():
                sizes = [p[2].numel() for p in group]
                idx_all = torch.cat([p[2] + p[1] for p in group]).cpu()
                a_all = torch.cat([p[3] for p in group]).cpu()
                b_all = torch.cat([p[4] for p in group]).cpu()
                off = 0
                for (name, _, _, _, _), k in zip(group, sizes):
                    results.setdefault(name, []).append(
                        (
                            idx_all[off : off + k].numpy(),
                            to_np_bits(a_all[off : off + k]),
                            to_np_bits(b_all[off : off + k]),
                        )
                    )
                    off += k
        else:
            for name, start, idx, a, b in pending:
                results.setdefault(name, []).append(((idx + start).numpy(), to_np_bits(a), to_np_bits(b)))
        pending = []
        pending_bytes = 0

    for name in base:
        bt, tt = base[name], target[name]
        a, b = bits_view(bt), bits_view(tt)
        esize = a.element_size()
        step = max(8, (chunk_bytes // esize) // 8 * 8)
        for start in range(0, a.numel(), step):
            sa, sb = a[start : start + step], b[start : start + step]
            moved = sb.device != sa.device
            if moved:  # e.g. live weights on GPU, snapshot on CPU: move one slice
                sb = sb.to(sa.device)
            if sa.device.type == "cpu":
                # temporaries: compare now, keep only the changes
                if moved or not (bt.is_contiguous() and tt.is_contiguous()):
                    i_np, a_np, b_np = _changed_slice_np(to_np_bits(sa), to_np_bits(sb), start)
                    if i_np.size:
                        results.setdefault(name, []).append((i_np, a_np, b_np))
                else:  # views of the caller's tensors: compared on the thread pool below
                    cpu_jobs.append((name, start, to_np_bits(sa), to_np_bits(sb)))
                continue
            idx, va, vb = _changed_slice(sa, sb)
            if idx.device.type == "cpu" and idx.numel() == 0:
                continue
            pending.append((name, start, idx, va, vb))
            pending_bytes += sa.numel() * esize
            if pending_bytes >= chunk_bytes:
                flush()
    flush()
    cpu_out = _parallel.map_ordered(lambda j: _changed_slice_np(j[2], j[3], j[1]), cpu_jobs)
    for (name, _, _, _), (i_np, a_np, b_np) in zip(cpu_jobs, cpu_out):  # in (tensor, slice) order
        if i_np.size:
            results.setdefault(name, []).append((i_np, a_np, b_np))

    for name in base:
        change = _change_of(base[name], results.get(name, []))
        if change is not None:
            out[name] = change
    return out


def compose_changes(
    older: Mapping[str, TensorChange], newer: Mapping[str, TensorChange]
) -> dict[str, TensorChange]:
    """Compose B->B+1 (`older`) with B+1->B+2 (`newer`) into B->B+2.

    Per tensor: the union of changed positions; base bits from `older` where it has them (else
    from `newer`, whose base equals B there); target bits from `newer` where it has them (else
    from `older`). Elements whose bits returned to their base value are dropped.
    """
    out: dict[str, TensorChange] = {}
    for name in list(older) + [n for n in newer if n not in older]:
        o, n = older.get(name), newer.get(name)
        if o is None or n is None:
            c = o if o is not None else n
            assert c is not None
            out[name] = c
            continue
        if o.dtype != n.dtype or tuple(o.shape) != tuple(n.shape):
            raise PatchMismatchError(
                f"tensor '{name}': newer change is {n.dtype} {tuple(n.shape)}, expected {o.dtype} {tuple(o.shape)}",
                hint="compose changes of consecutive versions of the same model",
            )
        idx = np.union1d(o.indices, n.indices)
        base_bits = np.empty(idx.size, dtype=o.base_bits.dtype)
        target_bits = np.empty(idx.size, dtype=o.base_bits.dtype)
        in_o = np.isin(idx, o.indices, assume_unique=True)
        in_n = np.isin(idx, n.indices, assume_unique=True)
        base_bits[in_o] = o.base_bits
        base_bits[~in_o] = n.base_bits[np.isin(n.indices, idx[~in_o], assume_unique=True)]
        target_bits[in_n] = n.target_bits
        target_bits[~in_n] = o.target_bits[np.isin(o.indices, idx[~in_n], assume_unique=True)]
        keep = base_bits != target_bits
        if keep.any():
            out[name] = TensorChange(o.dtype, tuple(o.shape), idx[keep], base_bits[keep], target_bits[keep])
    return out
