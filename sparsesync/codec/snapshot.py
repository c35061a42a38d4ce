"""The writer's full copy of the last published version, and diff+encode against it.

Guarantee: after `diff_encode(current, v)`, the snapshot holds exactly `current`'s bits and
`.digests` are its digests, and the returned patch takes the previous snapshot to `current`.

Memory: the snapshot is a full copy of the model, the tensor bytes once (2 B per parameter for
bf16: 1.2 GB for a 0.6B model, 14 GB for 7B). It lives in CPU memory by default; pass
`device="cuda"` to keep it in GPU memory (faster diff, costs GPU memory). Diffing adds at most
`chunk_bytes` of temporaries plus the changed elements (about 10 B per changed element).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sparsesync.codec import _parallel
from sparsesync.codec._flat_group import Done, FlatGroup
from sparsesync.codec._groups import plan_groups
from sparsesync.codec._member_changes import ChangeMap
from sparsesync.codec.cast import CastState, layout, owned_copy, uncast
from sparsesync.codec.diff import TensorChange, bits_view, diff_cpu_tensor, diff_state, put_bits, to_np_bits
from sparsesync.codec.digest import DEFAULT_ALGO, put_and_digest, state_digest, tensor_digest
from sparsesync.codec.patch import Effort, assemble_patch, check_effort, encode_tensor, encode_tensors


@dataclass
class PatchStats:
    """Sizes and timings of one encoded patch."""

    n_params: int  # elements in the whole model
    n_changed: int  # elements whose bits changed
    density: float  # n_changed / n_params
    patch_bytes: int  # size of the patch file
    bytes_per_changed: float  # patch_bytes / n_changed (0 for an empty patch)
    diff_s: float  # seconds spent in change detection
    encode_s: float  # seconds spent encoding (and advancing the snapshot, hashing)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass
class EncodedPatch:
    """One patch produced by `Snapshot.diff_encode`."""

    data: bytes  # the patch file
    # what changed (for `compose_changes` when uploads lag; a group's members' made when read)
    changes: Mapping[str, TensorChange]
    base_version: int
    target_version: int
    base_state_digest: str
    target_state_digest: str
    target_digests: dict[str, str]  # digests of every tensor at the target version
    stats: PatchStats


class Snapshot:
    """A full copy of the last published version (see the module docstring for its memory cost)."""

    def __init__(self, state: Mapping[str, torch.Tensor], version: int, *, device: str | torch.device | None = None,
                 effort: Effort = "size", algo: str = DEFAULT_ALGO) -> None:
        """`effort`: what `diff_encode` favors, smaller patches or faster encode and decode
        (`sparsesync.codec.patch.Effort`). `algo`: the digest algorithm of `.digests` and the
        patches (a writer continuing a run written with "xxh3" keeps it: `digest.algo_of`)."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.effort = check_effort(effort)
        self.version = version
        self.state: dict[str, torch.Tensor] = {n: owned_copy(state, n, dev) for n in state}  # one tensor cast at a time
        self.algo = algo
        # small tensors live end to end in one flat tensor per group (`state` holds views of it):
        # a group is diffed and encoded as one tensor (formats 4 and 5; `codec._groups`)
        self._groups: list[FlatGroup] = []
        if dev.type == "cpu":
            for names in plan_groups({n: (t.dtype, t.numel()) for n, t in self.state.items()}):
                g = FlatGroup(names, [self.state[n] for n in names])
                self._groups.append(g)
                self.state.update(zip(names, g.views))
        self._n_params = sum(t.numel() for t in self.state.values())  # the layout is fixed: counted once
        self.digests: dict[str, str] = {n: tensor_digest(t, algo) for n, t in self.state.items()}
        self.state_digest: str = state_digest(self.digests)

    @property
    def nbytes(self) -> int:
        """Bytes the copy occupies."""
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def diff_encode(
        self, current: Mapping[str, torch.Tensor], target_version: int, *, chunk_bytes: int = 256 << 20
    ) -> EncodedPatch:
        """The patch from the snapshot's version to `current` (as `target_version`); then the
        snapshot becomes `current` (only the changed elements are written). If anything fails,
        the snapshot is left as it was. `current` may be a `codec.cast.CastState` (an fp32 master
        published as bf16): each tensor is cast when it is diffed, never the whole state at once."""
        t0 = time.perf_counter()
        base_digests = dict(self.digests)
        base_sd = self.state_digest
        # a Ctrl-C waits: the snapshot advances whole or not at all
        with _parallel.gc_paused(), _parallel.interrupts_deferred():
            groups: list = []
            if self._fusable(current):
                changes, encoded, groups, diff_s = self._diff_encode_fused(current, chunk_bytes)
            else:
                own = diff_state(self.state, current, chunk_bytes=chunk_bytes)
                diff_s = time.perf_counter() - t0
                # needs the base: before advancing
                encoded = encode_tensors(own, base=self.state, effort=self.effort)
                self.apply_changes(own)
                changes = ChangeMap([own])
            data = assemble_patch(
                encoded,
                base_version=self.version,
                target_version=target_version,
                base_digests=base_digests,
                target_digests=self.digests,
                base_state_digest=base_sd,
                target_state_digest=self.state_digest,
                groups=groups,
            )
        t2 = time.perf_counter()
        base_version, self.version = self.version, target_version
        n_params = self._n_params
        n_changed = changes.n_changed
        stats = PatchStats(
            n_params=n_params,
            n_changed=n_changed,
            density=n_changed / n_params if n_params else 0.0,
            patch_bytes=len(data),
            bytes_per_changed=len(data) / n_changed if n_changed else 0.0,
            diff_s=diff_s,
            encode_s=t2 - t0 - diff_s,
        )
        return EncodedPatch(
            data, changes, base_version, target_version, base_sd, self.state_digest, dict(self.digests), stats
        )

    def _fusable(self, current: Mapping[str, torch.Tensor]) -> bool:
        """Whether every tensor pair is contiguous on the CPU with the same layout (else the
        phase-by-phase path, which also reports layout mismatches)."""
        if current.keys() != self.state.keys():
            return False
        if not isinstance(current, CastState):  # the same checks, fewer Python calls per tensor
            for name, b in self.state.items():
                t = current[name]
                if not (t.is_cpu and b.is_cpu and t.dtype == b.dtype and t.shape == b.shape and t.is_contiguous()):
                    return False
            return True
        for name, b in self.state.items():
            device, dtype, shape, contiguous = layout(current, name)  # a `CastState` is not cast here
            if b.device.type != "cpu" or device.type != "cpu" or not contiguous or dtype != b.dtype or shape != b.shape:
                return False
        return True

    def _diff_encode_fused(
        self, current: Mapping[str, torch.Tensor], chunk_bytes: int
    ) -> tuple[ChangeMap, dict, list, float]:
        """Diff, encode and advance each tensor (or group of small tensors) in one task on the
        codec's pool (no barrier between the phases; a tensor's changes are encoded while they
        are in cache). A failure in any task puts every advanced tensor back (its change holds
        the old bits)."""
        grouped = {n for g in self._groups for n in g.names}
        units: list[str | FlatGroup] = [n for n in self.state if n not in grouped] + list(self._groups)
        weight = [self.state[u].numel() if isinstance(u, str) else u.numel for u in units]
        # biggest first keeps every thread busy to the end
        order = sorted(range(len(units)), key=lambda i: (-weight[i], i))

        def one(i: int) -> Done:
            u = units[i]
            if isinstance(u, FlatGroup):
                return u.diff_encode(current, self.effort, chunk_bytes, algo=self.algo)
            ta = time.perf_counter()
            ch = diff_cpu_tensor(self.state[u], uncast(current, u), chunk_bytes=chunk_bytes)  # casts in slices
            tb = time.perf_counter()
            if ch is None:
                return Done(diff_s=tb - ta)
            enc = encode_tensor(u, ch, self.state[u], effort=self.effort)  # needs the base: before advancing
            try:  # advance and hash in one pass over the tensor
                digest = put_and_digest(
                    to_np_bits(bits_view(self.state[u])), ch.indices, ch.target_bits, algo=self.algo
                )
            except BaseException:
                self._put(u, ch.indices, ch.base_bits)
                raise
            return Done(
                {u: ch},
                {u: enc},
                None,
                {u: digest},
                tb - ta,
                time.perf_counter() - tb,
                lambda: self._put(u, ch.indices, ch.base_bits),
            )

        t0 = time.perf_counter()
        results = _parallel.map_settled(one, order, weights=[weight[i] for i in order])
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            for r in results:
                if not isinstance(r, Exception) and r.undo is not None:
                    r.undo()
            raise failed[0]
        wall = time.perf_counter() - t0
        done = [r for r in results if not isinstance(r, Exception)]  # all of them: a failure raised above
        changes = ChangeMap([r.changes for r in done if r.changes])  # a group's members' made when read
        encoded: dict = {}
        groups = []
        for r in done:
            encoded.update(r.encoded)
            self.digests.update(r.digests)
            if r.group is not None:
                groups.append(r.group)
        if changes:
            self.state_digest = state_digest(self.digests)
        cpu_diff, cpu_all = sum(r.diff_s for r in done), sum(r.diff_s + r.encode_s for r in done)
        groups.sort(key=lambda g: g[1].names[0])
        return (
            changes,
            dict(sorted(encoded.items())),
            groups,
            wall * cpu_diff / cpu_all if cpu_all else 0.0,
        )

    def _put(self, name: str, indices: np.ndarray, bits: np.ndarray) -> None:
        """Write `bits` at `indices` of a CPU snapshot tensor."""
        put_bits(to_np_bits(bits_view(self.state[name])), indices, bits)

    def apply_changes(self, changes: Mapping[str, TensorChange]) -> None:
        """Write the target bits of `changes` into the snapshot and refresh the touched digests
        (tensors in parallel on the codec's pool)."""

        def one(name: str) -> str:
            ch = changes[name]
            flat = bits_view(self.state[name])
            if flat.device.type == "cpu":
                return put_and_digest(to_np_bits(flat), ch.indices, ch.target_bits, algo=self.algo)
            idx = torch.from_numpy(ch.indices).to(flat.device)
            flat[idx] = torch.from_numpy(np.ascontiguousarray(ch.target_bits).view(_signed(ch.target_bits.dtype))).to(
                flat.device
            )
            return tensor_digest(self.state[name], self.algo)

        names = list(changes)
        self.digests.update(zip(names, _parallel.map_ordered(one, names)))
        if changes:
            self.state_digest = state_digest(self.digests)


def _signed(dt: np.dtype) -> np.dtype:
    return np.dtype({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[dt.itemsize])
