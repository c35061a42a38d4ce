"""A stand-in for the Hugging Face Hub's bucket routes, on 127.0.0.1, for tests.

It speaks the wire protocol the real `huggingface_hub` client and `hf_xet` use (see
/work/shared/notes/hub-buckets.md), so `HfApi` bucket calls run unmodified end to end:
create/info/delete/settings, tree (paginated with `Link: rel="next"`), paths-info, batch
(NDJSON), resolve HEAD/GET (with `Range`), and xet read/write tokens that hand out a
file-backed `local:///<dir>` CAS. Uploaded bytes live in that CAS; the server reads them back
through hf_xet to learn sizes and to answer resolve GETs. It stands in for the Hub at the wire
only: no business logic of sparsesync lives here.

Fault knobs (all thread-safe, all cleared by `heal()`):
- `fail_next(n, status=503, mode="status")`: the next n requests fail transiently
  (mode "status": an HTTP error; mode "drop": the connection is closed with no answer).
- `unavailable_for(seconds, status=503, mode="status")`: every request fails for a while.
- `stale_listing()` / `fresh_listing()`: tree and paths-info answer from a snapshot of the
  bucket contents taken when `stale_listing()` was called (resolve stays fresh).
- `fail_batch_path(path, times=1)`: the batch route reports that path as failed.
- `events_enabled`: serve the bucket events feed (`GET .../events`, server-sent events:
  `ready`, then `changes` batches with integer cursors; `?cursor=N` replays after N). Off by
  default: the route answers 501, as on deployments without live follow.
- `tokens`: when a set, requests must carry `Authorization: Bearer <one of them>` (401 else).
`requests` records every request (method, path, JSON body, whether it carried a token).

Run alone for manual poking: `python -m tests.support.hub_server` (prints its URL).
"""

from __future__ import annotations

import copy
import json
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.support.tcp_proxy import TcpProxy

