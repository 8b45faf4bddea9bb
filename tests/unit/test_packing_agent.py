"""The packing mode in the agent (laminar.zone.component): the node side's least-fragmenting
offers (``[zone] packing = "frag"``) and the submitter's packing placement, over SimNet (a
FAKE network: the real Arbiter and Submitter code, messages through the real wire codec).
No privileges, no sockets."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from laminar import config
from laminar.policy import packing as pk
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import DEFAULT_FRAG_MIX, MIX_MIN_SEEN, Arbiter, ZoneComponent, frag_offer
from laminar.zone.simnet import SimNet

NOW = 1000.0
# Only 0.3-GPU workers arrive: a GPU left with less than 0.3 free is a fragment.
MIX_03 = ((pk.Shape(0, 300, 1), 1.0),)


def node(gpus: tuple[float, ...], n: int = 1, zone: int = 1) -> pl.NodeCapacity:
    return pl.NodeCapacity(n, zone, gpus, 32.0, 64_000, "H100")


def probe(pid: int, gpus_centi: int, cpus_milli: int = 1000) -> wire.Probe:
    return wire.Probe(pid, gpus_centi, cpus_milli, 1024, 5000)


def test_frag_arbiter_offers_the_least_fragmenting_gpu_where_best_fit_leaves_a_sliver():
    """GPUs free (1.0, 0.6, 0.3), a 0.25-GPU demand, a mix of 0.3-GPU workers. Best fit takes
    GPU 2 (the smallest that holds it) and leaves 0.05 no 0.3 worker can use: fragmentation
    0 -> 50 milli. GPU 1 (0.6 -> 0.35) and GPU 0 (1.0 -> 0.75) leave every GPU usable
    (delta 0); the tie goes to the tighter GPU, 1. The node keeps 1000 + 350 + 300 milli."""
    best = Arbiter(node((1.0, 0.6, 0.3)))
    frag = Arbiter(node((1.0, 0.6, 0.3)), packing="frag", mix=MIX_03)
    ob = best.on_probe(probe(1, 25), NOW)
    of = frag.on_probe(probe(1, 25), NOW)
    assert isinstance(ob, wire.Offer) and ob.gpu_alloc == ((2, 25),) and ob.frag is None
    assert isinstance(of, wire.Offer) and of.gpu_alloc == ((1, 25),) and of.frag == (0, 1650)
    # the reservation held is the one offered, and it counts: a second 0.25 goes elsewhere
    assert frag.held[1].gpu_alloc == ((1, 0.25),)
    of2 = frag.on_probe(probe(2, 25), NOW)
    assert isinstance(of2, wire.Offer) and of2.gpu_alloc == ((0, 25),)  # GPU 1 (0.35) would leave 0.1
    assert frag.counts["frag_offers"] == 2
    # the hand-over binds what was offered
    p = frag.bind(1, NOW)
    assert p is not None and p.reservation.gpu_alloc == ((1, 0.25),)


def test_a_retransmitted_probe_gets_the_same_frag_offer_with_its_score():
    frag = Arbiter(node((1.0, 0.6, 0.3)), packing="frag", mix=MIX_03)
    first = frag.on_probe(probe(1, 25), NOW)
    again = frag.on_probe(probe(1, 25), NOW + 0.01)  # the answer was lost: the probe comes again
    assert isinstance(first, wire.Offer) and first.frag == (0, 1650)
    assert again == wire.Offer(1, again.lease_ms, first.gpu_alloc, first.frag)
    assert len(frag.held) == 1 and frag.counts["frag_offers"] == 1


def test_frag_arbiter_scores_a_fragment_filling_offer_negative():
    """(1.0, 0.5), a 0.5 demand, mix half 0.5-GPU and half 1-GPU workers (the packing module's
    example): GPU 1 closes the half GPU a whole-GPU worker cannot use: delta -250 milli."""
    mix = ((pk.Shape(0, 500, 1), 0.5), (pk.Shape(0, 1000, 1), 0.5))
    a = Arbiter(node((1.0, 0.5)), packing="frag", mix=mix)
    o = a.on_probe(probe(1, 50), NOW)
    assert isinstance(o, wire.Offer) and o.gpu_alloc == ((1, 50),) and o.frag == (-250_000, 1000)


def test_frag_arbiter_learns_its_mix_from_the_probes_it_sees():
    a = Arbiter(node((1.0,) * 8), packing="frag")
    assert a.shape_mix() == DEFAULT_FRAG_MIX
    for pid in range(1, MIX_MIN_SEEN + 1):
        a.on_probe(probe(pid, 25, 1000), NOW)
    assert a.shape_mix() == ((pk.Shape(1000, 250, 1), 1.0),)
    # a fraction above one GPU has no packing shape: best fit, no score, not in the mix
    o = a.on_probe(probe(99, 150), NOW)
    assert isinstance(o, wire.Offer) and o.frag is None and sum(c for _, c in o.gpu_alloc) == 150


def test_frag_arbiter_never_promises_more_than_the_node_has():
    """Random probes, hand-overs and finished jobs: what is held and placed never exceeds any
    GPU, the CPUs or the memory, and it refuses exactly when the best-fit arbiter's checks say
    the demand does not fit."""
    rng = random.Random(7)
    inv = pl.NodeCapacity(1, 1, (1.0, 1.0, 1.0, 1.0), 16.0, 64_000, "H100")
    a = Arbiter(inv, packing="frag")
    for pid in range(1, 600):
        now = NOW + pid * 0.01
        g = rng.choice((0, 10, 25, 30, 50, 70, 100, 150, 200, 400))
        c = rng.choice((500, 1000, 4000))
        before = a.view(now)
        o = a.on_probe(wire.Probe(pid, g, c, 1024, 50), now)
        expect = pl.fits(before, pl.Demand(g / 100, c / 1000, 1024))
        assert isinstance(o, wire.Offer) == (expect is None), (o, expect)
        if isinstance(o, wire.Offer) and rng.random() < 0.6:
            a.bind(pid, now)
        if a.placed and rng.random() < 0.3:
            a.finish(rng.choice(sorted(a.placed)))
        used = [0.0] * 4
        cpus = 0.0
        for r in [x.reservation for x in a.placed.values()] + [r for r in a.held.values() if r.live(now)]:
            for i, f in r.gpu_alloc:
                used[i] += f
            cpus += r.demand.cpus
        assert all(u <= 1.0 + 1e-6 for u in used), used
        assert cpus <= inv.cpus + 1e-6


def test_bad_packing_mode_is_refused():
    with pytest.raises(ValueError, match="packing 'tight'; choose one of bestfit, frag"):
        Arbiter(node((1.0,)), packing="tight")


def test_config_refuses_an_unknown_packing_mode(tmp_path: Path):
    p = tmp_path / "bad.toml"
    p.write_text("[zone]\npacking = 'tight'\npacking_spread = 0\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(p)
    msg = str(e.value)
    assert "zone.packing = 'tight'" in msg and "bestfit, frag" in msg
    assert "zone.packing_spread = 0" in msg


def test_one_node_zone_with_frag_packing_and_the_api_flag():
    comp = ZoneComponent(settings={"cpus": 4, "memory_mb": 4000, "packing": "frag"}, gpus=2)

    async def go():
        await comp.start(None)
        await comp.stop()

    asyncio.run(go())
    assert comp.arbiter.packing == "frag" and comp.submitter.packing_spread == 4
    o = comp.handle_request(1, wire.Probe(5, 50, 1000, 100, 2000))
    assert isinstance(o, wire.Offer) and o.frag is not None
    from laminar.api import ApiError, Peer, Request

    submit = next(r for r in comp.routes() if r.method == "POST" and r.path == "/v1/placements")
    req = Request("POST", "/v1/placements", {}, {}, {"spec": {"command": ["true"]}, "packing": "yes"}, Peer(0, 0, 1))
    with pytest.raises(ApiError, match="packing 'yes' must be true or false"):
        asyncio.run(submit.handler(req))


# --------------------------------------------------------------------------- over SimNet (a fake network)


def frag_net(packing: str = "frag") -> SimNet:
    """8 fake nodes, 2 zones of 4, 2 idle GPUs each, except node 7 (zone 2) with (1.0, 0.5):
    a 0.5-GPU job there closes a half GPU (delta -250 with the mix below), anywhere else it
    opens one (+250). Every arbiter scores with the same mix."""
    net = SimNet.build(nodes=8, zone_size=4, gpus_per_node=2, fill=0.0, rng=random.Random(3), packing=packing)
    mix = ((pk.Shape(0, 500, 1), 0.5), (pk.Shape(0, 1000, 1), 0.5))
    for a in net.arbiters.values():
        a.fixed_mix = mix
    net.arbiters[7].inventory = pl.NodeCapacity(7, 2, (1.0, 0.5), 64.0, 512_000, "H100")
    net.refresh_summaries()
    return net


def test_packing_placement_binds_the_best_scored_offer_not_the_first():
    net = frag_net()
    res = asyncio.run(net.place(pl.Demand(gpus=0.5, cpus=1, memory_mb=1024), packing=True))
    assert res.outcome == "placed" and res.node == 7 and res.zone == 2
    assert sorted(res.probed) == list(range(1, 9))  # every member of both zones
    assert net.arbiters[7].placed[res.placement_id].reservation.gpu_alloc == ((1, 0.5),)
    # 8 probes, 8 offers, the hand-over and its answer
    assert net.by_type["Probe"] == 8 and net.by_type["Offer"] == 8 and net.by_type["Handover"] == 1


def test_packing_placement_remembers_unused_offers_and_releases_them_by_the_next_probe():
    net = frag_net()
    sub = net.submitter()
    d = pl.Demand(gpus=0.5, cpus=1, memory_mb=1024)
    first = asyncio.run(net.place(d, submitter=sub, packing=True))
    losers = set(range(1, 9)) - {first.node}
    assert all(first.placement_id in net.arbiters[n].held for n in losers)  # they hold until released
    # their lease outlives the wait for every answer (probe_timeout_s), then the usual lease
    lease = net.arbiters[2].held[first.placement_id].expires_at - net.clock_s
    assert lease == pytest.approx(sub.lease_s + sub.probe_timeout_s, abs=1e-3)
    assert set(sub._unused) == losers
    second = asyncio.run(net.place(d, submitter=sub, packing=True))
    assert second.outcome == "placed"
    for n in losers - {second.node}:
        assert first.placement_id not in net.arbiters[n].held  # released by the second probe
        assert net.arbiters[n].counts["releases"] == 1


def test_packing_placement_ranks_unscored_offers_last():
    """A node in the bestfit mode answers without a score: it binds only when no scored offer
    is there."""
    net = frag_net()
    net.arbiters[1].packing = "bestfit"
    res = asyncio.run(net.place(pl.Demand(gpus=0.5, cpus=1, memory_mb=1024), packing=True))
    assert res.node == 7
    o = pl.Offer(1, 1, None, pl.Reservation(9, pl.Demand(), ((0, 0.5),), NOW + 1))
    assert frag_offer(o, None).delta == float("inf")
    scored = frag_offer(pl.Offer(2, 1, None, pl.Reservation(9, pl.Demand(), ((0, 0.5),), NOW + 1)), (900_000, 1500))
    assert pk.pick_frag_offer([frag_offer(o, None), scored], quantized=True) == scored


def test_packing_placement_spreads_over_the_first_zones_only():
    net = frag_net()
    sub = net.submitter()
    sub.packing_spread = 1  # zone 1 only: node 7 is not probed, a zone-1 node takes it
    res = asyncio.run(net.place(pl.Demand(gpus=0.5, cpus=1, memory_mb=1024), submitter=sub, packing=True))
    assert res.outcome == "placed" and res.zone == 1 and sorted(res.probed) == [1, 2, 3, 4]


def test_default_placement_is_unchanged_d_probes_and_best_fit():
    """Without ``packing`` the submitter probes d = 2 nodes and binds the first good offer;
    bestfit arbiters offer placement.arbitrate's best fit, without a score."""
    net = frag_net(packing="bestfit")
    res = asyncio.run(net.place(pl.Demand(gpus=0.5, cpus=1, memory_mb=1024)))
    assert res.outcome == "placed" and len(res.probed) == 2 and net.by_type["Probe"] == 2
    assert all(a.packing == "bestfit" and a.counts["frag_offers"] == 0 for a in net.arbiters.values())
    a = Arbiter(node((1.0, 0.6, 0.3, 0.25)))
    o = a.on_probe(probe(77, 25), NOW)
    assert isinstance(o, wire.Offer) and o.frag is None and o.gpu_alloc == ((3, 25),)  # allocate_gpus' best fit


def test_laminarctl_zone_submit_packing_sets_the_body_flag():
    from laminarctl.cmd_zone import build_placement
    from laminarctl.main import build_parser

    args = build_parser().parse_args(["zone", "submit", "--gpus", "0.5", "--packing", "--", "sleep", "1"])
    assert build_placement(args)["packing"] is True
    args = build_parser().parse_args(["zone", "submit", "--gpus", "0.5", "--", "sleep", "1"])
    assert "packing" not in build_placement(args)  # the default body is unchanged
