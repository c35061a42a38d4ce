"""Sharded anchors of a distributed publisher: every rank writes whole tensors, none the whole model.

transformers' sharded checkpoints (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`)
hold whole tensors, while an FSDP2 rank holds rows of every tensor. So an anchor version assigns
each tensor to one rank (`assign`: replicated plain tensors to rank 0, which publishes them
anyway; tensors one rank holds whole, as MoE experts split from a fused tensor's dim-0 shard, to
that rank; DTensors largest first to the least loaded rank), each DTensor's rows are gathered to
its owner alone (`gather_rows`: one gloo `gather` of byte buffers per tensor, on the publisher's
own group, never the trainer's), and each rank writes its tensors as one shard file with their
digests in its metadata (`codec.anchor.write_anchor_shard`). Rank 0 writes the index from the
plan and every rank's digests (reported in the commit collective) and commits the files together.

Guarantees: the plan is a pure function of the names, global shapes and dtypes, so every rank
computes the same one without a collective; the gathered bytes are the ranks' own bytes (raw
bytes travel, no cast), so the anchor is bit-exact; memory per rank is its own tensors (about
1/N of the model plus at most the largest tensor) and one padded shard of the tensor in flight.
A plan with one non-empty rank writes `model.safetensors` alone, as a single process does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sparsesync.codec.anchor import shard_name


@dataclass(frozen=True)
class AnchorPlan:
    """Which rank writes which tensors, and under which file name."""

    owner: dict[str, int]  # tensor name -> rank that writes it
    files: dict[int, str]  # rank -> its file name (ranks that write nothing are absent)
    total_size: int  # bytes of every tensor

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name (the index's `weight_map`)."""
        return {name: self.files[r] for name, r in self.owner.items()}

    def names(self, rank: int) -> list[str]:
        return [n for n, r in self.owner.items() if r == rank]


def assign(
    tensors: Sequence[tuple[str, int, bool]], world: int, holders: Mapping[str, int] | None = None
) -> AnchorPlan:
    """The plan for (name, bytes, sharded) tensors over `world` ranks: plain tensors on the rank
    `holders` names (one rank holds them whole: a fused MoE tensor's experts), else on rank 0
    (replicated); sharded ones largest first (ties by name) to the rank with the fewest bytes so
    far (ties to the lowest rank). Files are numbered in rank order over the ranks that write one."""
    load = [0] * world
    owner: dict[str, int] = {}
    for name, nbytes, sharded in tensors:
        if not sharded:
            r = (holders or {}).get(name, 0)
            owner[name] = r
            load[r] += nbytes
    for name, nbytes, _ in sorted((t for t in tensors if t[2]), key=lambda t: (-t[1], t[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        owner[name] = r
        load[r] += nbytes
    owner = {name: owner[name] for name, _, _ in tensors}  # the state dict's order
    writers = sorted(set(owner.values()))
    files = {r: shard_name(i + 1, len(writers)) for i, r in enumerate(writers)}
    return AnchorPlan(owner, files, sum(t[1] for t in tensors))


def gather_rows(local: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, owner: int, *, rank: int, world: int,
                group: Any, ranks: Sequence[int]) -> torch.Tensor | None:
    """The whole tensor of `shape` on rank `owner` (None elsewhere), from every rank's dim-0 rows
    `local` (torch.chunk's split, as FSDP2 shards; a rank past the end holds none). Raw bytes
    travel, padded to one chunk per rank; a collective over `group` (global ranks `ranks`)."""
    rows = shape[0]
    chunk = math.ceil(rows / world)
    size = chunk * math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()  # bytes of one rank's rows
    if size == 0:  # no elements (alike on every rank: global shape)
        return torch.empty(tuple(shape), dtype=dtype) if rank == owner else None
    buf = torch.zeros(size, dtype=torch.uint8)
    if local.numel():
        raw = local.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        buf[: raw.numel()] = raw
    whole = torch.empty(world * size, dtype=torch.uint8) if rank == owner else None
    dist.gather(buf, gather_list=list(whole.split(size)) if whole is not None else None, dst=ranks[owner], group=group)
    if whole is None:
        return None
    return whole[: math.prod(shape) * torch.empty((), dtype=dtype).element_size()].view(dtype).reshape(tuple(shape))
