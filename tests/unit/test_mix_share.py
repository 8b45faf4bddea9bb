"""The shape mix shared between ``frag`` agents through their summaries: the optional wire
trailer of ``summary`` and ``zone-summary`` (round trip, older bodies, malformed trailers
dropped and counted), the merge rule (laminar.policy.mixlearn), the arbiter's side and the
zone component's receive/merge/send path (laminar.zone.component)."""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import socket
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ports import free_port

from laminar.policy import mixlearn
from laminar.policy import placement as pl
from laminar.policy.packing import Shape
from laminar.zone import wire
from laminar.zone.component import (
    Arbiter,
    ZoneComponent,
    shares_to_wire,
    wire_to_shares,
    zone_summary_to_msg,
)
from laminar.zone.keys import ZoneKeys
from laminar.zone.wire import Decoder, Dropped, DropReason, Encoder

KEYS = ZoneKeys({1: bytes(range(32))}, "mix-share test")
NOW = 1_700_000_000.0
SMALL = Shape(4000, 500, 1)
WHOLE = Shape(8000, 1000, 1)
GANG = Shape(16000, 1000, 4)
CPU = Shape(2000, 0, 0)


def carry(body: wire.Body) -> wire.Body:
    """``body`` through a signed datagram and back (raises Dropped)."""
    data = Encoder(10, KEYS, seq0=1).encode(body, zone=1, now=NOW)
    assert len(data) <= wire.MAX_DATAGRAM
    return Decoder(KEYS, {10: 1}).decode(data, NOW).body


def drop_reason(body_bytes: bytes, mtype: wire.MsgType) -> DropReason | None:
    """Decode a signed datagram of ``body_bytes``; the drop reason, None when accepted. The
    decoder's counter of that reason went up by one."""
    dec = Decoder(KEYS, {11: 1})
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, mtype, 0, 0, 1, 11, int(NOW * 1000), 1, len(body_bytes))
    data = head + body_bytes + wire._mac(KEYS.get(1) or b"", head + body_bytes)
    try:
        dec.decode(data, NOW)
    except Dropped as e:
        assert dec.drops[e.reason.value] == 1
        return e.reason
    return None


MIX = ((4000, 500, 1, 40000), (8000, 1000, 1, 20000), (2000, 0, 0, 5535))


# --------------------------------------------------------------------------- wire


def test_summary_mix_trailer_round_trips_and_is_optional():
    plain = wire.Summary((100, 50), 8000, 64000, False, "A100", "")
    assert carry(plain) == plain  # no trailer: as before
    with_mix = replace(plain, mix=MIX, mix_weight=123456)
    got = carry(with_mix)
    assert got == with_mix
    assert len(wire.encode_body(with_mix)) == len(wire.encode_body(plain)) + 5 + 9 * len(MIX)


@pytest.mark.parametrize("hints,hosts", [((), ()), (((1, 2),), ()), ((), (((3, 40, 100),),)),
                                         (((1,),), (((3, 40, 100), (9, 20, 50)),))])
def test_zone_summary_mix_trailer_round_trips_whatever_came_before(hints, hosts):
    z = wire.ZoneSummaryMsg(2, 64, (1,) * 7, 1000, 2000, ("A100",), hints, hosts)
    assert carry(z) == z
    zm = replace(z, mix=MIX, mix_weight=7)
    assert carry(zm) == zm


