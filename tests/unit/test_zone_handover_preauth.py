"""The hand-over port before authentication, real ZoneComponents on loopback (nodes 1, 2 and 3
at 127.0.0.1, .2 and .3; 127.0.0.9 is a host the roster does not list).

Before: any host that reached the port could take one of 16 reading slots (all sources
together) for 10 s by sending a frame's length and nothing more; holding the 16, it had every
real hand-over cut (the submitter saw its frame written, got no answer, and after
``unconfirmed_wait_s`` gave the placement up as ``unconfirmed``). A frame was read whole (1 MiB)
before anything of it was checked. Now:

- with ``zone.check_source`` an off-roster address is reset at accept (``off_roster``);
- a roster address holds its own share of slots (``source_busy`` past it), so one member
  cannot take another's;
- the header is read first, within ``HEADER_DEADLINE_S``, and checked (zone, claimed sender,
  that sender's address) before the body is read; a peer that drips is cut (``slow``);
- UDP: a datagram is checked against its claimed sender's address before any HMAC.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path

from test_zone_handover import SubmittingJobs
from test_zone_wrong_source import forged, with_nodes

from laminar.policy import placement as pl
from laminar.zone import gate as G
from laminar.zone import transport, wire
from laminar.zone.component import HANDOVER_OK, ZoneComponent, demand_to_probe

HOSTS = {1: "127.0.0.1", 2: "127.0.0.2", 3: "127.0.0.3"}
# a peer's job runs as its owner (nobody, an account of this host: laminar.zone.authority)
SPEC = json.dumps({"spec": {"command": ["sleep", "1"], "name": "placed"}, "owner_uid": 65534, "owner_gid": 65534}).encode()


async def _hold(addr: str, port: int, src: str, n: int, first: bytes) -> list[asyncio.StreamWriter]:
    """``n`` connections from ``src`` that each send ``first`` and then nothing."""
    out = []
    for _ in range(n):
        try:
            r, w = await asyncio.open_connection(addr, port, local_addr=(src, 0))
        except ConnectionError:
            continue
        w.write(first)
        out.append(w)
    return out


async def _placed(n1: ZoneComponent, n2: ZoneComponent, pid: int) -> wire.HandoverAck:
    """Node 2's real hand-over of placement ``pid`` to node 1 (offered first), through the
    agent's own transport: as a placement does it."""
    offer = n1.handle_request(2, demand_to_probe(pl.Demand(gpus=0.1), pid, 30.0))
    assert isinstance(offer, wire.Offer), offer
    return await n2.submitter.t.handover(1, 0, wire.Handover(pid, SPEC), 5.0)


def test_an_off_roster_host_holding_every_connection_it_can_blocks_no_hand_over(tmp_path: Path) -> None:
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in HOSTS}

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2 = comps[1], comps[2]
        me = n1.membership.by_node[1]
        # what used to fill the 16 reading slots: a frame's length (1 MiB), then silence
        held = await _hold(me.addr, me.handover_port, "127.0.0.9", 300, struct.pack("!I", wire.MAX_FRAME))
        try:
            await asyncio.sleep(0.3)
            for k in range(5):
                ack = await _placed(n1, n2, 0x5000 + k)
                assert ack.status == HANDOVER_OK, ack
            st = n1.stats()["handover_tcp"]
            assert st["off_roster"] >= 250 and st["reading"] == 0, st
            assert len(tables[1].jobs) == 5
            assert n1.status()["handover_gate"]["off_roster"] == st["off_roster"]  # `laminarctl status`
        finally:
            for w in held:
                w.close()

    asyncio.run(with_nodes(tmp_path, HOSTS, body, jobs=tables.get))


