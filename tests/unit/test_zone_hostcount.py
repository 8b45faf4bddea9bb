"""Zone summaries that count the nodes able to host a demand (host buckets, issue 7's packing gap).

A zone summary carries, per GPU shape, the nodes with room for it grouped by free CPUs
(``ZoneSummary.hosts``); ``zone_fit`` is then bounded per node, so a zone whose GPU room and
CPU room sit on different nodes says 0. Checked here: that rule against the old one, against
brute force on random zones, through the wire codec, with an older peer's summary (no field),
and with malformed fields."""

from __future__ import annotations

import math
import random
import struct

import pytest

from laminar.policy import placement as pl
from laminar.policy.placement import Demand, NodeCapacity
from laminar.zone import wire
from laminar.zone.component import msg_to_zone_summary, zone_summary_to_msg
from laminar.zone.keys import ZoneKeys
from laminar.zone.wire import Decoder, Dropped, DropReason, Encoder

KEYS = ZoneKeys({1: bytes(range(32))}, "hostcount-test")
NODES = {10: 1}


def split_zone() -> list[NodeCapacity]:
    """GPU room on node 1 (no free CPU), CPU and memory room on node 2 (no free GPU)."""
    return [
        NodeCapacity(1, 1, (1.0, 1.0), cpus=0.5, memory_mb=4_000, gpu_model="H100"),
        NodeCapacity(2, 1, (0.0, 0.0), cpus=48.0, memory_mb=256_000, gpu_model="H100"),
    ]


def roundtrip(s: pl.ZoneSummary) -> pl.ZoneSummary:
    data = Encoder(10, KEYS, seq0=1).encode(zone_summary_to_msg(s), zone=1, now=100.0)
    m = Decoder(KEYS, NODES).decode(data, now=100.0)
    assert isinstance(m.body, wire.ZoneSummaryMsg)
    out = msg_to_zone_summary(m.body, 100.0)
    assert out is not None
    return out


def test_gpu_room_and_cpu_room_on_different_nodes_fit_nowhere():
    d = Demand(gpus=1, cpus=4, memory_mb=8_000)
    old = pl.summarize_zone(1, split_zone(), hosts=False)
    new = pl.summarize_zone(1, split_zone())
    assert pl.zone_fit(old, d) == 2  # the old rule: 2 GPU slots, 48.5 CPUs and 260 GB summed
    assert pl.zone_fit(new, d) == 0  # no single node has a GPU and 4 CPUs
    assert pl.hosts_fit(new.hosts[pl.shape_index(1)], d) == 0
    # what node 1 can take, it is still counted for
    assert pl.zone_fit(new, Demand(gpus=1, cpus=0.5, memory_mb=2_000)) == 1
    # and a CPU-only demand goes to node 2
    assert pl.zone_fit(new, Demand(gpus=0, cpus=40, memory_mb=100_000)) == 1
    # after the wire, the same answers
    back = roundtrip(new)
    assert pl.zone_fit(back, d) == 0
    assert pl.zone_fit(back, Demand(gpus=1, cpus=0.5, memory_mb=2_000)) == 1


def test_memory_room_on_another_node_fits_nowhere():
    nodes = [NodeCapacity(1, 1, (1.0,), cpus=16, memory_mb=1_000), NodeCapacity(2, 1, (), cpus=0, memory_mb=500_000)]
    d = Demand(gpus=0.5, cpus=2, memory_mb=64_000)
    assert pl.zone_fit(pl.summarize_zone(1, nodes, hosts=False), d) == 2  # two half-GPU slots, 501 GB summed
    assert pl.zone_fit(pl.summarize_zone(1, nodes), d) == 0


def test_fit_counts_hosts_near_saturation():
    # 10 nodes each with one idle GPU and 5 free CPUs, one node with 64 CPUs and no GPU: the old
    # rule sums 114 CPUs into 9 copies of a 12-CPU pod; no node can host one
    nodes = [NodeCapacity(i, 1, (1.0,), cpus=5, memory_mb=64_000) for i in range(10)]
    nodes.append(NodeCapacity(10, 1, (), cpus=64, memory_mb=64_000))
    d = Demand(gpus=1, cpus=12, memory_mb=1_000)
    assert pl.zone_fit(pl.summarize_zone(1, nodes, hosts=False), d) == 9
    assert pl.zone_fit(pl.summarize_zone(1, nodes), d) == 0
    d4 = Demand(gpus=1, cpus=4, memory_mb=1_000)  # each of the 10 hosts one
    assert pl.zone_fit(pl.summarize_zone(1, nodes), d4) == 10


