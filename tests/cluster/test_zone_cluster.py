"""Zone placement between real agents: 9 laminard processes in 3 zones, each in its own network
namespace on a bridge of the test's own, talking authenticated UDP (probes, offers, summaries)
and TCP (hand-overs). GPUs are declared (no GPU here): 2 per node, so the cluster holds 18
one-GPU jobs and not one more.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from harness import UDP_PORT, Cluster, wait_until

pytestmark = pytest.mark.cluster


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Start a cluster (harness.Cluster.create); everything is removed after the test."""
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))

SLEEP = ["sleep", "300"]


def all_jobs(c: Cluster) -> list[tuple[int, dict[str, Any]]]:
    """(node id, job) for every job of every running agent, whatever its state."""
    out = []
    for nd in c.nodes:
        if nd.agent.proc is not None and nd.agent.proc.poll() is None:
            out.extend((nd.node_id, j) for j in nd.json("jobs"))
    return out


def assert_within_capacity(c: Cluster, gpus: int) -> None:
    for node, jobs in c.jobs().items():
        used = [g for j in jobs for g in j["gpus"]]
        assert len(used) <= gpus and len(set(used)) == len(used), f"node {node} over capacity: {jobs}"


def test_jobs_submitted_on_one_node_run_on_others_never_over_capacity(make_cluster):
    c = make_cluster(zones=3, per_zone=3, gpus=2)
    results = [c.place(0, {"name": f"fill-{i}", "command": SLEEP}, gpus=1) for i in range(18)]
    assert [r["outcome"] for r in results] == ["placed"] * 18, results
    where = Counter(r["node"] for r in results)
    assert set(where) == {nd.node_id for nd in c.nodes}  # every node took its two
    assert all(n == 2 for n in where.values()), where
    assert {r["zone"] for r in results} == {1, 2, 3}
    # each job runs on the node the placement names, under the job id it returned
    jobs = {(node, j["id"]): j for node, j in all_jobs(c)}
    for r in results:
        assert jobs[(r["node"], r["job_id"])]["name"] == r.get("name", jobs[(r["node"], r["job_id"])]["name"])
    assert_within_capacity(c, 2)
    # the cluster is full: one more is refused (queued, then given up), nothing starts anywhere
    extra = c.place(0, {"name": "one-too-many", "command": SLEEP}, gpus=1)
    assert extra["outcome"] == "queued-out", extra
    assert not [j for _, j in all_jobs(c) if j["name"] == "one-too-many"]
    assert_within_capacity(c, 2)
    # fractional GPUs share the freed GPU of one job: two halves fit where one whole job was
    victim = results[0]
    c.nodes[victim["node"] - 1].ctl("job", "stop", victim["job_id"], "--grace", "0")
    # its GPU is the only free one: its zone's summary names it (a hint) for one GPU, as other
    # zones receive it, so a probe goes to it
    vzone = (victim["node"] - 1) // 3 + 1
    observer = c.nodes[(vzone % 3) * 3]  # a node of another zone
    wait_until(lambda: observer.json("zone", "stats")["zone_summaries"].get(str(vzone), {}).get("hints", {}).get("1.0")
               == [victim["node"]], 30, "the zone summary to hint the node with the free GPU")
    wait_until(lambda: c.place(0, {"name": "half-a", "command": SLEEP}, gpus=0.5)["outcome"] == "placed",
               30, "the freed GPU to be offered again")
    half_b = c.place(0, {"name": "half-b", "command": SLEEP}, gpus=0.5)
    assert half_b["outcome"] == "placed" and half_b["node"] == victim["node"], half_b
    share = {j["name"]: j["origin"]["gpu_share"] for _, j in all_jobs(c) if j["name"].startswith("half-")}
    assert share["half-a"].endswith(":0.5") and share["half-b"].endswith(":0.5"), share


