"""Hugging Face Buckets as an object store, through huggingface_hub's bucket API and hf_xet.

URL: `hf://buckets/<namespace>/<bucket>/<prefix>`. The Hub is `HF_ENDPOINT` (read when the
store opens) or huggingface.co; the token is the usual one (`HF_TOKEN`, else `hf auth login`),
looked up by huggingface_hub on every call and never stored in a URL, message or repr.

How each operation maps onto the Hub:
- put / put_many: `batch_bucket_files(add=...)` (uploads go through Xet; one batch call).
  `BucketBatchError` is not transactional: the failed paths alone are re-sent, twice, then
  reported together with their server errors.
- get / get_range: plain HTTP GET on `/buckets/{id}/resolve/{path}` (with `Range` for ranges):
  one round trip, good for commit records and safetensors header peeks.
- get_file / get_many: `download_bucket_files` (Xet, parallel, whole files).
- exists: `get_bucket_paths_info`; list: `list_bucket_tree(recursive=True)`; delete: batch.
- wait_for_change: the bucket events feed (`GET /api/buckets/{id}/events`, server-sent events)
  through huggingface_hub's live-follow client, started on first use; any change under the
  prefix wakes the waiter. Where the Hub does not serve the feed (or the token may not read
  it) the client gives up and waiting degrades to a plain sleep, so callers keep polling.

Guarantees: buckets are created only when asked (`create=True`) and then private unless
`private=False`; there is no create-only write on the Hub (`has_create_only` is False, last
writer wins); listings may be stale, callers re-list. huggingface_hub retries 429/5xx itself;
`sparsesync.store.retry` bounds the whole call on top of that.

First contact fails fast: until the endpoint has answered once in this process, every call
first sends one request to it without any retry (through huggingface_hub's own HTTP session,
so proxies apply); a host name that does not resolve, a refused connection or no route raises
`StoreUnavailableError` at once, one line naming the host and the fix, with no retry warnings.
After that first answer the same failures are transient (a Hub restarting, a network blip)
and retried as before. A slow first answer (a timeout) is not judged here: the call proceeds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sparsesync.errors import ConfigError, ObjectNotFoundError, StoreAuthError, StoreError
from sparsesync.store import retry
from sparsesync.store._keys import check_key, check_prefix
from sparsesync.store.base import ObjectInfo, Store

log = logging.getLogger(__name__)

_DEFAULT_ENDPOINT = "https://huggingface.co"
_BATCH_RESENDS = 2
_TIMEOUT_S = 60.0
_PROBE_TIMEOUT_S = 10.0


class HfBucketStore(Store):
    """Objects live under `hf://buckets/<bucket_id>/<prefix>/`; keys are relative to the prefix."""

    has_create_only = False

    def __init__(self, bucket_id: str, prefix: str = "", *, create: bool = False, private: bool = True,
                 endpoint: str | None = None, token: str | None = None) -> None:
        from huggingface_hub import HfApi

        self.bucket_id = bucket_id
        self.prefix = prefix.strip("/")
        self.url = f"hf://buckets/{bucket_id}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")
        self._token = token  # None: huggingface_hub looks it up (HF_TOKEN, then the login file) per call
        self._api = HfApi(endpoint=self.endpoint, token=token)
        self._changed = threading.Event()
        self._feed: Any = None  # huggingface_hub BucketFollower, started by the first wait_for_change
        self._feed_lock = threading.Lock()
        self._closed = False
        if create:
            self._ensure_bucket(private)

    @classmethod
    def from_url(cls, url: str, *, create: bool = False, private: bool = True) -> HfBucketStore:
        """Parse `hf://buckets/<namespace>/<bucket>[/<prefix>]`."""
        head = "hf://buckets/"
        if not url.startswith(head) or "?" in url or "#" in url:
            raise ConfigError(f"HF store URL {url!r} is not hf://buckets/<namespace>/<bucket>/<prefix>",
                              hint="sparsesync stores live in Hub buckets, e.g. hf://buckets/me/rl-sync/run1")
        parts = [p for p in url[len(head):].split("/") if p]
        if len(parts) < 2:
            raise ConfigError(f"HF store URL {url!r} names no bucket",
                              hint="use hf://buckets/<namespace>/<bucket>/<prefix>")
        prefix = "/".join(parts[2:])
        if prefix:
            check_prefix(prefix, url)
        return cls(f"{parts[0]}/{parts[1]}", prefix, create=create, private=private)

    def __repr__(self) -> str:
        return f"HfBucketStore({self.url!r}, endpoint={self.endpoint!r})"

    # -- helpers ------------------------------------------------------------------------
    def _full(self, key: str) -> str:
        check_key(key, self.url)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _secrets(self) -> tuple[str | None, ...]:
        from huggingface_hub import get_token

        return (self._token or get_token(),)

    def _first_contact(self, what: str, url: str) -> None:
        """First contact fails fast (see module docstring); a no-op once the endpoint answered."""
        import httpx2
        from huggingface_hub.utils import get_session

        fix = (f"check the network, and that HF_ENDPOINT={self.endpoint} names a Hub this machine can reach"
               if os.environ.get("HF_ENDPOINT") else
               f"connect this machine to the network (the Hub is {self.endpoint}), or set HF_ENDPOINT to a "
               "Hub it can reach")
        retry.first_contact(self.endpoint, lambda: get_session().head(
            f"{self.endpoint}/api/buckets/{self.bucket_id}", timeout=_PROBE_TIMEOUT_S, follow_redirects=False),
            what=what, url=url, hint=fix, timeouts=(httpx2.TimeoutException,))

    def _transient(self, e: BaseException) -> bool:
        return _is_transient(e)

    def _translate(self, e: Exception, what: str, url: str) -> StoreError:
        from huggingface_hub.errors import BucketNotFoundError, EntryNotFoundError, HfHubHTTPError

        msg = retry.describe(e, self._secrets())
        status = _status(e)
        if isinstance(e, BucketNotFoundError) or (status == 404 and _error_code(e) == "RepoNotFound"):
            return StoreError(
                f"bucket {self.bucket_id} not found on {self.endpoint} ({what} of {url})", url=url,
                hint=f"create it (`hf buckets create {self.bucket_id} --private`, or open the store with "
                "create=True), or use a token that can read it (HF_TOKEN / `hf auth login`)")
        if isinstance(e, EntryNotFoundError) or status == 404:
            return ObjectNotFoundError(f"no object at {url}", url=url,
                                       hint="check the key; the writer may not have committed it yet")
        if status in (401, 403) or _auth_in_message(e):
            have = self._token or _lookup_token()
            fix = ("the token was refused: set HF_TOKEN to a token with write access to "
                   f"{self.bucket_id.split('/')[0]} or run `hf auth login`") if have else (
                "no Hugging Face token found: set HF_TOKEN or run `hf auth login`")
            return StoreAuthError(f"the Hub refused {what} of {url} (HTTP {status or 'auth'})", url=url, hint=fix)
        if isinstance(e, HfHubHTTPError):
            return StoreError(f"{what} of {url} failed: {msg}", url=url,
                              hint="see the Hub's message above; check the bucket id and key")
        return StoreError(f"{what} of {url} failed: {msg}", url=url,
                          hint=f"check HF_ENDPOINT ({self.endpoint}) and the network")

    def _headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(token=self._token)

    def _resolve_url(self, full: str) -> str:
        return f"{self.endpoint}/buckets/{self.bucket_id}/resolve/{quote(full, safe='')}"

    def _ensure_bucket(self, private: bool) -> None:
        from huggingface_hub.errors import BucketNotFoundError

        def _ensure() -> None:
            try:
                self._api.bucket_info(self.bucket_id)
                return
            except BucketNotFoundError:
                pass
            # exist_ok: a concurrent creator, or a bucket we may write but not read the info of
            self._api.create_bucket(self.bucket_id, private=private, exist_ok=True)

        self._call("create bucket", f"hf://buckets/{self.bucket_id}", _ensure)

    # -- writes -------------------------------------------------------------------------
    def put(self, key: str, data: bytes | Path) -> None:
        self.put_many([(key, data)])

    def put_many(self, items: Sequence[tuple[str, bytes | Path]]) -> None:
        from huggingface_hub.errors import BucketBatchError

        pending: list[tuple[str | bytes, str]] = []
        for key, data in items:
            full = self._full(key)
            if isinstance(data, (bytes, bytearray, memoryview)):
                pending.append((bytes(data), full))
            else:
                if not Path(data).is_file():
                    raise StoreError(f"cannot upload {data} to {self.object_url(key)}: no such file",
                                     url=self.object_url(key), hint="pass bytes or an existing file")
                pending.append((str(data), full))
        if not pending:
            return
        failures: list[dict[str, Any]] = []
        for _ in range(1 + _BATCH_RESENDS):
            batch = pending

            def _send(batch: list[tuple[str | bytes, str]] = batch) -> None:
                self._api.batch_bucket_files(self.bucket_id, add=list(batch))

            try:
                self._call("upload", self.url if len(batch) > 1 else self._url_of(batch[0][1]), _send)
                return
            except StoreError as e:
                if not isinstance(e.__cause__, BucketBatchError):
                    raise
                failures = list(getattr(e.__cause__, "failures", []) or [])
                failed = {f.get("path") for f in failures}
                pending = [p for p in pending if p[1] in failed] or pending
        shown = "; ".join(f"{f.get('path')}: {f.get('error')}" for f in failures[:5])
        raise StoreError(
            f"{len(failures)} of {len(items)} uploads to {self.url} failed after {1 + _BATCH_RESENDS} tries: {shown}",
            url=self.url, hint="the other objects were written; retry the upload, and check key names and quota")

    def _url_of(self, full: str) -> str:
        return f"hf://buckets/{self.bucket_id}/{full}"

    def delete(self, keys: Sequence[str]) -> None:
        from huggingface_hub.errors import BucketBatchError

        fulls = [self._full(k) for k in keys]
        if not fulls:
            return

        def _delete() -> None:
            try:
                self._api.batch_bucket_files(self.bucket_id, delete=fulls)
            except BucketBatchError as e:
                # deleting a missing path may be reported as a failure: only paths still there count
                failed = [f.get("path") for f in (getattr(e, "failures", None) or [])]
                still = {i.path for i in self._api.get_bucket_paths_info(self.bucket_id, failed)}
                if still:
                    raise StoreError(f"{len(still)} deletes under {self.url} failed, e.g. {sorted(still)[0]}",
                                     url=self.url, hint="check that the token may write this bucket") from e

        self._call("delete", self.url, _delete)

    # -- reads --------------------------------------------------------------------------
    def _http_get(self, full: str, headers: dict[str, str]) -> Any:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        r = get_session().get(self._resolve_url(full), headers={**self._headers(), **headers},
                              timeout=_TIMEOUT_S, follow_redirects=True)
        if r.status_code == 416:
            return r
        hf_raise_for_status(r)
        return r

    def get(self, key: str) -> bytes:
        full = self._full(key)
        return self._call("download", self.object_url(key),
                          lambda: self._http_get(full, {"Accept-Encoding": "identity"}).content)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        full = self._full(key)
        url = self.object_url(key)
        if start < 0 or length < 0:
            raise StoreError(f"bad range start={start} length={length} for {url}", url=url,
                             hint="start and length must be >= 0")
        if length == 0:
            if not self.exists(key):
                raise ObjectNotFoundError(f"no object at {url}", url=url, hint="check the key")
            return b""

        def _read() -> bytes:
            r = self._http_get(full, {"Range": f"bytes={start}-{start + length - 1}",
                                      "Accept-Encoding": "identity"})
            if r.status_code == 416:
                return b""  # start is at or past the end of an existing object
            body = r.content
            if r.status_code == 200:  # server ignored the range
                body = body[start:start + length]
            return body[:length]

        return self._call("range read", url, _read)

    def get_file(self, key: str, dest: Path) -> None:
        self.get_many([(key, dest)])

    def get_many(self, items: Sequence[tuple[str, Path]]) -> None:
        from huggingface_hub.errors import EntryNotFoundError

        if not items:
            return
        plan = [(self._full(k), Path(d)) for k, d in items]
        parts = [dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}") for _, dest in plan]
        for dest in parts:
            dest.parent.mkdir(parents=True, exist_ok=True)

        def _download() -> None:
            self._api.download_bucket_files(self.bucket_id, [(f, str(p)) for (f, _), p in zip(plan, parts)],
                                            raise_on_missing_files=True)

        what = self.url if len(items) > 1 else self.object_url(items[0][0])
        try:
            self._call("download", what, _download)
            for part, (_, dest) in zip(parts, plan, strict=True):
                os.replace(part, dest)
        except ObjectNotFoundError as e:
            cause = e.__cause__
            missing = str(cause).split(": ", 1)[-1] if isinstance(cause, EntryNotFoundError) else ""
            raise ObjectNotFoundError(f"no object at {what}" + (f" (missing: {missing})" if missing else ""),
                                      url=what, hint=e.hint) from cause
        finally:
            for part in parts:
                part.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        from huggingface_hub import BucketFile

        check_prefix(prefix, self.url)
        root = f"{self.prefix}/" if self.prefix else ""
        want = root + prefix
        # ask the server for the deepest folder the prefix names, then match the plain string here
        # (the Hub matches tree prefixes as plain strings; filtering again keeps us exact either way)
        folder = want.rsplit("/", 1)[0] if "/" in want else ""

        def _list() -> list[ObjectInfo]:
            from huggingface_hub.errors import BucketNotFoundError, EntryNotFoundError

            try:
                entries = list(self._api.list_bucket_tree(self.bucket_id, folder or None, recursive=True))
            except EntryNotFoundError as e:  # a folder that does not exist yet lists empty
                if isinstance(e, BucketNotFoundError):
                    raise
                return []
            out = [ObjectInfo(e.path[len(root):], int(e.size)) for e in entries
                   if isinstance(e, BucketFile) and e.path.startswith(want)]
            out.sort(key=lambda o: o.key)
            return out

        return self._call("list", self.url + ("/" + prefix if prefix else ""), _list)

    def exists(self, key: str) -> bool:
        full = self._full(key)
        return self._call("stat", self.object_url(key),
                          lambda: any(i.path == full for i in self._api.get_bucket_paths_info(self.bucket_id, [full])))

    # -- change feed --------------------------------------------------------------------
    @property
    def events_active(self) -> bool:
        """Whether the bucket events feed is being followed right now (else: plain polling)."""
        feed = self._feed
        return bool(feed and feed.is_alive() and feed.subscribed)

    def wait_for_change(self, timeout: float, stop: threading.Event) -> None:
        self._start_feed()
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._changed.wait(min(left, 0.1)):
                self._changed.clear()
                return

    def close(self) -> None:
        self._closed = True
        feed, self._feed = self._feed, None
        if feed:
            feed.stop()

    def _start_feed(self) -> None:
        with self._feed_lock:
            if self._feed is not None or self._closed:
                return
            try:  # huggingface_hub's reference client of the feed (not public API: optional)
                from huggingface_hub._bucket_live_follow import BucketFollower
            except ImportError:  # pragma: no cover - older huggingface_hub: polling only
                self._feed = False
                return
            root = f"{self.prefix}/" if self.prefix else ""

            def on_changes(changes: list[Any]) -> None:
                # replicas' heartbeats (`fleet/`, rewritten every few seconds) never need a follower to look
                if any(c.path.startswith(root) and not c.path.startswith(root + "fleet/") for c in changes):
                    self._changed.set()

            self._feed = BucketFollower(
                endpoint=self.endpoint, bucket_id=self.bucket_id, token=self._token,
                on_changes=on_changes, on_reconcile=self._changed.set, is_alive=lambda: not self._closed,
            )
            self._feed.start()


# -- classification -----------------------------------------------------------------------
def _status(e: BaseException) -> int:
    resp = getattr(e, "response", None)
    return int(getattr(resp, "status_code", 0) or 0)


def _error_code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    return str(getattr(resp, "headers", {}).get("X-Error-Code", "")) if resp is not None else ""


def _lookup_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _auth_in_message(e: BaseException) -> bool:
    """hf_xet reports a refused token (on its token refresh) as a plain ConnectionError whose
    message carries the HTTP status; XetAuthenticationError is its explicit form."""
    if type(e).__name__ == "XetAuthenticationError":
        return True
    if isinstance(e, (ConnectionError, RuntimeError)) or type(e).__module__.startswith("hf_xet"):
        text = str(e).lower()
        return any(w in text for w in ("401 unauthorized", "403 forbidden", "(401", "(403"))
    return False


def _is_transient(e: BaseException) -> bool:
    import httpx2
    from huggingface_hub.errors import BucketBatchError, HfHubHTTPError

    if _auth_in_message(e):
        return False
    if isinstance(e, BucketBatchError):
        return False  # per-path failures: put_many re-sends just those
    if isinstance(e, HfHubHTTPError):
        return _status(e) in retry.TRANSIENT_HTTP_STATUS
    if isinstance(e, (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
        return True
    if type(e).__module__.startswith("hf_xet") or isinstance(e, RuntimeError):
        text = str(e).lower()  # hf_xet surfaces CAS/network trouble as plain errors with a message
        return any(w in text for w in ("timed out", "timeout", "connection", "reset", "temporar", "unavailable",
                                       " 429", " 500", " 502", " 503", " 504", "too many requests"))
    return retry.is_transient_os_error(e)
