"""Fragmentation-aware packing policy (laminar.policy.packing), checked by hand on tiny nodes."""

from __future__ import annotations

import pytest

from laminar.policy import packing as K
from laminar.policy.packing import FragOffer, PackingError, Resident, Shape

HALF = Shape(4000, 500, 1)
WHOLE = Shape(8000, 1000, 1)
CPU_ONLY = Shape(16000, 0, 0)
MIX = ((HALF, 0.5), (WHOLE, 0.5))


def test_shape_of_and_errors() -> None:
    assert K.shape_of(0.46, 6.0) == Shape(6000, 460, 1)
    assert K.shape_of(2, 16) == Shape(16000, 1000, 2)
    assert K.shape_of(0, 12.5) == Shape(12500, 0, 0)
    with pytest.raises(PackingError, match="1.5"):
        K.shape_of(1.5, 4)
    with pytest.raises(PackingError, match="num_gpus 2 with gpu_milli 0"):
        Shape(1000, 0, 2)
    with pytest.raises(PackingError, match="share is only for one GPU"):
        Shape(1000, 500, 2)


def test_shape_mix_keeps_popular_shapes_and_renormalizes() -> None:
    shapes = [HALF] * 6 + [WHOLE] * 3 + [CPU_ONLY]
    assert K.shape_mix(shapes, coverage=0.9) == ((HALF, 6 / 9), (WHOLE, 3 / 9))
    mix = K.shape_mix(shapes, coverage=1.0)
    assert [s for s, _ in mix] == [HALF, WHOLE, CPU_ONLY]
    assert sum(p for _, p in mix) == pytest.approx(1.0)
    with pytest.raises(PackingError, match="coverage"):
        K.shape_mix(shapes, coverage=0)
    with pytest.raises(PackingError, match="sum to"):
        K.check_mix(((HALF, 0.4),))


def test_node_frag_by_hand() -> None:
    # GPUs (1000, 500), 32 cores. HALF fits: no GPU below 500 -> 0. WHOLE fits: the 500 GPU
    # is below 1000 -> 500. Expected: 0.5*0 + 0.5*500 = 250.
    assert K.node_frag((1000, 500), 32000, MIX) == pytest.approx(250)
    # (500, 500): WHOLE cannot fit at all -> all 1000 free milli are fragment for it.
    assert K.node_frag((500, 500), 32000, MIX) == pytest.approx(0.5 * 0 + 0.5 * 1000)
    # Too few CPUs for either shape: everything free is fragment.
    assert K.node_frag((1000, 500), 3000, MIX) == pytest.approx(1500)
    # 6 cores: HALF fits (0), WHOLE lacks CPU -> 1500 * 0.5.
    assert K.node_frag((1000, 500), 6000, MIX) == pytest.approx(750)
    # A CPU-only shape can use none of the GPUs: all free GPU milli are its fragment.
    assert K.node_frag((1000, 0), 64000, ((CPU_ONLY, 1.0),)) == pytest.approx(1000)
    # Nothing free: no fragment.
    assert K.node_frag((0, 0), 64000, MIX) == 0
    # GPU order does not matter.
    assert K.node_frag((500, 1000), 32000, MIX) == K.node_frag((1000, 500), 32000, MIX)


def test_fgd_example_two_gpu_gang() -> None:
    # FGD's own kind of example: an 8-GPU node with 4 GPUs half used, mix of 2-GPU gangs only.
    gang = Shape(1000, 1000, 2)
    mix = ((gang, 1.0),)
    gpus = (1000, 1000, 1000, 1000, 500, 500, 500, 500)
    # the gang fits (4 idle GPUs); the four half GPUs are fragment: 2000
    assert K.node_frag(gpus, 64000, mix) == pytest.approx(2000)
    # 3 idle GPUs left after one whole GPU: still fits, fragment unchanged (2000)
    assert K.frag_delta(gpus, 64000, ((0, 1000),), 1000, mix) == pytest.approx(0)
    # only one idle GPU: the gang no longer fits, all 3000 free milli are fragment
    assert K.node_frag((1000, 0, 0, 0, 500, 500, 500, 500), 64000, mix) == pytest.approx(3000)


def test_alloc_options_and_choices() -> None:
    assert K.alloc_options((1000, 500, 300), HALF) == [((0, 500),), ((1, 500),)]
    assert K.alloc_options((1000, 0, 1000), Shape(1000, 1000, 2)) == [((0, 1000), (2, 1000))]
    assert K.alloc_options((1000, 500), Shape(1000, 1000, 2)) == []
    assert K.alloc_options((0,), CPU_ONLY) == [()]
    # half on the idle GPU 0: (500, 500) -> 500 (delta +250); on GPU 1: (1000, 0) -> 0 (-250)
    opts = [(a, K.frag_delta((1000, 500), 32000, a, 4000, MIX)) for a in K.alloc_options((1000, 500), HALF)]
    assert opts == [(((0, 500),), pytest.approx(250)), (((1, 500),), pytest.approx(-250))]
    assert K.least_frag_alloc((1000, 500), 32000, HALF, MIX) == (((1, 500),), pytest.approx(-250))
    got = K.fgd_alloc((1000, 500), 32000, HALF, MIX)
    assert got is not None and got[0] == ((1, 500),)
    assert got[1] == int(100 / (1 + 2.718281828459045 ** (-0.25)))  # sigmoid(0.25) -> 56
    assert K.least_frag_alloc((1000, 500), 3000, HALF, MIX) is None  # too few CPUs
    assert K.fgd_alloc((300,), 32000, HALF, MIX) is None


