"""laminar.net.rtnl's message codec: attributes round trip, and a malformed or truncated reply
is refused with an error saying what was wrong (never half a dump). The replies here come
through a real socket (a UNIX datagram pair standing in for the kernel's end), no root needed."""

from __future__ import annotations

import errno
import socket
import struct

import pytest

from laminar.net import rtnl

HDR = struct.Struct("=IHHII")


def msg(kind: int, seq: int, payload: bytes, flags: int = 0, length: int | None = None) -> bytes:
    n = HDR.size + len(payload) if length is None else length
    return HDR.pack(n, kind, flags, seq, 0) + payload


def tcmsg(ifindex: int, handle: int, parent: int, info: int = 0) -> bytes:
    return struct.pack("=BxxxiIII", 0, ifindex, handle, parent, info)


@pytest.fixture
def fake() -> tuple[rtnl.Rtnl, socket.socket]:  # type: ignore[misc]
    """An Rtnl whose socket's other end is the test: the test writes the 'kernel's' replies."""
    nl = rtnl.Rtnl()
    nl.sock.close()
    nl.sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    yield nl, peer
    nl.close()
    peer.close()


def test_attributes_round_trip_with_padding_and_nesting() -> None:
    data = (rtnl.attr_str(1, "bpf") + rtnl.attr_u32(6, 7) + rtnl.attr_u64(7, 1 << 40)
            + rtnl.attr_nest(2, [rtnl.attr_str(7, "lm_egress"), rtnl.attr_u32(8, 1)]))
    assert len(data) % 4 == 0
    attrs = rtnl.parse_attrs(data)
    assert rtnl.string(attrs[1]) == "bpf" and rtnl.u32(attrs[6]) == 7 and rtnl.u64(attrs[7]) == 1 << 40
    inner = rtnl.parse_attrs(attrs[2])
    assert rtnl.string(inner[7]) == "lm_egress" and rtnl.u32(inner[8]) == 1
    # the nested flag (0x8000) is not part of the type
    assert rtnl.parse_attrs(struct.pack("=HH", 8, 0x8000 | 2) + b"\0" * 4) == {2: b"\0" * 4}


def test_attribute_past_the_end_is_refused() -> None:
    bad = struct.pack("=HH", 40, 3) + b"abcd"  # says 40 bytes, has 8
    with pytest.raises(rtnl.MalformedReply, match="attribute 3 at offset 0 says 40 bytes, 8 left"):
        rtnl.parse_attrs(bad)
    with pytest.raises(rtnl.MalformedReply, match="a u32 needs 4"):
        rtnl.u32(b"\1\2")


def test_dump_is_parsed_and_filtered_to_the_interface(fake) -> None:  # type: ignore[no-untyped-def]
    nl, peer = fake
    seq = nl.seq + 1
    q1 = msg(rtnl.RTM_NEWQDISC, seq, tcmsg(5, 0x4C4D0000, rtnl.TC_H_ROOT) + rtnl.attr_str(rtnl.TCA_KIND, "htb"),
             rtnl.NLM_F_MULTI)
    q2 = msg(rtnl.RTM_NEWQDISC, seq, tcmsg(6, 0, rtnl.TC_H_ROOT) + rtnl.attr_str(rtnl.TCA_KIND, "noqueue"),
             rtnl.NLM_F_MULTI)
    peer.send(msg(rtnl.RTM_NEWQDISC, seq + 1000, tcmsg(5, 1, 2)))  # stale: another request's answer
    peer.send(q1 + q2)
    peer.send(msg(rtnl.NLMSG_DONE, seq, struct.pack("=i", 0), rtnl.NLM_F_MULTI))
    qs = nl.qdiscs(5)
    assert [(q.tc_kind, q.handle, q.parent) for q in qs] == [("htb", 0x4C4D0000, rtnl.TC_H_ROOT)]
    # the request went out as a dump for ifindex 5
    sent = peer.recv(4096)
    n, kind, flags, sseq, _ = HDR.unpack_from(sent)
    assert (n, kind, flags & rtnl.NLM_F_DUMP, sseq) == (len(sent), rtnl.RTM_GETQDISC, rtnl.NLM_F_DUMP, seq)


def test_truncated_message_is_refused(fake) -> None:  # type: ignore[no-untyped-def]
    nl, peer = fake
    seq = nl.seq + 1
    whole = msg(rtnl.RTM_NEWQDISC, seq, tcmsg(5, 0, rtnl.TC_H_ROOT) + rtnl.attr_str(rtnl.TCA_KIND, "htb"))
    peer.send(whole[:30])  # the header says more than the datagram holds
    with pytest.raises(rtnl.MalformedReply, match=r"message type 36 at offset 0 says \d+ bytes, 30 left \(truncated\)") as ei:
        nl.qdiscs(5)
    assert ei.value.errno == errno.EBADMSG


def test_short_fixed_header_and_stray_type_are_refused(fake) -> None:  # type: ignore[no-untyped-def]
    nl, peer = fake
    peer.send(msg(rtnl.RTM_NEWQDISC, nl.seq + 1, b"\0" * 8))  # a tcmsg needs 20 bytes
    with pytest.raises(rtnl.MalformedReply, match="message type 36: 8 bytes, its header needs 20"):
        nl.qdiscs(5)
    peer.recv(4096)
    peer.send(msg(99, nl.seq + 1, b""))
    with pytest.raises(rtnl.MalformedReply, match="unexpected message type 99"):
        nl.qdiscs(5)
    peer.recv(4096)
    peer.send(msg(rtnl.RTM_NEWQDISC, nl.seq + 1, b"", length=8))  # length below the header
    with pytest.raises(rtnl.MalformedReply, match="says 8 bytes"):
        nl.qdiscs(5)


def test_error_carries_errno_extack_and_the_request(fake) -> None:  # type: ignore[no-untyped-def]
    nl, peer = fake
    seq = nl.seq + 1
    echoed = HDR.pack(36, rtnl.RTM_DELTFILTER, 5, seq, 0)  # capped: the request's header only
    ext = rtnl.attr_str(rtnl.NLMSGERR_ATTR_MSG, "Filter with specified priority/protocol not found")
    peer.send(msg(rtnl.NLMSG_ERROR, seq, struct.pack("=i", -errno.ENOENT) + echoed + ext,
                  rtnl.NLM_F_CAPPED | rtnl.NLM_F_ACK_TLVS))
    with pytest.raises(rtnl.NetlinkError) as ei:
        nl.tc(rtnl.RTM_DELTFILTER, 0, 5, 1, 0xFFFFFFF3, tc_kind="bpf", what="deleting bpf filter 'lm_egress'")
    e = ei.value
    assert e.errno == e.code == errno.ENOENT
    assert e.extack == "Filter with specified priority/protocol not found"
    assert str(e) == ("[Errno 2] deleting bpf filter 'lm_egress': No such file or directory "
                      "(Filter with specified priority/protocol not found)")
    # an ACK (error 0) is success
    peer.send(msg(rtnl.NLMSG_ERROR, nl.seq + 1, struct.pack("=i", 0) + HDR.pack(36, 0, 0, nl.seq + 1, 0)))
    nl.tc(rtnl.RTM_DELTFILTER, 0, 5, 1, 0xFFFFFFF3, what="x")


def test_the_agent_and_its_components_load_no_pyroute2() -> None:
    """The agent's netlink is this client: pyroute2 (about 13 MB of idle RSS) stays out of it."""
    import subprocess
    import sys

    code = ("import sys, laminar.agent as A; A.import_components(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyroute2'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
