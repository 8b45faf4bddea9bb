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

A local user must not be able to lock the operator out or starve the agent of file descriptors
(1024 under systemd's default soft limit; every cgroup write and PSI trigger needs one): a
request must arrive whole within ``[agent] request_timeout_s`` (10 s; else 408 and the connection is closed),
an answer must be taken within as long, and a caller that is neither root nor in the control
group may hold at most ``MAX_CONNS_PER_UID`` connections (``MAX_UNPRIVILEGED_CONNS`` over all
such callers; ``events --follow`` streams count) -- past that a new connection is answered 503
and closed at once. Root and the control group are never counted or refused.

What a request of such a caller may hold beyond its connection is bounded too, and refused at
once past the bound, never queued: work in a worker thread (``WORK_PER_UID``, `work_slot`, 429);
the components bound their own (laminar.userbounds). Every refusal is counted by a short reason
(``ApiError.reason``; `refusals`), shown as ``api.refused_by_reason`` by GET /v1/status, so a
benchmark can count attacks by what refused them.

Nor can a local user crowd root out of the kernel's queue of connections not yet accepted (the
listen backlog): one who connects in a loop keeps it full however fast the agent answers, and a
connect() to a full backlog fails (``EAGAIN``) or waits. So the agent listens on a second socket
beside the first, the *admin socket* (``laminard.admin.sock`` for ``laminard.sock``, see
:func:`laminar.config.admin_socket_path`), that only root and the control group may open: mode
0660, group the control group (0600, root's, when that group does not exist at start). laminarctl
uses it whenever its caller may open it, and the public socket otherwise; both serve every route,
privileged ones to the same callers. Each accept round takes at most ``ACCEPT_BATCH`` connections
from a socket, so a flooded public socket cannot hold the loop away from the admin one.

It is also on the kill-switch's hot path (a request to cut traffic is enforced when the handler
writes the map), so a request costs as few event-loop rounds as it can: the listening socket is
watched directly, a new connection is read with non-blocking ``recv`` at once (the request is
usually already there), and the handler is *started eagerly*, inside the accept callback, the way
Python 3.12's eager tasks do (inside its own task from its first line, on 3.11 too): a handler
that never waits (a kill-switch flip) runs to completion and is answered within the accept
callback, without another round of the loop; one that waits continues as an ordinary task from
that point. Route lookups are cached per path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import json
import logging
import math
import os
import re
import socket
import struct
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .config import admin_socket_path
from .userbounds import Busy, Refusals, UidSlots

log = logging.getLogger("laminar.api")


def _finite(v: Any) -> Any:
    """``v`` with every NaN or infinite float (at any depth) as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def to_json(payload: Any) -> str:
    """An answer as JSON: a NaN or infinite number (an MTBF with no departure seen, a rate never
    measured) is null, since ``Infinity`` is not JSON and every parser but Python's refuses it."""
    try:
        return json.dumps(payload, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(payload), default=str, allow_nan=False)

MAX_BODY = 1 << 20
MAX_HEADER = 16 << 10
# A whole request (header and body) must arrive within this; so must the client take an answer.
# The default of ``[agent] request_timeout_s``.
REQUEST_TIMEOUT_S = 10.0
# Open connections of a caller that is neither root nor in the control group: per uid, and all
# such callers together. Root and the control group are never refused (see the module docstring).
MAX_CONNS_PER_UID = 32
MAX_UNPRIVILEGED_CONNS = 128
# After accept() failed for want of descriptors, the listening socket is watched again after this
# (it stays readable, so watching it at once would spin the loop).
ACCEPT_BACKOFF_S = 0.1
# Connections taken from one listening socket per loop round: a user who connects in a loop
# refills the public backlog as fast as it drains, and must not keep the loop (the admin socket,
# handlers waiting on I/O, the data plane's timers) from its next round.
ACCEPT_BATCH = 64
# The listen backlog of each socket (the kernel caps it at net.core.somaxconn, 4096 by default).
LISTEN_BACKLOG = 128
STOP_WAIT_S = 5.0  # how long the API's stop waits for cancelled connections to end
# Work a request of a caller outside root and the control group may have running in a worker
# thread at once (a replica scan, a checkpoint's check): per uid, and for all such callers
# together at most half the default executor's threads (min(32, CPUs + 4)), so the agent's own
# work there (job teardown, checkpoint checks, NVML) always finds one. Past it: 429 at once.
WORK_PER_UID = 2
WORK_ALL_USERS = max(1, min(32, (os.cpu_count() or 1) + 4) // 2)

REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Payload Too Large",
           422: "Unprocessable Entity", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable",
           507: "Insufficient Storage"}


