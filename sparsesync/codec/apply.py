"""Applying a patch: decode and validate, write in place, verify; all or nothing.

Guarantee (all-or-nothing): `decode_patch` checks, for every tensor the patch touches, that the
tensor exists, is contiguous, has the patch's dtype and shape, that every stream decodes to
exactly the declared size, that positions are in range, strictly increasing and unique, and
(optionally) that the tensor's bytes match the patch's base digest, writing nothing.
`apply_patch` makes the same checks and the digest checks, and writes: CPU tensors are each
written as soon as they are decoded (while in cache) and hashed in the pass that writes them;
other devices' through `device_apply` (compact updates copied there, digests checked there;
"xxh3" runs: only after every check). Whatever fails (a stream, a base digest, a target digest),
every tensor's old bits are restored before the error (PatchFormatError, PatchMismatchError or
DigestMismatchError) is raised. Works for CPU and CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from sparsesync.codec import _container, _parallel
from sparsesync.codec._decode import decode_bits, tensor_base
from sparsesync.codec._group_read import decode_group, member_ptrs
from sparsesync.codec._group_write import GroupWrite, member_updates, write_group
from sparsesync.codec.diff import bits_view, put_bits, to_np_bits
from sparsesync.codec.digest import (
    BLOCKS_ALGO,
    DEFAULT_ALGO,
    algo_of,
    algos_of,
    put_and_digest,
    put_and_digests,
    tensor_digests,
)
from sparsesync.codec.patch import GROUPED, Group, Patch, PatchHeader, TensorEntry
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError, some_of

Written = Callable[[torch.Tensor], object]  # told of each tensor once its writes are done
DEVICE_PATH: list[Callable[..., dict[str, SparseUpdate]]] = []  # `device_apply` registers itself (codec/__init__)
R = TypeVar("R")


@dataclass
class SparseUpdate:
    """The new values of one tensor's changed elements (what a sparse weight loader needs)."""

    indices: torch.Tensor  # int64, CPU, sorted unique flat (C-order) indices
    values: torch.Tensor  # the tensor's dtype, CPU, one per index


def _check_layout(patch: Patch, tensors: Mapping[str, torch.Tensor]) -> bool:
    """PatchMismatchError unless every tensor the patch touches is present, contiguous and of
    its entry's dtype and shape; returns whether they are all on the CPU. One comparison of
    two lists when they fit (no Python call per tensor but `is_contiguous`)."""
    entries = patch.header.tensors
    try:
        ts = [tensors[n] for n in entries]
    except KeyError:
        ts = []
    if len(ts) == len(entries):
        st = _container.ST_DTYPES
        if [(t.dtype, t.shape, t.is_contiguous()) for t in ts] == [
            (st[e.dtype][0], e.shape, True) for e in entries.values()
        ]:
            return all([t.device.type == "cpu" for t in ts])
    _layout_problems(patch, tensors)
    return all(tensors[n].device.type == "cpu" for n in entries)


def _layout_problems(patch: Patch, tensors: Mapping[str, torch.Tensor]) -> None:
    """`_check_layout`'s error, naming every tensor that does not fit (none: returns)."""
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
            f"patch {patch.header.base_version}->{patch.header.target_version} does not fit the tensors: "
            + some_of(problems),
            hint="apply the patch to the model it was made for (same names, dtypes and shapes)",
        )


def _decode_one(patch: Patch, e: TensorEntry, t: torch.Tensor) -> SparseUpdate:
    idx, vals = decode_bits(patch, e, tensor_base(bits_view(t)))
    values = torch.from_numpy(np.ascontiguousarray(vals).view(_signed(vals.dtype))).view(t.dtype)
    return SparseUpdate(torch.from_numpy(idx.astype(np.int64, copy=False)), values)


def _signed(dt: np.dtype) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[dt.itemsize])


def _mismatches(
    tensors: Mapping[str, torch.Tensor], want: Mapping[str, str], known: Mapping[str, str] | None = None
) -> list[str]:
    """One line per tensor of `want` (each present in `tensors`) whose bytes do not hash to its
    digest, in that digest's algorithm; `known`: digests already computed for some of them (the
    rest, and any known in another algorithm, are hashed here)."""
    algos = algos_of(want)
    known_algos = algos_of(known or {})
    known = {n: d for n, d in (known or {}).items() if n in algos and known_algos[n] == algos[n]}
    got = {**known, **tensor_digests({n: tensors[n] for n in want if n not in known}, algos)}
    return [f"tensor '{n}': digest {got[n]}, expected {d}" for n, d in want.items() if got[n] != d]


def _listing(problems: list[str]) -> str:
    return "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")