def test_malformed_mix_trailers_are_dropped_and_counted():
    good = wire.encode_body(wire.Summary((100,), 1000, 100, False, "", "", MIX, 500))
    assert drop_reason(good, wire.MsgType.SUMMARY) is None
    base = wire.encode_body(wire.Summary((100,), 1000, 100, False, "", ""))

    def summary_with(head: tuple[int, int], entries: list[tuple[int, int, int, int]]) -> bytes:
        return base + wire._MIX_HEAD.pack(*head) + b"".join(wire._MIX_ENTRY.pack(*e) for e in entries)

    bad = [
        summary_with((0, 5), []),  # no shapes
        summary_with((17, 5), [(1, 0, 0, 1)] * 17),  # too many
        summary_with((1, 0), [(1, 0, 0, 1)]),  # weight 0
        summary_with((2, 5), [(1, 0, 0, 40000), (2, 0, 0, 40000)]),  # shares above one
        summary_with((2, 5), [(1, 0, 0, 1), (1, 0, 0, 2)]),  # a shape twice
        summary_with((1, 5), [(1, 1001, 1, 1)]),  # more than a GPU
        summary_with((1, 5), [(1, 500, 0, 1)]),  # a share of no GPU
        summary_with((1, 5), [(1, 500, 2, 1)]),  # a share of two GPUs
        summary_with((2, 5), [(1, 0, 0, 1)]),  # truncated
        good[:-1],  # truncated by a byte
        good + b"\x00",  # trailing byte
    ]
    for b in bad:
        assert drop_reason(b, wire.MsgType.SUMMARY) is DropReason.MALFORMED, b.hex()
    z = wire.ZoneSummaryMsg(2, 64, (1,) * 7, 1000, 2000, ())
    zgood = wire.encode_body(replace(z, mix=MIX, mix_weight=5))
    assert drop_reason(zgood, wire.MsgType.ZONE_SUMMARY) is None
    # hints 0, hosts 0 and nothing after: not an encoding the speaker writes
    assert drop_reason(wire.encode_body(z) + b"\x00\x00", wire.MsgType.ZONE_SUMMARY) is DropReason.MALFORMED
    assert drop_reason(zgood[:-3], wire.MsgType.ZONE_SUMMARY) is DropReason.MALFORMED
    with pytest.raises(ValueError, match="shares sum"):
        wire.encode_body(replace(z, mix=((1, 0, 0, 40000), (2, 0, 0, 40000)), mix_weight=5))


shape_key = st.one_of(
    st.tuples(st.integers(0, 2**32 - 1), st.just(0), st.just(0)),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 1000), st.just(1)),
    st.tuples(st.integers(0, 2**32 - 1), st.just(1000), st.integers(2, 255)),
)
mixes = st.dictionaries(shape_key, st.integers(0, 4000), min_size=1, max_size=wire.MAX_MIX_SHAPES).map(
    lambda d: tuple((c, g, n, p) for (c, g, n), p in d.items()))


@settings(max_examples=400, deadline=None)
@given(mix=mixes, weight=st.integers(1, 2**32 - 1), pos=st.integers(0, 400), byte=st.integers(0, 255),
       zone=st.booleans())
def test_mix_trailers_round_trip_and_garbage_only_ever_drops(mix, weight, pos, byte, zone):
    if zone:
        body: wire.Body = wire.ZoneSummaryMsg(3, 9, (2,) * 7, 5, 6, ("H100",), (), (((1, 2, 3),),), mix, weight)
        mtype = wire.MsgType.ZONE_SUMMARY
    else:
        body = wire.Summary((100, 0), 1, 2, True, "m", "p", mix, weight)
        mtype = wire.MsgType.SUMMARY
    assert carry(body) == body
    raw = bytearray(wire.encode_body(body))
    raw[pos % len(raw)] = byte  # a signed body with one byte changed: accepted whole, or dropped
    reason = drop_reason(bytes(raw), mtype)
    assert reason in (None, DropReason.MALFORMED)


# --------------------------------------------------------------------------- the merge rule


def test_top_shares_and_merge_weigh_each_part_by_its_total():
    assert mixlearn.top_shares({}) is None
    total, items = mixlearn.top_shares({SMALL: 3.0, WHOLE: 1.0, CPU: 0.0}) or (0, ())
    assert total == 4.0 and items == ((SMALL, 0.75), (WHOLE, 0.25))
    many = {Shape(1000 + i, 0, 0): float(i + 1) for i in range(40)}
    t, top = mixlearn.top_shares(many, 16) or (0, ())
    assert len(top) == 16 and t == sum(many.values()) and top[0][0] == Shape(1039, 0, 0)
    merged = mixlearn.merge_shares([(100.0, ((SMALL, 1.0),)), (300.0, ((WHOLE, 0.5), (SMALL, 0.5))),
                                    (math.nan, ((GANG, 1.0),)), (0.0, ((GANG, 1.0),))])
    assert merged == {SMALL: 250.0, WHOLE: 150.0}


def test_peers_weights_move_a_nodes_mix_to_the_clusters():
    m = mixlearn.MixLearner(min_seen=4, refresh=4, rate_window=0)
    assert m.mix() is None and m.share() is None
    m.set_peers({WHOLE: 100.0})  # a node that saw nothing yet scores with what its peers saw
    assert m.mix() == ((WHOLE, 1.0),)
    for pid in range(8):
        m.note(SMALL, pid)
    total, items = m.share() or (0, ())
    assert items == ((SMALL, 1.0),)  # a node shares its own counts only, never its peers'
    assert 4 < total <= 8
    mix = dict(m.mix() or ())
    assert mix[WHOLE] > 0.9 and mix[SMALL] < 0.1
    kept = m.mix()
    m.set_peers({WHOLE: 100.5})  # moved by far less than MIX_CHANGE: the same object (warm cache)
    assert m.mix() is kept
    m.set_peers({})
    assert m.mix() == ((SMALL, 1.0),)


