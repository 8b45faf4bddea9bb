"""What a transfer reports while it runs: :class:`Progress` (bytes persisted at the
destination) to its caller, and to the shaper and kill-switch (a :class:`FlowHook`, the
agent's transfer registry) the connection's 5-tuple (:class:`Flow`) and, every ACK_POLL_S,
the bytes the peer's TCP has acknowledged (:class:`_AckMeter`, :func:`_report_acks`)."""

from __future__ import annotations

import asyncio
import collections
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from laminar.migrate.transfer.channel import RECORD_MAX, RECORD_TAG, _Channel

if TYPE_CHECKING:
    from laminar.components import MigrateAgent


@dataclass(frozen=True)
class Progress:
    job_id: str
    ckpt_id: str
    done_bytes: int  # persisted at the destination
    total_bytes: int
    elapsed_s: float

    @property
    def fraction(self) -> float:
        return 1.0 if self.total_bytes == 0 else self.done_bytes / self.total_bytes


@dataclass(frozen=True)
class Flow:
    """A transfer's TCP 5-tuple as the source sees it (local -> remote), IPv4 or IPv6.

    Addresses are kept as the packets carry them, so the flow hook registers the 5-tuple the data
    plane sees: a zone (``fe80::1%eth0``, part of an IPv6 socket's name) is dropped, and an
    IPv4-mapped address (``::ffff:10.0.0.2``, a dual-stack socket's name for an IPv4 peer) becomes
    its IPv4 address (the packets are IPv4). Raises ValueError for an address that is neither."""

    saddr: str
    sport: int
    daddr: str
    dport: int
    proto: str = "tcp"

    def __post_init__(self) -> None:
        from laminar.zone.membership import canonical_ip

        for name in ("saddr", "daddr"):
            raw = str(getattr(self, name))
            try:
                object.__setattr__(self, name, canonical_ip(raw))
            except ValueError:
                raise ValueError(f"flow {name} {raw!r} is not an IPv4 or IPv6 address") from None

    @classmethod
    def of_socket(cls, sockname: Any, peername: Any, proto: str = "tcp") -> Flow:
        """The flow of a connected socket from its ``getsockname()``/``getpeername()`` (an IPv4
        pair or an IPv6 4-tuple with flow info and scope id)."""
        return cls(str(sockname[0]), int(sockname[1]), str(peername[0]), int(peername[1]), proto)


class FlowHook(Protocol):
    """What the shaper and kill-switch need from a transfer (H5's transfer registry).
    ``register`` and ``unregister`` may return awaitables (the registry does netlink work on
    its own thread); they are awaited. ``progress`` is called on the loop, at most every
    ACK_POLL_S and once at the commit, with the registered bytes the peer's TCP has acknowledged
    (growing, at most the registered total; the total once the destination committed); never
    when the kernel cannot say (see :class:`_AckMeter`). It must not block."""

    def register(self, flow: Flow, job_id: str, total_bytes: int, deadline_monotonic: float | None) -> Any: ...

    def progress(self, handle: Any, acked_bytes: int) -> None: ...

    def unregister(self, handle: Any) -> Any: ...


# The sender reports to its flow hook what the peer's TCP has acknowledged, at most this often
# (and once more when the destination has committed): bytes written into the socket are not yet
# on the wire, and bytes the shaper's leaf sent may still be lost; acknowledged bytes are neither.
ACK_POLL_S = 0.2
_TCP_INFO_LEN = 256  # asks for more than any kernel's struct tcp_info has: the kernel returns what it has
_TCPI_BYTES_ACKED = 120  # offset of __u64 tcpi_bytes_acked in struct tcp_info (Linux 4.1+)
_SIOCOUTQ = 0x5411  # TIOCOUTQ: a TCP socket's bytes written and not yet acknowledged


def bytes_acked_of(info: bytes) -> int | None:
    """``tcpi_bytes_acked`` of a ``TCP_INFO`` answer, or None when the kernel's struct tcp_info is
    too short to have it (kernels before 4.1)."""
    if len(info) < _TCPI_BYTES_ACKED + 8:
        return None
    return int(struct.unpack_from("=Q", info, _TCPI_BYTES_ACKED)[0])


def tcp_bytes_acked(sock: Any) -> int | None:
    """Bytes of this TCP connection's stream the peer has acknowledged so far (the kernel's
    ``tcpi_bytes_acked``: one getsockopt, exact, never more than the peer's TCP received; the SYN
    and a FIN count one each, so take differences), or None when the kernel does not say (no such
    field, not a TCP socket)."""
    import socket as _socket

    try:
        info = sock.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, ValueError):
        return None
    return bytes_acked_of(info)


