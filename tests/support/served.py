"""A follower's hook that serves through a real engine and notes what it served: the state digest
of the engine's own weights after every version, in order (so a test can say which states a
replica ever served, e.g. never an abandoned version after a rewind)."""

from __future__ import annotations

from typing import Any

from sparsesync.codec import state_digest, tensor_digests
from sparsesync.protocol.follower.hooks import ApplyHook


class ServedDigests(ApplyHook):
    """`engine` (an EmbeddedEngine) as the follower's hook; `served` holds the state digest of
    the engine's weights after each version it took, read back from the engine itself."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.served: list[str] = []

    def load_full(self, version: int, tensors: Any) -> None:
        self.engine.load_full(version, tensors)
        self.served.append(state_digest(tensor_digests(self.engine.state_dict())))

    def apply_sparse(self, version: int, updates: Any, full: Any) -> None:
        self.engine.apply_sparse(version, updates, full)
        self.served.append(state_digest(tensor_digests(self.engine.state_dict())))
