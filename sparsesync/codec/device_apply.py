"""Applying a patch to tensors on a device (a GPU), all or nothing, every digest checked there.

The steps, for a patch whose digests are "xxh3b" (a patch of an older run, "xxh3", keeps the
host path of `apply.apply_patch`):
1. decode on the host (`apply.decode_patch`, the same decoders and checks as the CPU path: every
   stream decodes to exactly the declared size, positions in range, strictly increasing);
2. ONE host->device copy of the compact updates: the indices and value bits of every touched
   tensor packed into one buffer (pinned where the device is CUDA);
3. on the device, in stream order: the block digests of every touched tensor (the base), its old
   values at the indices gathered, the new values scattered in place (`index_copy_` on the flat
   bit view), the block digests again (the target);
4. ONE device synchronization: every block digest of the patch comes to the host at once
   (8 bytes per 64 KiB block), where each tensor's digest is combined (`blocks_digest.combine`)
   and compared with the patch's base and target digests.

Guarantee (all or nothing): when `apply_on_device` returns, every touched tensor holds exactly
its target digest's bits (and held its base digest's before, if `check_base_digest`). On any
failure (a base digest that does not match: PatchMismatchError; a target digest: DigestMismatchError;
an error or interrupt raised while scattering, or by `written`) the old bits are scattered back
into every tensor before the error is raised, naming each bad tensor, its digest and the
expected one. The code is device-agnostic torch: on CPU tensors it runs the same operations
(tests compare it bit for bit with the C path). Memory on the device: the packed update, the
old values (one per changed element) and the digest temporaries (`device_changes.block_digests_many`:
the blocks of many tensors hashed together, one digest call per 256 MiB; each call's constants are
host->device copies that wait for the device, so "one synchronization" is the one read of the
digests plus about one wait per 256 MiB hashed, until the digest kernel keeps its constants there).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsesync.codec import _parallel, apply
from sparsesync.codec.apply import (
    SparseUpdate,
    Written,
    _check_layout,
    _listing,
    _not_produced,
    decode_patch,
    patch_algo,
)
from sparsesync.codec.blocks_digest import combine, n_blocks
from sparsesync.codec.device_changes import block_digests_many
from sparsesync.codec.diff import bits_view
from sparsesync.codec.digest import BLOCKS_ALGO
from sparsesync.codec.patch import Patch
from sparsesync.errors import DigestMismatchError, PatchFormatError, PatchMismatchError

_ALIGN = 8  # every packed segment starts at a multiple of 8 bytes (an int64 view needs it)


def device_apply_supported(patch: Patch) -> bool:
    """Whether `patch`'s digests can be checked on the device ("xxh3b"; "xxh3" is one host stream)."""
    return patch_algo(patch.header) == BLOCKS_ALGO


def apply_on_device(
    patch: Patch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool = True, check_base_digest: bool = True,
    written: Written | None = None,
) -> dict[str, SparseUpdate]:
    """Apply `patch` in place to `tensors` on whatever device each is on (module docstring);
    returns the decoded updates (host tensors). A Ctrl-C is raised once the writes are done or
    undone (`_parallel.interrupts_deferred`). `written` is called with each tensor once its new
    values are scattered (the digests are checked after; an undo may write it again)."""
    if not (verify or check_base_digest):
        raise ValueError("apply_on_device needs verify=True or check_base_digest=True: one digest must be checked")
    with _parallel.interrupts_deferred():
        return _apply_on_device(patch, tensors, verify=verify, check_base_digest=check_base_digest, written=written)


@dataclass
class _Job:
    """The work on one device: its tensors' flat bit views, their packed updates there, the old
    values gathered, and the block digests enqueued (base, then target)."""

    device: torch.device
    names: list[str]
    flats: dict[str, torch.Tensor] = field(default_factory=dict)
    at: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> (indices, value bits)
    old: dict[str, torch.Tensor] = field(default_factory=dict)
    digests: list[torch.Tensor] = field(default_factory=list)
    host: torch.Tensor | None = None  # the packed host buffer, alive until the device has read it

    def undo(self) -> None:
        """Scatter every gathered old value back (a tensor not yet written gets its own bits)."""
        for n, old in self.old.items():
            self.flats[n].index_copy_(0, self.at[n][0], old)
        _synchronize(self.device)


