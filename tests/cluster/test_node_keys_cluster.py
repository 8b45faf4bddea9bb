"""Node keys end to end (docs/protocol.md, *Node keys*): real laminard agents, each in its own
network namespace, with a node key file each and every pubkey in the roster.

- A zone with node keys works: jobs are placed across all nodes, also across zones (probes,
  offers, commits, hand-overs and zone summaries all pair-signed), and no datagram or hand-over
  frame is dropped as ``bad_mac``; a reclaim forwarded to another node's agent and withdrawn
  there (migrate control messages over the transfer protocol) authenticates under the pair key.
- The property node keys buy: node 3 (a zone member: it holds the zone key) sends node 1 a
  reclaim notice signed with the zone key in node 2's name, from node 2's own address and port
  (a raw socket writes the IP header: IP spoofing on the segment). ``zone.check_source`` stays
  on and passes it (the address is node 2's). Without node keys node 1 believes it: it records
  node 2's reclaim (the hole, shown first); with them it drops it as ``bad_mac`` and placements
  go on.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Cluster, wait_until
from test_keys_rotation_cluster import api, bad_macs, make_cluster, place_round

from laminar.zone import wire
from laminar.zone.keys import ZoneKeys

pytestmark = pytest.mark.cluster
__all__ = ["make_cluster"]  # the fixture, shared with the rotation test


def test_a_zone_with_node_keys_places_jobs_on_every_node_of_both_zones(make_cluster: Any) -> None:
    # node 2 lets node 1 (the operator's node) reclaim it and cancel that (migrate.reclaim_from)
    c = make_cluster(zones=2, per_zone=2, gpus=1, node_keys=True, node_extra={1: "[migrate]\nreclaim_from = [1]\n"})
    for nd in c.nodes:
        nk = api(nd, "/v1/zone/keys")["node_key"]
        assert nk["file"] == str(c.node_key_files[nd.node_id])
        assert nk["pair_peers"] == [n.node_id for n in c.nodes if n is not nd]
    res = [c.place(0, {"name": f"nk-{i}", "command": ["sleep", "300"]}, gpus=1) for i in range(4)]
    assert [r["outcome"] for r in res] == ["placed"] * 4, res
    assert sorted(r["node"] for r in res) == [1, 2, 3, 4], res  # one GPU each: every node, both zones
    assert bad_macs(c) == {1: 0, 2: 0, 3: 0, 4: 0}
    for nd in c.nodes:
        st = api(nd, "/v1/zone/stats")
        assert st["drops"]["accepted"] > 0 and st["handover_drops"]["wrong_source"] == 0
    # the migrate layer's control messages (its transfer protocol's handshake) use the pair key
    # too: node 1 forwards a reclaim of node 2 to node 2's agent, then withdraws it there
    n1, n2 = c.nodes[0], c.nodes[1]
    n1.ctl("reclaim", "--node", "2", "--notice", "120s", "--reason", "lm-t forwarded under the pair key")
    assert n2.json("reclaim", "status")["reclaim"]["reason"] == "lm-t forwarded under the pair key (from node 1)"
    n1.ctl("reclaim", "cancel", "--node", "2", "--reason", "lm-t withdrawn")
    assert n2.json("reclaim", "status")["reclaim"] is None


def forged_reclaim_notice(c: Cluster) -> None:
    """Node 3 signs a reclaim notice as node 2 with zone 1's key and sends it to node 1 from
    node 2's address and port (its sequence number far ahead of node 2's)."""
    enc = wire.Encoder(2, ZoneKeys({1: c.keys[1]}, "zone 1's key"), seq0=time.time_ns() // 1000 + 10**12)
    data = enc.encode(wire.ReclaimNotice(0xF0F0, 60_000, "forged by node 3"), 1, time.time(), to=1)
    c.send_spoofed(2, src=c.nodes[1], dst=c.nodes[0], data=data)


@pytest.mark.parametrize("node_keys", [False, True], ids=["zone-key-only", "node-keys"])
def test_a_notice_spoofed_from_node_2s_address_is_taken_only_without_node_keys(make_cluster: Any,
                                                                                node_keys: bool) -> None:
    c = make_cluster(zones=1, per_zone=3, gpus=1, node_keys=node_keys)
    n1 = c.nodes[0]
    before = api(n1, "/v1/zone/stats")
    assert before["counts"]["reclaim_notices"] == 0
    forged_reclaim_notice(c)
    if not node_keys:
        # the address check passes (it is node 2's address): node 1 takes node 2's "reclaim"
        wait_until(lambda: api(n1, "/v1/zone/stats")["counts"]["reclaim_notices"] == 1, 15,
                   "node 1 to take the spoofed notice")
        st = api(n1, "/v1/zone/stats")
        assert st["drops"]["wrong_source"] == before["drops"]["wrong_source"]
        assert any("node 2 announced its reclaim" in e["message"] for e in api(n1, "/v1/events?kind=zone"))
        return
    wait_until(lambda: api(n1, "/v1/zone/stats")["drops"]["bad_mac"] == before["drops"]["bad_mac"] + 1, 15,
               "node 1 to drop the spoofed notice as bad_mac")
    st = api(n1, "/v1/zone/stats")
    assert st["counts"]["reclaim_notices"] == 0
    assert st["drops"]["wrong_source"] == before["drops"]["wrong_source"]
    assert not any("announced its reclaim" in e["message"] for e in api(n1, "/v1/events?kind=zone"))
    # node 2's own traffic is taken as before (the forgery moved nothing of its replay window)
    place_round(c, 0, "after-forgery")
    assert bad_macs(c) == {1: 1, 2: 0, 3: 0}
