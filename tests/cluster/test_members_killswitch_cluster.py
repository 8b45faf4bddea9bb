"""The kill-switch of a multi-node job cuts the traffic of every member, on every member's node
(issue 33), between real agents: 3 laminard processes in one zone, each in a network namespace of
its own on a bridge of the test's own, each with its netguard data plane on its interface.

A 3-worker job of a plain program: member 0 listens on a UDP port of its own address and counts
what it gets, members 1 and 2 send to it (``MASTER_ADDR``) every 10 ms. ``laminarctl killswitch
on --job J`` on the origin: on every member's node the member's netguard counters (the
``lm_job_stats`` entry of its cgroup, ``laminarctl bpf dump``) stop counting what passes and
count drops instead, and member 0 receives nothing; ``off`` on the origin: traffic passes again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from harness import Cluster, Node, wait_until

pytestmark = pytest.mark.cluster

# Member 0 counts the datagrams it gets (one line per datagram, to RECV); the others send one
# every 10 ms to member 0's address (send errors, e.g. EPERM while cut, are ignored).
MEMBER = r"""
import os, socket, time
port = int(os.environ["MASTER_PORT"]) + 1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if os.environ["RANK"] == "0":
    s.bind((os.environ["MASTER_ADDR"], port))
    with open(os.environ["RECV"], "a") as f:
        while True:
            s.recv(2048)
            f.write("r\n")
            f.flush()
while True:
    try:
        s.sendto(b"x" * 200, (os.environ["MASTER_ADDR"], port))
    except OSError:
        pass
    time.sleep(0.01)
"""


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))




def stats(nd: Node, cgroup_id: int) -> dict[str, int]:
    """The member's netguard counters on its node (lm_job_stats, keyed by its cgroup's id)."""
    for e in nd.json("bpf", "dump", "lm_job_stats")["entries"]:
        if int(e["key"]["cgroup_id"]) == cgroup_id:
            return {k: int(v) for k, v in e["value"].items()}
    return {}


def test_the_killswitch_of_a_multinode_job_cuts_every_members_traffic_and_off_restores_it(make_cluster,
                                                                                          tmp_path) -> None:
    import sys

    c = make_cluster(zones=1, per_zone=3, gpus=0)
    recv = tmp_path / "recv"
    view = c.place(0, {"name": "talk", "command": [sys.executable, "-c", MEMBER], "workers": 3,
                       "launcher": "plain", "env": {"RECV": str(recv)}})
    job = view["id"]
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 30, "the job running")
    by_node = {nd.node_id: nd for nd in c.nodes}
    index_of = {m["node"]: m["index"] for m in view["members"]}
    cg = {}
    for nd in c.nodes:
        cg[nd.node_id] = int(nd.json("job", "show", job)["cgroup_id"])

    def received() -> int:
        return len(recv.read_text()) // 2 if recv.exists() else 0

    def counted(node: int) -> int:  # what passes: sent by a sender, received by member 0
        s = stats(by_node[node], cg[node])
        return s.get("rx_packets", 0) if index_of[node] == 0 else s.get("tx_packets", 0)

    def all_growing(window: float = 0.5) -> bool:
        a = {n: counted(n) for n in cg}
        r = received()
        time.sleep(window)
        return all(counted(n) > a[n] for n in cg) and received() > r

    wait_until(all_growing, 20, "every member's traffic counted on its node and member 0 receiving")

    out = c.nodes[0].ctl("killswitch", "on", "--job", job)
    assert out.returncode == 0, out
    # every member's node cut it: what passes stops on every node, drops grow on the senders'
    time.sleep(0.3)  # packets in flight when the switch went on
    passed = {n: counted(n) for n in cg}
    drops = {n: stats(by_node[n], cg[n]).get("drop_packets", 0) for n in cg}
    r = received()
    time.sleep(1.0)
    assert {n: counted(n) for n in cg} == passed, "a member's traffic still passes with the switch on"
    assert received() == r, "member 0 still receives with the switch on"
    senders = [n for n in cg if index_of[n] != 0]
    after = {n: stats(by_node[n], cg[n]).get("drop_packets", 0) for n in cg}
    assert all(after[n] > drops[n] for n in senders), (drops, after)
    for nd in c.nodes:  # each node says it cut its member
        ks = nd.json("events", "--kind", "killswitch", "--limit", "50")
        assert any(e.get("job") == job and e.get("action") == "on" for e in ks), (nd.node_id, ks)

    c.nodes[0].ctl("killswitch", "off", "--job", job)
    wait_until(all_growing, 20, "every member's traffic passing again")
    assert c.multinode_view(0, job)["state"] == "running"
    c.nodes[0].ctl("job", "stop", job)
    wait_until(lambda: c.multinode_view(0, job).get("state") == "ended", 30, "the job stopped")
