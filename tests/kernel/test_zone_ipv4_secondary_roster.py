"""A node listed in the roster by a secondary IPv4 address of its uplink (a second IP, a service
address, keepalived's VIP), not the one the kernel's route picks as source. With zone.listen
unset laminard binds the roster address (it holds it), so the zone's datagrams, its hand-over
listener and the checkpoint-transfer listener (whose connections leave from the same address)
are all on it, and a peer sees its datagrams come from the roster address (zone.check_source
drops anything else as wrong_source). Before, an IPv4 roster kept 0.0.0.0: the kernel sent from
the primary address and every peer dropped the node's traffic.

A real laminard in a namespace whose veth holds 10.69.0.1/24 (primary) and 10.69.0.2/24 (the
roster's); the peer, node 2, is a plain UDP socket at 10.69.0.3 in a second namespace that
reports the source of the first datagram it gets (a capacity summary, sent every second)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from agentproc import AgentProc
from conftest import delete_netns, kernel_ready, make_netns
from test_zone_tentative_roster import _keys, _listening

pytestmark = [pytest.mark.kernel, pytest.mark.skipif(kernel_ready() is not None, reason=str(kernel_ready()))]

IF = "lmtv4s0"
ROSTER, PEER = "10.69.0.2", "10.69.0.3"

PEER_SCRIPT = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 7440))
s.settimeout(30)
print(s.recvfrom(65536)[1][0])
"""


def test_a_node_listed_by_a_secondary_ipv4_address_listens_and_sends_from_it(tmp_path: Path) -> None:
    ns, peer, agent = make_netns("v4s"), None, None
    try:
        peer = make_netns("v4sp")
        ns.run("ip", "link", "add", IF, "type", "veth", "peer", "name", f"{IF}p", "netns", peer.name)
        ns.run("ip", "addr", "add", "10.69.0.1/24", "dev", IF)  # primary: the route's source
        ns.run("ip", "addr", "add", f"{ROSTER}/24", "dev", IF)  # secondary: the roster's
        ns.run("ip", "link", "set", IF, "up")
        peer.run("ip", "addr", "add", f"{PEER}/24", "dev", f"{IF}p")
        peer.run("ip", "link", "set", f"{IF}p", "up")
        zone = (f'[zone]\nnode_id = 1\nkeys_file = "{_keys(tmp_path)}"\n'
                f'[[zone.nodes]]\nid = 1\nzone = 1\naddr = "{ROSTER}"\n'
                f'[[zone.nodes]]\nid = 2\nzone = 1\naddr = "{PEER}"\n')
        agent = AgentProc(tmp_path, IF, netns=ns, extra_toml=zone)
        agent.start()
        assert agent.proc is not None
        seen = subprocess.run(peer.argv(sys.executable, "-c", PEER_SCRIPT, PEER), capture_output=True, text=True,
                              timeout=60)
        assert seen.returncode == 0, seen.stderr + agent.log()
        assert seen.stdout.strip() == ROSTER, f"the peer saw the node's datagram come from {seen.stdout.strip()}"
        assert _listening(ns, agent.proc.pid) == [f"tcp {ROSTER}:7441", f"tcp {ROSTER}:7442", f"udp {ROSTER}:7440"], \
            agent.log()
    finally:
        if agent is not None:
            agent.cleanup()
        for n in (ns, peer):
            if n is not None:
                delete_netns(n)
