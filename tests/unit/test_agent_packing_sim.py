"""The FGD allocation experiment run by the agents' packing mode (laminar.sim.agent_packing):
real Arbiters (``packing="frag"``) and a real Submitter (``packing=True``) over SimNet (a FAKE
network), on small synthetic clusters with openb-like node and pod shapes. No data files."""

from __future__ import annotations

import random

import pytest

from laminar.sim import allocation as A
from laminar.sim.agent_packing import allocated_gpus, build_net, run_agent_packing
from laminar.sim.trace import JobSpec, NodeSpec

# openb-like nodes: (GPUs, cores, memory MiB, model)
NODE_KINDS = ((8, 96.0, 786_432, "V100M32"), (4, 64.0, 262_144, "T4"), (2, 32.0, 131_072, "P100"),
              (8, 128.0, 786_432, "G2"))
# two zones (66 nodes, the simulator's zones are 64 nodes) of mostly 2-GPU nodes: small and fast
SMALL_KINDS = (NODE_KINDS[2],) * 3 + (NODE_KINDS[0],)
# pod shapes (GPUs, cores, MiB) whose GPU share is one a zone summary counts slots for exactly
EXACT_SHAPES = ((0.25, 4, 8_192), (0.5, 6, 16_384), (1.0, 8, 30_000), (2.0, 16, 60_000), (8.0, 64, 200_000),
                (0.0, 8, 16_000), (4.0, 24, 100_000))
# openb's odd shares too (0.16, 0.81, 0.1...): the summaries round them up to the next slot shape
ODD_SHAPES = EXACT_SHAPES[:4] + EXACT_SHAPES[5:] + ((0.1, 2, 4_096), (0.16, 4, 12_000), (0.81, 8, 24_000),
                                                   (0.47, 6, 16_384))


def cluster(n: int, seed: int, kinds: tuple[tuple[int, float, int, str], ...] = NODE_KINDS) -> list[NodeSpec]:
    r = random.Random(seed)
    return [NodeSpec(f"n{i}", *r.choice(kinds)) for i in range(n)]


def pods(k: int, seed: int, shapes: tuple[tuple[float, int, int], ...]) -> list[JobSpec]:
    r = random.Random(seed)
    return [JobSpec(f"p{i:03d}", 0.0, 1.0, 1, *r.choice(shapes)) for i in range(k)]


@pytest.mark.parametrize("n,seed", [(6, 1), (12, 2), (10, 7)])
def test_one_zone_exact_shapes_allocates_as_the_simulator(n: int, seed: int):
    """One zone (fewer than 64 nodes), every pod's GPU share one of the summaries' slot shapes,
    the workload's mix on every arbiter: the agents allocate exactly what the simulator's
    ``laminar-frag-wide`` does, failing the same pods. Here the summaries' ``zone_fit`` says
    0 only when no node can host the pod (the slot of an exact shape is a node that holds it),
    so the zone is probed whenever the simulator's exact count would probe it. It may probe
    when the simulator does not (``zone_fit`` ignores each node's CPUs and can over-promise):
    those probes are all refused, so they cost messages, never a different placement."""
    nodes, work = cluster(n, seed), pods(30, seed, EXACT_SHAPES)
    sim = A.run_allocation(nodes, work, "laminar-frag-wide", seed=seed)
    agent = run_agent_packing(nodes, work, seed=seed, mix="workload")
    assert agent.pods == sim.pods and agent.placed + agent.failed == agent.pods
    assert agent.failed == sim.failed
    assert agent.allocation_ratio_pct == pytest.approx(sim.allocation_ratio_pct, abs=1e-6)
    assert agent.messages >= sim.messages  # over-promising summaries cost probes, nothing else
    assert agent.probe_timeouts == 0


