"""A loopback TCP proxy that tests can switch off: "the store is unavailable for a while".

Put it in front of any HTTP store server (moto's S3, tests/support/hub_server.py) and point the
client at `proxy.url`. It knows nothing about HTTP: it pipes bytes, and on command
- `refuse(seconds=None)`: stops listening (clients get "connection refused") and cuts every
  open connection, so pooled keep-alive connections fail too; back up after `seconds`
  (or at `restore()`), on the same port.
- `drop_next(n)`: cuts every open connection, then accepts and immediately resets the next
  n connections (clients see "connection reset" / "server closed the connection").
- `restore()`: ends both faults.
`rate` (bytes per second in each direction, None: unlimited) makes it a slow link, as a
cross-region path is (benchmarks use it; tests leave it off). The pace is the link's, not each
connection's: one token bucket per direction is shared by every connection through the proxy,
so 8 parallel multipart uploads together get `rate`, as they would on a real 500 Mbit/s link.
`connections` counts connections accepted (dropped ones included).
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class _Pace:
    """One direction of a paced link: every connection's chunks take turns on it, each leaving
    when its last byte would have crossed a link of `rate` bytes/s; an idle link banks at most
    2 ms (what makes up for sleeps that overshoot), so there is no burst after idle time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0  # when the link has carried everything handed to it so far
        self._lock = threading.Lock()

    def wait(self, n: int) -> None:
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic() - 0.002) + n / self.rate
            leave_at = self._free_at
        wait = leave_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class TcpProxy:
    """127.0.0.1:<port> -> target_host:target_port, with refuse/drop switches."""

    def __init__(self, target_host: str, target_port: int, *, rate: float | None = None) -> None:
        self.target = (target_host, target_port)
        self.rate = rate
        self._pace = (_Pace(rate), _Pace(rate)) if rate else (None, None)  # (client -> target, target -> client)
        self.port = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._live: set[socket.socket] = set()
        self._drop = 0
        self._up_at: float | None = None  # when refusing: monotonic time to come back (None = until restore)
        self._refusing = False
        self._stopped = False
        self._timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._listen()
        return self

    def stop(self) -> None:
        self._stopped = True
        self._close_listener()
        self._cut_all()
        if self._timer:
            self._timer.cancel()

    # -- switches ---------------------------------------------------------------------------
    def refuse(self, seconds: float | None = None) -> None:
        """Refuse connections (and cut open ones) for `seconds`, or until `restore()`."""
        with self._lock:
            self._refusing = True
            if self._timer:
                self._timer.cancel()
                self._timer = None
            if seconds is not None:
                self._timer = threading.Timer(seconds, self.restore)
                self._timer.daemon = True
                self._timer.start()
        self._close_listener()
        self._cut_all()

    def drop_next(self, n: int) -> None:
        """Cut open connections, then reset the next `n` new connections."""
        with self._lock:
            self._drop = n
        self._cut_all()

    def restore(self) -> None:
        """End every fault: listen again on the same port, stop dropping."""
        with self._lock:
            self._drop = 0
            was_refusing, self._refusing = self._refusing, False
            if self._timer:
                self._timer.cancel()
                self._timer = None
        if was_refusing and not self._stopped:
            self._listen()

    # -- internals --------------------------------------------------------------------------
    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for _ in range(50):  # the port may sit in TIME_WAIT for a moment after refuse()
            try:
                sock.bind(("127.0.0.1", self.port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"tcp proxy could not re-bind 127.0.0.1:{self.port}")
        sock.listen(64)
        self.port = sock.getsockname()[1]
        with self._lock:
            self._listener = sock
        threading.Thread(target=self._accept_loop, args=(sock,), daemon=True, name="tcp-proxy").start()

    def _close_listener(self) -> None:
        with self._lock:
            sock, self._listener = self._listener, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _cut_all(self) -> None:
        with self._lock:
            live, self._live = self._live, set()
        for s in live:
            _reset(s)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                self.connections += 1
                drop = self._drop > 0
                if drop:
                    self._drop -= 1
            if drop:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._live.update((client, upstream))
            threading.Thread(target=self._pipe, args=(client, upstream, self._pace[0]), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self._pace[1]), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, pace: _Pace | None) -> None:
        try:
            while data := src.recv(65536):
                if pace is not None:
                    pace.wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._live.discard(src)
                self._live.discard(dst)
            src.close()


def _reset(sock: socket.socket) -> None:
    """Close with RST rather than FIN, so the peer sees a hard failure at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
