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




def ddp_by_hand(tmp_path: Path, ex: str, args: list[str]) -> Path:
    """The reference: the same DDP job run by `torchrun --standalone` by hand with 3 workers;
    the path of its final weights."""
    import subprocess
    import sys

    hand = tmp_path / "hand.pt"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", ex, *args,
                    "--out", str(hand)], check=True, capture_output=True, timeout=180, cwd=tmp_path)
    return hand


def job_logs(c: Cluster, job: str) -> dict[int, str]:
    """node id -> the log of ``job``'s member there (every generation's)."""
    return {nd.node_id: (nd.agent.state_dir / "logs" / f"{job}.log").read_text()
            for nd in c.nodes if (nd.agent.state_dir / "logs" / f"{job}.log").exists()}


def wait_ended(c: Cluster, job: str, timeout: float) -> dict[str, Any]:
    """The job's view at its origin (node 0) once ended; on a timeout, the error carries the
    view and the tail of every member's log."""
    try:
        return dict(wait_until(lambda: (lambda x: x if x.get("state") == "ended" else None)(c.multinode_view(0, job)),
                               timeout, "the job's end"))
    except AssertionError:
        raise AssertionError(f"{c.multinode_view(0, job)}\n{ {n: t[-3000:] for n, t in job_logs(c, job).items()} }") from None


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
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 20, "the job running at its origin")
    c.nodes[0].ctl("job", "stop", job)
    wait_until(lambda: all(j["state"] not in ("running", "suspended", "queued")
                           for j in member_jobs(c, job).values()), 30, "every member stopped")
    v = c.multinode_view(0, job)
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
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 30, "the job running")
    victim_node = next(m["node"] for m in view["members"] if m["index"] == 2)
    victim = next(nd for nd in c.nodes if nd.node_id == victim_node)
    pid = member_jobs(c, job)[victim_node]["pid"]
    assert pid
    os.kill(pid, signal.SIGKILL)
    try:
        wait_until(lambda: c.multinode_view(0, job).get("generation") == 1, 30, "generation 1")
    except AssertionError:
        logs = "\n".join(line for nd in c.nodes for line in nd.agent.log().splitlines() if "members" in line)
        raise AssertionError(f"{c.multinode_view(0, job)}\n{member_jobs(c, job)}\n{logs}") from None
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 30, "the job running again")
    v = c.multinode_view(0, job)
    assert v["restarts"] == 1 and [m["state"] for m in v["members"]] == ["running"] * 3, v
    running = member_jobs(c, job)
    assert sorted(running) == sorted(nd.node_id for nd in c.nodes)
    assert all(j["state"] == "running" for j in running.values()), running
    assert victim.json("jobs")  # the victim's node lists the relaunched member
    # kill -9 of the origin's agent: nothing lost, nothing doubled
    c.nodes[0].agent.kill9()
    c.nodes[0].agent.start()
    v2 = wait_until(lambda: c.multinode_view(0, job), 30, "the origin back")
    assert v2["generation"] == 1 and v2["restarts"] == 1 and v2["state"] == "running", v2
    assert [j["state"] for j in member_jobs(c, job).values()] == ["running"] * 3
    # each member ran twice: generation 0, then 1 (its log appended)
    for nd in c.nodes:
        log = (nd.agent.state_dir / "logs" / f"{job}.log").read_text()
        assert log.count("gen start") == 2, (nd.node_id, log)
    # kill -9 of a member's agent: its member runs on, reattached; the job stays as it was
    pids = {n: j["pid"] for n, j in member_jobs(c, job).items()}
    c.nodes[1].agent.kill9()
    c.nodes[1].agent.start()
    wait_until(lambda: member_jobs(c, job).get(c.nodes[1].node_id, {}).get("state") == "running", 30,
               "the member reattached")
    assert {n: j["pid"] for n, j in member_jobs(c, job).items()} == pids
    v3 = c.multinode_view(0, job)
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
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 30, "the job running")
    nodes = {m["index"]: m["node"] for m in c.multinode_view(0, job)["members"]}
    pids = {n: j["pid"] for n, j in member_jobs(c, job).items() if j["state"] == "running"}
    os.kill(pids[nodes[2]], signal.SIGKILL)
    wait_until(lambda: c.multinode_view(0, job).get("state") == "resizing", 20, "the job resizing")
    v = c.multinode_view(0, job)
    assert v["generation"] == 0 and v["members"][2]["state"] == "failed", v
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 30, "the job running with two")
    alive = {n: j["pid"] for n, j in member_jobs(c, job).items() if j["state"] == "running"}
    assert alive == {nodes[0]: pids[nodes[0]], nodes[1]: pids[nodes[1]]}
    # a live member's node other than the origin's goes without notice (member 1's, or member
    # 0's when member 1 is the origin's: either leaves fewer than min)
    i = 1 if nodes[1] != c.nodes[0].node_id else 0
    gone = next(nd for nd in c.nodes if nd.node_id == nodes[i])
    gone.agent.kill9()
    os.kill(pids[nodes[i]], signal.SIGKILL)
    wait_until(lambda: c.multinode_view(0, job).get("generation") == 1, 90, "the lost member's restart")
    wait_until(lambda: c.multinode_view(0, job).get("state") == "running", 60, "the job running again")
    v = c.multinode_view(0, job)
    assert v["restarts"] == 1 and nodes[i] not in [m["node"] for m in v["members"]], v
    assert len({m["node"] for m in v["members"]}) == 3


DDP_ARGS = ["--steps", "40", "--samples", "256", "--global-batch", "30"]


def ddp_example() -> str:
    return str(Path(__file__).resolve().parents[2] / "examples/ddp_train.py")


