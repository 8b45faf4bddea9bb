"""Hand-over frames that arrive late, between real ZoneComponents on loopback (real TCP, real keys).

A sender's one sequence counter runs across its UDP datagrams and its TCP hand-over frames, and
each receiver's decoders (UDP and TCP) keep their own replay state per sender. A hand-over frame
signed before its connect, whose connect is slow (a lost SYN: here a stand-in gate in front of
``asyncio.open_connection``, the one fake), was dropped as ``replay`` when a later hand-over from
a busy sender (more than 256 numbers on, its datagrams to other nodes in between) reached the
node first, and as ``stale`` when the connect took longer than the 30 s replay window (a shared
fake wall clock that the gate moves on by 31 s). The submitter's retry recovered, slower, with the
``replay`` counter up. Replay protection must stay whole: the same frame a second time, or a
frame from before the time window, is still dropped.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_zone_handover import SubmittingJobs
from test_zone_replay import with_zone

from laminar.policy import placement as pl
from laminar.zone import transport, wire
from laminar.zone.component import HANDOVER_OK, NetTransport, ZoneComponent, demand_to_probe

# a hand-over names its job's owner (a missing one is refused: laminar.zone.authority); nobody
# has an account on every Debian host and needs no zone.root_from
NOBODY_IDS = {"owner_uid": 65534, "owner_gid": 65534}

SPEC = json.dumps({"spec": {"command": ["sleep", "1"]}, **NOBODY_IDS}).encode()


class SlowConnect:
    """Stand-in for a lost SYN: the first connect to ``port`` waits until ``release()``, then runs
    ``on_release`` (e.g. moves a fake clock on) and connects for real. Others connect at once."""

    def __init__(self, port: int, on_release: Callable[[], None] = lambda: None) -> None:
        self.port = port
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()
        self.on_release = on_release
        self.used = False
        self.real = asyncio.open_connection

    async def __call__(self, host: str, port: int, **kw: Any) -> Any:
        if port == self.port and not self.used:
            self.used = True
            self.waiting.set()
            await self.gate.wait()
            self.on_release()
        return await self.real(host, port, **kw)


def offer(comp: ZoneComponent, sender: int, pid: int) -> None:
    o = comp.handle_request(sender, demand_to_probe(pl.Demand(gpus=1), pid, 30.0))
    assert isinstance(o, wire.Offer), o


def test_a_slow_hand_over_behind_a_busy_sender_s_later_one_is_not_dropped_as_replay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tables = {1: SubmittingJobs(tmp_path / "state1")}

    async def body(comps: dict[int, ZoneComponent]) -> None:
        node, sub = comps[1], comps[2]
        slow = SlowConnect(node.membership.by_node[1].handover_port)
        monkeypatch.setattr(transport.asyncio, "open_connection", slow)
        offer(node, 2, 0xA1)
        offer(node, 2, 0xB2)
        t = NetTransport(sub)
        first = asyncio.ensure_future(t.handover(1, 0, wire.Handover(0xA1, SPEC), 10.0))
        await asyncio.wait_for(slow.waiting.wait(), 5.0)
        assert sub.encoder is not None
        for _ in range(300):  # the busy sender's datagrams to other nodes meanwhile
            sub.encoder.encode(wire.Release(0x77), 1, sub.wall(), to=3)
        second = await t.handover(1, 0, wire.Handover(0xB2, SPEC), 10.0)
        assert second.status == HANDOVER_OK
        slow.gate.set()
        ack = await asyncio.wait_for(first, 10.0)  # before the fix: HandoverError, dropped as replay
        assert ack.status == HANDOVER_OK, ack.text
        assert node.tcp_decoder is not None and node.tcp_decoder.drops.get("replay", 0) == 0
        assert len(tables[1].jobs) == 2

    asyncio.run(with_zone(tmp_path, {1: "p", 2: "q"}, body, jobs=tables.get))


def test_a_hand_over_whose_connect_outlasts_the_replay_window_is_not_dropped_as_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tables = {1: SubmittingJobs(tmp_path / "state1")}
    offset = [0.0]

    def wall() -> float:  # the zone's wall clock (both nodes): moved on by the slow connect
        import time
        return time.time() + offset[0]

    def later() -> None:
        offset[0] += 31.0

    async def body(comps: dict[int, ZoneComponent]) -> None:
        node, sub = comps[1], comps[2]
        sub.wall = wall
        assert node.server is not None
        node.server.clock = wall
        slow = SlowConnect(node.membership.by_node[1].handover_port, later)
        monkeypatch.setattr(transport.asyncio, "open_connection", slow)
        offer(node, 2, 0xC3)
        first = asyncio.ensure_future(NetTransport(sub).handover(1, 0, wire.Handover(0xC3, SPEC), 60.0))
        await asyncio.wait_for(slow.waiting.wait(), 5.0)
        slow.gate.set()
        ack = await asyncio.wait_for(first, 10.0)  # before the fix: HandoverError, dropped as stale
        assert ack.status == HANDOVER_OK, ack.text
        assert node.tcp_decoder is not None and node.tcp_decoder.drops.get("stale", 0) == 0

    asyncio.run(with_zone(tmp_path, {1: "p", 2: "q"}, body, jobs=tables.get))


def test_the_hand_over_decoder_takes_frames_far_out_of_order_and_still_refuses_replays(tmp_path: Path) -> None:
    """The node's own TCP decoder, driven directly: a frame 300 numbers behind the highest seen
    (a big spec still being read while later frames came in) is taken; the same frame again,
    the later one again, or one older than the time window, is refused. The UDP decoder keeps
    its 256-number window (a datagram 256 behind is a replay there)."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        node, sub = comps[1], comps[2]
        assert sub.encoder is not None and node.tcp_decoder is not None and node.decoder is not None
        now = sub.wall()
        slow = sub.encoder.encode(wire.Handover(1, SPEC), 1, now, max_size=wire.MAX_FRAME, to=1)
        for _ in range(300):
            sub.encoder.encode(wire.Release(0x77), 1, now, to=3)
        fast = sub.encoder.encode(wire.Handover(2, SPEC), 1, now, max_size=wire.MAX_FRAME, to=1)
        dec = node.tcp_decoder
        assert dec.decode(fast, now).body == wire.Handover(2, SPEC)
        assert dec.decode(slow, now + 1).body == wire.Handover(1, SPEC)  # before the fix: replay
        for frame in (slow, fast):
            with pytest.raises(wire.Dropped) as e:
                dec.decode(frame, now + 2)
            assert e.value.reason is wire.DropReason.REPLAY
        old = sub.encoder.encode(wire.Handover(3, SPEC), 1, now - 40, max_size=wire.MAX_FRAME, to=1)
        with pytest.raises(wire.Dropped) as e:
            dec.decode(old, now)
        assert e.value.reason is wire.DropReason.STALE
        # the replay memory of the TCP decoder is bounded by time: what it forgets is stale
        with pytest.raises(wire.Dropped) as e:
            dec.decode(slow, now + 31)
        assert e.value.reason is wire.DropReason.STALE
        # UDP: unchanged, 256 behind the highest seen is a replay, 255 is taken
        udp = node.decoder
        base = [sub.encoder.encode(wire.Release(0x78), 1, now, to=1) for _ in range(257)]
        assert udp.decode(base[-1], now)
        assert udp.decode(base[1], now)  # 255 behind
        with pytest.raises(wire.Dropped) as e:
            udp.decode(base[0], now)  # 256 behind
        assert e.value.reason is wire.DropReason.REPLAY

    asyncio.run(with_zone(tmp_path, {1: "p", 2: "q"}, body))
