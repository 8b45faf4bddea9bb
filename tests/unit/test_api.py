"""The control API server on a real Unix socket: routing, errors, streams, limits, authorization."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from laminar.api import MAX_BODY, ApiError, ApiServer, Authorizer, Peer, Request, Route, Stream, start_eagerly


def _raw(path: Path, data: bytes) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def _req(path: Path, method: str, target: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else b""
    status, raw = _raw(path, f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return status, [json.loads(line) for line in raw.splitlines() if line] if b"\n{" in raw.strip() else json.loads(raw)


def serve(tmp_path: Path, body: Any) -> Any:
    """Runs `body(path)` in a thread against a server on tmp_path, returns its result."""
    async def echo(req: Request) -> dict[str, Any]:
        return {"params": req.params, "query": req.query, "body": req.body, "uid": req.peer.uid}

    async def slow(req: Request) -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"slept": True}

    async def refuse(req: Request) -> dict[str, Any]:
        raise ApiError(409, "job 'x' is not running")

    async def broken(req: Request) -> dict[str, Any]:
        raise RuntimeError("boom")

    async def items() -> Any:
        for i in range(3):
            yield {"i": i}

    async def stream(req: Request) -> Stream:
        return Stream(items())

    async def main() -> Any:
        path = tmp_path / "api.sock"
        server = ApiServer(path, Authorizer("laminar-test-no-such-group"))
        server.add([Route("GET", "/v1/jobs/{id}", echo), Route("POST", "/v1/jobs/{id}", echo, privileged=True),
                    Route("GET", "/slow", slow), Route("GET", "/refuse", refuse), Route("GET", "/broken", broken),
                    Route("GET", "/stream", stream)])
        await server.start()
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, body, path)
        finally:
            await server.stop()
        assert not path.exists()  # the socket is removed on stop
        return result

    return asyncio.run(main())


def test_routes_params_query_body_and_errors(tmp_path: Path) -> None:
    def calls(path: Path) -> list[tuple[int, Any]]:
        return [_req(path, "GET", "/v1/jobs/job-3?x=1"), _req(path, "POST", "/v1/jobs/job-3", {"a": [1]}),
                _req(path, "GET", "/slow"), _req(path, "GET", "/refuse"), _req(path, "GET", "/broken"),
                _req(path, "GET", "/nope"), _req(path, "DELETE", "/v1/jobs/1"), _req(path, "GET", "/stream")]

    r = serve(tmp_path, calls)
    assert r[0][0] == 200 and r[0][1]["params"] == {"id": "job-3"} and r[0][1]["query"] == {"x": "1"}
    assert r[1][0] == 201 and r[1][1]["body"] == {"a": [1]}
    assert r[2] == (200, {"slept": True})
    assert r[3] == (409, {"error": "job 'x' is not running"})
    assert r[4][0] == 500 and "RuntimeError: boom" in r[4][1]["error"]
    assert r[5][0] == 404 and "/nope" in r[5][1]["error"]
    assert r[6][0] == 405 and "GET, POST" in r[6][1]["error"]
    assert r[7] == (200, [{"i": 0}, {"i": 1}, {"i": 2}])


def test_malformed_and_oversized_requests(tmp_path: Path) -> None:
    def calls(path: Path) -> list[tuple[int, bytes]]:
        return [_raw(path, b"NONSENSE\r\n\r\n"),
                _raw(path, f"POST /v1/jobs/1 HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()),
                _raw(path, b"POST /v1/jobs/1 HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope"),
                _raw(path, b"POST /v1/jobs/1 HTTP/1.1\r\nContent-Length: abc\r\n\r\n")]

    r = serve(tmp_path, calls)
    assert r[0][0] == 400
    assert r[1][0] == 413 and str(MAX_BODY) in r[1][1].decode()
    assert r[2][0] == 400 and b"not valid JSON" in r[2][1]
    assert r[3][0] == 400


@pytest.mark.parametrize("peer, allowed", [(Peer(0, 0, 1), True), (Peer(65534, 65534, 1), False)])
def test_authorizer_root_or_control_group(peer: Peer, allowed: bool) -> None:
    assert Authorizer("laminar-test-no-such-group").allowed(peer) is allowed


def test_control_group_membership_by_primary_gid() -> None:
    import grp

    g = grp.getgrgid(0).gr_name  # root's group exists everywhere
    assert Authorizer(g).allowed(Peer(12345, 0, 1)) is True


def test_a_request_that_arrives_late_and_in_parts_is_answered(tmp_path: Path) -> None:
    """The server's first read of a connection runs before the connection has its task (the
    eager start): a request not there at once made it wait with a timeout there. On Python 3.12
    ``wait_for`` raised "Timeout should be used inside a task" and the connection was reset
    (every `laminarctl policy set -`, and a loaded agent's submissions, on Ubuntu 24.04)."""
    import time

    def calls(path: Path) -> tuple[int, bytes]:
        data = json.dumps({"a": 1}).encode()
        head = f"POST /v1/jobs/job-7 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            time.sleep(0.2)  # nothing there at the server's first read
            s.sendall(head[:10])
            time.sleep(0.1)
            s.sendall(head[10:])
            time.sleep(0.1)  # the header whole, the body not yet
            s.sendall(data)
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
        h, _, body = buf.partition(b"\r\n\r\n")
        return int(h.split(b" ")[1]), body

    status, body = serve(tmp_path, calls)
    assert status == 201 and json.loads(body)["body"] == {"a": 1}, body


def test_an_eagerly_started_coroutine_runs_inside_its_own_task_from_its_first_line() -> None:
    """What the server's eager start promises a handler on every Python (the 3.11 path steps the
    coroutine by hand): ``asyncio.current_task()`` is the task that carries it on, from the first
    line, so ``asyncio.timeout`` works before the first wait; one that finishes at once returns
    None and leaves nothing pending; an exception of the synchronous part reaches the caller; a
    start from inside another task gives that task back as the current one."""
    import warnings

    seen: dict[str, Any] = {}

    async def handler(gate: asyncio.Future[None]) -> str:
        seen["sync"] = asyncio.current_task()
        async with asyncio.timeout(5):  # "Timeout should be used inside a task" without one
            await gate
        seen["after"] = asyncio.current_task()
        return "answered"

    async def at_once() -> str:
        seen["at_once"] = asyncio.current_task()
        return "done"

    async def fails() -> None:
        raise LookupError("synchronous part")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        started: list[asyncio.Task[Any] | None] = []
        loop.call_soon(lambda: started.append(start_eagerly(loop, handler(gate))))  # as the accept callback
        await asyncio.sleep(0)
        task = started[0]
        assert task is not None and seen["sync"] is task
        gate.set_result(None)
        assert await task == "answered" and seen["after"] is task

        outer = asyncio.current_task()
        assert start_eagerly(loop, at_once()) is None
        assert seen["at_once"] is not None and seen["at_once"] is not outer
        assert asyncio.current_task() is outer  # the caller's task is current again
        with pytest.raises(LookupError, match="synchronous part"):
            start_eagerly(loop, fails())
        assert asyncio.current_task() is outer
        await asyncio.sleep(0.01)
        assert [t for t in asyncio.all_tasks() if t is not outer] == []  # nothing left pending

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail it
        asyncio.run(main())