def assert_same_weights(torch: Any, got_path: Path, ref_path: Path) -> None:
    got, ref = torch.load(got_path, weights_only=True), torch.load(ref_path, weights_only=True)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def kill_member(c: Cluster, job: str, node: int) -> None:
    """SIGKILL to every process of ``job``'s member on ``node`` (its cgroup's)."""
    import signal

    victim = member_jobs(c, job)[node]
    for pid in (Path(victim["cgroup"]) / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_real_ddp_job_across_three_agents_ends_with_the_weights_of_torchrun_by_hand(make_cluster, tmp_path) -> None:
    """examples/ddp_train.py (PyTorch DDP, gloo, CPU) submitted as a 3-worker job: each agent
    runs its member through torchrun (c10d rendezvous on member 0's node, across the network
    namespaces); the job ends ok at its origin, and rank 0's final weights equal those of the
    same job run by `torchrun --standalone` by hand (within float tolerance)."""
    import sys

    torch = pytest.importorskip("torch")
    ex = ddp_example()
    hand = ddp_by_hand(tmp_path, ex, DDP_ARGS)
    c = make_cluster(zones=1, per_zone=3, gpus=0)
    out = tmp_path / "laminar.pt"
    view = c.place(0, {"name": "ddp", "command": [sys.executable, ex, *DDP_ARGS, "--out", str(out)], "workers": 3,
                       "cwd": str(tmp_path)})
    job = view["id"]
    assert view["launcher"] == "torchrun", view
    v = wait_ended(c, job, 180)
    assert v["end_reason"] == "ok", v
    assert_same_weights(torch, out, hand)


def test_a_real_elastic_ddp_job_that_loses_a_member_ends_with_two_and_the_weights_of_an_unresized_run(
        make_cluster, tmp_path) -> None:
    """The same DDP job, elastic 2:3: once rank 0 checkpointed, every process of member 2 is
    killed (its node's cgroup). The origin lets the job go on with two (resizing); TorchElastic
    re-forms the group on the survivors, which end it; the job ends ok with 2 of 3 members and
    the final weights equal those of torchrun by hand with 3 workers."""
    import sys

    torch = pytest.importorskip("torch")
    ex = ddp_example()
    hand = ddp_by_hand(tmp_path, ex, DDP_ARGS)
    c = make_cluster(zones=1, per_zone=3, gpus=0)
    out = tmp_path / "laminar.pt"
    view = c.place(0, {"name": "ddp", "command": [sys.executable, ex, *DDP_ARGS, "--ckpt-every", "10", "--step-sleep",
                                                  "0.1", "--out", str(out)],
                       "workers": 3, "workers_min": 2, "workers_max": 3, "cwd": str(tmp_path)})
    job = view["id"]
    nodes = {m["index"]: m["node"] for m in view["members"]}
    wait_until(lambda: any('"checkpoint"' in t for t in job_logs(c, job).values()), 120, "rank 0's first checkpoint")
    kill_member(c, job, nodes[2])
    v = wait_ended(c, job, 240)
    assert v["end_reason"] == "ok with 2 of 3 members" and v["generation"] == 0, v
    assert_same_weights(torch, out, hand)


def test_a_real_rigid_ddp_job_whose_member_is_killed_restarts_from_its_checkpoint_with_the_same_weights(
        make_cluster, tmp_path) -> None:
    """The DDP job, rigid (3 workers), its checkpoints in a directory every member shares
    (``[members] ckpt_root``). Once the origin knows a verified checkpoint (member 0's agent
    found it and reported it), every process of member 1 is killed. The origin restarts the
    job: the other members are stopped and every member is relaunched with the next generation
    and ``LAMINAR_RESUME_FROM`` = that checkpoint; every rank resumes past step 0, the job ends
    ok, and the final weights equal those of torchrun by hand (within float tolerance)."""
    import json
    import sys

    torch = pytest.importorskip("torch")
    ex = ddp_example()
    hand = ddp_by_hand(tmp_path, ex, DDP_ARGS)
    shared = tmp_path / "shared-ckpt"
    shared.mkdir()
    c = make_cluster(zones=1, per_zone=3, gpus=0, zone_extra=f'\n[members]\nckpt_root = "{shared}"\n')
    out = tmp_path / "laminar.pt"
    # 0.6 s a step: member 0's agent looks for a new checkpoint every 10 s (CKPT_LOOK_S), so the
    # job must still run when the origin hears of one (a job that ended first has nothing to kill)
    view = c.place(0, {"name": "ddp", "command": [sys.executable, ex, *DDP_ARGS, "--ckpt-every", "10", "--step-sleep",
                                                  "0.6", "--out", str(out)],
                       "workers": 3, "cwd": str(tmp_path)})
    job = view["id"]
    nodes = {m["index"]: m["node"] for m in view["members"]}
    ckpt = wait_until(lambda: c.multinode_view(0, job).get("last_ckpt"), 150, "the origin to know a verified checkpoint")
    assert str(ckpt).startswith(f"{shared}/{job}/"), ckpt
    assert c.multinode_view(0, job)["state"] == "running", "the job ended before the kill: make its steps slower"
    kill_member(c, job, nodes[1])
    v = wait_ended(c, job, 240)
    assert v["end_reason"] == "ok" and v["generation"] >= 1 and v["restarts"] >= 1, v
    # every rank of the relaunched generation started from a checkpoint, not from step 0
    starts = [e for t in job_logs(c, job).values()
              for e in map(json.loads, (ln for ln in t.splitlines() if ln.startswith("{"))) if e.get("event") == "start"]
    resumed = [e for e in starts if e.get("resumed")]
    assert len(resumed) >= 3 and all(e["step"] > 0 for e in resumed), starts
    assert_same_weights(torch, out, hand)
