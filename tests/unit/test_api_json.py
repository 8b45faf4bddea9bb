"""Deeply nested JSON gets a 400 answer, not a dropped connection and a traceback in the log.

Python's JSON reader raises RecursionError (not ValueError) for nesting deeper than the
interpreter's recursion limit. The control API caught only ValueError, so any local user could
send ``[[[[...]]]]`` (well under the 1 MiB limit) to any endpoint: no answer at all, and a full
traceback in the agent's log for each request. Real Unix socket and server.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from laminar.api import ApiServer, Authorizer, Request, Route


def test_deep_json_is_a_bad_request(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    body = b"[" * 200_000 + b"]" * 200_000

    async def echo(req: Request) -> dict[str, bool]:
        return {"ok": True}

    def call() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect(str(path))
            s.sendall(f"POST /v1/x HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
            return buf

    async def main() -> bytes:
        srv = ApiServer(path, Authorizer("laminar-test-no-such-group"))
        srv.add([Route("POST", "/v1/x", echo)])
        await srv.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, call)
        finally:
            await srv.stop()

    raw = asyncio.run(main())
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]
    assert b"nested" in raw
