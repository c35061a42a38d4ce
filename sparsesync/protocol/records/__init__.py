"""Every record a run writes to or reads from a bucket, as typed dataclasses (docs/protocol.md).

    CommitRecord   commits/v{version}-e{epoch}.json   makes a version visible; its fields are
                   ObjectRef, PartRef (+ Unit), FileRef and AdapterMeta          (`commit.py`);
                   its `metrics` typed: CommitMetrics, CommitKind             (`metrics.py`)
    WriterClaim    writers/e{epoch}-{writer}.json     a writer's claim of an epoch (`commit.py`)
    Heartbeat      fleet/{replica}.json                a replica's report of itself (`replica.py`)
    SwitchRecord   switches/v{version}.json            "switch to this version at apply_at" (`replica.py`)

Each has `to_json()` (the bytes on the wire, as every earlier sparsesync wrote them) and
`from_json(data, key)`. All of them read their JSON through one bounded field reader
(`fields.py`: `load_object` and `Fields`): sizes capped, types, lengths and ranges checked, a
one-line reason naming the field for anything else. Object names are `protocol.keys`'s.
Import the names from here; the submodules split the records by concept only.
"""

from sparsesync.protocol.records.commit import (
    ADAPTER_DTYPES,
    COMMIT_FORMAT,
    COMMIT_FORMAT_PARTS,
    FILE_NAMES,
    MAX_CLAIM_BYTES,
    MAX_COMMIT_BYTES,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_OBJECT_BYTES,
    MAX_TOTAL_BYTES,
    AdapterMeta,
    CommitRecord,
    FileRef,
    ObjectRef,
    PartRef,
    Unit,
    WriterClaim,
)
from sparsesync.protocol.records.fields import Fields, check_list, clean_text, load_object, show
from sparsesync.protocol.records.metrics import KINDS, CommitKind, CommitMetrics
from sparsesync.protocol.records.replica import (
    HEARTBEAT_FORMAT,
    MAX_DURATION,
    MAX_LEAD_S,
    MAX_RECORD_BYTES,
    MAX_TEXT,
    MAX_TIME,
    SWITCH_FORMAT,
    Heartbeat,
    SwitchRecord,
)

__all__ = [
    "ADAPTER_DTYPES", "COMMIT_FORMAT", "COMMIT_FORMAT_PARTS", "FILE_NAMES", "HEARTBEAT_FORMAT", "KINDS",
    "MAX_CLAIM_BYTES", "MAX_COMMIT_BYTES", "MAX_DURATION", "MAX_FILES", "MAX_FILE_BYTES", "MAX_LEAD_S",
    "MAX_OBJECT_BYTES", "MAX_RECORD_BYTES", "MAX_TEXT", "MAX_TIME", "MAX_TOTAL_BYTES", "SWITCH_FORMAT",
    "AdapterMeta", "CommitKind", "CommitMetrics", "CommitRecord", "Fields", "FileRef", "Heartbeat", "ObjectRef",
    "PartRef", "SwitchRecord", "Unit", "WriterClaim", "check_list", "clean_text", "load_object", "show",
]
