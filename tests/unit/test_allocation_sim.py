"""The allocation experiment (laminar.sim.allocation) on tiny node lists checked by hand."""

from __future__ import annotations

import random

import pytest

from laminar.policy import packing as K
from laminar.policy import placement as P
from laminar.sim import allocation as A
from laminar.sim.cluster import BestFitPlacer, SimNode
from laminar.sim.trace import JobSpec, NodeSpec


def pod(i: int, gpus: float, cpus: float = 1.0) -> JobSpec:
    return JobSpec(f"p{i:03d}", 0.0, 0.0, 1, gpus, cpus, 1024)


def test_inflate_reaches_ratio_without_passing_it() -> None:
    pods = [pod(0, 1.0), pod(1, 0.5)]
    work = A.inflate(pods, 10.0, 1.3, random.Random(3))
    total = sum(p.gpus for p in work)
    assert 13.0 - 1.0 < total <= 13.0
    assert A.inflate(pods, 10.0, 1.3, random.Random(3)) == work  # deterministic for a seed


def test_workload_mix_counts_worker_shapes() -> None:
    pods = [pod(0, 0.5, 4), pod(1, 0.5, 4), pod(2, 1.0, 8), pod(3, 0.0, 2)]
    mix = A.workload_mix(pods, coverage=1.0)
    assert dict(mix) == {K.Shape(4000, 500, 1): 0.5, K.Shape(8000, 1000, 1): 0.25, K.Shape(2000, 0, 0): 0.25}


def test_fgd_placer_prefers_the_node_it_fragments_least() -> None:
    # Node 0 has GPU (0.5 free, 1.0 free), node 1 two idle GPUs. Mix: half and whole GPUs.
    # A half worker on node 0's half-free GPU leaves (0, 1000): fragment 0 (delta -250 from 250).
    # On node 1: (500, 1000) -> 250 (delta +250). FGD takes node 0, GPU 0.
    specs = [NodeSpec("a", 2, 32.0, 64_000), NodeSpec("b", 2, 32.0, 64_000)]
    nodes = [SimNode.from_spec(i, s, 0) for i, s in enumerate(specs)]
    nodes[0].take(1, "x", ((0, 0.5),), 1.0, 1024, False)
    mix = ((K.Shape(4000, 500, 1), 0.5), (K.Shape(8000, 1000, 1), 0.5))
    fgd = A.FgdPlacer(nodes, mix, random.Random(1))
    got = fgd.place(nodes, 0.5, 4.0, 1024, 0.0)
    assert got is not None and got[0] is nodes[0] and got[1] == ((0, 0.5),)
    # a worker that fits nowhere
    assert fgd.place(nodes, 4.0, 4.0, 1024, 0.0) is None


def test_allocation_by_hand_tiny_cluster() -> None:
    # Two 2-GPU nodes (4 GPUs). Pods: 1 whole + 0.5 GPUs, tuned to 1.3 x 4 = 5.2 GPUs. Every
    # placement can fit all of 4 GPUs only if the halves pair up on shared GPUs.
    nodes = [NodeSpec("a", 2, 64.0, 1_000_000), NodeSpec("b", 2, 64.0, 1_000_000)]
    pods = [pod(0, 1.0), pod(1, 0.5)]
    for pl in A.PLACEMENTS:
        r = A.run_allocation(nodes, pods, pl, seed=7)
        work = A.inflate(pods, 4.0, 1.3, random.Random(7))
        assert r.pods == len(work)
        assert 0 < r.allocation_ratio_pct <= 100
        placed = sum(p.gpus for p in work) - 0  # upper bound on what could be allocated
        assert r.allocation_ratio_pct <= 100 * min(4.0, placed) / 4.0
        assert r.curve[-1][0] == pytest.approx(100 * sum(p.gpus for p in work) / 4.0)
        assert r.failed >= 1  # 5.2 GPUs arrived for 4
        assert A.run_allocation(nodes, pods, pl, seed=7).allocation_ratio_pct == r.allocation_ratio_pct


