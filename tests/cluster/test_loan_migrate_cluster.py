"""A loan return's ``migrate`` moves the job's checkpoint between real agents.

5 laminard processes in one zone, each in its own network namespace (nodes 1-2 training,
3-5 inference; two declared GPUs each, no GPU here). Two training jobs fill the training pool;
two lent jobs land on inference nodes 3 and 4, one each, so each of those has a GPU left.
Returning one server finds room for its job on the other (the plan says ``migrate``): the
migration layer checkpoints the job, reserves the other server, sends the checkpoint over the
zone-keyed TCP transfer, and the job resumes there, lent again, from the copy the destination
verified (not from the source's directory), its step counter carried over.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from harness import Cluster, wait_until
from test_loaning_cluster import job, node_jobs

pytestmark = pytest.mark.cluster


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))


def test_returned_servers_job_migrates_with_its_checkpoint_to_a_loanable_server(make_cluster):
    loan = "[loan]\nelastic_interval_s = 0\nckpt_wait_s = 5\nstop_grace_s = 1\n[migrate]\nckpt_wait_s = 5\n"
    c = make_cluster(zones=1, per_zone=5, gpus=2, pools={0: "training", 1: "training", 2: "inference",
                                                         3: "inference", 4: "inference"},
                     node_extra={i: loan for i in range(5)}, probe_timeout_s=1.0)
    c.nodes[4].ctl("pool", "load", "0.9")  # node 5 serves inference: it takes no loans
    for name in ("train-a", "train-b"):
        r = c.place(0, job(name, 0), gpus=2, pool="training")
        assert r["outcome"] == "placed" and r["node"] in (1, 2), r
    # one lent job per inference server: the other one is busy while each is placed
    c.nodes[3].ctl("pool", "load", "0.9")
    x = c.place(0, job("lent-x", 0.3), gpus=1, pool="training")
    assert x["outcome"] == "placed" and x["node"] == 3, x
    c.nodes[3].ctl("pool", "load", "0.0")
    c.nodes[2].ctl("pool", "load", "0.9")
    y = c.place(0, job("lent-y", 0), gpus=1, pool="training")
    assert y["outcome"] == "placed" and y["node"] == 4, y
    c.nodes[2].ctl("pool", "load", "0.0")
    assert c.nodes[2].json("pool")["loanable"] is True and c.nodes[3].json("pool")["loanable"] is True

    # lent-x checkpoints often: node 3 is the cheaper return, and node 4 has a free GPU for it
    src = node_jobs(c, 3)["lent-x"]
    wait_until(lambda: any(Path(src["ckpt_dir"]).glob("ckpt-*")), 20, "lent-x's first checkpoint")

    def weight(node: int, name: str) -> float:
        return next(float(r["weight"]) for r in c.nodes[node - 1].json("pool")["jobs"] if r["name"] == name)

    # what the plan compares, once the agents saw it (their scan of checkpoint directories runs
    # every 0.5 s, off the loop): lent-x's work at risk, hence its weight, below lent-y's
    wait_until(lambda: weight(3, "lent-x") < weight(4, "lent-y"), 20, "node 3 to see lent-x's checkpoint")
    # the inference pool takes a server back from one of its own members (node 5: loan.return_from)
    plan = c.nodes[4].json("pool", "return", "--pool", "inference", "--count", "1")
    assert plan["servers"] == [3], plan
    assert plan["actions"] == [{"node": 3, "job": x["job_id"], "action": "migrate", "workers_removed": 1}], plan

    # the migration layer moves it: the source stops as migrated, the job runs on node 4, lent
    moved = wait_until(lambda: node_jobs(c, 4).get("lent-x"), 60, "lent-x to resume on node 4")
    assert moved["state"] == "running" and moved["spec"]["lent"] is True, moved
    resume = Path(moved["spec"]["resume_from"])
    assert resume.is_relative_to(Path(c.nodes[3].agent.state_dir)), resume  # node 4's verified copy
    assert not resume.is_relative_to(Path(src["ckpt_dir"]))
    gone = wait_until(lambda: node_jobs(c, 3)["lent-x"]["state"] != "running" and node_jobs(c, 3)["lent-x"], 30,
                      "the source copy to stop")
    assert gone["state"] == "migrated", gone
    step_at_move = int((resume / "state.bin").read_bytes())  # jobkit's payload: the job's step counter
    assert step_at_move > 0
    pool3 = c.nodes[2].json("pool")
    rq = [r for r in pool3["requeues"] if r["job"] == x["job_id"]]
    assert rq and rq[0]["via"] == "migration" and rq[0]["node"] == 4 and rq[0]["phase"] == "placed", pool3
    assert pool3["counts"]["migrated"] == 1 and pool3["counts"]["requeued"] == 0, pool3["counts"]
    # it goes on from the moved checkpoint: its next checkpoints count on from there
    ck = Path(moved["ckpt_dir"])
    wait_until(lambda: any(ck.glob("ckpt-*")), 30, "a checkpoint of the resumed job")
    newest = max(ck.glob("ckpt-*"), key=lambda p: int(p.name[5:]))
    assert int((newest / "state.bin").read_bytes()) > step_at_move
    # the other jobs were not touched
    assert node_jobs(c, 4)["lent-y"]["state"] == "running"
    for name in ("train-a", "train-b"):
        assert any(node_jobs(c, n).get(name, {}).get("state") == "running" for n in (1, 2)), name
    events = c.nodes[2].json("events")
    assert any(e.get("kind") == "zone" and e.get("via") == "migration" for e in events), json.dumps(events[-6:])
