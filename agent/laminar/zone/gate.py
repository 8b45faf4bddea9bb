"""Who may hold the agent's peer TCP ports, and how much of them: the hand-over port
(``zone.handover_port``, :class:`laminar.zone.transport.HandoverServer`) and the checkpoint
transfer port (``migrate.port``, :class:`laminar.migrate.transfer.Receiver`).

Anyone who reaches a port can open connections, and until the peer proves it holds the zone's
key each one costs the agent a file descriptor, buffers and time on its event loop. So the
agent accepts connections itself (:class:`GatedListener`) and decides on the bare socket,
before an asyncio transport, task or buffer exists for it (:class:`Gate`):

- with ``zone.check_source`` (the default) a peer whose address is no roster address
  (``[[zone.nodes]] addr``, canonical: an IPv4 peer seen on a dual-stack socket is its IPv4
  address) is reset at once and counted ``off_roster``: it never takes a slot, whatever it
  sends and however many addresses it has;
- the others take a slot for as long as they have not authenticated, from one of two pools:
  roster addresses (at most :data:`PER_SOURCE` each, :data:`ROSTER_TOTAL` in all) and, only
  with ``check_source = false`` (NAT'd or multi-homed nodes, whose connections may come from
  any address), *strangers* (at most :data:`PER_SOURCE` per address, an IPv6 one's /64 taken
  as one address, :data:`STRANGER_TOTAL` in all). One address cannot take another's slots,
  and strangers cannot take the roster's: a flood of strangers holds at most their own pool,
  and a hand-over or transfer from a node's roster address still finds its slot. A connection
  past its share is reset and counted (``source_busy``, ``busy``);
- once authenticated, a member's connections take a slot of their own (at most
  :data:`MEMBER_AUTHENTICATED` per member, :data:`AUTHENTICATED_TOTAL` in all; past them:
  ``member_busy``, ``authenticated_busy``): a compromised member holds what one member may.

The servers count deadlines missed before authentication as ``slow`` (:meth:`Gate.count`).
:meth:`Gate.stats` is what ``laminarctl zone stats`` (``handover_tcp``) and ``laminarctl
status`` (``zone.handover_gate``, ``migrate.transfer_gate``) show.

Example::

    >>> g = Gate(lambda: {"10.0.0.1"}, check_source=True)
    >>> g.admit("10.0.0.9") is None, g.stats()["off_roster"]
    (True, 1)
    >>> s = g.admit("10.0.0.1")
    >>> g.stats()["reading"]
    1
    >>> s.release(); g.stats()["reading"]
    0
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Collection

from laminar.zone.membership import canonical_ip

log = logging.getLogger("laminar.zone.gate")

# Connections one address may have before they authenticate. A sender opens one per hand-over
# or transfer, and the handshake takes milliseconds: 8 at once is a burst of placements, and a
# refused one is tried again (a hand-over after 0.2 s, a transfer after retry_delay_s).
PER_SOURCE = 8
ROSTER_TOTAL = 64  # every roster address's together (a large zone's burst)
STRANGER_TOTAL = 32  # check_source = false only: addresses the roster does not list, together
# Authenticated connections: one per transfer or control message a member runs with this node
# at once (a reclaim of the member moves its jobs in parallel); each holds a few KiB until it
# takes an offer (laminar.migrate.transfer.channel._RecordBuffer grows only then).
MEMBER_AUTHENTICATED = 32
AUTHENTICATED_TOTAL = 256
ACCEPT_BATCH = 64  # connections accepted per wake-up of the event loop: the rest wait their turn
ACCEPT_BACKOFF_S = 0.1  # after an accept failed (EMFILE): the listening socket is watched again then
LISTEN_BACKLOG = 128

# every reason a connection was refused or cut, as counted (all present in stats(), zeros too)
REASONS = ("off_roster", "source_busy", "busy", "slow", "member_busy", "authenticated_busy")


class Slot:
    """One connection's place in a pool; :meth:`release` (idempotent) gives it back."""

    __slots__ = ("_pool", "key")

    def __init__(self, pool: _Pool, key: str) -> None:
        self._pool: _Pool | None = pool
        self.key = key

    def release(self) -> None:
        if self._pool is not None:
            self._pool.give(self.key)
            self._pool = None


class _Pool:
    """At most ``per_key`` slots per key, ``total`` in all."""

    def __init__(self, per_key: int, total: int, busy: tuple[str, str]) -> None:
        self.per_key, self.total = per_key, total
        self.busy = busy  # the reasons counted: (this key's share is taken, the pool is full)
        self.held: dict[str, int] = {}
        self.n = 0

    def take(self, key: str) -> Slot | str:
        """A slot, or the reason there is none."""
        k = self.held.get(key, 0)
        if k >= self.per_key:
            return self.busy[0]
        if self.n >= self.total:
            return self.busy[1]
        self.held[key] = k + 1
        self.n += 1
        return Slot(self, key)

    def give(self, key: str) -> None:
        k = self.held.get(key, 0) - 1
        if k > 0:
            self.held[key] = k
        else:
            self.held.pop(key, None)
        self.n = max(0, self.n - 1)


def source_key(ip: str) -> str:
    """The address a stranger's per-source share is counted by: its IP, an IPv6 one's /64 (one
    host holds a whole /64 as easily as one address)."""
    try:
        a = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(a, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((a, 64), strict=False))
    return ip


