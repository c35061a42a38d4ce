"""How a training job starts on its bucket: a new run, the run's continuation, or a rewind.

`first_version(publisher, state, cfg, ctx)`: on an empty bucket the weights at `[model] path`
are published as version 0. On a bucket that holds a run they continue it: from its newest
version when they are its weights (the next version is a delta), else from the newest older
version that they are (a checkpoint from before a crash): the run is rewound to it
(docs/protocol.md, "Rewinds"; `Publisher.resume(state, version=N)`), in one process and under
torchrun alike (there every rank takes part: the weights are checked over the run's units,
nothing gathered whole on one rank). Weights that are no version of the run are a ConfigError,
before anything is uploaded, naming what the run holds.

`wait_for_rewound_replicas`: after a rewind, no rollout starts before every replica of
`[rollout] replicas` serves the rewound state (its `/sync` state digest), so no sample comes
from weights the rewind abandoned.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from sparsesync.errors import ConfigError, PatchMismatchError
from sparsesync.protocol.writer.publisher import Publisher
from trainer.config import TrainerConfig
from trainer.distributed import DistContext, collective
from trainer.errors import TrainerError
from trainer.replicas import ReplicaPool

log = logging.getLogger(__name__)


def first_version(publisher: Publisher, state: dict[str, torch.Tensor], cfg: TrainerConfig,
                  ctx: DistContext | None = None) -> tuple[int, bool]:
    """(the version the job starts from, whether it rewound the run): see the module docstring.
    Under torchrun every rank calls it and goes by rank 0's view of the run."""
    newest = publisher.committed_version
    if ctx is not None:
        import torch.distributed as dist

        box: list[Any] = [newest]
        dist.broadcast_object_list(box, src=0, group=ctx.group)  # every rank goes by rank 0's view
        newest = box[0]
    if newest is None:
        with _collective(ctx, "publishing the first version"):
            return publisher.publish(state, 0), False
    try:
        with _collective(ctx, "resuming the run"):
            publisher.resume(state)
        return newest, False
    except PatchMismatchError as e:  # raised on every rank alike
        # weights of an older version (a checkpoint from before a crash): rewind the run to it
        with _collective(ctx, "finding which version of the run [model] path holds"):
            older = publisher.version_of(state)
        if older is None:
            raise ConfigError(
                f"[sync] bucket {cfg.sync.bucket!r} already holds a run: its newest version ({newest}) is not the "
                "weights at [model] path, nor is any older version of it",
                hint="use a fresh bucket or prefix for a new run, or start from one of the run's versions "
                     f"(`sparsesync pull {cfg.sync.bucket} DIR --version N`)",
            ) from e
    with _collective(ctx, f"rewinding the run to version {older}"):
        publisher.resume(state, version=older)  # docs/protocol.md, "Rewinds"
    log.warning("[model] path holds version %d of %s: the run is rewound to it", older, cfg.sync.bucket)
    return older, True


def wait_for_rewound_replicas(pool: ReplicaPool, publisher: Publisher, version: int, timeout_s: float) -> None:
    """After a rewind, until every replica of `pool` serves the rewound `version` (its `/sync`
    state digest; a replica that reports none: its version), so no rollout comes from an
    abandoned version. TrainerError after `timeout_s` (`[sync] fleet_timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    want = (version, publisher.state_digest)
    while True:
        seen = {u: None if st is None else (st.get("serving_version"), st.get("state_digest", want[1]))
                for u, st in pool.sync_status().items()}
        behind = {u: v for u, v in seen.items() if v != want}
        if not behind:
            return
        if time.monotonic() > deadline:
            raise TrainerError(
                f"after the rewind to version {want[0]}, replicas {sorted(behind)} still serve {list(behind.values())} "
                f"after {timeout_s} s", hint="check that they follow [sync] bucket (GET /sync)")
        time.sleep(0.1)


def _collective(ctx: DistContext | None, what: str) -> contextlib.AbstractContextManager[None]:
    return collective(ctx, what) if ctx is not None else contextlib.nullcontext()
