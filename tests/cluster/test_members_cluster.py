"""A multi-node job between real agents (issue 33): 3 laminard processes in one zone, each in
its own network namespace on a bridge of the test's own. A 3-worker job of a plain program is
submitted on one agent (POST /v1/placements with ``workers``), placed as a gang, and runs as one
member on each of the 3 agents with the rendezvous env (RANK, WORLD_SIZE, MASTER_ADDR, the
members' addresses); every agent knows the job's members; ``stop`` on the origin stops every
member.
"""

from __future__ import annotations

import os
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


def mview(c: Cluster, index: int, job: str) -> dict[str, Any]:
    """The multi-node job's view as node ``index`` shows it (GET /v1/jobs/{id}: on a node that
    hosts a member, the member's local job with the view under ``multinode``)."""
    got = api(c, index, "GET", f"/v1/jobs/{job}")
    return dict(got.get("multinode") or got)


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
    wait_until(lambda: mview(c, 0, job).get("state") == "running", 20, "the job running at its origin")
    c.nodes[0].ctl("job", "stop", job)
    wait_until(lambda: all(j["state"] not in ("running", "suspended", "queued")
                           for j in member_jobs(c, job).values()), 30, "every member stopped")
    v = mview(c, 0, job)
    assert v["state"] == "ended" and v["end_reason"].startswith("stopped by uid 0"), v
    assert len(member_jobs(c, job)) == 3


def test_a_members_process_killed_restarts_every_member_with_the_next_generation(make_cluster) -> None:
    """Rigid job, member 2's process killed (SIGKILL, as the OOM killer would): the origin
    stops the others and relaunches all three with generation 1 (each node's local job of the
    job's id started again); the job runs again. Then the origin's agent is killed with -9 and
    restarted: the job's record comes back unchanged and no member is started twice."""
    import os
    import signal

    c = make_cluster(zones=1, per_zone=3, gpus=0)
    spec = {"name": "gang", "command": ["sh", "-c", 'echo "gen start $RANK"; sleep 300'], "workers": 3,
            "launcher": "plain"}
    view = c.place(0, spec)
    job = view["id"]
    wait_until(lambda: mview(c, 0, job).get("state") == "running", 30, "the job running")
    victim_node = next(m["node"] for m in view["members"] if m["index"] == 2)
    victim = next(nd for nd in c.nodes if nd.node_id == victim_node)
    pid = member_jobs(c, job)[victim_node]["pid"]
    assert pid
    os.kill(pid, signal.SIGKILL)
    try:
        wait_until(lambda: mview(c, 0, job).get("generation") == 1, 30, "generation 1")
    except AssertionError:
        logs = "\n".join(line for nd in c.nodes for line in nd.agent.log().splitlines() if "members" in line)
        raise AssertionError(f"{mview(c, 0, job)}\n{member_jobs(c, job)}\n{logs}") from None
    wait_until(lambda: mview(c, 0, job).get("state") == "running", 30, "the job running again")
    v = mview(c, 0, job)
    assert v["restarts"] == 1 and [m["state"] for m in v["members"]] == ["running"] * 3, v
    running = member_jobs(c, job)
    assert sorted(running) == sorted(nd.node_id for nd in c.nodes)
    assert all(j["state"] == "running" for j in running.values()), running
    assert victim.json("jobs")  # the victim's node lists the relaunched member
    # kill -9 of the origin's agent: nothing lost, nothing doubled
    c.nodes[0].agent.kill9()
    c.nodes[0].agent.start()
    v2 = wait_until(lambda: mview(c, 0, job), 30, "the origin back")
    assert v2["generation"] == 1 and v2["restarts"] == 1 and v2["state"] == "running", v2
    assert [j["state"] for j in member_jobs(c, job).values()] == ["running"] * 3
    # each member ran twice: generation 0, then 1 (its log appended)
    for nd in c.nodes:
        log = (nd.agent.state_dir / "logs" / f"{job}.log").read_text()
        assert log.count("gen start") == 2, (nd.node_id, log)
    # kill -9 of a member's agent: its member runs on, re-adopted; the job stays as it was
    pids = {n: j["pid"] for n, j in member_jobs(c, job).items()}
    c.nodes[1].agent.kill9()
    c.nodes[1].agent.start()
    wait_until(lambda: member_jobs(c, job).get(c.nodes[1].node_id, {}).get("state") == "running", 30,
               "the member re-adopted")
    assert {n: j["pid"] for n, j in member_jobs(c, job).items()} == pids
    v3 = mview(c, 0, job)
    assert v3["generation"] == 1 and v3["state"] == "running", v3


