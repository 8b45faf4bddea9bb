"""The zone wire format: authenticated, replay-protected datagrams between agents.

Every datagram is ``header | body | mac`` (byte layouts in ``docs/protocol.md``):

- a 30-byte header in network byte order: magic ``b"LZ"``, version, message type, flags, bits
  16-23 of the body length (0 but in a hand-over frame of more than 64 KiB), the *key zone* (whose key signs it), the sender's node id, the sender's wall
  clock in milliseconds, the sender's sequence number and the body length;
- a compact ``struct`` body, one layout per message type;
- HMAC-SHA256 with the key zone's key (32 bytes) over the receiver's node id (u32, not sent)
  followed by header and body: a datagram verifies only at the node it was sent to, so one
  captured on its way to one node and replayed to another is dropped (``bad_mac``). Between two
  nodes that both have a node key the MAC key is their pair key under the key zone's key
  (:class:`laminar.zone.keys.PairKeys`), and a receiver takes only that from such a sender.

A sender signs with the zone's current key; a receiver accepts any key the zone lists (its
``next`` and ``previous`` keys during a rotation, :mod:`laminar.zone.keys`), trying the current
one first, and counts which key verified (:meth:`Decoder.key_stats`).

A UDP datagram is at most :data:`MAX_DATAGRAM` bytes; hand-overs over TCP use the same
envelope behind a 4-byte length with a larger limit (:data:`MAX_FRAME`).

:class:`Decoder` turns bytes into a typed :class:`Message` or raises :class:`Dropped` with a
:class:`DropReason`, counting every drop by reason; it raises nothing else, whatever the input
(``tests/unit/test_fuzz_wire.py`` holds it to that). Checks run cheapest first: the claimed
sender (in the roster, and with ``sources`` at its roster address) is checked before any MAC
work, so a datagram from an address that is not its claim's costs no HMAC; the MAC is checked
before anything else in the header is trusted beyond its length; the sequence window is
updated only for datagrams that passed every other check, so a forgery cannot burn sequence
numbers. A decoder keeps, per sender, a window of the :data:`SEQ_WINDOW` numbers behind the
highest seen (UDP), or with ``remember_by_time`` every number it took while its timestamp can
pass the stale check (the hand-over decoders: one sender's numbers run across its datagrams too,
so its hand-over frames are far apart and a slow one may come in far behind a later one).

Example::

    >>> from laminar.zone.keys import ZoneKeys
    >>> keys = ZoneKeys({1: bytes(32)}, "test")
    >>> enc = Encoder(node=5, keys=keys, seq0=1)
    >>> dec = Decoder(keys, known_nodes={5: 1, 6: 1}, node=6)
    >>> data = enc.encode(Release(placement_id=77), zone=1, now=1000.0, to=6)
    >>> dec.decode(data, now=1000.0).body
    Release(placement_id=77)
    >>> try:
    ...     dec.decode(data, now=1000.0)
    ... except Dropped as e:
    ...     print(e.reason)
    DropReason.REPLAY
"""

from __future__ import annotations

import enum
import hmac
import secrets
import struct
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from laminar.zone.keys import ANY_ZONE, PairKeys, ZoneKeys, fingerprint

MAGIC = b"LZ"
VERSION = 2  # 2: the MAC covers the receiver's node id (a datagram of version 1 is dropped as bad_version)
HEADER = struct.Struct("!2sBBBBHIQQH")
HEADER_SIZE = HEADER.size  # 30
MAC_SIZE = 32
MAX_DATAGRAM = 1200  # stays under any path MTU with IPv6 and tunnels, no fragmentation
MAX_FRAME = 1 << 20  # a TCP hand-over frame (job spec inside)
REPLAY_WINDOW_S = 30.0  # clocks of a zone's nodes are NTP-synchronised far better than this
SEQ_WINDOW = 256  # sequence numbers accepted out of order behind the highest seen (255 behind: taken; 256: replay)
# A decoder that remembers by time (hand-over frames over TCP, Decoder(remember_by_time=True))
# keeps every sequence number it took while its timestamp can still pass the stale check, at
# most this many (then the oldest go, and a sender's numbers at or below a forgotten one are
# refused as replay): hand-overs are few, so this is never reached in practice.
SEEN_BY_TIME_MAX = 1 << 16
SEQ_BLOCK = 1 << 20  # sequence numbers an encoder reserves at a time in its persisted floor (Encoder.reserve)

FLAG_REPLY_WANTED = 0x01  # a heartbeat that asks for one back (liveness check)


def new_id() -> int:
    """A message id a peer must not guess (a placement's, a loan request's, a reclaim notice's):
    63 random bits from the operating system's CSPRNG, odd (never 0). Whoever saw many ids (``GET
    /v1/placements`` shows them to every local user) cannot predict the next, as Python's
    ``random`` (the Mersenne Twister) can be from a few hundred outputs."""
    return secrets.randbits(63) | 1


class MsgType(enum.IntEnum):
    """Message types (append only; values travel on the wire)."""

    PROBE = 1
    OFFER = 2
    REFUSE = 3
    COMMIT = 4
    COMMIT_ACK = 5
    RELEASE = 6
    SUMMARY = 7
    ZONE_SUMMARY = 8
    RECLAIM_NOTICE = 9
    HEARTBEAT = 10
    HANDOVER = 11
    HANDOVER_ACK = 12
    LOAN_REQUEST = 13
    LOAN_ANSWER = 14
    MEMBER_REQUEST = 15
    MEMBER_ANSWER = 16


_MSG_TYPES: dict[int, MsgType] = {int(t): t for t in MsgType}


class DropReason(enum.Enum):
    """Why a datagram was dropped; the value is the counter's name (``/v1/zone/stats``)."""

    TRUNCATED = "truncated"  # shorter than header + mac, or than its body length says
    TOO_LARGE = "too_large"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_LENGTH = "bad_length"  # body length disagrees with the datagram's size
    UNKNOWN_ZONE = "unknown_zone"  # no key for the key zone it names
    BAD_MAC = "bad_mac"  # forged, corrupted, signed with another key, or sent to another node
    UNKNOWN_NODE = "unknown_node"  # the claimed sender is not in the membership (checked before the MAC)
    WRONG_SOURCE = "wrong_source"  # sent from another address than its claimed sender's (zone.check_source; before the MAC)
    BAD_TYPE = "bad_type"
    STALE = "stale"  # timestamp outside the replay window
    REPLAY = "replay"  # sequence number seen already, or behind the window
    MALFORMED = "malformed"  # body does not parse for its type


