"""Applying a patch: validate everything, then write in place, then verify.

Guarantee (all-or-nothing): `decode_patch` checks, for every tensor the patch touches, that the
tensor exists, is contiguous, has the patch's dtype and shape, that every stream decodes to
exactly the declared size, that positions are in range, strictly increasing and unique, and
(optionally) that the tensor's bytes match the patch's base digest; only then does
`apply_patch` write anything. `apply_patch` checks the base digests of CPU tensors in the same
pass as its writes (and of CUDA tensors before them); if a base or a target digest does not
match, the old bits are restored before PatchMismatchError or DigestMismatchError is raised.
Works for CPU and CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

from sparsesync.codec import _container, _encodings, _parallel
from sparsesync.codec.diff import bits_view, put_bits, take_bits, to_np_bits
from sparsesync.codec.digest import put_and_digest, put_and_digests, tensor_digests
from sparsesync.codec.patch import Patch, TensorEntry, ctx_for
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError


@dataclass
class SparseUpdate:
    """The new values of one tensor's changed elements (what a sparse weight loader needs)."""

    indices: torch.Tensor  # int64, CPU, sorted unique flat (C-order) indices
    values: torch.Tensor  # the tensor's dtype, CPU, one per index


def _check_layout(patch: Patch, tensors: Mapping[str, torch.Tensor]) -> None:
    problems = []
    for name, e in patch.header.tensors.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"tensor '{name}': missing, expected {e.dtype} {list(e.shape)}")
            continue
        st = _container.TORCH_TO_ST.get(t.dtype, str(t.dtype))
        if st != e.dtype:
            problems.append(f"tensor '{name}': dtype {st}, expected {e.dtype}")
        if tuple(t.shape) != e.shape:
            problems.append(f"tensor '{name}': shape {list(t.shape)}, expected {list(e.shape)}")
        if not t.is_contiguous():
            problems.append(f"tensor '{name}': not contiguous (call `.contiguous()` on it first)")
    if problems:
        raise PatchMismatchError(
            f"patch {patch.header.base_version}->{patch.header.target_version} does not fit the tensors: " + "; ".join(problems),
            hint="apply the patch to the model it was made for (same names, dtypes and shapes)",
        )


def _decode_one(patch: Patch, e: TensorEntry, t: torch.Tensor) -> SparseUpdate:
    flat = bits_view(t)

    def base_bits(idx: np.ndarray | None) -> np.ndarray:
        if idx is None:
            return to_np_bits(flat)
        if ctx.base_at_positions is not None and ctx.base_at_positions[0] is idx:
            return ctx.base_at_positions[1]  # gathered by the positions decoder in its pass
        if flat.device.type == "cpu":
            return take_bits(to_np_bits(flat), idx)
        return to_np_bits(flat[torch.from_numpy(idx).to(flat.device)])

    ctx = ctx_for(e, base_bits, patch.header.format_version)
    streams = {role: patch.stream(e.name, role) for role in e.streams}
    try:
        idx = _encodings.POSITIONS[e.positions][1](e.position_params, streams, ctx)
        if e.positions not in ("dense", "gaps"):  # gaps decode to n_changed strictly increasing positions in range by construction
            idx = _encodings.check_indices(ctx, idx)
        vals = _encodings.VALUES[e.values][1](e.value_params, streams, idx, ctx)
    except PatchFormatError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, OverflowError) as err:
        raise PatchFormatError(
            f"tensor '{e.name}': {e.positions}/{e.values} streams do not decode ({type(err).__name__}: {err})",
            hint="the patch is corrupt; fetch it again",
        ) from None
    if vals.shape != idx.shape:
        raise PatchFormatError(f"tensor '{e.name}': {vals.size} values decoded, expected {idx.size}", hint="the patch is corrupt; fetch it again")
    if e.positions == "dense":  # report only what actually changes
        keep = vals != base_bits(None)
        idx, vals = np.flatnonzero(keep), vals[keep]
    values = torch.from_numpy(np.ascontiguousarray(vals).view(_signed(vals.dtype))).view(t.dtype)
    return SparseUpdate(torch.from_numpy(idx.astype(np.int64, copy=False)), values)


