"""A node added to a zone's roster is taken by a reload, without restarting the agents that
run (docs/operations.md, "Adding a node"): 3 real laminard agents of one zone, each in its own
network namespace; nodes 1 and 2 run with a roster that lacks node 3 (node 3 lists all three).
Node 3's datagrams are dropped at their door (``unknown_node``) and nobody places on it. Then
node 1's config gets node 3's entry and a SIGHUP (its event names ``added_nodes: [3]``), node
2's a ``laminarctl zone keys reload`` (which says so): from then on jobs placed from node 1 and from node 2 land
on all three nodes (probes, offers and the hand-over to node 3 cross). A reload whose roster
drops a node is refused whole, naming it, and changes nothing (a restart's business)."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest
from harness import Node, wait_until
from test_keys_rotation_cluster import api, make_cluster, place_round

pytestmark = pytest.mark.cluster
__all__ = ["make_cluster"]


def without(text: str, node: int) -> str:
    """A harness config with node ``node``'s ``[[zone.nodes]]`` entry taken out."""
    out, n = re.subn(rf"\n\[\[zone\.nodes\]\]\nid = {node}\n(?:(?!\[)[^\n]*\n)*", "\n", text)
    assert n == 1, f"node {node}'s entry not found once in the config"
    return out


def roster(nd: Node) -> list[int]:
    return sorted(int(p["node"]) for p in api(nd, "/v1/zone/peers"))


def test_a_node_added_to_the_roster_by_a_reload_takes_placements_without_a_restart(make_cluster: Any) -> None:
    c = make_cluster(zones=1, per_zone=3, gpus=1)
    n1, n2, n3 = c.nodes
    full = {nd.node_id: nd.agent.config_path.read_text() for nd in (n1, n2)}
    for nd in (n1, n2):  # nodes 1 and 2 run with a roster that lacks node 3
        nd.agent.config_path.write_text(without(full[nd.node_id], 3))
        nd.agent.stop()
        nd.agent.start()
    assert roster(n1) == [1, 2] and roster(n2) == [1, 2] and roster(n3) == [1, 2, 3]
    wait_until(lambda: api(n1, "/v1/zone/stats")["drops"]["unknown_node"] > 0, 30,
               "node 1 to drop node 3's datagrams at the door")

    n1.agent.config_path.write_text(full[1])
    assert n1.agent.proc is not None
    os.kill(n1.agent.proc.pid, signal.SIGHUP)
    wait_until(lambda: roster(n1) == [1, 2, 3], 15, "node 1 to take node 3 into its roster on SIGHUP")
    ev = [e for e in api(n1, "/v1/events?kind=zone") if e.get("added_nodes")]
    assert [e["added_nodes"] for e in ev] == [[3]] and "nodes added to the roster: 3 (zone 1" in ev[0]["message"], ev
    n2.agent.config_path.write_text(full[2])
    out = n2.ctl("zone", "keys", "reload").stdout
    assert "nodes added to the roster: 3" in out and "restart" not in out, out
    assert roster(n2) == [1, 2, 3]
    assert n1.agent.proc.poll() is None and n2.agent.proc is not None and n2.agent.proc.poll() is None  # no restart

    place_round(c, 0, "from-1")  # three one-GPU jobs from node 1: one on each node, node 3 included
    place_round(c, 1, "from-2")
    place_round(c, 2, "from-3")

    # a roster that drops a node is a restart's business: refused whole, nothing changes
    n1.agent.config_path.write_text(without(full[1], 2))
    r = n1.ctl("zone", "keys", "reload", check=False)
    assert r.returncode != 0 and "node 2 dropped" in r.stderr and "takes a restart" in r.stderr, (r.stdout, r.stderr)
    assert roster(n1) == [1, 2, 3]
    n1.agent.config_path.write_text(full[1])
    place_round(c, 0, "after-refused")


def peer_addr(nd: Node, node: int) -> str:
    return next(str(p["addr"]) for p in api(nd, "/v1/zone/peers") if int(p["node"]) == node)


