"""Prometheus metrics on localhost (``metrics.listen``, default 127.0.0.1:9477).

Components register their own collectors on ``agent.metrics`` (a CollectorRegistry of the
agent's, not the process-global default, so tests can run several agents in one process).

The endpoint is served from the agent's own event loop (:class:`MetricsServer`), with the
control API's bounds, because every local user reaches a TCP port on localhost: the exporter
prometheus_client starts (one thread per connection, no timeout, no cap) let one user who opens
connections and sends nothing hold a thread and a descriptor each, without end (500 idle
connections: 500 more threads in the agent; the agent's descriptors ran out first, and with them
every accept of the control API, root's included). Now:

- a request (``GET /metrics``; ``/`` too) must arrive whole within ``[agent] request_timeout_s``,
  its header at most 16 KiB, and the answer be taken within as long; one request per connection;
- the exposition is rendered at most once a second (`CACHE_S`): any number of scrapes in that
  second cost one render;
- connections are counted per user: for a connection from this host the kernel says which uid
  owns the connecting socket (NETLINK_SOCK_DIAG, inet_diag: the peer's socket looked up by its
  addresses and ports, `peer_uid`), and that uid may hold at most `CONNS_PER_UID` at once; one
  from another host is counted by its address, as many. All of them together, root's aside, at
  most `CONNS_MAX`; past either bound a connection is closed at once, and counted
  (``api.refused_by_reason``: ``metrics_uid_connections``, ``metrics_all_connections``).
  Root (uid 0) is never refused. Where the kernel cannot say (no inet_diag), local connections
  are counted by address, all as one source: the global bound still holds.

Why not a Unix socket: Prometheus scrapes TCP, and ``[metrics] listen`` is an address today;
SO_PEERCRED is what a Unix socket would add, and inet_diag gives the same uid for loopback.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import struct
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

log = logging.getLogger("laminar.metrics")

CACHE_S = 1.0  # the exposition is rendered at most this often
CONNS_PER_UID = 4  # open connections of one uid (or one remote address); root is not counted
CONNS_MAX = 64  # of everyone but root together
MAX_HEADER = 16 << 10
ACCEPT_BATCH = 64  # connections taken per loop round (as the control API)
ACCEPT_BACKOFF_S = 0.1


def make_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


class CoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("laminar_events_total", "Events emitted, by kind", ["kind"], registry=registry)
        self.up = Gauge("laminar_agent_start_time_seconds", "When this agent process started", registry=registry)
        self.api_requests = Gauge("laminar_api_requests", "Control API requests served", registry=registry)
        self.api_refused = Gauge("laminar_api_refused", "Privileged API calls refused by SO_PEERCRED check",
                                 registry=registry)


# --- who owns the other end of a loopback TCP connection (NETLINK_SOCK_DIAG) ----------------------

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_NLMSGHDR = struct.Struct("=IHHII")
# struct inet_diag_req_v2: family, protocol, ext, pad, states, then struct inet_diag_sockid:
# sport, dport (big endian), src[4], dst[4] (big endian words), if, cookie[2]
_REQ = struct.Struct("=BBBxI")
_SOCKID = struct.Struct(">HH16s16s")  # then idiag_if (u32) and the cookie (2 x u32): 48 bytes
_NO_IF_NO_COOKIE = struct.pack("=I", 0) + b"\xff" * 8  # INET_DIAG_NOCOOKIE: the cookie is not checked
# struct inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires, rqueue,
# wqueue, uid, inode
_MSG_UID_OFFSET = 4 + 48 + 12


def _addr16(family: int, addr: str) -> bytes:
    raw = socket.inet_pton(family, addr)
    return raw + b"\0" * (16 - len(raw))


class PeerUids:
    """Looks up the uid owning the local socket at the other end of a TCP connection, through
    one netlink socket (inet_diag answers within the send: no wait on the loop)."""

    def __init__(self) -> None:
        self._nl: socket.socket | None = None
        self.broken: str | None = None  # why lookups are off (no inet_diag), None while they work
        self._seq = 0

    def _sock(self) -> socket.socket | None:
        if self._nl is None and self.broken is None:
            try:
                nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
                nl.setblocking(False)
                nl.bind((0, 0))
                self._nl = nl
            except OSError as e:
                self.broken = f"NETLINK_SOCK_DIAG: {e}"
                log.warning("metrics: cannot tell which user opens a connection (%s); local connections are "
                            "counted together", self.broken)
        return self._nl

    def uid(self, local: tuple[Any, ...], peer: tuple[Any, ...], family: int) -> int | None:
        """The uid of the socket whose own address is `peer` and whose remote is `local` (the
        connecting end of a connection accepted at `local`); None when no such socket is on this
        host (a remote client) or the kernel cannot say."""
        nl = self._sock()
        if nl is None:
            return None
        paddr, pport = peer[0], peer[1]
        laddr, lport = local[0], local[1]
        fam = family
        if family == socket.AF_INET6:  # a v4 client of a :: listener: its socket is AF_INET
            p6, l6 = ipaddress.IPv6Address(paddr), ipaddress.IPv6Address(laddr)
            if p6.ipv4_mapped is not None and l6.ipv4_mapped is not None:
                fam, paddr, laddr = socket.AF_INET, str(p6.ipv4_mapped), str(l6.ipv4_mapped)
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        body = (_REQ.pack(fam, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
                + _SOCKID.pack(pport, lport, _addr16(fam, paddr), _addr16(fam, laddr)) + _NO_IF_NO_COOKIE)
        try:
            nl.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, self._seq, 0) + body)
            data = nl.recv(8192)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.EAGAIN):
                log.debug("metrics: sock_diag lookup failed: %s", e)
            return None
        if len(data) < _NLMSGHDR.size:
            return None
        _, mtype, _, _, _ = _NLMSGHDR.unpack_from(data)
        if mtype == NLMSG_ERROR:  # ENOENT: no such socket here (a remote client)
            err = struct.unpack_from("=i", data, _NLMSGHDR.size)[0] if len(data) >= _NLMSGHDR.size + 4 else 0
            if err and -err not in (errno.ENOENT,) and self.broken is None and -err in (errno.EINVAL, errno.EOPNOTSUPP):
                self.broken = f"inet_diag: {errno.errorcode.get(-err, -err)}"
            return None
        if mtype != SOCK_DIAG_BY_FAMILY or len(data) < _NLMSGHDR.size + _MSG_UID_OFFSET + 4:
            return None
        return int(struct.unpack_from("=I", data, _NLMSGHDR.size + _MSG_UID_OFFSET)[0])

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None


class MetricsServer:
    """``GET /metrics`` on `listen` (HOST:PORT), served from the event loop (module docstring)."""

    def __init__(self, listen: str, registry: CollectorRegistry, refusals: Any = None,
                 request_timeout_s: float = 10.0) -> None:
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self.registry = registry
        self.refusals = refusals  # userbounds.Refusals (the API's), or None
        self.request_timeout_s = request_timeout_s
        self.peers = PeerUids()
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: dict[tuple[str, Any], int] = {}  # ("uid", uid) or ("addr", address) -> open connections
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cache: tuple[float, bytes] | None = None
        self.served = 0
        self.renders = 0

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._accept)
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._sock = None
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        self.peers.close()

    def shutdown(self) -> None:  # the old exporter's name (prometheus_client's server)
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        self.peers.close()

    def _refuse(self, reason: str) -> None:
        if self.refusals is not None:
            self.refusals.count(reason)

    def source(self, conn: socket.socket) -> tuple[str, Any]:
        """Who a connection is counted as: ("uid", uid) for one from this host whose owner the
        kernel names, else ("addr", the peer's address)."""
        peer = conn.getpeername()
        uid = self.peers.uid(conn.getsockname(), peer, conn.family)
        return ("uid", uid) if uid is not None else ("addr", peer[0])

    def _accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE: say so, look again a little later
                log.warning("metrics: accept failed: %s", e)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(ACCEPT_BACKOFF_S, self._rewatch)
                return
            conn.setblocking(False)
            try:
                who = self.source(conn)
            except OSError:
                conn.close()
                continue
            counted = who != ("uid", 0)
            if counted:
                if self._open.get(who, 0) >= CONNS_PER_UID:
                    self._refuse("metrics_uid_connections")
                    conn.close()
                    continue
                if sum(self._open.values()) >= CONNS_MAX:
                    self._refuse("metrics_all_connections")
                    conn.close()
                    continue
                self._open[who] = self._open.get(who, 0) + 1
            task = self._loop.create_task(self._serve(conn, who if counted else None))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _rewatch(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def render(self) -> bytes:
        """The exposition, rendered at most every CACHE_S."""
        now = time.monotonic()
        if self._cache is None or now - self._cache[0] >= CACHE_S:
            self._cache = (now, generate_latest(self.registry))
            self.renders += 1
        return self._cache[1]

    async def _serve(self, conn: socket.socket, who: tuple[str, Any] | None) -> None:
        loop = self._loop
        assert loop is not None
        try:
            status, body, ctype = await self._answer(loop, conn)
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            await asyncio.wait_for(loop.sock_sendall(conn, head + body), self.request_timeout_s)
        except (TimeoutError, OSError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("metrics: a scrape failed")
        finally:
            conn.close()
            if who is not None:
                n = self._open.get(who, 0) - 1
                if n > 0:
                    self._open[who] = n
                else:
                    self._open.pop(who, None)

    async def _answer(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> tuple[str, bytes, str]:
        deadline = loop.time() + self.request_timeout_s
        buf = b""
        while b"\r\n\r\n" not in buf:
            if len(buf) > MAX_HEADER:
                self._refuse("metrics_header_too_large")
                return "400 Bad Request", b"request header too long\n", "text/plain"
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(loop.sock_recv(conn, 16384), left)
            except TimeoutError:
                self._refuse("metrics_request_timeout")
                return "408 Request Timeout", b"the request did not arrive in time\n", "text/plain"
            if not chunk:
                raise ConnectionResetError
            buf += chunk
        line = buf.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(line) != 3 or line[0] not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        path = line[1].split("?", 1)[0]
        if path not in ("/metrics", "/"):
            return "404 Not Found", b"GET /metrics\n", "text/plain"
        self.served += 1
        body = self.render()
        return "200 OK", b"" if line[0] == "HEAD" else body, CONTENT_TYPE_LATEST