class ApiError(Exception):
    """A client-facing error: status code and a message that says what was wrong and what to do.
    `reason`: a short stable word it is counted under in ``api.refused_by_reason`` (None: the
    route's path and the status, e.g. ``/v1/jobs 400``)."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason


@dataclass(frozen=True)
class Peer:
    """The caller as the kernel recorded it at connect(): uid, primary gid, pid and, for a
    connection, its supplementary groups (``SO_PEERGROUPS``). ``groups`` is None for a Peer
    made by hand; the authorizer then reads them from /proc, which is only right while the
    pid is still the caller's."""

    uid: int
    gid: int
    pid: int
    groups: frozenset[int] | None = None


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any
    peer: Peer
    params: dict[str, str] = field(default_factory=dict)


class RawJson(bytes):
    """Return this from a handler whose answer is JSON already encoded (a cached answer, sent as
    it is: not decoded and encoded again for each caller)."""


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
        m = self._re.fullmatch(path)
        return m.groupdict() if m else None


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python 3.11 lacks the name


def peer_credentials(sock: socket.socket) -> Peer:
    """The connecting process's pid, uid, gid and supplementary groups as the kernel recorded
    them at connect(). The pid is not used to decide anything: it may belong to another process
    by the time a request arrives."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    try:
        groups = peer_groups(sock)
    except OSError as e:  # a kernel that cannot say: membership by supplementary group fails closed
        log.warning("api: SO_PEERGROUPS: %s; only the primary gid counts for the control group", e)
        groups = frozenset()
    return Peer(uid=uid, gid=gid, pid=pid, groups=groups)


def peer_groups(sock: socket.socket) -> frozenset[int]:
    """The supplementary groups of the process that connected `sock`, as of connect()
    (``SO_PEERGROUPS``). Raises OSError when the kernel cannot say."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)  # 256 groups: Python's most
    except OSError as e:
        if e.errno != errno.ERANGE:
            raise
        raw = _peergroups_large(sock.fileno())
    n = len(raw) // 4
    return frozenset(struct.unpack(f"{n}I", raw[:4 * n]))