def test_shares_to_wire_and_back_keep_the_mix_within_rounding():
    shares = mixlearn.top_shares({SMALL: 600.0, WHOLE: 300.0, GANG: 100.0})
    mix, weight = shares_to_wire(shares)
    assert weight == 100000 and sum(e[3] for e in mix) <= wire.MIX_SHARE_ONE
    back = wire_to_shares(mix, weight)
    assert back is not None and back[0] == 1000.0
    assert {s: round(p, 4) for s, p in back[1]} == {SMALL: 0.6, WHOLE: 0.3, GANG: 0.1}
    assert shares_to_wire(None) == ((), 0) and wire_to_shares((), 0) is None


# --------------------------------------------------------------------------- arbiter and component


def inventory(node: int = 1, zone: int = 1) -> pl.NodeCapacity:
    return pl.NodeCapacity(node, zone, (1.0,) * 8, 64.0, 512000, "A100")


def probe(pid: int, gpus_centi: int, cpus_milli: int) -> wire.Probe:
    return wire.Probe(pid, gpus_centi, cpus_milli, 1000, 100)


def test_a_learning_frag_arbiter_shares_its_mix_and_scores_with_its_peers():
    a = Arbiter(inventory(), packing="frag")
    assert a.summary(NOW).mix == ()  # nothing learned yet
    for pid in range(20):
        a.on_probe(probe(pid, 50, 4000), NOW + pid)
    s = a.summary(NOW + 30)
    assert [e[:3] for e in s.mix] == [(4000, 500, 1)] and s.mix_weight > 0
    assert carry(s) == s
    a.set_peer_mixes([(1e6, ((WHOLE, 1.0),))])
    assert dict(a.shape_mix())[WHOLE] > 0.99
    assert a.summary(NOW + 30).mix == s.mix  # its own counts, not the peers'
    for other in (Arbiter(inventory(), packing="bestfit"), Arbiter(inventory(), packing="frag", mix=((WHOLE, 1.0),))):
        for pid in range(20):
            other.on_probe(probe(pid, 50, 4000), NOW + pid)
        other.set_peer_mixes([(1e6, ((SMALL, 1.0),))])  # learns no mix: shares none, takes none
        assert other.summary(NOW).mix == ()
    assert other.shape_mix() == ((WHOLE, 1.0),)




def test_zone_component_merges_fresh_shared_mixes_and_sends_its_zones(tmp_path):
    keys = tmp_path / "zone.keys"
    keys.write_text(f"* {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    nodes = [{"id": 1, "zone": 1, "addr": "127.0.0.1:1"}, {"id": 2, "zone": 1, "addr": "127.0.0.1:2"},
             {"id": 3, "zone": 2, "addr": "127.0.0.1:3"}]
    comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1",
                                   "port": free_port(socket.SOCK_DGRAM), "handover_port": free_port(socket.SOCK_STREAM), "packing": "frag", "cpus": 8, "memory_mb": 8000},
                         gpus=2)

    async def go():
        await comp.start(None)
        await comp.stop()

    asyncio.run(go())
    t = comp.clock()

    def msg(node: int, body: wire.Body) -> wire.Message:
        return wire.Message(wire.MsgType.SUMMARY if isinstance(body, wire.Summary) else wire.MsgType.ZONE_SUMMARY,
                            0, 1, node, int(t * 1000), 1, body)

    peer_mix, peer_weight = shares_to_wire((500.0, ((SMALL, 1.0),)))
    comp._on_message(msg(2, wire.Summary((100, 100), 8000, 8000, False, "", "", peer_mix, peer_weight)), ("127.0.0.1", 2))
    zone2 = zone_summary_to_msg(pl.summarize_zone(2, [inventory(3, 2)], t), (1500.0, ((WHOLE, 1.0),)))
    assert zone2.mix and zone2.mix_weight == 150000
    comp._on_message(msg(3, zone2), ("127.0.0.1", 3))
    assert set(comp.summaries.peer_mixes) == {2} and set(comp.summaries.zone_mixes) == {2}
    comp.summaries.refresh_peer_mixes(t)
    assert dict(comp.arbiter.shape_mix()) == pytest.approx({WHOLE: 0.75, SMALL: 0.25}, abs=1e-3)
    own = comp.summaries.own_zone_mix(t)  # this node learned nothing: the zone's mix is its peer's
    assert own is not None and own[0] == pytest.approx(500.0) and own[1][0][0] == SMALL
    sent = zone_summary_to_msg(comp.summaries.own_zone_summary(t), own)
    assert sent.mix and len(wire.encode_body(sent)) + wire.HEADER_SIZE + wire.MAC_SIZE <= wire.MAX_DATAGRAM
    # stale ones are forgotten: after peer_timeout_s the peer's, after 3 x that the zone's
    comp.summaries.refresh_peer_mixes(t + 11)
    assert comp.summaries.peer_mixes == {} and set(comp.summaries.zone_mixes) == {2}
    assert dict(comp.arbiter.shape_mix()) == pytest.approx({WHOLE: 1.0})
    comp.summaries.refresh_peer_mixes(t + 31)
    assert comp.summaries.zone_mixes == {}


