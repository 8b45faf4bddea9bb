"""The agent under exactly what systemd/laminard.service gives it: its capability bounding set.

A real laminard runs under ``setpriv --bounding-set`` with the unit's ``CapabilityBoundingSet``
(as systemd starts it: root, no other capability) and must still do what it does to files of
the users whose jobs it runs. Files are owned by a real second user (tests/userrig.py).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from userrig import call_as, local_user

pytestmark = pytest.mark.kernel

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "laminard.service"


def unit_directive(name: str) -> str:
    """The value of directive `name` in the unit's [Service] section (its last setting)."""
    values = [x.split("=", 1)[1] for x in UNIT.read_text().splitlines() if x.startswith(f"{name}=")]
    assert values, f"{UNIT} sets no {name}="
    return values[-1]


def setpriv_unit_caps() -> tuple[str, ...]:
    """A setpriv prefix that runs what follows with only the unit's capabilities (and, as the
    unit sets it, no_new_privs)."""
    caps = [c.removeprefix("CAP_").lower() for c in unit_directive("CapabilityBoundingSet").split()]
    nnp = ("--no-new-privs",) if unit_directive("NoNewPrivileges") in ("yes", "true", "1", "on") else ()
    return ("setpriv", *nnp, "--bounding-set", "-all," + ",".join("+" + c for c in caps), "--inh-caps", "-all", "--")


def test_older_agents_user_files_are_made_private_under_the_units_caps(veth_pair: Any, tmp_path: Path) -> None:
    """An older agent left a job's log 0640 and its checkpoint directory 0755, both the job
    owner's. At start the agent makes them the owner's alone (0600, 0700): chmod of a file that
    is not root's needs CAP_FOWNER, so the unit must grant it (without it the files stayed
    readable by the owner's group and by everyone, with a warning in the log)."""
    with local_user("fowner") as user:
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
        logs, ckpt = a.state_dir / "logs", a.state_dir / "ckpt"
        for d in (a.state_dir, logs, ckpt):
            d.mkdir(mode=0o711, exist_ok=True)
            os.chmod(d, 0o711)
        log = logs / "job-old.log"
        log.write_text("a token printed by the job\n")
        os.chmod(log, 0o640)
        os.chown(log, user.uid, user.gid)
        cdir = ckpt / "job-old"
        cdir.mkdir()
        os.chmod(cdir, 0o755)
        os.chown(cdir, user.uid, user.gid)
        try:
            a.start(prefix=setpriv_unit_caps())
            assert stat.S_IMODE(log.stat().st_mode) == 0o600, a.log()
            assert stat.S_IMODE(cdir.stat().st_mode) == 0o700, a.log()
            assert log.stat().st_uid == user.uid and cdir.stat().st_uid == user.uid
        finally:
            a.cleanup()


def test_a_job_does_not_inherit_the_agents_nice(veth_pair: Any, tmp_path: Path) -> None:
    """The unit runs the agent at ``Nice=`` (-10) so that it gets the CPU ahead of the jobs it
    protects; a job is a child of the agent and inherits its nice value unless the agent resets
    it. A job at the agent's priority defeats that, and gives a user a priority only root may set."""
    nice = int(unit_directive("Nice"))
    assert nice < 0
    with local_user("nice") as user:
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
        try:
            a.start(prefix=("nice", "-n", str(nice), *setpriv_unit_caps()))
            job = a.json("submit", "--name", "nice", "--", "sleep", "60")
            assert job["owner_uid"] == 0
            status, user_job, raw = call_as(user, a.sock, "POST", "/v1/jobs", {"name": "nice-user",
                                                                               "command": ["sleep", "60"]})
            assert status == 201 and user_job["owner_uid"] == user.uid, raw
            for j in (job, user_job):
                pid = wait_until(lambda j=j: a.json("job", "show", j["id"]).get("pid"), 30, "the job's pid")
                # the pid is the job's from the agent's fork on; the nice is set in the root steps
                # before the drop (runtime.joblimits), so look once the command runs (under load the
                # pid was seen still in the steps before it, at the agent's nice)
                wait_until(lambda pid=pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep",
                           30, "the job's command to run")
                assert os.getpriority(os.PRIO_PROCESS, pid) == 0, f"job {j['id']} (pid {pid}) runs at the agent's nice"
        finally:
            a.cleanup()


