"""How zone messages travel: the interface the submitter uses, and the real UDP/TCP mechanism.

:class:`~laminar.zone.submitter.Transport` (defined with the submitter, which holds no socket)
is what :class:`laminar.zone.submitter.Submitter` needs: send a message to a node, receive the
answers of one placement in arrival order, hand a job over. The agent uses
:class:`UdpEndpoint` (one UDP socket, datagrams signed and checked by
:mod:`laminar.zone.wire`) plus :func:`handover` / :class:`HandoverServer` (TCP, the same signed
envelope behind a length prefix). The benchmark uses :class:`laminar.zone.simnet.SimNet`.

Answers are routed by placement id (:class:`Router`): an offer that arrives for a placement
nobody waits for any more (it came after the submitter bound another) is counted and dropped;
it lapses with its short lease on the node that made it (no release is sent).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from laminar import listen
from laminar.zone import wire
from laminar.zone.gate import REASONS, Gate, GatedListener, Slot
from laminar.zone.membership import Membership, canonical_ip, host_port

# The hand-over error and the Transport protocol live with the submitter, which needs them
# without sockets (issue 32); importable from here as before.
from laminar.zone.submitter import HandoverError, Transport  # noqa: F401  (Transport: the old path)

log = logging.getLogger("laminar.zone.transport")

ANSWER_QUEUE_MAX = 256  # answers buffered per placement: d is at most 255
READ_BATCH = 256  # datagrams read per wake-up of the event loop, at most (others wait their turn)
READ_BUDGET_S = 0.005  # ...and for at most this long: a burst of datagrams never holds the loop past it
RCVBUF = 4 << 20  # socket receive buffer: about 5,000 datagrams of a burst
CANON_CACHE_MAX = 4096  # source addresses whose canonical spelling is remembered


class _Canon:
    """``canonical_ip`` of socket addresses, remembered (the UDP hot path sees few distinct
    sources: the roster's). Anything that is not an IP address maps to itself."""

    def __init__(self) -> None:
        self.known: dict[str, str] = {}

    def __call__(self, host: str) -> str:
        c = self.known.get(host)
        if c is None:
            try:
                c = canonical_ip(host)
            except ValueError:
                c = host
            if len(self.known) < CANON_CACHE_MAX:
                self.known[host] = c
        return c


def address_is_local(host: str) -> bool:
    """True when the IP address ``host`` is assigned in this network namespace and usable now
    (a socket can bind it: not an address of another host, nor a tentative IPv6 one)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


IFA_F_DADFAILED, IFA_F_TENTATIVE = 0x08, 0x40  # an IPv6 address's flags (uapi/linux/if_addr.h)
IF_INET6 = "/proc/net/if_inet6"  # this network namespace's IPv6 addresses, tentative ones too


def address_state(host: str, if_inet6: str = IF_INET6) -> str:
    """``usable`` when a socket can bind the IP address ``host`` here (:func:`address_is_local`);
    for an IPv6 address this host holds but cannot bind yet, ``tentative`` (duplicate address
    detection runs: 1 to 2 s after the address was added, and as long as its link has no
    carrier) or ``duplicate`` (DAD failed: another host on the link holds it); else ``absent``."""
    if address_is_local(host):
        return "usable"
    try:
        want = ipaddress.IPv6Address(host).packed.hex()
    except ValueError:
        return "absent"
    try:
        with open(if_inet6) as f:
            rows = [line.split() for line in f]
    except OSError:
        return "absent"
    for row in rows:  # address, ifindex, prefix length, scope, flags (hex), interface
        if len(row) >= 6 and row[0] == want:
            flags = int(row[4], 16)
            if flags & IFA_F_DADFAILED:
                return "duplicate"
            if flags & IFA_F_TENTATIVE:
                return "tentative"
    return "absent"


async def wait_while_tentative(host: str, wait_s: float, step_s: float = 0.1) -> str:
    """:func:`address_state` of ``host``, once it is not ``tentative`` or after ``wait_s``
    (checked every ``step_s``): an address added just before the agent started (a node's boot)
    is usable a second or two later."""
    state = address_state(host)
    if state == "tentative":
        log.info("zone: address %s is tentative (duplicate address detection runs): waiting up to %.1f s for it",
                 host, wait_s)
        deadline = time.monotonic() + wait_s
        while state == "tentative" and time.monotonic() < deadline:
            await asyncio.sleep(step_s)
            state = address_state(host)
    return state


class Router:
    """Answers by placement id, for any transport."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Queue[tuple[int, wire.Body]]] = {}
        self.late_offers = 0
        # told of each late offer (the submitter remembers it, to release it with its next
        # probe to that node: Submitter.note_late_offer)
        self.on_late_offer: Callable[[int, wire.Offer], None] | None = None

    def expect(self, placement_id: int) -> asyncio.Queue[tuple[int, wire.Body]]:
        q: asyncio.Queue[tuple[int, wire.Body]] = asyncio.Queue(ANSWER_QUEUE_MAX)
        self.waiting[placement_id] = q
        return q

    def forget(self, placement_id: int) -> None:
        self.waiting.pop(placement_id, None)

    def route(self, node: int, body: wire.Offer | wire.Refuse | wire.CommitAck) -> bool:
        """Queue an answer for its placement; False when nobody waits (a late offer: counted,
        it lapses)."""
        q = self.waiting.get(body.placement_id)
        if q is None:
            if isinstance(body, wire.Offer):
                self.late_offers += 1
                if self.on_late_offer is not None:
                    self.on_late_offer(node, body)
            return False
        try:
            q.put_nowait((node, body))
        except asyncio.QueueFull:
            return True
        return True


class UdpEndpoint:
    """The agent's UDP socket: decodes every datagram and hands good ones to ``on_message``.

    The socket is read straight from the event loop's reader callback, draining up to
    :data:`READ_BATCH` datagrams per wake-up (asyncio's datagram transport reads one per loop
    iteration, which costs a poll per datagram at thousands a second), with a 4 MiB receive
    buffer to ride out bursts. ``clock`` (the wall clock) stamps and checks datagrams;
    ``local_clock`` (default: the same) tells the membership when a peer was heard.
    ``on_message(msg, addr)`` runs synchronously in the loop and
    must not block. Drops are counted by the decoder (``decoder.stats()``); send errors (a
    peer's host down: ICMP unreachable, a full buffer) are counted, never raised.

    When the decoder checks sources (``decoder.sources``, from
    :meth:`Membership.udp_sources`), each datagram's source (canonical IP, port) must be its
    claimed sender's roster address; one that is not is dropped as ``wrong_source`` before it
    counts as traffic from anyone.
    """

    def __init__(
        self,
        membership: Membership,
        encoder: wire.Encoder,
        decoder: wire.Decoder,
        on_message: Callable[[wire.Message, tuple[str, int]], None],
        clock: Callable[[], float] = time.time,
        local_clock: Callable[[], float] | None = None,
    ) -> None:
        self.m = membership
        self.enc = encoder
        self.dec = decoder
        self.on_message = on_message
        self.clock = clock  # the wall clock: datagram timestamps
        self.local_clock = local_clock or clock  # when a peer was heard, for ages (membership.seen)
        self.sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None  # the port bound (kept while a rebind finds it taken)
        self.sent = 0
        self.received = 0
        self.send_errors = 0
        self.recv_errors = 0
        self._canon = _Canon()

    def open(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> None:
        """Bind ``host:port`` and start reading. Raises OSError (e.g. the port is taken). An
        IPv6 ``host`` gives an IPv6 socket; ``::`` one for IPv6 and IPv4 peers alike (dual
        stack: IPv4 peers are sent to and seen v4-mapped)."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if host == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            for opt in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
                if opt is None:
                    continue
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, RCVBUF)
                    break
                except OSError:
                    continue
            sock.bind((host, port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self._loop = loop
        self.port = int(sock.getsockname()[1])
        loop.add_reader(sock.fileno(), self._readable)

    def rebind(self, host: str) -> None:
        """Listen on ``host`` at the same port instead (the socket is closed and a new one
        bound: a datagram arriving in between is lost, as any). When ``host`` cannot be bound
        the old address is bound again and the OSError raised; when neither can be (the port
        was taken in between), no socket is open (sends are dropped) and an OSError says so:
        the next call binds ``host`` at that port."""
        assert self._loop is not None and self.port is not None, "rebind before open"
        loop, port = self._loop, self.port
        if self.sock is None:
            self.open(loop, host, port)
            return
        old = str(self.sock.getsockname()[0])
        self.close()
        try:
            self.open(loop, host, port)
        except OSError as e:
            try:
                self.open(loop, old, port)
            except OSError as again:
                raise OSError(e.errno, f"cannot bind {host} port {port} ({e.strerror}), nor {old} again "
                                       f"({again.strerror}): no zone socket until it is tried again") from e
            raise

    def close(self) -> None:
        if self.sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def _readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        until = time.monotonic() + READ_BUDGET_S
        for i in range(READ_BATCH):
            try:
                data, addr = sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. ECONNREFUSED reported for an earlier send
                self.recv_errors += 1
                return
            self.datagram_received(data, addr)
            if i & 15 == 15 and time.monotonic() > until:
                return  # the rest next round: the socket stays readable

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received += 1
        now = self.clock()
        try:
            msg = self.dec.decode(data, now, (self._canon(addr[0]), addr[1]) if self.dec.sources is not None else None)
        except wire.Dropped as e:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("dropped datagram from %s: %s", host_port(addr[0], addr[1]), e)
            return
        self.m.seen(msg.node, now, now if self.local_clock is self.clock else self.local_clock())
        try:
            self.on_message(msg, addr)
        except Exception:  # a handler bug must not take the endpoint down
            log.exception("handling %s from node %d failed", msg.type.name, msg.node)

    def send(self, node: int, body: wire.Body, flags: int = 0) -> None:
        m = self.m.by_node.get(node)
        if m is None:
            return
        self.send_to(m.zone, (m.addr, m.port), body, flags, to=node)
        self.m.state[node].tx += 1

    def send_to(self, zone: int, addr: tuple[str, int], body: wire.Body, flags: int = 0, to: int = 0) -> None:
        """Send ``body`` signed with ``zone``'s key for node ``to`` (only its decoder accepts
        it) to ``addr``."""
        if self.sock is None:
            return
        if self.sock.family == socket.AF_INET6 and ":" not in addr[0]:
            addr = (f"::ffff:{addr[0]}", addr[1])  # an IPv4 peer, from a dual-stack socket
        try:
            self.sock.sendto(self.enc.encode(body, zone, self.clock(), flags, to=to), addr)
            self.sent += 1
        except (OSError, ValueError) as e:
            self.send_errors += 1
            log.debug("send to %s failed: %s", host_port(addr[0], addr[1]), e)


# --------------------------------------------------------------------------- TCP hand-over


def error_text(e: BaseException, timeout_s: float | None = None) -> str:
    """What went wrong, in words, for a message that names the address itself: a timeout as
    such (its str() is empty), an OSError as its errno's text (asyncio's errors repeat the
    address as a tuple: ``('::1', 7441, 0, 0)``)."""
    if isinstance(e, TimeoutError):
        return f"no answer in {timeout_s:g} s" if timeout_s is not None else "timed out"
    if isinstance(e, OSError) and e.errno:
        return f"{os.strerror(e.errno)} (errno {e.errno})"
    return str(e) or type(e).__name__


async def _read_frame(reader: asyncio.StreamReader, max_size: int) -> bytes:
    prefix = await reader.readexactly(4)
    n = wire.frame_length(prefix)
    if n > max_size:
        raise ValueError(f"frame of {n} bytes exceeds {max_size}")
    return await reader.readexactly(n)


async def handover(
    encoder: wire.Encoder,
    decoder: wire.Decoder,
    zone: int,
    addr: str,
    port: int,
    body: wire.Handover,
    timeout_s: float,
    clock: Callable[[], float] = time.time,
    to: int = 0,
    local_host: str | None = None,
) -> wire.HandoverAck:
    """Send one hand-over frame to ``addr:port`` (node ``to``: the frame verifies there only)
    and wait for its authenticated ack (from node ``to``, when given).

    ``local_host`` (the agent's ``zone.listen`` when it names one address) is the address the
    connection leaves from, so that it is this node's roster address on a host with several
    (the receiver checks it: ``zone.check_source``); None: the route's source address.

    Raises :class:`HandoverError` (``delivered`` False when the connection failed before the
    frame was written, True afterwards); ValueError (before connecting) when the frame would
    exceed :data:`wire.MAX_FRAME`.

    The frame is signed once the connection is up, not before: its timestamp and sequence number
    are those of the moment it is written, so a slow connect (a lost SYN) neither ages it past
    the replay window nor puts it behind the sender's later frames."""
    if encoder.keys.get(zone) is None:
        raise ValueError(f"wire: no key for zone {zone} ({encoder.keys.source})")
    size = wire.HEADER_SIZE + len(wire.encode_body(body)) + wire.MAC_SIZE
    if size > wire.MAX_FRAME:
        raise ValueError(f"wire: HANDOVER message of {size} bytes exceeds {wire.MAX_FRAME}")
    peer = host_port(addr, port)  # [fd00::2]:7441: an IPv6 address's colons would run into the port's
    try:
        local = (local_host, 0) if local_host else None
        reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, port, local_addr=local), timeout_s)
    except (OSError, TimeoutError) as e:
        raise HandoverError(f"connect {peer}: {error_text(e, timeout_s)}", delivered=False) from None
    try:
        data = wire.frame(encoder.encode(body, zone, clock(), max_size=wire.MAX_FRAME, to=to))
        try:
            writer.write(data)
            await asyncio.wait_for(writer.drain(), timeout_s)
        except (OSError, TimeoutError) as e:
            raise HandoverError(f"send to {peer}: {error_text(e, timeout_s)}", delivered=False) from None
        try:
            raw = await asyncio.wait_for(_read_frame(reader, 64 * 1024), timeout_s)
            msg = decoder.decode(raw, clock())
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, wire.Dropped) as e:
            raise HandoverError(f"no valid answer from {peer}: {error_text(e, timeout_s)}", delivered=True) from None
        if not isinstance(msg.body, wire.HandoverAck) or msg.body.placement_id != body.placement_id:
            raise HandoverError(f"unexpected answer from {peer}: {msg.type.name}", delivered=True)
        if to and msg.node != to:
            raise HandoverError(f"answer from {peer} signed as node {msg.node}, not node {to}", delivered=True)
        return msg.body
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


