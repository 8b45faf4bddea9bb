"""The map ABI of ``bpf/laminar.h`` in Python: ctypes mirrors of every struct and constant.

``tests/kernel/test_abi.py`` checks each mirror's size and field offsets against the BTF of
the compiled objects, so C and Python cannot drift apart. Bump :data:`LM_ABI_VERSION` together
with the header.

Build a value, write it, read it back::

    from laminar.bpf import abi
    job = abi.LmJob(job_id=7, flags=abi.LM_JOB_KILL)
    jobs_map.update(abi.u64(cgroup_id), bytes(job))
    abi.decode("lm_jobs", abi.u64(cgroup_id), jobs_map.lookup(abi.u64(cgroup_id)))
    # -> ({'cgroup_id': 1234}, {'job_id': 7, 'flags': ['kill'], 'kill_at_ns': 0})

Flow keys hold addresses and ports in network byte order, as in the packet; addresses are
16 bytes, IPv6 or IPv4 v4-mapped (``::ffff:10.0.0.1``). :func:`flow_key` builds one from
address text (``10.0.0.1`` or ``fd00::1``) and host-order ports, and :func:`decode` shows them
the same way (an IPv4 address as its dotted quad).
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from typing import Any

__all__ = [
    "ctypes",
    "LmJob",
    "LmCounters",
    "LmGlobal",
    "LmFlowKey",
    "LmFlow",
    "LmFragKey",
    "LmPressureEvent",
    "MAP_SCHEMAS",
    "STRUCTS",
    "decode",
    "flow_key",
]

LM_ABI_VERSION = 2  # 2: lm_flow_key holds IPv6 (IPv4 v4-mapped); 1: IPv4 only

LM_MAX_JOBS = 4096
LM_MAX_FLOWS = 1024
LM_MAX_FRAGS = 1024
LM_RINGBUF_BYTES = 256 * 1024

LM_JOB_KILL = 1 << 0
LM_JOB_LENT = 1 << 1
LM_JOB_ARMED = 1 << 2

LM_GLOBAL_KILL_JOBS = 1 << 0
LM_GLOBAL_KILL_LENT = 1 << 1
LM_GLOBAL_ARMED = 1 << 2

LM_FLOW_KILL = 1 << 0
LM_FLOW_ARMED = 1 << 1

LM_EV_DIRECT_RECLAIM_BEGIN = 1
LM_EV_DIRECT_RECLAIM_END = 2
LM_EV_MEMCG_RECLAIM_BEGIN = 3
LM_EV_MEMCG_RECLAIM_END = 4
LM_EV_OOM_VICTIM = 5

LM_STAT_PASS = 0
LM_STAT_DROP_JOB = 1
LM_STAT_DROP_GLOBAL = 2
LM_STAT_DROP_FLOW = 3
LM_STAT_SHAPED = 4
LM_STAT_EV_LOST = 5
LM_STAT_DROP_EXTHDR = 6
LM_STAT_DROP_FRAG = 7
LM_STAT_MAX = 8

# Every constant of laminar.h by its C name (tests compare them with the header).
CONSTANTS: dict[str, int] = {k: v for k, v in dict(globals()).items() if k.startswith("LM_") and isinstance(v, int)}

JOB_FLAGS = {LM_JOB_KILL: "kill", LM_JOB_LENT: "lent", LM_JOB_ARMED: "armed"}
GLOBAL_FLAGS = {LM_GLOBAL_KILL_JOBS: "kill_jobs", LM_GLOBAL_KILL_LENT: "kill_lent", LM_GLOBAL_ARMED: "armed"}
FLOW_FLAGS = {LM_FLOW_KILL: "kill", LM_FLOW_ARMED: "armed"}
EVENT_NAMES = {
    LM_EV_DIRECT_RECLAIM_BEGIN: "direct_reclaim_begin",
    LM_EV_DIRECT_RECLAIM_END: "direct_reclaim_end",
    LM_EV_MEMCG_RECLAIM_BEGIN: "memcg_reclaim_begin",
    LM_EV_MEMCG_RECLAIM_END: "memcg_reclaim_end",
    LM_EV_OOM_VICTIM: "oom_victim",
}
# lm_stats slot name -> index
STAT_SLOTS = {
    "pass": LM_STAT_PASS,
    "drop_job": LM_STAT_DROP_JOB,
    "drop_global": LM_STAT_DROP_GLOBAL,
    "drop_flow": LM_STAT_DROP_FLOW,
    "shaped": LM_STAT_SHAPED,
    "ev_lost": LM_STAT_EV_LOST,
    "drop_exthdr": LM_STAT_DROP_EXTHDR,
    "drop_frag": LM_STAT_DROP_FRAG,
}

# Maps of each object (names are the pins under the pin root).
NETGUARD_MAPS = ("lm_jobs", "lm_job_stats", "lm_global", "lm_flows", "lm_frags", "lm_stats")
PRESSURE_MAPS = ("lm_events", "lm_stats")


class LmJob(ctypes.Structure):
    """struct lm_job: the value of lm_jobs (key: u64 cgroup2 id)."""

    _fields_ = [("job_id", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("kill_at_ns", ctypes.c_uint64)]


class LmCounters(ctypes.Structure):
    """struct lm_counters: the value of lm_job_stats (key: u64 cgroup2 id)."""

    _fields_ = [
        ("tx_packets", ctypes.c_uint64),
        ("tx_bytes", ctypes.c_uint64),
        ("rx_packets", ctypes.c_uint64),
        ("rx_bytes", ctypes.c_uint64),
        ("drop_packets", ctypes.c_uint64),
        ("drop_bytes", ctypes.c_uint64),
    ]


class LmGlobal(ctypes.Structure):
    """struct lm_global: the one entry (key u32 0) of lm_global."""

    _fields_ = [("flags", ctypes.c_uint32), ("abi_version", ctypes.c_uint32), ("kill_at_ns", ctypes.c_uint64)]


class LmFlowKey(ctypes.Structure):
    """struct lm_flow_key: egress 5-tuple, addresses (IPv6, or IPv4 v4-mapped) and ports in network
    byte order."""

    _fields_ = [
        ("saddr", ctypes.c_uint32 * 4),
        ("daddr", ctypes.c_uint32 * 4),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 3),
    ]


class LmFlow(ctypes.Structure):
    """struct lm_flow: the value of lm_flows."""

    _fields_ = [
        ("job_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("priority", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("kill_at_ns", ctypes.c_uint64),
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


class LmFragKey(ctypes.Structure):
    """struct lm_frag_key: a fragmented datagram whose first fragment netguard dropped (the key
    of lm_frags, value u64 ns of the drop); addresses as in the packet, id host order."""

    _fields_ = [
        ("saddr", ctypes.c_uint32 * 4),
        ("daddr", ctypes.c_uint32 * 4),
        ("id", ctypes.c_uint32),
        ("proto", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 3),
    ]


class LmPressureEvent(ctypes.Structure):
    """struct lm_pressure_event: one record of the lm_events ring buffer."""

    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("cgroup_id", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("type", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("comm", ctypes.c_char * 16),
    ]


# C struct name -> mirror (every struct of laminar.h).
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "lm_job": LmJob,
    "lm_counters": LmCounters,
    "lm_global": LmGlobal,
    "lm_flow_key": LmFlowKey,
    "lm_flow": LmFlow,
    "lm_frag_key": LmFragKey,
    "lm_pressure_event": LmPressureEvent,
}

KeyValueType = type[ctypes.Structure] | type[ctypes._SimpleCData]

# map name -> (key type, value type); lm_events is a ring buffer of LmPressureEvent records.
MAP_SCHEMAS: dict[str, tuple[KeyValueType | None, KeyValueType]] = {
    "lm_jobs": (ctypes.c_uint64, LmJob),
    "lm_job_stats": (ctypes.c_uint64, LmCounters),
    "lm_global": (ctypes.c_uint32, LmGlobal),
    "lm_flows": (LmFlowKey, LmFlow),
    "lm_frags": (LmFragKey, ctypes.c_uint64),
    "lm_stats": (ctypes.c_uint32, ctypes.c_uint64),
    "lm_events": (None, LmPressureEvent),
}


def u32(v: int) -> bytes:
    """`v` as a host-order u32 map key."""
    return struct.pack("=I", v)


def u64(v: int) -> bytes:
    """`v` as a host-order u64 map key (a cgroup id)."""
    return struct.pack("=Q", v)


def _flag_names(flags: int, names: dict[int, str]) -> list[str]:
    out = [n for bit, n in names.items() if flags & bit]
    rest = flags & ~sum(names)
    if rest:
        out.append(hex(rest))
    return out


def job_flag_names(flags: int) -> list[str]:
    return _flag_names(flags, JOB_FLAGS)


def global_flag_names(flags: int) -> list[str]:
    return _flag_names(flags, GLOBAL_FLAGS)


def flow_flag_names(flags: int) -> list[str]:
    return _flag_names(flags, FLOW_FLAGS)


def ip_str(addr_be: int) -> str:
    """A u32 read from a network-order field (host-order int of its bytes) as a dotted quad."""
    return socket.inet_ntoa(struct.pack("=I", addr_be))


def ip_be(addr: str) -> int:
    """A dotted quad as the u32 whose in-memory bytes are network order (what the packet has)."""
    try:
        return int(struct.unpack("=I", socket.inet_aton(addr))[0])
    except OSError:
        raise ValueError(f"flow address {addr!r} is not an IPv4 dotted quad like 10.0.0.1") from None


V4_MAPPED = bytes(10) + b"\xff\xff"  # the first 12 bytes of ::ffff:a.b.c.d


def addr16(addr: str) -> bytes:
    """An IPv4 or IPv6 address as the 16 bytes of an lm_flow_key address: IPv6 as is, IPv4
    v4-mapped (``::ffff:a.b.c.d``). A zone (``fe80::1%eth0``) is dropped: the packet has none."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        raise ValueError(f"flow address {addr!r} is not an IPv4 address like 10.0.0.1 or an IPv6 address "
                         "like fd00::1") from None
    return V4_MAPPED + ip.packed if ip.version == 4 else ip.packed


