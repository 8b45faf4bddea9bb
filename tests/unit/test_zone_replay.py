"""Replayed zone datagrams between real ZoneComponents on loopback (real UDP, real keys).

The zone's MAC covers the sender, its sequence number and the body, not the receiver: a
datagram one node sent to another verifies at every node of the zone. Each receiver keeps
its own sequence window per sender, and a sender's sequence runs across all its peers, so a
datagram captured on its way to one node and replayed to another (within the replay window)
is new to that one. These tests replay real captured datagrams to the wrong node."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from ports import free_port
from test_zone_handover import SubmittingJobs

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import ZoneComponent

T = TypeVar("T")


def _port(kind: int) -> int:
    return free_port(kind)


class Tap:
    """Wraps a component's UDP socket: records every datagram it sends (an on-path observer)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[tuple[bytes, tuple[str, int]]] = []

    def sendto(self, data: bytes, addr: tuple[str, int]) -> int:
        self.sent.append((bytes(data), addr))
        return self.sock.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


async def with_zone(tmp: Path, pools: dict[int, str], body: Callable[[dict[int, ZoneComponent]], Awaitable[T]],
                    jobs: Callable[[int], Any] | None = None, loan: dict[str, Any] | None = None) -> T:
    """Runs ``body(comps)`` with one real ZoneComponent per node of ``pools`` (node -> pool),
    all in zone 1 on 127.0.0.1, one key, each node's job table ``jobs(node)`` (none by
    default), ``loan`` over the [loan] settings; stops them after. Every node trusts every other
    with root's jobs (``zone.root_from``) and loan returns (``loan.return_from``)."""
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    ports = {n: (_port(socket.SOCK_DGRAM), _port(socket.SOCK_STREAM)) for n in pools}
    nodes = [{"id": n, "zone": 1, "addr": f"127.0.0.1:{u}", "handover_port": t, "pool": pools[n]}
             for n, (u, t) in ports.items()]
    comps = {}
    for n, (u, t) in ports.items():
        # one operator's test zone: every node may hand the others root's jobs and return their servers
        settings = {"node_id": n, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1", "port": u,
                    "handover_port": t, "cpus": 8, "memory_mb": 8000, "root_from": list(pools)}
        comps[n] = ZoneComponent(settings=settings, jobs=jobs(n) if jobs else None, gpus=2,
                                 loan={"elastic_interval_s": 0, "query_timeout_s": 1.0, "return_from": list(pools),
                                       **(loan or {})})
    started = []
    try:
        for c in comps.values():
            await c.start(None)
            started.append(c)
        return await body(comps)
    finally:
        for c in started:
            await c.stop()


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            return False
        await asyncio.sleep(0.01)
    return True


def test_a_return_replayed_to_another_server_does_not_return_it(tmp_path: Path) -> None:
    """Node 3 returns one of two idle inference servers (1 and 2). An observer replays the
    return datagram node 3 sent to the chosen server to the other one, within the replay
    window: that server must not return itself (before the fix it did: every lent job on it
    was checkpointed, stopped and requeued, and it refused loans until its load was set
    again; one captured return could return the whole pool)."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        coord = comps[3]
        tap = Tap(coord.endpoint.sock)
        coord.endpoint.sock = tap
        out = await coord.loan.return_servers("inference", 1)
        (chosen,) = out["servers"]
        other = 2 if chosen == 1 else 1
        assert comps[chosen].loan.returned and not comps[other].loan.returned
        to_chosen = comps[chosen].membership.by_node[chosen]
        returns = []
        for data, addr in tap.sent:
            if addr != (to_chosen.addr, to_chosen.port):
                continue
            # what the chosen server's decoder reads in it
            msg = wire.Decoder(coord.keys, coord.membership.zone_of(), node=chosen).decode(data, coord.clock())
            if isinstance(msg.body, wire.LoanRequest) and msg.body.op == 2:
                returns.append(data)
        assert returns  # the return datagram(s) node 3 sent to the chosen server
        dst = comps[other].membership.by_node[other]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
            attacker.bind(("127.0.0.1", 0))
            attacker.setblocking(False)
            for data in returns:
                attacker.sendto(data, (dst.addr, dst.port))
            seen = comps[other].endpoint.received
            assert await until(lambda: comps[other].endpoint.received >= seen + len(returns))
            await asyncio.sleep(0.1)
        assert not comps[other].loan.returned, "a replayed return returned a server the plan did not choose"
        assert comps[other].loan.counts["returns"] == 0
        assert comps[other].loan.loanable
        # the chosen server's own return went through, once
        assert comps[chosen].loan.counts["returns"] == 1
        assert json.loads(json.dumps(out["told"][chosen]))["returned"] is True

    asyncio.run(with_zone(tmp_path, {1: "inference", 2: "inference", 3: "training"}, body))


def test_a_hand_over_replayed_to_the_node_whose_offer_lost_does_not_start_the_job_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 3 places a job: it probes nodes 1 and 2 (the demand's pool), both offer, it hands
    the job over to one of them. The other node's unused offer lapses, and a late hand-over
    still binds a lapsed offer (Arbiter.bind re-arbitrates it). An observer replays the
    hand-over frame (the TCP bytes node 3 sent to the chosen node) to the other node's
    hand-over port within the replay window: before the fix that node started the job too, a
    second copy of the same job (the placement said it ran once). It must refuse the frame."""
    frames: list[bytes] = []
    real_frame = wire.frame

    def tap_frame(data: bytes) -> bytes:  # what transport.handover writes to the TCP stream
        out = real_frame(data)
        frames.append(out)
        return out

    monkeypatch.setattr(wire, "frame", tap_frame)
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in (1, 2, 3)}

    async def body(comps: dict[int, ZoneComponent]) -> None:
        res = await comps[3].place({"command": ["sleep", "1"], "name": "once"}, pl.Demand(gpus=1, pool="p"))
        assert res.outcome == "placed", res.reason
        assert sorted(set(res.probed)) == [1, 2]
        chosen = res.node
        other = 2 if chosen == 1 else 1
        assert len(tables[chosen].jobs) == 1 and not tables[other].jobs
        handovers = [f for f in frames if wire.MsgType(f[4 + 3]) is wire.MsgType.HANDOVER]
        assert len(handovers) == 1
        # the other node made an offer for this placement, now lapsed (or still held)
        arb = comps[other].arbiter
        await asyncio.sleep(0.15)
        arb.expire(comps[other].clock())
        assert res.placement_id in arb.lapsed or res.placement_id in arb.held
        dst = comps[other].membership.by_node[other]
        reader, writer = await asyncio.open_connection(dst.addr, dst.handover_port)
        try:
            writer.write(handovers[0])
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(65536), 5.0)
        finally:
            writer.close()
        assert answer == b""  # a frame failing the wire checks is closed without an answer
        assert not tables[other].jobs, "the replayed hand-over started the job a second time"
        assert res.placement_id not in arb.placed
        assert comps[other].tcp_decoder.drops["bad_mac"] == 1

    asyncio.run(with_zone(tmp_path, {1: "p", 2: "p", 3: "q"}, body, jobs=tables.get))
