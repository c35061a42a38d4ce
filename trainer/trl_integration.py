"""Old import path of `sparsesync.integrations.trl`, kept so existing imports keep working.

Import from the library instead (`from sparsesync.integrations.trl import SparsesyncCallback`):
a user's own `trainer.py` shadows this top-level package.
"""

from sparsesync.integrations.trl import (
    SparsesyncCallback,
    SparsesyncWeightTransfer,
    checkpoint_name,
    inference_state,
    model_state,
)

__all__ = ["SparsesyncCallback", "SparsesyncWeightTransfer", "checkpoint_name", "inference_state", "model_state"]
