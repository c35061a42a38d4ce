"""The one small interface every object store implements.

A store is a flat namespace of immutable objects addressed by '/'-separated keys relative to
the store's root URL (e.g. `hf://buckets/me/rl/run1` or `s3://bucket/prefix`). sparsesync
writes every object once under a unique key and never overwrites, so the interface needs no
compare-and-swap; `put_new` uses create-only writes where the backend has them and is a plain
put elsewhere (callers must not rely on it for correctness).

Guarantees every backend keeps:
- `get`/`get_range`/`get_file` of a missing key raise `ObjectNotFoundError` naming the URL.
- transient failures (timeouts, connection resets, 5xx, 429) are retried with backoff
  (`sparsesync.store.retry`); when retries run out, `StoreUnavailableError`.
- auth failures raise `StoreAuthError` with the fix; tokens never appear in messages or `url`.
- `list(prefix)` returns every object whose key starts with `prefix` (a plain string match),
  recursively, sorted by key. Listings may be stale on some backends; callers re-list.

Every backend runs each operation through the one wrapper `Store._call` (retries, then its own
translation of what failed into a `StoreError`); a backend supplies only the hooks.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from sparsesync.errors import StoreError
from sparsesync.store import retry

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key relative to the store root, and its size in bytes."""

    key: str
    size: int


class Store(abc.ABC):
    """An object store rooted at `url`. Keys are relative, '/'-separated, never start with '/'."""

    #: root URL of the store, safe to print (no credentials)
    url: str
    #: True when `put_new` is a real create-only write (fails if the key exists)
    has_create_only: bool = False

    def object_url(self, key: str) -> str:
        """The printable URL of one object."""
        return f"{self.url.rstrip('/')}/{key}"

    # -- the one wrapper of every backend operation, and its hooks -------------------------------
    def _call(self, what: str, url: str, fn: Callable[[], T]) -> T:
        """Run `fn`, the operation `what` on `url`: the backend's first-contact check, then
        `fn` retried while `_transient` says its failure may pass (`retry.call`). A `StoreError`
        passes through; any other failure becomes the `StoreError` `_translate` makes of it, or
        leaves unchanged where `_translate` makes none (a bug, not a store's answer)."""
        try:
            self._first_contact(what, url)
            return retry.call(fn, what=what, url=url, transient=self._transient, secrets=self._secrets())
        except StoreError:
            raise
        except Exception as e:
            err = self._translate(e, what, url)
            if err is None:
                raise
            raise err from e

    def _first_contact(self, what: str, url: str) -> None:
        """Fail fast before the first operation reaches an endpoint that cannot be reached (default: nothing to
        check)."""

    def _transient(self, e: BaseException) -> bool:
        """Whether the failure `e` may pass on a retry (default: a transient OS error)."""
        return retry.is_transient_os_error(e)

    def _secrets(self) -> tuple[str | None, ...]:
        """Credential values to mask in messages (default: none)."""
        return ()

    def _translate(self, e: Exception, what: str, url: str) -> StoreError | None:
        """The `StoreError` that says what the failure `e` of `what` on `url` means, or None to raise `e` unchanged."""
        return None

    # -- writes -------------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, key: str, data: bytes | Path) -> None:
        """Store `data` (bytes, or the contents of a local file) under `key`."""

    def put_many(self, items: Sequence[tuple[str, bytes | Path]]) -> None:
        """Store several objects; backends with batch uploads override this. Not atomic."""
        for key, data in items:
            self.put(key, data)

    def put_new(self, key: str, data: bytes) -> bool:
        """Create `key` only if absent. Returns False if it already existed.

        Backends without create-only writes check existence first (racy); see `has_create_only`.
        """
        if self.exists(key):
            return False
        self.put(key, data)
        return True

    @contextlib.contextmanager
    def deferred_sync(self) -> Iterator[None]:
        """Writes of this thread in the block may return once visible, before they are durable,
        as long as each is durable before any later write of this store becomes visible (so after
        a power loss only the newest such object can be missing or empty). For the last write of
        a version, the commit record. Default: nothing changes (every write durable on return)."""
        yield

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects; missing keys are ignored."""

    # -- reads --------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from offset `start` (fewer only at the end of the object)."""

    def get_file(self, key: str, dest: Path) -> None:
        """Download the object to a local file (atomically: written to a temp name, renamed)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        tmp.write_bytes(self.get(key))
        tmp.replace(dest)

    def get_many(self, items: Sequence[tuple[str, Path]]) -> None:
        """Download several objects; backends with bulk downloads override this."""
        for key, dest in items:
            self.get_file(key, dest)

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, recursively, sorted by key."""

    def exists(self, key: str) -> bool:
        """Whether `key` exists (may be stale where listings are)."""
        return any(o.key == key for o in self.list(key))

    def wait_for_change(self, timeout: float, stop: threading.Event) -> None:
        """Sleep up to `timeout` s, returning early when `stop` is set or (on backends with a
        change feed, such as HF bucket events) when objects under the store changed."""
        stop.wait(timeout)

    def close(self) -> None:
        """Release connections and threads. Safe to call twice."""