def test_fgd_score_quantizes() -> None:
    assert K.fgd_score(0) == 50
    assert K.fgd_score(-1000) == 73  # sigmoid(1) = 0.731
    assert K.fgd_score(1000) == 26  # sigmoid(-1) = 0.269
    assert K.fgd_score(10) == K.fgd_score(30)  # close deltas tie
    assert K.fgd_score(1e9) == 0 and K.fgd_score(-1e9) == 100


def test_pick_frag_offer() -> None:
    a = FragOffer(3, ((0, 500),), 100.0, 2000)
    b = FragOffer(1, ((1, 500),), -50.0, 4000)
    c = FragOffer(2, ((1, 500),), -50.0, 1500)
    assert K.pick_frag_offer([a, b, c]) == c  # least delta, then tighter
    assert K.pick_frag_offer([a]) == a
    assert K.pick_frag_offer([]) is None


def test_eviction_order() -> None:
    # Node: GPU 0 holds a 0.5 worker (id 7), GPU 1 a 0.3 worker (id 8); a WHOLE worker does
    # not fit. Moving 8 frees GPU 1 (whole), moving 7 frees GPU 0: both make room; the smaller
    # share (0.3) comes first.
    residents = [Resident(7, ((0, 500),), 4000), Resident(8, ((1, 300),), 2000)]
    got = K.eviction_order((500, 700), 20000, 10_000, residents, WHOLE, 1000, MIX)
    assert [(r.worker, a) for r, a, _ in got] == [(8, ((1, 1000),)), (7, ((0, 1000),))]
    # already fits: no move
    assert K.eviction_order((1000, 700), 20000, 10_000, residents, WHOLE, 1000, MIX) == []
    # not enough memory even after a move
    assert K.eviction_order((500, 700), 20000, 0, residents, WHOLE, 1000, MIX) == []
    with pytest.raises(PackingError, match="limit"):
        K.eviction_order((500, 700), 20000, 0, residents, WHOLE, 1000, MIX, limit=0)


def test_move_frees_by_hand() -> None:
    # GPU 0 holds a 0.3 worker (id 8) and has 700 free; GPU 1 holds a 0.5 worker (id 7).
    residents = [Resident(7, ((1, 500),), 4000), Resident(8, ((0, 300),), 2000)]
    # WHOLE (8 cores) does not fit now; moving 8 frees GPU 0, and 10 + 2 cores >= 8: hinted.
    assert K.move_frees((700, 500), 10000, residents, WHOLE)
    # HALF fits now (GPU 0 has 700): no move is needed, so no hint.
    assert not K.move_frees((700, 500), 10000, residents, HALF)
    # Too few CPUs even after the larger CPU release (6 + 4 < 16 for a 16-core whole GPU).
    assert not K.move_frees((700, 500), 6000, residents, Shape(16000, 1000, 1))
    # GPUs fit but CPUs do not: moving the CPU-only resident (id 9, 12 cores) frees them.
    cpu_res = [Resident(9, (), 12000)]
    assert K.move_frees((1000,), 2000, cpu_res, WHOLE)
    # A 2-GPU gang: one move frees only one GPU of the two busy ones: no hint.
    two = [Resident(1, ((0, 1000),), 1000), Resident(2, ((1, 1000),), 1000)]
    assert not K.move_frees((0, 0), 64000, two, Shape(1000, 1000, 2))
    assert K.move_frees((0, 0, 1000), 64000, two, Shape(1000, 1000, 2))


def test_hint_shape_maps_to_smallest_cover() -> None:
    hinted = [Shape(4000, 500, 1), Shape(8000, 500, 1), Shape(3000, 810, 1), Shape(8000, 1000, 1)]
    assert K.hint_shape(Shape(4000, 500, 1), hinted) == Shape(4000, 500, 1)  # itself
    # 0.46 with 6 cores: covered by (8000, 500) (share 500 >= 460, 8 >= 6 cores), not by
    # (4000, 500) (too few cores); (3000, 810) has too few cores.
    assert K.hint_shape(Shape(6000, 460, 1), hinted) == Shape(8000, 500, 1)
    # 0.2 with 2 cores: the smallest share covering it wins over the larger one.
    assert K.hint_shape(Shape(2000, 200, 1), hinted) == Shape(4000, 500, 1)
    # a 4-GPU gang: no hinted shape covers it: its GPU-only gang shape
    assert K.hint_shape(Shape(32000, 1000, 4), hinted) == Shape(0, 1000, 4)


def test_pick_evictions_order_and_limit() -> None:
    small = K.MoveCandidate(5, Resident(1, ((0, 300),), 1000), ((0, 1000),), 40.0)
    cpu = K.MoveCandidate(9, Resident(2, (), 12000), ((0, 500),), 10.0)
    small_better = K.MoveCandidate(7, Resident(3, ((1, 300),), 1000), ((1, 1000),), -20.0)
    big = K.MoveCandidate(1, Resident(4, ((0, 1000),), 1000), ((0, 1000),), -500.0)
    assert K.pick_evictions([small, cpu, small_better, big], 3) == [cpu, small_better, small]
    assert K.pick_evictions([], 2) == []
    with pytest.raises(PackingError, match="limit"):
        K.pick_evictions([small], 0)
