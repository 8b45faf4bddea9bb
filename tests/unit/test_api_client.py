"""laminarctl reads the agent's answer even when the agent answered before reading the request.

The agent answers some requests and closes without reading them: 503 to a caller past its
share of connections, 413 to a body over the limit. laminarctl's send then fails with a broken
pipe and it used to report "laminard did not answer ...: Broken pipe" (exit 3, "not running")
instead of the agent's reason; ``events --follow`` let the BrokenPipeError reach main(), which
takes it for a closed stdout and exits 0. A real Unix socket and a real server thread here.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminarctl.client import EXIT_FAILED, Client, CtlError

REASON = "agent busy: uid 65534 already has 32 open connections"


@pytest.fixture
def answers_without_reading(tmp_path: Path) -> Iterator[Path]:
    """A server that answers 503 to each connection at once and closes it, reading nothing."""
    path = tmp_path / "s.sock"
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(str(path))
    lsock.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            body = json.dumps({"error": REASON}).encode()
            conn.sendall(f"HTTP/1.1 503 Service Unavailable\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield path
    finally:
        stop.set()
        lsock.shutdown(socket.SHUT_RDWR)
        lsock.close()
        t.join(5)


def test_an_answer_sent_before_the_request_was_read_is_reported(answers_without_reading: Path) -> None:
    big = {"text": "x" * (4 << 20)}  # more than the socket buffers hold: the send must fail
    with pytest.raises(CtlError) as err:
        Client(str(answers_without_reading), timeout=10).post("/v1/policy/validate", big)
    assert REASON in err.value.message and err.value.code == EXIT_FAILED, (err.value.message, err.value.code)


def test_a_refused_stream_is_an_error_not_success(answers_without_reading: Path) -> None:
    """(A keeper: here the short GET usually goes out before the close, as it did before the fix.)"""
    with pytest.raises(CtlError) as err:
        list(Client(str(answers_without_reading), timeout=10).stream("/v1/events?follow=1"))
    assert REASON in err.value.message and err.value.code == EXIT_FAILED