class Dropped(Exception):
    """A datagram the decoder refused; ``reason`` says why."""

    def __init__(self, reason: DropReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- bodies


@dataclass(frozen=True)
class Probe:
    """Can you take this demand? Hold it for ``lease_ms`` if so.

    ``releases`` (optional, at most :data:`MAX_PROBE_RELEASES`) names earlier placements of
    this submitter whose offers from the probed node it left unused: the node drops those
    tentative reservations before it arbitrates (a release carried for free by the next probe
    to the same node, instead of a datagram of its own)."""

    placement_id: int
    gpus_centi: int  # GPUs x 100 (50 = half a GPU)
    cpus_milli: int
    memory_mb: int
    lease_ms: int
    gpu_model: str = ""
    pool: str = ""
    releases: tuple[int, ...] = ()


@dataclass(frozen=True)
class Offer:
    """Yes: held until ``lease_ms`` from now; ``gpu_alloc`` is ((index, centi), ...).

    ``frag`` (optional trailing field, sent by a node in the ``frag`` packing mode) is
    ``(delta, gpu_left)``: how much the offer grows the node's fragmentation, in micro-GPUs
    (signed; :func:`laminar.policy.packing.frag_delta` times 1000), and the free milli-GPUs the
    node keeps after it. A packing placement ranks offers by it
    (:func:`laminar.policy.packing.pick_frag_offer`); an offer without it ranks last. Decoders
    that predate the field drop such an offer as malformed (trailing bytes): nodes in the
    ``frag`` mode need submitters of this version.
    """

    placement_id: int
    lease_ms: int
    gpu_alloc: tuple[tuple[int, int], ...] = ()
    frag: tuple[int, int] | None = None


@dataclass(frozen=True)
class Refuse:
    placement_id: int
    reason: int  # laminar.policy.placement.RefuseReason


@dataclass(frozen=True)
class Commit:
    """Bind the offer: turn the reservation committed for ``hold_ms`` (the hand-over window)."""

    placement_id: int
    hold_ms: int


@dataclass(frozen=True)
class CommitAck:
    """``status`` 0: committed, hand the job over on TCP ``port``; else a RefuseReason."""

    placement_id: int
    status: int
    port: int


@dataclass(frozen=True)
class Release:
    placement_id: int


MixEntry = tuple[int, int, int, int]
"""A shared shape mix's entry on the wire: ``(cpu_milli, gpu_milli, num_gpus, share)``, the
share of the mix's weight in 1/65535 (:data:`MIX_SHARE_ONE`)."""


@dataclass(frozen=True)
class Summary:
    """A node's residual capacity (after the reservations it holds).

    ``mix`` (an optional trailing field; a body without it decodes with none): the shape mix a
    ``frag`` node learned from the probes it saw, its heaviest shapes as :data:`MixEntry`, and
    ``mix_weight`` its total weight in hundredths of a probe (> 0 when ``mix`` is given).
    Decoders that predate the field drop such a summary as malformed (trailing bytes)."""

    gpu_free_centi: tuple[int, ...]
    cpus_milli: int
    memory_mb: int
    draining: bool
    gpu_model: str = ""
    pool: str = ""
    mix: tuple[MixEntry, ...] = ()
    mix_weight: int = 0


@dataclass(frozen=True)
class ZoneSummaryMsg:
    """A zone's residual capacity by shape, for submitters in other zones. ``hints[k]`` names
    nodes that had room for shape ``k`` (an optional trailing field: a body without it
    decodes with no hints).

    ``hosts[k]`` (a second optional trailing field, after the hints; a body without it decodes
    with none) groups the nodes that might host a demand of shape ``k``'s class, each group as ``(nodes, cpus_deci,
    memory_64mb)``: its node count and the largest free CPUs (tenths of a core) and free memory
    (64 MB units) among its nodes, rounded up; :data:`HOST_MORE` in a unit field means "at
    least that much" (:func:`laminar.policy.placement.host_buckets`). Decoders that predate the
    field drop such a summary as malformed (trailing bytes), as for ``Offer.frag``.

    ``mix``, ``mix_weight`` (a third optional trailing field, after the host buckets, which are
    then sent with a count of 0 when there are none): the zone's merged shape mix, as in
    :class:`Summary`.
    """

    zone: int
    nodes: int
    slots: tuple[int, ...]
    cpus_milli: int
    memory_mb: int
    gpu_models: tuple[str, ...] = ()
    hints: tuple[tuple[int, ...], ...] = ()
    hosts: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    mix: tuple[MixEntry, ...] = ()
    mix_weight: int = 0


@dataclass(frozen=True)
class ReclaimNotice:
    """The sender's owner takes it back in ``deadline_ms``: stop placing here, move jobs off."""

    notice_id: int
    deadline_ms: int
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat:
    uptime_s: int = 0


@dataclass(frozen=True)
class Handover:
    """TCP only: the job spec (JSON) for a committed placement."""

    placement_id: int
    spec_json: bytes


@dataclass(frozen=True)
class HandoverAck:
    """TCP only: ``status`` 0 and the job id, or a non-zero status and an error message."""

    placement_id: int
    status: int
    text: str = ""


@dataclass(frozen=True)
class LoanRequest:
    """Capacity loaning (``laminar.zone.loan``): ``op`` 1 asks a server for its loan state and
    lent jobs, 2 tells it to return (``payload``: JSON). A repeat (same ``request_id``) gets the
    same answer and is not acted on twice."""

    request_id: int
    op: int
    payload: bytes = b""


@dataclass(frozen=True)
class LoanAnswer:
    """The answer to a :class:`LoanRequest`: ``status`` 0 and a JSON ``payload``, or non-zero
    and an error message (JSON ``{"error": ...}``)."""

    request_id: int
    status: int
    payload: bytes = b""


@dataclass(frozen=True)
class MemberRequest:
    """Multi-node jobs (``laminar.members``): ``op`` 1 REPORT (a member to its job's origin), 2
    ORDER (the origin to a member), 3 VIEW (the origin to a member); ``payload``: JSON. A
    repeat (same ``request_id``) gets the same answer and is not acted on twice."""

    request_id: int
    op: int
    payload: bytes = b""


@dataclass(frozen=True)
class MemberAnswer:
    """The answer to a :class:`MemberRequest`: ``status`` 0 and a JSON ``payload``, or non-zero
    and an error message (JSON ``{"error": ...}``)."""

    request_id: int
    status: int
    payload: bytes = b""


Body = (
    Probe | Offer | Refuse | Commit | CommitAck | Release | Summary | ZoneSummaryMsg | ReclaimNotice | Heartbeat | Handover
    | HandoverAck | LoanRequest | LoanAnswer | MemberRequest | MemberAnswer
)

TYPE_OF: dict[type, MsgType] = {
    Probe: MsgType.PROBE,
    Offer: MsgType.OFFER,
    Refuse: MsgType.REFUSE,
    Commit: MsgType.COMMIT,
    CommitAck: MsgType.COMMIT_ACK,
    Release: MsgType.RELEASE,
    Summary: MsgType.SUMMARY,
    ZoneSummaryMsg: MsgType.ZONE_SUMMARY,
    ReclaimNotice: MsgType.RECLAIM_NOTICE,
    Heartbeat: MsgType.HEARTBEAT,
    Handover: MsgType.HANDOVER,
    HandoverAck: MsgType.HANDOVER_ACK,
    LoanRequest: MsgType.LOAN_REQUEST,
    LoanAnswer: MsgType.LOAN_ANSWER,
    MemberRequest: MsgType.MEMBER_REQUEST,
    MemberAnswer: MsgType.MEMBER_ANSWER,
}


@dataclass(frozen=True)
class Message:
    """A decoded, authenticated datagram."""

    type: MsgType
    flags: int
    zone: int  # key zone
    node: int  # sender
    ts_ms: int
    seq: int
    body: Body


# --------------------------------------------------------------------------- body codecs

_U8 = struct.Struct("!B")
_BB = struct.Struct("!BB")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_PROBE = struct.Struct("!QHIII")
_OFFER = struct.Struct("!QIB")
_OFFER_FRAG = struct.Struct("!iI")  # Offer.frag: delta in micro-GPUs (signed), free milli-GPUs after
_REFUSE = struct.Struct("!QB")
_COMMIT = struct.Struct("!QI")
_COMMIT_ACK = struct.Struct("!QBH")
_SUMMARY = struct.Struct("!IIBB")
_ZONE_SUMMARY = struct.Struct("!HIQQB")
MAX_PROBE_RELEASES = 8  # unused placements a probe may release (its optional trailing field)
MAX_SUMMARY_GPUS = 64  # GPUs a summary may list: a node's most (laminar.policy.placement.MAX_GPUS_PER_NODE)
MAX_HINT_SHAPES = 16  # zone-summary hints: shapes, and nodes named per shape, at most
MAX_HINTS_PER_SHAPE = 32
MAX_HOST_SHAPES = 16  # zone-summary host buckets: shapes, and buckets per shape, at most
MAX_HOST_BUCKETS = 8
_HOST_BUCKET = struct.Struct("!HHH")  # nodes, largest free cpus (tenths), largest free memory (64 MB units)
MAX_MIX_SHAPES = 16  # a shared mix's shapes at most (summary and zone-summary)
MIX_SHARE_ONE = 0xFFFF  # a mix entry's share of the weight: 65535 is all of it
_MIX_HEAD = struct.Struct("!BI")  # shapes, total weight (hundredths of a probe)
_MIX_ENTRY = struct.Struct("!IHBH")  # cpu_milli, gpu_milli, num_gpus, share
HOST_MORE = 0xFFFF  # a host bucket's cpus or memory at (or beyond) the field's top
_RECLAIM = struct.Struct("!QI")
_HANDOVER_ACK = struct.Struct("!QB")
_LOAN = struct.Struct("!QB")


class _Reader:
    """Bounds-checked reads over a body; every failure is :class:`Dropped` MALFORMED."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, s: struct.Struct) -> tuple[int, ...]:
        end = self.pos + s.size
        if end > len(self.buf):
            raise Dropped(DropReason.MALFORMED, "body too short")
        v = s.unpack_from(self.buf, self.pos)
        self.pos = end
        return v

    def raw(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise Dropped(DropReason.MALFORMED, "body too short")
        v = self.buf[self.pos : end]
        self.pos = end
        return v

    def text(self) -> str:
        (n,) = self.take(_U8)
        try:
            return self.raw(n).decode("utf-8")
        except UnicodeDecodeError:
            raise Dropped(DropReason.MALFORMED, "string not utf-8") from None

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise Dropped(DropReason.MALFORMED, f"{len(self.buf) - self.pos} trailing bytes")


def _text(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 255:
        raise ValueError(f"wire: string of {len(b)} bytes, at most 255: {s[:40]!r}")
    return _U8.pack(len(b)) + b


def _mix_bytes(mix: tuple[MixEntry, ...], weight: int) -> bytes:
    """The shared-mix trailer; ValueError for a mix the decoder would refuse."""
    err = _mix_error(mix, weight)
    if err:
        raise ValueError(f"shared mix: {err}")
    return _MIX_HEAD.pack(len(mix), weight) + b"".join(_MIX_ENTRY.pack(*e) for e in mix)


def _mix_error(mix: tuple[MixEntry, ...], weight: int) -> str:
    """Why ``mix`` is not a shared mix the wire carries ('' when it is): 1..16 distinct valid
    shapes (a share of one GPU, whole GPUs, or CPU only), shares summing to at most
    :data:`MIX_SHARE_ONE`, a weight > 0."""
    if not 0 < len(mix) <= MAX_MIX_SHAPES:
        return f"{len(mix)} shapes, must be 1..{MAX_MIX_SHAPES}"
    if not 0 < weight <= 0xFFFFFFFF:
        return f"weight {weight} must be 1..{0xFFFFFFFF}"
    if sum(e[3] for e in mix) > MIX_SHARE_ONE:
        return f"shares sum to {sum(e[3] for e in mix)} > {MIX_SHARE_ONE}"
    if len({e[:3] for e in mix}) != len(mix):
        return "a shape given twice"
    for c, g, n, _ in mix:
        if g > 1000 or (n == 0) != (g == 0) or (n > 1 and g != 1000):
            return f"shape (cpu {c}, gpu_milli {g}, gpus {n}) is not a packing shape"
    return ""


def _read_mix(r: _Reader) -> tuple[tuple[MixEntry, ...], int]:
    k, weight = r.take(_MIX_HEAD)
    if not 0 < k <= MAX_MIX_SHAPES:  # checked before reading k entries
        raise Dropped(DropReason.MALFORMED, f"shared mix of {k} shapes, must be 1..{MAX_MIX_SHAPES}")
    mix = tuple((e[0], e[1], e[2], e[3]) for e in (r.take(_MIX_ENTRY) for _ in range(k)))
    err = _mix_error(mix, weight)
    if err:
        raise Dropped(DropReason.MALFORMED, f"shared mix: {err}")
    return mix, weight


def encode_body(body: Body) -> bytes:
    """The body's bytes. Raises ValueError (or struct.error) for a value out of its field's range."""
    if isinstance(body, Probe):
        return (
            _PROBE.pack(body.placement_id, body.gpus_centi, body.cpus_milli, body.memory_mb, body.lease_ms)
            + _text(body.gpu_model)
            + _text(body.pool)
            + (_probe_releases(body.releases) if body.releases else b"")
        )
    if isinstance(body, Offer):
        out = _OFFER.pack(body.placement_id, body.lease_ms, len(body.gpu_alloc))
        if body.gpu_alloc:
            out += b"".join([_BB.pack(i, c) for i, c in body.gpu_alloc])
        return out + _OFFER_FRAG.pack(*body.frag) if body.frag is not None else out
    if isinstance(body, Refuse):
        return _REFUSE.pack(body.placement_id, body.reason)
    if isinstance(body, Commit):
        return _COMMIT.pack(body.placement_id, body.hold_ms)
    if isinstance(body, CommitAck):
        return _COMMIT_ACK.pack(body.placement_id, body.status, body.port)
    if isinstance(body, Release):
        return _U64.pack(body.placement_id)
    if isinstance(body, Summary):
        if len(body.gpu_free_centi) > MAX_SUMMARY_GPUS:
            raise ValueError(f"summary: {len(body.gpu_free_centi)} GPUs, at most {MAX_SUMMARY_GPUS}")
        return (
            _SUMMARY.pack(body.cpus_milli, body.memory_mb, int(body.draining), len(body.gpu_free_centi))
            + bytes(body.gpu_free_centi)
            + _text(body.gpu_model)
            + _text(body.pool)
            + (_mix_bytes(body.mix, body.mix_weight) if body.mix else b"")
        )
    if isinstance(body, ZoneSummaryMsg):
        out = _ZONE_SUMMARY.pack(body.zone, body.nodes, body.cpus_milli, body.memory_mb, len(body.slots))
        out += b"".join(_U32.pack(min(s, 2**32 - 1)) for s in body.slots)
        out += _U8.pack(len(body.gpu_models)) + b"".join(_text(m) for m in body.gpu_models)
        if body.hints or body.hosts or body.mix:  # later fields follow the hints: a count of 0 when none
            if len(body.hints) > MAX_HINT_SHAPES or any(len(h) > MAX_HINTS_PER_SHAPE for h in body.hints):
                raise ValueError(f"zone-summary hints: at most {MAX_HINT_SHAPES} shapes of {MAX_HINTS_PER_SHAPE} nodes")
            out += _U8.pack(len(body.hints))
            out += b"".join(_U8.pack(len(h)) + b"".join(_U32.pack(n) for n in h) for h in body.hints)
        if body.hosts or body.mix:  # the mix follows the hosts: a count of 0 when there are none
            if len(body.hosts) > MAX_HOST_SHAPES or any(len(b) > MAX_HOST_BUCKETS for b in body.hosts):
                raise ValueError(f"zone-summary hosts: at most {MAX_HOST_SHAPES} shapes of {MAX_HOST_BUCKETS} buckets")
            out += _U8.pack(len(body.hosts))
            out += b"".join(_U8.pack(len(b)) + b"".join(_HOST_BUCKET.pack(*g) for g in b) for b in body.hosts)
        if body.mix:
            out += _mix_bytes(body.mix, body.mix_weight)
        return out
    if isinstance(body, ReclaimNotice):
        return _RECLAIM.pack(body.notice_id, body.deadline_ms) + _text(body.reason)
    if isinstance(body, Heartbeat):
        return _U32.pack(body.uptime_s)
    if isinstance(body, Handover):
        return _U64.pack(body.placement_id) + body.spec_json
    if isinstance(body, HandoverAck):
        return _HANDOVER_ACK.pack(body.placement_id, body.status) + body.text.encode("utf-8")
    if isinstance(body, LoanRequest):
        return _LOAN.pack(body.request_id, body.op) + body.payload
    if isinstance(body, LoanAnswer):
        return _LOAN.pack(body.request_id, body.status) + body.payload
    if isinstance(body, MemberRequest):
        return _LOAN.pack(body.request_id, body.op) + body.payload
    if isinstance(body, MemberAnswer):
        return _LOAN.pack(body.request_id, body.status) + body.payload
    raise TypeError(f"wire: not a message body: {body!r}")


_new = object.__new__


def _probe_releases(pids: tuple[int, ...]) -> bytes:
    if len(pids) > MAX_PROBE_RELEASES:
        raise ValueError(f"probe: {len(pids)} releases, at most {MAX_PROBE_RELEASES}")
    return _U8.pack(len(pids)) + b"".join(_U64.pack(p) for p in pids)


def _decode_probe_fast(buf: bytes) -> Probe | None:
    """A well-formed probe body without :class:`_Reader` (the hot path: thousands a second);
    None for anything else, which the general path then decodes or drops with its reason.
    Accepts exactly what the general path accepts."""
    n = len(buf)
    if n < _PROBE.size + 2:
        return None
    pid, g, c, m, lease = _PROBE.unpack_from(buf, 0)
    e1 = _PROBE.size + 1 + buf[_PROBE.size]
    if g > 6400 or e1 >= n:
        return None
    e2 = e1 + 1 + buf[e1]
    releases: tuple[int, ...] = ()
    if e2 != n:  # the optional releases: a count, then that many placement ids
        if e2 > n or not (0 < buf[e2] <= MAX_PROBE_RELEASES) or e2 + 1 + 8 * buf[e2] != n:
            return None
        releases = struct.unpack_from(f"!{buf[e2]}Q", buf, e2 + 1)
    try:
        model, pool = buf[_PROBE.size + 1 : e1].decode("utf-8"), buf[e1 + 1 : e2].decode("utf-8")
    except UnicodeDecodeError:
        return None
    p = _new(Probe)  # Probe(...) without its frozen-dataclass __init__, as for Message
    p.__dict__.update(placement_id=pid, gpus_centi=g, cpus_milli=c, memory_mb=m, lease_ms=lease, gpu_model=model,
                      pool=pool, releases=releases)
    return p


def decode_body(mtype: MsgType, buf: bytes) -> Body:
    """Parse ``buf`` as a body of ``mtype``; raises :class:`Dropped` MALFORMED on any mismatch."""
    if mtype is MsgType.PROBE:
        p = _decode_probe_fast(buf)
        if p is not None:
            return p
    elif mtype is MsgType.RELEASE and len(buf) == _U64.size:
        return Release(*_U64.unpack_from(buf, 0))
    r = _Reader(buf)
    body: Body
    if mtype is MsgType.PROBE:
        pid, g, c, m, lease = r.take(_PROBE)
        if g > 6400:
            raise Dropped(DropReason.MALFORMED, f"probe gpus_centi {g} > 6400")
        model, pool = r.text(), r.text()
        releases: tuple[int, ...] = ()
        if r.pos < len(buf):  # the optional releases
            (k,) = r.take(_U8)
            if not 0 < k <= MAX_PROBE_RELEASES:
                raise Dropped(DropReason.MALFORMED, f"probe releases {k}, must be 1..{MAX_PROBE_RELEASES}")
            releases = tuple(r.take(_U64)[0] for _ in range(k))
        body = Probe(pid, g, c, m, lease, model, pool, releases)
    elif mtype is MsgType.OFFER:
        pid, lease, n = r.take(_OFFER)
        alloc = []
        for _ in range(n):
            i, c = r.take(_BB)
            if c > 100:
                raise Dropped(DropReason.MALFORMED, f"offer gpu share {c} > 100")
            alloc.append((i, c))
        frag: tuple[int, int] | None = None
        if r.pos < len(buf):  # the optional fragmentation score
            d, left = r.take(_OFFER_FRAG)
            frag = (d, left)
        body = Offer(pid, lease, tuple(alloc), frag)
    elif mtype is MsgType.REFUSE:
        pid, reason = r.take(_REFUSE)
        body = Refuse(pid, reason)
    elif mtype is MsgType.COMMIT:
        body = Commit(*r.take(_COMMIT))
    elif mtype is MsgType.COMMIT_ACK:
        body = CommitAck(*r.take(_COMMIT_ACK))
    elif mtype is MsgType.RELEASE:
        body = Release(*r.take(_U64))
    elif mtype is MsgType.SUMMARY:
        c, m, dr, n = r.take(_SUMMARY)
        if n > MAX_SUMMARY_GPUS:
            raise Dropped(DropReason.MALFORMED, f"summary of {n} GPUs > {MAX_SUMMARY_GPUS}")
        gpus = tuple(r.raw(n))
        if any(g > 100 for g in gpus) or dr > 1:
            raise Dropped(DropReason.MALFORMED, "summary gpu share > 100 or draining not 0/1")
        model, pool = r.text(), r.text()
        smix: tuple[MixEntry, ...] = ()
        sweight = 0
        if r.pos < len(buf):  # the optional shared mix
            smix, sweight = _read_mix(r)
        body = Summary(gpus, c, m, bool(dr), model, pool, smix, sweight)
    elif mtype is MsgType.ZONE_SUMMARY:
        z, nodes, c, m, ns = r.take(_ZONE_SUMMARY)
        slots = tuple(r.take(_U32)[0] for _ in range(ns))
        (nm,) = r.take(_U8)
        models = tuple(r.text() for _ in range(nm))
        hints: list[tuple[int, ...]] = []
        if r.pos < len(buf):  # the optional hints
            (nh,) = r.take(_U8)
            if nh == 0 and r.pos == len(buf):  # written only before later fields: one encoding per body
                raise Dropped(DropReason.MALFORMED, "zone-summary hints for 0 shapes and no host buckets")
            if nh > MAX_HINT_SHAPES:
                raise Dropped(DropReason.MALFORMED, f"zone-summary hints for {nh} shapes > {MAX_HINT_SHAPES}")
            for _ in range(nh):
                (k,) = r.take(_U8)
                if k > MAX_HINTS_PER_SHAPE:
                    raise Dropped(DropReason.MALFORMED, f"zone-summary {k} hints for a shape > {MAX_HINTS_PER_SHAPE}")
                hints.append(tuple(r.take(_U32)[0] for _ in range(k)))
        hosts: list[tuple[tuple[int, int, int], ...]] = []
        if r.pos < len(buf):  # the optional host buckets
            (nh,) = r.take(_U8)
            if nh > MAX_HOST_SHAPES or (nh == 0 and r.pos == len(buf)):  # 0 only before a shared mix
                raise Dropped(DropReason.MALFORMED, f"zone-summary hosts for {nh} shapes, must be 1..{MAX_HOST_SHAPES} "
                              "(0 only when a shared mix follows)")
            for _ in range(nh):
                (k,) = r.take(_U8)
                if k > MAX_HOST_BUCKETS:
                    raise Dropped(DropReason.MALFORMED, f"zone-summary {k} host buckets for a shape > {MAX_HOST_BUCKETS}")
                hosts.append(tuple((g[0], g[1], g[2]) for g in (r.take(_HOST_BUCKET) for _ in range(k))))
        zmix: tuple[MixEntry, ...] = ()
        zweight = 0
        if r.pos < len(buf):  # the optional shared mix
            zmix, zweight = _read_mix(r)
        body = ZoneSummaryMsg(z, nodes, slots, c, m, models, tuple(hints), tuple(hosts), zmix, zweight)
    elif mtype is MsgType.RECLAIM_NOTICE:
        nid, dl = r.take(_RECLAIM)
        body = ReclaimNotice(nid, dl, r.text())
    elif mtype is MsgType.HEARTBEAT:
        body = Heartbeat(*r.take(_U32))
    elif mtype is MsgType.HANDOVER:
        (pid,) = r.take(_U64)
        body = Handover(pid, r.raw(len(buf) - r.pos))
    elif mtype is MsgType.HANDOVER_ACK:
        pid, st = r.take(_HANDOVER_ACK)
        try:
            text = r.raw(len(buf) - r.pos).decode("utf-8")
        except UnicodeDecodeError:
            raise Dropped(DropReason.MALFORMED, "hand-over ack text not utf-8") from None
        body = HandoverAck(pid, st, text)
    elif mtype is MsgType.LOAN_REQUEST:
        rid, op = r.take(_LOAN)
        body = LoanRequest(rid, op, r.raw(len(buf) - r.pos))
    elif mtype is MsgType.LOAN_ANSWER:
        rid, st = r.take(_LOAN)
        body = LoanAnswer(rid, st, r.raw(len(buf) - r.pos))
    elif mtype is MsgType.MEMBER_REQUEST:
        rid, op = r.take(_LOAN)
        body = MemberRequest(rid, op, r.raw(len(buf) - r.pos))
    elif mtype is MsgType.MEMBER_ANSWER:
        rid, st = r.take(_LOAN)
        body = MemberAnswer(rid, st, r.raw(len(buf) - r.pos))
    else:  # pragma: no cover - every MsgType is handled above
        raise Dropped(DropReason.BAD_TYPE, str(mtype))
    r.done()
    return body


# --------------------------------------------------------------------------- envelope


def _mac(key: bytes, data: bytes, to: int = 0) -> bytes:
    """The MAC of ``data`` sent to node ``to``: over ``to`` (u32) and ``data``; ``to`` 0 (no
    receiver named: the simulators and tests, never an agent, whose node ids start at 1) over
    ``data`` alone."""
    if to:
        data = _U32.pack(to) + data
    return hmac.digest(key, data, "sha256")  # one-shot, in C: a third of hmac.new()'s cost


class Encoder:
    """Signs and frames messages for one sending node.

    ``seq0`` starts the sequence; the default, the wall clock in microseconds, keeps it rising
    across agent restarts, so peers' replay windows accept a restarted node at once.

    ``reserve`` (optional) persists a *sequence floor*: it is called with a number at least
    :data:`SEQ_BLOCK` above the next sequence number, now and each time the sequence reaches
    the last number it was given, before any number above is used. So every number this
    encoder ever sent is at or below the last value ``reserve`` stored, and an agent that starts
    from ``max(clock, stored floor)`` stays above its earlier numbers even when the wall clock
    stepped back between its runs (:func:`seq_start`). ``reserve`` must not raise.

    ``pairs`` (this node's :class:`laminar.zone.keys.PairKeys`; None: none) signs what goes to a
    node it covers with their pair key under the zone's current key instead of the zone key.
    """

    def __init__(self, node: int, keys: ZoneKeys, seq0: int | None = None, max_size: int = MAX_DATAGRAM,
                 reserve: Callable[[int], None] | None = None, block: int = SEQ_BLOCK,
                 pairs: PairKeys | None = None) -> None:
        import time

        self.node = node
        self.keys = keys
        self.pairs = pairs
        self.seq = seq0 if seq0 is not None else time.time_ns() // 1000
        self.max_size = max_size
        self._reserve = reserve
        self.block = block
        self.limit = 1 << 64  # the highest sequence number usable without reserving more
        if reserve is not None:
            self.limit = self.seq + block
            reserve(self.limit)

    def encode(self, body: Body, zone: int, now: float, flags: int = 0, max_size: int | None = None,
               to: int = 0) -> bytes:
        """``body`` framed and signed with ``zone``'s key at wall-clock time ``now`` (seconds),
        for node ``to`` (only that node's decoder accepts it; 0: a decoder without a node). With
        ``pairs`` covering ``to``, signed with the pair key of this node and ``to`` under that zone
        key instead (:func:`laminar.zone.keys.pair_key`).

        Raises ValueError when this node holds no key for ``zone`` or the result would exceed
        the size limit (``max_size``, default the encoder's)."""
        key = self.keys.get(zone)
        if key is None:
            raise ValueError(f"wire: no key for zone {zone} ({self.keys.source})")
        payload = encode_body(body)
        mtype = TYPE_OF[type(body)]
        self.seq += 1
        if self.seq > self.limit and self._reserve is not None:  # once per SEQ_BLOCK messages
            self.limit = self.seq + self.block
            self._reserve(self.limit)
        limit = max_size if max_size is not None else self.max_size
        if HEADER_SIZE + len(payload) + MAC_SIZE > limit:
            raise ValueError(f"wire: {mtype.name} message of {HEADER_SIZE + len(payload) + MAC_SIZE} bytes exceeds {limit}")
        # the body length's bits 16-23 go in the reserved byte (0 for every body a datagram or an
        # agent of an older release sends): a hand-over of a job spec near its cap is longer than
        # 16 bits can say
        blen = len(payload)
        data = HEADER.pack(MAGIC, VERSION, mtype, flags, blen >> 16, zone, self.node, int(now * 1000), self.seq,
                           blen & 0xFFFF) + payload
        if to and self.pairs is not None:
            key = self.pairs.signing_key(key, to)
        return data + _mac(key, data, to)


def seq_start(clock_us: int, floor: int | None) -> int:
    """Where a starting encoder's sequence begins: its wall clock in microseconds, or above the
    persisted floor (the highest number an earlier run may have used) when the clock is behind
    it (a restart right after the wall clock stepped back)."""
    return max(clock_us, floor + 1 if floor is not None else 0)


@dataclass
class _SeqWindow:
    top: int = -1
    bits: int = 0  # bit i set: top - i seen


class Decoder:
    """Checks and decodes datagrams for one receiving node; counts drops by reason.

    ``known_nodes`` maps each member's node id to its zone. A datagram is signed with the key
    of the zone it is addressed to (the receiver's zone), so a node accepts only its own zone's
    key (``accept_zones``; default: every key it holds); a submitter that places into other
    zones holds their keys too.

    ``node`` is the receiving node's id: the MAC covers it, so a datagram sent to another
    node (a replay of one captured on its way there) fails the MAC check. 0 (the default, for
    simulators and tests) accepts datagrams encoded for no node (``to`` 0) only.

    A datagram verifies under any key its zone lists (``ZoneKeys.accepted``), the current key
    tried first; :meth:`key_stats` counts which key verified. Assigning ``keys`` (a reload)
    takes effect for the next datagram; the counts of a key that stays listed carry over.

    ``sources`` (node id -> the address its datagrams come from, in the form the caller passes
    as ``src`` to :meth:`decode`; None: no check) binds each sender to its address: the key is
    per zone, so any member could otherwise sign a datagram as any node id of its zone. An
    authenticated datagram whose ``src`` differs from its sender's is dropped
    (``wrong_source``) before its sequence number is taken, so a forgery moves neither the
    claimed sender's replay window nor anything else.

    ``pairs`` (this node's :class:`laminar.zone.keys.PairKeys`; None: none; used only by a
    decoder with a ``node``): a datagram whose claimed sender it covers verifies only under the
    pair key of that sender and this node (under each key the zone lists, as above), never
    under the zone key itself: a member that is not the sender cannot sign as it, whatever
    address it sends from. Senders it does not cover (no pubkey in the roster) are checked with
    the zone keys as before. A wrong pair MAC is ``bad_mac``; the counts of :meth:`key_stats`
    are by zone key, whichever pair key derived from it verified.
    """

    def __init__(
        self,
        keys: ZoneKeys,
        known_nodes: Mapping[int, int],
        *,
        accept_zones: set[int] | None = None,
        window_s: float = REPLAY_WINDOW_S,
        max_size: int = MAX_DATAGRAM,
        node: int = 0,
        remember_by_time: bool = False,
        sources: Mapping[int, object] | None = None,
        pairs: PairKeys | None = None,
    ) -> None:
        self.pairs = pairs if node else None
        self._pair_slots: dict[tuple[int, int], tuple[bytes, ...]] = {}  # (zone, sender) -> its pair keys
        # per key zone: (keys to try, current first; verified counts; last verified at) for the
        # line group that supplies them (ZoneKeys.entry)
        self._slots: dict[int, tuple[tuple[bytes, ...], list[int], list[float]]] = {}
        self._groups: dict[int, tuple[tuple[bytes, ...], list[int], list[float]]] = {}
        self._verified: Counter[tuple[int, str]] = Counter()  # counts of keys no longer listed, by fingerprint
        self._last: dict[tuple[int, str], float] = {}
        self.keys = keys
        self.node = node
        self.known_nodes = known_nodes
        self.sources = sources
        self.accept_zones = accept_zones
        self.window_ms = int(window_s * 1000)
        self.max_size = max_size
        self.drops: Counter[str] = Counter()
        self.accepted = 0
        self._seqs: dict[int, _SeqWindow] = {}
        # remember_by_time (the hand-over decoder): every sequence number taken, per sender, while
        # its timestamp can pass the stale check (not a 256-wide window: one sender's numbers run
        # across its UDP datagrams too, so its hand-over frames are far apart and may arrive out
        # of order by more than SEQ_WINDOW). Exact: a number taken is refused again until its
        # frame is stale. A wall clock stepping back cannot revive a forgotten number: a frame
        # older than the window before the latest "now" this decoder saw is stale too.
        self._by_time = remember_by_time
        self._seen: dict[int, dict[int, int]] = {}  # sender -> seq -> ts_ms
        self._seen_order: deque[tuple[int, int, int]] = deque()  # (ts_ms, sender, seq)
        self._seen_floor: dict[int, int] = {}  # sender -> highest seq forgotten early (SEEN_BY_TIME_MAX)
        self._latest_ms = 0

    def use_pairs(self, pairs: PairKeys | None) -> None:
        """Verify with ``pairs`` from the next datagram on (a reload of the node keys)."""
        self.pairs = pairs if self.node else None
        self._pair_slots = {}

    @property
    def keys(self) -> ZoneKeys:
        return self._keys

    @keys.setter
    def keys(self, keys: ZoneKeys) -> None:
        """Use ``keys`` from the next datagram on; fold the counts of the keys in use so far
        into the totals by fingerprint (a key listed again keeps its count)."""
        for entry, (ks, counts, last) in self._groups.items():
            for k, c, t in zip(ks, counts, last, strict=True):
                self._verified[(entry, fingerprint(k))] += c
                if t:
                    self._last[(entry, fingerprint(k))] = t
        self._groups = {}
        self._slots = {}
        self._pair_slots = {}
        self._keys = keys

    def _slot(self, zone: int) -> tuple[tuple[bytes, ...], list[int], list[float]] | None:
        """The keys to try for ``zone`` and their counters; None when this node takes no key for it."""
        if self.accept_zones is not None and zone not in self.accept_zones:
            return None
        entry = self._keys.entry(zone)
        if entry is None:
            return None
        g = self._groups.get(entry)
        if g is None:
            ks = tuple(k for _, k in self._keys.accepted(zone))
            g = self._groups[entry] = (ks, [0] * len(ks), [0.0] * len(ks))
        self._slots[zone] = g
        return g

    def key_stats(self) -> list[dict[str, object]]:
        """Every key this decoder accepts: ``{zone, role, fingerprint, verified, last_verified}``
        (datagrams it verified since the agent started, across reloads; when it last verified
        one, wall-clock seconds, for keys other than the current one; None: never)."""
        out: list[dict[str, object]] = []
        for d in self._keys.describe():
            entry = ANY_ZONE if d["zone"] == "*" else int(str(d["zone"]))
            fp = str(d["fingerprint"])
            n = self._verified.get((entry, fp), 0)
            last = self._last.get((entry, fp))
            g = self._groups.get(entry)
            if g is not None:
                for k, c, t in zip(*g, strict=True):
                    if fingerprint(k) == fp:
                        n += c
                        last = t or last
            out.append({**d, "verified": n, "last_verified": None if d["role"] == "current" else last})
        return out

    def _drop(self, reason: DropReason, detail: str = "") -> Dropped:
        self.drops[reason.value] += 1
        return Dropped(reason, detail)

    def decode(self, data: bytes, now: float, src: object = None) -> Message:
        """The message in ``data`` received at wall-clock ``now`` (seconds) from ``src`` (the
        sender's address as ``sources`` holds it; None: not checked), or raise
        :class:`Dropped` (and count it). Never raises anything else."""
        try:
            return self._decode(data, now, src)
        except Dropped as e:
            if e.reason is DropReason.MALFORMED:
                self.drops[e.reason.value] += 1
            raise
        except Exception as e:  # a decoder bug must never take the agent down: count and drop
            self.drops[DropReason.MALFORMED.value] += 1
            raise Dropped(DropReason.MALFORMED, f"{type(e).__name__}: {e}") from None

    def precheck(self, header: bytes, size: int, src: object = None) -> None:
        """What :meth:`decode` checks before any MAC work, on a TCP frame's first
        :data:`HEADER_SIZE` bytes and its announced ``size``, so that a frame that will be
        dropped is not read further: raises :class:`Dropped` (counted as decode would) for a
        frame too large, truncated, not ours, whose body length disagrees with ``size``, of a
        zone this node takes no key for, or claiming a sender that is not a member or (with
        ``sources``) not at ``src``. Never raises anything else."""
        try:
            if size > self.max_size:
                raise self._drop(DropReason.TOO_LARGE, f"{size} bytes > {self.max_size}")
            if size < HEADER_SIZE + MAC_SIZE or len(header) < HEADER_SIZE:
                raise self._drop(DropReason.TRUNCATED, f"{size} bytes")
            magic, version, _mtype, _flags, high, zone, node, _ts, _seq, blen = HEADER.unpack_from(header, 0)
            blen |= high << 16
            if magic != MAGIC:
                raise self._drop(DropReason.BAD_MAGIC)
            if version != VERSION:
                raise self._drop(DropReason.BAD_VERSION, f"version {version}, this agent speaks {VERSION}")
            if HEADER_SIZE + blen + MAC_SIZE != size:
                raise self._drop(DropReason.BAD_LENGTH, f"body length {blen}, frame of {size} bytes")
            if (self._slots.get(zone) or self._slot(zone)) is None:
                raise self._drop(DropReason.UNKNOWN_ZONE, f"zone {zone}")
            if node not in self.known_nodes:
                raise self._drop(DropReason.UNKNOWN_NODE, f"node {node}")
            if src is not None and self.sources is not None and self.sources.get(node, src) != src:
                raise self._drop(DropReason.WRONG_SOURCE, f"node {node} from {src}, its address is {self.sources.get(node)}")
        except Dropped:
            raise
        except Exception as e:  # never anything else
            self.drops[DropReason.MALFORMED.value] += 1
            raise Dropped(DropReason.MALFORMED, f"{type(e).__name__}: {e}") from None

    def _decode(self, data: bytes, now: float, src: object = None) -> Message:
        n = len(data)
        if n > self.max_size:
            raise self._drop(DropReason.TOO_LARGE, f"{n} bytes > {self.max_size}")
        if n < HEADER_SIZE + MAC_SIZE:
            raise self._drop(DropReason.TRUNCATED, f"{n} bytes")
        magic, version, mtype, flags, high, zone, node, ts_ms, seq, blen = HEADER.unpack_from(data, 0)
        blen |= high << 16  # (bits 16-23 of the body length: Encoder.encode)
        if magic != MAGIC:
            raise self._drop(DropReason.BAD_MAGIC)
        if version != VERSION:
            raise self._drop(DropReason.BAD_VERSION, f"version {version}, this agent speaks {VERSION}")
        if HEADER_SIZE + blen + MAC_SIZE > n:
            raise self._drop(DropReason.TRUNCATED, f"body length {blen}, {n} bytes received")
        if HEADER_SIZE + blen + MAC_SIZE != n:
            raise self._drop(DropReason.BAD_LENGTH, f"body length {blen}, {n} bytes received")
        slot = self._slots.get(zone) or self._slot(zone)
        if slot is None:
            raise self._drop(DropReason.UNKNOWN_ZONE, f"zone {zone}")
        # the claim, before any MAC work: a datagram from an address that is not its claimed
        # sender's roster address, or naming no member, costs no HMAC (a flood of them from off
        # the roster costs a dict look-up each)
        if node not in self.known_nodes:
            raise self._drop(DropReason.UNKNOWN_NODE, f"node {node}")
        if src is not None and self.sources is not None and self.sources.get(node, src) != src:
            raise self._drop(DropReason.WRONG_SOURCE, f"node {node} from {src}, its address is {self.sources.get(node)}")
        keys, counts, last = slot
        pairs = self.pairs
        if pairs is not None and node in pairs.shared:  # the sender has a node key: its pair key first
            pk = self._pair_slots.get((zone, node))
            if pk is None:  # require: the pair key only; accept, send (a roll-out): the zone key too, after it
                pk = self._pair_slots[(zone, node)] = pairs.accepted(keys, node)
            keys = pk
        signed = data[: HEADER_SIZE + blen]
        mac = data[HEADER_SIZE + blen :]
        if hmac.compare_digest(_mac(keys[0], signed, self.node), mac):
            counts[0] += 1
        else:  # a rotation: a peer may sign with the zone's next or previous key
            n = len(counts)  # counted by zone key, whichever of its pair key or itself verified
            for i in range(1, len(keys)):
                if hmac.compare_digest(_mac(keys[i], signed, self.node), mac):
                    counts[i % n] += 1
                    if i % n:
                        last[i % n] = now
                    break
            else:
                raise self._drop(DropReason.BAD_MAC)
        mt = _MSG_TYPES.get(mtype)
        if mt is None:
            raise self._drop(DropReason.BAD_TYPE, f"type {mtype}")
        now_ms = int(now * 1000)
        if abs(now_ms - ts_ms) > self.window_ms:
            raise self._drop(DropReason.STALE, f"timestamp {ts_ms - now_ms:+d} ms off")
        if self._by_time:
            self._check_seen(node, seq, ts_ms, now_ms)
            body = decode_body(mt, data[HEADER_SIZE : HEADER_SIZE + blen])
            self._remember(node, seq, ts_ms)
        else:
            w = self._seqs.get(node)
            if w is not None and (seq <= w.top - SEQ_WINDOW or (seq <= w.top and (w.bits >> (w.top - seq)) & 1)):
                raise self._drop(DropReason.REPLAY, f"node {node} seq {seq}")
            body = decode_body(mt, data[HEADER_SIZE : HEADER_SIZE + blen])
            self._accept_seq(node, seq)
        self.accepted += 1
        # Message(...) without its frozen-dataclass __init__ (seven object.__setattr__ calls):
        # the same object, 0.6 us less on every datagram
        m = _new(Message)
        m.__dict__.update(type=mt, flags=flags, zone=zone, node=node, ts_ms=ts_ms, seq=seq, body=body)
        return m

    def _check_seen(self, node: int, seq: int, ts_ms: int, now_ms: int) -> None:
        """remember_by_time: raises Dropped (stale, replay) for a frame taken already, or one
        whose number may have been forgotten; forgets what can no longer pass the stale check."""
        self._latest_ms = max(self._latest_ms, now_ms)
        oldest_ms = self._latest_ms - self.window_ms
        if ts_ms < oldest_ms:
            raise self._drop(DropReason.STALE, f"timestamp {ts_ms - self._latest_ms:+d} ms off the latest time seen")
        order = self._seen_order
        while order and order[0][0] < oldest_ms:
            t, n, q = order.popleft()
            seen = self._seen.get(n)
            if seen is not None and seen.get(q) == t:
                del seen[q]
                if not seen:
                    del self._seen[n]
        seen = self._seen.get(node)
        if (seen is not None and seq in seen) or seq <= self._seen_floor.get(node, -1):
            raise self._drop(DropReason.REPLAY, f"node {node} seq {seq}")

    def _remember(self, node: int, seq: int, ts_ms: int) -> None:
        self._seen.setdefault(node, {})[seq] = ts_ms
        self._seen_order.append((ts_ms, node, seq))
        while len(self._seen_order) > SEEN_BY_TIME_MAX:
            t, n, q = self._seen_order.popleft()
            seen = self._seen.get(n)
            if seen is not None and seen.get(q) == t:
                del seen[q]
                if not seen:
                    del self._seen[n]
            self._seen_floor[n] = max(self._seen_floor.get(n, -1), q)

    def _accept_seq(self, node: int, seq: int) -> None:
        w = self._seqs.get(node)
        if w is None:
            self._seqs[node] = _SeqWindow(seq, 1)
        elif seq > w.top:
            shift = seq - w.top
            w.bits = ((w.bits << shift) | 1) & ((1 << SEQ_WINDOW) - 1) if shift < SEQ_WINDOW else 1
            w.top = seq
        else:
            w.bits |= 1 << (w.top - seq)

    def stats(self) -> dict[str, int]:
        """Drop counters by reason (every reason present, zeros included) and ``accepted``."""
        out = {r.value: self.drops.get(r.value, 0) for r in DropReason}
        out["accepted"] = self.accepted
        return out


def frame(data: bytes) -> bytes:
    """A TCP frame: ``data`` (one signed envelope) behind its 4-byte big-endian length."""
    return _U32.pack(len(data)) + data


def frame_length(prefix: bytes) -> int:
    """The length a 4-byte TCP frame prefix announces."""
    return int(_U32.unpack(prefix)[0])
