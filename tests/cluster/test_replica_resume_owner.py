"""A job of a user other than root resumes from its checkpoint after it moved to another node:
the replica it resumes from (under the destination's ``xfer/``, root's alone) is made readable to
the job's owner, and to nobody else. And another user cannot stop that resumption by naming the
job's key in a job of their own (issue 31 item 2; audit F2).

Two real agents in one zone (tests/cluster/harness.py), each in its own network namespace. The
job is submitted by a real other uid (``agentproc.NOBODY``, through the real laminarctl), runs
as that user, writes jobkit checkpoints (one at start, one more each time it is asked), and on
its restart resumes with jobkit from ``LAMINAR_RESUME_FROM``. Node A is reclaimed with a notice
window; the job moves to node B and must resume there from the checkpoint it moved with, under
its owner's limits on B (runtime.joblimits), not B's agent's.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from agentproc import NOBODY, REPO, jobkit_base
from harness import Cluster, wait_until
from test_migration import gone, job_log, job_state, migrate_config
from userrig import call_as, local_user, read_as

pytestmark = pytest.mark.cluster

# The job: resumes if it is told to (and says from which step), writes a checkpoint at start and
# whenever one is asked for (SIGUSR1, jobkit), and runs on.
JOB = """
import json, os, sys, time
sys.path.insert(0, os.environ.get("LMT_LIB", REPO_AGENT))
from laminar.jobkit import Checkpointer
ck = Checkpointer()
try:
    ck.resume()
except Exception as e:
    print(json.dumps({"event": "resume-failed", "error": str(e)}), flush=True)
    sys.exit(3)
step = ck.resumed_step or 0
print(json.dumps({"event": "start", "resumed": ck.resumed_step}), flush=True)
if step == 0:
    step = 7
    ck.save(b"weights-%d" % step, step=step)
while True:
    if ck.requested():
        step += 1
        ck.save(b"weights-%d" % step, step=step)
        print(json.dumps({"event": "checkpoint", "step": step}), flush=True)
    time.sleep(0.05)
