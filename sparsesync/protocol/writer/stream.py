"""A delta in parts, encoded by a writer mode and handed to the uploader part by part.

    with PartStream(queue, snapshot, version) as stream:
        item = stream.encode(state)      # each part goes to the uploader as soon as it is encoded
        ...                              # the mode's own bookkeeping (anchor bytes, an anchor)
    if not stream.streamed:
        queue.put(item)                  # the mode queues (coalesces, merges) it itself

Guarantees: when no other version waits for upload (and nothing is pinned to merge into,
`after`), the version is queued before its first part is encoded and the uploader stores each
part while the next is encoded; its commit waits until the `with` block ends without an error
(`UploadQueue.seal`). Any error inside the block (encoding, or the mode's bookkeeping) marks the
version failed, so nothing of it is ever committed, and stops the publisher: the snapshot may
hold this version in some parts only, so nothing more can be published from it (the error is
raised here and again from the next `publish`/`flush`; `after` is queued again).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

import torch

from sparsesync.errors import SparsesyncError
from sparsesync.protocol.writer.parts import PartedSnapshot, combined_stats
from sparsesync.protocol.writer.uploads import PendingVersion, UploadQueue


class PartStream:
    """Encode one delta in parts against `snap` into `queue` (see the module docstring)."""

    def __init__(self, queue: UploadQueue, snap: PartedSnapshot, version: int,
                 after: PendingVersion | None = None) -> None:
        self.queue, self.snap, self.version, self.after = queue, snap, version, after
        self.item = PendingVersion(
            version=version, base_version=snap.version, state_digest="", base_state_digest=snap.state_digest,
            digests={}, base_digests=snap.digests, changes=None, delta=None, anchor_dir=None, metrics={},
            parts=[], sealed=False,
        )
        self.streamed = False  # queued before it was encoded (else the mode queues it once sealed)

    def __enter__(self) -> PartStream:
        self.streamed = self.queue.open_stream(self.item, self.after)
        return self

    def encode(self, state: Mapping[str, torch.Tensor]) -> PendingVersion:
        """Diff and encode `state` against the snapshot (which then holds this version), each
        part handed to the uploader as soon as it is encoded; the version, its digests and
        metrics set (not yet sealed)."""
        item = self.item
        parts = self.snap.diff_encode(state, self.version, lambda part: self.queue.add_part(item, part))
        item.state_digest, item.digests = self.snap.state_digest, self.snap.digests
        item.metrics = combined_stats(parts)
        return item

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if error is None:
            self.queue.seal(self.item)
            return
        self.queue.fail(self.item, error if isinstance(error, SparsesyncError) else SparsesyncError(
            f"encoding version {self.version} for {self.queue.url} failed half-way: {error!r}",
            hint="start a new Publisher (its first version is an anchor)"), self.after)
