"""laminar.metrics.MetricsServer: Prometheus' text from the agent's own loop, rendered at most once
a second, one request per connection, and who opened a loopback connection told by the kernel
(inet_diag). The per-user bound against a real other user: tests/kernel/test_security_loop.py."""

from __future__ import annotations

import asyncio
import os
import socket

from laminar import metrics as M


def _get(port: int, path: str = "/metrics") -> tuple[str, bytes]:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    finally:
        s.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


def test_scrapes_are_served_from_the_loop_and_rendered_once_a_second() -> None:
    async def main() -> None:
        reg = M.make_registry()
        core = M.CoreMetrics(reg)
        core.events.labels("agent").inc()
        srv = M.MetricsServer("127.0.0.1:0", reg, request_timeout_s=2.0)
        srv.port = 0
        await srv.start()
        assert srv._sock is not None
        port = srv._sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        try:
            answers = await asyncio.gather(*(loop.run_in_executor(None, _get, port) for _ in range(20)))
            assert all(a[0] == "HTTP/1.1 200 OK" for a in answers)
            assert all(b'laminar_events_total{kind="agent"} 1.0' in a[1] for a in answers)
            assert srv.renders == 1 and srv.served == 20  # twenty scrapes in a second: one render
            status, _ = await loop.run_in_executor(None, _get, port, "/other")
            assert status.startswith("HTTP/1.1 404")
        finally:
            await srv.stop()

    asyncio.run(main())


def test_the_kernel_names_who_opened_a_loopback_connection() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    c = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    try:
        uid = M.PeerUids().uid(conn.getsockname(), conn.getpeername(), conn.family)
        assert uid == os.geteuid()
        # a connection whose other end is not on this host: no such socket here
        assert M.PeerUids().uid(("127.0.0.1", 1), ("127.0.0.1", 2), socket.AF_INET) is None
    finally:
        for s in (c, conn, srv):
            s.close()
