"""A small rtnetlink client: the handful of NETLINK_ROUTE requests the agent makes.

Laminar talks to the kernel's routing/traffic-control netlink family for exactly these things:
an interface's index by name and name by index, the IPv4 routes of the main table (to find the
default uplink), and traffic-control objects (qdiscs, classes, filters: add, change, replace,
delete, dump). Each request is one ``struct nlmsghdr`` followed by the request's fixed header
(``ifinfomsg``, ``rtmsg`` or ``tcmsg``) and its attributes (``struct nlattr``, 4-byte aligned,
nested where the kernel nests them); the kernel answers with an ACK, an error, or a dump.

Usage (root for changes; reads work for anyone)::

    from laminar.net import rtnl

    with rtnl.Rtnl() as nl:                       # a socket in this thread's network namespace
        idx = nl.link_index("lmt0a")              # None when there is no such interface
        for q in nl.qdiscs(idx):
            print(q.tc_kind, hex(q.handle), hex(q.parent))
        nl.tc(rtnl.RTM_NEWQDISC, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, idx, 0xFFFF0000,
              rtnl.TC_H_CLSACT, kind="clsact", what=f"adding clsact on ifindex {idx}")

    with rtnl.Rtnl(netns="lm-t-x") as nl:         # a socket bound to /run/netns/lm-t-x
        ...

A socket for another network namespace is created in a short-lived thread that enters the
namespace (``setns``) first; a netlink socket stays in the namespace it was created in, so the
caller's own threads never change namespace.

Errors: a request the kernel refuses raises :class:`NetlinkError`, an ``OSError`` whose
``errno`` (also ``code``) is the kernel's, whose ``extack`` is the kernel's extended-ack text
when it sent one (e.g. "Filter with specified priority/protocol not found"), and whose message
names the request (``what``: the interface, handle or name). A reply that does not parse (a
length field past the end, a header shorter than its type needs, an answer to another
sequence number) raises :class:`MalformedReply` (``errno`` EBADMSG) naming what was wrong and
where, instead of returning half a dump. Every call is synchronous: netlink to the local
kernel answers in microseconds, so callers on the agent's event loop call it directly.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# --- netlink (uapi/linux/netlink.h, rtnetlink.h, pkt_sched.h) --------------------------------
NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11

NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_ACK, NLM_F_DUMP_INTR = 0x1, 0x2, 0x4, 0x10
NLM_F_DUMP = 0x300
NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x100, 0x200, 0x400
NLM_F_CAPPED, NLM_F_ACK_TLVS = 0x100, 0x200  # flags of an NLMSG_ERROR
NLMSGERR_ATTR_MSG = 1
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
RTM_NEWQDISC, RTM_DELQDISC, RTM_GETQDISC = 36, 37, 38
RTM_NEWTCLASS, RTM_DELTCLASS, RTM_GETTCLASS = 40, 41, 42
RTM_NEWTFILTER, RTM_DELTFILTER, RTM_GETTFILTER = 44, 45, 46
RTM_NEWNEXTHOP, RTM_GETNEXTHOP = 104, 106

IFLA_IFNAME, IFLA_LINK, IFLA_LINKINFO, IFLA_LINK_NETNSID = 3, 5, 18, 37
IFLA_INFO_KIND = 1
RTA_OIF, RTA_PRIORITY, RTA_MULTIPATH, RTA_TABLE, RTA_NH_ID = 4, 6, 9, 15, 30
NHA_ID, NHA_GROUP, NHA_OIF = 1, 2, 5
RT_TABLE_MAIN = 254
TCA_KIND, TCA_OPTIONS, TCA_STATS2 = 1, 2, 7
TCA_STATS_BASIC, TCA_STATS_QUEUE, TCA_STATS_PKT64 = 1, 3, 8
TC_H_ROOT = 0xFFFFFFFF
TC_H_CLSACT = 0xFFFFFFF1

_NLMSGHDR = struct.Struct("=IHHII")      # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")    # family, type, index, flags, change
_RTMSG = struct.Struct("=BBBBBBBBI")     # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_TCMSG = struct.Struct("=BxxxiIII")      # family, ifindex, handle, parent, info
_NLATTR = struct.Struct("=HH")           # len, type
_RTNEXTHOP = struct.Struct("=HBBi")      # len, flags, hops, ifindex (struct rtnexthop, then its attributes)
_NHMSG = struct.Struct("=BBBxI")         # family, scope, protocol, (reserved), flags (struct nhmsg)
_NHGRP = struct.Struct("=IBBH")          # id, weight, (weight_high / reserved) (struct nexthop_grp)
_ERRNO = struct.Struct("=i")
# The fixed header each reply type carries after the nlmsghdr.
_BODY = {RTM_NEWLINK: _IFINFOMSG, RTM_NEWROUTE: _RTMSG, RTM_NEWQDISC: _TCMSG, RTM_NEWTCLASS: _TCMSG,
         RTM_NEWTFILTER: _TCMSG, RTM_NEWNEXTHOP: _NHMSG}
RECV_BUF = 65536  # the kernel sizes dump batches to the reader's buffer, so one never exceeds it
DUMP_RETRIES = 3  # a dump interrupted by a concurrent change (NLM_F_DUMP_INTR) is asked again


class NetlinkError(OSError):
    """The kernel refused a request: ``errno``/``code`` is its errno, ``extack`` its extended-ack
    message ("" when none), ``what`` the request as the caller named it, ``reason`` the
    kernel's side alone (strerror and extack)."""

    def __init__(self, code: int, what: str, extack: str = "") -> None:
        reason = os.strerror(code) + (f" ({extack})" if extack else "")
        super().__init__(code, f"{what}: {reason}")
        self.code = code
        self.what = what
        self.extack = extack
        self.reason = reason


