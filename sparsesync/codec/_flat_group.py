"""The writer's side of a group of small tensors: held end to end, diffed and encoded as one.

Guarantee: `FlatGroup.diff_encode` gives the same changes, element for element, as diffing each
member on its own, codes them as one flat tensor (the touched members' concatenation in name
order; a single touched member is coded alone, as format 3 does), and advances the members to
`current` only once the encoding succeeded; its `undo` puts the old bits back. Its two halves,
`split` and `code`, serve a device snapshot's host groups (`device_groups`), which diff and
advance in `publish` and code later from a copy of the base: the same bytes. The members of
`current` are diffed where the caller holds them, in one native call over the member list
(`diff.diff_members`); a cast state (`codec.cast.CastState`) is cast into one concatenation
first. Memory: the group holds its members' bytes once (the snapshot's copy); a version adds
the changes, for a cast state a copy of the current members (the concatenation diffed) and,
when only some members changed, a copy of their base (the concatenation coded).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsesync.codec import _groups
from sparsesync.codec._member_changes import MemberChanges
from sparsesync.codec._scratch import cat_into
from sparsesync.codec.blocks_digest import digests_many
from sparsesync.codec.cast import CastState, uncast
from sparsesync.codec.diff import TensorChange, bits_view, diff_cpu_tensor, diff_members, put_bits, to_np_bits
from sparsesync.codec.digest import BLOCKS_ALGO, DEFAULT_ALGO, tensor_digest
from sparsesync.codec.patch import Effort, EncodedTensor, encode_tensor


@dataclass
class Done:
    """What one task of `Snapshot.diff_encode` did (empty when nothing changed)."""

    changes: Mapping[str, TensorChange] = field(default_factory=dict)  # per tensor, its own indices
    encoded: dict[str, EncodedTensor] = field(default_factory=dict)  # tensors coded alone
    group: tuple[EncodedTensor, _groups.Members] | None = None  # a group's coding and touched members
    digests: dict[str, str] = field(default_factory=dict)  # target digests of the changed tensors
    diff_s: float = 0.0
    encode_s: float = 0.0
    undo: Callable[[], None] | None = None  # puts the old bits back


class FlatGroup:
    """Members of one group (`_groups.plan_groups`) copied end to end into one flat tensor;
    `views` are the members, shaped, over it."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.names = names
        self.shapes = [tuple(t.shape) for t in tensors]
        numels = [t.numel() for t in tensors]
        self.offsets = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(numels, out=self.offsets[1:])
        self.numel = int(self.offsets[-1])
        self.flat = torch.cat([t.reshape(-1) for t in tensors])
        self.views = [
            self.flat[a:b].view(s)
            for a, b, s in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), self.shapes)
        ]
        self._int_dtype = bits_view(self.flat).dtype  # the members' bits are viewed as this
        self._bits = to_np_bits(bits_view(self.flat))

    def diff_encode(
        self, current: Mapping[str, torch.Tensor], effort: Effort, chunk_bytes: int, algo: str = DEFAULT_ALGO
    ) -> Done:
        """Diff the members against `current`, encode, advance (see the module docstring); the
        touched members' digests are hashed in `algo`."""
        ta = time.perf_counter()
        if isinstance(current, CastState):  # cast by the diff, in slices, from the members laid end to end
            cur = cat_into("current", [uncast(current, n) for n in self.names])
            ch = diff_cpu_tensor(self.flat, cur, chunk_bytes=chunk_bytes)
            del cur
            counts = None
        else:  # the caller's members diffed where they are (no copy), one native call
            dt, ts = self._int_dtype, map(current.__getitem__, self.names)
            members = [(t.detach() if t.requires_grad else t).view(dt).numpy() for t in ts]
            idx, old, new, counts = diff_members(self._bits, members, self.offsets)
            ch = TensorChange(self.flat.dtype, (self.numel,), idx, old, new) if idx.size else None
        tb = time.perf_counter()
        if ch is None:
            return Done(diff_s=tb - ta)
        touched, counts, changes = self.split(ch, counts)
        encoded, group = self.code(ch, touched, counts, self.flat, effort)
        bits = to_np_bits(bits_view(self.flat))

        def undo() -> None:
            put_bits(bits, ch.indices, ch.base_bits)

        put_bits(bits, ch.indices, ch.target_bits)
        try:
            if algo == BLOCKS_ALGO:  # every touched member in one native call
                offs = self.offsets
                got = digests_many([bits[offs[m] : offs[m + 1]] for m in touched])
                digests = {self.names[m]: d for m, d in zip(touched, got)}
            else:
                digests = {self.names[m]: tensor_digest(self.views[m], algo) for m in touched}
        except BaseException:
            undo()
            raise
        return Done(changes, encoded, group, digests, tb - ta, time.perf_counter() - tb, undo)

    def split(self, ch: TensorChange, counts: np.ndarray | None = None) -> tuple[list[int], np.ndarray, MemberChanges]:
        """Of `ch` (a change of the whole flat tensor; `counts`: each member's count of its
        changes, if known): the members it touches (positions in `names`), every member's count
        of changed elements, each touched member's own change (made when it is read)."""
        offs = self.offsets
        if counts is None:
            cuts = np.searchsorted(ch.indices, offs)
            counts = np.diff(cuts)
        else:
            cuts = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=cuts[1:])
        touched = np.flatnonzero(counts).tolist()
        return touched, counts, MemberChanges(ch, self.names, self.shapes, offs, cuts.tolist(), touched)

    def code(
        self, ch: TensorChange, touched: list[int], counts: np.ndarray, base: torch.Tensor, effort: Effort
    ) -> tuple[dict[str, EncodedTensor], tuple[EncodedTensor, _groups.Members] | None]:
        """`ch` (`split` gave `touched`, `counts`) coded against `base`, the group's flat tensor
        before the change (`flat`, or a copy of it): the touched members as one flat tensor, or
        a single touched member alone (as format 3 codes it: an "xxh3" file stays format 3)."""
        offs = self.offsets
        if len(touched) == 1:
            m = touched[0]
            name = self.names[m]
            own = TensorChange(ch.dtype, self.shapes[m], ch.indices - offs[m], ch.base_bits, ch.target_bits)
            return {name: encode_tensor(name, own, base[offs[m] : offs[m + 1]].view(self.shapes[m]),
                                        effort=effort)}, None
        if len(touched) == len(self.names):
            vidx, vbase = ch.indices, base
        else:  # the touched members' concatenation: shift each member's indices to its place there
            sizes = offs[1:] - offs[:-1]
            starts = np.concatenate([[0], np.cumsum(sizes[touched])[:-1]])
            vidx = ch.indices - np.repeat(offs[touched] - starts, counts[touched])
            vbase = cat_into("base", [base[offs[m] : offs[m + 1]] for m in touched])
        vch = TensorChange(ch.dtype, (int(vbase.numel()),), vidx, ch.base_bits, ch.target_bits)
        first = self.names[touched[0]]
        members = _groups.Members(
            [self.names[m] for m in touched], [self.shapes[m] for m in touched], [int(counts[m]) for m in touched]
        )
        return {}, (encode_tensor(first, vch, vbase, effort=effort), members)