class Gate:
    """Admission to one peer TCP port (see the module docstring). ``roster()``: the canonical
    IPs of the roster's members, now (cheap: :meth:`laminar.zone.membership.Membership.roster_ips`);
    None: no roster (a transfer endpoint outside an agent: every address is a stranger).
    ``check_source``: refuse addresses that are not the roster's (ignored without a roster)."""

    def __init__(self, roster: Callable[[], Collection[str]] | None = None, check_source: bool = True,
                 per_source: int = PER_SOURCE, roster_total: int = ROSTER_TOTAL, stranger_total: int = STRANGER_TOTAL,
                 member_authenticated: int = MEMBER_AUTHENTICATED,
                 authenticated_total: int = AUTHENTICATED_TOTAL) -> None:
        self.roster = roster
        self.check_source = check_source and roster is not None
        self.members = _Pool(per_source, roster_total, ("source_busy", "busy"))
        self.strangers = _Pool(per_source, stranger_total, ("source_busy", "busy"))
        self.authenticated = _Pool(member_authenticated, authenticated_total, ("member_busy", "authenticated_busy"))
        self.counts: Counter[str] = Counter()

    def admit(self, ip: str) -> Slot | None:
        """A pre-authentication slot for a connection from ``ip`` (canonical: :func:`canonical`),
        or None (counted by reason): reset it unread."""
        if self.roster is not None and ip in self.roster():
            got = self.members.take(ip)
        elif self.check_source:
            self.counts["off_roster"] += 1
            return None
        else:
            got = self.strangers.take(source_key(ip))
        if isinstance(got, str):
            self.counts[got] += 1
            return None
        self.counts["accepted"] += 1
        return got

    def authenticate(self, node: int | str) -> Slot | None:
        """A slot for an authenticated connection of member ``node``, or None (counted)."""
        got = self.authenticated.take(str(node))
        if isinstance(got, str):
            self.counts[got] += 1
            return None
        return got

    def count(self, reason: str) -> None:
        self.counts[reason] += 1

    def stats(self) -> dict[str, int]:
        """Connections ``accepted`` (given a slot), refused or cut by reason (:data:`REASONS`),
        and held now: ``reading`` (not yet authenticated), ``authenticated``."""
        out = {"accepted": self.counts["accepted"], **{r: self.counts[r] for r in REASONS}}
        out["reading"] = self.members.n + self.strangers.n
        out["authenticated"] = self.authenticated.n
        return out


@functools.lru_cache(maxsize=4096)
def canonical(host: str) -> str:
    """``canonical_ip(host)``, remembered for the addresses seen most (the roster's); anything
    that is not an IP address is itself."""
    try:
        return canonical_ip(host)
    except ValueError:
        return host


_LINGER_RESET = struct.pack("ii", 1, 0)


def reset(conn: socket.socket) -> None:
    """Close ``conn`` with a reset (SO_LINGER 0): no FIN handshake, no TIME_WAIT, nothing left
    of it in the kernel either."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    conn.close()


Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str, Slot], Awaitable[None]]


class GatedListener:
    """A TCP server whose connections a :class:`Gate` admits on the bare socket (see the module
    docstring). ``serve(reader, writer, peer_ip, slot)`` runs for each admitted one, ``peer_ip``
    canonical; the slot is released when it returns, or earlier by ``serve`` (once the peer
    authenticated). Connections being served go on when the listener is closed.

    ``sockets`` are the listening sockets (``start`` with ``::`` and a port: two, IPv4 and
    IPv6, as asyncio's own servers; :func:`laminar.listen.relisten` reads them)."""

    def __init__(self, gate: Gate, serve: Serve, name: str) -> None:
        self.gate = gate
        self.serve = serve
        self.name = name
        self.sockets: list[socket.socket] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str | None, port: int) -> int:
        """Listen on ``host:port`` (None: every address, IPv4 and IPv6); the port bound.
        Raises OSError."""
        loop = self._loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        socks: list[socket.socket] = []
        seen = set()
        try:
            for family, kind, proto, _, addr in infos:
                if (family, addr) in seen:
                    continue
                seen.add((family, addr))
                s = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
                socks.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and host is None:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 socket beside it takes IPv4
                s.bind(addr)
                s.listen(LISTEN_BACKLOG)
                s.setblocking(False)
        except OSError:
            for s in socks:
                s.close()
            raise
        self.sockets = socks
        for s in socks:
            loop.add_reader(s.fileno(), self._accept, s)
        return int(socks[0].getsockname()[1])

    def close(self) -> None:
        """Stop listening (connections being served go on)."""
        for s in self.sockets:
            if self._loop is not None:
                self._loop.remove_reader(s.fileno())
            s.close()
        self.sockets = []

    async def wait_closed(self) -> None:
        return None

    def _accept(self, lsock: socket.socket) -> None:
        loop = self._loop
        assert loop is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: say so, watch the socket again a little later
                log.warning("%s: accept failed: %s", self.name, e)
                loop.remove_reader(lsock.fileno())
                loop.call_later(ACCEPT_BACKOFF_S, self._rewatch, lsock)
                return
            ip = canonical(str(addr[0])) if isinstance(addr, tuple) and addr else "?"
            slot = self.gate.admit(ip)
            if slot is None:
                reset(conn)
                continue
            conn.setblocking(False)
            task = loop.create_task(self._run(conn, ip, slot))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _rewatch(self, lsock: socket.socket) -> None:
        if self._loop is not None and lsock in self.sockets:
            self._loop.add_reader(lsock.fileno(), self._accept, lsock)

    async def _run(self, conn: socket.socket, ip: str, slot: Slot) -> None:
        loop = asyncio.get_running_loop()
        writer: asyncio.StreamWriter | None = None
        try:
            reader = asyncio.StreamReader(limit=64 << 10, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            try:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=conn)
            except OSError:
                conn.close()
                return
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            await self.serve(reader, writer, ip, slot)
        except Exception:
            log.exception("%s: connection from %s failed", self.name, ip)
        finally:
            slot.release()
            if writer is not None:
                writer.close()  # (serve closes it; a second close does nothing)