@dataclass
class StagedPatch:
    """A patch decoded on the host and its compact updates copied to the tensors' devices
    (`stage_on_device`); nothing written yet (`apply_staged` writes it)."""

    patch: Patch
    updates: dict[str, SparseUpdate]  # host tensors, by name in the patch's order
    jobs: list[_Job]


def stage_on_device(
    patch: Patch, tensors: Mapping[str, torch.Tensor], *, check_base_digest: bool = True
) -> StagedPatch:
    """Check `patch` against `tensors`' layout, decode it on the host (reading the base bits it
    needs from the tensors) and copy the updates to their devices in one transfer per device;
    writes nothing. A patch that does not decode is PatchFormatError, or PatchMismatchError when
    (`check_base_digest`) the tensors are not at its base."""
    _check_layout(patch, tensors)
    if not device_apply_supported(patch):
        raise ValueError(
            f"patch {patch.header.base_version}->{patch.header.target_version} has '{patch_algo(patch.header)}' "
            "digests: only 'xxh3b' is checked on a device (apply it with codec.apply_patch)"
        )
    names = list(patch.header.tensors)
    try:
        updates = decode_patch(patch, tensors, check_base_digest=False)
    except PatchFormatError:
        if check_base_digest:  # decoded against other weights: say that instead
            want = {n: e.base_digest for n, e in patch.header.tensors.items()}
            _raise_base(patch, _mismatched(want, _digest_all(tensors, names)))
        raise
    return StagedPatch(patch, {n: updates[n] for n in names}, _jobs(tensors, updates, names))


def apply_staged(
    staged: StagedPatch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool = True,
    check_base_digest: bool = True, written: Written | None = None,
) -> dict[str, SparseUpdate]:
    """Write a staged patch into `tensors` (the same layout and devices as when staged), all or
    nothing, its digests checked on the devices (module docstring); returns its updates."""
    if not (verify or check_base_digest):
        raise ValueError("apply_staged needs verify=True or check_base_digest=True: one digest must be checked")
    patch, jobs = staged.patch, staged.jobs
    _check_layout(patch, tensors)
    h = patch.header
    bad_base, bad_target = _scatter_checked(
        jobs, tensors, {n: e.base_digest for n, e in h.tensors.items()} if check_base_digest else None,
        {n: e.target_digest for n, e in h.tensors.items()} if verify else None, written)
    if bad_base or bad_target:
        _raise_base(patch, bad_base)
        raise _not_produced(
            patch, DigestMismatchError(_listing(bad_target), hint="reload from the newest anchor and replay the chain")
        ) from None
    return dict(staged.updates)


def _scatter_checked(jobs: list[_Job], tensors: Mapping[str, torch.Tensor], base: Mapping[str, str] | None,
                     target: Mapping[str, str] | None, written: Written | None) -> tuple[list[str], list[str]]:
    """Scatter every job into `tensors` and check their digests against `base` (before) and
    `target` (after), each None: not checked. Returns (base mismatches, target mismatches), one
    line per tensor; when either is not empty, or anything raises, every old bit is back first."""
    for job in jobs:
        moved = [n for n in job.names if tensors[n].device != job.device]
        if moved:
            raise PatchMismatchError(f"tensor '{moved[0]}': on {tensors[moved[0]].device}, staged for {job.device}",
                                     hint="stage the update again for the tensors it is applied to")
        job.flats, job.old, job.digests = {n: bits_view(tensors[n]) for n in job.names}, {}, []
    check_base, verify = base is not None, target is not None
    try:
        for job in jobs:
            _enqueue(job, tensors, check_base_digest=check_base, verify=verify, written=written)
        got = _collect(jobs, tensors, check_base_digest=check_base, verify=verify)
    except BaseException:
        for job in jobs:
            job.undo()
        raise
    bad = [_mismatched(want, have) if want is not None else [] for want, have in ((base, got[0]), (target, got[1]))]
    if bad[0] or bad[1]:
        for job in jobs:
            job.undo()
    return bad[0], bad[1]


