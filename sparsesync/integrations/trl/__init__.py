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

from typing import TYPE_CHECKING

from sparsesync._lazy import lazy_names

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
    "SparsesyncCallback": "sparsesync.integrations.trl.callback",
    "SparsesyncWeightTransfer": "sparsesync.integrations.trl.callback",
    "VersionedPublisher": "sparsesync.integrations.trl.callback",
    "checkpoint_name": "sparsesync.integrations.trl.callback",
    "inference_state": "sparsesync.integrations.trl.callback",
    "model_state": "sparsesync.integrations.trl.callback",
    "sharding": "sparsesync.integrations.trl.callback",
    "SparsesyncVLLMClient": "sparsesync.integrations.trl.client",
    "sparsesync_server_mode": "sparsesync.integrations.trl.client",
    "SparsesyncRolloutLoop": "sparsesync.integrations.trl.rollout",
    "SparsesyncRolloutWorker": "sparsesync.integrations.trl.rollout",
    "follow_replicas": "sparsesync.integrations.trl.rollout",
    "parse_replica_urls": "sparsesync.integrations.trl.rollout",
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


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
