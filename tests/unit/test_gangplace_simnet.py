"""GangPlacer over SimNet (a FAKE network: the real GangPlacer and Arbiter, every message
encoded, signed and decoded by the wire code): all-or-nothing, concurrent gangs, failures."""

from __future__ import annotations

import asyncio
import random

import pytest

from laminar.policy import placement as pl
from laminar.zone.gangplace import GangResult
from laminar.zone.simnet import SimNet

WHOLE_NODE = pl.Demand(gpus=8, cpus=4, memory_mb=8_000)  # one per node: a node is taken or free


def _idle_net(nodes: int, zone_size: int, seed: int = 1, **kw: object) -> SimNet:
    net = SimNet.build(nodes=nodes, zone_size=zone_size, rng=random.Random(seed), fill=0.0)
    for k, v in kw.items():
        setattr(net, k, v)
    return net


def _placed_nodes(net: SimNet) -> dict[int, int]:
    """node -> how many jobs are placed on it."""
    return {n: len(a.placed) for n, a in net.arbiters.items() if a.placed}


def _nothing_held(net: SimNet) -> list[tuple[int, int]]:
    """Reservations (tentative or committed) still held anywhere: (node, placement id)."""
    return [(n, pid) for n, a in net.arbiters.items() for pid in a.held]


def test_gang_of_three_on_three_distinct_nodes() -> None:
    net = _idle_net(60, 30)
    r = asyncio.run(net.place_gang(WHOLE_NODE, 3))
    assert r.outcome == "placed", r
    assert len(r.nodes) == 3 and len(set(r.nodes)) == 3
    assert len({net.membership.by_node[n].zone for n in r.nodes}) == 1  # one zone when one fits
    assert [m[0] for m in r.members] == r.nodes and all(m[1].startswith("10.") for m in r.members)
    for n in r.nodes:
        assert r.placement_id in net.arbiters[n].placed
    assert _nothing_held(net) == []  # every unused offer released at once
    assert sum(len(a.placed) for a in net.arbiters.values()) == 3
    # one step: 6 probes, their answers, 3 commits and acks, 3 hand-overs and acks, 3 releases
    assert r.messages == net.messages == 27
    assert r.as_dict()["outcome"] == "placed"


def test_no_partial_gang_when_too_few_nodes() -> None:
    net = _idle_net(6, 6)
    for n in (1, 2, 3, 4):  # four nodes taken: two left, a gang of three cannot start
        net.arbiters[n].inventory = pl.NodeCapacity(n, 1, (0.0,) * 8, 64.0, 512_000, "H100")
    r = asyncio.run(net.place_gang(WHOLE_NODE, 3))
    assert r.outcome == "queued-out", r
    assert r.nodes == []
    assert _placed_nodes(net) == {}
    assert _nothing_held(net) == []


def test_spread_zones_only_when_allowed() -> None:
    net = _idle_net(4, 2)  # two zones of two nodes
    r = asyncio.run(net.place_gang(WHOLE_NODE, 3))
    assert r.outcome == "queued-out" and "no zone advertises a fit for 3 workers" in r.reason
    r = asyncio.run(net.place_gang(WHOLE_NODE, 3, spread_zones=True))
    assert r.outcome == "placed", r
    assert len(set(r.zones)) == 2 and len(set(r.nodes)) == 3
    assert _nothing_held(net) == []


def _race(net: SimNet, gangs: int, k: int, max_rounds: int = 2) -> list[GangResult]:
    placer = net.gang_placer(max_rounds=max_rounds)

    async def go() -> list[GangResult]:
        return await asyncio.wait_for(
            asyncio.gather(*(net.place_gang(WHOLE_NODE, k, placer=placer) for _ in range(gangs))), 30)

    return asyncio.run(go())


def test_concurrent_gangs_never_overcommit_nor_deadlock() -> None:
    # 20 gangs of 4 race for one zone of 40 whole nodes (room for 10 gangs), every message
    # delivered on a later turn of the loop so that the placements interleave message by message
    for seed in (1, 2, 3):
        net = _idle_net(40, 40, seed=seed, async_delivery=True)
        results = _race(net, 20, 4)
        assert {r.outcome for r in results} <= {"placed", "queued-out"}  # each ended (wait_for: bounded)
        placed = [r for r in results if r.outcome == "placed"]
        assert placed, [r.as_dict() for r in results]
        assert all(len(set(r.nodes)) == 4 for r in placed)
        used = [n for r in placed for n in r.nodes]
        assert len(used) == len(set(used))  # no node given to two gangs
        assert all(c == 1 for c in _placed_nodes(net).values())  # never over-committed
        assert sorted(_placed_nodes(net)) == sorted(used)  # no member of a gang that did not place
        for r in results:
            if r.outcome != "placed":
                assert r.nodes == [] and all(r.placement_id not in a.placed for a in net.arbiters.values())
        assert _nothing_held(net) == []  # no reservation left behind
        assert len(placed) <= 10


def test_concurrent_gangs_all_place_when_there_is_room() -> None:
    net = _idle_net(200, 200, async_delivery=True)
    results = _race(net, 10, 4, max_rounds=3)
    assert [r.outcome for r in results] == ["placed"] * 10
    used = [n for r in results for n in r.nodes]
    assert len(used) == len(set(used)) == 40
    assert _nothing_held(net) == []