def test_a_node_given_another_address_is_taken_by_a_reload_without_restarting_the_others(make_cluster: Any) -> None:
    """Node 2's host gets another address (a re-IP): its agent restarts there with its new
    roster entry (its own address takes a restart), and nodes 1 and 3 take the new address by a
    reload (SIGHUP, ``zone keys reload``), no restart: until then they drop node 2's datagrams
    (``wrong_source``: its listed address is the old one) and never place on it; after, jobs
    placed from each node land on all three. A reload that changes another node's zone, or this
    node's own address, is refused whole, naming the node, and changes nothing."""
    c = make_cluster(zones=1, per_zone=3, gpus=1)
    n1, n2, n3 = c.nodes
    old = n2.addr
    new = old.rsplit(".", 1)[0] + ".102"
    n2.netns.run("ip", "addr", "add", f"{new}/24", "dev", n2.host_if[:-1] + "n")
    texts = {nd.node_id: nd.agent.config_path.read_text() for nd in c.nodes}
    moved = {n: t.replace(f'addr = "{old}:', f'addr = "{new}:') for n, t in texts.items()}
    assert all(moved[n] != texts[n] for n in moved)
    n2.agent.config_path.write_text(moved[2])
    n2.agent.stop()
    n2.agent.start()
    drops = api(n1, "/v1/zone/stats")["drops"]["wrong_source"]
    wait_until(lambda: api(n1, "/v1/zone/stats")["drops"]["wrong_source"] > drops, 30,
               "node 1 to drop node 2's datagrams from its new address")

    n1.agent.config_path.write_text(moved[1])
    assert n1.agent.proc is not None
    os.kill(n1.agent.proc.pid, signal.SIGHUP)
    wait_until(lambda: peer_addr(n1, 2).startswith(new), 15, "node 1 to take node 2's new address on SIGHUP")
    ev = [e for e in api(n1, "/v1/events?kind=zone") if e.get("readdressed_nodes")]
    assert [e["readdressed_nodes"] for e in ev] == [[2]] and f"nodes readdressed: 2 ({new}:" in ev[0]["message"], ev
    n3.agent.config_path.write_text(moved[3])
    out = n3.ctl("zone", "keys", "reload").stdout
    assert "nodes at a new address: 2" in out and "restart" not in out, out
    assert peer_addr(n3, 2).startswith(new)
    assert all(nd.agent.proc is not None and nd.agent.proc.poll() is None for nd in (n1, n3))  # no restart
    assert roster(n1) == roster(n3) == [1, 2, 3]

    place_round(c, 0, "from-1")  # node 2 included, at its new address (probes, offers, the hand-over)
    place_round(c, 1, "from-2")
    place_round(c, 2, "from-3")

    # another node's zone, or this node's own address: a restart's business, refused whole
    for text, what in ((moved[1].replace("id = 3\nzone = 1", "id = 3\nzone = 2"), "node 3 changed"),
                       (moved[1].replace(f'addr = "{n1.addr}:', f'addr = "{n1.addr[:-1]}9:'), "node 1 changed")):
        assert text != moved[1]
        n1.agent.config_path.write_text(text)
        r = n1.ctl("zone", "keys", "reload", check=False)
        assert r.returncode != 0 and what in r.stderr and "takes a restart" in r.stderr, (r.stdout, r.stderr)
        assert peer_addr(n1, 2).startswith(new) and roster(n1) == [1, 2, 3]
    # node 2 moved onto node 3's address: one address for two nodes, refused whole
    n1.agent.config_path.write_text(moved[1].replace(f'addr = "{new}:', f'addr = "{n3.addr}:'))
    r = n1.ctl("zone", "keys", "reload", check=False)
    assert r.returncode != 0 and "lists node 3 at node 2's address" in " ".join(r.stderr.split()), r.stderr
    assert peer_addr(n1, 2).startswith(new) and peer_addr(n1, 3).startswith(n3.addr)
    n1.agent.config_path.write_text(moved[1])
    place_round(c, 0, "after-refused")
