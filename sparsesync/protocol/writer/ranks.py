"""What each rank of a distributed writer holds, and the collectives that move it between ranks.

- `Ranks`: the process group and this process's place in it (`Ranks.of(group)`: None for a
  single process).
- `shard_rows`, `checkpoint_shards`, `local_units`: a state dict of FSDP2 DTensors (dim-0 shards on
  a 1-D mesh) and plain tensors in the checkpoint's own key set, and the units (`name` or
  `name[start:stop]`, global coordinates) each rank diffs, encodes and uploads.
- `gather_whole`, `digests_over`: each tensor whole on one rank only (the anchor plan's), for a
  sharded anchor or to hash the weights over another world size's units. Memory: one tensor in
  flight per rank. Raw bytes travel (`anchor_shards.gather_rows`): bit-exact.
- `collective`: every collective of the writer runs inside it, so a lost rank (gloo: a peer died
  or timed out) is a RankFailedError naming what was lost, never a hang or a bare RuntimeError.

Guarantees: everything here that decides (key sets, units, plans) is a pure function of names,
global shapes and dtypes, so every rank computes the same without a collective.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsesync.checkpoint import EXPERT_KEY, check_tied, split_fused_experts
from sparsesync.codec import tensor_digest
from sparsesync.errors import ConfigError, RankFailedError
from sparsesync.protocol.records import Unit
from sparsesync.protocol.writer.anchor_shards import AnchorPlan, assign, gather_rows

RANK_DIED = "a rank of the trainer died or hung; restart the job"
@contextlib.contextmanager
def collective(what: str, lost: str = "a rank did not join", hint: str = RANK_DIED) -> Iterator[None]:
    """Turn a failed collective (gloo: a peer died or timed out) into RankFailedError("`what`: `lost` (cause)")."""
    try:
        yield
    except RuntimeError as e:
        raise RankFailedError(f"{what}: {lost} ({e})", hint=hint) from None


@dataclass(frozen=True)
class Ranks:
    """The process group a distributed writer runs on, and this process's place in it."""

    group: Any  # a torch.distributed ProcessGroup
    rank: int
    world: int
    ranks: tuple[int, ...]  # the group's global ranks; the first one is its rank 0

    @classmethod
    def of(cls, group: Any = None) -> Ranks | None:
        """The ranks of `group` (default: the world, when torch.distributed runs with more than one
        process); None when a Publisher created now is a single process."""
        if group is None:
            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                return None
            group = dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group), tuple(dist.get_process_group_ranks(group)))

    @property
    def src(self) -> int:
        """Rank 0's global rank (the source of broadcasts)."""
        return self.ranks[0]


def holds_shards(state: Any) -> bool:
    """Whether `state` (a state dict) holds DTensors: then it is published in shards."""
    from torch.distributed.tensor import DTensor

    return isinstance(state, Mapping) and any(isinstance(v, DTensor) for v in state.values())


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The dim-0 rows [start, stop) of `rank` when `rows` are split as torch.chunk (FSDP2) splits them."""
    chunk = math.ceil(rows / world)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


@dataclass(frozen=True)
class ShardedTensor:
    """One tensor of the checkpoint's key set as this rank holds it (alike on every rank but `local`)."""

    name: str  # its checkpoint name
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    holder: int | None  # the rank holding it whole; None: every rank holds its dim-0 rows (shard_rows)
    local: torch.Tensor | None  # this rank's rows (holder None), or the whole tensor where holder is this rank

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def checkpoint_shards(state: Mapping[str, torch.Tensor], rank: int, world: int,
                      aliases: Mapping[str, str]) -> list[ShardedTensor]:
    """`state` in the checkpoint's own key set, as `checkpoint.checkpoint_state` maps a whole state
    (in its order), with what this rank holds of each tensor:

    - the names of `aliases` (tied weights, found once by `checkpoint.shared_aliases`) are left out,
      after checking they still hold their kept tensor's values (`checkpoint.check_tied`);
    - a DTensor sharded on dim 0 of a 1-D mesh: its local rows, holder None; but runtime-fused MoE
      experts ([experts, ...]: dim 0 is the expert) are split per expert (`split_fused_experts`),
      each a whole tensor held by the rank whose rows hold that expert;
    - a plain tensor is replicated: held by rank 0 (fused experts split there too).

    Other placements raise ConfigError.
    """
    from torch.distributed.tensor import DTensor, Shard

    check_tied(state, aliases)
    out: list[ShardedTensor] = []
    for name, v in state.items():
        if name in aliases:
            continue
        if not isinstance(v, DTensor):
            for n, t in (split_fused_experts(name, v) or {name: v}).items():
                out.append(ShardedTensor(n, tuple(t.shape), t.dtype, 0, t.detach() if rank == 0 else None))
            continue
        if v.device_mesh.ndim != 1 or tuple(v.placements) != (Shard(0),):
            raise ConfigError(
                f"tensor {name!r}: DTensor placements {list(v.placements)} on a {v.device_mesh.ndim}-D mesh; "
                "the distributed publisher takes dim-0 shards on a 1-D mesh (FSDP2 fully_shard)",
                hint="shard with fully_shard on a 1-D mesh, or publish a full state dict from one process",
            )
        rows = v.shape[0]
        start, stop = shard_rows(rows, rank, world)
        local = v.to_local().detach()
        if local.shape[0] != stop - start:
            raise ConfigError(
                f"tensor {name!r}: rank {rank} holds {local.shape[0]} rows, expected [{start}, {stop}) "
                f"of {rows} (torch.chunk's split over {world} ranks)",
                hint="the distributed publisher expects FSDP2's even dim-0 sharding",
            )
        whole = split_fused_experts(name, torch.empty(tuple(v.shape), dtype=v.dtype, device="meta"))
        if whole is None:
            out.append(ShardedTensor(name, tuple(v.shape), v.dtype, None, local))
            continue
        mine = split_fused_experts(name, local, first=start) or {}
        chunk = math.ceil(rows / world)
        for n, t in whole.items():
            m = EXPERT_KEY.match(n)
            assert m is not None  # split_fused_experts names each expert so
            holder = int(m["e"]) // chunk
            out.append(ShardedTensor(n, tuple(t.shape), v.dtype, holder, mine.get(n)))
    return out