def addr_str(raw: bytes) -> str:
    """16 lm_flow_key address bytes as text: a v4-mapped address as its dotted quad."""
    if raw[:12] == V4_MAPPED:
        return socket.inet_ntoa(raw[12:16])
    return str(ipaddress.IPv6Address(raw))


def port_be(port: int) -> int:
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"flow port {port} out of range 0..65535")
    return socket.htons(port)


PROTOS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}


def flow_key(saddr: str, daddr: str, sport: int, dport: int, proto: str | int) -> LmFlowKey:
    """The lm_flows key of a flow as it leaves this node (local -> remote); addresses IPv4 or
    IPv6 text (both of one family), ports host order."""
    p = PROTOS.get(proto, None) if isinstance(proto, str) else proto
    if p not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
        raise ValueError(f"flow protocol {proto!r} must be 'tcp' or 'udp'")
    s, d = addr16(saddr), addr16(daddr)
    if (s[:12] == V4_MAPPED) != (d[:12] == V4_MAPPED):
        raise ValueError(f"flow addresses {saddr!r} and {daddr!r} are of different families: both IPv4 or both IPv6")
    raw = s + d + struct.pack("=HHB3x", port_be(sport), port_be(dport), p)
    return LmFlowKey.from_buffer_copy(raw)


def upgrade_v1_entry(map_name: str, key: bytes, value: bytes) -> tuple[bytes, bytes]:
    """An entry of a map written under map ABI 1 as it is under ABI 2: an lm_flows key (IPv4
    only: saddr, daddr, sport, dport, proto, 3 pad bytes: 16 bytes) becomes v4-mapped; the other
    maps' layouts did not change."""
    if map_name == "lm_flows" and len(key) == 16:
        return bytes(V4_MAPPED + key[0:4] + V4_MAPPED + key[4:8] + key[8:13] + bytes(3)), value
    return key, value


