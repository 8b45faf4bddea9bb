"""Node keys rolled out by reloads, without a restart (docs/operations.md, "Node keys"): 3 real
laminard agents of one zone, each in its own network namespace, start on zone-key MACs (each has
a node key file; the roster lists no pubkey). The operator's three rounds, each node by node: the
roster's pubkeys with ``node_keys = "accept"``, then ``send``, then ``require``, each node's
config rewritten and then reloaded (a SIGHUP or ``laminarctl zone keys reload``). After every
single node's reload three one-GPU jobs are placed from one node and must all be placed (they
land on all three nodes: probes, offers, commits and hand-overs cross between nodes one step
apart), and no datagram or hand-over frame is dropped as ``bad_mac``. At the end pair MACs are
required: a reclaim notice signed with the zone key in node 2's name (sent from node 2's own
address) is dropped by node 1 as ``bad_mac``.

A reload the agent cannot apply is refused whole and changes nothing: a config whose node key is
not the private key of the node's roster pubkey, one whose roster moved a node to another zone
(a restart's business). A ``[zone]`` setting a reload does not apply is named (``restart_needed``); the key
file is read from the path the config file names now."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest
from harness import Node, wait_until
from test_keys_rotation_cluster import api, bad_macs, make_cluster, place_round
from test_node_keys_cluster import forged_reclaim_notice

pytestmark = pytest.mark.cluster
__all__ = ["make_cluster"]


def node_key(nd: Node) -> dict[str, Any] | None:
    nk: dict[str, Any] | None = api(nd, "/v1/zone/keys")["node_key"]
    return nk


def test_node_keys_roll_out_by_reloads_node_by_node_with_placements_working(make_cluster: Any) -> None:
    c = make_cluster(zones=1, per_zone=3, gpus=1, node_keys=True, roster_pubkeys=False)
    started = {nd.node_id: nd.agent.config_path.read_text() for nd in c.nodes}

    def config(nd: Node, mode: str, extra: str = "") -> str:
        """The node's config with the roster's pubkeys and ``node_keys = mode``."""
        text = started[nd.node_id].replace(f"node_id = {nd.node_id}\n",
                                           f'node_id = {nd.node_id}\nnode_keys = "{mode}"\n{extra}', 1)
        return re.sub(r"\[\[zone.nodes\]\]\nid = (\d+)\n",
                      lambda m: f'{m.group(0)}pubkey = "{c.node_pubkeys[int(m.group(1))]}"\n', text)

    def reload(nd: Node, how: str, mode: str) -> None:
        nd.agent.config_path.write_text(config(nd, mode))
        if how == "sighup":
            assert nd.agent.proc is not None
            os.kill(nd.agent.proc.pid, signal.SIGHUP)
            wait_until(lambda: (node_key(nd) or {}).get("mode") == mode, 15,
                       f"node {nd.node_id} to reload its node keys on SIGHUP")
        else:
            out = nd.json("zone", "keys", "reload")
            assert out["node_key"]["mode"] == mode and out["restart_needed"] == [], out
        nk = node_key(nd)
        assert nk is not None and nk["mode"] == mode and nk["pubkey"] == c.node_pubkeys[nd.node_id], nk
        assert nk["pair_peers"] == [n.node_id for n in c.nodes if n is not nd], nk

    assert all(node_key(nd) is None for nd in c.nodes)
    place_round(c, 0, "before")
    rounds = 0
    for mode, hows in (("accept", ["sighup", "ctl", "ctl"]), ("send", ["ctl", "sighup", "ctl"]),
                       ("require", ["ctl", "ctl", "sighup"])):
        for nd, how in zip(c.nodes, hows, strict=True):
            reload(nd, how, mode)
            rounds += 1
            place_round(c, rounds % 3, f"{mode}-node{nd.node_id}")
            assert bad_macs(c) == {1: 0, 2: 0, 3: 0}, f"{mode}, after node {nd.node_id} ({how})"

    # pair MACs are required now: a zone-key MAC in node 2's name is no longer taken
    n1 = c.nodes[0]
    before = api(n1, "/v1/zone/stats")
    forged_reclaim_notice(c)
    wait_until(lambda: api(n1, "/v1/zone/stats")["drops"]["bad_mac"] == before["drops"]["bad_mac"] + 1, 15,
               "node 1 to drop the zone-key notice in node 2's name as bad_mac")
    assert api(n1, "/v1/zone/stats")["counts"]["reclaim_notices"] == before["counts"]["reclaim_notices"]

    # refused whole: node 1's node key file is node 2's (not the key of node 1's roster pubkey),
    # and node_keys goes back to accept in the same file: nothing changes
    good = config(n1, "require")
    n1.agent.config_path.write_text(config(n1, "accept").replace(
        f'node_key_file = "{c.node_key_files[1]}"', f'node_key_file = "{c.node_key_files[2]}"'))
    r = n1.ctl("zone", "keys", "reload", check=False)
    err = " ".join(r.stderr.split())
    assert r.returncode != 0 and "node 1's pubkey" in err and "the keys in use stay" in err, r.stderr
    assert node_key(n1)["mode"] == "require"  # type: ignore[index]
    # refused whole: the roster moved node 3 to another zone (a restart's business), named in the
    # event of a SIGHUP
    entry = f'zone = 1\naddr = "{c.nodes[2].addr}:'
    assert entry in good
    n1.agent.config_path.write_text(good.replace(entry, entry.replace("zone = 1", "zone = 2")))
    os.kill(n1.agent.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: any("not reloaded" in e["message"] and "node 3 changed" in e["message"]
                           for e in api(n1, "/v1/events?kind=zone")), 15, "the refused reload's event")
    assert node_key(n1)["mode"] == "require"  # type: ignore[index]
    # a [zone] setting a reload does not apply is named, and the node keys are applied
    n1.agent.config_path.write_text(good.replace("summary_interval_s = 0.3\n", "summary_interval_s = 0.5\n"))
    out = n1.json("zone", "keys", "reload")
    assert out["restart_needed"] == ["zone.summary_interval_s"] and out["node_key"]["mode"] == "require", out
    # keys_file is the config file's now: a key file moved to another path is read from there
    moved = c.keys_file.with_name("zone-moved.keys")
    moved.write_bytes(c.keys_file.read_bytes())
    os.chmod(moved, 0o600)
    n1.agent.config_path.write_text(good.replace(f'keys_file = "{c.keys_file}"', f'keys_file = "{moved}"'))
    out = n1.json("zone", "keys", "reload")
    assert out["source"] == str(moved) and out["restart_needed"] == [], out
    place_round(c, 0, "after")
    assert bad_macs(c) == {1: 1, 2: 0, 3: 0}  # the forged notice alone
