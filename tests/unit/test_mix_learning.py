"""The shape mix a "frag" arbiter learns from its probes (laminar.policy.mixlearn, Arbiter).

The learner must give the arrivals' mix from a node's filtered probe stream: retries of one
placement counted once, what the node saw while it was probed for every arrival weighing
more than what it sees once its zone is full for most demands, bounded memory, and the fixed
mix path untouched.
"""

from __future__ import annotations

import math
import random

import pytest

from laminar.policy import mixlearn as ml
from laminar.policy import packing as pk
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import DEFAULT_FRAG_MIX, MIX_MIN_SEEN, SHAPES_SEEN_MAX, Arbiter

SMALL = pk.Shape(2000, 250, 1)
HALF = pk.Shape(4000, 500, 1)
WHOLE = pk.Shape(8000, 1000, 1)
CPU = pk.Shape(8000, 0, 0)
ARRIVALS: pk.ShapeMix = ((WHOLE, 0.5), (HALF, 0.3), (SMALL, 0.2))


def draw(rng: random.Random, mix: pk.ShapeMix) -> pk.Shape:
    x = rng.random()
    for s, p in mix:
        x -= p
        if x < 0:
            return s
    return mix[-1][0]


def test_weighted_shape_mix_is_shape_mix_for_counts() -> None:
    rng = random.Random(3)
    shapes = [draw(rng, ARRIVALS) for _ in range(500)] + [CPU] * 7
    counts: dict[pk.Shape, float] = {}
    for s in shapes:
        counts[s] = counts.get(s, 0) + 1
    for cov in (0.5, 0.95, 1.0):
        got, want = ml.weighted_shape_mix(counts, cov), pk.shape_mix(shapes, cov)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [p for _, p in got] == pytest.approx([p for _, p in want])
    with pytest.raises(pk.PackingError, match="coverage"):
        ml.weighted_shape_mix(counts, 0)
    with pytest.raises(pk.PackingError, match="positive"):
        ml.weighted_shape_mix({})


def test_a_retried_placement_counts_once() -> None:
    """Placed demands (small) probed once; failing ones (whole GPUs) probed in 3 rounds at the
    same node: counted once each, the mix is the placements' and not the probes'."""
    m = ml.MixLearner(rate_window=0)
    pid = 0
    for k in range(400):
        pid += 1
        if k % 2:
            for _ in range(3):
                m.note(WHOLE, pid)
        else:
            m.note(SMALL, pid)
    assert m.repeats == 400
    assert dict(m.mix() or ()) == pytest.approx({WHOLE: 0.5, SMALL: 0.5}, abs=0.02)


def test_the_probes_of_a_filtered_stream_give_the_arrivals_mix() -> None:
    """A node probed for every arrival (one every 10 s) while its zone has room, then only
    for the small ones (its zone full for whole and half GPUs: a filtered, slower stream)
    for as long again: the learned mix stays near the arrivals' mix, where the last 512
    probes (the old rule) say the node sees small demands only."""
    rng = random.Random(11)
    m = ml.MixLearner()
    window: list[pk.Shape] = []
    t = 0.0
    pid = 0
    for phase in ("open", "full"):
        for _ in range(3000):
            t += 10.0
            pid += 1
            s = draw(rng, ARRIVALS)
            if phase == "full" and s != SMALL:
                continue  # not probed here: the zone's summary said no room
            m.note(s, pid, t)
            window = (window + [s])[-512:]
    assert pk.shape_mix(window) == ((SMALL, 1.0),)  # what the old rule scored with
    got = dict(m.mix() or ())
    assert ml.mix_distance(m.mix() or (), ARRIVALS) < 0.1, got
    assert got[WHOLE] > 0.4


def test_a_long_filtered_phase_weighs_by_the_rate_the_node_is_probed_at() -> None:
    """The filtered phase lasts 20,000 arrivals (4,000 probes, about a half-life): counted
    one for one it outweighs the open phase (the mix three quarters small demands); weighed
    by the share of the arrivals the node is probed for (a fifth), the open phase still
    holds about half the weight and whole GPUs keep a third of the mix."""
    def run(rate_window: int) -> dict[pk.Shape, float]:
        rng = random.Random(12)
        m = ml.MixLearner(rate_window=rate_window)
        t = 0.0
        for pid in range(23_000):
            t += 10.0
            s = draw(rng, ARRIVALS)
            if pid < 3000 or s == SMALL:
                m.note(s, pid, t)
        return dict(m.mix() or ())
    weighed, counted = run(ml.RATE_WINDOW), run(0)
    assert counted[SMALL] > 0.65 and counted[WHOLE] < 0.2
    assert weighed[SMALL] < 0.55 and weighed[WHOLE] > 0.3


def test_the_mix_follows_a_workload_that_changed() -> None:
    """The memory decays: after many half-lives of a new mix the old shapes are gone."""
    m = ml.MixLearner(half_life=200, rate_window=0, change=0.0)
    for pid in range(1000):
        m.note(WHOLE, pid)
    for pid in range(1000, 3000):
        m.note(SMALL, pid)
    assert m.mix() == ((SMALL, 1.0),)


def test_memory_is_bounded() -> None:
    """Thousands of distinct shapes and placements: the counts and the remembered ids stay
    within their bounds, and the weight is rescaled (finite) over a long run."""
    m = ml.MixLearner(half_life=50, max_shapes=64, recent_ids=32)
    for pid in range(20_000):
        m.note(pk.Shape(1000 + pid % 5000, 500, 1), pid, pid * 0.5)
        assert len(m.counts) <= 64 and len(m._recent) <= 32
    assert m._inc <= 1e100 and all(math.isfinite(w) and w >= 0 for w in m.counts.values())
    assert m.mix() is not None


