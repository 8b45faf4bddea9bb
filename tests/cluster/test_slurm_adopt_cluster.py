"""Slurm jobs adopted by laminard (issue 34), with a real Slurm: Debian's slurmctld, one slurmd
per agent in that agent's namespaces, munge, and the laminar SPANK plugin (``tests/slurmrig.py``;
docs/slurm.md).

- ``sbatch --laminar-class long-resident`` of a job: the task is adopted by its node's agent
  (``laminarctl jobs`` lists it with ``slurm:<id>``, the job's record names the scheduler and
  its Slurm job id, the task got ``LAMINAR_JOB_ID`` from the plugin); ``scancel`` ends it;
- two tasks of one job on a node are one Laminar job; with ``adopt=all`` a job without options
  is adopted with the agent's defaults;
- a task waits ``wait=`` seconds for its node's agent to come back; without one it fails, or runs
  unprotected with ``unreachable=run``;
- bad input refused at ``srun`` (and ``sbatch``), before the job is queued, with the agent's
  reason: an unknown class, a priority beyond the user's grant (srun run as a plain local user);
- the kill-switch cuts an adopted job's traffic (its netguard counters, ``lm_job_stats``);
- GPUs (issue 35; gres on FAKE device files, ``SlurmRig(gpus=2)``, the agent's inventory
  ``[gpus] declared``, ``[slurm] enabled``): a job given a GPU by ``--gres=gpu:1`` is adopted
  holding the GPU slurmctld gave it; a plain user's task without gres that sets
  ``SLURM_STEP_GPUS=0`` is refused at its start, naming both lists, and a gres job given GPU 0
  next is adopted holding it;
- a memory storm on its node (serial, below) leaves it running while a transient job yields.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, Node, wait_until
from slurmrig import SlurmRig, adopt_toml, slurm_ready

pytestmark = pytest.mark.cluster

_reason = slurm_ready()
if _reason:  # in CI (CI=true) a cluster test that skips counts as failed (tests/conftest.py)
    pytestmark = [pytest.mark.cluster, pytest.mark.skip(reason=f"slurm rig: {_reason}")]


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[tuple[Cluster, SlurmRig]]:
    """Two agents in one zone, a slurmd beside each."""
    with ExitStack() as stack:
        c = stack.enter_context(Cluster.create(tmp_path, zones=1, per_zone=2, gpus=0, zone_extra=adopt_toml(tmp_path)))
        yield c, stack.enter_context(SlurmRig.create(tmp_path, c))


def adopted(nd: Node, ref: str) -> dict[str, Any] | None:
    """The live Laminar job on ``nd`` adopted from Slurm job ``ref``, or None."""
    for j in nd.json("jobs"):
        if j.get("scheduler") == "slurm" and j.get("scheduler_ref") == ref and j["state"] in ("running", "suspended"):
            return dict(j)
    return None


def wait_adopted(s: SlurmRig, nd: Node, ref: str, timeout: float = 60.0) -> dict[str, Any]:
    try:
        return wait_until(lambda: adopted(nd, ref), timeout, f"slurm job {ref} adopted on node {nd.node_id}")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.job(ref)}\n{s.logs()}\n--- agent ---\n{nd.agent.log()}") from None


def test_an_sbatch_job_with_a_laminar_class_is_adopted_by_its_nodes_agent_and_ends_with_scancel(slurm, tmp_path):
    c, s = slurm
    nd = c.nodes[0]
    out = tmp_path / "job.out"
    script = 'echo "id=$LAMINAR_JOB_ID dir=$LAMINAR_CKPT_DIR sig=$LAMINAR_CKPT_SIGNAL"; exec sleep 300'
    ref = s.sbatch("-w", s.nodes[0].name, "-o", str(out), "--laminar-class", "long-resident",
                   "--laminar-priority", "80", "--wrap", script, node=0)
    s.wait_state(ref, "RUNNING")
    job = wait_adopted(s, nd, ref)
    assert job["class"] == "long-resident" and job["priority"] == 80, job
    shown = nd.json("job", "show", job["id"])
    assert shown["scheduler"] == "slurm" and shown["scheduler_ref"] == ref, shown
    # the task is in the job's cgroup (moved there: proctrack/linuxproc leaves it outside any
    # scheduler cgroup), and the plugin gave it the agent's env
    wait_until(lambda: out.exists() and "id=" in out.read_text(), 20, "the job's first line")
    line = out.read_text()
    assert f"id={job['id']} " in line and "dir=/" in line, line
    procs = (Path("/sys/fs/cgroup") / shown["cgroup"].lstrip("/") / "cgroup.procs")
    if not procs.exists():
        procs = Path(shown["cgroup"]) / "cgroup.procs"
    assert procs.read_text().split(), shown
    # laminarctl jobs names its scheduler and Slurm job id
    listing = nd.ctl("jobs").stdout
    assert re.search(rf"\bslurm:{ref}\b", listing), listing
    # no job on the other node: the plugin asked its own node's agent
    assert adopted(c.nodes[1], ref) is None
    # Slurm ends it: the agent sees its processes gone
    s.run("scancel", ref)
    end = wait_until(lambda: (lambda j: j if j["state"] not in ("running", "suspended") else None)(
        nd.json("job", "show", job["id"])), 30, "the adopted job's end")
    assert end["state"] == "exited" and end["reason"] == "ended by slurm", end


def test_two_tasks_of_one_slurm_job_on_a_node_are_one_laminar_job(slurm, tmp_path):
    """srun -n2 on one node: both tasks adopted into the same Laminar job, each told its id and
    the checkpoint contract; the job ends with the step."""
    c, s = slurm
    nd = c.nodes[0]
    r = s.run("srun", "-n2", "-w", s.nodes[0].name, "--laminar-class", "standard", "--laminar-checkpoint", "USR2",
              "sh", "-c", 'echo "id=$LAMINAR_JOB_ID sig=$LAMINAR_CKPT_SIGNAL"; sleep 1', node=0)
    lines = sorted(r.stdout.split())
    ids = {w for w in lines if w.startswith("id=")}
    assert len(ids) == 1 and ids != {"id="}, r.stdout
    assert [w for w in lines if w.startswith("sig=")] == ["sig=SIGUSR2"] * 2, r.stdout
    job = nd.json("job", "show", ids.pop()[3:])
    assert job["scheduler"] == "slurm" and job["class"] == "standard", job
    wait_until(lambda: nd.json("job", "show", job["id"])["state"] == "exited", 30, "the job's end with its step")


def test_with_adopt_all_a_job_without_options_is_adopted_with_the_defaults(tmp_path):
    """plugstack.conf ``adopt=all``: a job that gives no --laminar-* option is adopted too
    (class standard, priority 50, checkpoint SIGUSR1: the agent's defaults)."""
    with ExitStack() as stack:
        c = stack.enter_context(Cluster.create(tmp_path, zones=1, per_zone=1, gpus=0, zone_extra=adopt_toml(tmp_path)))
        s = stack.enter_context(SlurmRig.create(tmp_path, c, plugin_args="adopt=all"))
        r = s.run("srun", "sh", "-c", 'echo "id=$LAMINAR_JOB_ID sig=$LAMINAR_CKPT_SIGNAL"', node=0)
        m = re.fullmatch(r"id=(\S+) sig=SIGUSR1", r.stdout.strip())
        assert m, r.stdout
        job = c.nodes[0].json("job", "show", m.group(1))
        assert (job["scheduler"], job["class"], job["priority"]) == ("slurm", "standard", 50), job


def test_a_task_waits_for_its_nodes_agent_to_restart_and_without_one_fails_or_runs_as_configured(tmp_path):
    """The node's agent is stopped (an upgrade, a crash before systemd restarts it): a task of a
    job that asked for Laminar tries again for ``wait=`` seconds, so an agent back within them
    adopts it; past them the task fails, naming the socket and the wait (``unreachable=fail``, the
    default), or runs without Laminar saying so on its stderr (``unreachable=run``)."""
    import threading

    with ExitStack() as stack:
        c = stack.enter_context(Cluster.create(tmp_path, zones=1, per_zone=1, gpus=0, zone_extra=adopt_toml(tmp_path)))
        s = stack.enter_context(SlurmRig.create(tmp_path, c, plugin_args="wait=90"))
        nd = c.nodes[0]
        srun = ("srun", "--laminar-class", "standard", "sh", "-c", 'echo "id=$LAMINAR_JOB_ID"')
        nd.agent.stop()
        back = threading.Timer(2.0, nd.agent.start)
        back.start()
        try:
            t0 = time.monotonic()
            r = s.run(*srun, node=0, timeout=120)
            took = time.monotonic() - t0
        finally:
            back.join()
        m = re.fullmatch(r"id=(\S+)", r.stdout.strip())
        assert m and took > 1.5, (r.stdout, r.stderr, took)  # adopted by the agent that came back
        job = nd.json("job", "show", m.group(1))
        assert job["scheduler"] == "slurm" and job["class"] == "standard", job

        nd.agent.stop()
        s.set_plugin_args("wait=1 unreachable=run")
        r = s.run(*srun, node=0, timeout=60)
        assert r.stdout.strip() == "id=", r.stdout  # ran, not adopted
        assert "the task runs without Laminar (plugin argument unreachable=run)" in r.stderr, r.stderr
        assert f"cannot reach the agent at {s.plugin_socket}" in r.stderr, r.stderr

        s.set_plugin_args("wait=1")  # unreachable=fail, the default
        r = s.run(*srun, node=0, check=False, timeout=60)
        assert r.returncode != 0 and "id=" not in r.stdout, (r.stdout, r.stderr)
        assert f"cannot reach the agent at {s.plugin_socket}" in r.stderr and "(tried for 1 s" in r.stderr, r.stderr


def test_bad_laminar_options_are_refused_at_srun_with_the_agents_reason(slurm, tmp_path):
    from userrig import local_user

    c, s = slurm
    nd = c.nodes[0]
    before = s.run("squeue", "-h", "-o", "%i").stdout.split()
    # syntax: the plugin's own check, no agent asked
    r = s.run("srun", "--laminar-priority", "1000", "true", node=0, check=False)
    assert r.returncode != 0 and "laminar: --laminar-priority 1000" in r.stderr, r
    # an unknown class: the agent's refusal, named
    r = s.run("srun", "--laminar-class", "bogus", "true", node=0, check=False)
    assert r.returncode != 0, r
    assert "laminar:" in r.stderr and "bogus" in r.stderr, r.stderr
    # the same at sbatch (allocator context)
    r = s.run("sbatch", "--laminar-class", "bogus", "--wrap", "true", node=0, check=False)
    assert r.returncode != 0 and "laminar: class 'bogus': no such Airlock class" in r.stderr, r.stderr
    with local_user("slurm") as u:
        # a plain user may give priority up to 50 (the default grant): 90 is refused, naming it
        r = s.run("srun", "--laminar-class", "standard", "--laminar-priority", "90", "true", node=0, user=u,
                  check=False)
        assert r.returncode != 0, r
        assert "laminar:" in r.stderr and "90" in r.stderr, r.stderr
        # a class beyond the grant: long-resident is not among a plain user's default classes
        r = s.run("srun", "--laminar-class", "long-resident", "true", node=0, user=u, check=False)
        assert r.returncode != 0 and "laminar:" in r.stderr and "long-resident" in r.stderr, r.stderr
        # within the grant: runs, adopted as the user's job
        r = s.run("srun", "-w", s.nodes[0].name, "--laminar-class", "standard", "--laminar-priority", "40",
                  "sh", "-c", 'echo "id=$LAMINAR_JOB_ID"', node=0, user=u, check=False)
        assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{s.logs()}\n{nd.agent.log()}"
        assert re.search(r"id=\S+", r.stdout), r.stdout
    # nothing refused was queued
    assert s.run("squeue", "-h", "-o", "%i").stdout.split() == before


def test_an_adopted_slurm_job_holds_the_gpus_slurmctld_gave_it_not_those_its_task_names(tmp_path, monkeypatch):
    from userrig import local_user

    from laminar.sched.slurm import parse_job_gpus

    with ExitStack() as stack:
        c = stack.enter_context(Cluster.create(tmp_path, zones=1, per_zone=1, gpus=2, zone_extra=adopt_toml(tmp_path)))
        s = stack.enter_context(SlurmRig.create(tmp_path, c, gpus=2))
        monkeypatch.setenv("SLURM_CONF", str(s.conf))  # the agent's scontrol finds the rig's slurm.conf
        s.agents_act_through_slurm(c)
        nd, name = c.nodes[0], s.nodes[0].name
        u = stack.enter_context(local_user("gpus"))

        def slurm_gpus(ref: str) -> list[int]:
            return list(parse_job_gpus(s.run("scontrol", "show", "job", "-d", ref).stdout, ref, name))

        # a plain user's job without gres that names GPU 0 itself: refused when its task starts,
        # naming both lists; nothing adopted. (On a node with GresTypes=gpu, slurmstepd unsets
        # SLURM_STEP_GPUS in a step without gres but leaves SLURM_JOB_GPUS as the user set it; the
        # plugin sends the first it finds)
        r = s.run("env", "SLURM_STEP_GPUS=0", "SLURM_JOB_GPUS=0", "srun", "-w", name, "--laminar-class", "standard", "sh", "-c",
                  "echo ran", node=0, user=u, check=False)
        assert r.returncode != 0 and "ran" not in r.stdout, r
        said = r.stdout + r.stderr
        assert "laminar: job " in said and "gpus [0] (the task's SLURM_STEP_GPUS or SLURM_JOB_GPUS) are not the GPUs slurmctld gave the job on " \
            f"node {name}: none" in said, said
        assert not [j for j in nd.json("jobs") if j["state"] in ("running", "suspended")], nd.json("jobs")
        # a gres job of the same user, given GPU 0 by Slurm (a step: its task sees SLURM_STEP_GPUS),
        # left running: adopted holding GPU 0
        holder = subprocess.Popen(s.argv("srun", "-w", name, "--gres=gpu:1", "--laminar-class", "standard", "sleep",
                                         "300", node=0, user=u), env=s.env(), cwd="/tmp", stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        stack.callback(lambda: (holder.kill(), holder.wait()))
        first = wait_until(lambda: next(iter(s.run("squeue", "-h", "-t", "R", "-o", "%i").stdout.split()), None), 30,
                           "the gres job running")
        stack.callback(lambda: s.run("scancel", first, check=False))
        assert slurm_gpus(first) == [0]
        assert wait_adopted(s, nd, first)["gpus"] == [0]
        # a step given the other GPU (SLURM_STEP_GPUS set by slurmstepd, seen by the plugin): adopted holding it
        r = s.run("srun", "-w", name, "--gres=gpu:1", "--laminar-class", "standard", "sh", "-c",
                  'echo "id=$LAMINAR_JOB_ID step_gpus=$SLURM_STEP_GPUS"', node=0, user=u, check=False)
        assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{nd.agent.log()}"
        m = re.fullmatch(r"id=(\S+) step_gpus=1", r.stdout.strip())
        assert m, r.stdout
        assert nd.json("job", "show", m.group(1))["gpus"] == [1]


# A sender: one UDP datagram every 10 ms to the bridge's address (the host side), forever.
SENDER = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
while True:
    try:
        s.sendto(b"x" * 200, (sys.argv[1], 9))
    except OSError:
        pass
    time.sleep(0.01)
"""


def stats(nd: Node, cgroup_id: int) -> dict[str, int]:
    for e in nd.json("bpf", "dump", "lm_job_stats")["entries"]:
        if int(e["key"]["cgroup_id"]) == cgroup_id:
            return {k: int(v) for k, v in e["value"].items()}
    return {}


def test_the_killswitch_cuts_an_adopted_slurm_jobs_traffic(slurm, tmp_path):
    c, s = slurm
    nd = c.nodes[0]
    prog = tmp_path / "sender.py"
    prog.write_text(SENDER)
    ref = s.sbatch("-w", s.nodes[0].name, "-o", str(tmp_path / "send.out"), "--laminar-class", "standard",
                   "--wrap", f"exec {sys.executable} {prog} {c.subnet}.254", node=0)
    job = wait_adopted(s, nd, ref)
    cg = int(nd.json("job", "show", job["id"])["cgroup_id"])

    def tx() -> int:
        return stats(nd, cg).get("tx_packets", 0)

    def growing() -> bool:
        a = tx()
        time.sleep(0.5)
        return tx() > a

    wait_until(growing, 20, "the adopted job's traffic counted")
    assert nd.ctl("killswitch", "on", "--job", job["id"]).returncode == 0
    time.sleep(0.3)
    passed, drops = tx(), stats(nd, cg).get("drop_packets", 0)
    time.sleep(1.0)
    assert tx() == passed, "the adopted job's traffic still passes with the switch on"
    assert stats(nd, cg).get("drop_packets", 0) > drops
    ks = nd.json("events", "--kind", "killswitch", "--limit", "50")
    assert any(e.get("job") == job["id"] and e.get("action") == "on" for e in ks), ks
    nd.ctl("killswitch", "off", "--job", job["id"])
    wait_until(growing, 20, "its traffic passing again")
    assert s.job(ref)["JobState"] == "RUNNING"


BUDGET_MB = 512

# The spike: grows to TOTAL MiB in 30 MiB steps (pages written), holds HOLD s, frees, sleeps.
SPIKE = r"""
import sys, time
total, hold = int(sys.argv[1]), float(sys.argv[2])
keep = []
while sum(map(len, keep)) < total << 20:
    b = bytearray(30 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    keep.append(b)
    time.sleep(0.03)
time.sleep(hold)
del keep[:]
while True:
    time.sleep(1)
"""

TICKER = 'while :; do echo t >> "$0"; sleep 0.05; done'


@pytest.fixture
def slurm_airlock(tmp_path: Path) -> Iterator[tuple[Cluster, SlurmRig]]:
    """One agent running Airlock with a budget of the test's own, a slurmd beside it."""
    with ExitStack() as stack:
        c = stack.enter_context(Cluster.create(tmp_path, zones=1, per_zone=1, gpus=0, airlock=(0,),
                                               zone_extra=adopt_toml(tmp_path),
                                               node_extra={0: f"[airlock]\nbudget_mb = {BUDGET_MB}\n"}))
        yield c, stack.enter_context(SlurmRig.create(tmp_path, c))


@pytest.mark.serial  # its memory pressure is felt machine-wide (Makefile: run alone)
def test_a_memory_storm_leaves_an_adopted_long_resident_job_running_while_a_transient_job_yields(
        slurm_airlock, tmp_path):
    c, s = slurm_airlock
    nd = c.nodes[0]
    pol = tmp_path / "policy.json"
    pol.write_text(json.dumps({"hysteresis": {"hold_s": 0.5, "step_s": 0.2},
                               "thresholds": {"usage.critical": 0.99, "memory.full": 0.0},
                               "rungs": {"suspend": {"budget_s": 60.0}}, "readdress": False}))
    nd.json("policy", "set", str(pol))
    ticks = tmp_path / "ticks"
    ref = s.sbatch("-w", s.nodes[0].name, "-o", str(tmp_path / "tick.out"), "--laminar-class", "long-resident",
                   "--laminar-priority", "80", "--wrap", f"sh -c '{TICKER}' {ticks}", node=0)
    job = wait_adopted(s, nd, ref)
    transient = nd.json("submit", "--name", "yielder", "--class", "transient", "--priority", "5",
                        "--memory", "64M", "--", "sh", "-c", "while :; do sleep 0.05; done")
    wait_until(lambda: ticks.exists() and ticks.stat().st_size > 0, 20, "the adopted job ticking")
    spiky = nd.json("submit", "--name", "spiky", "--class", "long-resident", "--priority", "90",
                    "--memory", "480M", "--", sys.executable, "-c", SPIKE, "450", "6")
    acted = wait_until(lambda: [a for a in nd.json("events", "--kind", "airlock", "--limit", "200")
                                if a.get("action") in ("suspend", "kill") and a.get("job") == transient["id"]],
                       40, "Airlock acting on the transient job")
    assert acted
    # the adopted job was never touched: running, its ticks going on, still RUNNING in Slurm
    size = ticks.stat().st_size
    time.sleep(0.5)
    assert ticks.stat().st_size > size, "the adopted job stopped ticking"
    acts = [a for a in nd.json("events", "--kind", "airlock", "--limit", "200") if "action" in a]
    assert not [a for a in acts if a.get("job") == job["id"]], acts
    assert nd.json("job", "show", job["id"])["state"] == "running"
    assert s.job(ref)["JobState"] == "RUNNING"
    assert nd.json("job", "show", spiky["id"])["state"] == "running"
