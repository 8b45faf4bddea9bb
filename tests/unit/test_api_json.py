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


def test_a_nan_or_infinite_number_is_answered_as_null(tmp_path: Path) -> None:
    """``Infinity`` is not JSON: an MTBF with no departure seen yet (GET /v1/checkpoints with a
    hazard prior of 0) made ``laminarctl checkpoints -o json | jq`` fail. Answers and streamed
    items carry null instead, at any depth."""
    import json

    from laminar.api import Stream

    path = tmp_path / "api.sock"

    async def odd(req: Request) -> dict[str, object]:
        return {"mtbf_s": float("inf"), "jobs": [{"rate": float("nan"), "n": 3, "x": -float("inf")}], "ok": 1.5}

    async def items() -> object:
        yield {"mtbf_s": float("inf")}

    async def stream(req: Request) -> Stream:
        return Stream(items())

    def call(target: str) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect(str(path))
            s.sendall(f"GET {target} HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode())
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
            return buf.partition(b"\r\n\r\n")[2]

    async def main() -> tuple[bytes, bytes]:
        srv = ApiServer(path, Authorizer("laminar-test-no-such-group"))
        srv.add([Route("GET", "/v1/odd", odd), Route("GET", "/v1/s", stream)])
        await srv.start()
        try:
            loop = asyncio.get_running_loop()
            return (await loop.run_in_executor(None, call, "/v1/odd"), await loop.run_in_executor(None, call, "/v1/s"))
        finally:
            await srv.stop()

    answer, streamed = asyncio.run(main())

    def strict(raw: bytes) -> object:
        return json.loads(raw, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"not JSON: {c}")))

    assert strict(answer) == {"mtbf_s": None, "jobs": [{"rate": None, "n": 3, "x": None}], "ok": 1.5}
    assert [strict(line) for line in streamed.splitlines() if line] == [{"mtbf_s": None}]