def test_the_unit_leaves_the_agent_its_devices_and_still_protects_the_clock() -> None:
    """The agent opens GPU device nodes itself (NVML: /dev/nvidiactl, /dev/nvidia<N>). On systemd
    245 to 251 (Ubuntu 20.04 and 22.04, Debian 11) ``ProtectClock=yes`` implies ``DeviceAllow=char-rtc
    r``, and any device allow-list closes every other device to the unit's cgroup (systemd issue
    18142, fixed in 252 by PR 25075): NVML failed and such a node had no GPUs. So the unit sets
    no device allow-list, directly or through ProtectClock=/PrivateDevices=; the clock stays
    protected by the capability bounding set, checked here for real: a process holding only the
    unit's capabilities may not set the clock."""
    text = UNIT.read_text().splitlines()
    for directive in ("ProtectClock=", "PrivateDevices=", "DeviceAllow=", "DevicePolicy="):
        assert not any(x.startswith(directive) for x in text), f"{UNIT} sets {directive}: it closes GPU devices"
    caps = unit_directive("CapabilityBoundingSet").split()
    assert "CAP_SYS_TIME" not in caps and "CAP_WAKE_ALARM" not in caps
    # set the clock to what it reads (a no-op even if allowed): refused for want of CAP_SYS_TIME
    code = ("import time,sys\ntry:\n    time.clock_settime(time.CLOCK_REALTIME, time.clock_gettime(time.CLOCK_REALTIME))\n"
            "except PermissionError:\n    sys.exit(0)\nsys.exit(3)\n")
    r = subprocess.run([*setpriv_unit_caps(), sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"a process with the unit's capabilities set the clock ({r.returncode}: {r.stderr})"


PIDS_V1 = Path("/sys/fs/cgroup/pids")


@pytest.mark.skipif(not (PIDS_V1 / "cgroup.procs").exists(), reason="no cgroup v1 pids hierarchy (not a hybrid host)")
def test_jobs_on_a_hybrid_host_leave_the_units_pids_cgroup_for_their_own_with_a_task_limit(
        veth_pair: Any, tmp_path: Path) -> None:
    """On a hybrid host the agent used to move a job into its own memory, cpu and unified
    cgroups, but not out of the v1 pids cgroup systemd started the agent in: every job's tasks
    counted against the unit's ``TasksMax=`` (the default, 15% of the pid limit, made the agent's
    own fork fail; so the unit says infinity) and no job had a task limit of its own: a fork bomb
    was bounded by nothing but the pid space. Now a job gets its own v1 pids cgroup with a
    ``pids.max``, all jobs together the root's; ``TasksMax=infinity`` stays for jobs an older
    agent started (docs/operations.md).

    Here a pids cgroup of the test's own stands for the unit's."""
    unit_cg = PIDS_V1 / f"laminar-t-sec-{os.getpid()}-{os.urandom(2).hex()}"
    unit_cg.mkdir()
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
    try:
        a.start(prefix=("sh", "-c", f'echo $$ > {unit_cg}/cgroup.procs && exec "$@"', "sh"))
        job = a.json("submit", "--name", "tasks", "--", "sleep", "60")
        pid = wait_until(lambda: a.json("job", "show", job["id"]).get("pid"), 30, "the job's pid")
        own = PIDS_V1 / a.cgroup_root / job["class"] / job["id"]
        wait_until(lambda: (own / "cgroup.procs").exists() and str(pid) in (own / "cgroup.procs").read_text().split(),
                   30, "the job in its own pids cgroup")
        procs = {int(x) for x in (unit_cg / "cgroup.procs").read_text().split()}
        assert pid not in procs, f"job pid {pid} stays in the agent's pids cgroup"
        assert int((own / "pids.max").read_text()) == a.json("job", "show", job["id"])["limits"]["pids_max"]
        assert (PIDS_V1 / a.cgroup_root / "pids.max").read_text().strip().isdigit()
        assert unit_directive("TasksMax") == "infinity"
    finally:
        a.cleanup()
        for _ in range(100):
            try:
                unit_cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