def tcp_unacked_bytes(sock: Any) -> int | None:
    """Bytes written into this TCP socket that the peer has not acknowledged yet (``SIOCOUTQ``:
    unsent plus in flight), or None when the kernel does not say."""
    import array
    import fcntl

    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), _SIOCOUTQ, buf, True)
    except (OSError, AttributeError, ValueError):
        return None
    return int(buf[0])


class _AckMeter:
    """How many chunk payload bytes the peer's TCP has acknowledged, for the flow hook.

    The channel counts every byte it hands the transport (``_Channel.written``); the meter marks
    where each chunk's payload records lie in that stream, and maps the stream position the peer
    has acknowledged to payload bytes (a record's length prefix, a chunk's header and the AES-GCM
    tags are not payload). The acknowledged position comes from ``tcpi_bytes_acked`` (counted from
    where it stood when the meter started, when everything written before had been answered), or,
    on a kernel without it, from the bytes handed to the socket less ``SIOCOUTQ``. ``read`` returns
    None when the kernel says neither: the hook is then not told (the shaper keeps its estimate)."""

    def __init__(self, sock: Any, ch: _Channel) -> None:
        self.sock, self.ch = sock, ch
        self.chunks: collections.deque[tuple[int, int, int]] = collections.deque()  # (payload start, len, payload before)
        self.payload = 0  # chunk payload bytes written so far
        self.done = 0  # payload bytes of the chunks already wholly acknowledged
        self.base_acked = tcp_bytes_acked(sock)
        self.base_pos = self._in_kernel() - (tcp_unacked_bytes(sock) or 0)
        self.outq = self.base_acked is None and tcp_unacked_bytes(sock) is not None

    def _in_kernel(self) -> int:
        """Channel bytes the socket has taken (what the transport still buffers is not in it)."""
        tr = getattr(self.ch.w, "transport", None)
        buffered = tr.get_write_buffer_size() if tr is not None else 0
        return self.ch.written - int(buffered)

    def chunk_sent(self, n: int) -> None:
        """A chunk of ``n`` payload bytes has just gone to the channel: its header record, then its
        payload records, end at ``ch.written``."""
        wire = sum(4 + min(RECORD_MAX, n - off) + RECORD_TAG for off in range(0, n, RECORD_MAX))
        self.chunks.append((self.ch.written - wire, n, self.payload))
        self.payload += n

    def position(self) -> int | None:
        """The channel stream position up to which the peer has acknowledged, or None."""
        if self.base_acked is not None:
            now = tcp_bytes_acked(self.sock)
            return None if now is None else self.base_pos + now - self.base_acked
        if self.outq:
            q = tcp_unacked_bytes(self.sock)
            return None if q is None else self._in_kernel() - q
        return None

    def read(self) -> int | None:
        """Chunk payload bytes the peer has acknowledged (never more than written), or None."""
        pos = self.position()
        if pos is None:
            return None
        while self.chunks:
            start, n, before = self.chunks[0]
            x = pos - start
            got = 0
            for off in range(0, n, RECORD_MAX):
                rl = min(RECORD_MAX, n - off)
                if x >= 4 + rl + RECORD_TAG:
                    got += rl
                    x -= 4 + rl + RECORD_TAG
                else:
                    got += min(rl, max(0, x - 4))
                    break
            if got < n:
                return before + got
            self.chunks.popleft()
            self.done = before + n
        return self.done


def default_flow_hook(agent: MigrateAgent) -> FlowHook | None:
    """The agent's transfer registry (``agent.transfers``, laminar.net.transfers) when it has
    one with register/progress/unregister, else None (the transfer then runs unshaped)."""
    reg = agent.transfers
    if reg is not None and all(hasattr(reg, a) for a in ("register", "progress", "unregister")):
        return reg  # type: ignore[return-value]  # (the registry has the three, checked above)
    return None


async def _report_acks(meter: _AckMeter, hook: FlowHook, handle: Any, total: int, told: list[int]) -> None:
    """Tells ``hook`` every ACK_POLL_S how many payload bytes the peer has acknowledged, when it
    grew past ``told[0]`` (kept there; at most ``total``, the bytes registered: chunks sent again
    after a ``need`` count again)."""
    while True:
        await asyncio.sleep(ACK_POLL_S)
        n = meter.read()
        if n is None:  # the kernel does not say (any more): the shaper keeps its own estimate
            return
        n = min(n, total)
        if n > told[0]:
            hook.progress(handle, n)
            told[0] = n