class MalformedReply(OSError):
    """A netlink reply that does not parse; nothing of it is used."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EBADMSG, f"malformed netlink reply: {message}")


def _align(n: int) -> int:
    return (n + 3) & ~3


# --- attributes -------------------------------------------------------------------------------

def attr(kind: int, payload: bytes) -> bytes:
    """One ``struct nlattr`` with its payload, padded to 4 bytes."""
    n = _NLATTR.size + len(payload)
    if n > 0xFFFF:
        raise ValueError(f"netlink attribute {kind} of {len(payload)} bytes is too long (at most 65531)")
    return _NLATTR.pack(n, kind) + payload + b"\0" * (_align(n) - n)


def attr_u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def attr_u64(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=Q", value))


def attr_str(kind: int, value: str) -> bytes:
    """A NUL-terminated string attribute (what NLA_STRING/NLA_NUL_STRING policies accept)."""
    return attr(kind, value.encode() + b"\0")


def attr_nest(kind: int, attrs: Iterable[bytes]) -> bytes:
    return attr(kind, b"".join(attrs))


def parse_attrs(data: bytes, where: str = "attributes") -> dict[int, bytes]:
    """The attributes in `data` as type -> payload (flags masked off; a repeated type keeps the
    last). Raises MalformedReply for a length below 4 or past the end of `data`."""
    out: dict[int, bytes] = {}
    off = 0
    while off + _NLATTR.size <= len(data):
        n, kind = _NLATTR.unpack_from(data, off)
        if n < _NLATTR.size or off + n > len(data):
            raise MalformedReply(f"{where}: attribute {kind & NLA_TYPE_MASK} at offset {off} says {n} bytes, "
                                 f"{len(data) - off} left")
        out[kind & NLA_TYPE_MASK] = data[off + _NLATTR.size:off + n]
        off += _align(n)
    if off < len(data) and any(data[off:]):
        raise MalformedReply(f"{where}: {len(data) - off} stray bytes after the last attribute")
    return out


def u32(data: bytes | None, where: str = "u32 attribute") -> int | None:
    if data is None:
        return None
    if len(data) < 4:
        raise MalformedReply(f"{where}: {len(data)} bytes, a u32 needs 4")
    return int(struct.unpack_from("=I", data)[0])


def u64(data: bytes | None, where: str = "u64 attribute") -> int | None:
    if data is None:
        return None
    if len(data) < 8:
        raise MalformedReply(f"{where}: {len(data)} bytes, a u64 needs 8")
    return int(struct.unpack_from("=Q", data)[0])


def string(data: bytes | None) -> str | None:
    return None if data is None else data.split(b"\0", 1)[0].decode(errors="replace")


# --- messages ---------------------------------------------------------------------------------

@dataclass
class Message:
    """One reply message: its type, flags, fixed header fields (by position, per _BODY) and
    attributes. For tc objects, ``ifindex``/``handle``/``parent``/``info`` name the fields."""

    type: int
    flags: int
    seq: int
    header: tuple[int, ...]
    attrs: dict[int, bytes] = field(default_factory=dict)

    @property
    def ifindex(self) -> int:
        """The interface of a tc object (tcmsg) or a link (ifinfomsg); routes name theirs in RTA_OIF."""
        if self.type in (RTM_NEWQDISC, RTM_NEWTCLASS, RTM_NEWTFILTER):
            return self.header[1]
        if self.type == RTM_NEWLINK:
            return self.header[2]
        raise AttributeError(f"a message of type {self.type} has no ifindex field (a route's is RTA_OIF)")

    @property
    def handle(self) -> int:
        return self.header[2]

    @property
    def parent(self) -> int:
        return self.header[3]

    @property
    def info(self) -> int:
        return self.header[4]

    @property
    def tc_kind(self) -> str | None:
        return string(self.attrs.get(TCA_KIND))

    def nested(self, *path: int) -> dict[int, bytes]:
        """The attributes nested under the attribute path (e.g. TCA_OPTIONS), {} when absent."""
        attrs = self.attrs
        for i, kind in enumerate(path):
            raw = attrs.get(kind)
            if raw is None:
                return {}
            attrs = parse_attrs(raw, f"nested attribute {list(path[:i + 1])} of message type {self.type}")
        return attrs


def _extack(data: bytes, off: int) -> str:
    try:
        return string(parse_attrs(data[off:], "extended ack").get(NLMSGERR_ATTR_MSG)) or ""
    except MalformedReply:
        return ""


def parse_messages(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) for each message in one datagram. Raises MalformedReply for
    a length field below the header or past the end of the datagram."""
    off = 0
    while off < len(data):
        if len(data) - off < _NLMSGHDR.size:
            raise MalformedReply(f"{len(data) - off} bytes at offset {off}, a message header needs {_NLMSGHDR.size}")
        n, kind, flags, seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if n < _NLMSGHDR.size or off + n > len(data):
            raise MalformedReply(f"message type {kind} at offset {off} says {n} bytes, {len(data) - off} left "
                                 f"(truncated)")
        yield kind, flags, seq, data[off + _NLMSGHDR.size:off + n]
        off += _align(n)