# Map ABI versions the agent converts the entries of (old version -> converter): pins of these
# are carried over into this ABI's maps, converted; pins of any other version are replaced empty.
UPGRADES = {1: upgrade_v1_entry}


_PROTO_NAMES = {v: k for k, v in PROTOS.items()}


def _struct_dict(obj: ctypes.Structure) -> dict[str, Any]:
    return {f[0]: getattr(obj, f[0]) for f in obj._fields_ if not f[0].startswith("_")}


def _decode_part(map_name: str, role: str, kind: KeyValueType | None, raw: bytes) -> dict[str, Any]:
    if kind is None:
        raise ValueError(f"map {map_name} has no keys (it is a ring buffer)")
    size = ctypes.sizeof(kind)
    if len(raw) != size:
        raise ValueError(f"{map_name} {role} is {len(raw)} bytes, expected {size} ({kind.__name__})")
    obj = kind.from_buffer_copy(raw)
    if isinstance(obj, ctypes._SimpleCData):
        v = int(obj.value)
        if map_name in ("lm_jobs", "lm_job_stats"):
            return {"cgroup_id": v}
        if map_name == "lm_stats" and role == "key":
            names = {i: n for n, i in STAT_SLOTS.items()}
            return {"slot": names.get(v, str(v)), "index": v}
        if map_name == "lm_frags":
            return {"dropped_at_ns": v}
        return {"index": v} if role == "key" else {"value": v}
    d = _struct_dict(obj)
    if isinstance(obj, LmJob):
        d["flags"] = job_flag_names(obj.flags)
    elif isinstance(obj, LmGlobal):
        d["flags"] = global_flag_names(obj.flags)
    elif isinstance(obj, LmFlow):
        d["flags"] = flow_flag_names(obj.flags)
        d["priority"] = f"{obj.priority >> 16:x}:{obj.priority & 0xFFFF:x}" if obj.priority else 0
    elif isinstance(obj, LmFragKey):
        d = {"saddr": addr_str(bytes(obj.saddr)), "daddr": addr_str(bytes(obj.daddr)), "id": obj.id,
             "proto": _PROTO_NAMES.get(obj.proto, obj.proto)}
    elif isinstance(obj, LmFlowKey):
        d = {
            "saddr": addr_str(bytes(obj.saddr)),
            "daddr": addr_str(bytes(obj.daddr)),
            "sport": socket.ntohs(obj.sport),
            "dport": socket.ntohs(obj.dport),
            "proto": _PROTO_NAMES.get(obj.proto, obj.proto),
        }
    elif isinstance(obj, LmPressureEvent):
        d["type"] = EVENT_NAMES.get(obj.type, obj.type)
        d["comm"] = obj.comm.decode("utf-8", "replace")
    return d


def decode(map_name: str, key: bytes, value: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(key, value) of map `map_name` as dicts of named fields, for ``laminarctl bpf dump``.

    Flags become lists of names, flow addresses dotted strings, ports host order, an HTB
    priority ``major:minor`` (hex, as tc writes it). Raises ValueError for an unknown map or
    bytes of the wrong size. For lm_stats pass one CPU's value or the sum packed as u64.
    """
    if map_name not in MAP_SCHEMAS:
        raise ValueError(f"unknown map {map_name!r}; known maps: {', '.join(sorted(MAP_SCHEMAS))}")
    kt, vt = MAP_SCHEMAS[map_name]
    return _decode_part(map_name, "key", kt, key), _decode_part(map_name, "value", vt, value)


def decode_event(record: bytes) -> dict[str, Any]:
    """One lm_events record as a dict (type name, cgroup_id, pid, comm, value, ts_ns)."""
    size = ctypes.sizeof(LmPressureEvent)
    if len(record) < size:
        raise ValueError(f"lm_events record is {len(record)} bytes, expected at least {size}")
    return _decode_part("lm_events", "value", LmPressureEvent, record[:size])