def random_zone(rng: random.Random, n: int) -> list[NodeCapacity]:
    out = []
    for i in range(n):
        gpus = tuple(rng.choice((0.0, 0.25, 0.5, 1.0, 1.0)) for _ in range(rng.choice((0, 1, 2, 4, 8))))
        # coarse values: many ties, which the grouping of more than 64 nodes must handle
        out.append(NodeCapacity(i, 1, gpus, cpus=float(rng.choice((0, 0.5, 1, 2, 4, 8, 11, 12, 32, 96))),
                                memory_mb=rng.choice((0, 1_000, 16_000, 64_000, 256_000)),
                                draining=rng.random() < 0.05))
    return out


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 200, 1000])
def test_host_buckets_bound_the_true_count(n):
    """Against brute force: hosts_fit is at least the nodes that can host each demand, and 0
    only when none can; zone_fit never below the true host count, also through the wire; the
    groups count every node that might host the shape's class. Demands of any size, not only
    the shapes: a 0.3-GPU demand is filed under the 0.5 shape."""
    rng = random.Random(n)
    nodes = random_zone(rng, n)
    s = pl.summarize_zone(1, nodes)
    back = roundtrip(s)
    for k, _shape in enumerate(pl.SHAPES):
        might = [x for x in nodes if pl.host_classes(x)[k]]
        assert sum(g[0] for g in s.hosts[k]) == len(might)
        assert len(s.hosts[k]) <= pl.MAX_HOST_BUCKETS
    for _ in range(300):
        gpus = rng.choice((0.0, 0.1, 0.25, 0.3, 0.45, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0))
        d = Demand(gpus=gpus, cpus=rng.choice((0, 0.5, 1, 3, 8, 11, 12, 40, 100)),
                   memory_mb=rng.choice((0, 500, 16_000, 100_000, 300_000)))
        k = pl.shape_index(d.gpus)
        assert k is not None
        true = [x for x in nodes if pl.fits(x, d) is None]  # what arbitration would accept
        assert all(pl.host_classes(x)[k] for x in true)  # the class rule never leaves a host out
        est = pl.hosts_fit(s.hosts[k], d)
        assert est >= len(true)  # so never 0 for a zone with a host
        assert pl.zone_fit(s, d) >= len(true)
        assert pl.zone_fit(back, d) >= len(true)  # rounding on the wire only goes up
        if not true and not any(pl.host_classes(x)[k] for x in nodes):
            assert pl.zone_fit(s, d) == 0


def test_a_share_filed_under_a_larger_shape_still_finds_its_host():
    # the zone's only GPU room: 0.4 and 0.36 free on one node, no GPU with a 0.5 slot; a 0.32-GPU
    # pod fits there (the simulator held such pods queued when host buckets counted 0.5 slots)
    nodes = [NodeCapacity(1, 1, (0.0, 0.4, 0.36, 0.0), cpus=8.7, memory_mb=160_000),
             NodeCapacity(2, 1, (0.0, 0.0), cpus=64, memory_mb=400_000)]
    d = Demand(gpus=0.32, cpus=4, memory_mb=15_258)
    assert pl.fits(nodes[0], d) is None
    s = pl.summarize_zone(1, nodes)
    assert pl.shape_slots(nodes[0])[pl.shape_index(0.32)] == 0  # no 0.5 slot anywhere
    assert pl.zone_fit(s, d) >= 1
    assert pl.zone_fit(roundtrip(s), d) >= 1
    # and 1.5 GPUs: one idle GPU and a half elsewhere on the node, no two idle GPUs
    two = [NodeCapacity(3, 1, (1.0, 0.5, 0.0), cpus=8, memory_mb=64_000)]
    d15 = Demand(gpus=1.5, cpus=2, memory_mb=1_000)
    assert pl.fits(two[0], d15) is None
    assert pl.zone_fit(pl.summarize_zone(1, two), d15) >= 1