_BUCKET_ROUTE = re.compile(
    r"^/api/buckets/(?P<ns>[^/]+)/(?P<name>[^/]+)"
    r"(?:/(?P<op>tree|paths-info|batch|xet-read-token|xet-write-token|settings|events)(?:/(?P<rest>.*))?)?$"
)
_RESOLVE_ROUTE = re.compile(r"^/buckets/(?P<ns>[^/]+)/(?P<name>[^/]+)/resolve/(?P<path>.+)$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(ts * 1000) % 1000:03d}Z"


@dataclass
class StoredFile:
    """One file of a bucket: its Xet hash and size, as the Hub records them."""

    xet_hash: str
    size: int
    mtime: float
    uploaded_at: float

    def as_json(self, path: str) -> dict[str, Any]:
        return {"type": "file", "path": path, "size": self.size, "xetHash": self.xet_hash,
                "mtime": _iso(self.mtime), "uploadedAt": _iso(self.uploaded_at)}


@dataclass
class Bucket:
    """A bucket: visibility, creation time, files by path."""

    private: bool
    created_at: float
    files: dict[str, StoredFile] = field(default_factory=dict)


@dataclass
class RecordedRequest:
    """One request as the server saw it (no token values are kept)."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    has_token: bool
    status: int = 0


class HubServer:
    """The bucket routes of the Hub on 127.0.0.1:<port>, backed by a local Xet CAS."""

    def __init__(self, root: str | Path | None = None, *, page_size: int = 100) -> None:
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="hub-server-")
        self.root = Path(root or self._tmp.name)  # type: ignore[union-attr]
        self.cas_dir = self.root / "cas"
        self.cas_dir.mkdir(parents=True, exist_ok=True)
        self.cas_url = f"local://{self.cas_dir.absolute()}"
        self.page_size = page_size
        self.tokens: set[str] | None = None
        self.buckets: dict[str, Bucket] = {}
        self.requests: list[RecordedRequest] = []
        self.lock = threading.RLock()
        self._blobs: dict[str, bytes] = {}
        self._xet: Any = None
        self._fail_next = 0
        self._down_until = 0.0
        self._fault_status = 503
        self._fault_mode = "status"
        self._snapshot: dict[str, dict[str, StoredFile]] | None = None
        self._batch_failures: dict[str, int] = {}
        self.events_enabled = False
        self._events: list[tuple[str, dict[str, Any]]] = []  # (bucket id, change), cursor = index + 1
        self._events_cv = threading.Condition(self.lock)
        self._stopping = False
        self.proxy: TcpProxy | None = None
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, port: int = 0, *, proxy: bool = False) -> HubServer:
        """Serve on 127.0.0.1:`port` (0: any free port); `proxy=True` also puts a `TcpProxy`
        in front, so `endpoint` can be made to refuse connections."""
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        if proxy:
            self.proxy = TcpProxy("127.0.0.1", self.port).start()
        return self

    @property
    def port(self) -> int:
        assert self._httpd is not None, "start() first"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        """The server itself."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """What clients should use as HF_ENDPOINT: the proxy when there is one."""
        return self.proxy.url if self.proxy is not None else self.url

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self._events_cv.notify_all()
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- fault knobs ----------------------------------------------------------------------
    def fail_next(self, n: int, *, status: int = 503, mode: str = "status") -> None:
        """The next `n` requests fail: HTTP `status` (mode "status") or a closed connection ("drop")."""
        with self.lock:
            self._fail_next, self._fault_status, self._fault_mode = n, status, mode

    def unavailable_for(self, seconds: float, *, status: int = 503, mode: str = "status") -> None:
        """Every request fails for `seconds` from now."""
        with self.lock:
            self._down_until, self._fault_status, self._fault_mode = time.monotonic() + seconds, status, mode

    def stale_listing(self) -> None:
        """Freeze tree and paths-info answers at the current contents of every bucket."""
        with self.lock:
            self._snapshot = {bid: copy.deepcopy(b.files) for bid, b in self.buckets.items()}

    def fresh_listing(self) -> None:
        with self.lock:
            self._snapshot = None

    def fail_batch_path(self, path: str, times: int = 1) -> None:
        """The batch route reports `path` (full path in the bucket) as failed `times` times."""
        with self.lock:
            self._batch_failures[path] = times

    def heal(self) -> None:
        """End every fault."""
        with self.lock:
            self._fail_next = 0
            self._down_until = 0.0
            self._snapshot = None
            self._batch_failures.clear()
            self.events_enabled = False
            self._events_cv.notify_all()
        if self.proxy is not None:
            self.proxy.restore()

    # -- direct state access for tests ----------------------------------------------------
    def add_bucket(self, bucket_id: str, *, private: bool = True) -> None:
        with self.lock:
            self.buckets.setdefault(bucket_id, Bucket(private=private, created_at=time.time()))

    def content(self, xet_hash: str) -> bytes:
        """The bytes of a file, read back from the local CAS through hf_xet (cached)."""
        with self.lock:
            if xet_hash in self._blobs:
                return self._blobs[xet_hash]
        import hf_xet

        if self._xet is None:
            self._xet = hf_xet.XetSession()
        group = self._xet.new_download_stream_group(endpoint=self.cas_url, token="local",
                                                    token_expiry_unix_secs=int(time.time()) + 3600)
        # the size is only an upper bound for a stream: the CAS knows the real length
        data = b"".join(group.download_stream(hf_xet.XetFileInfo(xet_hash, 1 << 40)))
        with self.lock:
            self._blobs[xet_hash] = data
        return data

    # -- request handling (called by _Handler) --------------------------------------------
    def _injected_fault(self) -> str | None:
        with self.lock:
            if self._fail_next > 0:
                self._fail_next -= 1
                return self._fault_mode
            if time.monotonic() < self._down_until:
                return self._fault_mode
        return None

    def _emit(self, bucket_id: str, change: dict[str, Any]) -> None:
        """Record one file change for the events feed (caller holds `lock`)."""
        self._events.append((bucket_id, change))
        self._events_cv.notify_all()

    def _listing(self, bucket_id: str) -> dict[str, StoredFile]:
        if self._snapshot is not None:
            return self._snapshot.get(bucket_id, {})
        return self.buckets[bucket_id].files


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: avoid 40 ms stalls
    hub: HubServer

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    # one entry point for every verb
    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    # -- plumbing -------------------------------------------------------------------------
    def _base(self) -> str:
        return f"http://{self.headers.get('Host') or '127.0.0.1:%d' % self.hub.port}"

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        raw = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        if body is not None and not isinstance(body, bytes):
            self.send_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)
        if self._record is not None:
            self._record.status = status

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers)

    def _handle(self) -> None:
        self._record: RecordedRequest | None = None
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        if raw and "ndjson" in self.headers.get("Content-Type", ""):
            body = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        elif raw:
            body = json.loads(raw)
        auth = self.headers.get("Authorization", "")
        self._record = RecordedRequest(self.command, unquote(parts.path), parse_qs(parts.query), body, bool(auth))
        with self.hub.lock:
            self.hub.requests.append(self._record)

        fault = self.hub._injected_fault()
        if fault == "drop":
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if fault:
            self._error(self.hub._fault_status, "injected fault: service unavailable")
            return
        tokens = self.hub.tokens
        if tokens is not None and auth.removeprefix("Bearer ").strip() not in tokens:
            self._error(401, "Invalid credentials in Authorization header")
            return
        try:
            self._route(parts.path, parse_qs(parts.query), body)
        except Exception as e:  # a bug in the stand-in must show up as a 500, not a hang
            self._error(500, f"hub_server error: {type(e).__name__}: {e}")

    def _route(self, path: str, query: dict[str, list[str]], body: Any) -> None:
        if m := _RESOLVE_ROUTE.match(path):
            return self._resolve(f"{m['ns']}/{m['name']}", unquote(m["path"]))
        m = _BUCKET_ROUTE.match(path)
        if not m:
            return self._error(404, f"no route {self.command} {path}")
        bid, op = f"{m['ns']}/{m['name']}", m["op"]
        if op is None and self.command == "POST":
            return self._create(bid, body or {})
        hub = self.hub
        with hub.lock:
            exists = bid in hub.buckets
        if not exists:
            return self._error(404, f"Bucket {bid} not found", "RepoNotFound")
        if op is None and self.command == "GET":
            with hub.lock:
                b = hub.buckets[bid]
                info = {"id": bid, "private": b.private, "createdAt": _iso(b.created_at),
                        "size": sum(f.size for f in b.files.values()), "totalFiles": len(b.files)}
            return self._send(200, info)
        if op is None and self.command == "DELETE":
            with hub.lock:
                del hub.buckets[bid]
            return self._send(200, {})
        if op == "settings" and self.command == "PUT":
            with hub.lock:
                hub.buckets[bid].private = bool((body or {}).get("private"))
            return self._send(200, {})
        if op == "tree" and self.command == "GET":
            return self._tree(bid, unquote(m["rest"] or ""), query)
        if op == "paths-info" and self.command == "POST":
            with hub.lock:
                files = hub._listing(bid)
                out = [files[p].as_json(p) for p in (body or {}).get("paths", []) if p in files]
            return self._send(200, out)
        if op == "batch" and self.command == "POST":
            return self._batch(bid, body or [])
        if op in ("xet-read-token", "xet-write-token") and self.command == "GET":
            exp = int(time.time()) + 3600
            return self._send(200, {"accessToken": "local-cas-token", "exp": exp, "casUrl": hub.cas_url},
                              {"X-Xet-Cas-Url": hub.cas_url, "X-Xet-Access-Token": "local-cas-token",
                               "X-Xet-Token-Expiration": str(exp)})
        if op == "events" and self.command == "GET":
            return self._events(bid, query)
        return self._error(405, f"{self.command} not allowed on {path}")

    # -- routes ---------------------------------------------------------------------------
    def _create(self, bid: str, body: dict[str, Any]) -> None:
        hub = self.hub
        with hub.lock:
            if bid in hub.buckets:
                return self._send(
                    409,
                    {"error": "You already created this bucket", "url": f"{self._base()}/buckets/{bid}"},
                    {"X-Error-Message": "You already created this bucket"},
                )
            # like the Hub: public unless asked otherwise
            hub.buckets[bid] = Bucket(private=body.get("visibility") == "private", created_at=time.time())
        self._send(200, {"url": f"{self._base()}/buckets/{bid}", "name": bid.split("/")[1], "id": bid})

    def _tree(self, bid: str, prefix: str, query: dict[str, list[str]]) -> None:
        hub = self.hub
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("true", "1")
        start = int((query.get("cursor") or ["0"])[0])
        with hub.lock:
            files = dict(hub._listing(bid))
        entries: list[dict[str, Any]] = []
        if recursive:  # plain string match on the prefix, like the Hub
            dirs: set[str] = set()
            for p in sorted(files):
                if p.startswith(prefix):
                    segs = p.split("/")[:-1]
                    for i in range(1, len(segs) + 1):
                        d = "/".join(segs[:i])
                        if d.startswith(prefix) and d not in dirs:
                            dirs.add(d)
                            entries.append({"type": "directory", "path": d, "uploadedAt": _iso(files[p].uploaded_at)})
                    entries.append(files[p].as_json(p))
        else:  # immediate children of the folder `prefix`
            base = prefix.strip("/") + "/" if prefix.strip("/") else ""
            seen: set[str] = set()
            for p in sorted(files):
                if not p.startswith(base):
                    continue
                head, sep, _ = p[len(base):].partition("/")
                if sep:
                    if base + head not in seen:
                        seen.add(base + head)
                        entries.append({"type": "directory", "path": base + head,
                                        "uploadedAt": _iso(files[p].uploaded_at)})
                else:
                    entries.append(files[p].as_json(p))
        page = entries[start:start + hub.page_size]
        headers = {}
        if start + hub.page_size < len(entries):
            path = urlsplit(self.path).path
            nxt = f"{self._base()}{path}?recursive={str(recursive).lower()}&cursor={start + hub.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send(200, page, headers)

    def _batch(self, bid: str, ops: list[dict[str, Any]]) -> None:
        hub = self.hub
        failed: list[dict[str, str]] = []
        for op in ops:
            path = op.get("path", "")
            with hub.lock:
                if hub._batch_failures.get(path, 0) > 0:
                    hub._batch_failures[path] -= 1
                    failed.append({"path": path, "error": "injected failure"})
                    continue
            kind = op.get("type")
            if kind in ("addFile", "copyFile"):
                try:
                    data = hub.content(op["xetHash"])
                except Exception as e:
                    failed.append({"path": path, "error": f"unknown xet hash: {e}"})
                    continue
                now = time.time()
                with hub.lock:
                    hub.buckets[bid].files[path] = StoredFile(op["xetHash"], len(data),
                                                              (op.get("mtime") or now * 1000) / 1000, now)
                    hub._emit(bid, {"path": path, "op": "add", "size": len(data), "xetHash": op["xetHash"]})
            elif kind == "deleteFile":
                with hub.lock:
                    if hub.buckets[bid].files.pop(path, None) is not None:
                        hub._emit(bid, {"path": path, "op": "delete"})
            else:
                failed.append({"path": path, "error": f"unknown operation {kind!r}"})
        self._send(422 if failed and len(failed) == len(ops) else 200, {"failed": failed})

    def _events(self, bid: str, query: dict[str, list[str]]) -> None:
        hub = self.hub
        if not hub.events_enabled:
            return self._error(501, "live follow is not available on this test server")
        with hub.lock:
            cursor = len(hub._events)
        if query.get("cursor"):
            try:
                cursor = max(0, min(int(query["cursor"][0]), cursor))
            except ValueError:
                return self._error(400, "bad cursor")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if self._record is not None:
            self._record.status = 200

        def send(event: str, data: dict[str, Any]) -> None:
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        try:
            send("ready", {"cursor": str(cursor)})
            while True:
                with hub.lock:
                    if len(hub._events) <= cursor and not hub._stopping and hub.events_enabled:
                        hub._events_cv.wait(timeout=1.0)
                    if hub._stopping or not hub.events_enabled:
                        return
                    batch = [c for b, c in hub._events[cursor:] if b == bid]
                    cursor = len(hub._events)
                if batch:
                    send("changes", {"cursor": str(cursor), "changes": batch})
                else:
                    self.wfile.write(b": ping\n\n")
                    self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            return

    def _resolve(self, bid: str, path: str) -> None:
        hub = self.hub
        with hub.lock:
            bucket = hub.buckets.get(bid)
            entry = bucket.files.get(path) if bucket else None
        if bucket is None:
            return self._error(404, f"Bucket {bid} not found", "RepoNotFound")
        if entry is None:
            return self._error(404, f"Entry {path} not found", "EntryNotFound")
        refresh = f"{self._base()}/api/buckets/{bid}/xet-read-token"
        headers = {"X-Xet-Hash": entry.xet_hash, "X-Linked-Size": str(entry.size), "ETag": f'"{entry.xet_hash}"',
                   "Link": f'<{refresh}>; rel="xet-auth"', "X-Xet-Refresh-Route": refresh,
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if self.command == "HEAD":
            return self._send(200, None, {**headers, "Content-Length": str(entry.size)})
        data = hub.content(entry.xet_hash)
        rng = self.headers.get("Range")
        if not rng:
            return self._send(200, data, headers)
        m = _RANGE.match(rng.strip())
        if not m or (not m[1] and not m[2]):
            return self._error(400, f"bad Range {rng!r}")
        size = len(data)
        if m[1]:
            first, last = int(m[1]), int(m[2]) if m[2] else size - 1
        else:
            first, last = max(0, size - int(m[2])), size - 1
        if first >= size:
            return self._send(416, b"", {"Content-Range": f"bytes */{size}"})
        last = min(last, size - 1)
        self._send(206, data[first:last + 1], {**headers, "Content-Range": f"bytes {first}-{last}/{size}"})


if __name__ == "__main__":  # pragma: no cover - manual use
    srv = HubServer().start()
    print(f"HF_ENDPOINT={srv.url}  (cas {srv.cas_url})")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.stop()
