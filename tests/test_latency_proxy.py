"""`LatencyProxy` (``kvtier bench obj``'s remote bucket): bytes pass intact both ways, a
connection and an exchange each take at least the round trip set, and a new ``rtt_s``
applies while it runs; bad input is named."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier_async.bench.rclone import LatencyProxy

TIMEOUT_S = 30.0


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 (one thread per connection)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(TIMEOUT_S)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=pump, args=(conn,), daemon=True).start()

    def pump(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def _exchange(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = bytearray()
    while len(got) < len(payload):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        got += chunk
    return bytes(got)


def test_bytes_pass_intact_and_each_round_trip_costs_at_least_rtt(echo: int) -> None:
    payload = os.urandom(3 << 20)  # many chunks: in flight together, not one delay each
    with LatencyProxy(echo, rtt_s=0.05) as proxy:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT_S) as sock:
            assert _exchange(sock, b"ping") == b"ping"  # the handshake's RTT, then the ping's
            opened = time.monotonic() - start
            assert opened >= 0.1
            assert _exchange(sock, payload) == payload
            proxy.rtt_s = 0.2
            start = time.monotonic()
            assert _exchange(sock, b"pong") == b"pong"
            assert time.monotonic() - start >= 0.2
        assert proxy.connections == 1


def test_a_round_trip_out_of_range_is_named(echo: int) -> None:
    proxy = LatencyProxy(echo)
    with pytest.raises(ValueError, match=r"rtt_s must be within \[0, 10\] seconds, got -1"):
        proxy.rtt_s = -1
