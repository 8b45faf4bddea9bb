"""A small HTTP+JSON client for the agent's Unix socket.

Exit codes (shared by every laminarctl command): 0 success, 1 the agent refused or failed the
request, 2 bad command-line input, 3 the agent is not running / not reachable, 4 permission
denied (the caller is neither root nor in the control group).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

DEFAULT_SOCKET = "/run/laminar/laminard.sock"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_AGENT, EXIT_DENIED = 0, 1, 2, 3, 4


class CtlError(Exception):
    """An error to print and exit with: message plus exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("laminar", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class Client:
    def __init__(self, socket_path: str | None = None, timeout: float | None = 30.0) -> None:
        self.path = socket_path or os.environ.get("LAMINAR_SOCKET") or DEFAULT_SOCKET
        self.timeout = timeout

    def _conn(self, timeout: float | None) -> _UnixConnection:
        conn = _UnixConnection(self.path, timeout)
        try:
            conn.connect()
        except FileNotFoundError:
            raise CtlError(f"laminard is not running: no control socket at {self.path} "
                           "(start it with `systemctl start laminard` or `make run`)", EXIT_NO_AGENT) from None
        except ConnectionRefusedError:
            raise CtlError(f"laminard is not running: {self.path} refuses connections", EXIT_NO_AGENT) from None
        except PermissionError:
            raise CtlError(f"cannot open {self.path}: permission denied", EXIT_DENIED) from None
        return conn

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        conn = self._conn(timeout if timeout is not None else self.timeout)
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            resp = _send_and_answer(conn, method, path, data, headers)
            raw = resp.read()
        except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
            raise CtlError(f"laminard did not answer {method} {path}: {e}", EXIT_NO_AGENT) from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            raise CtlError(f"laminard sent a response that is not JSON: {raw[:200]!r}") from None
        if resp.status >= 400:
            msg = payload.get("error") if isinstance(payload, dict) else raw.decode(errors="replace")
            raise CtlError(str(msg), EXIT_DENIED if resp.status == 403 else EXIT_FAILED)
        return payload

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        return self.request("POST", path, body if body is not None else {}, timeout)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    def stream(self, path: str) -> Iterator[Any]:
        """Yields JSON objects from a newline-delimited stream until the agent closes it."""
        conn = self._conn(None)
        try:
            try:
                resp = _send_and_answer(conn, "GET", path, None, {})
            except (ConnectionError, http.client.HTTPException) as e:
                # not left to main(), which takes a BrokenPipeError for a closed stdout (exit 0)
                raise CtlError(f"laminard did not answer GET {path}: {e}", EXIT_NO_AGENT) from None
            if resp.status >= 400:
                payload = json.loads(resp.read() or b"{}")
                raise CtlError(str(payload.get("error")), EXIT_DENIED if resp.status == 403 else EXIT_FAILED)
            while True:
                line = resp.readline()
                if not line:
                    return
                yield json.loads(line)
        finally:
            conn.close()


def _send_and_answer(conn: _UnixConnection, method: str, path: str, data: bytes | None,
                     headers: dict[str, str]) -> http.client.HTTPResponse:
    """Sends a request and returns the agent's answer. The agent may answer and close before it
    has read the request (a 503 when the caller has too many connections open, a 413 for a body
    too large): the send then fails with a broken pipe, but the answer is there to read, and it
    says why. Raises the send's error when there is no answer."""
    try:
        conn.request(method, path, body=data, headers=headers)
    except (BrokenPipeError, ConnectionResetError) as send_error:
        try:
            return conn.getresponse()
        except (OSError, http.client.HTTPException):
            raise send_error from None
    return conn.getresponse()
