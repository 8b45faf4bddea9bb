"""The persisted sequence floor (laminar.zone.wire.Encoder ``reserve``, ZoneComponent): an agent
restarted right after its wall clock stepped back starts its sequence numbers below what its
peers last saw from it, and they dropped its datagrams as replays until the clock caught up.

Two real ZoneComponents on loopback talk real UDP (summaries); node 1 keeps its floor in a real
laminar.store.Store. Its wall clock is a stand-in (``SteppedWall``, the real clock less a
step the test sets): stepping this machine's clock would disturb everything else running
here. No privileges."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from standin_agent import standin_agent
from test_loan_component import free_port

from laminar.components import ZoneAgent
from laminar.store import Store
from laminar.zone import wire
from laminar.zone.component import ZoneComponent
from laminar.zone.keys import ZoneKeys


class SteppedWall:
    """A stand-in wall clock: the real one plus ``step`` seconds."""

    def __init__(self, step: float = 0.0) -> None:
        self.step = step

    def __call__(self) -> float:
        return time.time() + self.step


def settings(tmp_path: Path, me: int, nodes: list[dict[str, Any]], hport: int) -> dict[str, Any]:
    return {"node_id": me, "nodes": nodes, "keys_file": str(tmp_path / "zone.keys"), "listen": "127.0.0.1",
            "port": int(nodes[me - 1]["addr"].split(":")[1]), "handover_port": hport, "cpus": 4, "memory_mb": 4000,
            "summary_interval_s": 0.05, "summary_fanout": 1}


async def until(fn: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_restart_after_the_wall_clock_stepped_back_is_not_dropped_as_replays(tmp_path: Path) -> None:
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    nodes = [{"id": n, "zone": 1, "addr": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"} for n in (1, 2)]
    store = Store(tmp_path / "state" / "laminar.db")
    agent1 = standin_agent(ZoneAgent, store=store)  # a stand-in agent: only the store (a real one) is used here
    s1 = settings(tmp_path, 1, nodes, free_port(socket.SOCK_STREAM))
    peer = ZoneComponent(settings=settings(tmp_path, 2, nodes, free_port(socket.SOCK_STREAM)), gpus=1,
                         loan={"elastic_interval_s": 0})

    def from_node1() -> int:
        assert peer.decoder is not None
        return peer.membership.state[1].rx

    async def go() -> None:
        await peer.start(None)
        try:
            first = ZoneComponent(settings=s1, gpus=1, loan={"elastic_interval_s": 0})
            await first.start(agent1)
            try:
                await until(lambda: from_node1() >= 5, what="the peer to hear node 1")
                assert first.encoder is not None
                last_seq = first.encoder.seq
                floor = store.get_meta("zone.seq_floor.1")
                assert floor is not None and floor >= last_seq + 1
            finally:
                await first.stop()
            # restarted at once, its wall clock stepped back 20 s (inside the 30 s replay window,
            # so its datagrams are not stale: only the sequence decides)
            second = ZoneComponent(settings=s1, gpus=1, loan={"elastic_interval_s": 0}, clock=SteppedWall(-20.0))
            heard = from_node1()
            await second.start(agent1)
            try:
                assert second.encoder is not None and second.encoder.seq > last_seq
                await until(lambda: from_node1() >= heard + 5, what="the peer to accept the restarted node 1")
                assert peer.decoder is not None and peer.decoder.stats()["replay"] == 0
            finally:
                await second.stop()
        finally:
            await peer.stop()
            store.close()

    asyncio.run(go())


def test_the_floor_is_stored_before_any_number_above_it_is_used() -> None:
    stored: list[int] = []
    enc = wire.Encoder(1, ZoneKeys({1: bytes(32)}, "test"), seq0=100, reserve=stored.append, block=4)
    assert stored == [104]
    seqs = []
    for _ in range(11):
        enc.encode(wire.Heartbeat(1), zone=1, now=0.0)
        seqs.append(enc.seq)
        assert enc.seq <= stored[-1]
    assert seqs == list(range(101, 112)) and stored == [104, 109, 114]
    assert wire.seq_start(50, 113) == 114 and wire.seq_start(500, 113) == 500 and wire.seq_start(7, None) == 7
