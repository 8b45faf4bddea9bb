"""laminar.bpf.abi without root: constants equal bpf/laminar.h, decode round-trips every map."""

from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from laminar.bpf import abi

HEADER = Path(__file__).resolve().parents[2] / "bpf/laminar.h"


def header_constants() -> dict[str, int]:
    out: dict[str, int] = {}
    for m in re.finditer(r"^#define\s+(LM_\w+)\s+(.+?)\s*(?:/\*.*)?$", HEADER.read_text(), re.M):
        expr = re.sub(r"(\d+)U\b", r"\1", m.group(2))
        if not re.fullmatch(r"[\d\s()<*+]+", expr):
            raise AssertionError(f"cannot evaluate {m.group(1)} = {m.group(2)!r}")
        out[m.group(1)] = int(eval(expr))  # digits, spaces, parens, <<, *, + only (checked above)
    return out


def test_constants_match_header() -> None:
    assert abi.CONSTANTS == header_constants()


def test_every_header_struct_is_mirrored() -> None:
    structs = set(re.findall(r"^struct (lm_\w+) \{", HEADER.read_text(), re.M))
    assert structs == set(abi.STRUCTS)


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@given(cg=u64, job_id=u32, flags=st.integers(0, 7), kill_at=u64)
def test_jobs_round_trip(cg: int, job_id: int, flags: int, kill_at: int) -> None:
    job = abi.LmJob(job_id=job_id, flags=flags, kill_at_ns=kill_at)
    key, value = abi.decode("lm_jobs", abi.u64(cg), bytes(job))
    assert key == {"cgroup_id": cg}
    assert value["job_id"] == job_id and value["kill_at_ns"] == kill_at
    names = {"kill": abi.LM_JOB_KILL, "lent": abi.LM_JOB_LENT, "armed": abi.LM_JOB_ARMED}
    assert sum(names[n] for n in value["flags"]) == flags


@given(cg=u64, vals=st.lists(u64, min_size=6, max_size=6))
def test_job_stats_round_trip(cg: int, vals: list[int]) -> None:
    c = abi.LmCounters(*vals)
    key, value = abi.decode("lm_job_stats", abi.u64(cg), bytes(c))
    assert key == {"cgroup_id": cg}
    assert list(value.values()) == vals
    assert abi.LmCounters.from_buffer_copy(bytes(c)).drop_bytes == vals[5]


@given(
    v=st.sampled_from([4, 6]),
    data=st.data(),
    sport=st.integers(0, 65535),
    dport=st.integers(0, 65535),
    proto=st.sampled_from(["tcp", "udp"]),
    prio=u32,
)
def test_flows_round_trip(v: int, data, sport: int, dport: int, proto: str, prio: int) -> None:  # type: ignore[no-untyped-def]
    a, b = data.draw(st.ip_addresses(v=v)), data.draw(st.ip_addresses(v=v))
    if v == 6:  # an IPv4-mapped IPv6 address is the IPv4 flow's key: shown as IPv4
        a, b = (x.ipv4_mapped or x for x in (a, b))
        # one mapped, one not: a flow of two families, which flow_key refuses (tested apart)
        assume(a.version == b.version)
    k = abi.flow_key(str(a), str(b), sport, dport, proto)
    # network byte order in memory, as in the packet; IPv4 v4-mapped in the 16 address bytes
    raw = bytes(k)
    assert len(raw) == 40
    want = (b"\0" * 10 + b"\xff\xff" + a.packed) if a.version == 4 else a.packed
    assert raw[:16] == want and raw[32:34] == sport.to_bytes(2, "big")
    f = abi.LmFlow(job_id=3, flags=abi.LM_FLOW_ARMED, priority=prio, kill_at_ns=9, packets=1, bytes=2)
    key, value = abi.decode("lm_flows", raw, bytes(f))
    assert key == {"saddr": str(a), "daddr": str(b), "sport": sport, "dport": dport, "proto": proto}
    assert value["flags"] == ["armed"] and value["packets"] == 1 and value["bytes"] == 2
    if prio:
        major, minor = value["priority"].split(":")
        assert (int(major, 16) << 16) | int(minor, 16) == prio


