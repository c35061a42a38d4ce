"""The upload queue: versions wait here for the background uploader, which never makes training
wait on the network. It only queues, coalesces and uploads: the writer modes (`whole`,
`sharded`) encode, and the uploader hands each version to the mode that started it
(`start(mode.upload)`), which stores its objects and commits.

When it blocks: never on the network. `put` hands a version to the uploader and returns; when
`queue_size` versions are already waiting, the newest waiting delta is coalesced with the new
one (B->N-1 and N-1->N become B->N; version N-1 is never committed). A delta in parts may be
handed over before it is encoded (`open_stream`, by `stream.PartStream`): when no other version
waits, the uploader takes each part as soon as it is added (`encoded_parts`), while the next one
is encoded; the commit still waits until the version is sealed.
Memory: at most `queue_size` encoded versions wait (plus the one uploading); a committed version
is let go at once.

Retries: a store outage (the store's own retries ran out) is retried with backoff
(`retry_backoff_s`, doubling, at most 30 s); meanwhile newer pure deltas that queued behind are
merged into the one retried. Any other failure stops the uploader: it is raised from the
publisher's next `publish`/`flush` (`raise_error`), as is a failed encoding (`fail`).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsesync.codec import TensorChange, compose_changes, encode_changes
from sparsesync.codec.device_snapshot import Extracted
from sparsesync.errors import SparsesyncError, StoreUnavailableError
from sparsesync.protocol.keys import new_uid
from sparsesync.protocol.writer.config import PublisherConfig
from sparsesync.protocol.writer.parts import EncodedPart, coalesce_parts, combined_stats

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 30.0


@dataclass
class PendingVersion:
    """One version waiting to be uploaded."""

    version: int
    base_version: int | None
    state_digest: str
    base_state_digest: str | None
    digests: dict[str, str]  # every tensor's digest at `version`
    base_digests: dict[str, str] | None
    changes: Mapping[str, TensorChange] | None
    delta: bytes | None
    anchor_dir: Path | None
    metrics: dict[str, Any]
    uid: str = field(default_factory=new_uid)
    parts: list[EncodedPart] | None = None  # the delta in parts (instead of `delta`), appended as encoded
    sealed: bool = True  # False while parts are still being encoded (streamed to the uploader)
    failed: bool = False  # encoding stopped half-way: never committed
    # changes extracted on a device, entropy coded by the uploader before `delta` is stored (None: encoded)
    unencoded: Extracted | None = None
    queued_at: float = 0.0  # time.perf_counter() when `publish` handed it over (for `encode_wait_s`)

    @property
    def pure_delta(self) -> bool:
        """A one-file delta without an anchor (the uploader may merge such versions while it retries)."""
        return self.delta is not None and self.anchor_dir is None


def wait_to_retry(what: str, error: StoreUnavailableError, backoff: float) -> float:
    """After a store outage (the store's own retries ran out): log it, sleep `backoff` seconds;
    the next wait (doubled, at most 30 s)."""
    log.warning("%s failed (%s); retrying in %.1f s", what, error, backoff)
    time.sleep(backoff)
    return min(backoff * 2, MAX_BACKOFF_S)


def coalesce(old: PendingVersion, new: PendingVersion,
             write_anchor: Callable[[PendingVersion], None] | None = None) -> PendingVersion:
    """Merge two waiting versions into one delta old.base -> new.version. When `old` carries an
    anchor it is never committed: its anchor is handed on to `new` (`write_anchor` writes one for
    `new` from the writer's current snapshot, which holds `new`)."""
    if old.anchor_dir is not None:
        shutil.rmtree(old.anchor_dir, ignore_errors=True)
        if new.anchor_dir is None:
            if write_anchor is None:
                raise ValueError(
                    f"version {old.version} carries an anchor: merging it needs an anchor of {new.version}"
                )
            write_anchor(new)
    if old.parts is not None and new.parts is not None:
        assert old.base_version is not None and old.base_digests is not None
        parts = coalesce_parts(old.parts, new.parts, old.base_version, old.base_digests, new.version)
        coalesced = old.metrics.get("coalesced", [old.version]) + [new.version]
        merged = PendingVersion(
            version=new.version, base_version=old.base_version, state_digest=new.state_digest,
            base_state_digest=old.base_state_digest, digests=new.digests, base_digests=old.base_digests,
            changes=None, delta=None, anchor_dir=new.anchor_dir, parts=parts,
            metrics={**new.metrics, **combined_stats(parts), "coalesced": coalesced},
        )
        log.info(
            "uploads lag: coalesced versions %s into %s->%s (in parts)", coalesced, merged.base_version, merged.version
        )
        return merged
    if old.changes is None or new.changes is None:
        # `old` is the very first version (a bare anchor, handed on above): the merge is an anchor of `new`
        new.changes, new.delta, new.base_version, new.parts = None, None, None, None
        new.base_state_digest = new.base_digests = None
        return new
    changes = compose_changes(old.changes, new.changes)
    assert old.base_digests is not None and old.base_version is not None
    data = encode_changes(
        changes,
        base_version=old.base_version,
        target_version=new.version,
        base_digests={n: old.base_digests[n] for n in changes},
        target_digests={n: new.digests[n] for n in changes},
        base_state_digest=old.base_state_digest or "",
        target_state_digest=new.state_digest,
    )
    merged = PendingVersion(
        version=new.version, base_version=old.base_version, state_digest=new.state_digest,
        base_state_digest=old.base_state_digest, digests=new.digests, base_digests=old.base_digests,
        changes=changes, delta=data, anchor_dir=new.anchor_dir,
        metrics={**new.metrics, "patch_bytes": len(data),
                 "coalesced": old.metrics.get("coalesced", [old.version]) + [new.version]},
    )
    log.info("uploads lag: coalesced versions %s into %s->%s", merged.metrics["coalesced"],
             merged.base_version, merged.version)
    return merged


class UploadQueue:
    """The versions waiting for upload and the uploader thread that commits them in order
    through `upload` (a writer mode's, given to `start`; it raises StoreUnavailableError to be retried)."""

    def __init__(self, url: str, config: PublisherConfig) -> None:
        self.url = url
        self.config = config
        self._upload: Callable[[PendingVersion], None] | None = None
        self._pending: deque[PendingVersion] = deque()
        self._busy = False
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None  # started by the mode that uploads (a passive rank: none)

    def start(self, upload: Callable[[PendingVersion], None]) -> None:
        """Start the uploader thread, which commits each queued version through `upload` (once)."""
        if self._thread is not None:
            raise RuntimeError(f"the uploader of {self.url} runs already")
        self._upload = upload
        self._thread = threading.Thread(target=self._loop, name="sparsesync-upload", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Versions handed over but not yet committed."""
        with self._cv:
            return len(self._pending) + int(self._busy)

    @property
    def waiting(self) -> int:
        """Versions waiting (not started)."""
        with self._cv:
            return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> BaseException | None:
        """What stopped the uploader (or the encoding of a streamed version); None while it runs."""
        return self._error

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def put(self, item: PendingVersion, write_anchor: Callable[[PendingVersion], None] | None = None) -> None:
        """Queue `item`; when `queue_size` versions wait, it is coalesced into the newest (see `coalesce`)."""
        with self._cv:
            if len(self._pending) >= self.config.queue_size:
                item = coalesce(self._pending.pop(), item, write_anchor)
            self._pending.append(item)
            self._cv.notify_all()

    def append(self, item: PendingVersion) -> None:
        """Queue `item` as it is (a sharded writer decides merging with the other ranks)."""
        with self._cv:
            self._pending.append(item)
            self._cv.notify_all()

    def take_newest(self, version: int | None) -> PendingVersion | None:
        """The newest waiting version, taken off the queue (the uploader cannot start it while the
        caller decides whether to merge into it), when it is `version` and a delta in parts; else None."""
        with self._cv:
            last = self._pending[-1] if self._pending else None
            if last is None or last.version != version or last.parts is None:
                return None
            return self._pending.pop()

    def wait_for_room(self) -> None:
        """Wait while `queue_size` versions wait for upload (then raise the uploader's error, if any)."""
        with self._cv:
            while len(self._pending) >= self.config.queue_size and self._error is None:
                self._cv.wait(timeout=1.0)
        self.raise_error()

    # -- a delta in parts, handed over while it is encoded (`stream.PartStream`) ---------------
    def open_stream(self, item: PendingVersion, after: PendingVersion | None = None) -> bool:
        """Queue `item` (a delta in parts, not sealed) at once when no other version waits and no
        `after` is pinned: the uploader then takes each part as it is added (`add_part`) and
        commits once `item` is sealed. False: nothing queued (the caller queues it once sealed)."""
        with self._cv:
            if after is not None or self._pending:
                return False
            self._pending.append(item)
            self._cv.notify_all()
            return True

    def add_part(self, item: PendingVersion, part: EncodedPart) -> None:
        """One more encoded part of `item` (which may be uploading already)."""
        with self._cv:
            assert item.parts is not None
            item.parts.append(part)
            self._cv.notify_all()

    def seal(self, item: PendingVersion) -> None:
        """Every part of `item` is added, its digests and metrics set: the uploader may commit it."""
        with self._cv:
            item.sealed = True
            self._cv.notify_all()

    def fail(self, item: PendingVersion, error: SparsesyncError, after: PendingVersion | None = None) -> None:
        """Encoding `item` stopped half-way: it is never committed, `error` stops the publisher
        (raised from its next `publish`/`flush`), and `after` (taken off the queue to merge
        `item` into) is queued again."""
        with self._cv:
            if after is not None:
                self._pending.append(after)
            item.failed = True
            self._error = error
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued version is committed (or raise the uploader's error)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (self._pending or self._busy) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StoreUnavailableError(
                        f"{len(self._pending) + self._busy} version(s) still uploading to {self.url} "
                        f"after {timeout} s",
                        url=self.url,
                        hint="the store is slow or unreachable; the publisher keeps retrying",
                    )
                self._cv.wait(timeout=left if left is not None else 1.0)
        self.raise_error()

    def close(self) -> None:
        """Stop the uploader (after the version it uploads, if any; no flush)."""
        self._closed = True
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the uploader's side ------------------------------------------------------------------
    def encoded_parts(self, item: PendingVersion) -> Iterator[EncodedPart]:
        """`item`'s parts, each as soon as it is encoded; the iteration ends once `item` is sealed
        and every part was given, or early when its encoding failed (`item.failed`: never commit it)."""
        i = 0
        assert item.parts is not None
        while True:
            with self._cv:
                while len(item.parts) <= i and not item.sealed and not item.failed:
                    self._cv.wait(timeout=1.0)
                if item.failed or len(item.parts) <= i:
                    return
                part = item.parts[i]
            yield part
            i += 1

    def _loop(self) -> None:
        backoff = self.config.retry_backoff_s
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait(timeout=1.0)  # a lost wake-up (publish interrupted mid-enqueue) heals itself
                if not self._pending:
                    return
                item = self._pending.popleft()
                self._busy = True
            try:
                while True:
                    try:
                        assert self._upload is not None  # set before the thread starts
                        self._upload(item)
                        backoff = self.config.retry_backoff_s
                        break
                    except StoreUnavailableError as e:
                        if self._closed:
                            raise
                        backoff = wait_to_retry(f"upload of version {item.version}", e, backoff)
                        with self._cv:  # newer deltas may have queued: merge them in now
                            # (only pure deltas: anchors are serialized on the publishing thread)
                            if self._pending and item.pure_delta and self._pending[0].pure_delta:
                                item = coalesce(item, self._pending.popleft())
            except BaseException as e:  # noqa: BLE001 - fatal: surfaced from publish()/flush()
                with self._cv:
                    self._error = e if isinstance(e, SparsesyncError) else SparsesyncError(
                        f"uploader of {self.url} failed: {e!r}")
                    self._busy = False
                    self._cv.notify_all()
                return
            item = None  # type: ignore[assignment]  # its changes and patch go now, not when the next version arrives
            with self._cv:
                self._busy = False
                self._cv.notify_all()
