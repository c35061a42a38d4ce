"""sparsesync: move RL weight updates as sparse, digest-checked safetensors patches through a bucket.

The front door:

    import sparsesync

    with sparsesync.Publisher("hf://buckets/me/rl-weights/run-1") as pub:   # the trainer
        pub.publish(model.state_dict(), step)
    follower = sparsesync.Follower("hf://buckets/me/rl-weights/run-1", hook=...)  # each replica
    sparsesync.push("checkpoints/checkpoint-100", url)   # a checkpoint on disk in ...
    sparsesync.pull(url, "policy/")                       # ... and out, bit-exact
    store = sparsesync.open_store(url)                    # the bucket itself

with the types those calls take and return (`FleetOptions`, `ApplyHook`, `FollowerStatus`,
`AdapterMeta`, `SparseUpdate`, `PushResult`, `PullResult`, `Store`; `AdapterMeta` is what every
commit of a LoRA adapter run says about its adapter: pass it as `Publisher(url, adapter=...)` to
publish an adapter state dict), and every error the library
raises on purpose (`sparsesync.SparsesyncError` and its subclasses, from `sparsesync.errors`).
The names load on first use (PEP 562, `sparsesync._lazy`), so `import sparsesync` (and
`sparsesync --help`) imports neither torch nor any store client. `_HOMES` says where each name
lives; the `TYPE_CHECKING` imports and `__all__` list the same names (tests/test_front_door.py).

The packages underneath, low to high (each imports only its own layer or lower; `pyproject.toml`
`[tool.importlinter]` checks it): `errors`, `codec` (change detection and the patch codec),
`store` (object stores), `checkpoint` (checkpoint folders), `lora` (LoRA adapters: the PEFT
bridge, the config bounds, `AdapterMeta`), `protocol` (the run layout, publisher and follower),
`transfer` (push/pull), `integrations` (vLLM, TRL), the apps
(`sparsesync.deploy`; `trainer`, `inference_space`, `env_space` beside this package) and the
`sparsesync` CLI (`sparsesync.cli`).
"""

from __future__ import annotations

from sparsesync._lazy import lazy_names

__version__ = "0.1.0"

TYPE_CHECKING = False  # typing's own flag without importing typing (type checkers take any TYPE_CHECKING as True)
if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily (__getattr__)
    from sparsesync.codec.apply import SparseUpdate
    from sparsesync.errors import (
        AdapterTargetError,
        BaseModelMismatchError,
        BrokenChainError,
        ConfigError,
        DigestMismatchError,
        EngineCheckError,
        EngineError,
        FencedWriterError,
        FleetTimeoutError,
        MalformedCommitError,
        MirrorMismatchError,
        ObjectNotFoundError,
        OutputError,
        PatchError,
        PatchFormatError,
        PatchMismatchError,
        ProtocolError,
        RankFailedError,
        ReplicaUnreachableError,
        RewindRefusedError,
        RunKindError,
        RunNotFoundError,
        SparsesyncError,
        StoreAuthError,
        StoreError,
        StoreUnavailableError,
        VersionNotFoundError,
        WeightUpdateError,
    )
    from sparsesync.lora.meta import AdapterMeta
    from sparsesync.protocol.follower.fleet_member import FleetOptions
    from sparsesync.protocol.follower.follower import Follower
    from sparsesync.protocol.follower.hooks import ApplyHook, FollowerStatus
    from sparsesync.protocol.writer.publisher import Publisher
    from sparsesync.store import Store, open_store
    from sparsesync.transfer import PullResult, PushResult, pull, push

_ERRORS = (
    "SparsesyncError", "ConfigError", "RunKindError", "BaseModelMismatchError", "AdapterTargetError",
    "RewindRefusedError", "OutputError", "PatchError", "PatchFormatError", "PatchMismatchError", "DigestMismatchError",
    "MirrorMismatchError", "StoreError", "ObjectNotFoundError", "StoreUnavailableError", "StoreAuthError",
    "ProtocolError", "MalformedCommitError", "RunNotFoundError", "VersionNotFoundError", "BrokenChainError",
    "FencedWriterError", "RankFailedError", "FleetTimeoutError", "ReplicaUnreachableError",
    "EngineError", "WeightUpdateError", "EngineCheckError",
)  # fmt: skip
_HOMES: dict[str, str] = {
    "Publisher": "sparsesync.protocol.writer.publisher",
    "Follower": "sparsesync.protocol.follower.follower",
    "push": "sparsesync.transfer",
    "pull": "sparsesync.transfer",
    "open_store": "sparsesync.store",
    "FleetOptions": "sparsesync.protocol.follower.fleet_member",
    "ApplyHook": "sparsesync.protocol.follower.hooks",
    "FollowerStatus": "sparsesync.protocol.follower.hooks",
    "AdapterMeta": "sparsesync.lora.meta",
    "SparseUpdate": "sparsesync.codec.apply",
    "PushResult": "sparsesync.transfer",
    "PullResult": "sparsesync.transfer",
    "Store": "sparsesync.store",
    **dict.fromkeys(_ERRORS, "sparsesync.errors"),
}

__all__ = [
    "__version__",
    "Publisher",
    "Follower",
    "push",
    "pull",
    "open_store",
    "FleetOptions",
    "ApplyHook",
    "FollowerStatus",
    "AdapterMeta",
    "SparseUpdate",
    "PushResult",
    "PullResult",
    "Store",
    "SparsesyncError",
    "ConfigError",
    "RunKindError",
    "BaseModelMismatchError",
    "AdapterTargetError",
    "RewindRefusedError",
    "OutputError",
    "PatchError",
    "PatchFormatError",
    "PatchMismatchError",
    "DigestMismatchError",
    "MirrorMismatchError",
    "StoreError",
    "ObjectNotFoundError",
    "StoreUnavailableError",
    "StoreAuthError",
    "ProtocolError",
    "MalformedCommitError",
    "RunNotFoundError",
    "VersionNotFoundError",
    "BrokenChainError",
    "FencedWriterError",
    "RankFailedError",
    "FleetTimeoutError",
    "ReplicaUnreachableError",
    "EngineError",
    "WeightUpdateError",
    "EngineCheckError",
]


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
