"""A local user cannot write the agent's own records through a job's environment, nor make root
take their ``resume_from`` for one the agent gave (laminar.runtime.provenance).

A real laminard, a real unprivileged user (tests/userrig.py) on the real control socket. Before:
``POST /v1/jobs`` and ``POST /v1/placements`` accepted ``LM_MIGRATED_FROM`` (one ``true`` job
carrying another job's key switched off that job's resumption, zone-wide), ``LM_PLACEMENT_ID``
(a late hand-over answered with the user's job), ``LM_GPU_SHARE`` (``0:x`` failed every loan
query to the node) and ``CUDA_VISIBLE_DEVICES`` (silently overwritten); a ``resume_from``
naming another user's checkpoint was taken for one the agent gave. Now each is refused with 400
naming it and what to use, nothing is created, the refusal is counted in the status
(``jobs.provenance``), and root's ``status`` and kill-switch answer meanwhile (RootLiveness).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from liveness import RootLiveness
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

NAMES = ("LM_MIGRATED_FROM", "LM_PLACEMENT_ID", "LM_GPU_SHARE", "LAMINAR_JOB_ID", "CUDA_VISIBLE_DEVICES",
         "LM_REMAINING_S", "LM_CKPT_PERIODIC")
VALUES = {"LM_MIGRATED_FROM": "n1-job-1", "LM_PLACEMENT_ID": "00000000000000ff", "LM_GPU_SHARE": "0:x",
          "LAMINAR_JOB_ID": "job-1", "CUDA_VISIBLE_DEVICES": "0", "LM_REMAINING_S": "-1", "LM_CKPT_PERIODIC": "off"}


def job_ids(agent: AgentProc) -> set[str]:
    return {j["id"] for j in agent.json("jobs", "--last", "1000")}


def root_job(agent: AgentProc) -> str:
    jid = str(agent.json("submit", "--name", "lmt-root", "--", "/bin/sleep", "600")["id"])
    wait_until(lambda: agent.json("job", "show", jid)["state"] == "running", 30, "root's job to run")
    return jid


def provenance(agent: AgentProc) -> dict[str, int]:
    return dict(agent.json("status")["jobs"].get("provenance") or {})


def test_a_user_setting_the_agents_env_names_is_refused_naming_each(agent: AgentProc) -> None:
    live_job = root_job(agent)
    before = job_ids(agent)
    rounds = 0
    with local_user("prov") as user, RootLiveness(agent.sock, live_job) as live:
        while rounds < 2 or len(live.status_s) < 5:  # (root's probe sees the whole attack)
            rounds += 1
            for name in NAMES:
                spec = {"name": "lmt-forge", "command": ["/bin/true"], "env": {"LMT_OK": "1", name: VALUES[name]}}
                status, body, raw = call_as(user, agent.sock, "POST", "/v1/jobs", spec)
                assert status == 400, (name, raw)
                assert repr(name) in body["error"] and "reserved" in body["error"], body
                assert "LMT_OK" not in body["error"]
                status, body, raw = call_as(user, agent.sock, "POST", "/v1/placements", {"spec": spec})
                assert status == 400, (name, raw)
                assert body["error"].startswith("placement: ") and repr(name) in body["error"], body
        # what to use instead is named for the user's own hints
        _, body, _ = call_as(user, agent.sock, "POST", "/v1/jobs", {"command": ["/bin/true"],
                                                                     "env": {"LM_REMAINING_S": "60"}})
        assert "remaining_s" in body["error"] and "--remaining" in body["error"], body
    live.check(bound_s=2.0)
    assert job_ids(agent) == before  # nothing created
    counts = provenance(agent)
    assert counts.get("refused.submit.reserved_env") == rounds * len(NAMES) + 1, counts
    assert counts.get("refused.placement.reserved_env") == rounds * len(NAMES), counts
    # the user's hints, as fields, are taken
    with local_user("hint") as user:
        status, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs", {
            "command": ["/bin/true"], "remaining_s": 60, "periodic_checkpoints": False})
        assert status == 201, raw
        assert job["spec"]["remaining_s"] == 60.0 and job["spec"]["periodic_checkpoints"] is False
        assert job["origin"] == {"migrated_from": None, "placement_id": None, "gpu_share": None,
                                 "requeued_from": None, "resume_given": None, "scheduler": None,
                                 "scheduler_ref": None, "scheduler_cgroup": None}


def test_a_users_resume_from_is_never_the_agents_and_may_not_name_another_users_job(agent: AgentProc) -> None:
    """F4: user B names user A's checkpoint as resume_from. Before, it was accepted, and with an
    archive the agent copied A's checkpoint (as root) into B's job's archived state. Now: refused
    (400, naming the job and whose it is); B's own job's checkpoint directory is accepted, and is
    recorded as the user's (resume_given None: the archive and the replica GC never read it)."""
    live_job = root_job(agent)
    with local_user("vict") as a, local_user("atk") as b, RootLiveness(agent.sock, live_job) as live:
        status, ja, raw = call_as(a, agent.sock, "POST", "/v1/jobs", {"name": "lmt-victim", "command": ["/bin/sleep", "60"]})
        assert status == 201, raw
        theirs = f"{ja['ckpt_dir']}/ckpt-100"
        status, jb, raw = call_as(b, agent.sock, "POST", "/v1/jobs", {"name": "lmt-atk", "command": ["/bin/sleep", "60"]})
        assert status == 201, raw
        before = job_ids(agent)
        for path, why in ((theirs, f"{ja['id']} is not a job of uid {b.uid}"),
                          (f"{agent.state_dir}/xfer/checkpoints/n1-{ja['id']}/ckpt-1", "agent's state directory"),
                          (f"{agent.state_dir}/ckpt/../ckpt/{ja['id']}/ckpt-1", "is not a job of uid"),
                          ("relative/ckpt-1", "absolute path")):
            status, body, raw = call_as(b, agent.sock, "POST", "/v1/jobs", {"command": ["/bin/true"], "resume_from": path})
            assert status == 400 and why in body["error"], (path, raw)
        assert job_ids(agent) == before
        wait_until(lambda: len(live.status_s) >= 5, 10, "root's probe to see the attack")
        own = f"{jb['ckpt_dir']}/ckpt-1"
        status, mine, raw = call_as(b, agent.sock, "POST", "/v1/jobs", {"command": ["/bin/true"], "resume_from": own})
        assert status == 201 and mine["spec"]["resume_from"] == own, raw
        assert mine["origin"]["resume_given"] is None
    live.check(bound_s=2.0)
    assert provenance(agent).get("refused.submit.resume_from") == 4


def test_the_agent_sets_its_names_in_the_jobs_env_and_the_job_reads_them(agent: AgentProc, tmp_path: Any) -> None:
    """The agent may still set LM_* and LAMINAR_* for a job to read: the contract is unchanged
    for jobs (a local job has no origin, so none of the origin names)."""
    out = tmp_path / "env.json"
    os.chmod(tmp_path, 0o755)
    script = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    jid = agent.json("submit", "--env", "LMT_MINE=1", "--", "/usr/bin/python3", "-c", script)["id"]
    wait_until(lambda: out.exists() and out.stat().st_size > 0, 30, "the job's env")
    env = json.loads(out.read_text())
    assert env["LMT_MINE"] == "1" and env["LAMINAR_JOB_ID"] == jid and env["CUDA_VISIBLE_DEVICES"] == ""
    assert not [k for k in env if k in ("LM_MIGRATED_FROM", "LM_PLACEMENT_ID", "LM_GPU_SHARE", "LM_REQUEUED_FROM")]
