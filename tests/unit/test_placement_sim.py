"""The node and submitter halves of placement (laminar.zone.component.Arbiter / Submitter) over
the simulated transport (laminar.zone.simnet.SimNet, a FAKE network): the same code the agent
runs, with instant delivery and counted messages. No privileges."""

from __future__ import annotations

import asyncio
import random

from laminar.zone import placement as pl
from laminar.zone import wire
from laminar.zone.component import Arbiter, demand_to_probe
from laminar.zone.simnet import SimNet, run_placements


def small_net(nodes: int = 12, zone_size: int = 4, seed: int = 1) -> SimNet:
    return SimNet.build(nodes, zone_size, gpus_per_node=4, rng=random.Random(seed), fill=0.0)


def test_placements_fill_the_cluster_exactly_and_never_overcommit():
    net = small_net()
    sub = net.submitter(pl.RetryPolicy(d=2, d_max=4, zones=3))
    res = []

    async def go() -> None:
        for i in range(60):
            if i % 5 == 0:
                net.refresh_summaries()
            res.append(await sub.place(pl.Demand(gpus=1, cpus=1, memory_mb=100), {"name": f"j{i}"}))

    asyncio.run(go())
    placed = [r for r in res if r.outcome == "placed"]
    # 12 nodes x 4 GPUs: at most 48 jobs fit, and nearly all of them get placed
    assert 44 <= len(placed) <= 48
    for node, a in net.arbiters.items():
        used = [f for p in a.placed.values() for _, f in p.reservation.gpu_alloc]
        assert sum(used) <= 4 + 1e-9, (node, used)
        idx = [i for p in a.placed.values() for i, _ in p.reservation.gpu_alloc]
        assert len(set(idx)) == len(idx)
    assert not any(a.held for a in net.arbiters.values())  # every unbound offer was released


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
    assert a.bind(6, now=1.5) is None  # its lease ran out before the hand-over came
    assert a.view(2.0).gpu_free == (0.0, 1.0)
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


def test_offer_arriving_after_binding_is_released():
    net = small_net(nodes=4, zone_size=4)
    sub = net.submitter(pl.RetryPolicy(d=4, d_max=4, zones=1, widen_steps=0))
    r = asyncio.run(sub.place(pl.Demand(gpus=1), {"name": "x"}))
    assert r.outcome == "placed"
    # four offers came, one was bound: three releases, nothing left held anywhere
    assert net.by_type["Release"] == 3
    assert sum(len(a.held) for a in net.arbiters.values()) == 0
    assert sum(len(a.placed) for a in net.arbiters.values()) == 1


def test_no_fit_anywhere_is_queued_out_with_a_reason():
    net = small_net(nodes=4, zone_size=2)
    sub = net.submitter()
    r = asyncio.run(sub.place(pl.Demand(gpus=8), {"name": "too-big"}))
    assert r.outcome == "queued-out"
    assert "no zone" in r.reason
