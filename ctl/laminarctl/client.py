"""A small HTTP+JSON client for the agent's Unix socket.

Exit codes (shared by every laminarctl command): 0 success, 1 the agent refused or failed the
request, 2 bad command-line input, 3 the agent is not running / not reachable, 4 permission
denied (the caller is neither root nor in the control group).

A caller who may open the agent's admin socket (root, the control group; see laminar.api) is
connected there, where another local user's flood of connections cannot queue in front of it;
everyone else goes to the public socket. A connect() waits for room in the socket's queue of
connections (up to the request's timeout) instead of failing at once when it is full.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import struct
from collections.abc import Iterator
from typing import Any

from laminar.config import admin_socket_path

DEFAULT_SOCKET = "/run/laminar/laminard.sock"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_AGENT, EXIT_DENIED = 0, 1, 2, 3, 4


class CtlError(Exception):
    """An error to print and exit with: message plus exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def connect_unix(path: str, timeout: float | None) -> socket.socket:
    """A connected stream socket to `path`, with `timeout` for its I/O. The connect() itself is a
    blocking one bounded by SO_SNDTIMEO: it waits for room when the listener's queue of connections
    is full (Python's settimeout would make it non-blocking, and fail at once with EAGAIN), and
    raises BlockingIOError when there was none within `timeout`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        if timeout is not None:
            sec = int(timeout)
            usec = int((timeout - sec) * 1e6) or (0 if sec else 1)  # 0 s 0 us would mean: no limit
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))
        s.connect(path)
        s.settimeout(timeout)
    except BaseException:
        s.close()
        raise
    return s


def _is_admin_socket(path: str) -> bool:
    """Whether `path` is a socket owned by root, as the agent's admin socket is: in a shared
    directory (agent.socket under /tmp) another user could have put a socket of their own there,
    and root's requests must not go to it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == 0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("laminar", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        admin = admin_socket_path(self._path)
        if _is_admin_socket(admin) and os.access(admin, os.W_OK):  # root or the control group
            try:
                self.sock = connect_unix(admin, self.timeout)
                return
            except (FileNotFoundError, ConnectionRefusedError, PermissionError):
                pass  # gone, or an agent without one: the public socket
        self.sock = connect_unix(self._path, self.timeout)


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
        except BlockingIOError:
            raise CtlError(f"laminard's control socket {self.path} did not take the connection within "
                           f"{timeout or 0:g} s: its queue of connections stayed full (another local user may be "
                           "flooding it; root and the control group are served on the admin socket "
                           f"{admin_socket_path(self.path)})", EXIT_NO_AGENT) from None
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
        """Yields JSON objects from a newline-delimited stream until the agent closes it (a last
        line cut short by the closing is dropped)."""
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
                try:
                    line = resp.readline()
                except (ConnectionError, http.client.HTTPException):
                    return
                if not line.endswith(b"\n"):  # closed, perhaps in the middle of a line
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
