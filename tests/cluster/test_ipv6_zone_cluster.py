"""A zone on an IPv6-only fabric: three real agents whose ``[[zone.nodes]]`` addresses are IPv6
(``[fd<random>::N]:7440``, a random ULA prefix), each in its own namespace with no IPv4 address at all, ``zone.listen``
left at its default (tests/cluster/harness.py, ``ipv6=True``). One zone serves every check:

- placements probe and hand jobs over across nodes, with no ``wrong_source`` drop and no send
  error anywhere (``zone stats``), and ``zone peers`` shows the addresses as the config takes them;
- a reclaim with a notice window moves a running job (a small jobkit job, ``JOB`` below) to
  another node over the TCP transfer: the checkpoint is verified at the destination and the job
  resumes there from it; the transfer is shaped while it runs (``net transfers`` names its IPv6
  flow and the TC program counts the flow's packets: ``net flows``);
- the kill-switch cuts a job's IPv6 traffic at an armed deadline (the mechanism a reclaim arms
  for its window's end) and ``off`` gives it back.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from agentproc import REPO, VENV_BIN, api_json
from harness import Cluster, Node, wait_until
from test_migration import job_log, job_state, migrate_config, verified_steps

pytestmark = pytest.mark.cluster

ECHO_PORT = 7499
CKPT_BYTES = 3 << 20  # a checkpoint the shaped transfer takes a while to send (link_mbit below)

JOB = textwrap.dedent(f"""\
    import json, os, socket, sys, time
    sys.path.insert(0, {str(REPO / "agent")!r})
    from laminar import jobkit

    ck = jobkit.Checkpointer()
    state = ck.resume()
    step = 0 if state is None else int.from_bytes(state[:8], "little")
    print(json.dumps({{"event": "start", "step": step, "resumed": state is not None}}), flush=True)
    blob = os.urandom({CKPT_BYTES})
    while step < 100000:
        time.sleep(0.05)
        step += 1
        if ck.requested():
            ck.save(step.to_bytes(8, "little") + blob, step=step)
            print(json.dumps({{"event": "checkpoint", "step": step}}), flush=True)
""")

# a job that asks an echo server (on another node) for an answer every 50 ms and logs each try;
# it takes no checkpoints (a reclaim's checkpoint signal is ignored)
ECHO_JOB = textwrap.dedent("""\
    import json, signal, socket, sys, time
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(0.2)
    n = 0
    while True:
        n += 1
        try:
            s.sendto(str(n).encode(), (sys.argv[1], int(sys.argv[2])))
            ok = s.recv(64) == str(n).encode()
        except OSError:
            ok = False
        print(json.dumps({"event": "echo", "n": n, "ok": ok}), flush=True)
        time.sleep(0.05)
""")

ECHO_SERVER = textwrap.dedent("""\
    import socket, sys
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], int(sys.argv[2])))
    while True:
        data, addr = s.recvfrom(64)
        s.sendto(data, addr)
