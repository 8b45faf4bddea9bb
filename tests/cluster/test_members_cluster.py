"""A multi-node job between real agents (issue 33): 3 laminard processes in one zone, each in
its own network namespace on a bridge of the test's own. A 3-worker job of a plain program is
submitted on one agent (POST /v1/placements with ``workers``), placed as a gang, and runs as one
member on each of the 3 agents with the rendezvous env (RANK, WORLD_SIZE, MASTER_ADDR, the
members' addresses); every agent knows the job's members; ``stop`` on the origin stops every
member.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_until

pytestmark = pytest.mark.cluster


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(Cluster.create(tmp_path, **kw))


def api(c: Cluster, index: int, method: str, path: str, body: Any = None) -> Any:
    from laminarctl.client import Client

    client = Client(str(c.nodes[index].agent.sock), timeout=60)
    return client.get(path) if method == "GET" else client.post(path, body or {})


def member_jobs(c: Cluster, job: str) -> dict[int, dict[str, Any]]:
    """node id -> that node's local job of the multi-node ``job`` (every state)."""
    out = {}
    for nd in c.nodes:
        for j in nd.json("jobs"):
            if j["id"] == job:
                out[nd.node_id] = j
    return out


def test_a_three_worker_job_runs_one_member_per_agent_with_its_env_and_stop_stops_all(make_cluster) -> None:
    c = make_cluster(zones=1, per_zone=3, gpus=0)
    spec = {"name": "gang", "command": ["sh", "-c", 'echo "member $RANK of $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT '
                                                   'members $LAMINAR_MEMBERS"; sleep 300'],
            "workers": 3, "launcher": "plain"}
    view = c.place(0, spec)
    job = view.get("id") or view.get("job_id")
    assert view["state"] in ("starting", "running"), view
    assert sorted(m["node"] for m in view["members"]) == sorted(nd.node_id for nd in c.nodes)
    wait_until(lambda: len([j for j in member_jobs(c, job).values() if j["state"] == "running"]) == 3, 30,
               "a running member on each of the 3 agents")
    by_node = {m["node"]: m for m in view["members"]}
    addrs = ",".join(m["addr"] for m in sorted(view["members"], key=lambda m: m["index"]))
    master = view["members"][0]["addr"]

    def logged(nd: Any) -> str:
        p = nd.agent.state_dir / "logs" / f"{job}.log"
        return p.read_text() if p.exists() else ""

    for nd in c.nodes:
        i = by_node[nd.node_id]["index"]
        line = wait_until(lambda nd=nd: logged(nd).strip(), 20, f"node {nd.node_id}'s member log")
        assert line.startswith(f"member {i} of 3 at {master}:"), line
        assert line.endswith(f"members {addrs}"), line
    # the origin's view shows every member running
    wait_until(lambda: api(c, 0, "GET", f"/v1/jobs/{job}").get("state") == "running", 20, "the job running at its origin")
    c.nodes[0].ctl("job", "stop", job)
    wait_until(lambda: all(j["state"] not in ("running", "suspended", "queued")
                           for j in member_jobs(c, job).values()), 30, "every member stopped")