class CheckedWrite:
    """Updates written into tensors on their devices by `write_checked`; `undo()` puts every old bit back."""

    def __init__(self, jobs: list[_Job]) -> None:
        self._jobs = jobs

    def undo(self) -> None:
        for job in self._jobs:
            job.undo()


def write_checked(tensors: Mapping[str, torch.Tensor], updates: Mapping[str, SparseUpdate], *,
                  base: Mapping[str, str] | None, target: Mapping[str, str], what: str) -> CheckedWrite:
    """Write `updates` (host indices and values) into `tensors` (contiguous, on any device) all or
    nothing, as `apply_staged` does: one transfer, base digests (where `base` names one) and target
    digests (every tensor) checked on the device with one synchronization. On a mismatch every old
    bit is back and PatchMismatchError (base) or DigestMismatchError (target) names each tensor
    (`what`: the update, for the message). Returns the write, for a caller that must undo it later."""
    names = list(updates)
    for n in names:
        t = tensors[n]
        if not t.is_contiguous() or t.numel() != _numel_of(updates[n], t):
            raise PatchMismatchError(f"tensor '{n}': {list(t.shape)} not contiguous or not the update's",
                                     hint="write it through the engine's own loader")
    jobs = _jobs(tensors, updates, names)
    known = {n: d for n, d in (base or {}).items() if n in updates}
    bad_base, bad_target = _scatter_checked(jobs, tensors, known or None, {n: target[n] for n in names}, None)
    if bad_base:
        raise PatchMismatchError(f"{what}: tensors are not at its base: " + _listing(bad_base),
                                 hint="reload the version in full")
    if bad_target:
        raise DigestMismatchError(f"{what} did not produce the target bits (undone): " + _listing(bad_target),
                                  hint="reload the version in full")
    return CheckedWrite(jobs)


def _numel_of(u: SparseUpdate, t: torch.Tensor) -> int:
    """`t`'s element count when every index of `u` is in range (else -1: refused before any write)."""
    idx = u.indices
    return t.numel() if idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < t.numel()) else -1


def _apply_on_device(
    patch: Patch, tensors: MutableMapping[str, torch.Tensor], *, verify: bool, check_base_digest: bool,
    written: Written | None,
) -> dict[str, SparseUpdate]:
    """`apply_on_device` once its arguments are checked."""
    staged = stage_on_device(patch, tensors, check_base_digest=check_base_digest)
    return apply_staged(staged, tensors, verify=verify, check_base_digest=check_base_digest, written=written)


def _jobs(tensors: Mapping[str, torch.Tensor], updates: Mapping[str, SparseUpdate], names: list[str]) -> list[_Job]:
    """One job per device, its updates packed into one buffer and copied there at once."""
    by_device: dict[torch.device, list[str]] = {}
    for n in names:
        by_device.setdefault(tensors[n].device, []).append(n)
    jobs = []
    for device, group in by_device.items():
        job = _Job(device, group, {n: bits_view(tensors[n]) for n in group})
        job.host, job.at = _pack(device, {n: updates[n] for n in group}, job.flats)
        jobs.append(job)
    return jobs


