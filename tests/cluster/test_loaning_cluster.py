"""Capacity loaning between real agents (laminar.zone.loan): 5 laminard processes in one zone,
each in its own network namespace on a bridge of the test's own. Nodes 1-2 are the training
pool, nodes 3-5 the inference pool; every node declares one GPU (no GPU here). Jobs are real
processes honouring the checkpoint contract with jobkit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from agentproc import VENV_BIN
from harness import Cluster, wait_until

pytestmark = pytest.mark.cluster

# A job that checkpoints when asked and, with a period > 0, on its own every period seconds;
# it resumes its step counter from LAMINAR_RESUME_FROM.
JOB = """
import sys, time
from laminar import jobkit
ck = jobkit.Checkpointer()
state = ck.resume()
step = int(state.decode()) if state else 0
every = float(sys.argv[1])
last = time.monotonic()
while True:
    time.sleep(0.05)
    step += 1
    if ck.requested() or (every > 0 and time.monotonic() - last >= every):
        ck.save(str(step).encode(), step=step)
        last = time.monotonic()
"""


def job(name: str, ckpt_every: float) -> dict[str, Any]:
    return {"name": name, "command": [str(VENV_BIN / "python"), "-c", JOB, str(ckpt_every)]}


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))


def node_jobs(c: Cluster, node: int) -> dict[str, dict[str, Any]]:
    """Jobs of a node by name (the newest record of each name)."""
    out: dict[str, dict[str, Any]] = {}
    for j in sorted(c.nodes[node - 1].json("jobs"), key=lambda j: j["created"]):
        out[j["name"]] = j
    return out


def test_idle_inference_nodes_take_training_on_loan_and_reclaim_returns_the_cheapest(make_cluster):
    loan = "[loan]\nelastic_interval_s = 0\nckpt_wait_s = 5\nstop_grace_s = 1\n"
    c = make_cluster(zones=1, per_zone=5, gpus=1, pools={0: "training", 1: "training", 2: "inference",
                                                         3: "inference", 4: "inference"},
                     node_extra={i: loan for i in range(5)},
                     # which pool answers first must not decide the test on a loaded 2-core machine
                     probe_timeout_s=1.0)
    c.nodes[4].ctl("pool", "load", "0.9")  # node 5 serves inference: no loans
    assert c.nodes[4].json("pool")["loanable"] is False
    assert c.nodes[2].json("pool")["loanable"] is True

    # training placements fill the training pool first (its nodes are probed first), then
    # go to the idle inference nodes, as lent jobs
    placed = {}
    for name, every in (("train-a", 0), ("train-b", 0), ("lent-rare", 0), ("lent-often", 0.3)):
        r = c.place(0, job(name, every), gpus=1, pool="training")
        assert r["outcome"] == "placed", r
        placed[name] = r
    assert {placed["train-a"]["node"], placed["train-b"]["node"]} == {1, 2}, json.dumps(placed, indent=1)
    assert {placed["lent-rare"]["node"], placed["lent-often"]["node"]} == {3, 4}
    for name, r in placed.items():
        j = node_jobs(c, r["node"])[name]
        assert j["state"] == "running" and j["spec"]["lent"] is (r["node"] in (3, 4)), j

    # the busy inference node refuses: nothing is left for a fifth training job
    extra = c.place(0, job("no-room", 0), gpus=1, pool="training")
    assert extra["outcome"] == "queued-out" and extra["refusals"].get("pool_busy", 0) >= 1, extra
    assert "no-room" not in node_jobs(c, 5)

    # reclaim one inference server: the one whose lent job checkpointed lately costs least
    often, rare = placed["lent-often"]["node"], placed["lent-rare"]["node"]
    wait_until(lambda: node_jobs(c, often)["lent-often"]["ckpt_dir"] and
               any(True for _ in Path(node_jobs(c, often)["lent-often"]["ckpt_dir"]).glob("ckpt-*")),
               20, "the often-checkpointing job's first checkpoint")

    def weight(node: int, name: str) -> float:
        return next(float(r["weight"]) for r in c.nodes[node - 1].json("pool")["jobs"] if r["name"] == name)

    # what the plan compares, once the agents saw that checkpoint (their scan of checkpoint
    # directories runs every 0.5 s, off the loop)
    wait_until(lambda: weight(often, "lent-often") < weight(rare, "lent-rare"), 20,
               "the agents to see the often-checkpointing job's checkpoint")
    # the inference pool's own scheduler takes a server back: on node 5, a member of that pool (a
    # node of another pool may only with [loan] return_from on the servers)
    plan = c.nodes[4].json("pool", "return", "--pool", "inference", "--count", "1")
    assert plan["servers"] == [often], plan
    assert set(plan["candidates"]) == {str(rare), str(often)}  # node 5 is busy, not on loan
    assert plan["candidates"][str(often)] < plan["candidates"][str(rare)]
    assert plan["actions"] == [{"node": often, "job": placed["lent-often"]["job_id"], "action": "requeue",
                                "workers_removed": 1}]
    assert plan["told"][str(often)]["returned"] is True

    # the returned server requeues its lent job (checkpoint, stop) and takes no more loans
    wait_until(lambda: node_jobs(c, often)["lent-often"]["state"] == "requeued", 30, "the lent job to be requeued")
    st = c.nodes[often - 1].json("pool")
    assert st["returned"] is True and st["loanable"] is False
    # the return is a departure with notice in the returned server's hazard evidence (which
    # times the checkpoints of the jobs lent to it later); the other server saw none
    assert c.nodes[often - 1].json("status")["migrate"]["evidence"]["announced"] == 1
    assert c.nodes[rare - 1].json("status")["migrate"]["evidence"]["announced"] == 0
    # the inference scheduler frees node 5: the requeued job lands there, on loan, resumed
    c.nodes[4].ctl("pool", "load", "0.0")
    moved = wait_until(lambda: node_jobs(c, 5).get("lent-often"), 60, "the requeued job to be placed again")
    assert moved["state"] == "running" and moved["spec"]["lent"] is True
    assert moved["spec"]["resume_from"] and "/ckpt-" in moved["spec"]["resume_from"]
    # the others keep running where they were
    for name in ("train-a", "train-b", "lent-rare"):
        assert node_jobs(c, placed[name]["node"])[name]["state"] == "running", name
    events = c.nodes[4].json("events")
    assert any(e.get("kind") == "zone" and e.get("plan") == plan["plan"] for e in events), events[-5:]
