"""Flow keys of both families without root: parsing, canonical addresses, packing, the sender's Flow.

A flow is named ``tcp:10.0.0.1:40000->10.0.0.2:7000`` or ``tcp:[fd00::1]:40000->[fd00::2]:7000``;
one flow is one key whatever way its addresses are written, and it packs to the lm_flow_key bytes
netguard builds from the packet (map ABI 2: IPv4 v4-mapped).
"""

from __future__ import annotations

import pytest

from laminar.bpf import abi
from laminar.migrate.transfer import Flow
from laminar.net import killswitch as ks


def test_an_ipv6_flow_parses_prints_and_packs() -> None:
    k = ks.FlowKey.parse("tcp:[fd00:4c4d:0::1]:40000->[FD00:4C4D::2]:7000")
    assert (k.saddr, k.daddr, k.ipv6) == ("fd00:4c4d::1", "fd00:4c4d::2", True)
    assert str(k) == "tcp:[fd00:4c4d::1]:40000->[fd00:4c4d::2]:7000"
    raw = k.pack()
    assert len(raw) == 40 and raw[:16] == bytes.fromhex("fd004c4d000000000000000000000001")
    assert raw[32:34] == (40000).to_bytes(2, "big") and raw[36] == 6
    assert ks.FlowKey.unpack(raw) == k


def test_an_ipv4_flow_is_keyed_v4_mapped_and_written_as_before() -> None:
    k = ks.FlowKey.parse("udp:10.0.0.1:1->10.0.0.2:2")
    assert str(k) == "udp:10.0.0.1:1->10.0.0.2:2" and not k.ipv6
    assert k.pack()[:16] == bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    assert ks.FlowKey.unpack(k.pack()) == k
    # a dual-stack socket's name for the same IPv4 flow is the same key
    assert ks.FlowKey("udp", "::ffff:10.0.0.1", 1, "::ffff:10.0.0.2", 2) == k


def test_bad_flows_are_refused_by_name() -> None:
    with pytest.raises(ks.KillSwitchError, match="different families"):
        ks.FlowKey("tcp", "10.0.0.1", 1, "fd00::1", 2)
    with pytest.raises(ks.KillSwitchError, match=r"tcp:\[fd00::zz\]"):
        ks.FlowKey.parse("tcp:[fd00::zz]:1->[fd00::1]:2")
    with pytest.raises(ks.KillSwitchError, match=r"tcp:\[fd00::1\]"):
        ks.FlowKey.parse("tcp:fd00::1:1->fd00::2:2")  # IPv6 needs its brackets


def test_the_senders_flow_is_what_the_packets_carry() -> None:
    f = Flow.of_socket(("fe80::1%lmt0", 40000, 0, 3), ("fe80::2%lmt0", 7480, 0, 3))
    assert (f.saddr, f.daddr) == ("fe80::1", "fe80::2")
    f4 = Flow.of_socket(("::ffff:10.0.0.1", 40000, 0, 0), ("::ffff:10.0.0.2", 7480, 0, 0))
    assert (f4.saddr, f4.daddr) == ("10.0.0.1", "10.0.0.2")
    assert ks.FlowKey("tcp", f4.saddr, f4.sport, f4.daddr, f4.dport).pack() == \
        bytes(abi.flow_key("10.0.0.1", "10.0.0.2", 40000, 7480, "tcp"))
    with pytest.raises(ValueError, match="'nohost'"):
        Flow("nohost", 1, "10.0.0.1", 2)