def decode(kind: int, flags: int, seq: int, payload: bytes) -> Message:
    """A data message (one of the types in _BODY) as a Message. Raises MalformedReply."""
    body = _BODY.get(kind)
    if body is None:
        raise MalformedReply(f"unexpected message type {kind} in a reply")
    if len(payload) < body.size:
        raise MalformedReply(f"message type {kind}: {len(payload)} bytes, its header needs {body.size}")
    return Message(kind, flags, seq, body.unpack_from(payload), parse_attrs(payload[_align(body.size):],
                                                                           f"message type {kind}"))


# --- the socket -------------------------------------------------------------------------------

def _open_socket() -> socket.socket:
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    try:
        s.bind((0, 0))
        for opt in (NETLINK_EXT_ACK, NETLINK_CAP_ACK):
            try:
                s.setsockopt(SOL_NETLINK, opt, 1)
            except OSError:
                pass  # older kernels: errors without extack, with the request echoed
    except BaseException:
        s.close()
        raise
    return s


RTMGRP_LINK = 0x1  # the multicast group of interface changes (RTM_NEWLINK/RTM_DELLINK)


def link_events() -> socket.socket:
    """A non-blocking NETLINK_ROUTE socket of this thread's network namespace subscribed to
    interface changes (RTMGRP_LINK): readable whenever a link is added, changed or removed. Its
    messages are notifications only; a reader drains them (an overflowing queue makes recv fail
    with ENOBUFS: something changed, and the reader looks at the links again anyway)."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK, NETLINK_ROUTE)
    try:
        s.bind((0, RTMGRP_LINK))
    except BaseException:
        s.close()
        raise
    return s


def netns_path(netns: str) -> str:
    """The file of a named network namespace (``ip netns`` keeps them in /run/netns); a path
    starting with "/" is taken as it is."""
    return netns if netns.startswith("/") else f"/run/netns/{netns}"


def _open_socket_in(netns: str) -> socket.socket:
    """A NETLINK_ROUTE socket created inside network namespace `netns`, from a short-lived
    thread that enters it, so no thread of the caller changes namespace."""
    import ctypes  # only here: the agent itself never names a netns

    path = netns_path(netns)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"no network namespace {netns!r} ({path}: {e.strerror})") from None  # ENOENT: FileNotFoundError
    out: dict[str, object] = {}

    def enter_and_open() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {netns!r}: {os.strerror(err)}")
            out["sock"] = _open_socket()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    try:
        t = threading.Thread(target=enter_and_open, name="laminar-rtnl-netns", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(fd)
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    sock = out["sock"]
    assert isinstance(sock, socket.socket)
    return sock


class Rtnl:
    """One NETLINK_ROUTE socket (in this thread's network namespace, or in `netns`). Not
    thread-safe: one request at a time. Close it (or use ``with``)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self.sock = _open_socket_in(netns) if netns else _open_socket()
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the protocol -----------------------------------------------------------------------

    def _send(self, kind: int, flags: int, payload: bytes) -> int:
        self.seq = self.seq % 0x7FFFFFFF + 1
        self.sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(payload), kind, NLM_F_REQUEST | flags, self.seq, 0)
                       + payload)
        return self.seq

    def _recv(self) -> bytes:
        data, _anc, flags, _addr = self.sock.recvmsg(RECV_BUF)
        if flags & socket.MSG_TRUNC:
            raise MalformedReply(f"a reply longer than the {RECV_BUF}-byte buffer was cut")
        if not data:
            raise MalformedReply("an empty datagram")
        return bytes(data)

    def _error(self, payload: bytes, flags: int, what: str) -> int:
        """The errno of an NLMSG_ERROR (0 for an ACK); raises NetlinkError for a refusal."""
        if len(payload) < _ERRNO.size:
            raise MalformedReply(f"an error message of {len(payload)} bytes, it needs {_ERRNO.size}")
        code = -_ERRNO.unpack_from(payload)[0]
        if code == 0:
            return 0
        extack = ""
        if flags & NLM_F_ACK_TLVS and len(payload) >= _ERRNO.size + _NLMSGHDR.size:
            echoed = _NLMSGHDR.size if flags & NLM_F_CAPPED else _NLMSGHDR.unpack_from(payload, _ERRNO.size)[0]
            extack = _extack(payload, _ERRNO.size + _align(echoed))
        raise NetlinkError(code, what, extack)

    def request(self, kind: int, flags: int, payload: bytes, *, what: str) -> None:
        """Sends one change request and waits for the kernel's ACK. Raises NetlinkError with the
        kernel's errno and extack (message prefixed by `what`), MalformedReply."""
        seq = self._send(kind, flags | NLM_F_ACK, payload)
        while True:
            for mkind, mflags, mseq, body in parse_messages(self._recv()):
                if mseq != seq:
                    continue  # a stale answer to an earlier request of this socket
                if mkind == NLMSG_ERROR:
                    self._error(body, mflags, what)
                    return
                if mkind == NLMSG_NOOP:
                    continue
                raise MalformedReply(f"message type {mkind} where the ACK for {what!r} was due")

    def dump(self, kind: int, payload: bytes, *, what: str) -> list[Message]:
        """Every message of a dump request (restarted when the kernel flags it interrupted).
        Raises NetlinkError, MalformedReply."""
        for _attempt in range(DUMP_RETRIES):
            seq = self._send(kind, NLM_F_DUMP, payload)
            out: list[Message] = []
            interrupted = False
            done = False
            while not done:
                for mkind, mflags, mseq, body in parse_messages(self._recv()):
                    if mseq != seq:
                        continue
                    interrupted |= bool(mflags & NLM_F_DUMP_INTR)
                    if mkind == NLMSG_DONE:
                        if len(body) >= _ERRNO.size and _ERRNO.unpack_from(body)[0] < 0:
                            code = -_ERRNO.unpack_from(body)[0]
                            raise NetlinkError(code, what, _extack(body, _ERRNO.size) if mflags & NLM_F_ACK_TLVS
                                               else "")
                        done = True
                        break
                    if mkind == NLMSG_ERROR:
                        self._error(body, mflags, what)
                        done = True  # an ACK ends a dump too
                        break
                    if mkind in (NLMSG_NOOP, NLMSG_OVERRUN):
                        continue
                    out.append(decode(mkind, mflags, mseq, body))
            if not interrupted:
                return out
        raise NetlinkError(errno.EINTR, f"{what} (interrupted by concurrent changes {DUMP_RETRIES} times)")

    def get(self, kind: int, payload: bytes, *, what: str) -> Message:
        """The one object a non-dump RTM_GET* request answers with. Raises NetlinkError (e.g.
        ENODEV for no such interface), MalformedReply."""
        seq = self._send(kind, 0, payload)
        while True:
            for mkind, mflags, mseq, body in parse_messages(self._recv()):
                if mseq != seq or mkind == NLMSG_NOOP:
                    continue
                if mkind == NLMSG_ERROR:
                    self._error(body, mflags, what)
                    raise MalformedReply(f"an ACK instead of the answer to {what!r}")
                return decode(mkind, mflags, mseq, body)

    # --- links and routes ---------------------------------------------------------------------

    def link_index(self, ifname: str) -> int | None:
        """The index of interface `ifname` in the socket's namespace; None when there is none."""
        if not ifname or len(ifname.encode()) >= 16 or "/" in ifname:
            return None  # no interface can have that name (IFNAMSIZ is 16 with the NUL)
        try:
            m = self.get(RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, ifname),
                         what=f"looking up interface {ifname!r}")
        except NetlinkError as e:
            if e.code == errno.ENODEV:
                return None
            raise
        return m.ifindex

    def link_name(self, ifindex: int) -> str | None:
        """The name of interface `ifindex`; None when there is none."""
        try:
            m = self.get(RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, ifindex, 0, 0),
                         what=f"looking up interface index {ifindex}")
        except NetlinkError as e:
            if e.code == errno.ENODEV:
                return None
            raise
        return string(m.attrs.get(IFLA_IFNAME))

    def links(self) -> list[Message]:
        """Every interface of the socket's namespace (``link_kind(m)``, ``link_underlay(m)``)."""
        return self.dump(RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0), what="listing interfaces")

    def routes(self, family: int = socket.AF_INET) -> list[Message]:
        """Every route of `family` (all tables; the table is ``route_table(m)``)."""
        return self.dump(RTM_GETROUTE, _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), what="listing routes")

    def route_interfaces(self, m: Message) -> list[int]:
        """The interfaces a route leaves by (:func:`route_oifs`), also for a route through a
        nexthop object (``ip route add ... nhid N``): with ``net.ipv4.nexthop_compat_mode`` 0
        such a route carries only RTA_NH_ID, and its interfaces are the nexthop's (a group's:
        its members', in the kernel's order)."""
        oifs = route_oifs(m)
        nh = u32(m.attrs.get(RTA_NH_ID), "RTA_NH_ID")
        return oifs if oifs or not nh else self.nexthop_oifs(nh)

    def nexthop_oifs(self, nh_id: int) -> list[int]:
        """The interfaces of nexthop object ``nh_id``: its NHA_OIF, or each member's of a group
        (groups hold plain nexthops, never groups). Empty for a blackhole. Raises NetlinkError
        (ENOENT: no such nexthop), MalformedReply."""
        out: list[int] = []
        todo, seen = [nh_id], set()
        while todo:
            n = todo.pop(0)
            if n in seen:
                continue
            seen.add(n)
            m = self.get(RTM_GETNEXTHOP, _NHMSG.pack(socket.AF_UNSPEC, 0, 0, 0) + attr(NHA_ID, struct.pack("=I", n)),
                         what=f"looking up nexthop {n}")
            oif = u32(m.attrs.get(NHA_OIF), "NHA_OIF")
            if oif and oif not in out:
                out.append(oif)
            grp = m.attrs.get(NHA_GROUP) or b""
            if len(grp) % _NHGRP.size:
                raise MalformedReply(f"nexthop {n}: a group of {len(grp)} bytes, not a multiple of {_NHGRP.size}")
            todo += [_NHGRP.unpack_from(grp, off)[0] for off in range(0, len(grp), _NHGRP.size)]
        return out

    # --- traffic control ----------------------------------------------------------------------

    def tc(self, kind: int, flags: int, ifindex: int, handle: int, parent: int, info: int = 0, *,
           tc_kind: str | None = None, options: bytes | None = None, what: str) -> None:
        """One tc change request (RTM_NEW*/RTM_DEL* of a qdisc, class or filter) on `ifindex`;
        `options` is the TCA_OPTIONS payload (already-encoded attributes)."""
        payload = _TCMSG.pack(socket.AF_UNSPEC, ifindex, handle, parent, info)
        if tc_kind is not None:
            payload += attr_str(TCA_KIND, tc_kind)
        if options is not None:
            payload += attr(TCA_OPTIONS, options)
        self.request(kind, flags, payload, what=what)

    def _tc_dump(self, kind: int, ifindex: int, parent: int, what: str) -> list[Message]:
        msgs = self.dump(kind, _TCMSG.pack(socket.AF_UNSPEC, ifindex, 0, parent, 0), what=what)
        return [m for m in msgs if m.ifindex == ifindex]  # qdisc dumps cover every interface

    def qdiscs(self, ifindex: int) -> list[Message]:
        return self._tc_dump(RTM_GETQDISC, ifindex, 0, f"listing qdiscs of ifindex {ifindex}")

    def classes(self, ifindex: int) -> list[Message]:
        return self._tc_dump(RTM_GETTCLASS, ifindex, 0, f"listing classes of ifindex {ifindex}")

    def filters(self, ifindex: int, parent: int) -> list[Message]:
        return self._tc_dump(RTM_GETTFILTER, ifindex, parent,
                             f"listing filters of ifindex {ifindex} parent {parent >> 16:x}:{parent & 0xFFFF:x}")


