"""Elastic grants give way to placements, between real agents (laminar.zone.loan): a laminard
with two declared GPUs (no GPU here) in its own network namespace grows an elastic job into its
idle GPU; a placement from a second agent then takes that GPU: the elastic job is told to scale
in (its workers file and a real SIGUSR2) before the new job starts on the GPU. Jobs are real
processes that read their worker count with jobkit on every SIGUSR2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Cluster, wait_until

pytestmark = pytest.mark.cluster

# An elastic job: on every SIGUSR2 it appends the worker count jobkit reads to its log.
ELASTIC = """
import signal, sys, time
from laminar import jobkit
log = open(sys.argv[1], "a", buffering=1)
signal.signal(signal.SIGUSR2, lambda *_: log.write(f"{jobkit.workers()}\\n"))
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    loan = "[loan]\nelastic_interval_s = 0.2\n"
    with Cluster.create(tmp_path, zones=1, per_zone=2, gpus=2, pools={0: "training", 1: "training"},
                        node_extra={0: loan, 1: loan}, probe_timeout_s=1.0) as c:
        yield c


def job_on(c: Cluster, node: int, name: str) -> dict[str, Any] | None:
    for j in sorted(c.nodes[node - 1].json("jobs"), key=lambda j: j["created"]):
        if j["name"] == name:
            return j
    return None


def test_placement_sheds_an_elastic_grant_and_the_job_scales_in_first(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    log = tmp_path / "elastic.log"
    log.touch()
    log.chmod(0o666)
    spec = {"name": "grow", "command": [str(VENV_BIN / "python"), "-c", ELASTIC, str(log)],
            "elastic_min": 1, "elastic_max": 2}
    r = c.place(0, spec, gpus=1, pool="training")
    assert r["outcome"] == "placed", r
    home = int(r["node"])
    other = 2 if home == 1 else 1
    # fill the other node, so the next placement can only land on the elastic job's node
    filler = c.place(0, {"name": "filler", "command": ["sleep", "600"]}, gpus=2, pool="training")
    assert filler["outcome"] == "placed" and filler["node"] == other, filler

    # the idle GPU of its node goes to the elastic job: 2 workers, told by file and SIGUSR2
    grow = wait_until(lambda: job_on(c, home, "grow"), 20, "the elastic job's record")
    wait_until(lambda: log.read_text().split()[-1:] == ["2"], 30, "the elastic job to scale out to 2 workers")
    pool = c.nodes[home - 1].json("pool")
    assert pool["grants"] == {grow["id"]: 1}, pool
    wfile = json.loads((Path(c.nodes[home - 1].agent.state_dir) / "elastic" / f"{grow['id']}.json").read_text())
    assert wfile["workers"] == 2 and sorted(wfile["gpus"]) == [0, 1], wfile
    assert grow["gpus"] == [0]

    # a placement takes the granted GPU: the grant is shed, the elastic job scales in first
    r2 = c.place(other - 1, {"name": "newcomer", "command": ["sleep", "600"]}, gpus=1, pool="training")
    assert r2["outcome"] == "placed" and r2["node"] == home, r2
    new = job_on(c, home, "newcomer")
    assert new is not None and new["state"] == "running" and new["gpus"] == [1], new
    wfile = json.loads((Path(c.nodes[home - 1].agent.state_dir) / "elastic" / f"{grow['id']}.json").read_text())
    assert wfile["workers"] == 1 and wfile["gpus"] == [0], wfile  # written before the new job started
    wait_until(lambda: log.read_text().split()[-1:] == ["1"], 20, "the elastic job to read 1 worker")
    assert c.nodes[home - 1].json("pool")["grants"] == {}
    events = c.nodes[home - 1].json("events")
    assert any(e.get("kind") == "zone" and "shed" in e.get("message", "") and e.get("job") == grow["id"]
               for e in events), events[-8:]
    # the GPU stays the new job's: the next elastic rounds do not grant it again
    wait_until(lambda: job_on(c, home, "newcomer")["state"] == "running", 5, "the new job to keep running")
    assert c.nodes[home - 1].json("pool")["grants"] == {}
    assert job_on(c, home, "grow")["state"] == "running"
