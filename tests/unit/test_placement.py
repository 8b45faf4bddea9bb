"""The placement policy (laminar.policy.placement): pure functions, no privileges."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.policy import placement as pl
from laminar.policy.placement import (
    Demand,
    NodeCapacity,
    Offer,
    PlacementError,
    Probe,
    Queue,
    Refusal,
    RefuseReason,
    Reservation,
    RetryPolicy,
)


def node(gpus=(1.0, 1.0, 1.0, 1.0), cpus=32.0, mem=128_000, model="H100", pool=None, n=1, zone=1, draining=False):
    return NodeCapacity(n, zone, tuple(gpus), cpus, mem, model, pool, draining)


def test_demand_rejects_bad_values_with_their_value():
    with pytest.raises(PlacementError, match="gpus -1"):
        Demand(gpus=-1)
    with pytest.raises(PlacementError, match="multiple of 0.01"):
        Demand(gpus=0.333)
    with pytest.raises(PlacementError, match="memory_mb"):
        Demand(memory_mb=-5)
    with pytest.raises(PlacementError, match="cpus"):
        Demand(cpus=float("nan"))


def test_node_rejects_bad_gpu_fraction():
    with pytest.raises(PlacementError, match="gpu 1 free fraction 1.5"):
        node(gpus=(1.0, 1.5))


def test_allocate_whole_and_fractional_best_fit():
    assert pl.allocate_gpus((1.0, 0.5, 1.0), 2) == ((0, 1.0), (2, 1.0))
    # the half-used GPU takes the half share; idle GPUs stay whole
    assert pl.allocate_gpus((1.0, 0.5, 1.0), 0.5) == ((1, 0.5),)
    assert pl.allocate_gpus((1.0, 0.5, 1.0), 1.5) == ((0, 1.0), (1, 0.5))
    assert pl.allocate_gpus((1.0, 0.5), 2) is None
    assert pl.allocate_gpus((0.25, 0.25), 0.5) is None
    assert pl.allocate_gpus((), 0) == ()


def test_fits_reasons_in_order():
    assert pl.fits(node(), Demand(gpus=4, cpus=32, memory_mb=128_000)) is None
    assert pl.fits(node(), Demand(gpus=5)) is RefuseReason.NO_GPU
    assert pl.fits(node(), Demand(gpus=1, gpu_model="A100")) is RefuseReason.GPU_MODEL
    assert pl.fits(node(), Demand(cpus=33)) is RefuseReason.NO_CPU
    assert pl.fits(node(), Demand(memory_mb=200_000)) is RefuseReason.NO_MEMORY
    assert pl.fits(node(draining=True), Demand()) is RefuseReason.DRAINING
    # a CPU-only job ignores the GPU model
    assert pl.fits(node(gpus=()), Demand(gpus=0, gpu_model="A100")) is None


def test_arbitrate_counts_held_reservations_and_leases_expire():
    n = node(gpus=(1.0, 1.0))
    d = Demand(gpus=1, cpus=4, memory_mb=1000)
    held: list[Reservation] = []
    for pid in (1, 2):
        a = pl.arbitrate(n, held, d, 10.0, placement_id=pid, lease_s=2.0)
        assert isinstance(a, Offer)
        held.append(a.reservation)
    assert {r.gpu_alloc[0][0] for r in held} == {0, 1}
    third = pl.arbitrate(n, held, d, 10.5, placement_id=3, lease_s=2.0)
    assert third == Refusal(1, RefuseReason.NO_GPU)
    # once the leases run out the capacity is back
    later = pl.arbitrate(n, held, d, 12.0, placement_id=3, lease_s=2.0)
    assert isinstance(later, Offer)


def test_arbitrate_is_idempotent_per_placement():
    n = node(gpus=(1.0,))
    d = Demand(gpus=1)
    a = pl.arbitrate(n, [], d, 0.0, placement_id=9, lease_s=1.0)
    assert isinstance(a, Offer)
    again = pl.arbitrate(n, [a.reservation], d, 0.5, placement_id=9, lease_s=1.0)
    assert again == a


def test_arbitrate_busy_limit_and_bad_lease():
    n = node()
    held = [Reservation(i, Demand(gpus=0, cpus=0, memory_mb=0), (), 100.0) for i in range(3)]
    assert pl.arbitrate(n, held, Demand(), 0.0, placement_id=99, lease_s=1, max_tentative=3).reason is RefuseReason.BUSY
    with pytest.raises(PlacementError, match="lease_s 0"):
        pl.arbitrate(n, [], Demand(), 0.0, placement_id=1, lease_s=0)


def test_commit_extends_lease_once_and_refuses_expired():
    r = Reservation(5, Demand(), (), expires_at=2.0)
    c = pl.commit([r], 5, now=1.0, hold_s=30.0)
    assert c is not None and c.committed and c.expires_at == 31.0
    assert pl.commit([c], 5, now=2.0, hold_s=30.0) == c
    assert pl.commit([r], 5, now=3.0, hold_s=30.0) is None
    assert pl.commit([r], 6, now=1.0, hold_s=30.0) is None


@settings(max_examples=200, deadline=None)
@given(
    gpus=st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=0, max_size=8),
    demands=st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=20),
)
def test_arbitration_never_overcommits(gpus, demands):
    """Whatever the sequence of probes, the offers held never exceed any GPU, CPUs or memory."""
    n = node(gpus=tuple(gpus), cpus=16, mem=64_000)
    held: list[Reservation] = []
    for pid, g in enumerate(demands):
        a = pl.arbitrate(n, held, Demand(gpus=g, cpus=3, memory_mb=10_000), 0.0, placement_id=pid, lease_s=5)
        if isinstance(a, Offer):
            held.append(a.reservation)
    used = [0.0] * len(gpus)
    for r in held:
        assert abs(sum(f for _, f in r.gpu_alloc) - r.demand.gpus) < 1e-6
        for i, f in r.gpu_alloc:
            used[i] += f
    assert all(u <= g + 1e-6 for u, g in zip(used, gpus, strict=True))
    assert sum(r.demand.cpus for r in held) <= 16
    assert sum(r.demand.memory_mb for r in held) <= 64_000


def test_zone_summary_and_fit():
    nodes = [
        node(gpus=(1.0, 1.0, 1.0, 1.0), n=1),
        node(gpus=(0.5, 0.0), n=2),
        node(gpus=(), model=None, n=3, cpus=8, mem=8000),
        node(gpus=(1.0, 1.0), n=4, draining=True),
    ]
    s = pl.summarize_zone(7, nodes, issued_at=3.0)
    assert s.nodes == 4
    by_shape = dict(zip(pl.SHAPES, s.slots, strict=True))
    assert by_shape[0.0] == 3  # draining node counts for nothing
    assert by_shape[0.5] == 8 + 1
    assert by_shape[1.0] == 4
    assert by_shape[2.0] == 2
    assert by_shape[8.0] == 0
    assert s.gpu_models == ("H100",)
    assert pl.zone_fit(s, Demand(gpus=2, cpus=1, memory_mb=1)) == 2
    assert pl.zone_fit(s, Demand(gpus=0.3, cpus=1, memory_mb=1)) == 9  # counted as 0.5 shape
    assert pl.zone_fit(s, Demand(gpus=1, gpu_model="A100")) == 0
    assert pl.zone_fit(s, Demand(gpus=16)) == 0
    # CPUs bound the estimate: summed over the zone in a summary without host buckets (an
    # older peer's); per node with them, and no node has 36 free CPUs
    old = pl.summarize_zone(7, nodes, issued_at=3.0, hosts=False)
    assert pl.zone_fit(old, Demand(gpus=0, cpus=36, memory_mb=1)) == 2
    assert pl.zone_fit(s, Demand(gpus=0, cpus=36, memory_mb=1)) == 0
    assert pl.zone_fit(old, Demand(gpus=0, cpus=20, memory_mb=1)) == 3  # 72 CPUs / 20
    assert pl.zone_fit(s, Demand(gpus=0, cpus=20, memory_mb=1)) == 2  # nodes 1 and 2 (32 CPUs): one each


def test_choose_zone_is_proportional_to_fit():
    rng = random.Random(1)
    fits = {1: 1.0, 2: 3.0, 3: 0.0}
    c = Counter(pl.choose_zone(fits, rng) for _ in range(20_000))
    assert c[3] == 0
    assert 2.6 < c[2] / c[1] < 3.4
    assert pl.choose_zone(fits, rng, exclude=[1, 2]) is None
    assert pl.choose_zone({}, rng) is None


def test_probe_targets_distinct_excluding_and_preferring():
    rng = random.Random(2)
    members = list(range(100_000))
    t = pl.probe_targets(members, 4, rng, exclude={0, 1})
    assert len(set(t)) == 4 and not {0, 1} & set(t)
    assert sorted(pl.probe_targets([1, 2, 3], 5, rng, exclude={2})) == [1, 3]
    t = pl.probe_targets(members, 3, rng, preferred=[7, 8])
    assert {7, 8} <= set(t) and len(t) == 3
    assert pl.probe_targets(members, 0, rng) == []
    with pytest.raises(PlacementError):
        pl.probe_targets(members, -1, rng)


def test_pick_offer_late_binding():
    r = lambda pid, exp: Reservation(pid, Demand(), (), exp)  # noqa: E731
    stale = Offer(1, 1, None, r(1, 1.0))
    good = Offer(2, 1, None, r(1, 5.0))
    later = Offer(3, 1, None, r(1, 9.0))
    assert pl.pick_offer([Refusal(4, RefuseReason.NO_CPU), stale, good, later], now=2.0) is good
    assert pl.pick_offer([good], now=4.5, margin_s=1.0) is None
    assert pl.pick_offer([], now=0.0) is None


def test_retry_schedule_widens_then_moves_then_queues():
    s = pl.retry_schedule(RetryPolicy())
    assert s == [Probe(0, 2), Probe(0, 4), Probe(1, 2), Probe(1, 4), Probe(2, 2), Probe(2, 4), Queue(1.0)]
    assert pl.retry_schedule(RetryPolicy(zones=1, widen_steps=2, d_max=6), round=3) == [
        Probe(0, 2),
        Probe(0, 4),
        Probe(0, 6),
        Queue(8.0),
    ]
    assert pl.retry_schedule(RetryPolicy(), round=50)[-1] == Queue(30.0)
    with pytest.raises(PlacementError, match="d_max"):
        RetryPolicy(d=4, d_max=2)


def test_zone_summary_hints_name_nodes_with_room_for_every_shape_some_node_lacks():
    rng = random.Random(5)
    # 20 nodes: 4 have 4 idle GPUs (room for the 4-GPU shape), all have room for 1 GPU
    nodes = [NodeCapacity(i, 1, (1.0,) * (4 if i < 4 else 1), 8, 8000) for i in range(20)]
    s = pl.summarize_zone(1, nodes, 3.0, rng=rng, hints=3)
    k4, k1 = pl.shape_index(4), pl.shape_index(1)
    assert len(s.hints) == len(pl.SHAPES)
    assert len(s.hints[k4]) == 3 and set(s.hints[k4]) <= {0, 1, 2, 3}
    assert s.hints[k1] == ()  # every node takes one GPU: a uniform probe does, no hint needed
    assert pl.hinted_nodes(s, Demand(gpus=4)) == s.hints[k4]
    assert pl.hinted_nodes(s, Demand(gpus=3)) == s.hints[k4]  # counted against the next shape up
    assert pl.hinted_nodes(s, Demand(gpus=1)) == ()
    assert pl.summarize_zone(1, nodes).hints == ()  # without hints asked for: none
    # a draining node, or one without CPUs left, is never hinted
    busy = [NodeCapacity(0, 1, (1.0,) * 4, 0, 8000), NodeCapacity(1, 1, (1.0,) * 4, 8, 8000, draining=True)]
    assert pl.summarize_zone(1, busy + nodes[4:], rng=rng, hints=3).hints[k4] == ()
    with pytest.raises(PlacementError, match="hints 99"):
        pl.summarize_zone(1, nodes, rng=rng, hints=99)
    # one node of the twenty is full: the one-GPU shape is hinted too (nineteen have room)
    full = [NodeCapacity(0, 1, (0.0,) * 4, 8, 8000)] + nodes[1:]
    s = pl.summarize_zone(1, full, 3.0, rng=rng, hints=3)
    assert len(s.hints[k1]) == 3 and 0 not in s.hints[k1]


def test_zone_summary_hints_are_a_uniform_sample():
    rng = random.Random(6)
    nodes = [NodeCapacity(i, 1, (1.0,) * (8 if i % 10 == 0 else 0), 8, 8000) for i in range(1000)]
    seen: dict[int, int] = {}
    for _ in range(300):
        for n in pl.summarize_zone(1, nodes, rng=rng, hints=4).hints[pl.shape_index(8)]:
            seen[n] = seen.get(n, 0) + 1
    assert set(seen) <= {i for i in range(0, 1000, 10)}
    assert len(seen) > 90  # nearly every one of the 100 eligible nodes named at some point


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 50), st.sampled_from([0.0, 1.0, 2.5, 7.0, 100.0, float("inf")]), max_size=12),
       st.integers(0, 2**32 - 1))
def test_zone_table_draws_what_choose_zone_draws(fits, seed):
    tab = pl.ZoneTable.of(fits)
    a, b = random.Random(seed), random.Random(seed)
    for _ in range(20):
        assert tab.choose(a) == pl.choose_zone(fits, b)
    excl = sorted(fits)[:1]
    assert tab.choose(a, exclude=excl) == pl.choose_zone(fits, b, exclude=excl)


def test_a_gpu_model_matches_by_name_or_a_run_of_its_words():
    h100 = "NVIDIA H100 80GB HBM3"  # what NVML calls it, and what the node advertises
    for want in ("H100", "h100", "H100 80GB", "nvidia-h100", h100):
        assert pl.model_matches(want, h100), want
    for want in ("A100", "H10", "80GB H100", "H100 PCIe"):
        assert not pl.model_matches(want, h100), want
    assert not pl.model_matches("A10", "NVIDIA A100-SXM4-40GB")
    assert pl.model_matches("A100", "NVIDIA A100-SXM4-40GB")
    assert not pl.model_matches("H100", None) and not pl.model_matches("H100", "")
    node = NodeCapacity(1, 1, (1.0,), 8, 8000, h100)
    assert pl.fits(node, Demand(gpus=1, gpu_model="H100")) is None
    assert pl.fits(node, Demand(gpus=1, gpu_model="A100")) == pl.RefuseReason.GPU_MODEL
    s = pl.summarize_zone(1, [node])
    assert pl.zone_fit(s, Demand(gpus=1, gpu_model="H100")) > 0
    assert pl.zone_fit(s, Demand(gpus=1, gpu_model="A100")) == 0