def check_base_digests(
    patch: Patch, tensors: Mapping[str, torch.Tensor], *, known: Mapping[str, str] | None = None
) -> None:
    """Raise PatchMismatchError naming every tensor the patch touches whose bytes do not hash to
    its base digest. Read-only; the tensors must be present (`_check_layout` first). `known`:
    digests of the tensors' base bytes already computed (by `apply_patch`'s write pass, before
    each block's writes); the others are hashed here."""
    bad = _mismatches(tensors, {n: e.base_digest for n, e in patch.header.tensors.items()}, known)
    if bad:
        raise PatchMismatchError(
            f"patch {patch.header.base_version}->{patch.header.target_version}: tensors are not at base version "
            f"{patch.header.base_version}: " + _listing(bad),
            hint=f"load version {patch.header.base_version} (anchor plus chain) before applying this patch",
        )


def _units(patch: Patch) -> tuple[list[str | Group], list[str | Group]]:
    """What decodes on its own: every tensor coded alone (by name) and every group; (in name
    order, the first failing one is reported; biggest first, which keeps both threads busy)."""
    h = patch.header
    units: list[str | Group] = sorted(
        [*(n for n, e in h.tensors.items() if e.positions != GROUPED), *h.groups], key=_unit_name
    )
    return units, sorted(units, key=lambda u: (-_unit_numel(patch, u), _unit_name(u)))


def _unit_name(u: str | Group) -> str:
    return u if isinstance(u, str) else u.coding.name


def _unit_numel(patch: Patch, u: str | Group) -> int:
    return patch.header.tensors[u].numel if isinstance(u, str) else u.coding.numel


def _run_units(patch: Patch, fn: Callable[[str | Group], R]) -> list[tuple[str | Group, R | BaseException]]:
    """`fn` of every unit on the codec's pool (biggest first), as (unit, result or the exception
    it raised) in name order."""
    names, order = _units(patch)
    with _parallel.gc_paused():
        results = _parallel.map_settled(fn, order, weights=[_unit_numel(patch, u) for u in order])
    by_unit = {_unit_name(u): r for u, r in zip(order, results)}
    return [(u, by_unit[_unit_name(u)]) for u in names]


def _group_ptrs(g: Group, tensors: Mapping[str, torch.Tensor]) -> np.ndarray | None:
    """The members' addresses if they are all on the CPU, else None."""
    ts = [tensors[n] for n in g.members]
    return member_ptrs(ts) if all([t.device.type == "cpu" for t in ts]) else None


def decode_patch(
    patch: Patch, tensors: Mapping[str, torch.Tensor], *, check_base_digest: bool = True
) -> dict[str, SparseUpdate]:
    """Decode and validate `patch` against `tensors` (read-only). Raises before returning if
    anything does not fit: PatchMismatchError (layout, base digest) or PatchFormatError (streams)."""
    _check_layout(patch, tensors)
    if check_base_digest:
        check_base_digests(patch, tensors)

    def one(u: str | Group) -> dict[str, SparseUpdate]:
        if isinstance(u, str):
            return {u: _decode_one(patch, patch.header.tensors[u], tensors[u])}
        idx, vals, cuts = decode_group(patch, u, tensors, _group_ptrs(u, tensors))
        per_member = member_updates(idx, vals, u.offsets, cuts, tensors[u.members[0]].dtype)
        return dict(zip(u.members, map(SparseUpdate, *per_member)))

    out: dict[str, SparseUpdate] = {}
    for _, r in _run_units(patch, one):
        if isinstance(r, BaseException):
            raise r
        out.update(r)
    return {n: out[n] for n in patch.header.tensors}


def patch_algo(header: PatchHeader) -> str:
    """The algorithm of a patch's digests (its state digest's form: "xxh3b" from format 5 on)."""
    return algo_of(header.target_state_digest)


def _write_one(
    t: torch.Tensor, u: SparseUpdate, *, digest: bool, before: bool, algo: str = DEFAULT_ALGO
) -> tuple[SparseUpdate, str | None, str | None]:
    """Write `u` into `t`; (the overwritten old values, the digest after the writes if `digest`,
    the digest before them if `before`), both hashed in `algo` in the pass that writes (CPU
    tensors only: a CUDA tensor's digests are None)."""
    flat = bits_view(t)
    if flat.device.type == "cpu":
        bits = to_np_bits(flat)
        idx, vals = u.indices.numpy(), u.values.view(flat.dtype).numpy().view(bits.dtype)
        h_before = h_after = None
        if not (digest or before):
            old = put_bits(bits, idx, vals, keep_old=True)
        else:
            old = np.empty(idx.size, dtype=bits.dtype)
            if before:
                h_before, h_after = put_and_digests(bits, idx, vals, old, algo)
            else:
                h_after = put_and_digest(bits, idx, vals, old, algo)
        return (
            SparseUpdate(u.indices, torch.from_numpy(old).view(flat.dtype).view(t.dtype)),
            h_after if digest else None,
            h_before,
        )
    at = u.indices.to(flat.device)
    old_vals = flat[at].cpu().view(t.dtype)
    flat[at] = u.values.view(flat.dtype).to(flat.device)
    return SparseUpdate(u.indices, old_vals), None, None


