"""The node and submitter halves of placement (laminar.zone.component.Arbiter / Submitter) over
the simulated transport (laminar.zone.simnet.SimNet, a FAKE network): the same code the agent
runs, with instant delivery and counted messages. No privileges."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import Arbiter, demand_to_probe
from laminar.zone.simnet import SimNet, run_placements


def small_net(nodes: int = 12, zone_size: int = 4, seed: int = 1) -> SimNet:
    return SimNet.build(nodes, zone_size, gpus_per_node=4, rng=random.Random(seed), fill=0.0)


def _check_capacity(net: SimNet, gpus: int) -> None:
    for node, a in net.arbiters.items():
        used = [f for p in a.placed.values() for _, f in p.reservation.gpu_alloc]
        assert sum(used) <= gpus + 1e-9, (node, used)
        idx = [i for p in a.placed.values() for i, _ in p.reservation.gpu_alloc]
        assert len(set(idx)) == len(idx)


def test_placements_fill_the_cluster_exactly_and_never_overcommit():
    net = small_net()
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=4, zones=3))
    lease = net.arbiters[1].lease_s
    res = []

    async def go() -> None:
        for i in range(60):
            if i % 5 == 0:
                net.refresh_summaries()
            res.append(await sub.place(pl.Demand(gpus=1, cpus=1, memory_mb=100), {"name": f"j{i}"}))
            net.clock_s += lease  # one placement per lease: the unused offers have lapsed

    asyncio.run(go())
    placed = [r for r in res if r.outcome == "placed"]
    # 12 nodes x 4 GPUs: at most 48 jobs fit, and nearly all of them get placed
    assert 44 <= len(placed) <= 48
    _check_capacity(net, 4)
    assert net.by_type["Release"] == 0  # unused offers are not released: they lapse
    assert not any(a.view(net.clock_s) and a.held for a in net.arbiters.values())


def test_a_burst_from_one_submitter_is_not_held_back_by_its_own_unused_offers():
    # 60 placements at one instant: each leaves an unused offer behind, which its node would
    # hold until the lease ends; the submitter's next probe to that node carries the release
    # (wire.Probe.releases), so the burst fills the cluster, never over capacity, and no
    # release datagram is sent
    net = small_net()
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=4, zones=3))
    res = []

    async def go() -> None:
        for i in range(60):
            res.append(await sub.place(pl.Demand(gpus=1, cpus=1, memory_mb=100), {"name": f"j{i}"}))

    asyncio.run(go())
    assert sum(r.outcome == "placed" for r in res) == 48  # 12 nodes x 4 GPUs
    _check_capacity(net, 4)
    assert net.by_type["Release"] == 0
    assert sum(a.counts["releases"] for a in net.arbiters.values()) > 0  # carried by probes


def test_without_piggybacked_releases_a_burst_is_held_back_but_never_overcommitted():
    # the same burst from a submitter that forgets its unused offers (as a different submitter
    # would see them): they hold their nodes until the lease ends, then the rest fits
    net = small_net()
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=4, zones=3))
    sub._note_unused = lambda *a: None  # type: ignore[method-assign]
    res = []

    async def go() -> None:
        for i in range(60):
            res.append(await sub.place(pl.Demand(gpus=1, cpus=1, memory_mb=100), {"name": f"j{i}"}))
        net.clock_s += net.arbiters[1].lease_s
        net.refresh_summaries()
        for i in range(60):
            res.append(await sub.place(pl.Demand(gpus=1, cpus=1, memory_mb=100), {"name": f"k{i}"}))
            net.clock_s += net.arbiters[1].lease_s

    asyncio.run(go())
    burst = sum(r.outcome == "placed" for r in res[:60])
    total = sum(r.outcome == "placed" for r in res)
    assert burst < 48 and 44 <= total <= 48
    _check_capacity(net, 4)


def test_a_probe_releases_only_the_named_tentative_offers():
    a = Arbiter(pl.NodeCapacity(1, 1, (1.0, 1.0), 8, 8000), lease_s=2.0)
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 11, lease_s=2.0), now=100.0), wire.Offer)
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 12, lease_s=2.0), now=100.0), wire.Offer)
    assert isinstance(a.on_commit(wire.Commit(12, 5000), now=100.0), wire.CommitAck)
    # full: a third probe is refused; naming 11 (unused) and 12 (committed) frees only 11
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 13, lease_s=2.0), now=100.1), wire.Refuse)
    p = replace(demand_to_probe(pl.Demand(gpus=1), 14, lease_s=2.0), releases=(11, 12, 999))
    assert isinstance(a.on_probe(p, now=100.2), wire.Offer)
    assert set(a.held) == {12, 14} and a.held[12].committed
    assert a.counts["releases"] == 1


def test_messages_per_placement_stay_within_bound_at_low_load():
    net = SimNet.build(2000, 1000, rng=random.Random(3), fill=0.2)
    rng = random.Random(4)
    jobs = [pl.Demand(gpus=rng.choice([0.25, 0.5, 1.0]), cpus=2, memory_mb=1000) for _ in range(200)]
    results, _cpu, msgs = run_placements(net, jobs, keep_running=500)
    assert all(r.outcome == "placed" for r in results)
    d = pl.RetryPolicy().d
    assert msgs / len(jobs) <= pl.max_messages_per_attempt(d) + 0.5  # widening is rare at low load
    assert net.by_type["Probe"] >= d * len(jobs)


def test_lost_release_costs_only_the_lease():
    a = Arbiter(pl.NodeCapacity(1, 1, (1.0,), 8, 8000), lease_s=2.0)
    probe = demand_to_probe(pl.Demand(gpus=1), 77, lease_s=2.0)
    assert isinstance(a.on_probe(probe, now=100.0), wire.Offer)
    other = demand_to_probe(pl.Demand(gpus=1), 78, lease_s=2.0)
    assert a.on_probe(other, now=101.0) == wire.Refuse(78, pl.RefuseReason.NO_GPU)
    # the submitter of 77 vanished: its release never comes, the lease runs out
    assert isinstance(a.on_probe(other, now=102.5), wire.Offer)
    assert a.counts["expired"] == 1


def test_hand_over_is_idempotent_and_binds_only_live_reservations():
    a = Arbiter(pl.NodeCapacity(1, 1, (1.0, 1.0), 8, 8000), lease_s=1.0)
    a.on_probe(demand_to_probe(pl.Demand(gpus=1), 5, lease_s=1.0), now=0.0)
    p = a.bind(5, now=0.5)
    assert p is not None
    p.job_id = "job-1"
    assert a.bind(5, now=9.0) is p  # a repeated hand-over finds the same job
    assert a.on_probe(demand_to_probe(pl.Demand(gpus=1), 5, lease_s=1.0), now=9.0).reason == pl.RefuseReason.BUSY
    a.on_probe(demand_to_probe(pl.Demand(gpus=1), 6, lease_s=1.0), now=0.0)
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 7, lease_s=1.0), now=1.2), wire.Offer)
    assert a.bind(6, now=1.5) is None  # its lease ran out before the hand-over came, and 7 holds the GPU
    assert a.view(2.5).gpu_free == (0.0, 1.0)
    a.finish(5)
    assert a.view(2.0).gpu_free == (1.0, 1.0)


def test_commit_holds_past_the_lease_and_is_idempotent():
    a = Arbiter(pl.NodeCapacity(1, 1, (1.0,), 8, 8000), lease_s=1.0, hold_s=30.0)
    a.on_probe(demand_to_probe(pl.Demand(gpus=1), 9, lease_s=1.0), now=0.0)
    assert a.on_commit(wire.Commit(9, 30_000), now=0.5, handover_port=7441) == wire.CommitAck(9, 0, 7441)
    assert a.on_commit(wire.Commit(9, 30_000), now=0.6).status == 0
    assert a.bind(9, now=20.0) is not None  # well past the 1 s lease
    assert a.on_commit(wire.Commit(10, 1000), now=0.0).status == pl.RefuseReason.UNKNOWN_PLACEMENT


def test_silent_node_costs_a_timeout_and_placement_goes_elsewhere():
    net = small_net(nodes=4, zone_size=4)
    dead = 2
    del net.arbiters[dead]  # its probes go nowhere: no answer ever
    sub = net.submitter(pl.RetryPolicy(d=4, d_max=4, zones=1, widen_steps=0))
    r = asyncio.run(sub.place(pl.Demand(gpus=1), {"name": "x"}))
    assert r.outcome == "placed" and r.node != dead
    assert dead in r.probed


def test_offers_not_bound_lapse_without_a_message():
    net = small_net(nodes=4, zone_size=4)
    sub = net.submitter(pl.RetryPolicy(d=4, d_max=4, zones=1, widen_steps=0))
    r = asyncio.run(sub.place(pl.Demand(gpus=1), {"name": "x"}))
    assert r.outcome == "placed"
    # four offers came, one was bound: no release is sent, the other three hold until the lease ends
    assert net.by_type["Release"] == 0 and net.messages == 2 * 4 + 2
    assert sum(len(a.held) for a in net.arbiters.values()) == 3
    later = net.clock_s + net.arbiters[1].lease_s
    assert sum(len(a.view(later) and a.held) for a in net.arbiters.values()) == 0
    assert sum(a.counts["expired"] for a in net.arbiters.values()) == 3
    assert sum(len(a.placed) for a in net.arbiters.values()) == 1


def test_release_unused_sends_the_releases_of_the_earlier_protocol():
    net = small_net(nodes=4, zone_size=4)
    net.release_unused = True
    sub = net.submitter(pl.RetryPolicy(d=4, d_max=4, zones=1, widen_steps=0))
    assert asyncio.run(sub.place(pl.Demand(gpus=1), {"name": "x"})).outcome == "placed"
    assert net.by_type["Release"] == 3
    assert sum(len(a.held) for a in net.arbiters.values()) == 0


def test_hand_over_after_the_lease_rebinds_when_the_capacity_is_still_free():
    a = Arbiter(pl.NodeCapacity(1, 1, (1.0,), 8, 8000), lease_s=0.1)
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 21, lease_s=0.1), now=0.0), wire.Offer)
    p = a.bind(21, now=5.0)  # long after its lease: arbitrated again, and it fits
    assert p is not None and p.reservation.gpu_alloc == ((0, 1.0),)
    assert a.counts["rebinds"] == 1
    # lapsed, and meanwhile another placement took the GPU: no bind, nothing over capacity
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 22, lease_s=0.1), now=6.0), wire.Refuse)
    a.finish(21)
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 22, lease_s=0.1), now=6.0), wire.Offer)
    assert isinstance(a.on_probe(demand_to_probe(pl.Demand(gpus=1), 23, lease_s=0.1), now=6.5), wire.Offer)
    assert a.bind(22, now=6.55) is None  # 22 lapsed, 23 holds the GPU now
    assert a.counts["rebind_refusals"] == 1
    assert a.bind(23, now=6.58) is not None
    # a commit after the lease revives the offer the same way
    b = Arbiter(pl.NodeCapacity(2, 1, (1.0,), 8, 8000), lease_s=0.1)
    b.on_probe(demand_to_probe(pl.Demand(gpus=1), 31, lease_s=0.1), now=0.0)
    assert b.on_commit(wire.Commit(31, 30_000), now=1.0).status == 0
    assert b.bind(31, now=20.0) is not None


def test_no_fit_anywhere_is_queued_out_with_a_reason():
    net = small_net(nodes=4, zone_size=2)
    sub = net.submitter()
    r = asyncio.run(sub.place(pl.Demand(gpus=8), {"name": "too-big"}))
    assert r.outcome == "queued-out"
    assert "no zone" in r.reason


def test_one_probe_goes_to_a_hinted_node_for_a_scarce_shape():
    net = SimNet.build(40, 40, gpus_per_node=4, rng=random.Random(2), fill=0.0)
    for n, a in net.arbiters.items():  # only nodes 7 and 30 have four idle GPUs
        a.inventory = pl.NodeCapacity(n, 1, (1.0,) * 4 if n in (7, 30) else (1.0, 0.0, 0.0, 0.0), 64, 512_000, "H100")
    net.refresh_summaries()
    assert set(pl.hinted_nodes(net.zone_summaries[1], pl.Demand(gpus=4))) == {7, 30}
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=4, zones=1))
    first = asyncio.run(sub.place(pl.Demand(gpus=4), {"name": "big"}))
    # two probes: one uniform (sent first, it would win if it could), one hinted
    assert first.outcome == "placed" and first.steps == 1 and first.node in (7, 30)
    assert first.probed[-1] in (7, 30) and len(first.probed) == 2
    # the submitter bound a job there since the summary was issued: not hinted again
    net.clock_s += 1.0
    second = asyncio.run(sub.place(pl.Demand(gpus=4), {"name": "big2"}))
    assert second.outcome == "placed" and second.node == ({7, 30} - {first.node}).pop()
    assert first.node not in second.probed
    # a small shape every node takes gets no hint: both probes are uniform draws
    assert pl.hinted_nodes(net.zone_summaries[1], pl.Demand(gpus=1)) == ()


def test_a_busy_steady_state_costs_at_most_2d_plus_2_messages_per_placement():
    # the placement benchmark's steady state at 100 nodes (a quarter of the nodes' worth of jobs
    # running, summaries refreshed every 50 placements): some nodes are full for one or two
    # GPUs, and two uniform probes would both miss them now and then; the hinted probe does not
    net = SimNet.build(100, 100, gpus_per_node=8, rng=random.Random(7), summaries=False)
    net.refresh_summaries()
    rng = random.Random(107)
    jobs = [pl.Demand(gpus=rng.choice((0.25, 0.5, 1.0, 1.0, 2.0, 4.0)), cpus=4, memory_mb=16_000) for _ in range(2000)]
    results, _cpu, msgs = run_placements(net, jobs, keep_running=25, interval_s=0.01, refresh_every=50)
    assert all(r.outcome == "placed" for r in results)
    assert msgs / len(jobs) <= pl.max_messages_per_attempt(pl.RetryPolicy().d)


def test_messages_per_placement_are_2d_plus_2_when_the_first_round_binds():
    net = SimNet.build(200, 100, rng=random.Random(8), fill=0.2)
    jobs = [pl.Demand(gpus=0.5, cpus=2, memory_mb=1000) for _ in range(50)]
    results, _cpu, msgs = run_placements(net, jobs, keep_running=100, interval_s=0.5)
    assert all(r.outcome == "placed" and r.steps == 1 for r in results)
    assert msgs == len(jobs) * pl.max_messages_per_attempt(2) == len(jobs) * 6
    assert set(net.by_type) <= {"Probe", "Offer", "Refuse", "Handover", "HandoverAck"}


def test_a_hinted_node_that_refused_the_shape_is_not_hinted_again_until_the_next_summary():
    net = SimNet.build(400, 400, gpus_per_node=4, rng=random.Random(3), fill=0.0)
    for n, a in net.arbiters.items():  # nodes 7 and 30 have four idle GPUs, the rest one
        a.inventory = pl.NodeCapacity(n, 1, (1.0,) * 4 if n in (7, 30) else (1.0, 0.0, 0.0, 0.0), 64, 512_000, "H100")
    net.refresh_summaries()
    # both fill up after the summary (jobs of other submitters): the hints are stale
    for n in (7, 30):
        net.arbiters[n].inventory = pl.NodeCapacity(n, 1, (0.0,) * 4, 64, 512_000, "H100")
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=2, zones=1, widen_steps=0))
    res = [asyncio.run(sub.place(pl.Demand(gpus=4), {"name": f"big{i}"})) for i in range(8)]
    assert all(r.outcome == "queued-out" for r in res)
    # each stale hint is probed once; then both probes are uniform draws again
    assert sum(7 in r.probed for r in res) == 1 and sum(30 in r.probed for r in res) == 1
    # the next summary (it knows they are full) hints nothing for the shape
    net.refresh_summaries()
    assert pl.hinted_nodes(net.zone_summaries[1], pl.Demand(gpus=4)) == ()


def test_a_late_offer_is_remembered_and_released_by_the_next_probe_to_its_node():
    # an offer that arrives after its placement ended (the router has nobody waiting) is
    # handed to the submitter, whose next probe to that node names it as a release
    from laminar.zone.transport import Router

    net = small_net()
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=4, zones=3))
    router = Router()
    router.on_late_offer = sub.note_late_offer
    assert router.route(5, wire.Offer(4242, 100, ((0, 100),))) is False
    assert router.late_offers == 1
    probe = demand_to_probe(pl.Demand(gpus=1), 77, lease_s=0.1)
    assert sub._with_releases(probe, 5).releases == (4242,)
    assert sub._with_releases(probe, 5).releases == ()  # sent once
    # once its lease has run out, a remembered offer is not named any more
    router.route(6, wire.Offer(4343, 100, ()))
    net.clock_s += 0.2
    assert sub._with_releases(probe, 6).releases == ()


def test_an_offer_whose_answer_was_still_on_its_way_is_released_by_the_next_probe():
    # two nodes of 4 GPUs; node 2's answers to the first placement are still in flight when
    # the placement binds node 1 (here: never delivered), but node 2 holds that offer
    net = SimNet.build(2, 2, gpus_per_node=4, rng=random.Random(3), fill=0.0)
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=2, zones=1, widen_steps=0))
    route, late = net._router_route, net._late_offer
    net._router_route = lambda node, body: False if node == 2 else route(node, body)  # type: ignore[method-assign]
    net._late_offer = None  # nor does it come late: it is still on its way
    first = asyncio.run(sub.place(pl.Demand(gpus=4), {"name": "a"}))
    assert first.outcome == "placed" and first.node == 1 and set(first.probed) == {1, 2}
    assert len(net.arbiters[2].held) == 1  # the unanswered offer holds all of node 2
    net._router_route, net._late_offer = route, late  # type: ignore[method-assign]
    # the next placement's probe to node 2 names it: node 2 lets it go and takes the job
    second = asyncio.run(sub.place(pl.Demand(gpus=4), {"name": "b"}))
    assert second.outcome == "placed" and second.node == 2, second.as_dict()
    assert net.arbiters[2].counts["releases"] == 1
