"""An IPv4 roster address that is not the one the kernel's route picks as source (a host with
several addresses on its uplink: a secondary IP, a service address, keepalived's VIP). With
zone.listen unset the agent binds the roster address when this host holds it, as on an IPv6
roster, so its datagrams and hand-overs leave from it and peers checking the source
(zone.check_source) hear them; where the host does not hold it (NAT) it listens on 0.0.0.0
and looks again every ``rebind.interval_s``.

Loopback holds all of 127.0.0.0/8 and the kernel sends from 127.0.0.1 to 127.0.0.1: node 1
listed as 127.0.0.2 is a node listed by its secondary address. The same on a real veth with a
real laminard: tests/kernel/test_zone_ipv4_secondary_roster.py."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
from pathlib import Path

from test_zone_handover import SubmittingJobs
from test_zone_ipv6_roster import SUMMARY, _port, _with_nodes
from test_zone_replay import until

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import HANDOVER_OK, ZoneComponent, demand_to_probe

# a hand-over names its job's owner (a missing one is refused: laminar.zone.authority); nobody
# has an account on every Debian host and needs no zone.root_from
NOBODY_IDS = {"owner_uid": 65534, "owner_gid": 65534}


def test_a_node_listed_by_a_secondary_ipv4_address_is_heard_from_it(tmp_path: Path) -> None:
    """Node 1 listed as 127.0.0.2, zone.listen unset: its datagram and its hand-over reach node 2
    from 127.0.0.2. Before, it listened on 0.0.0.0, the kernel sent from 127.0.0.1 and node 2
    dropped both as wrong_source: the node could place nothing elsewhere nor be heard."""
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in (1, 2)}
    spec = json.dumps({"spec": {"command": ["sleep", "1"], "name": "v4"}, **NOBODY_IDS}).encode()

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2 = comps[1], comps[2]
        before = n2.endpoint.received
        n1.endpoint.send(2, SUMMARY)
        assert await until(lambda: n2.endpoint.received > before), n1.endpoint.send_errors
        assert n2.decoder.drops["wrong_source"] == 0
        assert n2.membership.state[1].last_summary is not None
        pid = 0x4402
        assert isinstance(n2.handle_request(1, demand_to_probe(pl.Demand(gpus=1), pid, 30.0)), wire.Offer)
        ack = await n1.submitter.t.handover(2, 0, wire.Handover(pid, spec), 5.0)
        assert ack.status == HANDOVER_OK, ack
        assert n2.tcp_decoder is not None and n2.tcp_decoder.drops["wrong_source"] == 0
        assert len(tables[2].jobs) == 1
        assert n1.listen_host == "127.0.0.2" and n1.endpoint.sock.getsockname()[0] == "127.0.0.2"

    asyncio.run(_with_nodes(tmp_path, {1: "127.0.0.2", 2: "127.0.0.1"}, body, jobs=tables.get))


def test_an_ipv4_roster_address_not_on_this_host_listens_on_any_address(tmp_path: Path) -> None:
    """Behind NAT the roster lists an address this host does not hold: the agent listens on
    0.0.0.0 (the kernel's source, rewritten by the NAT) rather than failing to start, and keeps
    looking for the address (a VIP that moves here later is bound then)."""
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    u, t = _port(socket.AF_INET, socket.SOCK_DGRAM), _port(socket.AF_INET, socket.SOCK_STREAM)
    nodes = [{"id": 1, "zone": 1, "addr": f"192.0.2.77:{u}", "handover_port": t},
             {"id": 2, "zone": 1, "addr": "127.0.0.1:7440"}]
    comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "port": u, "handover_port": t,
                                   "summary_interval_s": 600}, gpus=0, loan={"elastic_interval_s": 0})

    async def run() -> None:
        await comp.start(None)
        try:
            assert comp.listen_host == "0.0.0.0"
            assert comp.endpoint.sock.getsockname()[:2] == ("0.0.0.0", u)
            assert comp.server.server is not None
            assert [s.getsockname()[:2] for s in comp.server.server.sockets] == [("0.0.0.0", t)]
            assert comp.rebind.waiting_for == "192.0.2.77"  # the look for it runs
        finally:
            await comp.stop()

    asyncio.run(run())