def test_no_host_means_zero_for_every_random_zone():
    rng = random.Random(7)
    for n in (3, 20, 80):
        nodes = random_zone(rng, n)
        s = pl.summarize_zone(1, nodes)
        for _ in range(200):
            d = Demand(gpus=rng.choice((0.0, 0.25, 0.5, 1.0, 2.0)), cpus=rng.choice((1, 8, 12, 40)),
                       memory_mb=rng.choice((1_000, 100_000, 300_000)))
            k = pl.shape_index(d.gpus)
            assert k is not None
            maxc = max((x.cpus for x in nodes if pl.host_classes(x)[k]), default=-1)
            maxm = max((x.memory_mb for x in nodes if pl.host_classes(x)[k]), default=-1)
            if d.cpus > maxc or d.memory_mb > maxm:
                assert pl.zone_fit(s, d) == 0


def test_wire_roundtrip_keeps_groups_rounded_up():
    nodes = [NodeCapacity(1, 1, (1.0, 0.5), cpus=3.05, memory_mb=10_001),
             NodeCapacity(2, 1, (1.0,), cpus=10_000.0, memory_mb=2**31)]
    s = pl.summarize_zone(1, nodes)
    msg = zone_summary_to_msg(s)
    data = Encoder(10, KEYS, seq0=1).encode(msg, zone=1, now=5.0)
    got = Decoder(KEYS, NODES).decode(data, now=5.0).body
    assert got == msg  # the codec is exact
    assert isinstance(got, wire.ZoneSummaryMsg)
    assert len(got.hosts) == len(pl.SHAPES)
    back = msg_to_zone_summary(got, 5.0)
    assert back is not None
    for mine, theirs in zip(s.hosts, back.hosts, strict=True):
        assert [g[0] for g in mine] == [g[0] for g in theirs]
        for (_, c, m), (_, c2, m2) in zip(mine, theirs, strict=True):
            assert c <= c2  # tenths of a core, rounded up; beyond the field: infinite
            assert c2 < c + 0.1 + 1e-9 or math.isinf(c2)
            assert m <= m2  # 64 MB units, rounded up; beyond the field: infinite
            assert m2 < m + 64 or math.isinf(m2)
    k1 = pl.shape_index(1)
    assert back.hosts[k1][0][1:] == (math.inf, math.inf)  # 10,000 cores, 2 TB: beyond 65535 units
    assert back.hosts[k1][1][1:] == (3.1, 10_048.0)
    assert pl.zone_fit(back, Demand(gpus=1, cpus=3.05, memory_mb=10_001)) == 2
    assert pl.hosts_fit(back.hosts[k1], Demand(gpus=1, cpus=3.2, memory_mb=10_001)) == 1  # node 2 alone


def test_old_format_summary_decodes_and_gives_the_old_estimate():
    nodes = split_zone()
    new = pl.summarize_zone(1, nodes)
    old = pl.summarize_zone(1, nodes, hosts=False)
    # an older peer's datagram: the same body without the host field (with and without hints)
    for hints in ((), ((1,), (), (1, 2))):
        m = wire.ZoneSummaryMsg(1, 2, new.slots, int(new.cpus * 1000), new.memory_mb, new.gpu_models, hints)
        data = Encoder(10, KEYS, seq0=1).encode(m, zone=1, now=1.0)
        body = Decoder(KEYS, NODES).decode(data, now=1.0).body
        assert isinstance(body, wire.ZoneSummaryMsg) and body.hosts == ()
        s = msg_to_zone_summary(body, 1.0)
        assert s is not None and s.hosts == ()
        for d in (Demand(gpus=1, cpus=4, memory_mb=8_000), Demand(gpus=0.5, cpus=1, memory_mb=1),
                  Demand(gpus=0, cpus=40, memory_mb=1_000)):
            assert pl.zone_fit(s, d) == pl.zone_fit(old, d)
        assert pl.zone_fit(s, Demand(gpus=1, cpus=4, memory_mb=8_000)) == 2  # the over-promise
    # a summary without hints: the host field comes after a hint count of 0
    plain = wire.encode_body(wire.ZoneSummaryMsg(1, 2, new.slots, int(new.cpus * 1000), new.memory_mb,
                                                 new.gpu_models))
    assert zone_summary_to_msg(new).hints == ()
    assert wire.encode_body(zone_summary_to_msg(new)).startswith(plain + bytes([0, len(pl.SHAPES)]))


