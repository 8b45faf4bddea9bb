"""The peer TCP ports under attack, real agents in their own network namespaces: placements
onto the attacked node and a checkpoint prestaged to it still succeed, its file descriptors and
memory stay bounded, and root's ``status`` and kill-switch keep answering
(:class:`liveness.RootLiveness`).

- **An off-roster host** (a namespace of its own on the zone's bridge, 40 addresses none of
  which the roster lists) opens as many connections as it can to node 1's hand-over port and
  transfer port, drips a byte every 2 s on each, and opens again whatever is closed
  (``tests/cluster/peerattack.py flood``). Before: the hand-over port read at most 16 frames at
  once, any source's, 10 s each, so the flooder held all 16 and every real hand-over was cut:
  placements onto node 1 ended ``unconfirmed`` (and a move's hand-over would wait, its job frozen);
  the transfer port held 16 connections per address with no total, 40 s each: the agent's file
  descriptors grew by hundreds. Now an address that is not the roster's is reset at accept,
  counted ``off_roster``, and never takes a slot.
- **A compromised member** (node 2's own key, from node 2's address:
  ``tests/cluster/peerattack.py member``) holds 64 authenticated connections idle and sends
  15 MiB control and offer headers and a chunk before any offer. Before: each authenticated
  connection took a 9 MiB receive buffer (64 held ~576 MiB of the privileged agent), and a
  15 MiB control message was parsed and serialized again on the event loop (about 1 s each: four
  at once stalled root's status for seconds). Now a member holds at most its share of
  authenticated connections (the rest are refused, "try again later"), a buffer grows only for
  an accepted offer, control headers are at most 64 KiB (a keeper's ~1 MiB), JSON over 64 KiB is
  parsed only under a separator bound, and a chunk before an offer is refused unread.

Figures go to the notes and bench/abuse.py, not here: the bounds below are liveness bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Cluster, Node, off_roster_host, wait_until
from liveness import RootLiveness
from test_migration import job_state, migrate_config, submit, verified_steps

pytestmark = [pytest.mark.cluster, pytest.mark.serial]

ATTACK = Path(__file__).resolve().parent / "peerattack.py"
SOURCES = 40  # the off-roster host's addresses
FLOOD_S = 75.0
PLACEMENTS = 4
FD_SLACK = 100  # descriptors node 1 may gain during the flood (its own work: jobs, transfers, threads)
RSS_SLACK_MB = 100

# A job that writes a 16 MiB checkpoint (step 7) at start and runs on: prestaged to its keeper
JOB = """
import os, time
from laminar.jobkit import Checkpointer
Checkpointer(install_signal=False).save(os.urandom(16 << 20), step=7)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # two nodes: node 2's only peer is node 1, so its job's checkpoint is prestaged there and
    # its GPU placements (its own GPUs taken) go there
    with Cluster.create(tmp_path_factory.mktemp("flood"), zones=1, per_zone=2, gpus=2,
                        zone_extra="unconfirmed_wait_s = 10\n" + migrate_config()) as c:
        n2 = c.nodes[1]
        filler = submit(n2, "--name", "lm-t-filler", "--", "sleep", "3600", gpus=2)
        wait_until(lambda: job_state(n2, filler)["state"] == "running", 30, "node 2's filler to run")
        yield c


def stop_placed(nd: Node, placed: list[dict[str, Any]]) -> None:
    """Stops the jobs placements put on ``nd`` (room for the next test's)."""
    for p in placed:
        if p.get("node") == nd.node_id and p.get("job_id"):
            nd.ctl("job", "stop", str(p["job_id"]), check=False)


@pytest.fixture
def offroster(cluster: Cluster) -> Iterator[tuple[Any, list[str]]]:
    """A namespace on the cluster's bridge with SOURCES addresses of the cluster's subnet, none
    in the roster."""
    with off_roster_host(cluster, SOURCES) as host:
        yield host


def agent_pid(nd: Node) -> int:
    return int(nd.json("status")["agent"]["pid"])


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Sampler:
    """The most of ``fn()`` seen every ``every`` s while the block runs."""

    def __init__(self, fn: Any, every: float = 0.2) -> None:
        self.fn, self.every, self.most = fn, every, 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.most = max(self.most, float(self.fn()))
            except OSError:
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)


def root_job(nd: Node) -> str:
    jid = submit(nd, "--name", "lm-t-root", "--", "sleep", "3600", gpus=0)
    wait_until(lambda: job_state(nd, jid)["state"] == "running", 30, "the root job to run")
    return jid


