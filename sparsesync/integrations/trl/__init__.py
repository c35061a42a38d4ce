"""TRL on sparsesync: TRL's trainers publish through a bucket, and read from its replicas.

- `callback`: `SparsesyncCallback` (a `transformers.TrainerCallback` for `trl.GRPOTrainer` or
  any `Trainer`) and `SparsesyncWeightTransfer` (the weight transfer of TRL's experimental async
  GRPO trainer); both publish each policy as the next version of a run. Needs `transformers`.
- `client`: `sparsesync_server_mode(bucket)`, a drop-in for TRL's vLLM client in `GRPOTrainer`
  server mode (`SparsesyncVLLMClient`). Needs `trl`.
- `rollout`: `follow_replicas(trainer, urls)`, TRL's async GRPO rollout worker on sparsesync
  replicas. Needs `trl`.

    from sparsesync.integrations.trl import SparsesyncCallback

Importing this package imports no trainer library: each name loads its submodule on first use
(PEP 562), so `SparsesyncCallback` needs only `transformers`, as it always did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily (__getattr__)
    from sparsesync.integrations.trl.callback import (
        SparsesyncCallback,
        SparsesyncWeightTransfer,
        VersionedPublisher,
        checkpoint_name,
        inference_state,
        model_state,
        sharding,
    )
    from sparsesync.integrations.trl.client import SparsesyncVLLMClient, sparsesync_server_mode
    from sparsesync.integrations.trl.rollout import (
        SparsesyncRolloutLoop,
        SparsesyncRolloutWorker,
        follow_replicas,
        parse_replica_urls,
    )

_HOMES = {
    "SparsesyncCallback": "callback",
    "SparsesyncWeightTransfer": "callback",
    "VersionedPublisher": "callback",
    "checkpoint_name": "callback",
    "inference_state": "callback",
    "model_state": "callback",
    "sharding": "callback",
    "SparsesyncVLLMClient": "client",
    "sparsesync_server_mode": "client",
    "SparsesyncRolloutLoop": "rollout",
    "SparsesyncRolloutWorker": "rollout",
    "follow_replicas": "rollout",
    "parse_replica_urls": "rollout",
}

__all__ = [
    "SparsesyncCallback",
    "SparsesyncWeightTransfer",
    "VersionedPublisher",
    "checkpoint_name",
    "inference_state",
    "model_state",
    "sharding",
    "SparsesyncVLLMClient",
    "sparsesync_server_mode",
    "SparsesyncRolloutLoop",
    "SparsesyncRolloutWorker",
    "follow_replicas",
    "parse_replica_urls",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