def _seg(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _pack(
    device: torch.device, updates: Mapping[str, SparseUpdate], flats: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The indices (int64) and value bits of `updates` laid out in one host buffer (pinned for
    CUDA), copied to `device` in one transfer: (host buffer, name -> (indices, value bits) there)."""
    spans, total = {}, 0
    for n, u in updates.items():
        k, w = u.indices.numel(), flats[n].element_size()
        spans[n] = (total, total + 8 * k, k)
        total += 8 * k + _seg(k * w)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda" and torch.cuda.is_available())
    for n, u in updates.items():
        i0, v0, k = spans[n]
        host[i0:v0].view(torch.int64).copy_(u.indices)
        host[v0 : v0 + k * flats[n].element_size()].view(flats[n].dtype).copy_(u.values.view(flats[n].dtype))
    dev = host.to(device, non_blocking=True)
    at = {}
    for n, (i0, v0, k) in spans.items():
        at[n] = (dev[i0:v0].view(torch.int64), dev[v0 : v0 + k * flats[n].element_size()].view(flats[n].dtype))
    return host, at


def _enqueue(job: _Job, tensors: Mapping[str, torch.Tensor], *, check_base_digest: bool, verify: bool,
             written: Written | None) -> None:
    """In the device's stream order: base block digests, old values gathered, new values scattered
    (`written` told of each tensor), target block digests. Nothing here waits for the device."""
    if check_base_digest:
        job.digests += block_digests_many([job.flats[n] for n in job.names])
    for n in job.names:
        job.old[n] = job.flats[n].index_select(0, job.at[n][0])
    for n in job.names:
        job.flats[n].index_copy_(0, *job.at[n])
        if written is not None:
            written(tensors[n])
    if verify:
        job.digests += block_digests_many([job.flats[n] for n in job.names])


def _collect(jobs: list[_Job], tensors: Mapping[str, torch.Tensor], *, check_base_digest: bool,
             verify: bool) -> tuple[dict[str, str], dict[str, str]]:
    """Every job's block digests to the host (one synchronization per device), combined per
    tensor: (base digests, target digests) by name."""
    base: dict[str, str] = {}
    target: dict[str, str] = {}
    for job in jobs:
        flat = torch.cat(job.digests).cpu().numpy().view(np.uint64) if job.digests else np.empty(0, np.uint64)
        job.host = None  # the copy it fed has completed: the device has run everything before this read
        at = 0
        for out in ([base] if check_base_digest else []) + ([target] if verify else []):
            for n in job.names:
                nbytes = tensors[n].numel() * tensors[n].element_size()
                k = n_blocks(nbytes)
                out[n] = combine(flat[at : at + k], nbytes)
                at += k
    return base, target


def _digest_all(tensors: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, str]:
    return device_digests({n: tensors[n] for n in names})


def device_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The "xxh3b" digest of every tensor, computed on its device: the block digests of all of
    them come to the host together (one synchronization per device, not one per tensor)."""
    by_device: dict[torch.device, list[str]] = {}
    for n, t in tensors.items():
        by_device.setdefault(t.device, []).append(n)
    out: dict[str, str] = {}
    for names in by_device.values():
        blocks = block_digests_many([tensors[n] for n in names])
        flat = torch.cat(blocks).cpu().numpy().view(np.uint64) if blocks else np.empty(0, np.uint64)
        at = 0
        for n in names:
            nbytes = tensors[n].numel() * tensors[n].element_size()
            out[n] = combine(flat[at : at + n_blocks(nbytes)], nbytes)
            at += n_blocks(nbytes)
    return {n: out[n] for n in tensors}


def _mismatched(want: Mapping[str, str], got: Mapping[str, str]) -> list[str]:
    """One line per tensor of `want` whose digest in `got` is another."""
    return [f"tensor '{n}': digest {got[n]}, expected {d}" for n, d in want.items() if got[n] != d]


def _raise_base(patch: Patch, bad: list[str]) -> None:
    """PatchMismatchError naming every tensor in `bad` (nothing when it is empty)."""
    if not bad:
        return
    h = patch.header
    raise PatchMismatchError(
        f"patch {h.base_version}->{h.target_version}: tensors are not at base version {h.base_version}: "
        + _listing(bad),
        hint=f"load version {h.base_version} (anchor plus chain) before applying this patch",
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


apply.DEVICE_PATH[:] = [_apply_on_device]  # apply_patch's path for tensors off the CPU