def _signed(dt: np.dtype) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[dt.itemsize])


def _mismatches(tensors: Mapping[str, torch.Tensor], want: Mapping[str, str]) -> list[str]:
    """One line per tensor of `want` (each present in `tensors`) whose bytes do not hash to its digest."""
    got = tensor_digests({n: tensors[n] for n in want})
    return [f"tensor '{n}': digest {got[n]}, expected {d}" for n, d in want.items() if got[n] != d]


def _listing(problems: list[str]) -> str:
    return "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")


def check_base_digests(patch: Patch, tensors: Mapping[str, torch.Tensor], *, known: Mapping[str, str] | None = None) -> None:
    """Raise PatchMismatchError naming every tensor the patch touches whose bytes do not hash to
    its base digest. Read-only; the tensors must be present (`_check_layout` first). `known`:
    digests of the tensors' base bytes already computed (by `write_updates`, before its writes);
    the others are hashed here."""
    known = known or {}
    want = {n: e.base_digest for n, e in patch.header.tensors.items()}
    bad = [f"tensor '{n}': digest {known[n]}, expected {d}" for n, d in want.items() if n in known and known[n] != d]
    bad += _mismatches(tensors, {n: d for n, d in want.items() if n not in known})
    if bad:
        raise PatchMismatchError(
            f"patch {patch.header.base_version}->{patch.header.target_version}: tensors are not at base version "
            f"{patch.header.base_version}: " + _listing(bad),
            hint=f"load version {patch.header.base_version} (anchor plus chain) before applying this patch",
        )


def decode_patch(patch: Patch, tensors: Mapping[str, torch.Tensor], *, check_base_digest: bool = True) -> dict[str, SparseUpdate]:
    """Decode and validate `patch` against `tensors` (read-only). Raises before returning if
    anything does not fit: PatchMismatchError (layout, base digest) or PatchFormatError (streams)."""
    _check_layout(patch, tensors)
    if check_base_digest:
        check_base_digests(patch, tensors)
    names = list(patch.header.tensors)  # sorted: the first failing tensor in name order is reported
    # biggest first keeps both threads busy to the end; errors are still raised in name order
    order = sorted(names, key=lambda n: (-patch.header.tensors[n].numel, n))
    with _parallel.gc_paused():
        results = _parallel.map_settled(lambda n: _decode_one(patch, patch.header.tensors[n], tensors[n]), order)
    by_name = dict(zip(order, results))
    for n in names:
        if isinstance(by_name[n], BaseException):
            raise by_name[n]
    return {n: by_name[n] for n in names}


def write_updates(
    tensors: MutableMapping[str, torch.Tensor], updates: Mapping[str, SparseUpdate], *, digests: dict[str, str] | None = None,
    base_digests: dict[str, str] | None = None,
) -> dict[str, SparseUpdate]:
    """Write `updates` into `tensors` in place (tensors in parallel on the codec's pool);
    returns the overwritten old values (for undo). With `digests`, the digest of every written
    CPU tensor is put there, hashed in the same pass over it as its writes (`put_and_digest`);
    with `base_digests` (and `digests`), also the digest each had before the writes, in that
    same pass (`put_and_digests`)."""

    def one(name: str) -> tuple[SparseUpdate, str | None, str | None]:
        u, t = updates[name], tensors[name]
        flat = bits_view(t)
        if flat.device.type == "cpu":
            bits = to_np_bits(flat)
            idx, vals = u.indices.numpy(), u.values.view(flat.dtype).numpy().view(bits.dtype)
            before = digest = None
            if digests is None:
                old = put_bits(bits, idx, vals, keep_old=True)
            else:
                old = np.empty(idx.size, dtype=bits.dtype)
                if base_digests is None:
                    digest = put_and_digest(bits, idx, vals, old)
                else:
                    before, digest = put_and_digests(bits, idx, vals, old)
            return SparseUpdate(u.indices, torch.from_numpy(old).view(flat.dtype).view(t.dtype)), digest, before
        idx = u.indices.to(flat.device)
        old_vals = flat[idx].cpu().view(t.dtype)
        flat[idx] = u.values.view(flat.dtype).to(flat.device)
        return SparseUpdate(u.indices, old_vals), None, None

    names = list(updates)
    done = dict(zip(names, _parallel.map_ordered(one, names)))
    if digests is not None:
        digests.update((n, d) for n, (_, d, _) in done.items() if d is not None)
    if base_digests is not None:
        base_digests.update((n, b) for n, (_, _, b) in done.items() if b is not None)
    return {n: old for n, (old, _, _) in done.items()}