def test_the_mix_object_stays_while_it_does_not_move() -> None:
    """A stationary stream: the recomputed mix differs by sampling noise only, so the same
    object is kept (scores are cached per mix), and a real change replaces it."""
    rng = random.Random(5)
    m = ml.MixLearner(rate_window=0, change=0.05)
    for pid in range(2000):
        m.note(draw(rng, ARRIVALS), pid)
    first = m.mix()
    for pid in range(2000, 2400):
        m.note(draw(rng, ARRIVALS), pid)
        assert m.mix() is first
    for pid in range(2400, 2400 + 3 * ml.HALF_LIFE):
        m.note(CPU, pid)
    assert m.mix() is not first and dict(m.mix() or ())[CPU] > 0.5


def test_bad_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="half_life 0"):
        ml.MixLearner(half_life=0)
    with pytest.raises(ValueError, match="rate_window 1"):
        ml.MixLearner(rate_window=1)
    with pytest.raises(ValueError, match="max_shapes -1"):
        ml.MixLearner(max_shapes=-1)


def node() -> pl.NodeCapacity:
    return pl.NodeCapacity(1, 1, (1.0,) * 8, 128.0, 1 << 20, None)


def probe(pid: int, s: pk.Shape) -> wire.Probe:
    return wire.Probe(pid, s.total_gpu_milli // 10, s.cpu_milli, 1024, 50)


def test_arbiter_learns_from_its_probes_once_per_placement() -> None:
    a = Arbiter(node(), packing="frag")
    assert a.shape_mix() == DEFAULT_FRAG_MIX
    for pid in range(1, MIX_MIN_SEEN + 1):
        a.on_probe(probe(pid, HALF), 100.0 + pid)
    assert a.shape_mix() == ((HALF, 1.0),)
    # a refused placement probed again in later rounds counts once
    full = Arbiter(pl.NodeCapacity(1, 1, (0.0,), 1.0, 1024, None), packing="frag")
    for rnd in range(3):
        for pid in range(1, 41):
            full.on_probe(probe(pid, WHOLE if pid % 2 else SMALL), 100.0 + rnd + pid / 100)
    assert full.mix_learner.seen == 40 and full.mix_learner.repeats == 80
    assert dict(full.shape_mix()) == pytest.approx({WHOLE: 0.5, SMALL: 0.5}, abs=0.01)
    assert SHAPES_SEEN_MAX == a.mix_learner.max_shapes


def test_arbiter_with_a_fixed_mix_scores_with_it_and_learns_nothing() -> None:
    mix = ((WHOLE, 0.6), (SMALL, 0.4))
    a = Arbiter(node(), packing="frag", mix=mix)
    for pid in range(1, 200):
        o = a.on_probe(probe(pid, HALF), 100.0 + pid)
        assert isinstance(o, wire.Offer) and o.frag is not None
    assert a.shape_mix() is mix and a.mix_learner.seen == 0


@pytest.mark.parametrize("mix", ["learned", "pooled"])
def test_mix_trace_and_the_pooled_diagnostic_on_a_small_cluster(mix: str) -> None:
    """laminar.sim.agent_packing on 70 synthetic nodes (two zones): MixTrace reports the mixes'
    distances; in the pooled diagnostic every arbiter holds the same learner, which counted
    each probed placement once, where ``learned`` gives each its own."""
    from laminar.sim import allocation as A
    from laminar.sim.agent_packing import MixTrace, run_agent_packing
    from laminar.sim.trace import JobSpec, NodeSpec
    from laminar.zone.component import PlacementResult
    from laminar.zone.simnet import SimNet

    r = random.Random(4)
    nodes = [NodeSpec(f"n{i}", *r.choice(((2, 32.0, 131_072, "P100"), (8, 96.0, 786_432, "V100M32"))))
             for i in range(70)]
    shapes = ((0.25, 4, 8_192), (0.5, 6, 16_384), (1.0, 8, 30_000), (0.0, 8, 16_000))
    work = [JobSpec(f"p{i:03d}", 0.0, 1.0, 1, *r.choice(shapes)) for i in range(120)]
    ref = A.workload_mix(A.inflate(work, float(sum(n.gpus for n in nodes)), 1.3, random.Random(4)))
    trace = MixTrace(ref, 40)
    learners: set[int] = set()
    probed: set[int] = set()

    def observe(i: int, pod: JobSpec, res: PlacementResult, net: SimNet) -> None:
        trace(i, pod, res, net)
        if res.probed:
            probed.add(res.placement_id)
        learners.update(id(a.mix_learner) for a in net.arbiters.values())
        if mix == "pooled":
            assert next(iter(net.arbiters.values())).mix_learner.seen == len(probed)

    res = run_agent_packing(nodes, work, seed=4, mix=mix, observe=observe)
    assert res.placed > 0 and len(trace.rows) == res.pods // 40
    assert len(learners) == (1 if mix == "pooled" else len(nodes))
    last = trace.rows[-1]
    assert isinstance(last["node_tv_workload"], float) and 0.0 <= last["node_tv_workload"] <= 1.0
    assert last["repeat_probes"] == 0
    with pytest.raises(ValueError, match="every 0"):
        MixTrace(ref, 0)