def test_frag_placements_fill_whole_gpus_with_halves() -> None:
    # Only half-GPU pods: a fragmentation-aware placement pairs them, so all 4 GPUs fill.
    nodes = [NodeSpec("a", 2, 64.0, 1_000_000), NodeSpec("b", 2, 64.0, 1_000_000)]
    pods = [pod(0, 0.5)]
    for pl in ("fgd", "laminar-frag", "bestfit"):
        assert A.run_allocation(nodes, pods, pl, seed=1).allocation_ratio_pct == pytest.approx(100.0)


def test_readdress_moves_a_resident_to_make_room() -> None:
    # Node a: one GPU. Node b: one GPU. Arrivals in order: 0.5 (lands somewhere), 0.5 on the
    # other node when it would fragment... drive the hop directly: a holds 0.3, b holds 0.6;
    # a whole-GPU pod fits nowhere, but moving a's 0.3 next to b's 0.6 frees GPU a.
    specs = [NodeSpec("a", 1, 32.0, 64_000), NodeSpec("b", 1, 32.0, 64_000)]
    nodes = [SimNode.from_spec(i, s, 0) for i, s in enumerate(specs)]
    nodes[0].take(1, "small", ((0, 0.3),), 1.0, 1024, False)
    nodes[1].take(2, "big", ((0, 0.6),), 1.0, 1024, False)
    mix = ((K.Shape(1000, 1000, 1), 0.5), (K.Shape(1000, 300, 1), 0.5))
    placer = A.FragProbePlacer(nodes, random.Random(1), mix, A.FRAG_RETRY, "first", True)
    p = pod(9, 1.0)
    assert placer.place(nodes, 1.0, 1.0, 1024, 0.0) is None
    got, moves = A._readdress_frag(nodes, placer, p, random.Random(2), 2)
    assert moves == 1 and got is not None
    node, alloc = got
    assert node is nodes[0] and alloc == ((0, 1.0),)
    assert 1 in nodes[1].workers and nodes[1].gpu_free[0] == pytest.approx(0.1)


def test_bad_placement_name() -> None:
    with pytest.raises(ValueError, match="placement 'nope'"):
        A.run_allocation([NodeSpec("a", 1, 1.0, 1024)], [pod(0, 1.0)], "nope")


def _hinted(specs: list[NodeSpec], zones: list[int], mix: K.ShapeMix) -> tuple[list[SimNode], A.HintedFragPlacer]:
    nodes = [SimNode.from_spec(i, s, z) for i, (s, z) in enumerate(zip(specs, zones, strict=True))]
    return nodes, A.HintedFragPlacer(nodes, random.Random(1), mix, A.FRAG_RETRY, "first", True)


def test_move_hints_name_the_nodes_one_move_frees() -> None:
    # Zone 0: a (0.3 used), b (0.5 + 0.5 used: one move leaves 0.5 busy, never a whole GPU).
    # Zone 1: c (0.6 used). A whole-GPU worker fits nowhere; one move frees a or c, not b.
    specs = [NodeSpec(n, 1, 32.0, 64_000) for n in "abc"]
    mix = ((K.Shape(1000, 1000, 1), 0.5), (K.Shape(1000, 300, 1), 0.5))
    nodes, placer = _hinted(specs, [0, 0, 1], mix)
    nodes[0].take(1, "x", ((0, 0.3),), 1.0, 1024, False)
    nodes[1].take(2, "y", ((0, 0.5),), 1.0, 1024, False)
    nodes[1].take(3, "z", ((0, 0.5),), 1.0, 1024, False)
    nodes[2].take(4, "w", ((0, 0.6),), 1.0, 1024, False)
    whole = K.Shape(1000, 1000, 1)
    assert placer.move_hints(0, whole) == (0,)
    assert placer.move_hints(1, whole) == (2,)
    # a 0.3 worker fits on a now (0.7 free): no hint for a; b is full, and moving one of its
    # 0.5 workers makes room: b is hinted
    assert placer.move_hints(0, K.Shape(1000, 300, 1)) == (1,)
    # a change of state is seen after touch(): a fills up, so it is no longer a one-move host
    nodes[0].take(5, "v", ((0, 0.7),), 1.0, 1024, False)
    placer.touch(nodes[0])
    assert placer.move_hints(0, whole) == ()


