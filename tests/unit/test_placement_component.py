"""The zone component's start-up checks and its one-node zone (laminar.zone.component): no
privileges, no sockets beyond loopback."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import ZoneComponent
from laminar.zone.keys import KeyFileError

NODES = [{"id": 1, "zone": 1, "addr": "127.0.0.1:1"}, {"id": 2, "zone": 1, "addr": "127.0.0.1:2"}]


def start(settings):
    comp = ZoneComponent(settings=settings, gpus=2)

    async def go():
        await comp.start(None)
        await comp.stop()

    asyncio.run(go())
    return comp


def test_missing_key_file_is_a_clear_start_up_error(tmp_path):
    with pytest.raises(KeyFileError, match="does not exist.*mode 0600"):
        start({"node_id": 1, "nodes": NODES, "keys_file": str(tmp_path / "none")})


def test_key_file_readable_by_others_is_refused(tmp_path):
    k = tmp_path / "keys"
    k.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(k, 0o644)
    with pytest.raises(KeyFileError, match="mode 0644"):
        start({"node_id": 1, "nodes": NODES, "keys_file": str(k)})


def test_weak_key_is_refused(tmp_path):
    k = tmp_path / "keys"
    k.write_text("1 00112233\n")
    os.chmod(k, 0o600)
    with pytest.raises(KeyFileError, match="at least 32"):
        start({"node_id": 1, "nodes": NODES, "keys_file": str(k)})


def test_node_id_must_be_set_and_listed(tmp_path):
    with pytest.raises(RuntimeError, match="node_id is not set"):
        start({"nodes": NODES})
    with pytest.raises(RuntimeError, match="node_id 9 is not in zone.nodes"):
        start({"node_id": 9, "nodes": NODES})


def test_one_node_zone_needs_no_key_and_arbitrates_locally():
    comp = start({"cpus": 4, "memory_mb": 4000})
    assert not comp.networked and comp.keys.source.startswith("ephemeral")
    offer = comp.handle_request(1, wire.Probe(5, 100, 1000, 100, 2000))
    assert isinstance(offer, wire.Offer) and offer.gpu_alloc == ((0, 100),)
    assert comp.handle_request(1, wire.Probe(6, 200, 1000, 100, 2000)) == wire.Refuse(6, pl.RefuseReason.NO_GPU)
    comp.handle_request(1, wire.Release(5))
    assert isinstance(comp.handle_request(1, wire.Probe(6, 200, 1000, 100, 2000)), wire.Offer)
    fits = comp.summaries.zone_fits(pl.Demand(gpus=1))
    assert set(fits) == {0}


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"id": 1, "zone": 1}], "addr None"),
        ([{"id": 0, "zone": 1, "addr": "10.0.0.1"}], "id 0 must be"),
        ([{"id": 1, "zone": 70000, "addr": "10.0.0.1"}], "zone 70000"),
        ([{"id": 1, "zone": 1, "addr": "host.example"}], "not an IP address"),
        ([{"id": 1, "zone": 1, "addr": "10.0.0.1:99999"}], "port must be"),
        ([{"id": 1, "zone": 1, "addr": "10.0.0.1", "color": "red"}], "unknown keys"),
    ],
)
def test_membership_config_errors_name_the_entry(rows, match):
    from laminar.zone.membership import MembershipError, members_from_config

    with pytest.raises(MembershipError, match=match):
        members_from_config(rows, 7440, 7441)


def test_membership_duplicate_ids_and_liveness():
    from laminar.zone.membership import MAX_MISSES, Member, Membership, MembershipError

    with pytest.raises(MembershipError, match="listed twice"):
        Membership(1, [Member(1, 1, "10.0.0.1", 1), Member(1, 2, "10.0.0.2", 1)])
    m = Membership(1, [Member(1, 1, "10.0.0.1", 1), Member(2, 1, "10.0.0.2", 1, pool="gpu")])
    assert m.pool_list(1, "gpu") == [2] and m.zone_list(1) == [1, 2]
    for _ in range(MAX_MISSES):
        m.missed(2, 0.0)
    assert m.suspects == {2} and m.zone_members(1, alive_only=True, now=0.0) == []
    m.seen(2, 1.0)
    assert m.suspects == set() and m.zone_members(1, alive_only=True, now=1.0) == [2]