def local_units(tensors: list[ShardedTensor], rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[Unit]]:
    """This rank's units of `tensors` and their local tensors by `Unit.key`: its rows of each
    row-sharded tensor (none when its shard is empty), and the tensors it holds whole."""
    out: dict[str, torch.Tensor] = {}
    units: list[Unit] = []
    for t in tensors:
        if t.holder is None:
            start, stop = shard_rows(t.shape[0], rank, world)
            if stop <= start:
                continue
            u = Unit(t.name, (start, stop))
        elif t.holder == rank:
            u = Unit(t.name)
        else:
            continue
        assert t.local is not None
        units.append(u)
        out[u.key] = t.local.contiguous()
    return out, units


def anchor_plan(tensors: list[ShardedTensor], world: int) -> AnchorPlan:
    """The sharded anchor plan of `tensors` (`anchor_shards.assign`): which rank holds each whole."""
    return assign([(t.name, t.nbytes, t.holder is None) for t in tensors], world,
                  holders={t.name: t.holder for t in tensors if t.holder is not None})


def gather_whole(tensors: list[ShardedTensor], plan: AnchorPlan, ranks: Ranks,
                 group: Any) -> Iterator[tuple[ShardedTensor, torch.Tensor]]:
    """Each tensor `plan` gives this rank, whole: a row-sharded one gathered from every rank's
    rows, one this rank holds whole as it is. Collectives over `group`: every rank iterates to the end."""
    for t in tensors:
        owner = plan.owner[t.name]
        if t.holder is None:
            assert t.local is not None
            whole = gather_rows(t.local, t.shape, t.dtype, owner, rank=ranks.rank, world=ranks.world,
                                group=group, ranks=list(ranks.ranks))
            if whole is not None:
                yield t, whole
        elif owner == ranks.rank:
            assert t.local is not None
            yield t, t.local


def digests_over(tensors: list[ShardedTensor], units: list[Unit], ranks: Ranks, group: Any) -> dict[str, str]:
    """Every rank: the digest of each of `units` (another world size's rows, or whole tensors)
    from the ranks' own bytes, by `Unit.key`. Each row-sharded tensor is gathered whole to one
    rank (the anchor plan's), which hashes its units and drops it; a tensor one rank holds
    whole is hashed there. Units of tensors outside `tensors` get no digest (so the state
    digest differs). Memory: one tensor in flight per rank, as when writing an anchor.
    Collectives over `group` (raise RuntimeError when a rank is lost: wrap in `collective`)."""
    by_name: dict[str, list[Unit]] = {}
    for u in units:
        by_name.setdefault(u.name, []).append(u)
    mine: dict[str, str] = {}
    for t, whole in gather_whole(tensors, anchor_plan(tensors, ranks.world), ranks, group):
        for u in by_name.get(t.name, ()):
            if u.rows is None:
                mine[u.key] = tensor_digest(whole)
            elif whole.dim() and u.rows[1] <= whole.shape[0]:
                mine[u.key] = tensor_digest(whole[u.rows[0] : u.rows[1]])
    got: list[Any] = [None] * ranks.world
    dist.all_gather_object(got, mine, group=group)
    return {k: d for part in got for k, d in part.items()}


def combined_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum of the ranks' sizes; the slowest rank's times."""
    out: dict[str, Any] = {}
    for m in per_rank:
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = max(out.get(k, 0), v) if k.endswith("_s") else out.get(k, 0) + v
    if out.get("n_params"):
        out["density"] = out.get("n_changed", 0) / out["n_params"]
    return out
