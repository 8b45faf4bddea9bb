"""A zone member cannot speak as another: real ZoneComponents on loopback (real UDP and TCP
sockets, real keys), forged messages sent from one member's address in another's name.

The zone's key is the zone's, not the node's: every member holds it, so a correctly signed
datagram claiming node 2 can come from node 3. With ``zone.check_source`` (the default) the
receiver drops a message whose source address is not its claimed sender's roster address
(``wrong_source``), before it is acted on or takes a sequence number; off, it is believed
(the knob for NAT'd and multi-homed nodes)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from ports import free_port
from test_zone_handover import SubmittingJobs
from test_zone_replay import until

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import HANDOVER_OK, ZoneComponent, demand_to_probe
from laminar.zone.keys import generate_node_key
from laminar.zone.membership import canonical_ip

# a hand-over names its job's owner (a missing one is refused: laminar.zone.authority); nobody
# has an account on every Debian host and needs no zone.root_from
NOBODY_IDS = {"owner_uid": 65534, "owner_gid": 65534}

T = TypeVar("T")


def _port(host: str, kind: int) -> int:
    return free_port(kind, host, socket.AF_INET)


async def with_nodes(tmp: Path, hosts: dict[int, str], body: Callable[[dict[int, ZoneComponent]], Awaitable[T]],
                     jobs: Callable[[int], Any] | None = None, listen: dict[int, str] | None = None,
                     node_keys: Iterable[int] = (), zone_settings: dict[str, Any] | None = None, **extra: Any) -> T:
    """Runs ``body(comps)`` with one real networked ZoneComponent per node of ``hosts`` (node ->
    its loopback IP in the roster; it listens there, or on ``listen[node]``), all in zone 1
    under one key, ``extra`` (and ``zone_settings``, for a key named like a parameter here) over each
    node's [zone] settings; stops them after. The nodes in ``node_keys`` get a node key
    (``tmp/node<N>.key``) and their pubkey in the roster."""
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    ports = {n: (_port(h, socket.SOCK_DGRAM), _port(h, socket.SOCK_STREAM)) for n, h in hosts.items()}
    pubs = {n: generate_node_key(tmp / f"node{n}.key").hex() for n in node_keys}
    nodes = [{"id": n, "zone": 1, "addr": f"{hosts[n]}:{u}", "handover_port": t, **({"pubkey": pubs[n]} if n in pubs else {})}
             for n, (u, t) in ports.items()]
    comps = {}
    for n, (u, t) in ports.items():
        settings = {"node_id": n, "nodes": nodes, "keys_file": str(keys), "listen": (listen or {}).get(n, hosts[n]),
                    "port": u, "handover_port": t, "cpus": 8, "memory_mb": 8000, "summary_interval_s": 600,
                    "node_key_file": str(tmp / f"node{n}.key"), **extra, **(zone_settings or {})}
        comps[n] = ZoneComponent(settings=settings, jobs=jobs(n) if jobs else None, gpus=2,
                                 loan={"elastic_interval_s": 0})
    started = []
    try:
        for c in comps.values():
            await c.start(None)
            started.append(c)
        return await body(comps)
    finally:
        for c in started:
            await c.stop()


def forged(comp: ZoneComponent, claim: int, to: int, body: wire.Body, max_size: int = wire.MAX_DATAGRAM) -> bytes:
    """What a member holding ``comp``'s keys can sign: ``body`` as node ``claim``, for node ``to``
    (sequence numbers far ahead of the real node's, as a forger who wants its window would pick)."""
    enc = wire.Encoder(claim, comp.keys, seq0=time.time_ns() // 1000 + 10**12)
    return enc.encode(body, 1, comp.wall(), to=to, max_size=max_size)


SUMMARY = wire.Summary(gpu_free_centi=(100,) * 7, cpus_milli=777_000, memory_mb=77_777, draining=False)


async def _delivered(comp: ZoneComponent, before: int, n: int = 1) -> None:
    """Wait until ``comp``'s endpoint has read ``n`` datagrams more than ``before``."""
    assert await until(lambda: comp.endpoint.received >= before + n)
    await asyncio.sleep(0.02)


def test_a_datagram_signed_as_node_2_from_node_3s_address_is_dropped_and_changes_nothing(tmp_path: Path) -> None:
    """Node 3 (a member: it holds the zone key) signs a summary and an offer as node 2 and
    sends them to node 1 from its own socket. Node 1 must drop both as wrong_source: it keeps
    no summary for node 2, routes no offer to the placement it waits on, and node 2's replay window is untouched (node 2's own datagrams, with their lower
    sequence numbers, still pass). The same messages from node 2's socket are accepted. Before
    the check, node 1 believed the claimed sender: any member could feed it capacity, offers,
    releases or refusals in any node's name."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        dst = (n1.membership.by_node[1].addr, n1.membership.by_node[1].port)
        pid = 0x0FF1CE
        q = n1.router.expect(pid)
        offer = wire.Offer(pid, 5000, ((0, 100),))
        # (node 2's first summary round, at its start, may have come in already: real traffic)
        before = n1.endpoint.received
        n3.endpoint.sock.sendto(forged(n3, 2, 1, SUMMARY), dst)
        n3.endpoint.sock.sendto(forged(n3, 2, 1, offer), dst)
        await _delivered(n1, before, 2)
        kept = n1.membership.state[2].last_summary
        assert kept is None or kept.memory_mb != 77_777, "a summary signed as node 2 by node 3 was kept"
        assert q.empty(), "an offer signed as node 2 by node 3 was routed to the placement"
        assert n1.decoder.drops["wrong_source"] == 2
        assert n1.router.late_offers == 0
        assert n1.stats()["drops"]["wrong_source"] == 2  # what `laminarctl zone stats` shows

        # node 2's own, from its own socket: accepted (its sequence numbers are far below the
        # forger's, so this also shows the forgeries took none of them)
        before = n1.endpoint.received
        n2.endpoint.send_to(1, dst, SUMMARY, to=1)
        n2.endpoint.send_to(1, dst, offer, to=1)
        await _delivered(n1, before, 2)
        assert n1.decoder.drops["replay"] == 0
        kept = n1.membership.state[2].last_summary
        assert kept is not None and kept.memory_mb == 77_777
        assert q.get_nowait() == (2, offer)

    asyncio.run(with_nodes(tmp_path, {1: "127.0.0.1", 2: "127.0.0.1", 3: "127.0.0.1"}, body))


def test_without_check_source_a_member_is_believed_whatever_its_address(tmp_path: Path) -> None:
    """zone.check_source = false (NAT, several addresses): the same forged summary is taken as
    node 2's. This is the behaviour the knob buys back, and what the check prevents."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n3 = comps[1], comps[3]
        dst = (n1.membership.by_node[1].addr, n1.membership.by_node[1].port)
        before = n1.endpoint.received
        n3.endpoint.sock.sendto(forged(n3, 2, 1, SUMMARY), dst)
        await _delivered(n1, before)
        assert n1.decoder.drops["wrong_source"] == 0
        kept = n1.membership.state[2].last_summary
        assert kept is not None and kept.memory_mb == 77_777

    asyncio.run(with_nodes(tmp_path, {1: "127.0.0.1", 2: "127.0.0.1", 3: "127.0.0.1"}, body, check_source=False))


def test_an_ipv4_peer_seen_by_a_dual_stack_socket_is_its_roster_address(tmp_path: Path) -> None:
    """Node 1 listens on '::' (one socket for IPv4 and IPv6): node 2's datagrams arrive from
    ::ffff:127.0.0.1, which is node 2's roster address 127.0.0.1 and must be accepted; node 3's
    forgery from the same host but its own port is still dropped."""
    assert canonical_ip("::ffff:127.0.0.1") == "127.0.0.1"
    assert canonical_ip("FE80::1%lo") == "fe80::1"

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        dst = ("127.0.0.1", n1.membership.by_node[1].port)
        before = n1.endpoint.received
        n2.endpoint.send_to(1, dst, SUMMARY, to=1)
        await _delivered(n1, before)
        assert n1.decoder.drops["wrong_source"] == 0
        assert n1.membership.state[2].last_summary is not None
        before = n1.endpoint.received
        n3.endpoint.sock.sendto(forged(n3, 2, 1, wire.Release(0x51)), dst)
        await _delivered(n1, before)
        assert n1.decoder.drops["wrong_source"] == 1

    asyncio.run(with_nodes(tmp_path, {1: "127.0.0.1", 2: "127.0.0.1", 3: "127.0.0.1"}, body, listen={1: "::"}))


def test_a_hand_over_signed_as_node_2_from_node_3s_address_is_refused(tmp_path: Path) -> None:
    """Node 1 holds an offer it made to node 2. Node 3 (127.0.0.3) opens a connection to node
    1's hand-over port and sends a correctly signed hand-over frame claiming node 2: node 1
    must close it unanswered (wrong_source) and start nothing. Node 2's own hand-over, through
    the agent's transport (it leaves from node 2's listen address 127.0.0.2), starts the job.
    Before the check any member could hand any node a job in another node's name."""
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in (1, 2, 3)}
    spec = json.dumps({"spec": {"command": ["sleep", "1"], "name": "in-2s-name"}, **NOBODY_IDS}).encode()

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        pid = 0x2B0B
        offer = n1.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 30.0))
        assert isinstance(offer, wire.Offer)
        me = n1.membership.by_node[1]
        frame = wire.frame(forged(n3, 2, 1, wire.Handover(pid, spec), max_size=wire.MAX_FRAME))
        reader, writer = await asyncio.open_connection(me.addr, me.handover_port, local_addr=("127.0.0.3", 0))
        try:
            writer.write(frame)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(65536), 5.0)
        finally:
            writer.close()
        assert not tables[1].jobs, "a hand-over signed as node 2 by node 3 started a job"
        assert answer == b"" and n1.counts["handovers"] == 0
        assert n1.tcp_decoder is not None and n1.tcp_decoder.drops["wrong_source"] == 1
        assert n1.stats()["handover_drops"]["wrong_source"] == 1
        assert pid in n1.arbiter.held and pid not in n1.arbiter.placed

        ack = await n2.submitter.t.handover(1, 0, wire.Handover(pid, spec), 5.0)
        assert ack.status == HANDOVER_OK, ack
        assert n1.counts["handovers"] == 1 and len(tables[1].jobs) == 1
        assert n1.tcp_decoder.drops["wrong_source"] == 1

    asyncio.run(with_nodes(tmp_path, {1: "127.0.0.1", 2: "127.0.0.2", 3: "127.0.0.3"}, body, jobs=tables.get))
