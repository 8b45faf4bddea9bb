"""The adoption API on a real agent (laminar.runtime.adopt_api): a local user's own Slurm task
(under a fake slurmstepd, named so) adopted as a Slurm job (its record, its env, netguard's registration on a real data plane,
``laminarctl jobs``' SCHEDULER column, its end with its process), and the refusals: another
user's pid, another uid, a process that is no task of the Slurm job it names, an unknown class, a priority beyond the grant, GPUs the node lacks,
a pod's cgroup asked by a user; each names the value and changes nothing."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel


@pytest.fixture
def agent(veth_pair: Any, tmp_path: Path) -> Iterator[AgentProc]:
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a,
                  extra_toml=f'[adopt]\nckpt_root = "{tmp_path}/adopted"\n\n[jobs]\nmax_per_user = 1\n')
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


def sleeper(uid: int, gid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["/bin/sleep", "600"], user=uid, group=gid, extra_groups=[], start_new_session=True)


class SlurmTask:
    """A user's task under a FAKE slurmstepd (named so: no Slurm here, the real one is in
    tests/cluster/test_slurm_*): a root process titled as slurmstepd titles itself for a step of
    Slurm job ``job`` ("slurmstepd: [777.0]"), whose child, as slurmstepd forks a task, runs as
    the user. ``pid`` is the task's."""

    def __init__(self, uid: int, gid: int, job: str) -> None:
        self.parent = subprocess.Popen(
            [f"slurmstepd: [{job}.0]", "-c", f"setpriv --reuid={uid} --regid={gid} --clear-groups /bin/sleep 600 & wait"],
            executable="/bin/sh", start_new_session=True)

        def task() -> int | None:
            kids = Path(f"/proc/{self.parent.pid}/task/{self.parent.pid}/children").read_text().split()
            if kids and Path(f"/proc/{kids[0]}/comm").read_text().strip() == "sleep":
                return int(kids[0])
            return None

        self.pid: int = wait_until(task, 10, "the fake slurmstepd's task")

    def kill(self) -> None:
        import os
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.parent.pid, signal.SIGKILL)
        self.parent.wait()


def test_a_user_adopts_their_own_task_and_the_refusals_name_the_value(agent: AgentProc, tmp_path: Path) -> None:
    with local_user("ada") as ada, local_user("bob") as bob:
        p = SlurmTask(ada.uid, ada.gid, "777")
        plain = sleeper(ada.uid, ada.gid)
        try:
            body = {"scheduler": "slurm", "ref": "777", "pid": p.pid, "class": "transient", "priority": 40}
            before = {j["id"] for j in agent.json("jobs", "--last", "1000")}
            refusals = [
                (bob, {**body}, 400, f"runs as uid {ada.uid}"),  # another user's process
                (bob, {**body, "uid": ada.uid}, 403, "only root"),  # another uid
                (None, {**body, "uid": ada.uid, "class": "huge"}, 400, "'huge'"),
                (ada, {**body, "priority": 99}, 403, "priority 99"),
                (None, {**body, "uid": ada.uid, "gpus": [5]}, 400, "[5]"),
                # GPUs a user's task names cannot be checked with slurmctld here ([slurm] enabled = false)
                (ada, {**body, "gpus": [0]}, 400, "gpus [0] (the task's SLURM_STEP_GPUS or SLURM_JOB_GPUS) cannot be "
                 "checked: this node's agent does not ask slurmctld ([slurm] enabled = false)"),
                (ada, {"scheduler": "kubernetes", "ref": "ns/p", "cgroup": "kubepods.slice/x"}, 403, "only root"),
                (ada, {**body, "ref": "7a"}, 400, "'7a'"),
                # a task of another Slurm job, a process that is no Slurm task: a user could otherwise
                # claim another user's coming job id here, or move any process out of its own cgroup
                (ada, {**body, "ref": "778"}, 403, "not a task of Slurm job 778 (its parent is slurmstepd of job 777)"),
                (ada, {**body, "pid": plain.pid}, 403, "its parent is no slurmstepd run by root"),
            ]
            for who, b, status, needle in refusals:
                st, ans, raw = call_as(who, agent.sock, "POST", "/v1/jobs/adopt", b)
                assert st == status and needle in ans.get("error", ""), (b, st, raw)
            st, ans, raw = call_as(ada, agent.sock, "POST", "/v1/jobs/adopt/check",
                                   {"scheduler": "slurm", "ref": "777", "class": "long-resident"})
            assert st == 403 and "long-resident" in ans["error"], raw
            st, ans, raw = call_as(ada, agent.sock, "POST", "/v1/jobs/adopt/check",
                                   {"scheduler": "slurm", "ref": "777", "class": "transient"})
            assert st == 201 and ans == {"ok": True}, raw
            assert {j["id"] for j in agent.json("jobs", "--last", "1000")} == before, "a refusal left a job"
            assert not (tmp_path / "adopted" / "slurm-777").exists(), "a refusal made a checkpoint directory"

            st, ans, raw = call_as(ada, agent.sock, "POST", "/v1/jobs/adopt", body)
            assert st == 201, raw
            job, env = ans["job"], ans["env"]
            assert job["scheduler"] == "slurm" and job["scheduler_ref"] == "777" and job["owner_uid"] == ada.uid
            assert job["cgroup_id"] and job["state"] == "running" and job["last_ckpt"] is None
            assert env["LAMINAR_CKPT_DIR"] == f"{tmp_path}/adopted/slurm-777" and env["LAMINAR_JOB_ID"] == job["id"]
            assert (tmp_path / "adopted" / "slurm-777").stat().st_uid == ada.uid
            # the same Slurm job again: the same job
            st, again, raw = call_as(None, agent.sock, "POST", "/v1/jobs/adopt", {**body, "uid": ada.uid})
            assert st == 201 and again["job"]["id"] == job["id"], raw
            # netguard sees it (a real data plane on the veth)
            ks = agent.json("killswitch", "status")
            assert any(r["job"] == job["id"] and r["cgroup_id"] == job["cgroup_id"] for r in ks["jobs"]), ks
            # as a submission: at most [jobs] max_per_user jobs not ended
            p2 = SlurmTask(ada.uid, ada.gid, "778")
            try:
                st, ans, raw = call_as(ada, agent.sock, "POST", "/v1/jobs/adopt", {**body, "ref": "778", "pid": p2.pid})
                assert st == 429 and "max_per_user" in ans["error"], raw
            finally:
                p2.kill()
            listing = agent.ctl("jobs").stdout
            assert "slurm:777" in listing, listing
            # only root tells the exit code
            st, ans, raw = call_as(ada, agent.sock, "POST", f"/v1/jobs/{job['id']}/exit", {"code": 3})
            assert st == 403, raw
            st, ans, raw = call_as(None, agent.sock, "POST", f"/v1/jobs/{job['id']}/exit", {"code": 3})
            assert st == 201, raw
            p.kill()
            end = wait_until(lambda: (j := agent.json("job", "show", job["id"]))["state"] == "exited" and j, 20,
                             "the adopted job to end with its process")
            assert end["reason"] == "ended by slurm" and end["exit_code"] == 3, end
        finally:
            p.kill()
            plain.kill()
            plain.wait()


