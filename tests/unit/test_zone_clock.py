"""A wall-clock step on a node (NTP stepping a clock that ran fast, a VM resumed) must not
change how long its offers hold capacity or how old its peers' summaries look: those are
local durations. A real ZoneComponent on loopback; its wall clock is a stand-in that steps
back an hour (stepping this machine's clock would disturb everything else running here),
everything else is real time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from test_loan_component import make_comp, probe

from laminar.zone import wire
from laminar.zone.component import ZoneComponent


class SteppingWall:
    """The wall clock, plus a step (seconds) that the test sets."""

    def __init__(self) -> None:
        self.step = 0.0

    def __call__(self) -> float:
        return time.time() + self.step


def test_an_offer_lapses_after_its_lease_when_the_wall_clock_steps_back(tmp_path: Path) -> None:
    """Before the fix the lease ran on the wall clock: an offer made just before the clock
    stepped back an hour held its GPU for that hour (every later probe refused), although its
    lease is 0.1 s."""
    wall = SteppingWall()
    settings = make_comp(tmp_path, pool="training")._settings
    comp = ZoneComponent(settings=settings, gpus=1, clock=wall, loan={"elastic_interval_s": 0})

    async def check() -> None:
        first = probe(comp, None, 0x11)
        assert isinstance(first, wire.Offer) and first.lease_ms <= 2000
        wall.step = -3600.0
        await asyncio.sleep(first.lease_ms / 1000 + 0.2)
        second = probe(comp, None, 0x13)
        assert isinstance(second, wire.Offer), f"the lapsed offer still holds the GPU: {second}"

    async def go() -> None:
        await comp.start(None)
        try:
            await check()
        finally:
            await comp.stop()

    asyncio.run(go())


def test_a_peer_summary_ages_in_real_time_across_a_wall_clock_step(tmp_path: Path) -> None:
    """A summary received just before the wall clock stepped back an hour looked fresh for
    that hour (its age negative): a dead peer's capacity kept counting in the zone summary."""
    wall = SteppingWall()
    settings = make_comp(tmp_path, pool="training")._settings
    assert settings is not None
    comp = ZoneComponent(settings={**settings, "peer_timeout_s": 0.5}, gpus=1, clock=wall, loan={"elastic_interval_s": 0})

    async def check() -> None:
        msg = wire.Message(wire.MsgType.SUMMARY, 0, 1, 2, int(wall() * 1000), 1,
                           wire.Summary((100, 100, 100, 100), 8000, 8000, False))
        comp._on_message(msg, ("127.0.0.1", 1))
        comp.membership.seen(2, wall(), comp.clock())  # what the endpoint records for a datagram
        assert comp.summaries.own_zone_summary(comp.clock()).nodes == 2  # the peer counts
        wall.step = -3600.0
        await asyncio.sleep(0.7)  # longer than peer_timeout_s: the peer's summary is stale now
        assert comp.summaries.own_zone_summary(comp.clock()).nodes == 1
        (row,) = [r for r in comp.membership.peers(comp.clock()) if r["node"] == 2]
        assert row["last_seen_s"] >= 0.7  # heard 0.7 s ago, not an hour in the future

    async def go() -> None:
        await comp.start(None)
        try:
            await check()
        finally:
            await comp.stop()

    asyncio.run(go())