def test_exact_zone_counts_and_the_workload_mix_make_the_agents_the_simulator():
    """With what the simulator assumes, the zones chosen by the exact count of nodes that can
    host the pod (``zones="exact"``, a diagnostic) and the workload's mix on every arbiter,
    the real Arbiters and Submitter over SimNet make the simulator's decisions pod for pod,
    odd shares and two zones included: the same failures, allocation and messages. (What
    remains of the agent, its CPU milli-core flooring and the micro-GPU delta on the wire,
    changes nothing here.) The agent's own runs differ by the zone choice and the mix only."""
    nodes, work = cluster(66, 2, SMALL_KINDS), pods(30, 2, ODD_SHAPES)
    sim = A.run_allocation(nodes, work, "laminar-frag-wide", seed=2)
    agent = run_agent_packing(nodes, work, seed=2, mix="workload", zones="exact")
    assert sim.failed > 0 and sim.allocation_ratio_pct > 95  # saturated: the choices matter
    assert (agent.pods, agent.failed, agent.messages) == (sim.pods, sim.failed, sim.messages)
    assert agent.allocation_ratio_pct == pytest.approx(sim.allocation_ratio_pct, abs=1e-6)


@pytest.mark.parametrize("mix", ["workload", "learned"])
def test_odd_shapes_over_two_zones_keep_every_node_within_its_inventory(mix: str):
    """Odd GPU shares (0.1, 0.16, 0.81...) over two zones, a saturated cluster: the agents and the simulator may
    legitimately differ (the summaries round a 0.81 share up to a whole GPU's slot and can
    say no zone fits when a node has 0.9 free; the learned mix differs from the workload's),
    so only the invariants are asserted: no GPU, CPU or memory of any node is over-allocated
    (every arbiter's placed jobs against its inventory), every pod is placed or failed,
    the ratio is that of the placed jobs, and a placed pod costs at most a probe and an answer
    per node of the cluster (3 groups of zones at most) plus the hand-over and its answer."""
    nodes, work = cluster(66, 2, SMALL_KINDS), pods(30, 2, ODD_SHAPES)
    r = run_agent_packing(nodes, work, seed=2, mix=mix)
    assert r.placed + r.failed == r.pods > 30
    assert 0 < r.placed and 0 < r.allocation_ratio_pct <= 100.0
    assert r.messages <= r.pods * 2 * len(nodes) + 2 * r.placed
    assert r.probe_timeouts == 0
    capacity = float(sum(n.gpus for n in nodes))
    assert r.pods == len(A.inflate(work, capacity, 1.3, random.Random(2)))  # run_allocation's pod list


def test_the_overallocation_check_catches_a_gpu_given_twice():
    """``allocated_gpus`` (the check every run ends with) raises, naming the node, when two
    placed jobs share more than a GPU holds, and sums the placed GPUs otherwise."""
    import asyncio

    from laminar.sim.cluster import demand_of

    nodes = cluster(3, 5)
    net = build_net(nodes, None, seed=5)
    sub = net.submitter(A.FRAG_RETRY)
    res = asyncio.run(sub.place(demand_of(0.5, 2, 1024), {"name": "x"}, packing=True))
    assert res.outcome == "placed" and res.node is not None
    assert allocated_gpus(net) == pytest.approx(0.5)
    a = net.arbiters[res.node]
    placed = a.placed[res.placement_id]
    (gpu, _), = placed.reservation.gpu_alloc
    from dataclasses import replace

    a.placed[res.placement_id + 2] = replace(placed, reservation=replace(placed.reservation, gpu_alloc=((gpu, 0.75),)))
    with pytest.raises(AssertionError, match=f"node {res.node}: GPU {gpu} allocated 1.250"):
        allocated_gpus(net)


def test_bad_arguments_are_refused_by_name():
    nodes, work = cluster(3, 1), pods(5, 1, EXACT_SHAPES)
    with pytest.raises(ValueError, match="mix 'fixed'; choose one of workload, learned"):
        run_agent_packing(nodes, work, mix="fixed")
    with pytest.raises(ValueError, match="zones 'fit'; choose one of summary, exact"):
        run_agent_packing(nodes, work, zones="fit")
    with pytest.raises(ValueError, match="limit -1 must be >= 0"):
        run_agent_packing(nodes, work, limit=-1)
    with pytest.raises(ValueError, match="the node list is empty"):
        build_net([], None)