def test_agent_killed_mid_placement_leaves_no_lost_or_doubled_job(make_cluster):
    """Only node 5 has the GPU model the jobs need, so every placement must go through it.
    It is frozen while probes arrive (they queue in its socket), thawed so it answers with
    offers, and killed before the submitters' hand-overs reach it; then it restarts. Each
    placement must end with exactly one job, on node 5, or with none."""
    c = make_cluster(zones=3, per_zone=3, gpus=2, handover_timeout_s=2.0, node_extra={4: 'gpu_model = "H100"'},
                     zone_extra="unconfirmed_wait_s = 60\nqueue_rounds = 6")
    victim = c.nodes[4]
    submitters = [0, 2, 6]  # zones 1 and 3: they reach zone 2 by its summary alone
    wait_until(lambda: all("H100" in c.nodes[i].json("zone", "stats")["zone_summaries"]["2"]["gpu_models"]
                           for i in submitters), 30, "zone 2's summary to advertise the H100")
    names = ["race-a", "race-b"]
    results: dict[str, dict[str, Any]] = {}

    def submit(i: int, name: str) -> None:
        results[name] = c.place(i, {"name": name, "command": SLEEP}, gpus=1, gpu_model="H100")

    os.kill(victim.agent.proc.pid, signal.SIGSTOP)
    threads = [threading.Thread(target=submit, args=(submitters[k], n)) for k, n in enumerate(names)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # probes wait in the frozen agent's socket; the submitters time out and back off
    os.kill(victim.agent.proc.pid, signal.SIGCONT)
    time.sleep(0.02)  # it answers the queued probes with offers (tentative reservations) ...
    victim.agent.kill9()  # ... and dies holding them
    time.sleep(1.0)
    victim.agent.start(wait=True, timeout=90)
    for t in threads:
        t.join(240)
    assert set(results) == set(names)
    jobs = all_jobs(c)
    by_name = Counter(j["name"] for _, j in jobs)
    for name, r in results.items():
        assert r["outcome"] == "placed", r
        assert r["node"] == victim.node_id, r
        assert by_name[name] == 1, f"{name}: {by_name[name]} jobs for one placement ({r})"
        assert any(node == r["node"] and j["id"] == r["job_id"] and j["name"] == name for node, j in jobs), r
    assert_within_capacity(c, 2)
    # the kill did land mid-placement: the submitters saw silence and retried
    stats = [c.nodes[i].json("zone", "stats")["submitter"] for i in submitters]
    assert sum(s["probe_timeouts"] for s in stats) >= 1, stats
    assert sum(s["queue_waits"] for s in stats) >= 1, stats


def test_forged_replayed_and_truncated_datagrams_are_counted_and_ignored(make_cluster):
    from scapy.all import UDP, Ether, Raw, sendp, sniff  # noqa: I001

    c = make_cluster(zones=3, per_zone=3, gpus=2)
    target = c.nodes[1]
    before = target.json("zone", "stats")["drops"]
    # a real datagram to the target, captured on the bridge (summaries flow every 0.3 s)
    got = sniff(iface=c.bridge, filter=f"udp and dst host {target.addr} and dst port {UDP_PORT}", count=1, timeout=10)
    assert got, "no zone datagram seen on the bridge"
    frame = got[0]
    data = bytes(frame[Raw].load)

    def inject(payload: bytes) -> None:
        f = frame.copy()
        f[UDP].remove_payload()
        f[UDP].add_payload(Raw(payload))
        del f[UDP].len, f[UDP].chksum, f["IP"].len, f["IP"].chksum
        sendp(Ether(bytes(f)), iface=c.bridge, verbose=False)

    # the same datagram again, byte for byte (checksums recomputed: a capture on the bridge holds
    # the veth's offloaded, still partial UDP checksum, which the receiving kernel would refuse)
    inject(data)
    forged = bytearray(data)
    forged[-1] ^= 0xFF  # MAC does not match
    inject(bytes(forged))
    tampered = bytearray(data)
    tampered[40] ^= 0x01  # body changed under the original MAC
    inject(bytes(tampered))
    inject(data[:20])  # truncated below the header
    inject(data[:-5])  # truncated inside the MAC

    def counted() -> dict[str, int] | None:
        now = target.json("zone", "stats")["drops"]
        d = {k: now[k] - before[k] for k in now}
        return d if d["replay"] >= 1 and d["bad_mac"] >= 2 and d["truncated"] >= 2 else None

    try:
        d = wait_until(counted, 10, "the drops to be counted")
    except AssertionError:
        now = target.json("zone", "stats")["drops"]
        raise AssertionError(f"drops counted: { {k: now[k] - before[k] for k in now} }; frame {frame!r}") from None
    assert d["replay"] == 1 and d["bad_mac"] == 2 and d["truncated"] == 2, d
    assert d["accepted"] > 0  # real traffic kept flowing meanwhile
    # and the agent still places jobs
    r = c.place(1, {"name": "after-attack", "command": SLEEP}, gpus=1)
    assert r["outcome"] == "placed", f"{r['outcome']}: {r['reason']}"
    assert target.agent.proc.poll() is None


def test_zone_keeps_advertising_when_its_speaker_dies(make_cluster):
    """Node 1 speaks for zone 1 (lowest id heard from); once it dies, node 2 takes over, and
    the other zones keep placing into zone 1 (on its live nodes)."""
    c = make_cluster(zones=3, per_zone=3, gpus=2, zone_extra="peer_timeout_s = 2")
    c.nodes[0].agent.kill9()
    observer = c.nodes[3]
    time.sleep(3.0)  # past peer_timeout_s: zone 1's summary must be coming from node 2 now

    def fresh() -> bool:
        z1 = observer.json("zone", "stats")["zone_summaries"].get("1")
        return bool(z1 and z1["age_s"] < 1.0)

    wait_until(fresh, 10, "a fresh summary of zone 1 after its speaker died")
    # the 8 live nodes hold 16 one-GPU jobs: all must be placed, 4 of them in zone 1
    placed = [c.place(3, {"name": f"z1-{i}", "command": SLEEP}, gpus=1) for i in range(16)]
    assert all(r["outcome"] == "placed" for r in placed), placed
    assert all(r["node"] != 1 for r in placed)
    assert Counter(r["zone"] for r in placed) == {1: 4, 2: 6, 3: 6}, placed


def test_a_suspect_in_another_zone_is_probed_again_once_it_is_back(make_cluster):
    """Node 4 (zone 2) alone has the H100 the jobs need. Its link goes down for a few seconds;
    a placement from node 1 (zone 1) gets no answer from it three times, so node 1 takes it for
    a suspect and stops probing it. The link comes back. Nothing node 4 sends reaches zone 1 by
    itself (its summaries go to its zone peer, zone 2 speaks through node 3): node 1 must find
    out that it is back, or every H100 job submitted on node 1 is queued out for ever while
    node 4 sits idle (before the fix: no heartbeat was ever sent, a suspect stayed one)."""
    from conftest import run

    c = make_cluster(zones=2, per_zone=2, gpus=1, node_extra={3: 'gpu_model = "H100"'})
    sub, victim = c.nodes[0], c.nodes[3]
    wait_until(lambda: "H100" in sub.json("zone", "stats")["zone_summaries"]["2"]["gpu_models"], 30,
               "zone 2's summary to advertise the H100")

    def alive_at_sub() -> bool:
        return bool(next(p for p in sub.json("zone", "peers") if p["node"] == victim.node_id)["alive"])

    run("ip", "link", "set", victim.host_if, "down")
    try:
        # zone 2's summary keeps node 4's capacity for peer_timeout_s (10 s): this placement
        # probes the unreachable node in each of its three rounds
        r = c.place(0, {"name": "while-away", "command": SLEEP}, gpus=1, gpu_model="H100")
        assert r["outcome"] == "queued-out", r
        assert not alive_at_sub()  # a suspect now
    finally:
        run("ip", "link", "set", victim.host_if, "up")
    wait_until(alive_at_sub, 20, "node 1 to see node 4 alive again")
    r = c.place(0, {"name": "back", "command": SLEEP}, gpus=1, gpu_model="H100")
    assert r["outcome"] == "placed" and r["node"] == victim.node_id, r


def test_a_users_placements_stop_at_each_nodes_job_limit_and_roots_do_not(make_cluster):
    """``[jobs] max_per_user`` holds for jobs placed through the zone too: the node that takes a
    local user's new placement counts the user's jobs not yet ended there, and refuses one over
    the limit, so the placement goes to another node; when every node is at the limit, it is not
    placed anywhere. Before, a placement's job was started by whichever node bound it with no
    count at all: a user could pile up jobs without bound through ``POST /v1/placements``."""
    from userrig import call_as, local_user

    c = make_cluster(zones=1, per_zone=2, gpus=0, zone_extra="\n[jobs]\nmax_per_user = 1\n")
    with local_user("zq") as user:
        spec = {"command": SLEEP, "class": "transient", "cwd": "/"}
        placed = []
        for i in range(2):
            status, out, _ = call_as(user, c.nodes[0].agent.sock, "POST", "/v1/placements",
                                     {"spec": {**spec, "name": f"lm-t-zq{i}"}, "gpus": 0})
            assert status < 300 and out["outcome"] == "placed", (status, out)
            placed.append(out["node"])
        assert sorted(placed) == [1, 2], placed  # one per node: the second node took the one the first refused
        status, out, _ = call_as(user, c.nodes[0].agent.sock, "POST", "/v1/placements",
                                 {"spec": {**spec, "name": "lm-t-zq-over"}, "gpus": 0})
        assert out.get("outcome") != "placed", (status, out)
        assert "jobs.max_per_user" in out.get("reason", ""), out
        mine = [j for _, j in all_jobs(c) if j["name"].startswith("lm-t-zq")]
        assert sorted(j["name"] for j in mine) == ["lm-t-zq0", "lm-t-zq1"], mine
        assert all(j["owner_uid"] == user.uid for j in mine), mine
        # root is not limited: its placements still land on the same nodes
        root = c.place(0, {**spec, "name": "lm-t-zq-root"})
        assert root["outcome"] == "placed", root
        for nd in c.nodes:
            for j in nd.json("jobs"):
                if j["name"].startswith("lm-t-zq") and j["state"] not in ("exited", "stopped", "failed"):
                    nd.ctl("job", "stop", j["id"], "--grace", "0", check=False)