def test_refused_commit_releases_and_retries_wider() -> None:
    net = _idle_net(12, 12)
    # one node loses its offer before the commit (the real Arbiter then refuses it): a gang of
    # 11 of the 12 nodes almost surely chose it; the placer releases what it holds and tries
    # again, wider, without the refusing node
    first = random.Random(5).sample(sorted(net.arbiters), 1)[0]
    net.lose_before_commit = {first}
    placer = net.gang_placer()
    r = asyncio.run(net.place_gang(WHOLE_NODE, 11, placer=placer))  # 11 of 12: the refuser is likely chosen
    assert r.outcome == "placed", r.as_dict()
    assert first not in r.nodes
    assert r.commit_failures == 1 and r.refusals.get("commit_unknown_placement") == 1
    assert r.steps >= 2
    assert _nothing_held(net) == []
    assert sum(len(a.placed) for a in net.arbiters.values()) == 11
    assert net.by_type["Release"] >= 10  # the committed ones released at once


def test_silent_commit_releases_and_retries() -> None:
    net = _idle_net(12, 12)
    dead = 3
    net.drop_commits = {dead}
    r = asyncio.run(net.place_gang(WHOLE_NODE, 11, placer=net.gang_placer(probe_timeout_s=0.02)))
    assert r.outcome == "placed", r.as_dict()
    assert dead not in r.nodes
    assert r.refusals.get("commit_silent") == 1
    assert _nothing_held(net) == []


def test_silent_node_is_skipped() -> None:
    net = _idle_net(12, 12)
    net.silent = {4, 5}
    r = asyncio.run(net.place_gang(WHOLE_NODE, 10, placer=net.gang_placer(probe_timeout_s=0.02)))
    assert r.outcome == "placed", r.as_dict()
    assert not {4, 5} & set(r.nodes)
    assert _nothing_held(net) == []


def test_failed_handover_undoes_started_members_and_retries() -> None:
    net = _idle_net(20, 20)
    placer = net.gang_placer()
    calls: list[list[int]] = []
    real = net.handover
    broken: set[int] = set()

    async def handover(node: int, port: int, body, timeout_s: float):  # type: ignore[no-untyped-def]
        if not broken and calls:  # the second member's hand-over finds no reservation, once
            broken.add(node)
            net.arbiters[node].held.pop(body.placement_id, None)
        calls.append([node])
        return await real(node, port, body, timeout_s)

    net.handover = handover  # type: ignore[method-assign]
    r = asyncio.run(net.place_gang(WHOLE_NODE, 3, placer=placer))
    assert r.outcome == "placed", r.as_dict()
    assert not broken & set(r.nodes)
    assert placer.counts["undone"] == 1
    assert sum(len(a.placed) for a in net.arbiters.values()) == 3  # the undone members are gone
    assert _nothing_held(net) == []


def test_arbiters_hold_one_placement_id_each() -> None:
    """One placement id probed at many nodes: each node's Arbiter holds its own offer, only
    the origin that probed may commit or release it, a committed one is released by the origin
    (a failed gang), and the rest bind by hand-over."""
    from laminar.zone import wire
    from laminar.zone.arbiter import Arbiter, demand_to_probe

    arbs = {n: Arbiter(pl.NodeCapacity(n, 1, (1.0,) * 8, 64.0, 512_000, "H100")) for n in (1, 2, 3)}
    probe = demand_to_probe(WHOLE_NODE, 77, lease_s=0.85)
    now, origin = 100.0, 9
    for a in arbs.values():
        assert isinstance(a.on_probe(probe, now, node=origin), wire.Offer)
        assert a.prober_of(77) == origin
    # another node speaks for the origin's placement: refused, nothing changes
    assert arbs[1].on_commit(wire.Commit(77, 30_000), now, node=5).status == pl.RefuseReason.UNKNOWN_PLACEMENT
    for a in arbs.values():
        assert a.on_commit(wire.Commit(77, 30_000), now + 0.5, node=origin).status == 0
        assert a.held[77].committed and a.held[77].expires_at == pytest.approx(now + 30.5)
    arbs[3].on_release(wire.Release(77), now + 1, node=5)  # not the prober: ignored
    assert 77 in arbs[3].held
    arbs[3].on_release(wire.Release(77), now + 1, node=origin)  # the origin lets a committed one go
    assert 77 not in arbs[3].held and arbs[3].view(now + 1).gpu_free == (1.0,) * 8
    for n in (1, 2):
        assert arbs[n].bind(77, now + 2, submitter=origin) is not None
        assert arbs[n].view(now + 2).gpu_free == (0.0,) * 8
    # the hold bounds a committed reservation whatever the origin does
    assert arbs[3].on_probe(probe, now + 3, node=origin)
    arbs[3].on_commit(wire.Commit(77, 1_000), now + 3, node=origin)
    assert arbs[3].view(now + 4.5).gpu_free == (1.0,) * 8


def test_gangs_that_lost_a_round_to_each_other_are_placed_in_a_later_one() -> None:
    # 4 gangs of 3 race for one zone of 6 whole nodes (room for 2): in the first round they split
    # the nodes between them, and a node that refused a gang then (held for another) is free again
    # after the queue wait; so the room for a second gang is used in a later round
    for seed in (1, 2, 3):
        net = _idle_net(6, 6, seed=seed, async_delivery=True)
        results = _race(net, 4, 3, max_rounds=3)
        placed = [r for r in results if r.outcome == "placed"]
        assert len(placed) == 2, [r.as_dict() for r in results]
        used = [n for r in placed for n in r.nodes]
        assert len(used) == len(set(used)) == 6
        assert _nothing_held(net) == []
