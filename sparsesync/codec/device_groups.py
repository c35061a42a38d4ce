"""The small tensors of a device snapshot: kept on the host, coded in groups as a CPU `Snapshot` codes them.

A `device_snapshot.DeviceSnapshot` hands the tensors `_groups.plan_groups` groups to a
`HostGroups`: their copy lives in host memory as `FlatGroup`s (the same groups and flat tensors
a CPU `Snapshot` holds). A publish reads their current bits from the device with the publish's
first read (`pack`: one buffer per group, all in that one read), then diffs, advances and
digests them on the host before `publish` returns (`advance`), and codes them later, on any
thread, from a copy of the touched groups' base bits (`SmallChanges.encode`): the patch's group
section and the tensor entries of singly touched members are byte for byte the CPU path's. The
device does no per-tensor work for them beyond gathering their bits.

Bound: every publish reads every grouped tensor (each at most `SMALL_NUMEL` elements) to the
host; a state whose groupable tensors hold more than `MAX_BYTES` keeps them on the device path,
ungrouped (the same bits reach followers; patches as the device path codes lone tensors).
Memory: the grouped tensors' bytes once on the host, plus per version in flight a copy of the
touched groups.

Guarantees: `advance` either advances every group to the current bits and returns their changes
and target digests, or raises with every group as it was; `SmallChanges.undo` puts them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsesync.codec import _groups, _parallel
from sparsesync.codec._flat_group import FlatGroup
from sparsesync.codec.cast import layout, owned_copy
from sparsesync.codec.device_changes import Packer, flat_bits
from sparsesync.codec.diff import TensorChange, bits_view, diff_cpu_tensor, put_bits, to_np_bits
from sparsesync.codec.digest import tensor_digest
from sparsesync.codec.patch import Effort, EncodedTensor

MAX_BYTES = 256 << 20  # groupable tensors beyond this total stay on the device path (read every publish)


@dataclass
class _Touched:
    """One group's change of a version, kept for the coding."""

    group: FlatGroup
    change: TensorChange  # of the whole flat tensor
    touched: list[int]
    counts: np.ndarray
    base: torch.Tensor  # a copy of the group's flat tensor before the change
    changes: Mapping[str, TensorChange]  # per touched member (made when read)


@dataclass
class SmallChanges:
    """The grouped tensors' part of one version (host memory only)."""

    changes: dict[str, TensorChange] = field(default_factory=dict)  # per touched member
    digests: dict[str, str] = field(default_factory=dict)  # target digests of the touched members
    touched: list[_Touched] = field(default_factory=list)

    def undo(self) -> None:
        """Put the touched groups' old bits back (the snapshot's host half as it was)."""
        for t in self.touched:
            put_bits(to_np_bits(bits_view(t.group.flat)), t.change.indices, t.change.base_bits)

    def encode(self, effort: Effort) -> tuple[dict[str, EncodedTensor], list[tuple[EncodedTensor, _groups.Members]]]:
        """The coded tensors (a group's one touched member, coded alone) and groups, as
        `Snapshot.diff_encode` codes them (any thread; groups on the codec's pool)."""
        done = _parallel.map_ordered(lambda t: t.group.code(t.change, t.touched, t.counts, t.base, effort),
                                     self.touched)
        encoded: dict[str, EncodedTensor] = {}
        groups = []
        for enc, grp in done:
            encoded.update(enc)
            if grp is not None:
                groups.append(grp)
        groups.sort(key=lambda g: g[1].names[0])
        return encoded, groups


class HostGroups:
    """The grouped tensors of a device snapshot (see the module docstring)."""

    def __init__(self, state: Mapping[str, torch.Tensor], algo: str) -> None:
        lay = {n: layout(state, n) for n in state}
        plan = _groups.plan_groups({n: (lay[n][1], lay[n][2].numel()) for n in state})
        total = sum(lay[n][2].numel() * lay[n][1].itemsize for g in plan for n in g)
        self.algo = algo
        self.groups = [FlatGroup(g, [owned_copy(state, n, torch.device("cpu")) for n in g])
                       for g in (plan if total <= MAX_BYTES else [])]
        self.names = {n for g in self.groups for n in g.names}

    def views(self) -> dict[str, torch.Tensor]:
        """Every grouped tensor, shaped, over its group's host copy."""
        return {n: v for g in self.groups for n, v in zip(g.names, g.views)}

    def digests(self) -> dict[str, str]:
        """Every grouped tensor's digest (the C codec's, on the host)."""
        return {n: tensor_digest(v, self.algo) for n, v in self.views().items()}

    def pack(self, current: Mapping[str, torch.Tensor], device: torch.device, pk: Packer) -> list[int]:
        """Queue each group's current members' bits, end to end, in `pk` (one gather per group
        on `device`); their indices in `pk.read()`'s list."""
        return [pk.add(torch.cat([flat_bits(current[n]).to(device) for n in g.names]), bits=True)
                for g in self.groups]

    def advance(self, host_bits: list[np.ndarray], chunk_bytes: int = 256 << 20) -> SmallChanges:
        """Diff each group against its current bits (`pack`'s, read back), keep a copy of each
        touched group's base for the coding, advance, digest the touched members (groups on the
        codec's pool); all or nothing (see the module docstring)."""

        def one(i: int) -> _Touched | None:
            g = self.groups[i]
            cur = torch.from_numpy(host_bits[i].view(f"i{g.flat.element_size()}")).view(g.flat.dtype)
            ch = diff_cpu_tensor(g.flat, cur, chunk_bytes=chunk_bytes)
            if ch is None:
                return None
            touched, counts, changes = g.split(ch)
            t = _Touched(g, ch, touched, counts, g.flat.clone(), changes)
            put_bits(to_np_bits(bits_view(g.flat)), ch.indices, ch.target_bits)
            return t

        results = _parallel.map_settled(one, range(len(self.groups)), weights=[g.numel for g in self.groups])
        out = SmallChanges(touched=[r for r in results if isinstance(r, _Touched)])
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            out.undo()
            raise failed[0]
        try:
            for t in out.touched:
                out.changes.update(t.changes)
                out.digests.update((t.group.names[m], tensor_digest(t.group.views[m], self.algo)) for m in t.touched)
        except BaseException:
            out.undo()
            raise
        return out