def test_hinted_hop_moves_one_resident_and_counts_messages() -> None:
    # a holds 0.3 (zone 0), c holds 0.6 (zone 1). The whole-GPU pod fails; the hint for zone
    # 0 names a; a's 0.3 moves next to c's 0.6 (the only room), and the pod takes a's GPU.
    specs = [NodeSpec(n, 1, 32.0, 64_000) for n in "ac"]
    mix = ((K.Shape(1000, 1000, 1), 0.5), (K.Shape(1000, 300, 1), 0.5))
    nodes, placer = _hinted(specs, [0, 1], mix)
    nodes[0].take(1, "small", ((0, 0.3),), 1.0, 1024, False)
    nodes[1].take(2, "big", ((0, 0.6),), 1.0, 1024, False)
    p = pod(9, 1.0)
    assert placer.place(nodes, 1.0, 1.0, 1024, 0.0) is None
    before = placer.messages
    got, moves = A._readdress_hinted(nodes, placer, p)
    assert moves == 1 and got is not None
    node, alloc = got
    assert node is nodes[0] and alloc == ((0, 1.0),)
    assert 1 in nodes[1].workers and nodes[1].gpu_free[0] == pytest.approx(0.1)
    # 1 hinted probe + answer, the resident's placement (zone 1: 1 probe, 1 answer, 2 to
    # bind), 2 to bind the pod: 2 + 4 + 2
    assert placer.hop_messages == 8 and placer.messages - before == 8


def test_hinted_hop_gives_up_when_the_resident_has_no_home() -> None:
    # Both nodes hold 0.6: either could host a whole GPU after one move, but the moved 0.6
    # fits nowhere else (0.4 free): no move, nothing changes.
    specs = [NodeSpec(n, 1, 32.0, 64_000) for n in "ab"]
    mix = ((K.Shape(1000, 1000, 1), 0.5), (K.Shape(1000, 600, 1), 0.5))
    nodes, placer = _hinted(specs, [0, 0], mix)
    nodes[0].take(1, "x", ((0, 0.6),), 1.0, 1024, False)
    nodes[1].take(2, "y", ((0, 0.6),), 1.0, 1024, False)
    assert placer.move_hints(0, K.Shape(1000, 1000, 1)) == (0, 1)
    got, moves = A._readdress_hinted(nodes, placer, pod(9, 1.0))
    assert (got, moves) == (None, 0)
    assert [n.gpu_free[0] for n in nodes] == [pytest.approx(0.4), pytest.approx(0.4)]
    assert set(nodes[0].workers) == {1} and set(nodes[1].workers) == {2}


def test_wide_round_compares_two_zones() -> None:
    # Zone 0: a, an idle 1-GPU node. Zone 1: b, a 1-GPU node with 0.5 used. A 0.5 worker on a
    # leaves (500) free: fragment for the whole-GPU half of the mix; on b it fills the GPU
    # (delta -250). With spread 1 only zone 0 (the first that can host) is probed and a
    # takes it; with spread 2 both zones answer and b wins.
    specs = [NodeSpec("a", 1, 32.0, 64_000), NodeSpec("b", 1, 32.0, 64_000)]
    mix = ((K.Shape(4000, 500, 1), 0.5), (K.Shape(8000, 1000, 1), 0.5))
    for spread, want in ((1, 0), (2, 1)):
        nodes = [SimNode.from_spec(i, s, i) for i, s in enumerate(specs)]
        nodes[1].take(1, "x", ((0, 0.5),), 1.0, 1024, False)
        placer = A.FragProbePlacer(nodes, random.Random(1), mix, A.FRAG_RETRY, "first", True, spread)
        got = placer.place(nodes, 0.5, 4.0, 1024, 0.0)
        assert got is not None and got[0] is nodes[want] and got[1] == ((0, 0.5),)
        # 2 messages per probed node, 2 to bind
        assert placer.messages == 2 * spread + 2
    with pytest.raises(ValueError, match="spread 0"):
        A.FragProbePlacer(nodes, random.Random(1), mix, A.FRAG_RETRY, "first", True, 0)