def link_kind(m: Message) -> str:
    """A link's kind (IFLA_INFO_KIND: "vxlan", "gre", "veth", ...); "" for one with none (a NIC, lo)."""
    return string(m.nested(IFLA_LINKINFO).get(IFLA_INFO_KIND)) or ""


def link_underlay(m: Message) -> int | None:
    """The index of the interface a link sits on (IFLA_LINK: a tunnel's ``dev``, a VLAN's or
    macvlan's parent), 0 for a link bound to none (a tunnel routed by the table), None when that
    interface is in another namespace (IFLA_LINK_NETNSID), where this namespace's indexes mean
    nothing."""
    if IFLA_LINK_NETNSID in m.attrs:
        return None
    link = u32(m.attrs.get(IFLA_LINK), "IFLA_LINK") or 0
    return 0 if link == m.ifindex else link


def route_table(m: Message) -> int:
    """A route's table: RTA_TABLE (tables above 255) or the rtmsg's 8-bit field."""
    return u32(m.attrs.get(RTA_TABLE)) or m.header[4]


def route_oifs(m: Message) -> list[int]:
    """The interfaces a route leaves by, in the kernel's order: its RTA_OIF, or for a multipath
    (ECMP) route every nexthop's ifindex in RTA_MULTIPATH (a list of struct rtnexthop, each
    followed by its own attributes). Empty for a route with neither (blackhole, unreachable).
    Raises :class:`MalformedReply` for a nexthop list that does not add up."""
    oif = u32(m.attrs.get(RTA_OIF), "RTA_OIF")
    if oif:
        return [oif]
    data = m.attrs.get(RTA_MULTIPATH)
    out: list[int] = []
    off = 0
    while data is not None and off + _RTNEXTHOP.size <= len(data):
        length, _flags, _hops, ifindex = _RTNEXTHOP.unpack_from(data, off)
        if length < _RTNEXTHOP.size or off + length > len(data):
            raise MalformedReply(f"route nexthop of {length} bytes at offset {off} of an RTA_MULTIPATH of {len(data)}")
        if ifindex > 0 and ifindex not in out:
            out.append(ifindex)
        off += _align(length)
    return out
