"""A version's changes by tensor name, a group's members' made only when they are read.

Guarantee: `MemberChanges` maps each touched member of a group to exactly the `TensorChange`
that diffing the member on its own gives (member-local indices, both sides' bits), made from
the group's flat change when it is first read and kept; `ChangeMap` joins such mappings and
plain dicts of disjoint names into one read-only mapping in name order, with the total count
of changed elements. Why: a LoRA version touches hundreds of members, and the writer's hot
path only needs their counts; the per-member objects (and, at 50% density, a copy of every
changed index) were made for every version, read only when uploads lag (`compose_changes`).
Memory: the flat change's arrays, shared; a member's indices once it is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from sparsesync.codec.diff import TensorChange


class MemberChanges(Mapping[str, TensorChange]):
    """The touched members' own changes of one group's flat change `ch` (see the module
    docstring): member i (of `names`, `shapes`) owns elements [offsets[i], offsets[i + 1]) of
    the flat tensor and changes [cuts[i], cuts[i + 1]) of `ch`; `touched`: those with any."""

    def __init__(self, ch: TensorChange, names: list[str], shapes: list[tuple[int, ...]], offsets: np.ndarray,
                 cuts: list[int], touched: list[int]) -> None:
        self._ch, self._names, self._shapes, self._offsets, self._cuts = ch, names, shapes, offsets, cuts
        self._touched = [names[m] for m in touched]
        self._at = dict(zip(self._touched, touched))
        self._made: dict[str, TensorChange] = {}
        self.n_changed = cuts[-1]  # of every member

    def __getitem__(self, name: str) -> TensorChange:
        got = self._made.get(name)
        if got is None:
            m = self._at[name]  # KeyError for a member not touched (or no member)
            a, b, ch = self._cuts[m], self._cuts[m + 1], self._ch
            got = self._made[name] = TensorChange(ch.dtype, self._shapes[m], ch.indices[a:b] - self._offsets[m],
                                                  ch.base_bits[a:b], ch.target_bits[a:b])
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._touched)

    def __len__(self) -> int:
        return len(self._touched)

    def __contains__(self, name: object) -> bool:
        return name in self._at


class ChangeMap(Mapping[str, TensorChange]):
    """`parts` (mappings of disjoint names) as one mapping in name order; nothing is read from
    a part until its name is looked up."""

    def __init__(self, parts: list[Mapping[str, TensorChange]]) -> None:
        self._where: dict[str, Mapping[str, TensorChange]] = {}
        for p in parts:
            self._where.update(dict.fromkeys(p, p))
        self._order = sorted(self._where)
        self._parts = parts

    @property
    def n_changed(self) -> int:
        """Changed elements over every tensor."""
        return sum(p.n_changed if isinstance(p, MemberChanges) else sum(c.n_changed for c in p.values())
                   for p in self._parts)

    def __getitem__(self, name: str) -> TensorChange:
        return self._where[name][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._where
