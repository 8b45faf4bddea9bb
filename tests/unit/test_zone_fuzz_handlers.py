"""Fuzzing what a node does with decoded datagrams (hypothesis): any body the wire decoder
accepts, from a zone peer or from a node of another zone, handled by a real ZoneComponent
(loopback sockets, real keys), must neither raise in the handler nor break what the node
computes from it afterwards (its zone summary and the datagram carrying it, the fits a
placement uses, its stats)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ports import free_port
from test_fuzz_wire import bodies

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import ZoneComponent, zone_summary_to_msg


def _port(kind: int) -> int:
    return free_port(kind)


@pytest.fixture(scope="module")
def comp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZoneComponent]:
    tmp: Path = tmp_path_factory.mktemp("fuzzzone")
    keys = tmp / "zone.keys"
    keys.write_text(f"* {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    nodes = [{"id": n, "zone": z, "addr": f"127.0.0.1:{_port(socket.SOCK_DGRAM)}"} for n, z in ((1, 1), (2, 1), (3, 2))]
    s = {"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1",
         "port": int(nodes[0]["addr"].split(":")[1]), "handover_port": _port(socket.SOCK_STREAM),
         "cpus": 8, "memory_mb": 8000, "packing": "frag"}
    c = ZoneComponent(settings=s, gpus=4, loan={"elastic_interval_s": 0})
    loop = asyncio.new_event_loop()
    loop.run_until_complete(c.start(None))
    try:
        yield c
    finally:
        loop.run_until_complete(c.stop())
        loop.close()


def _roundtrip(body: wire.Body, sender: int) -> wire.Message | None:
    """``body`` as the receiver's decoder returns it (None when the wire would drop it)."""
    from laminar.zone.keys import ZoneKeys

    k = ZoneKeys({-1: bytes(32)}, "fuzz")
    try:
        data = wire.Encoder(sender, k, seq0=1).encode(body, 1, 1000.0, to=1)
        return wire.Decoder(k, {2: 1, 3: 2}, node=1).decode(data, 1000.0)
    except (ValueError, wire.Dropped, OverflowError):
        return None
    except Exception as e:  # struct.error: a value out of its field's range
        if type(e).__name__ == "error":
            return None
        raise


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=bodies, sender=st.sampled_from([2, 3]), zone2=st.booleans())
def test_any_decoded_body_is_handled_and_the_node_keeps_working(comp: ZoneComponent, body: wire.Body, sender: int,
                                                                zone2: bool) -> None:
    if zone2 and isinstance(body, wire.ZoneSummaryMsg):
        body = dataclasses.replace(body, zone=2)  # zone 2's, as its member node 3 (or node 2, wrongly) sends it
    msg = _roundtrip(body, sender)
    if msg is None:
        return
    comp._on_message(msg, ("127.0.0.1", 9))  # raises nothing (the endpoint would log a bug)
    now = comp.clock()
    comp.summaries.changed()
    comp.summaries.refresh_peer_mixes(now)
    own = comp.summaries.own_zone_summary(now)
    zone_summary_to_msg(own, comp.summaries.own_zone_mix(now))
    for d in (pl.Demand(gpus=1), pl.Demand(gpus=0.5), pl.Demand(gpus=8), pl.Demand(cpus=2.0)):
        comp.summaries.zone_fits(d)
        comp.summaries.zone_summary(2)
    comp.arbiter.summary(now)
    comp.stats()


def test_a_summary_of_more_gpus_than_a_node_may_have_is_dropped_and_counted(comp: ZoneComponent) -> None:
    """A node has at most 64 GPUs (placement.MAX_GPUS_PER_NODE); the summary's count is a u8.
    A summary of 65 or more was accepted by the decoder and raised in the handler (the node
    capacity refuses it): not counted as a drop, a traceback in the log for every such
    datagram. It is malformed: dropped and counted, and the peer's state is left as it was."""
    import time

    st0 = comp.membership.state[2].last_summary
    before = comp.decoder.stats()
    enc = wire.Encoder(2, comp.keys, seq0=time.time_ns() // 1000)
    key = comp.keys.get(1)
    assert key is not None
    m2 = comp.membership.by_node[2]
    src = (m2.addr, m2.port)  # node 2's roster address: zone.check_source drops node 2's datagrams from any other
    for n in (65, 255):  # signed by node 2 for node 1, as its encoder would (which refuses to)
        body = wire._SUMMARY.pack(8000, 8000, 0, n) + bytes([100] * n) + b"\0\0"
        enc.seq += 1
        data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.MsgType.SUMMARY, 0, 0, 1, 2, int(comp.wall() * 1000),
                                enc.seq, len(body)) + body
        comp.endpoint.datagram_received(data + wire._mac(key, data, 1), src)
    after = comp.decoder.stats()
    assert after["malformed"] == before["malformed"] + 2 and after["accepted"] == before["accepted"]
    assert comp.membership.state[2].last_summary is st0
    ok = enc.encode(wire.Summary((100,) * 64, 8000, 8000, False), 1, comp.wall(), to=1)  # 64: a node's most
    comp.endpoint.datagram_received(ok, src)
    assert comp.decoder.stats()["accepted"] == before["accepted"] + 1
    assert len(comp.membership.state[2].last_summary.gpu_free) == 64