def _peergroups_large(fd: int) -> bytes:
    """SO_PEERGROUPS for a caller with more than 256 groups (NGROUPS_MAX is 65536), through libc:
    Python's getsockopt takes at most 1024 bytes."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = ctypes.c_uint32(65536 * 4)
    buf = ctypes.create_string_buffer(size.value)
    if libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"SO_PEERGROUPS: {os.strerror(err)}")
    return buf.raw[:size.value]


def _supplementary_groups(pid: int) -> set[int]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class Authorizer:
    """Decides who may call privileged routes: uid 0, or a member of the control group (by the
    primary gid or the supplementary groups the caller had at connect())."""

    # The group's gid is looked up again when it is older than this: every connection of a caller
    # other than root is checked on the event loop, and getgrnam may go to the network (LDAP,
    # sssd) and wait there. So only the first look-up (at the API's start) is made where it is
    # asked; later ones run in a thread of their own, one at a time, while the answer known so
    # far stands (a directory service that hangs holds that thread, never the loop).
    GID_TTL_S = 30.0

    def __init__(self, control_group: str) -> None:
        self.control_group = control_group
        self._gid: tuple[float, int | None] | None = None  # (when looked up, gid or None)
        self._refreshing = False

    def _lookup(self) -> int | None:
        try:
            return grp.getgrnam(self.control_group).gr_gid
        except KeyError:
            return None

    def _refresh(self) -> None:
        try:
            gid = self._lookup()
        except Exception as e:  # NSS errors: keep the gid known so far, try again later
            log.warning("api: looking up group %r failed: %s", self.control_group, e)
            gid = self._gid[1] if self._gid is not None else None
        self._gid = (time.monotonic(), gid)
        self._refreshing = False

    def group_gid(self) -> int | None:
        """The control group's gid, None when it does not exist. Looked up here only the first
        time; afterwards refreshed every GID_TTL_S in a thread of its own (the known gid
        answers meanwhile)."""
        now = time.monotonic()
        if self._gid is None:
            self._gid = (now, self._lookup())
        elif now - self._gid[0] >= self.GID_TTL_S and not self._refreshing:
            self._refreshing = True
            import threading

            threading.Thread(target=self._refresh, name="lm-group-lookup", daemon=True).start()
        return self._gid[1]

    def allowed(self, peer: Peer) -> bool:
        if peer.uid == 0:
            return True
        gid = self.group_gid()
        if gid is None:
            return False
        if peer.gid == gid:
            return True
        groups = peer.groups if peer.groups is not None else _supplementary_groups(peer.pid)
        return gid in groups


def socket_in_use(path: str | Path) -> bool:
    """Whether a process accepts connections on the Unix socket at `path` (a running agent);
    False for a socket file nobody listens on (left by a crashed agent) or no socket at all."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return False
    except OSError:  # EAGAIN (its backlog is full), EACCES: someone is there
        return True
    finally:
        s.close()
    return True


@types.coroutine
def _carry_on(coro: Coroutine[Any, Any, Any], first: Any) -> Generator[Any, Any, Any]:
    """Drives a coroutine that was stepped outside a task and is suspended on `first` (what it
    yielded: a future, or None for a bare yield). Run inside a task, it hands each yielded value
    to the task and passes back what the task sends or throws (a cancellation included), exactly
    as if the task had run the coroutine from its start. Returns the coroutine's result."""
    pending = first
    while True:
        try:
            sent = yield pending
        except BaseException as exc:  # thrown in by the task (cancellation, a failed future)
            try:
                pending = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            pending = coro.send(sent)
        except StopIteration as stop:
            return stop.value


_EAGER = getattr(asyncio, "eager_task_factory", None)  # Python 3.12+


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any] | None:
    """Runs `coro` now, synchronously, up to its first real wait; returns None when it finished
    without waiting, else the task that carries it on. Exceptions from the synchronous part
    propagate to the caller (the coroutine should catch its own).

    This saves the loop round that ``create_task`` costs before a coroutine's first line runs.
    The synchronous part runs with its own task as ``asyncio.current_task()``, as
    ``asyncio.timeout`` and 3.12's ``wait_for`` need (outside a task they raise "Timeout should
    be used inside a task": every request whose bytes were not there at once was reset, seen on
    Ubuntu 24.04's Python 3.12). On Python 3.12 and later this is ``asyncio.eager_task_factory``.
    On 3.11 the task is made first (its first step is only scheduled), made the current task
    while the coroutine is stepped by hand (``asyncio.tasks._enter_task``, what 3.12's eager
    start does inside), and then carries the coroutine on from where it waits; a coroutine that
    finished at once leaves a task that is cancelled before its first step."""
    if _EAGER is not None:
        task: asyncio.Task[Any] = _EAGER(loop, coro)
        if task.done():
            task.result()  # the synchronous part's exception, as on 3.11
            return None
        return task
    first: list[Any] = []

    async def rest() -> Any:
        return await _carry_on(coro, first[0])

    carrier = loop.create_task(rest())
    outer = asyncio.current_task(loop)  # None from a loop callback (the accept); set from a task
    if outer is not None:
        asyncio.tasks._leave_task(loop, outer)  # type: ignore[attr-defined]
    asyncio.tasks._enter_task(loop, carrier)  # type: ignore[attr-defined]
    try:
        first.append(coro.send(None))
    except StopIteration:
        carrier.cancel()  # cancelled before its first step: its coroutine never starts
        return None
    except BaseException:
        carrier.cancel()
        raise
    finally:
        asyncio.tasks._leave_task(loop, carrier)  # type: ignore[attr-defined]
        if outer is not None:
            asyncio.tasks._enter_task(loop, outer)  # type: ignore[attr-defined]
    return carrier


