"""Versions in parts: a version's delta as several patches, encoded and uploaded piecewise.

A part is an ordinary format-3 patch (docs/format.md) over a set of *units*: whole tensors, or
rows [start, stop) of a tensor's dim 0 (a rank's FSDP shard), named inside the patch by
`Unit.key` (`name` or `name[start:stop]`), in global checkpoint coordinates. The commit record
lists the parts (`records.PartRef`, docs/protocol.md "Versions in parts"). This module is the
writer's side (how a state is cut into parts, encoded and coalesced); the reader's side
(fetch, verify, decode, prefetch, apply all or nothing) is `sparsesync.protocol.parts_reader`.

Guarantees:
- `group_by_bytes` is deterministic: the same key set and shapes give the same parts, version
  after version (a part's units never move between versions, which coalescing relies on).
- `PartedSnapshot.diff_encode` hands each part to `on_part` as soon as it is encoded (the
  publisher uploads it while the next part is encoded); each part's digests cover exactly its units.
- `coalesce_parts` merges two consecutive versions part by part into parts that take the first's
  base to the second's target, refusing parts that cover other units.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from sparsesync.codec import (
    DEFAULT_ALGO,
    Effort,
    EncodedPatch,
    PatchStats,
    Snapshot,
    compose_changes,
    encode_changes,
    state_digest,
)
from sparsesync.codec.cast import nbytes_of, select
from sparsesync.protocol.records import Unit

DEFAULT_PART_BYTES = 256 << 20  # tensor bytes per part of a single-process publisher


def group_by_bytes(state: Mapping[str, torch.Tensor], part_bytes: int) -> list[list[str]]:
    """Tensor names in sorted order, cut into consecutive groups of at most `part_bytes` tensor
    bytes (a larger tensor is a group of its own), the last names into a small group of at most
    `part_bytes // 8`: parts go out in this order, and once the encoder is done a reader has only
    that small part left to fetch and decode. Deterministic: the same key set and shapes give the
    same groups, version after version."""
    names = sorted(state)
    size = {n: nbytes_of(state, n) for n in names}
    tail: list[str] = []
    tail_bytes = 0
    while len(names) > 1 and tail_bytes + size[names[-1]] <= part_bytes // 8:
        tail_bytes += size[names[-1]]
        tail.insert(0, names.pop())
    groups: list[list[str]] = []
    total = 0
    for name in names:
        if not groups or total + size[name] > part_bytes:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += size[name]
    return groups + ([tail] if tail else [])


# -- writer ------------------------------------------------------------------------------------
@dataclass
class EncodedPart:
    """One part of a version as the writer produced it."""

    index: int
    units: tuple[Unit, ...]
    patch: EncodedPatch


class PartedSnapshot:
    """The writer's copy of the last published version, split into parts (one `Snapshot` each).

    `units` lists each part's units; the tensors handed to `diff_encode` are keyed by `Unit.key`.
    Memory: the units' bytes once, as a single `Snapshot` of them would be.
    """

    def __init__(self, parts: Sequence[Sequence[Unit]], state: Mapping[str, torch.Tensor], version: int, *,
                 effort: Effort = "size", algo: str = DEFAULT_ALGO) -> None:
        self.units = [tuple(p) for p in parts]
        self.algo = algo  # the digest algorithm (`Snapshot`)
        self.snapshots = [
            Snapshot(select(state, [u.key for u in units]), version, effort=effort, algo=algo) for units in self.units
        ]
        self.version = version
        self._digests: dict[str, str] | None = None  # `digests`, once per version (`diff_encode` clears it)
        self._state_digest: str | None = None

    @classmethod
    def whole(cls, state: Mapping[str, torch.Tensor], version: int, part_bytes: int, *, effort: Effort = "size",
              algo: str = DEFAULT_ALGO) -> PartedSnapshot:
        """Whole tensors grouped by `part_bytes` (the single-process publisher)."""
        return cls(
            [[Unit(n) for n in g] for g in group_by_bytes(state, part_bytes)], state, version, effort=effort, algo=algo
        )

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """Every unit's tensor by `Unit.key` (references, no copy)."""
        return {k: t for s in self.snapshots for k, t in s.state.items()}

    @property
    def digests(self) -> dict[str, str]:
        """Every unit's digest by `Unit.key`: one dict per version, shared by every caller (read only)."""
        if self._digests is None:
            self._digests = {k: d for s in self.snapshots for k, d in s.digests.items()}
        return self._digests

    @property
    def state_digest(self) -> str:
        if self._state_digest is None:
            self._state_digest = state_digest(self.digests)
        return self._state_digest

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def diff_encode(self, current: Mapping[str, torch.Tensor], target_version: int,
                    on_part: Callable[[EncodedPart], None] | None = None) -> list[EncodedPart]:
        """Diff and encode part by part against the snapshot (which then holds `current`);
        `on_part` gets each part as soon as it is encoded."""
        out = []
        try:
            for i, (units, snap) in enumerate(zip(self.units, self.snapshots, strict=True)):
                self._digests = self._state_digest = None  # the parts change one by one (and may stop half-way)
                part = EncodedPart(i, units, snap.diff_encode(select(current, [u.key for u in units]), target_version))
                if on_part is not None:
                    on_part(part)
                out.append(part)
        finally:
            self._digests = self._state_digest = None
        self.version = target_version
        return out


def coalesce_parts(old: Sequence[EncodedPart], new: Sequence[EncodedPart], base_version: int,
                   base_digests: Mapping[str, str], target_version: int) -> list[EncodedPart]:
    """Merge two consecutive versions' parts (same units, part by part) into parts
    base_version -> target_version (`compose_changes`, re-encoded without the base)."""
    out = []
    for o, n in zip(old, new, strict=True):
        if o.units != n.units:
            raise ValueError(f"part {o.index} covers other units in the two versions")
        changes = compose_changes(o.patch.changes, n.patch.changes)
        data = encode_changes(
            changes,
            base_version=base_version,
            target_version=target_version,
            base_digests={k: base_digests[k] for k in changes},
            target_digests={k: n.patch.target_digests[k] for k in changes},
            base_state_digest=o.patch.base_state_digest,
            target_state_digest=n.patch.target_state_digest,
        )
        st = n.patch.stats
        n_changed = sum(c.n_changed for c in changes.values())
        stats = PatchStats(st.n_params, n_changed, n_changed / st.n_params if st.n_params else 0.0, len(data),
                           len(data) / n_changed if n_changed else 0.0, st.diff_s, st.encode_s)
        out.append(EncodedPart(o.index, o.units, EncodedPatch(data, changes, base_version, target_version,
                                                             o.patch.base_state_digest, n.patch.target_state_digest,
                                                             n.patch.target_digests, stats)))
    return out


def combined_stats(parts: Sequence[EncodedPart]) -> dict[str, float | int]:
    """The metrics of a whole version from its parts' stats (the keys of `PatchStats`)."""
    st = [p.patch.stats for p in parts]
    n_params, n_changed, nbytes = (
        sum(s.n_params for s in st),
        sum(s.n_changed for s in st),
        sum(s.patch_bytes for s in st),
    )
    return {"n_params": n_params, "n_changed": n_changed, "density": n_changed / n_params if n_params else 0.0,
            "patch_bytes": nbytes, "bytes_per_changed": nbytes / n_changed if n_changed else 0.0,
            "diff_s": sum(s.diff_s for s in st), "encode_s": sum(s.encode_s for s in st), "parts": len(parts)}
