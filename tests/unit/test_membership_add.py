"""Nodes added to a running roster (a reload: Keyring.reload_keys): every index a reader
holds is updated in place, the new nodes start unknown (probed optimistically, as at start),
and a node id or address already listed is refused with nothing added."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from pathlib import Path

import pytest
from ports import free_port

from laminar.zone.component import ZoneComponent
from laminar.zone.membership import Member, Membership, MembershipError


def roster() -> Membership:
    return Membership(1, [Member(1, 1, "10.0.0.1", 7440, pool="training"), Member(2, 1, "10.0.0.2", 7440),
                          Member(4, 2, "10.0.0.4", 7440)])


def test_added_nodes_join_every_index_in_place_and_start_unknown() -> None:
    m = roster()
    zone1, training = m.zone_list(1), m.pool_list(1, "training")  # lists a reader holds on to
    assert m.add([Member(3, 1, "10.0.0.3", 7440, pool="training"), Member(5, 3, "10.0.0.5", 7440)]) == [3, 5]
    assert zone1 == [1, 2, 3] and m.zone_list(1) is zone1  # the same list, sorted
    assert training == [1, 3] and m.pool_list(1, "training") is training
    assert m.zones() == [1, 2, 3] and m.zone_list(3) == [5]
    assert m.zone_of() == {1: 1, 2: 1, 3: 1, 4: 2, 5: 3}
    assert m.udp_sources()[3] == ("10.0.0.3", 7440) and m.tcp_sources()[5] == "10.0.0.5"
    assert m.by_addr[("10.0.0.3", 7440)] == 3 and [x.node for x in m.members] == [1, 2, 4, 3, 5]
    assert m.zone_members(1, alive_only=True, now=0.0) == [2, 3]  # never heard from: probed
    m.seen(3, now=1.0)
    assert m.state[3].rx == 1 and [p["node"] for p in m.peers(1.0)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(("new", "error"), [
    ([Member(2, 1, "10.0.0.9", 7440)], "node id 2 listed twice"),
    ([Member(3, 1, "10.0.0.3", 7440), Member(3, 1, "10.0.0.6", 7440)], "node id 3 listed twice"),
    ([Member(3, 1, "10.0.0.2", 7440)], "node 3's address 10.0.0.2:7440 is another node's too"),
    ([Member(3, 1, "10.0.0.3", 7440), Member(5, 1, "10.0.0.3", 7440)], "node 3's address 10.0.0.3:7440"),
])
def test_a_node_id_or_address_listed_already_is_refused_with_nothing_added(new: list[Member], error: str) -> None:
    m = roster()
    with pytest.raises(MembershipError, match=error.replace("(", r"\(")):
        m.add(new)
    assert sorted(m.by_node) == [1, 2, 4] and m.zone_list(1) == [1, 2] and sorted(m.state) == [1, 2, 4]


def test_a_readdressed_node_is_heard_and_reached_at_its_new_address_and_keeps_its_liveness() -> None:
    m = roster()
    m.seen(2, now=5.0)
    assert m.readdress([Member(2, 1, "10.0.0.12", 7441, handover_port=7442)]) == [2]
    assert m.by_node[2].addr == "10.0.0.12" and m.by_node[2].port == 7441 and m.by_node[2].handover_port == 7442
    assert m.by_addr[("10.0.0.12", 7441)] == 2 and ("10.0.0.2", 7440) not in m.by_addr
    assert m.udp_sources()[2] == ("10.0.0.12", 7441) and m.tcp_sources()[2] == "10.0.0.12"
    assert [x.node for x in m.members] == [1, 2, 4] and m.members[1].addr == "10.0.0.12"
    assert m.state[2].last_seen == 5.0 and m.zone_list(1) == [1, 2]
    # two nodes trading addresses: each address one node's after the move
    assert m.readdress([Member(1, 1, "10.0.0.4", 7440, pool="training"), Member(4, 2, "10.0.0.1", 7440)]) == [1, 4]
    assert m.by_addr[("10.0.0.4", 7440)] == 1 and m.by_addr[("10.0.0.1", 7440)] == 4


@pytest.mark.parametrize(("new", "error"), [
    ([Member(3, 1, "10.0.0.3", 7440)], "node 3 is not in the roster"),
    ([Member(2, 2, "10.0.0.12", 7440)], "node 2's zone, pool or owner changed"),
    ([Member(1, 1, "10.0.0.11", 7440)], "node 1's zone, pool or owner changed"),  # its pool ("training") dropped
    ([Member(2, 1, "10.0.0.4", 7440)], "node 4's address 10.0.0.4:7440 is node 2's too"),
])
def test_a_readdress_that_is_not_only_an_address_or_takes_another_nodes_is_refused_with_nothing_changed(
        new: list[Member], error: str) -> None:
    m = roster()
    before = (dict(m.by_node), dict(m.by_addr), list(m.members))
    with pytest.raises(MembershipError, match=error.replace("(", r"\(").replace(")", r"\)")):
        m.readdress(new)
    assert (m.by_node, m.by_addr, m.members) == before
    assert m.udp_sources()[2] == ("10.0.0.2", 7440)  # the decoders' map, rebuilt from it, unchanged too


def test_a_reload_that_moves_a_node_and_adds_one_at_its_old_address_applies_both(tmp_path: Path) -> None:
    """A real ZoneComponent on loopback takes a reload's roster changes (``Keyring.roster_changes``): node
    2 moved to another port and node 3 added at node 2's old address. The move is applied
    first: added first, node 3 would clash with node 2 still there and the reload would fail
    half applied (its keys already switched)."""
    port = free_port(socket.SOCK_DGRAM)
    old2, new2 = free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    settings = {"node_id": 1, "nodes": [{"id": 1, "zone": 1, "addr": f"127.0.0.1:{port}"},
                                        {"id": 2, "zone": 1, "addr": f"127.0.0.1:{old2}"}],
                "keys_file": str(keys), "listen": "127.0.0.1", "port": port,
                "handover_port": free_port(socket.SOCK_STREAM), "cpus": 4, "memory_mb": 4000}
    comp = ZoneComponent(settings=settings, gpus=1, loan={"elastic_interval_s": 0})

    async def go() -> None:
        await comp.start(None)
        try:
            hp = comp.membership.by_node[2].handover_port
            comp.keyring.roster_changes([Member(3, 1, "127.0.0.1", old2, hp)], [Member(2, 1, "127.0.0.1", new2, hp)])
            m = comp.membership
            assert m.by_addr[("127.0.0.1", new2)] == 2 and m.by_addr[("127.0.0.1", old2)] == 3
            assert comp.decoder is not None and comp.decoder.sources is not None
            assert comp.decoder.sources[2] == ("127.0.0.1", new2) and comp.decoder.sources[3] == ("127.0.0.1", old2)
            assert comp.decoder.known_nodes == {1: 1, 2: 1, 3: 1}
        finally:
            await comp.stop()

    asyncio.run(go())
