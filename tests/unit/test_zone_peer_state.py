"""State a zone member's datagrams can make another agent keep, with real ZoneComponents on
loopback and real signed datagrams: it must stay bounded by what the protocol can use, and a
node speaks for its own zone only."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from test_zone_replay import until, with_zone

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import ZoneComponent, zone_summary_to_msg


def send_as(comps: dict[int, ZoneComponent], src: int, dst: int, bodies: list[wire.Body]) -> None:
    """Send ``bodies`` from ``src``'s socket, signed by ``src`` for ``dst`` (what ``src`` sends)."""
    ep = comps[src].endpoint
    for b in bodies:
        ep.send(dst, b)


def test_late_offers_from_a_peer_keep_at_most_what_a_probe_can_release(tmp_path: Path) -> None:
    """Offers for placements nobody waits for are remembered, to be released by the next probe
    to their node (at most wire.MAX_PROBE_RELEASES ids a probe). A peer answering with many
    such offers (a bug, or a member misbehaving) grew that per-node table without bound until
    this node happened to probe it again."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        rng = random.Random(7)
        offers: list[wire.Body] = [wire.Offer(rng.getrandbits(63), 60_000, ((0, 100),)) for _ in range(3000)]
        before = comps[1].router.late_offers
        send_as(comps, 2, 1, offers)
        assert await until(lambda: comps[1].router.late_offers >= before + 2900, 10)
        kept = comps[1].submitter._unused.get(2, {})
        assert len(kept) <= 2 * wire.MAX_PROBE_RELEASES, f"{len(kept)} late offers kept for one node"

    asyncio.run(with_zone(tmp_path, {1: "a", 2: "a"}, body))


def test_a_node_speaks_for_its_own_zone_only(tmp_path: Path) -> None:
    """A zone summary names its zone; only a member of that zone sends it (its speaker). A
    summary a node sent for another zone (here zone 9, which has no members) was believed:
    a member could steer placements away from a real zone or toward one with no members, and
    each new zone id grew every receiver's table (up to 65,536) and the fits every placement
    computes."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n0 = comps[2].counts["zone_summaries_received"]
        fake = pl.ZoneSummary(9, 50, (40,) * len(pl.SHAPES), 400.0, 1 << 20, (), comps[1].clock())
        send_as(comps, 1, 2, [zone_summary_to_msg(fake)])  # node 1 (zone 1) speaks for zone 9
        assert await until(lambda: comps[2].counts["zone_summaries_received"] >= n0 + 1, 5)
        assert 9 not in comps[2].summaries.zone_summaries
        assert 9 not in comps[2].summaries.zone_fits(pl.Demand(gpus=1))

    asyncio.run(with_zone(tmp_path, {1: "a", 2: "a"}, body))