def write_updates(
    tensors: MutableMapping[str, torch.Tensor],
    updates: Mapping[str, SparseUpdate],
    *,
    digests: dict[str, str] | None = None,
    written: Written | None = None,
    algo: str | Mapping[str, str] = DEFAULT_ALGO,
) -> dict[str, SparseUpdate]:
    """Write `updates` into `tensors` in place (tensors in parallel on the codec's pool);
    returns the overwritten old values (for undo). With `digests`, the digest of every written
    CPU tensor is put there, hashed in the same pass over it as its writes (`put_and_digest`), in
    `algo` (one for all, or by name: the algorithm of the digest it will be checked against).
    `written` is called with each tensor once its writes (and hashing) are done."""
    names = list(updates)

    def one(n: str) -> tuple[SparseUpdate, str | None, str | None]:
        r = _write_one(
            tensors[n],
            updates[n],
            digest=digests is not None,
            before=False,
            algo=algo if isinstance(algo, str) else algo.get(n, DEFAULT_ALGO),
        )
        if written is not None:
            written(tensors[n])
        return r

    done = dict(zip(names, _parallel.map_ordered(one, names)))
    if digests is not None:
        digests.update((n, d) for n, (_, d, _) in done.items() if d is not None)
    return {n: old for n, (old, _, _) in done.items()}


def verify_digests(
    tensors: Mapping[str, torch.Tensor], digests: Mapping[str, str], *, known: Mapping[str, str] | None = None
) -> None:
    """Raise DigestMismatchError naming every tensor in `digests` that is missing or whose bytes
    do not match. `known`: digests of the tensors' current bytes already computed (by
    `write_updates`); the others are hashed here."""
    bad = [f"tensor '{n}': missing, expected digest {d}" for n, d in digests.items() if n not in tensors]
    bad += _mismatches(tensors, {n: d for n, d in digests.items() if n in tensors}, known)
    if bad:
        raise DigestMismatchError(_listing(bad), hint="reload from the newest anchor and replay the chain")


def apply_patch(
    patch: Patch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool = True, check_base_digest: bool = True,
    written: Written | None = None,
) -> dict[str, SparseUpdate]:
    """Validate, write the target bits in place, then (if `verify`) check the target digests;
    on a mismatch the old bits are restored and DigestMismatchError raised.

    CPU tensors: each is decoded and validated, then written at once, while its bytes are still
    in cache, and hashed in that same pass, each block of 2 MiB just before its writes (the base
    digest) and after them (the target digest). Any failure, in any tensor, restores the old bits
    of every tensor written before it is raised: a stream that does not decode, a base digest
    that does not match (PatchMismatchError), a target digest that does not match
    (DigestMismatchError). A patch whose streams do not decode against tensors that are not at
    its base is reported as PatchMismatchError (the weights are at the wrong version), not as a
    corrupt patch. CUDA tensors: the base digests, then every stream, are checked before the first
    write (`decode_patch`).

    `check_base_digest=False` skips hashing the base tensors, for a holder whose tensors are
    known to match the patch's base digests (e.g. verified when they were last written). With
    `verify` the result is still bit-exact or undone: the target digests cover every element,
    and a wrong base only changes which error is raised (DigestMismatchError, after undoing).

    A Ctrl-C in the main thread is raised once the writes are done or undone
    (`_parallel.interrupts_deferred`): the tensors are then at the base or at the target, never between.

    `written` is called with each tensor once its new bits are written and hashed (a holder may
    then page it out: the follower's mirror does); an undo may write it again afterwards."""
    if not (verify or check_base_digest):
        raise ValueError("apply_patch needs verify=True or check_base_digest=True: one of the digests must be checked")
    with _parallel.interrupts_deferred():  # a Ctrl-C waits for the writes or their undo
        return _apply(patch, tensors, verify=verify, check_base_digest=check_base_digest, written=written)


def _apply(patch: Patch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool, check_base_digest: bool,
           written: Written | None) -> dict[str, SparseUpdate]:
    """`apply_patch` once its arguments are checked."""
    on_cpu = _check_layout(patch, tensors)
    h = patch.header
    if on_cpu:
        return _apply_cpu(patch, tensors, verify=verify, check_base_digest=check_base_digest, written=written)
    targets = {n: e.target_digest for n, e in h.tensors.items()}
    if DEVICE_PATH and patch_algo(h) == BLOCKS_ALGO:  # compact updates to the device, digests checked there
        return DEVICE_PATH[0](patch, tensors, verify=verify, check_base_digest=check_base_digest, written=written)
    updates = decode_patch(patch, tensors, check_base_digest=check_base_digest)
    hashed: dict[str, str] = {}
    old = write_updates(tensors, updates, digests=hashed if verify else None, written=written, algo=patch_algo(h))
    if verify:
        try:
            verify_digests(tensors, targets, known=hashed)
        except DigestMismatchError as err:
            write_updates(tensors, old)
            raise _not_produced(patch, err) from None
    return updates