def test_a_v1_flow_key_is_upgraded_to_its_v4_mapped_key() -> None:
    """Map ABI 1 keyed lm_flows by IPv4 (16 bytes); the upgrade gives the key ABI 2 uses for it."""
    v1 = bytes([10, 0, 0, 1, 10, 0, 0, 2]) + (40000).to_bytes(2, "big") + (7000).to_bytes(2, "big") + bytes([6, 0, 0, 0])
    key, value = abi.UPGRADES[1]("lm_flows", v1, b"v")
    assert key == bytes(abi.flow_key("10.0.0.1", "10.0.0.2", 40000, 7000, "tcp")) and value == b"v"
    assert abi.UPGRADES[1]("lm_jobs", abi.u64(5), b"j") == (abi.u64(5), b"j")
    assert abi.LM_ABI_VERSION == 2


def test_global_and_stats() -> None:
    g = abi.LmGlobal(flags=abi.LM_GLOBAL_KILL_LENT | abi.LM_GLOBAL_ARMED, abi_version=abi.LM_ABI_VERSION)
    key, value = abi.decode("lm_global", abi.u32(0), bytes(g))
    assert key == {"index": 0}
    assert value == {"flags": ["kill_lent", "armed"], "abi_version": abi.LM_ABI_VERSION, "kill_at_ns": 0}
    key, value = abi.decode("lm_stats", abi.u32(abi.LM_STAT_DROP_FLOW), abi.u64(42))
    assert key == {"slot": "drop_flow", "index": abi.LM_STAT_DROP_FLOW} and value == {"value": 42}


def test_unknown_flag_bits_are_shown() -> None:
    assert abi.job_flag_names(abi.LM_JOB_KILL | 0x100) == ["kill", "0x100"]


def test_event_decode() -> None:
    ev = abi.LmPressureEvent(ts_ns=5, cgroup_id=77, value=3, type=abi.LM_EV_OOM_VICTIM, pid=42, comm=b"python3")
    d = abi.decode_event(bytes(ev) + b"\0" * 8)  # ring buffer records may be padded
    assert d == {"ts_ns": 5, "cgroup_id": 77, "value": 3, "type": "oom_victim", "pid": 42, "comm": "python3"}


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="unknown map 'lm_nope'"):
        abi.decode("lm_nope", b"", b"")
    with pytest.raises(ValueError, match="lm_jobs key is 4 bytes, expected 8"):
        abi.decode("lm_jobs", abi.u32(1), bytes(abi.LmJob()))
    with pytest.raises(ValueError, match="'10.0.0.300'"):
        abi.flow_key("10.0.0.300", "10.0.0.1", 1, 2, "tcp")
    with pytest.raises(ValueError, match="'icmp'"):
        abi.flow_key("10.0.0.3", "10.0.0.1", 1, 2, "icmp")
    with pytest.raises(ValueError, match="70000"):
        abi.flow_key("10.0.0.3", "10.0.0.1", 70000, 2, "udp")
    with pytest.raises(ValueError, match="different families"):
        abi.flow_key("10.0.0.3", "fd00::1", 1, 2, "udp")
    with pytest.raises(ValueError, match="'fd00::g'"):
        abi.flow_key("fd00::g", "fd00::1", 1, 2, "udp")
    assert ctypes.sizeof(abi.LmFlowKey) == 40


def test_frags_decode() -> None:
    """lm_frags: the datagram's addresses as text, its id, the protocol's name; the drop's time."""
    raw = abi.addr16("10.77.9.1") + abi.addr16("fd00::2") + struct.pack("=IB3x", 0x12345, 17)
    key, value = abi.decode("lm_frags", raw, abi.u64(77))
    assert key == {"saddr": "10.77.9.1", "daddr": "fd00::2", "id": 0x12345, "proto": "udp"}
    assert value == {"dropped_at_ns": 77}
