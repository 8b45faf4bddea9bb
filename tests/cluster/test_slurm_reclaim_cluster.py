"""An owner's reclaim carried out through a real Slurm (issue 34): the node drained in Slurm, the
adopted job checkpointed, requeued, and finished on another node from its checkpoint.

A real Slurm (:mod:`slurmrig`: munged, slurmctld, one slurmd per agent in that agent's
namespaces, the laminar SPANK plugin) over two real agents of one zone, each with
``[slurm] enabled`` and its Slurm NodeName, and one ``[adopt] ckpt_root`` both reach (the
shared storage of a real site: a requeued job finds its checkpoint on any node). The job is a
batch job, a small python program using ``laminar.jobkit.Checkpointer``: it sums ``i * i`` over
STEPS steps of STEP_S seconds, saves its state only when it is asked (its checkpoint signal),
resumes from ``LAMINAR_RESUME_FROM`` when it is given one, and writes its result and the step it
began at to a file of the test.

``laminarctl reclaim --notice 30s`` on the node X it runs on: X is DRAIN in Slurm with the
reclaim's reason; the job checkpoints (a step past 0), its comment carries
``laminar-ckpt=<time> <path>``, it is requeued (``Restarts`` 1), runs on the other node, begins
there past step 0 and ends COMPLETED with the right sum; X's agent says so in ``sched`` events.
Then ``laminarctl reclaim cancel`` (the owner gives the node back) clears X's drain in Slurm.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from harness import Cluster, wait_until

pytestmark = pytest.mark.cluster

slurmrig = pytest.importorskip("slurmrig", reason="tests/slurmrig.py (branch i34-slurm) is not merged")

STEPS = 300
STEP_S = 0.1
NOTICE_S = 30

JOB = f'''#!{sys.executable}
# lm-t-sumsq: the test's Slurm batch job (tests/cluster/test_slurm_reclaim_cluster.py)
import json, os, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / "agent")!r})
from laminar.jobkit import Checkpointer

out = sys.argv[1]
ck = Checkpointer()
state = ck.resume()
i, acc = (0, 0) if state is None else tuple(json.loads(state))
began = i
with open(out + ".log", "a") as f:
    f.write(json.dumps({{"node": os.uname().nodename, "began": began, "job": os.environ.get("SLURM_JOB_ID"),
                         "resume_from": os.environ.get("LAMINAR_RESUME_FROM"),
                         "ckpt_dir": os.environ.get("LAMINAR_CKPT_DIR")}}) + "\\n")
while i < {STEPS}:
    acc += i * i
    i += 1
    time.sleep({STEP_S})
    if ck.requested():
        ck.save(json.dumps([i, acc]).encode(), step=i)
with open(out, "w") as f:
    json.dump({{"result": acc, "began": began, "node": os.uname().nodename}}, f)
'''

EXPECTED = sum(i * i for i in range(STEPS))


def _node_fields(s, name: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from laminar.sched.slurm import parse_oneliner

    return parse_oneliner(s.run("scontrol", "show", "node", name, "--oneliner").stdout)


def _job_fields(s, job: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from laminar.sched.slurm import parse_oneliner

    return parse_oneliner(s.run("scontrol", "show", "job", job, "--oneliner").stdout)


def test_reclaim_drains_checkpoints_requeues_and_the_job_finishes_elsewhere(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    why = slurmrig.slurm_ready()
    if why:
        pytest.skip(f"slurm rig: {why}")
    shared = tmp_path / "shared-ckpt"  # the site's shared checkpoint storage, as both nodes see it
    shared.mkdir(mode=0o755)
    adopt = f'\n[adopt]\nckpt_root = "{shared}"\n'
    with Cluster.create(tmp_path, zones=1, per_zone=2, gpus=0, node_extra={0: adopt, 1: adopt}) as c, \
            slurmrig.SlurmRig.create(tmp_path, c) as s:
        # each agent acts through Slurm as its Slurm node (the names are the rig's, known only
        # now): restarted with [slurm]; scontrol finds the rig's slurm.conf through SLURM_CONF
        monkeypatch.setenv("SLURM_CONF", str(s.conf))
        s.agents_act_through_slurm(c)

        script = s.public / "lm-t-sumsq.py"  # readable where slurmd runs it
        script.write_text(JOB)
        script.chmod(0o755)
        out = tmp_path / "result.json"
        job = s.sbatch("--requeue", "--laminar-class", "standard", "--laminar-checkpoint", "USR1",
                       "-o", str(tmp_path / "slurm-%j.out"), str(script), str(out))
        running = s.wait_state(job, "RUNNING", 60)
        x_name = running["NodeList"]
        xi = next(n.index for n in s.nodes if n.name == x_name)
        x, y = c.nodes[xi], c.nodes[1 - xi]

        def adopted() -> dict | None:  # type: ignore[type-arg]
            for j in x.json("jobs"):
                if j.get("scheduler") == "slurm" and j.get("scheduler_ref") == job and j["state"] == "running":
                    return dict(j)
            return None

        lj = wait_until(adopted, 30, f"slurm job {job} adopted on {x_name}")
        time.sleep(3)  # some steps done: a resume at step 0 would be a restart from nothing

        x.ctl("reclaim", "--notice", f"{NOTICE_S}s", "--reason", "owner needs it")

        # drained in Slurm with the reclaim's reason
        def drained() -> dict[str, str] | None:
            f = _node_fields(s, x_name)
            return f if "DRAIN" in f.get("State", "") else None

        nf = wait_until(drained, 20, f"{x_name} drained in slurm")
        assert nf["Reason"].startswith(f"laminar: reclaim of node {x_name}: owner needs it"), nf

        # checkpointed and requeued; the comment names the checkpoint
        requeued = wait_until(lambda: (lambda f: f if int(f.get("Restarts", "0")) >= 1 else None)(_job_fields(s, job)),
                              NOTICE_S + 10, f"slurm job {job} requeued")
        assert "laminar-ckpt=" in requeued.get("Comment", ""), requeued
        ckpts = sorted((shared / f"slurm-{job}").glob("ckpt-*"))
        assert ckpts and int(ckpts[-1].name[5:]) > 0, ckpts
        # (the give-back's event comes once the job's processes here are gone and Slurm's hold
        # on its restart is released, after the requeue Slurm shows)
        events = wait_until(lambda: (lambda ev: ev if any(e.get("outcome") == "given-back" for e in ev) else None)(
            x.json("events", "--kind", "sched", "--limit", "100")), 20, "the give-back's event")
        outcomes = [e.get("outcome") for e in events]
        assert "drained" in outcomes and "checkpoint-asked" in outcomes and "given-back" in outcomes, events
        given = next(e for e in events if e.get("outcome") == "given-back")
        assert given["new_checkpoint"] is True and given["checkpoint"].startswith(str(shared)), given
        # its processes here ended with the requeue, so its restart was let go at once: not held
        # the two minutes Slurm holds a requeued job (Reason=BeginTime)
        assert "Slurm's hold on its restart released" in given["message"], given
        assert x.json("job", "show", lj["id"])["state"] != "running"

        # runs again on the other node, from the checkpoint, and ends with the right sum
        done = s.wait_state(job, "COMPLETED", 240)
        assert done["NodeList"] == s.nodes[y.index].name, done
        result = json.loads(out.read_text())
        assert result["result"] == EXPECTED, result
        assert result["node"] == s.nodes[y.index].name
        runs = [json.loads(line) for line in (out.parent / (out.name + ".log")).read_text().splitlines()]
        assert len(runs) == 2, runs
        assert runs[0]["began"] == 0 and runs[0]["node"] == x_name, runs
        assert runs[1]["began"] > 0 and runs[1]["resume_from"], runs  # resumed past step 0, from its checkpoint
        assert os.path.commonpath([runs[1]["resume_from"], str(shared)]) == str(shared), runs

        # the owner gives the node back: its drain in Slurm is cleared (UNDRAIN on a real node)
        x.ctl("reclaim", "cancel")
        wait_until(lambda: "DRAIN" not in _node_fields(s, x_name).get("State", "DRAIN"), 30,
                   f"{x_name} no longer drained in slurm")
        assert "undrained" in [e.get("outcome") for e in x.json("events", "--kind", "sched", "--limit", "100")]