def verify_digests(tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str], *, known: Mapping[str, str] | None = None) -> None:
    """Raise DigestMismatchError naming every tensor in `digests` that is missing or whose bytes
    do not match. `known`: digests of the tensors' current bytes already computed (by
    `write_updates`); the others are hashed here."""
    known = known or {}
    bad = [f"tensor '{n}': missing, expected digest {d}" for n, d in digests.items() if n not in tensors]
    bad += [f"tensor '{n}': digest {known[n]}, expected {d}" for n, d in digests.items() if n in tensors and n in known and known[n] != d]
    bad += _mismatches(tensors, {n: d for n, d in digests.items() if n in tensors and n not in known})
    if bad:
        raise DigestMismatchError(_listing(bad), hint="reload from the newest anchor and replay the chain")


def apply_patch(
    patch: Patch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool = True, check_base_digest: bool = True
) -> dict[str, SparseUpdate]:
    """Validate with `decode_patch`, write the target bits in place, then (if `verify`) check the
    target digests; on a mismatch the old bits are restored and DigestMismatchError raised.

    The base digests of CPU tensors are hashed in the pass that writes them (each block just
    before its writes, `put_and_digests`), not in a pass of their own first: a tensor that was
    not at the base gets its writes undone, every tensor's, and PatchMismatchError is raised, as
    it is when the check comes first (CUDA tensors: first). A patch whose streams do not decode
    against the tensors held is checked against the base digests before its PatchFormatError is
    raised, so a holder at the wrong version is told that, not that the patch is corrupt.

    `check_base_digest=False` skips hashing the base tensors, for a holder whose tensors are
    known to match the patch's base digests (e.g. verified when they were last written). With
    `verify` the result is still bit-exact or undone: the target digests cover every element,
    and a wrong base only changes which error is raised (DigestMismatchError, after undoing)."""
    if not (verify or check_base_digest):
        raise ValueError("apply_patch needs verify=True or check_base_digest=True: one of the digests must be checked")
    _check_layout(patch, tensors)
    in_pass = check_base_digest and all(tensors[n].device.type == "cpu" for n in patch.header.tensors)
    if check_base_digest and not in_pass:
        check_base_digests(patch, tensors)
    try:
        updates = decode_patch(patch, tensors, check_base_digest=False)
    except PatchFormatError:
        if in_pass:
            check_base_digests(patch, tensors)  # decoded against other weights: say that instead
        raise
    written: dict[str, str] = {}
    before: dict[str, str] = {}
    old = write_updates(tensors, updates, digests=written if (verify or in_pass) else None, base_digests=before if in_pass else None)
    try:
        if in_pass:
            check_base_digests(patch, tensors, known=before)
        if verify:
            verify_digests(tensors, {n: e.target_digest for n, e in patch.header.tensors.items()}, known=written)
    except PatchMismatchError:
        write_updates(tensors, old)
        raise
    except DigestMismatchError as err:
        write_updates(tensors, old)
        raise DigestMismatchError(
            f"patch {patch.header.base_version}->{patch.header.target_version} did not produce the target bits (undone): {err.message}",
            hint="the patch is corrupt or was made from different weights; fetch it again or reload from an anchor",
        ) from None
    return updates