def test_a_zone_summary_too_large_for_a_datagram_leaves_the_mix_out_first():
    models = tuple("M" * 60 + str(i) for i in range(13))  # long GPU model names
    z = pl.summarize_zone(1, [pl.NodeCapacity(i, 1, (1.0,) * 8, 64.0, 512000, models[i % 13]) for i in range(40)],
                          NOW)
    mix = (1000.0, tuple((Shape(1000 + i, 0, 0), 1 / 16) for i in range(16)))
    msg = zone_summary_to_msg(z, mix)
    assert wire.HEADER_SIZE + len(wire.encode_body(msg)) + wire.MAC_SIZE <= wire.MAX_DATAGRAM
    assert msg.mix == ()


# --------------------------------------------------------------------------- agent_packing's exchange (SimNet, a FAKE network)


def test_agent_packing_exchanges_the_mixes_through_the_wire_and_every_node_takes_them():
    """The experiment's ``learned`` mix runs the summaries' exchange (``MixExchange``): through
    the codec each datagram stays within one datagram and grows by the trailer; every node,
    also one never probed, ends up scoring with a learned mix (not the fixed default); and
    without the codec the decisions are the same."""
    import random as _random

    from laminar.sim.agent_packing import MixExchange, build_net, run_agent_packing
    from laminar.sim.trace import JobSpec, NodeSpec
    from laminar.zone.component import DEFAULT_FRAG_MIX

    r = _random.Random(4)
    kinds = ((2, 32.0, 131_072, "P100"),) * 3 + ((8, 96.0, 786_432, "V100M32"),)
    nodes = [NodeSpec(f"n{i}", *r.choice(kinds)) for i in range(70)]
    shapes = ((0.25, 4, 8_192), (0.5, 6, 16_384), (1.0, 8, 30_000), (2.0, 16, 60_000), (0.0, 8, 16_000))
    work = [JobSpec(f"p{i:03d}", 0.0, 1.0, 1, *r.choice(shapes)) for i in range(40)]
    wired = run_agent_packing(nodes, work, seed=4, mix="learned", mix_every=2)
    bare = run_agent_packing(nodes, work, seed=4, mix="learned", mix_every=2, use_wire=False)
    local = run_agent_packing(nodes, work, seed=4, mix="local")
    assert wired.mix_rounds > 0 and local.mix_rounds == 0 and local.summary_bytes is None
    sizes = wired.summary_bytes or {}
    assert 0 < sizes["node_before_max"] < sizes["node_max"] <= wire.MAX_DATAGRAM
    assert 0 < sizes["zone_before_max"] < sizes["zone_max"] <= wire.MAX_DATAGRAM
    assert (wired.placed, wired.failed, wired.messages) == (bare.placed, bare.failed, bare.messages)
    assert wired.allocation_ratio_pct == bare.allocation_ratio_pct
    # a net where only zone 1's nodes counted probes: after a round, zone 2's score with their mix
    net = build_net(nodes, None, seed=4)
    zone1 = [n for n, m in net.membership.by_node.items() if m.zone == 1]
    zone2 = [n for n, m in net.membership.by_node.items() if m.zone == 2]
    for n in zone1:
        for pid in range(20):
            net.arbiters[n].on_probe(probe(pid + 1, 50, 4000), NOW + pid)
    ex = MixExchange(net)
    ex.round()
    assert all(net.arbiters[n].shape_mix() == ((SMALL, 1.0),) for n in zone1 + zone2)
    assert DEFAULT_FRAG_MIX != ((SMALL, 1.0),)