Done = tuple[SparseUpdate, SparseUpdate, str | None, str | None] | GroupWrite  # a unit written by `_apply_cpu`


def _apply_cpu(patch: Patch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool, check_base_digest: bool,
               written: Written | None) -> dict[str, SparseUpdate]:
    """`apply_patch` for CPU tensors: decode and write unit by unit (biggest first, on the
    codec's pool; a group in a few native calls over its members), then check the digests
    hashed in the writes; undo everything on any failure."""
    h = patch.header
    algo = patch_algo(h)

    def one(u: str | Group) -> Done:
        if isinstance(u, str):
            d = _decode_one(patch, h.tensors[u], tensors[u])
            r = (d, *_write_one(tensors[u], d, digest=verify, before=check_base_digest, algo=algo))
            if written is not None:
                written(tensors[u])
            return r
        ptrs = member_ptrs([tensors[n] for n in u.members])
        idx, vals, cuts = decode_group(patch, u, tensors, ptrs)
        w = write_group(tensors, u.members, ptrs, u.offsets, idx, vals, cuts, digest=verify,
                        before=check_base_digest, algo=algo)
        if written is not None:
            for n in u.members:
                written(tensors[n])
        return w

    ran = _run_units(patch, one)
    done = [(u, r) for u, r in ran if not isinstance(r, BaseException)]

    def undo() -> None:
        write_updates(tensors, {u: r[1] for u, r in done if isinstance(u, str) and isinstance(r, tuple)})
        for _, r in done:
            if isinstance(r, GroupWrite):
                r.undo()

    failed = [r for _, r in ran if isinstance(r, BaseException)]
    if failed:
        undo()
        if check_base_digest and isinstance(failed[0], PatchFormatError):
            check_base_digests(patch, tensors)  # decoded against other weights: say that instead
        raise failed[0]
    try:
        if check_base_digest and not _all_equal(patch, done, before=True):
            check_base_digests(patch, tensors, known=_known(done, before=True))
        if verify and not _all_equal(patch, done, before=False):
            targets = {n: e.target_digest for n, e in h.tensors.items()}
            verify_digests(tensors, targets, known=_known(done, before=False))
    except PatchMismatchError:
        undo()
        raise
    except DigestMismatchError as err:
        undo()
        raise _not_produced(patch, err) from None
    return _updates(patch, done)


def _all_equal(patch: Patch, done: list[tuple[str | Group, Done]], *, before: bool) -> bool:
    """Whether every digest hashed in the writes (`before`: of the base, else of the target)
    equals the patch's (a whole group's in one list comparison)."""
    es = patch.header.tensors
    for u, r in done:
        if isinstance(r, GroupWrite):
            want = [es[n].base_digest for n in r.members] if before else [es[n].target_digest for n in r.members]
            if (r.before if before else r.after) != want:
                return False
        else:
            assert isinstance(u, str)
            if (r[3] if before else r[2]) != (es[u].base_digest if before else es[u].target_digest):
                return False
    return True


def _known(done: list[tuple[str | Group, Done]], *, before: bool) -> dict[str, str]:
    """The digests hashed in the writes, by tensor name (`before`: of the base, else of the target)."""
    out: dict[str, str] = {}
    for u, r in done:
        got = (r.before if before else r.after) if isinstance(r, GroupWrite) else [r[3] if before else r[2]]
        names = r.members if isinstance(r, GroupWrite) else [u]
        out.update((n, d) for n, d in zip(names, got or []) if isinstance(n, str) and d is not None)
    return out


def _updates(patch: Patch, done: list[tuple[str | Group, Done]]) -> dict[str, SparseUpdate]:
    """What `apply_patch` returns: each touched tensor's update, in the header's order."""
    out: dict[str, SparseUpdate] = {}
    for u, r in done:
        if isinstance(r, GroupWrite):
            out.update(zip(r.members, map(SparseUpdate, *r.updates())))
        else:
            assert isinstance(u, str)
            out[u] = r[0]
    return {n: out[n] for n in patch.header.tensors}


def _not_produced(patch: Patch, err: DigestMismatchError) -> DigestMismatchError:
    return DigestMismatchError(
        f"patch {patch.header.base_version}->{patch.header.target_version} did not produce the target bits (undone): "
        f"{err.message}",
        hint="the patch is corrupt or was made from different weights; fetch it again or reload from an anchor",
    )