def signed(body: bytes, seq: int) -> bytes:
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.MsgType.ZONE_SUMMARY, 0, 0, 1, 10, 1000, seq, len(body))
    return head + body + wire._mac(KEYS.get(1) or b"", head + body)


def test_malformed_host_field_is_dropped_and_counted():
    base = wire.encode_body(wire.ZoneSummaryMsg(1, 2, (2, 0, 0, 0, 0, 0, 0), 1000, 2000, ("H100",)))
    g = struct.pack("!HHH", 1, 10, 10)
    bad = [
        b"\0",  # a hint count of 0 with nothing after: never written
        b"\0" + bytes([0]),  # host buckets for 0 shapes: never written
        b"\0" + bytes([wire.MAX_HOST_SHAPES + 1]) + (b"\0" * (wire.MAX_HOST_SHAPES + 1)),
        b"\0" + bytes([1, wire.MAX_HOST_BUCKETS + 1]) + g * (wire.MAX_HOST_BUCKETS + 1),
        b"\0" + bytes([1, 2]) + g + g[:4],  # a bucket cut short
        b"\0" + bytes([2, 1]) + g,  # a shape missing
        b"\0" + bytes([1, 1]) + g + b"x",  # trailing byte
    ]
    dec = Decoder(KEYS, NODES)
    for seq, tail in enumerate(bad, start=10):
        with pytest.raises(Dropped) as e:
            dec.decode(signed(base + tail, seq), now=1.0)
        assert e.value.reason is DropReason.MALFORMED
    assert dec.stats()["malformed"] == len(bad)
    assert dec.accepted == 0
    # the same field well formed is accepted
    ok = dec.decode(signed(base + b"\0" + bytes([1, 1]) + g, 99), now=1.0).body
    assert isinstance(ok, wire.ZoneSummaryMsg) and ok.hosts == (((1, 10, 10),),)
    with pytest.raises(ValueError, match="hosts"):
        wire.encode_body(wire.ZoneSummaryMsg(1, 2, (2,), 1, 1, (), (), (((1, 1, 1),) * 9,)))


def test_a_summary_too_large_for_a_datagram_leaves_the_host_field_out():
    # 16 GPU models of 24 bytes and hints for every shape: no room left for the host buckets
    nodes = [NodeCapacity(i, 1, (1.0,) * 8, cpus=96, memory_mb=400_000, gpu_model=f"{'M' * 20}{i:04d}")
             for i in range(40)]
    nodes += [NodeCapacity(100 + i, 1, (0.0,) * 8, cpus=4, memory_mb=1_000) for i in range(40)]
    s = pl.summarize_zone(1, nodes, rng=random.Random(1), hints=pl.HINTS_PER_SHAPE)
    assert s.hosts and len(s.gpu_models) > 16
    msg = zone_summary_to_msg(s)
    assert msg.hosts == ()
    data = Encoder(10, KEYS, seq0=1).encode(msg, zone=1, now=1.0)  # fits: no ValueError
    assert len(data) <= wire.MAX_DATAGRAM
    # a usual summary keeps them
    small = pl.summarize_zone(1, nodes[:2] + nodes[40:42], rng=random.Random(1), hints=pl.HINTS_PER_SHAPE)
    assert zone_summary_to_msg(small).hosts != ()


def test_summary_rejects_too_many_groups():
    with pytest.raises(pl.PlacementError, match="host buckets"):
        pl.ZoneSummary(1, 1, (0,) * len(pl.SHAPES), 0.0, 0, hosts=(((1, 1.0, 1.0),) * (pl.MAX_HOST_BUCKETS + 1),))