def test_one_member_holding_its_share_cannot_take_another_members(tmp_path: Path) -> None:
    """Node 3 (a member, from its own address) holds as many connections as it can, each with
    a header that names it and a body that never comes: it holds its share (PER_SOURCE), the
    rest are reset (source_busy), and node 2's hand-overs go through meanwhile. The ones it holds
    are cut once the body's deadline passes (slow)."""
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in HOSTS}

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        me = n1.membership.by_node[1]
        frame = wire.frame(forged(n3, 3, 1, wire.Handover(0x77, b"x" * 5000), max_size=wire.MAX_FRAME))
        head = frame[:4 + wire.HEADER_SIZE + 10]  # its length, its header, 10 bytes of its body
        held = await _hold(me.addr, me.handover_port, "127.0.0.3", 40, head)
        try:
            await asyncio.sleep(0.3)
            ack = await _placed(n1, n2, 0x6001)
            assert ack.status == HANDOVER_OK, ack
            st = n1.stats()["handover_tcp"]
            assert st["reading"] == G.PER_SOURCE and st["source_busy"] >= 40 - G.PER_SOURCE, st
            t0 = time.monotonic()
            await asyncio.sleep(0.5)
            while n1.stats()["handover_tcp"]["reading"] and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.1)
            st = n1.stats()["handover_tcp"]
            assert st["reading"] == 0 and st["slow"] == G.PER_SOURCE, st
        finally:
            for w in held:
                w.close()

    # the body's deadline: handover_timeout_s (1 s here) and the time at 1 MiB/s
    asyncio.run(with_nodes(tmp_path, HOSTS, body, jobs=tables.get, handover_timeout_s=1.0))


def test_a_frame_claiming_another_node_is_dropped_at_its_header_its_body_unread(tmp_path: Path) -> None:
    """Node 3 sends the header of a frame signed as node 2 (60 KB of body announced): node 1
    closes at once (wrong_source, no MAC computed: not bad_mac), without waiting for the body.
    So it does for node 3's own frame announced as 1 MiB, which its header's 16-bit body length
    cannot describe (bad_length): before, the agent read the whole MiB first."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n3 = comps[1], comps[3]
        me = n1.membership.by_node[1]

        async def header_only(frame: bytes) -> float:
            r, w = await asyncio.open_connection(me.addr, me.handover_port, local_addr=("127.0.0.3", 0))
            try:
                t0 = time.monotonic()
                w.write(frame[:4 + wire.HEADER_SIZE])
                await w.drain()
                assert await asyncio.wait_for(r.read(100), 5) == b""
                return time.monotonic() - t0
            finally:
                w.close()

        as_2 = wire.frame(forged(n3, 2, 1, wire.Handover(0x78, b"y" * 60_000), max_size=wire.MAX_FRAME))
        took = await header_only(as_2)
        drops = n1.stats()["handover_drops"]
        assert drops["wrong_source"] == 1 and drops["bad_mac"] == 0, drops
        assert took < transport.HEADER_DEADLINE_S, took  # closed on its header, not at a deadline
        own = forged(n3, 3, 1, wire.Handover(0x79, b"z" * 100), max_size=wire.MAX_FRAME)
        took = await header_only(struct.pack("!I", wire.MAX_FRAME) + own)
        assert n1.stats()["handover_drops"]["bad_length"] == 1 and took < transport.HEADER_DEADLINE_S

    asyncio.run(with_nodes(tmp_path, HOSTS, body))


def test_a_datagram_from_an_address_not_its_claims_costs_no_mac(tmp_path: Path) -> None:
    """A datagram claiming node 2 from node 3's socket, with a wrong MAC: wrong_source, not
    bad_mac (the claim is checked first: a flood of them costs a dict look-up each)."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n3 = comps[1], comps[3]
        dst = (n1.membership.by_node[1].addr, n1.membership.by_node[1].port)
        data = bytearray(forged(n3, 2, 1, wire.Heartbeat(1)))
        data[-1] ^= 0xFF  # a wrong MAC
        before = n1.endpoint.received
        n3.endpoint.sock.sendto(bytes(data), dst)
        for _ in range(100):
            if n1.endpoint.received > before:
                break
            await asyncio.sleep(0.01)
        drops = n1.stats()["drops"]
        assert drops["wrong_source"] == 1 and drops["bad_mac"] == 0, drops

    asyncio.run(with_nodes(tmp_path, HOSTS, body))