def test_zone_host_count_tells_pods_of_one_shape_apart_by_memory() -> None:
    # one node with room for a GPU and 8 GiB: a pod of the same shape asking 16 GiB has no host,
    # also right after one asking 1 GiB was counted (the count was cached by shape alone)
    nodes = [SimNode.from_spec(0, NodeSpec("a", 1, 8.0, 8_192), 0)]
    placer = A.FragProbePlacer(nodes, random.Random(1), ((K.Shape(1000, 1000, 1), 1.0),), A.FRAG_RETRY, "first", True)
    shape = K.Shape(1000, 1000, 1)
    z = nodes[0].zone
    assert placer.hosts(z, P.Demand(gpus=1.0, cpus=1.0, memory_mb=1024), shape) == 1
    assert placer.hosts(z, P.Demand(gpus=1.0, cpus=1.0, memory_mb=16_384), shape) == 0


def test_cached_answers_follow_each_change_of_a_node() -> None:
    # The placers keep answers per node until the node changes (capacity(), fits, offers):
    # every take, give and change of serving must show in the next answer.
    specs = [NodeSpec("a", 2, 32.0, 64_000), NodeSpec("b", 2, 32.0, 64_000)]
    nodes = [SimNode.from_spec(i, s, 0) for i, s in enumerate(specs)]
    n = nodes[0]
    assert n.capacity() is n.capacity()  # built once while nothing changes
    assert (n.idle_gpus(), n.free_gpu(), n.alloc_gpus(1.5)) == (2, 2.0, ((0, 1.0), (1, 0.5)))
    n.take(1, "x", ((0, 1.0), (1, 0.5)), 30.0, 1024, False)
    assert n.capacity().gpu_free == (0.0, 0.5) and n.capacity().cpus == 2.0
    assert (n.idle_gpus(), n.free_gpu(), n.alloc_gpus(1.5), n.alloc_gpus(0.5)) == (0, 0.5, None, ((1, 0.5),))
    assert BestFitPlacer(nodes).place(nodes, 1.0, 1.0, 1024, 0.0)[0] is nodes[1]  # type: ignore[index]
    n.serving = True
    assert n.capacity().draining
    n.serving = False
    n.give(1)
    assert n.capacity().gpu_free == (1.0, 1.0) and not n.capacity().draining
    assert (n.idle_gpus(), n.free_gpu(), n.alloc_gpus(1.5)) == (2, 2.0, ((0, 1.0), (1, 0.5)))

    mix = ((K.Shape(4000, 500, 1), 0.5), (K.Shape(8000, 1000, 1), 0.5))
    frag = A.FragProbePlacer(nodes, random.Random(1), mix)
    whole = P.Demand(gpus=1.0, cpus=4.0, memory_mb=1024)
    shape = K.shape_of(1.0, 4.0)
    assert frag.fits(n, whole) and frag.answer(n, whole, shape) is not None
    n.take(2, "y", ((0, 1.0), (1, 1.0)), 4.0, 1024, False)
    frag.touch(n)
    assert not frag.fits(n, whole) and frag.answer(n, whole, shape) is None
    n.give(2)
    frag.touch(n)
    offer = frag.answer(n, whole, shape)
    assert offer is not None and offer.gpu_left_after == 1000  # of 2,000 milli-GPUs free, one GPU taken

    fgd = A.FgdPlacer(nodes, mix, random.Random(1))
    for m in nodes:
        m.take(10 + m.idx, "z", ((0, 1.0),), 1.0, 1024, False)
        fgd.touch(m)
    got = fgd.place(nodes, 1.0, 4.0, 1024, 0.0)
    assert got is not None and got[1] == ((1, 1.0),)
    for m in nodes:
        m.take(20 + m.idx, "z", ((1, 1.0),), 1.0, 1024, False)
        fgd.touch(m)
    assert fgd.place(nodes, 1.0, 4.0, 1024, 0.0) is None  # not the answers from before the takes
