"""Rotating a zone key without downtime, end to end (docs/operations.md, "Rotating a zone key"):
3 real laminard agents of one zone, each in its own network namespace, talking real UDP and
TCP. The operator's procedure, each step node by node: add the new key as ``next``, make it
``current`` (the old one ``previous``), remove the old one. After every single node's change
(a SIGHUP, ``laminarctl zone keys reload``, or, once, a restart) three one-GPU jobs are placed
from one node and must all be placed: with one GPU per node they land on all three nodes, so
probes, offers, commits and hand-overs cross between nodes holding different key files. No
datagram or hand-over frame is dropped as ``bad_mac`` at any time, and ``laminarctl zone
keys`` shows when the old key stopped verifying anything.

The agents share one key file path (tests/cluster/harness.py); an agent reads it only when it
reloads or starts, so rewriting the file and then reloading the agents one at a time is the
same as changing each node's own file in turn."""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, Node, wait_until

from laminar.zone.keys import fingerprint

pytestmark = pytest.mark.cluster


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))


def api(nd: Node, path: str, body: Any = None) -> Any:
    """GET ``path`` (POST with ``body``) on the node's control socket, in-process: the reads and
    stops around each round go through the API, not a laminarctl process each (about 0.4 s a
    process on the CI's 2-core VM, and a round makes dozens); the operator's own steps
    (``zone keys reload``, the refused reload) still run laminarctl."""
    from laminarctl.client import Client

    cl = Client(str(nd.agent.sock), timeout=60)
    return cl.get(path) if body is None else cl.post(path, body)


def keys_of(nd: Node) -> list[tuple[str, str]]:
    return [(k["role"], k["fingerprint"]) for k in api(nd, "/v1/zone/keys")["keys"]]


def bad_macs(c: Cluster) -> dict[int, int]:
    out = {}
    for nd in c.nodes:
        st = api(nd, "/v1/zone/stats")
        out[nd.node_id] = st["drops"]["bad_mac"] + st["handover_drops"]["bad_mac"]
    return out


def place_round(c: Cluster, submitter: int, tag: str) -> None:
    """Three one-GPU jobs from node ``submitter``: all placed, one on each node; then stopped
    and their capacity freed everywhere."""
    res = [c.place(submitter, {"name": f"{tag}-{i}", "command": ["sleep", "300"]}, gpus=1) for i in range(3)]
    assert [r["outcome"] for r in res] == ["placed"] * 3, res
    assert sorted(r["node"] for r in res) == [1, 2, 3], res
    for r in res:
        api(c.nodes[r["node"] - 1], f"/v1/jobs/{r['job_id']}/stop", {"grace_s": 0})
    wait_until(lambda: all(api(nd, "/v1/zone/stats")["arbiter"]["placed"] == 0 for nd in c.nodes), 30,
               "the stopped jobs' GPUs to be free again")


def test_rotating_the_zone_key_node_by_node_keeps_placements_working(make_cluster: Any) -> None:
    c = make_cluster(zones=1, per_zone=3, gpus=1)
    old, new = c.keys[1].hex(), secrets.token_hex(32)
    fp_old, fp_new = fingerprint(bytes.fromhex(old)), fingerprint(bytes.fromhex(new))

    def write(text: str) -> None:
        c.keys_file.write_text(text)
        os.chmod(c.keys_file, 0o600)

    def reload(nd: Node, how: str, want: list[tuple[str, str]]) -> None:
        if how == "sighup":
            assert nd.agent.proc is not None
            os.kill(nd.agent.proc.pid, signal.SIGHUP)
            wait_until(lambda: keys_of(nd) == want, 15, f"node {nd.node_id} to reload its keys on SIGHUP")
        elif how == "ctl":
            out = nd.json("zone", "keys", "reload")
            assert [(k["role"], k["fingerprint"]) for k in out["keys"]] == want
        else:  # a restart reads the file too (jobs survive it)
            nd.agent.stop()
            nd.agent.start(wait=True, timeout=90)
            c.wait_converged()
        assert keys_of(nd) == want

    assert all(keys_of(nd) == [("current", fp_old)] for nd in c.nodes)
    place_round(c, 0, "before")
    rounds = 0
    steps = [
        (f"1 {old}\n1 {new} next\n", [("current", fp_old), ("next", fp_new)], ["sighup", "ctl", "ctl"]),
        (f"1 {new} current\n1 {old} previous\n", [("current", fp_new), ("previous", fp_old)], ["ctl", "restart", "sighup"]),
        (f"1 {new}\n", [("current", fp_new)], ["ctl", "sighup", "ctl"]),
    ]
    for n, (text, want, hows) in enumerate(steps, 1):
        write(text)
        for nd, how in zip(c.nodes, hows, strict=True):
            reload(nd, how, want)
            rounds += 1
            place_round(c, rounds % 3, f"step{n}-node{nd.node_id}")
            assert bad_macs(c) == {1: 0, 2: 0, 3: 0}, f"step {n}, after node {nd.node_id} ({how})"
            if n == 2 and nd.node_id == 1:
                # node 1 signs with the new key, node 3 (still on step 1) verified it as its next key
                nxt = [k for k in api(c.nodes[2], "/v1/zone/keys")["keys"] if k["role"] == "next"]
                assert nxt[0]["fingerprint"] == fp_new and nxt[0]["verified"] > 0, nxt
        if n == 2:
            # every node signs with the new key now: the old one (previous) stops verifying
            # anything, which is what the operator checks before step 3
            def old_count() -> dict[int, int]:
                return {nd.node_id: next(k["verified"] for k in api(nd, "/v1/zone/keys")["keys"]
                                         if k["fingerprint"] == fp_old) for nd in c.nodes}
            before = old_count()
            place_round(c, 1, "step2-quiet")
            assert old_count() == before
    # only the new key is left, and it verified the traffic
    for nd in c.nodes:
        (k,) = api(nd, "/v1/zone/keys")["keys"]
        assert k["fingerprint"] == fp_new and k["role"] == "current" and k["verified"] > 0
    # a bad file is refused whole; the keys in use stay and placements keep working
    write(f"1 {new}\n1 {old} previus\n")
    r = c.nodes[0].ctl("zone", "keys", "reload", check=False)
    # (the message is wrapped to the terminal at any space: a long key file path moves the breaks)
    assert r.returncode != 0 and "zone.keys:2: expected a role" in " ".join(r.stderr.split()), r.stderr
    os.kill(c.nodes[1].agent.proc.pid, signal.SIGHUP)  # type: ignore[union-attr]
    wait_until(lambda: any("not reloaded" in e["message"] for e in api(c.nodes[1], "/v1/events?kind=zone")),
               15, "the refused reload's event")
    assert all(keys_of(nd) == [("current", fp_new)] for nd in c.nodes)
    place_round(c, 2, "after")
    assert bad_macs(c) == {1: 0, 2: 0, 3: 0}