# Before its MAC is checked a hand-over frame is read in two steps, each under a deadline: its
# length and header (34 bytes, sent at once by a submitter) within HEADER_DEADLINE_S, then, once
# the header names a member at this connection's address, its body (at most wire.MAX_FRAME, a
# spec at its cap with its request) within the hand-over timeout plus the time it takes at
# BODY_MIN_RATE. A peer that drips bytes holds its slot no longer.
HEADER_DEADLINE_S = 3.0
BODY_MIN_RATE = 64 << 10  # bytes per second


class HandoverServer:
    """The TCP end of hand-overs: one frame in, one ack out, per connection.

    ``on_handover(msg)`` returns the ack body; frames that fail the wire checks are counted by
    the decoder and the connection is closed without an answer. When the decoder checks
    sources (``decoder.sources``, from :meth:`Membership.tcp_sources`), the connection's peer
    IP must be the roster address of the node the frame claims to come from (``wrong_source``
    otherwise: a member cannot hand a job over as another node).

    Who may hold the port before authenticating is the ``gate``'s to decide
    (:mod:`laminar.zone.gate`: with ``zone.check_source`` only roster addresses, a share each;
    counted by reason in :meth:`stats`). An admitted connection's header is read first
    (:data:`HEADER_DEADLINE_S`) and checked (:meth:`laminar.zone.wire.Decoder.precheck`: a
    frame's size, its zone, its claimed sender and that sender's address) before its body is
    read, at :data:`BODY_MIN_RATE` at least (a frame announcing more than its header's body
    length, up to :data:`wire.MAX_FRAME` before, is dropped there: ``bad_length``). Once
    authenticated the connection gives its reading slot back and takes one of its member's
    (``gate.authenticate``) while the job starts.
    """

    def __init__(
        self,
        encoder: wire.Encoder,
        decoder: wire.Decoder,
        zone_of: Callable[[int], int | None],
        on_handover: Callable[[wire.Message], Awaitable[wire.HandoverAck]],
        clock: Callable[[], float] = time.time,
        timeout_s: float = 10.0,
        gate: Gate | None = None,
    ) -> None:
        self.enc = encoder
        self.dec = decoder
        self.gate = gate if gate is not None else Gate()
        self.zone_of = zone_of
        self.on_handover = on_handover
        self.clock = clock
        self.timeout_s = timeout_s
        self.server: GatedListener | None = None
        self.port: int | None = None  # the port it listens on (kept while a relisten finds it taken)
        self.connections = 0

    @property
    def refused(self) -> int:
        """Connections refused or cut before their frame was read (every reason of the gate's)."""
        st = self.gate.stats()
        return sum(st[r] for r in REASONS)

    @property
    def reading(self) -> int:
        """Connections whose frame is being read (not yet authenticated)."""
        return self.gate.stats()["reading"]

    def stats(self) -> dict[str, int]:
        """``connections`` admitted or not, ``refused`` (all reasons), and the gate's counts by
        reason (:meth:`laminar.zone.gate.Gate.stats`)."""
        return {"connections": self.connections, "refused": self.refused, **self.gate.stats()}

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; ``::`` is every address of both families (two sockets, as
        asyncio's servers)."""
        srv = GatedListener(self.gate, self._serve, "zone: hand-over port")
        self.port = await srv.start(None if host == "::" else host, port)
        self.server = srv

    async def relisten(self, host: str) -> None:
        """Listen on ``host`` at the same port instead; hand-overs being served go on. When
        ``host`` cannot be bound the old address is listened on again and the OSError raised;
        when neither can be, nothing listens until the next call (:func:`laminar.listen.relisten`)."""
        await listen.relisten(self.server, self.port, host, self.start, self.stop)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ip: str, slot: Slot) -> None:
        self.connections += 1
        member: Slot | None = None
        try:
            src = ip if self.dec.sources is not None else None
            try:
                async with asyncio.timeout(min(HEADER_DEADLINE_S, self.timeout_s)):
                    head = await reader.readexactly(4 + wire.HEADER_SIZE)
                n = wire.frame_length(head[:4])
                self.dec.precheck(head[4:], n, src)  # nothing more is read of a frame that will be dropped
                async with asyncio.timeout(self.timeout_s + n / BODY_MIN_RATE):
                    raw = head[4:] + await reader.readexactly(n - wire.HEADER_SIZE)
            except TimeoutError:
                self.gate.count("slow")
                return
            msg = self.dec.decode(raw, self.clock(), src)
            del raw
            slot.release()  # authenticated: its reading slot goes back, a member's is taken
            if not isinstance(msg.body, wire.Handover):
                return
            member = self.gate.authenticate(msg.node)
            if member is None:
                return
            ack = await self.on_handover(msg)
            zone = self.zone_of(msg.node)
            if zone is None:
                return
            writer.write(wire.frame(self.enc.encode(ack, zone, self.clock(), max_size=wire.MAX_FRAME, to=msg.node)))
            await asyncio.wait_for(writer.drain(), self.timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError, wire.Dropped):
            return
        except Exception:
            log.exception("hand-over failed")
        finally:
            if member is not None:
                member.release()
            writer.close()