""".replace("REPO_AGENT", repr(str(REPO / "agent")))


def test_a_moved_job_of_another_user_resumes_from_its_checkpoint() -> None:
    # the agents' state directories must be reachable by the job's user, with jobkit where it can
    # read it (agentproc.jobkit_base), and the job runs the system's python (the venv's lives under /root)
    with jobkit_base("lm-t-resume-") as base, \
            Cluster.create(base, zones=1, per_zone=2, gpus=0, zone_extra=migrate_config()) as c:
        moved_and_resumed(c, base / "lib")


def moved_and_resumed(c: Cluster, lib: Path) -> None:
    a, b = c.nodes
    r = a.agent.ctl("-o", "json", "submit", "--name", "theirs", "--env", f"LMT_LIB={lib}", "--", "/usr/bin/python3",
                    "-c", JOB, user=NOBODY)
    jid = json.loads(r.stdout)["id"]
    assert job_state(a, jid)["owner_uid"] == NOBODY
    wait_until(lambda: any(e["event"] == "start" for e in job_log(a, jid)), 30, "the job to start on A")

    a.ctl("reclaim", "--notice", "8s", "--reason", "owner needs it")
    wait_until(lambda: job_state(a, jid)["state"] in ("migrated", "reclaimed"), 60, "the job to leave A")
    # a move to a keeper (held) ends after its job was stopped here (reclaimed)
    move = wait_until(lambda: (m := a.json("migrations")[0])["phase"] in ("done", "held", "failed") and m, 30,
                      "the move to end")
    assert move["phase"] == "done" and move["dest"] == b.node_id, move
    moved = int(move["ckpt"].removeprefix("ckpt-"))
    dest = move["dest_job"]
    wait_until(lambda: job_log(b, dest), 30, "the job to start on B")
    on_b = job_log(b, dest)
    assert on_b[0] == {"event": "start", "resumed": moved}, (on_b, job_state(b, dest))
    st = job_state(b, dest)
    assert st["state"] == "running" and st["owner_uid"] == NOBODY, st
    # a job from a peer starts with its owner's limits on this node, not the agent's ([job_limits])
    assert st["limits"]["from"][0] == "[job_limits]" and st["limits"]["rlimits"]["nofile"][0] == 1024, st["limits"]
    nofile = next(line.split()[3] for line in Path(f"/proc/{st['pid']}/limits").read_text().splitlines()
                  if line.startswith("Max open files"))
    assert nofile == "1024", nofile
    # what it resumed from: readable by its owner only, never writable by it
    rf = Path(st["spec"]["resume_from"])
    for p in [rf, *rf.iterdir()]:
        m = os.lstat(p)
        assert not stat.S_ISLNK(m.st_mode) and not m.st_mode & 0o022, (p, oct(m.st_mode))
        if stat.S_ISREG(m.st_mode):
            assert m.st_uid == 0, (p, m.st_uid)  # the owner reads the file, cannot change it
    top = os.lstat(rf.parent)
    assert top.st_uid == NOBODY and stat.S_IMODE(top.st_mode) == 0o500, (rf.parent, oct(top.st_mode))
    manifest = rf / "MANIFEST.json"
    assert read_as(NOBODY, manifest) == "read"
    assert read_as(NOBODY - 1, manifest) == "Permission denied"  # another user: not even the path


def test_another_users_job_naming_the_victims_key_does_not_stop_its_resumption() -> None:
    """F2. Node A runs a job of one user (``NOBODY``); node B keeps its replica. A second real
    user submits, on B and through the zone from A, a job whose env carries the victim's key
    (``LM_MIGRATED_FROM=n<A>-<job>``), which was the agent's only record of where a job came
    from. A then leaves without notice. B must resume the victim's job: what counts is the
    origin the agent stored with the jobs it started itself. Before, the forged job was
    accepted (201) and ended at once, and B's take-over found it and stood down ("handed-over"
    to the attacker's job): the victim's job ran nowhere."""
    with jobkit_base("lm-t-forge-") as base, local_user("forge") as attacker, \
            Cluster.create(base, zones=1, per_zone=2, gpus=0, zone_extra=migrate_config(orphan_after_s=2.0)) as c:
        a, b = c.nodes
        r = a.agent.ctl("-o", "json", "submit", "--name", "victim", "--env", f"LMT_LIB={base / 'lib'}", "--",
                        "/usr/bin/python3", "-c", JOB, user=NOBODY)
        jid = json.loads(r.stdout)["id"]
        key = f"n{a.node_id}-{jid}"
        wait_until(lambda: any(e["event"] == "start" for e in job_log(a, jid)), 30, "the victim's job to start on A")
        wait_until(lambda: any(r["key"] == key and r["state"] == "keeping" for r in b.json("replicas")), 60,
                   "B to keep the victim's replica")
        forged = {"name": "forged", "command": ["/bin/true"], "env": {"LM_MIGRATED_FROM": key}}
        on_b = call_as(attacker, b.agent.sock, "POST", "/v1/jobs", forged)
        via_zone = call_as(attacker, a.agent.sock, "POST", "/v1/placements", {"spec": forged})
        time.sleep(1.0)  # (before: the forged jobs ran and ended here)

        gone(a)  # A leaves without notice: B declares it dead after orphan_after_s and takes over
        row = wait_until(lambda: next((r for r in b.json("replicas")
                                       if r["key"] == key and r["state"] not in ("keeping", "waiting")), None),
                         90, "B's take-over of the victim's job")
        assert row["state"] == "resumed", row  # before: "handed-over", its job_id the attacker's job
        resumed = str(row["job_id"])
        st = job_state(b, resumed)
        assert st["owner_uid"] == NOBODY and st["origin"]["migrated_from"] == key, st
        wait_until(lambda: job_log(b, resumed), 30, "the resumed job's log on B")
        assert job_log(b, resumed)[0]["event"] == "start" and job_log(b, resumed)[0]["resumed"] is not None
        # the forged jobs were refused, naming the name, and nothing of them was created
        for status, body, raw in (on_b, via_zone):
            assert status == 400 and "LM_MIGRATED_FROM" in body["error"], raw
        assert not [j for j in b.json("jobs") if j["name"] == "forged"]
