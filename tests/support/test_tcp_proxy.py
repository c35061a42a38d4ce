"""The paced link of tests/support/tcp_proxy.py (what benchmarks/protocol_lag.py's "500 Mbit/s link" is):
the pace belongs to the link, so parallel connections share it rather than each getting it."""

from __future__ import annotations

import socket
import threading
import time

from tests.support.tcp_proxy import TcpProxy

RATE = 2 << 20  # bytes per second, each direction
PER_CONN = 1 << 20
CONNS = 4


def _sink() -> tuple[socket.socket, list[int], threading.Event]:
    """A server that reads every connection to its end; (listener, bytes read, all-read event)."""
    srv = socket.create_server(("127.0.0.1", 0))
    got, done = [0], threading.Event()
    lock = threading.Lock()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                with lock:
                    got[0] += len(data)
                    if got[0] >= CONNS * PER_CONN:
                        done.set()

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return srv, got, done


def _send(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"\0" * PER_CONN)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # until the proxy has passed everything on and closed


def test_parallel_connections_share_the_links_pace():
    srv, got, done = _sink()
    proxy = TcpProxy("127.0.0.1", srv.getsockname()[1], rate=RATE).start()
    try:
        t0 = time.monotonic()
        senders = [threading.Thread(target=_send, args=(proxy.port,)) for _ in range(CONNS)]
        for t in senders:
            t.start()
        assert done.wait(30), got
        elapsed = time.monotonic() - t0
        for t in senders:
            t.join(30)
    finally:
        proxy.stop()
        srv.close()
    # 4 MiB over a 2 MiB/s link: about 2 s together; paced per connection it took about 0.5 s
    assert elapsed >= 1.7, (
        f"{CONNS} x {PER_CONN} B through a {RATE} B/s link took {elapsed:.2f} s: the pace is per connection"
    )
    assert elapsed < 5, elapsed
