"""The trainer under `torchrun`: data-parallel GRPO on an FSDP2-sharded policy, one rollout side.

    torchrun --nproc-per-node 2 -m trainer --config trainer.toml

Launched by torchrun (WORLD_SIZE > 1 in the environment), `python -m trainer` is one rank of a
sharded run; nothing in the config switches it on. Each rank initializes the process group (gloo
on CPU, `cuda:nccl,cpu:gloo` on CUDA, so the publisher's CPU shards still have a backend), loads
the same weights, wraps them with FSDP2 `fully_shard` (every decoder layer, then the root) and
publishes `model.state_dict()` (DTensors) through `Publisher`, which then runs
in its sharded mode (`sparsesync.protocol.writer.sharded`): each rank diffs and uploads its own rows, rank 0 commits.

Design: rank 0 alone drives the rollout side (replica pool, rollout workers, buffer, fleet wait,
metrics) and sends each step's groups to every rank over a gloo group of our own
(`send_batch` / `receive_batch`); rank r trains on groups r, r + N, ... of the step
(`my_groups`), with the loss normalized by the step's total completion tokens so FSDP's gradient
average is the single-process gradient of the whole batch. One rollout stream keeps the staleness accounting, the env
and the replicas' load exactly as in one process; ranks reading their own slices would need N buffers
that agree on versions. The broadcast is tiny next to a step (token ids and log-probs).

Failure: no collective waits longer than `[distributed] timeout_s`; rank 0 sends a keep-alive
every 2 s while it waits for rollouts (its fleet wait is bounded by `[sync] fleet_timeout_s`,
which the config requires to be shorter), and a stop message with its error when it fails alone
(rollouts, fleet wait) while the others wait for a batch. A rank that dies is noticed by gloo at once (its sockets
close) and torchrun stops the others with SIGTERM, which `stop_on_sigterm` turns into RankFailedError, so every rank
ends with a one-line error and no version is half committed (the distributed publisher commits only when
every part is stored).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from sparsesync.checkpoint import shared_aliases
from sparsesync.errors import ConfigError, RankFailedError
from trainer.buffer import Group
from trainer.errors import TrainerError


def launched_distributed() -> bool:
    """Whether this process is one rank of a multi-process launch (torchrun sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class DistContext:
    """This rank's place in the job and the gloo group the step's batch travels on."""

    rank: int
    world: int
    device: torch.device
    group: Any  # gloo group of our own: the batch broadcast and the loss average

    @property
    def lead(self) -> bool:
        """Rank 0: drives the rollout side, logs, commits."""
        return self.rank == 0


def init_distributed(device: torch.device, timeout_s: float) -> DistContext:
    """Join the job torchrun started (env:// rendezvous). `device` is cpu or cuda; on cuda each
    rank takes the GPU `LOCAL_RANK`."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout)
    return DistContext(dist.get_rank(), dist.get_world_size(), device, group)


def shard_policy(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: `fully_shard` every decoder layer (the model's `_no_split_modules` classes), then
    the root; parameters become DTensors sharded on dim 0. Tied weights stay one parameter."""
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"[model] {type(model).__name__} names no decoder layer class (_no_split_modules)",
                          hint="train it in one process, or use a transformers causal LM (Qwen3, Llama, ...)")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def my_groups(groups: list[Group], rank: int, world: int) -> list[Group]:
    """This rank's share of the step: groups rank, rank + world, ..."""
    return groups[rank::world]


def full_state(state: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor] | None:
    """Every DTensor of `state` gathered (a collective: call it on every rank, same order); the
    full tensors on rank 0, None elsewhere."""
    from torch.distributed.tensor import DTensor

    aliases = shared_aliases(state) if rank == 0 else {}  # rank 0's shards tell which names are tied
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t  # every rank, every name: the same collectives
        if rank == 0:
            out[name] = out[aliases[name]] if name in aliases else full.cpu()  # a tied head stays one tensor
    return out if rank == 0 else None


def all_mean(value: float, ctx: DistContext) -> float:
    """The mean of `value` over the ranks (one small all_reduce on the batch group)."""
    t = torch.tensor([value], dtype=torch.float64)
    with collective(ctx, "averaging the loss"):
        dist.all_reduce(t, group=ctx.group)
    return float(t[0]) / ctx.world


@contextlib.contextmanager
def collective(ctx: DistContext, what: str) -> Iterator[None]:
    """Turn a failed collective (a peer died, or waited past the timeout) into RankFailedError."""
    try:
        yield
    except RuntimeError as e:  # gloo / nccl errors (DistBackendError is one)
        raise RankFailedError(f"rank {ctx.rank} of {ctx.world}: {what} failed: {str(e).splitlines()[0]}",
                              hint="another rank of the trainer died or hung (see its error); restart the job: "
                                   "it continues from the newest committed version") from None


def send_batch(ctx: DistContext, kind: str, payload: Any = None) -> None:
    """Rank 0 to every other rank: "batch" (the step's list of Group), "wait" (a keep-alive) or
    "stop" (rank 0's error text). Plain objects between the job's own ranks, never bucket data."""
    with collective(ctx, f"sending {kind!r} to the other ranks"):
        dist.broadcast_object_list([(kind, payload)], src=0, group=ctx.group)


def receive_batch(ctx: DistContext, step: int) -> list[Group]:
    """Other ranks: the groups of `step` (keep-alives skipped); TrainerError if rank 0 stopped."""
    while True:
        box: list[Any] = [None]
        with collective(ctx, f"waiting for the batch of step {step} from rank 0"):
            dist.broadcast_object_list(box, src=0, group=ctx.group)
        kind, payload = box[0]
        if kind == "batch":
            return list(payload)
        if kind == "stop":
            raise TrainerError(f"rank 0 stopped the run at step {step}: {payload}")


def stop_on_sigterm(rank: int) -> None:
    """SIGTERM (torchrun stopping the job because another rank failed) raises RankFailedError
    here, so cleanup runs and the rank ends with one line naming the cause."""

    def _handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise RankFailedError(
            f"rank {rank}: stopped by the launcher (signal {signum}): another rank of the trainer failed",
            hint="see the other ranks' errors (torchrun names the first failure); restart the job: "
            "it continues from the newest committed version",
        )

    signal.signal(signal.SIGTERM, _handler)