def test_an_elastic_job_goes_on_with_fewer_members_and_a_gone_node_is_lost(make_cluster) -> None:
    """Elastic 2:3 on 4 agents. Member 2's process killed: the job goes on (resizing, then
    running) with the other two untouched, generation 0. Then member 1's node leaves without
    notice (its agent and its member killed): the origin's views go unanswered, the zone's
    liveness calls the node dead, the member is lost; fewer than min live: the job restarts,
    the lost member re-placed on the fourth node."""
    import os
    import signal

    c = make_cluster(zones=1, per_zone=4, gpus=0)
    spec = {"name": "elastic", "command": ["sh", "-c", "sleep 300"], "workers": 3, "workers_min": 2,
            "workers_max": 3, "launcher": "plain"}
    view = c.place(0, spec)
    job = view["id"]
    wait_until(lambda: mview(c, 0, job).get("state") == "running", 30, "the job running")
    nodes = {m["index"]: m["node"] for m in mview(c, 0, job)["members"]}
    pids = {n: j["pid"] for n, j in member_jobs(c, job).items() if j["state"] == "running"}
    os.kill(pids[nodes[2]], signal.SIGKILL)
    wait_until(lambda: mview(c, 0, job).get("state") == "resizing", 20, "the job resizing")
    v = mview(c, 0, job)
    assert v["generation"] == 0 and v["members"][2]["state"] == "failed", v
    wait_until(lambda: mview(c, 0, job).get("state") == "running", 30, "the job running with two")
    alive = {n: j["pid"] for n, j in member_jobs(c, job).items() if j["state"] == "running"}
    assert alive == {nodes[0]: pids[nodes[0]], nodes[1]: pids[nodes[1]]}
    # a live member's node other than the origin's goes without notice (member 1's, or member
    # 0's when member 1 is the origin's: either leaves fewer than min)
    i = 1 if nodes[1] != c.nodes[0].node_id else 0
    gone = next(nd for nd in c.nodes if nd.node_id == nodes[i])
    gone.agent.kill9()
    os.kill(pids[nodes[i]], signal.SIGKILL)
    wait_until(lambda: mview(c, 0, job).get("generation") == 1, 90, "the lost member's restart")
    wait_until(lambda: mview(c, 0, job).get("state") == "running", 60, "the job running again")
    v = mview(c, 0, job)
    assert v["restarts"] == 1 and nodes[i] not in [m["node"] for m in v["members"]], v
    assert len({m["node"] for m in v["members"]}) == 3


def test_a_real_ddp_job_across_three_agents_ends_with_the_weights_of_torchrun_by_hand(make_cluster, tmp_path) -> None:
    """examples/ddp_train.py (PyTorch DDP, gloo, CPU) submitted as a 3-worker job: each agent
    runs its member through torchrun (c10d rendezvous on member 0's node, across the network
    namespaces); the job ends ok at its origin, and rank 0's final weights equal those of the
    same job run by `torchrun --standalone` by hand (within float tolerance)."""
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    repo = Path(__file__).resolve().parents[2]
    ex = str(repo / "examples/ddp_train.py")
    args = ["--steps", "40", "--samples", "256", "--global-batch", "30"]
    hand = tmp_path / "hand.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", ex, *args,
                    "--out", str(hand)], check=True, capture_output=True, timeout=180, cwd=tmp_path)
    c = make_cluster(zones=1, per_zone=3, gpus=0)
    out = tmp_path / "laminar.pt"
    view = c.place(0, {"name": "ddp", "command": [sys.executable, ex, *args, "--out", str(out)], "workers": 3,
                       "cwd": str(tmp_path)})
    job = view["id"]
    assert view["launcher"] == "torchrun", view
    try:
        v = wait_until(lambda: (lambda x: x if x.get("state") == "ended" else None)(mview(c, 0, job)), 180,
                       "the job's end")
    except AssertionError:
        logs = {nd.node_id: (nd.agent.state_dir / "logs" / f"{job}.log").read_text()[-3000:] for nd in c.nodes
                if (nd.agent.state_dir / "logs" / f"{job}.log").exists()}
        raise AssertionError(f"{mview(c, 0, job)}\n{logs}") from None
    assert v["end_reason"] == "ok", v
    got, ref = torch.load(out, weights_only=True), torch.load(hand, weights_only=True)
    assert got.keys() == ref.keys()
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_a_real_elastic_ddp_job_that_loses_a_member_ends_with_two_and_the_weights_of_an_unresized_run(
        make_cluster, tmp_path) -> None:
    """The same DDP job, elastic 2:3: once rank 0 checkpointed, every process of member 2 is
    killed (its node's cgroup). The origin lets the job go on with two (resizing); TorchElastic
    re-forms the group on the survivors, which end it; the job ends ok with 2 of 3 members and
    the final weights equal those of torchrun by hand with 3 workers."""
    import signal
    import subprocess
    import sys

    torch = pytest.importorskip("torch")
    repo = Path(__file__).resolve().parents[2]
    ex = str(repo / "examples/ddp_train.py")
    args = ["--steps", "40", "--samples", "256", "--global-batch", "30"]
    hand = tmp_path / "hand.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", ex, *args,
                    "--out", str(hand)], check=True, capture_output=True, timeout=180, cwd=tmp_path)
    c = make_cluster(zones=1, per_zone=3, gpus=0)
    out = tmp_path / "laminar.pt"
    view = c.place(0, {"name": "ddp", "command": [sys.executable, ex, *args, "--ckpt-every", "10", "--step-sleep",
                                                  "0.1", "--out", str(out)],
                       "workers": 3, "workers_min": 2, "workers_max": 3, "cwd": str(tmp_path)})
    job = view["id"]
    nodes = {m["index"]: m["node"] for m in view["members"]}

    def logs() -> dict[int, str]:
        return {nd.node_id: (nd.agent.state_dir / "logs" / f"{job}.log").read_text()
                for nd in c.nodes if (nd.agent.state_dir / "logs" / f"{job}.log").exists()}
    wait_until(lambda: any('"checkpoint"' in t for t in logs().values()), 120, "rank 0's first checkpoint")
    victim = member_jobs(c, job)[nodes[2]]
    procs = Path(victim["cgroup"]) / "cgroup.procs"
    for pid in procs.read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        v = wait_until(lambda: (lambda x: x if x.get("state") == "ended" else None)(mview(c, 0, job)), 240,
                       "the job's end")
    except AssertionError:
        raise AssertionError(f"{mview(c, 0, job)}\n{ {n: t[-3000:] for n, t in logs().items()} }") from None
    assert v["end_reason"] == "ok with 2 of 3 members" and v["generation"] == 0, v
    got, ref = torch.load(out, weights_only=True), torch.load(hand, weights_only=True)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