def test_root_adopts_a_pod_cgroup_in_place_and_netguard_sees_its_containers(veth_pair: Any, tmp_path: Path) -> None:
    from test_adopt import pod_tree

    with pod_tree() as (top, ctr):
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a,
                      extra_toml=f'[adopt]\nckpt_root = "{tmp_path}/adopted"\ninplace_roots = ["{top}"]\n')
        p = subprocess.Popen(["/bin/sleep", "600"], start_new_session=True)
        try:
            (ctr / "cgroup.procs").write_text(str(p.pid))
            a.start()
            st, ans, raw = call_as(None, a.sock, "POST", "/v1/jobs/adopt", {
                "scheduler": "kubernetes", "ref": "team-a/train-0", "cgroup": f"{top}/pod", "uid": 0, "gid": 0,
                "class": "long-resident", "priority": 80})
            assert st == 201, raw
            job = ans["job"]
            assert job["cgroup"] == str(ctr.parent) and job["scheduler_ref"] == "team-a/train-0"
            ks = a.json("killswitch", "status")
            ids = {r["cgroup_id"] for r in ks["jobs"]}
            assert job["cgroup_id"] in ids and ctr.stat().st_ino in ids, ks
            assert "kubernetes:team-a/train-0" in a.ctl("jobs").stdout
            # the job's kill-switch cuts its containers' traffic too (their entries carry the switch)
            a.ctl("killswitch", "on", "--job", job["id"])
            rows = {r["cgroup_id"]: r for r in a.json("killswitch", "status")["jobs"]}
            assert rows[ctr.stat().st_ino]["kill"] and rows[job["cgroup_id"]]["kill"], rows
            a.ctl("killswitch", "off", "--job", job["id"])
            rows = {r["cgroup_id"]: r for r in a.json("killswitch", "status")["jobs"]}
            assert not rows[ctr.stat().st_ino]["kill"], rows
            p.kill()
            p.wait()
            wait_until(lambda: a.json("job", "show", job["id"])["state"] == "exited", 20, "the pod's job to end")
            assert ctr.is_dir(), "the agent removed the pod's cgroup"
            ks = a.json("killswitch", "status")
            assert ctr.stat().st_ino not in {r["cgroup_id"] for r in ks["jobs"]}, "netguard kept an ended container"
        finally:
            p.kill()
            p.wait()
            a.cleanup()