""")


@pytest.fixture(scope="module")
def zone6(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("v6")
    (tmp / "v6job.py").write_text(JOB)
    (tmp / "v6echo.py").write_text(ECHO_JOB)
    extra = migrate_config(shaping_mbit=40, prestage='"off"')
    with Cluster.create(tmp, zones=1, per_zone=3, gpus=1, ipv6=True, zone_extra=extra) as c:
        yield c


def stats(nd: Node) -> dict[str, Any]:
    return dict(nd.json("zone", "stats"))


def no_wrong_source(c: Cluster) -> None:
    for nd in c.nodes:
        st = stats(nd)
        assert st["drops"]["wrong_source"] == 0 and st["handover_drops"]["wrong_source"] == 0, (nd.node_id, st)
        assert st["udp"]["send_errors"] == 0, (nd.node_id, st["udp"])


def test_placements_cross_nodes_over_ipv6(zone6: Cluster) -> None:
    c = zone6
    peers = c.nodes[0].json("zone", "peers")
    # the roster's spelling (leading zeros, see Cluster.create) is shown; it is the address ip prints
    assert {p["node"]: p["addr"].rpartition(":")[2] for p in peers} == {nd.node_id: "7440" for nd in c.nodes}
    assert {p["node"]: str(ipaddress.ip_address(p["addr"][1:].partition("]")[0])) for p in peers} == {
        nd.node_id: nd.addr for nd in c.nodes}
    # every peer has been heard (summaries went both ways over IPv6)
    wait_until(lambda: all(p["self"] or p["last_seen_s"] is not None for p in c.nodes[0].json("zone", "peers")),
               10, "node 1 to hear every peer")
    # one GPU per node: three one-GPU placements from node 1 take every node
    placed = [c.place(0, {"name": f"lm-t-v6-{i}", "command": ["sleep", "1"]}, gpus=1) for i in range(3)]
    assert [p["outcome"] for p in placed] == ["placed"] * 3, placed
    assert sorted(p["node"] for p in placed) == [1, 2, 3], placed
    accepted = sum(stats(nd)["handover_drops"]["accepted"] for nd in c.nodes[1:])
    assert accepted >= 2  # the two remote placements came in as hand-overs
    no_wrong_source(c)
    for p in placed:  # their GPUs are free again for the checks below
        nd = c.nodes[p["node"] - 1]
        wait_until(lambda nd=nd, p=p: job_state(nd, p["job_id"])["state"] == "exited", 20, "a placed job to end")


def test_reclaim_moves_a_running_job_over_ipv6_shaped(zone6: Cluster) -> None:
    c = zone6
    a = c.nodes[0]
    job = json.loads(a.ctl("-o", "json", "submit", "--name", "lm-t-v6move", "--",
                           str(VENV_BIN / "python"), str(c.tmp.parent / "v6job.py")).stdout)
    jid, key = job["id"], f"n{a.node_id}-{job['id']}"
    wait_until(lambda: any(e["event"] == "start" for e in job_log(a, jid)), 30, "the job to start on node A")
    res = json.loads(a.ctl("-o", "json", "reclaim", "--notice", "10s", "--reason", "lm-t v6").stdout)
    assert res["reclaim"]["armed"] == [jid], res  # the kill-switch is armed for the window's end
    seen_transfers: list[dict[str, Any]] = []
    seen_flows: list[dict[str, Any]] = []

    def get(path: str) -> Any:  # straight to the socket: a laminarctl process per poll could miss the transfer
        status, body = api_json(a.agent.sock, "GET", path)
        assert status == 200, (path, body)
        return body

    def moved() -> bool:
        seen_transfers.extend(t for t in get("/v1/net/transfers")["transfers"] if t["job"] == jid)
        seen_flows.extend(get("/v1/killswitch/flow"))
        return get(f"/v1/jobs/{jid}")["state"] == "migrated"

    wait_until(moved, 40, "the job to leave node A", every=0.05)
    move = a.json("migrations")[0]  # done before the job was stopped here (migrated)
    assert move["phase"] == "done", move
    assert move["dest"] != a.node_id, move
    b = c.nodes[move["dest"] - 1]
    ckpt = int(move["ckpt"].removeprefix("ckpt-"))
    assert ckpt in verified_steps(b, key)  # verified at the destination
    wait_until(lambda: any(e["event"] == "start" for e in job_log(b, move["dest_job"])), 30, "the job to resume on B")
    first = [e for e in job_log(b, move["dest_job"]) if e["event"] == "start"][0]
    assert first == {"event": "start", "step": ckpt, "resumed": True}, first
    # the transfer was shaped: registered with its IPv6 flow, and the TC program counted it
    flows = {t["flow"] for t in seen_transfers}
    assert flows and all(f.startswith(f"tcp:[{a.addr}]:") and f"->[{b.addr}]:" in f for f in flows), seen_transfers
    counted = [f for f in seen_flows if f.get("flow") in flows and int(f.get("packets") or 0) > 0]
    assert counted, (flows, seen_flows[-5:])
    no_wrong_source(c)
    b.ctl("job", "stop", "--grace", "0", move["dest_job"])


def test_the_kill_switch_cuts_a_jobs_ipv6_traffic(zone6: Cluster) -> None:
    c = zone6
    b, peer = c.nodes[1], c.nodes[2]
    server = peer.netns.popen(str(VENV_BIN / "python"), "-c", ECHO_SERVER, peer.addr, str(ECHO_PORT))
    try:
        job = json.loads(b.ctl("-o", "json", "submit", "--name", "lm-t-v6echo", "--", str(VENV_BIN / "python"),
                               str(c.tmp.parent / "v6echo.py"), peer.addr, str(ECHO_PORT)).stdout)
        jid = job["id"]

        def echoes() -> list[dict[str, Any]]:
            return [e for e in job_log(b, jid) if e["event"] == "echo"]

        wait_until(lambda: any(e["ok"] for e in echoes()), 20, "the job's first answered echo")
        b.ctl("killswitch", "arm", "--job", jid, "--at", "+1s")
        # cut: from some try on, nothing is answered any more
        wait_until(lambda: len(echoes()) > 5 and not any(e["ok"] for e in echoes()[-5:]), 20,
                   "the job's echoes to go unanswered after the armed deadline")
        n_cut = echoes()[-1]["n"]
        b.ctl("killswitch", "off", "--job", jid)
        wait_until(lambda: any(e["ok"] and e["n"] > n_cut for e in echoes()), 20, "the echoes to come back after off")
        b.ctl("job", "stop", "--grace", "0", jid)
    finally:
        server.kill()
        server.wait()


def test_a_second_address_in_the_prefix_does_not_change_where_a_node_speaks_from(zone6: Cluster) -> None:
    """IPv6 hosts often hold several addresses of one /64 (SLAAC beside a static one, a service
    address, privacy addresses), and the kernel picks the newest as the source of what a
    wildcard socket sends. Node 3 gets one more; its probes, summaries and hand-overs must still
    come from its roster address. Before, zone.listen's default bound '::': every datagram and
    hand-over of node 3 was dropped as wrong_source and node 3 could place nothing elsewhere."""
    c = zone6
    me, other = c.nodes[2], c.nodes[1]  # node 1 is reclaimed (draining) by the test above
    ifname = json.loads(me.netns.run("ip", "-j", "-6", "addr", "show", "to", f"{me.addr}/128").stdout)[0]["ifname"]
    extra = f"{me.addr.rsplit(':', 1)[0]}:{secrets.randbelow(0xF000) + 0x1000:x}"
    me.netns.run("ip", "addr", "add", f"{extra}/64", "dev", ifname, "nodad")
    try:
        src = me.netns.run("ip", "-6", "route", "get", other.addr).stdout
        assert f"src {extra} " in src, src  # the kernel's choice of source is now the new address
        sent = stats(me)["counts"]["summaries_sent"]
        wait_until(lambda: stats(me)["counts"]["summaries_sent"] >= sent + 3, 10, "node 3 to send summaries")
        placed = [c.place(2, {"name": f"lm-t-v6-src{i}", "command": ["sleep", "60"]}, gpus=1) for i in range(2)]
        assert [p["outcome"] for p in placed] == ["placed"] * 2, placed
        assert sorted(p["node"] for p in placed) == [other.node_id, me.node_id], placed  # one hand-over to node 2
        no_wrong_source(c)
        for p in placed:
            c.nodes[p["node"] - 1].ctl("job", "stop", "--grace", "0", p["job_id"])
    finally:
        me.netns.run("ip", "addr", "del", f"{extra}/64", "dev", ifname, check=False)


def test_a_reclaims_window_end_cuts_a_jobs_ipv6_traffic_with_the_agent_gone(zone6: Cluster) -> None:
    """The network backstop of a reclaim: node 2 is reclaimed with a short notice and its agent
    is killed at once (so nothing stops or moves its job); the deadline the reclaim armed in the
    data plane cuts the job's IPv6 traffic at the window's end all the same. (Last in the
    module: node 2 is gone after it.)"""
    c = zone6
    b, peer = c.nodes[1], c.nodes[2]
    server = peer.netns.popen(str(VENV_BIN / "python"), "-c", ECHO_SERVER, peer.addr, str(ECHO_PORT))
    try:
        job = json.loads(b.ctl("-o", "json", "submit", "--name", "lm-t-v6cut", "--", str(VENV_BIN / "python"),
                               str(c.tmp.parent / "v6echo.py"), peer.addr, str(ECHO_PORT)).stdout)
        jid = job["id"]

        def echoes() -> list[dict[str, Any]]:
            return [e for e in job_log(b, jid) if e["event"] == "echo"]

        wait_until(lambda: any(e["ok"] for e in echoes()), 20, "the job's first answered echo")
        res = json.loads(b.ctl("-o", "json", "reclaim", "--notice", "5s", "--reason", "lm-t v6 cut").stdout)
        assert jid in res["reclaim"]["armed"], res
        b.agent.kill9()
        at_kill = len(echoes())
        # answered inside the window (the cut is at its end, not at the announcement) ...
        wait_until(lambda: any(e["ok"] for e in echoes()[at_kill:]), 5, "an answered echo inside the window")
        # ... and, from some try on, no answer any more, with no agent running
        wait_until(lambda: len(echoes()) > at_kill + 5 and not any(e["ok"] for e in echoes()[-5:]), 20,
                   "the job's echoes to go unanswered at the window's end")
        assert b.agent.proc is not None and b.agent.proc.poll() is not None
    finally:
        server.kill()
        server.wait()