class ApiServer:
    # Distinct paths whose route matches are remembered (paths carry ids, so the cache is bounded).
    MATCH_CACHE = 1024

    def __init__(self, path: str | Path, authorizer: Authorizer, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.request_timeout_s = request_timeout_s  # a request must arrive whole within it; an answer be taken
        self.admin_path = Path(admin_socket_path(str(self.path)))
        self.auth = authorizer
        self.routes: list[Route] = []
        self._sock: socket.socket | None = None
        self._admin_sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._matches: dict[str, list[tuple[Route, dict[str, str]]]] = {}
        self._open_by_uid: dict[int, int] = {}  # open connections of unprivileged callers
        self.requests = 0
        self.refused = 0
        self.busy_refused = 0  # connections refused past an unprivileged caller's share
        self.timed_out = 0
        self.internal_errors = 0
        # every refusal by reason (``api.refused_by_reason`` in GET /v1/status), the components' too
        self.refusals = Refusals()
        # requests' work in worker threads, per unprivileged uid (`work_slot`)
        self.work = UidSlots("requests doing work in a worker thread", WORK_PER_UID, WORK_ALL_USERS, "uid_threads")

    def exempt(self, peer: Peer) -> bool:
        """Whether `peer` is never counted against a per-user bound: root or the control group."""
        return self.auth.allowed(peer)

    def work_slot(self, peer: Peer) -> Any:
        """A context manager holding one of `peer`'s worker-thread slots while a request's work
        runs in a thread (``with api.work_slot(req.peer): await asyncio.to_thread(...)``):
        Busy (429) at once past WORK_PER_UID for the uid or WORK_ALL_USERS for all users."""
        return self.work.hold(peer.uid, exempt=self.exempt(peer))

    def stats(self) -> dict[str, Any]:
        """The API's counts for GET /v1/status (``api``)."""
        return {"requests": self.requests, "refused_privileged": self.refused, "refused": self.refusals.total(),
                "refused_by_reason": self.refusals.as_dict(), "internal_errors": self.internal_errors,
                "unprivileged_connections": sum(self._open_by_uid.values()),
                "threads_in_flight": self.work.in_flight()}

    def add(self, routes: list[Route]) -> None:
        self.routes.extend(routes)
        self._matches.clear()

    async def start(self) -> None:
        # Reachable by every local user (read-only calls) when the agent makes the directory; a
        # directory that exists keeps its mode: it may be a shared one (/tmp: 1777) or set so on
        # purpose (systemd/laminar.tmpfiles makes /run/laminar 0755).
        if not self.path.parent.is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(self.path.parent, 0o755)
        for path in (self.path, self.admin_path):
            self._clear_stale(path)
        # Every local user may connect to the public socket (read-only calls; privileged calls are
        # checked per request); only root and the control group to the admin socket. The mode is
        # set before listen(): nobody can connect in between.
        gid = self.auth.group_gid()
        self._sock = self._listen(self.path, 0o666, -1)
        try:
            self._admin_sock = self._listen(self.admin_path, 0o600 if gid is None else 0o660,
                                            -1 if gid is None else gid)
        except OSError:
            self._sock.close()
            self._sock = None
            raise
        self._loop = asyncio.get_running_loop()
        for sock in (self._admin_sock, self._sock):
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    @staticmethod
    def _clear_stale(path: Path) -> None:
        """A stale socket from a crashed agent would make bind() fail; only remove a socket, and
        only one nobody answers on (else a second agent would take over a running one's socket)."""
        if path.is_socket():
            if socket_in_use(path):
                raise RuntimeError(f"api: another laminard answers on {path}; stop it first, or give this "
                                   "agent its own agent.socket")
            path.unlink()
        elif path.exists():
            raise RuntimeError(f"api: {path} exists and is not a socket; remove it or set agent.socket")

    @staticmethod
    def _listen(path: Path, mode: int, gid: int) -> socket.socket:
        """A non-blocking listening socket bound at `path` with `mode` (and group `gid`, -1: unchanged)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(path))
            os.chown(path, -1, gid)
            os.chmod(path, mode)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock

    async def stop(self) -> None:
        for sock in (self._sock, self._admin_sock):
            if sock is not None and self._loop is not None:
                self._loop.remove_reader(sock.fileno())
                sock.close()
        self._sock = self._admin_sock = None
        conns = list(self._conns)
        for task in conns:  # open streams (events --follow) and requests still waiting
            task.cancel()
        if conns:  # bounded: a handler that ignores its cancellation must not hold the agent's stop
            _, stuck = await asyncio.wait(conns, timeout=STOP_WAIT_S)
            if stuck:
                log.warning("api: %d connection(s) still open %g s after the stop cancelled them; left behind",
                            len(stuck), STOP_WAIT_S)
        for path in (self.path, self.admin_path):
            try:
                if path.is_socket():
                    path.unlink()
            except OSError:
                pass

    def _accept(self, lsock: socket.socket) -> None:
        """Reader callback of a listening socket: serves up to ACCEPT_BATCH pending connections,
        each started eagerly (see the module docstring); the rest wait for the next loop round."""
        assert self._loop is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: say so, keep serving the others later
                log.warning("api: accept failed: %s", e)
                # The pending connection keeps the socket readable: watching it again at once
                # would run this callback on every loop round.
                self._loop.remove_reader(lsock.fileno())
                self._loop.call_later(ACCEPT_BACKOFF_S, self._rewatch, lsock)
                return
            conn.setblocking(False)
            try:
                peer = peer_credentials(conn)
                counted = not self.auth.allowed(peer)
                if counted and not self._admit(peer.uid):
                    self._refuse_busy(conn, peer)
                    continue
            except Exception:
                log.exception("api: connection failed")
                conn.close()
                continue
            try:
                task = start_eagerly(self._loop, self._serve(conn, peer, counted))
            except Exception:
                log.exception("api: connection failed")
                conn.close()
                continue
            if task is not None:
                self._conns.add(task)
                task.add_done_callback(self._conns.discard)

    def _rewatch(self, lsock: socket.socket) -> None:
        if self._loop is not None and lsock in (self._sock, self._admin_sock):
            self._loop.add_reader(lsock.fileno(), self._accept, lsock)

    def _admit(self, uid: int) -> bool:
        """Counts a connection of an unprivileged caller; False when it is past its share."""
        if (self._open_by_uid.get(uid, 0) >= MAX_CONNS_PER_UID
                or sum(self._open_by_uid.values()) >= MAX_UNPRIVILEGED_CONNS):
            return False
        self._open_by_uid[uid] = self._open_by_uid.get(uid, 0) + 1
        return True

    def _release(self, uid: int) -> None:
        n = self._open_by_uid.get(uid, 0) - 1
        if n > 0:
            self._open_by_uid[uid] = n
        else:
            self._open_by_uid.pop(uid, None)

    def _refuse_busy(self, conn: socket.socket, peer: Peer) -> None:
        """Answers 503 without waiting (best effort: the answer fits an empty socket buffer) and closes."""
        self.busy_refused += 1
        mine = self._open_by_uid.get(peer.uid, 0)
        self.refusals.count("uid_connections" if mine >= MAX_CONNS_PER_UID else "all_connections")
        body = json.dumps({"error": f"agent busy: uid {peer.uid} already has {mine} open connections to the "
                                    f"control socket (at most {MAX_CONNS_PER_UID} per user, "
                                    f"{MAX_UNPRIVILEGED_CONNS} for all users outside root and group "
                                    f"'{self.auth.control_group}'); close some and retry"}).encode() + b"\n"
        try:
            conn.send(f"HTTP/1.1 503 {REASONS[503]}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                      f"\r\nConnection: close\r\n\r\n".encode() + body)
        except OSError:
            pass
        finally:
            conn.close()

    async def _serve(self, conn: socket.socket, peer: Peer, counted: bool = False) -> None:
        """Serves one connection; `counted`: it holds one of the unprivileged caller's connections."""
        loop = self._loop
        assert loop is not None
        try:
            try:
                req = await self._read_request(loop, conn, peer, self.request_timeout_s)
            except ApiError as e:
                if e.status == 408:
                    self.timed_out += 1
                self.refusals.count(e.reason or f"request {e.status}")
                await self._send(loop, conn, e.status, {"error": e.message}, self.request_timeout_s)
                return
            if req is None:  # the client went away before sending a whole request
                return
            self.requests += 1
            status, payload = await self._dispatch(req)
            if isinstance(payload, Stream):
                await self._send_stream(loop, conn, payload, self.request_timeout_s)
            else:
                await self._send(loop, conn, status, payload, self.request_timeout_s)
        except (ConnectionError, BrokenPipeError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("api: connection failed")
        finally:
            conn.close()
            if counted:
                self._release(peer.uid)

    @staticmethod
    async def _read_request(loop: asyncio.AbstractEventLoop, conn: socket.socket, peer: Peer,
                            timeout_s: float = REQUEST_TIMEOUT_S) -> Request | None:
        """Reads one request (non-blocking recv first: it is usually there already). None when the
        client closed the connection early; ApiError for a malformed or oversized request, 408
        when the whole request has not arrived within `timeout_s`."""
        deadline = loop.time() + timeout_s
        buf = b""
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > MAX_HEADER:
                raise ApiError(400, f"request header longer than {MAX_HEADER} bytes", "header_too_large")
            chunk = await _recv(loop, conn, 65536, deadline, timeout_s)
            if not chunk:
                return None
            buf += chunk
        if end > MAX_HEADER:
            raise ApiError(400, f"request header longer than {MAX_HEADER} bytes", "header_too_large")
        lines = buf[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            raise ApiError(400, f"malformed request line {lines[0]!r}")
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            raise ApiError(400, f"Content-Length {headers.get('content-length')!r} is not a number") from None
        if length < 0:
            raise ApiError(400, f"Content-Length {length} is negative")
        if length > MAX_BODY:
            raise ApiError(413, f"request body of {length} bytes exceeds the {MAX_BODY} byte limit", "body_too_large")
        raw = buf[end + 4:]
        while len(raw) < length:
            chunk = await _recv(loop, conn, min(65536, length - len(raw)), deadline, timeout_s)
            if not chunk:
                return None
            raw += chunk
        raw = raw[:length]
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise ApiError(400, f"request body is not valid JSON: {e}", "bad_json") from None
            except RecursionError:
                raise ApiError(400, "request body is JSON nested too deeply; no request needs more than a "
                                    "few levels", "bad_json") from None
        url = urlsplit(target)
        return Request(method.upper(), url.path, dict(parse_qsl(url.query)), headers, body, peer)

    def _match(self, path: str) -> list[tuple[Route, dict[str, str]]]:
        """Every route whose path matches, in registration order, with its path parameters."""
        hit = self._matches.get(path)
        if hit is None:
            hit = [(r, p) for r in self.routes if (p := r.match(path)) is not None]
            if len(self._matches) >= self.MATCH_CACHE:
                self._matches.clear()
            self._matches[path] = hit
        return hit

    async def _dispatch(self, req: Request) -> tuple[int, Any]:
        allowed_methods = []
        for route, params in self._match(req.path):
            if route.method != req.method:
                allowed_methods.append(route.method)
                continue
            if route.privileged and not self.auth.allowed(req.peer):
                self.refused += 1
                self.refusals.count("not_privileged")
                return 403, {"error": f"permission denied: {req.method} {req.path} needs root or membership in group "
                                      f"'{self.auth.control_group}' (caller uid {req.peer.uid})"}
            req.params = dict(params)
            try:
                result = await route.handler(req)
            except ApiError as e:
                if e.status >= 400 and (e.reason or e.status != 404):  # a 404 of a look-up is no refusal
                    self.refusals.count(e.reason or f"{route.path} {e.status}")
                return e.status, {"error": e.message}
            except Busy as e:  # the caller's share of some work is in flight (userbounds)
                self.refusals.count(e.reason)
                return 429, {"error": e.message}
            except Exception as e:
                self.internal_errors += 1
                log.exception("api: %s %s failed", req.method, req.path)
                return 500, {"error": f"internal error: {type(e).__name__}: {e}"}
            return (201 if req.method == "POST" else 200), result
        self.refusals.count("no_route" if not allowed_methods else "bad_method")
        if allowed_methods:
            return 405, {"error": f"{req.method} not allowed on {req.path}; use {', '.join(sorted(set(allowed_methods)))}"}
        return 404, {"error": f"no such endpoint {req.path}"}

    @staticmethod
    async def _send(loop: asyncio.AbstractEventLoop, conn: socket.socket, status: int, payload: Any,
                    timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        body = (bytes(payload) if isinstance(payload, RawJson) else to_json(payload).encode()) + b"\n"
        head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        data = head + body
        try:  # the whole answer usually fits the socket buffer: no task, no timer
            sent = conn.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            try:
                await asyncio.wait_for(loop.sock_sendall(conn, data[sent:]), timeout_s)
            except TimeoutError:
                log.info("api: a client did not take its %d-byte answer within %g s; dropped", len(data),
                         timeout_s)

    @staticmethod
    async def _send_stream(loop: asyncio.AbstractEventLoop, conn: socket.socket, stream: Stream,
                           timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Sends each item as a line. A client that takes no line for `timeout_s` is dropped:
        its stream ends (a last line says why, where the socket takes it) and it is closed, so a
        reader that stopped reading holds no buffer in the agent (its queue: agent._follow)."""
        await asyncio.wait_for(loop.sock_sendall(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                                                       b"Connection: close\r\n\r\n"), timeout_s)
        try:
            async for item in stream.items:
                try:
                    await asyncio.wait_for(loop.sock_sendall(conn, to_json(item).encode() + b"\n"), timeout_s)
                except TimeoutError:
                    log.info("api: a stream's client took no line within %g s; dropped", timeout_s)
                    with contextlib.suppress(OSError):
                        conn.send(b"\n" + to_json({"kind": "dropped", "ts": time.time(),
                                                    "message": f"stream closed: the client took no line for "
                                                               f"{timeout_s:g} s"}).encode() + b"\n")
                    return
        finally:
            aclose = getattr(stream.items, "aclose", None)
            if aclose:
                await aclose()


async def _recv(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int, deadline: float,
                timeout_s: float = REQUEST_TIMEOUT_S) -> bytes:
    """Up to `n` bytes from a non-blocking socket: at once when they are there (no task, no timer),
    else waiting until `deadline` (loop time; `timeout_s` after the request began, for the error).
    Raises ApiError 408 past the deadline."""
    try:
        return conn.recv(n)
    except (BlockingIOError, InterruptedError):
        pass
    remaining = deadline - loop.time()
    if remaining > 0:
        try:
            return await asyncio.wait_for(loop.sock_recv(conn, n), remaining)
        except TimeoutError:
            pass
    raise ApiError(408, f"the request did not arrive whole within {timeout_s:g} s; send the header "
                        "and the Content-Length bytes of body at once", "request_timeout")


def require(body: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Reads a required key from a JSON body or raises a 400 that names it and what is expected."""
    if not isinstance(body, dict) or key not in body:
        raise ApiError(400, f"missing '{key}' in request body: expected {what}")
    value = body[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise ApiError(400, f"'{key}' = {value!r}: expected {what}")
    return value
