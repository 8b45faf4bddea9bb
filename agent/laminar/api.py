"""The local control API: HTTP/1.1 + JSON on a Unix socket (``/run/laminar/laminard.sock``).

Anyone on the node may connect and read (``status``, ``jobs``, ``events``); calls that change
policy or flip a kill-switch are *privileged*: allowed only to root or to members of the
configured control group, decided from the caller's kernel-verified credentials
(``SO_PEERCRED``), never from anything the caller sends. ``curl`` works too::

    curl --unix-socket /run/laminar/laminard.sock http://laminar/v1/status
    curl --unix-socket /run/laminar/laminard.sock -X POST -d '{"on": true, "job": "j1"}' \\
         http://laminar/v1/killswitch

Errors come back as ``{"error": "..."}`` with a 4xx/5xx status. A streaming endpoint
(``/v1/events?follow=1``) answers with newline-delimited JSON until the client hangs up.
The server is deliberately small (one request per connection, bodies up to 1 MiB): the agent
must stay lean, and the only clients are laminarctl, curl and scripts on the same node.
"""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

log = logging.getLogger("laminar.api")

MAX_BODY = 1 << 20
MAX_HEADER = 16 << 10
REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large", 422: "Unprocessable Entity",
           500: "Internal Server Error", 503: "Service Unavailable"}


class ApiError(Exception):
    """A client-facing error: status code and a message that says what was wrong and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    peer: Peer
    params: dict[str, str] = field(default_factory=dict)


class Stream:
    """Return this from a handler to stream newline-delimited JSON objects."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self.items = items


Handler = Callable[[Request], Awaitable[Any]]


@dataclass
class Route:
    method: str
    path: str
    handler: Handler
    privileged: bool = False

    def __post_init__(self) -> None:
        pattern = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.path)
        self._re = re.compile(f"^{pattern}$")

    def match(self, path: str) -> dict[str, str] | None:
        m = self._re.match(path)
        return m.groupdict() if m else None


def peer_credentials(sock: socket.socket) -> Peer:
    """The connecting process's pid, uid and gid as the kernel recorded them at connect()."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(uid=uid, gid=gid, pid=pid)


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class Authorizer:
    """Decides who may call privileged routes: uid 0, or a member of the control group."""

    def __init__(self, control_group: str) -> None:
        self.control_group = control_group

    def allowed(self, peer: Peer) -> bool:
        if peer.uid == 0:
            return True
        try:
            gid = grp.getgrnam(self.control_group).gr_gid
        except KeyError:
            return False
        return peer.gid == gid or gid in _supplementary_groups(peer.pid)


class ApiServer:
    def __init__(self, path: str | Path, authorizer: Authorizer) -> None:
        self.path = Path(path)
        self.auth = authorizer
        self.routes: list[Route] = []
        self._server: asyncio.base_events.Server | None = None
        self.requests = 0
        self.refused = 0

    def add(self, routes: list[Route]) -> None:
        self.routes.extend(routes)

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o755)
        # A stale socket from a crashed agent would make bind() fail; only remove a socket.
        if self.path.is_socket():
            self.path.unlink()
        elif self.path.exists():
            raise RuntimeError(f"api: {self.path} exists and is not a socket; remove it or set agent.socket")
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_HEADER)
        # Every local user may connect (read-only calls); privileged calls are checked per request.
        os.chmod(self.path, 0o666)

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()
        try:
            if self.path.is_socket():
                self.path.unlink()
        except OSError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            peer = peer_credentials(sock)
            try:
                req = await self._read_request(reader, peer)
            except ApiError as e:
                await self._send(writer, e.status, {"error": e.message})
                return
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
                return
            self.requests += 1
            status, payload = await self._dispatch(req)
            if isinstance(payload, Stream):
                await self._send_stream(writer, payload)
            else:
                await self._send(writer, status, payload)
        except (ConnectionError, BrokenPipeError):
            pass
        except Exception:
            log.exception("api: connection failed")
        finally:
            try:
                writer.close()
                await writer.wait_closed()
            except Exception:
                pass

    async def _read_request(self, reader: asyncio.StreamReader, peer: Peer) -> Request:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            raise ApiError(400, f"malformed request line {lines[0]!r}")
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0") or 0)
        if length > MAX_BODY:
            raise ApiError(413, f"request body of {length} bytes exceeds the {MAX_BODY} byte limit")
        raw = await reader.readexactly(length) if length else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise ApiError(400, f"request body is not valid JSON: {e}") from None
        url = urlsplit(target)
        return Request(method.upper(), url.path, dict(parse_qsl(url.query)), headers, body, peer)

    async def _dispatch(self, req: Request) -> tuple[int, Any]:
        allowed_methods = []
        for route in self.routes:
            params = route.match(req.path)
            if params is None:
                continue
            if route.method != req.method:
                allowed_methods.append(route.method)
                continue
            if route.privileged and not self.auth.allowed(req.peer):
                self.refused += 1
                return 403, {"error": f"permission denied: {req.method} {req.path} needs root or membership in group "
                                      f"'{self.auth.control_group}' (caller uid {req.peer.uid})"}
            req.params = params
            try:
                result = await route.handler(req)
            except ApiError as e:
                return e.status, {"error": e.message}
            except Exception as e:
                log.exception("api: %s %s failed", req.method, req.path)
                return 500, {"error": f"internal error: {type(e).__name__}: {e}"}
            return (201 if req.method == "POST" else 200), result
        if allowed_methods:
            return 405, {"error": f"{req.method} not allowed on {req.path}; use {', '.join(sorted(set(allowed_methods)))}"}
        return 404, {"error": f"no such endpoint {req.path}"}

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
        body = json.dumps(payload, default=str).encode() + b"\n"
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        writer.write(head + body)
        await writer.drain()

    @staticmethod
    async def _send_stream(writer: asyncio.StreamWriter, stream: Stream) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n")
        await writer.drain()
        try:
            async for item in stream.items:
                writer.write(json.dumps(item, default=str).encode() + b"\n")
                await writer.drain()
        finally:
            aclose = getattr(stream.items, "aclose", None)
            if aclose:
                await aclose()


def require(body: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Reads a required key from a JSON body or raises a 400 that names it and what is expected."""
    if not isinstance(body, dict) or key not in body:
        raise ApiError(400, f"missing '{key}' in request body: expected {what}")
    value = body[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise ApiError(400, f"'{key}' = {value!r}: expected {what}")
    return value