def test_an_off_roster_flood_of_both_ports_leaves_placements_and_prestages_working(
        cluster: Cluster, offroster: tuple[Any, list[str]]) -> None:
    n1, n2 = cluster.nodes
    ns, addrs = offroster
    xport = int(n1.json("status")["migrate"]["port"])
    pid = agent_pid(n1)
    base_fds = fds(pid)
    keep = root_job(n1)  # (node 2's GPUs are its filler's: its GPU placements can only go to node 1)
    flood = ns.popen(str(VENV_BIN / "python"), str(ATTACK), "flood", "--target", n1.addr, "--handover", "7441",
                     "--transfer", str(xport), "--sources", ",".join(addrs), "--seconds", str(FLOOD_S), "--max", "4000",
                     "--rate", "400", "--drip", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    placed: list[dict[str, Any]] = []
    flooding = False
    try:
        time.sleep(5)  # the flood holds what it can
        with Sampler(lambda: fds(pid)) as fd_most, RootLiveness(n1.agent.sock, keep) as live:
            jid = submit(n2, "--name", "lm-t-ckpt", "--", str(VENV_BIN / "python"), "-c", JOB, gpus=0)
            for k in range(PLACEMENTS):
                placed.append(cluster.place(1, {"name": f"lm-t-p{k}", "command": ["sleep", "600"]}, gpus=0.5))
            key = f"n{n2.node_id}-{jid}"
            steps = wait_until(lambda: verified_steps(n1, key), 50, "node 2's checkpoint prestaged to node 1")
        flooding = flood.poll() is None  # still running: what was checked ran under the flood
    finally:
        flood.terminate()
        out, err = flood.communicate(timeout=30)
        stop_placed(n1, placed)
    seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": err[-2000:]}
    zone = n1.json("zone", "stats")["handover_tcp"]
    xfer = n1.json("status")["migrate"].get("transfer_gate", {})
    figures = {"flood": seen, "fds": {"base": base_fds, "most": fd_most.most},
               "placements": [(p.get("outcome"), p.get("node"), p.get("reason")) for p in placed],
               "status_s": round(live.worst()[0], 3), "killswitch_s": round(live.worst()[1], 3),
               "handover_gate": zone, "transfer_gate": xfer}
    print("figures:", json.dumps(figures))
    assert seen.get("opened", 0) > 1000, f"the flood did not run as meant: {seen}"
    assert all(p.get("outcome") == "placed" and p.get("node") == n1.node_id for p in placed), figures
    assert 7 in steps
    assert flooding, "the flood ended before the checks did: their figures are not under flood"
    assert fd_most.most - base_fds < FD_SLACK, figures
    assert zone.get("off_roster", 0) > 0 and xfer.get("off_roster", 0) > 0, figures
    assert zone["reading"] + xfer["reading"] <= 2 * 8, figures  # the roster's own, at most (zone.gate.PER_SOURCE)
    live.check(bound_s=2.0)


def test_a_member_holding_authenticated_connections_and_sending_huge_headers_is_bounded(cluster: Cluster) -> None:
    n1, n2 = cluster.nodes
    xport = int(n1.json("status")["migrate"]["port"])
    pid = agent_pid(n1)
    base_rss = rss_mb(pid)
    keep = root_job(n1)
    with Sampler(lambda: rss_mb(pid)) as rss_most, RootLiveness(n1.agent.sock, keep) as live:
        r = n2.netns.run(str(VENV_BIN / "python"), str(ATTACK), "member", "--target", n1.addr, "--port", str(xport),
                         "--local", n2.addr, "--key-file", str(cluster.keys_file), "--zone", "1",
                         "--node", str(n2.node_id), "--idle", "64", "--big", str(15 << 20))
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    gate = n1.json("status")["migrate"].get("transfer_gate", {})
    figures = {"member": seen, "rss_mb": {"base": round(base_rss, 1), "most": round(rss_most.most, 1)},
               "status_s": round(live.worst()[0], 3), "killswitch_s": round(live.worst()[1], 3), "transfer_gate": gate}
    print("figures:", json.dumps(figures))
    idle = seen["idle"]
    assert idle["held"] <= 32 and idle["refused"] >= 64 - 32, figures  # zone.gate.MEMBER_AUTHENTICATED
    assert any("try again later" in x for x in idle["refusals"]), figures
    assert gate.get("member_busy", 0) >= 64 - 32, figures
    big = {b["what"]: b["answer"] for b in seen["big"]}
    for op in ("ctl keeper", "ctl space", "ctl release", "ctl needs"):
        assert "exceeds" in big[op], figures  # 15 MiB: past a keeper's 1 MiB and everything else's 64 KiB
    assert "refused unparsed" in big["offer"], figures
    assert "chunk before an offer" in big["chunk"], figures
    assert (gate.get("too_large"), gate.get("too_dense"), gate.get("chunk_before_offer")) == (4, 1, 1), figures
    assert rss_most.most - base_rss < RSS_SLACK_MB, figures
    live.check(bound_s=2.0)
    # and node 2's own traffic still gets through: a placement onto node 1
    p = cluster.place(1, {"name": "lm-t-after", "command": ["sleep", "600"]}, gpus=0.5)
    stop_placed(n1, [p])
    assert p.get("outcome") == "placed" and p.get("node") == n1.node_id, p
