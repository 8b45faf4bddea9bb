"""The Slurm client and backend (:mod:`laminar.sched.slurm`) against a real slurmctld: Debian's
munged and slurmctld started by the test on this host (their own key, socket, ports, state
under the test's tmp dir), one node in slurm.conf with no slurmd behind it (a drain, a comment
and a requeue are the controller's business; a job stays PENDING). Root, Slurm and munge needed
(``make`` installs them).

Checked, on the real controller: the drain's reason is what ``scontrol show node`` says, and
the backend's undrain resumes it; the published comment round-trips with the user's words kept
and is parsed back (``Comment=`` holds spaces and ``;``); a refused requeue (a pending job) is a
SlurmError that names the command line and what slurmctld answered; a node the controller does
not know is refused with its answer (which scontrol prints on stdout)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from laminar.policy import sched_reclaim as sr
from laminar.policy.sched import Scheduler
from laminar.sched.slurm import Slurm, SlurmBackend, SlurmError

pytestmark = pytest.mark.kernel

NEEDS = ("munged", "slurmctld", "scontrol", "sbatch")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def ctld(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    if os.geteuid() != 0:
        pytest.skip("needs root (slurmctld as SlurmUser=root, munged)")
    missing = [b for b in NEEDS if not (shutil.which(b) or shutil.which(b, path="/usr/sbin:/sbin"))]
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (make installs slurmctld slurm-client munge)")
    d = tmp_path / f"lmt-slurm-{secrets.token_hex(3)}"
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    node = "lmtu-n1"
    conf = d / "slurm.conf"
    (d / "plugstack.conf").write_text("")
    conf.write_text(
        f"ClusterName=lmtu\nSlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)\n"
        f"SlurmctldPort={_port()}\nSlurmdPort={_port()}\nAuthType=auth/munge\nCredType=cred/munge\n"
        f"AuthInfo=socket={d}/munge.sock\nSlurmUser=root\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n"
        f"SlurmctldPidFile={d}/slurmctld.pid\nSlurmctldLogFile={d}/slurmctld.log\nProctrackType=proctrack/linuxproc\n"
        "TaskPlugin=task/none\nSelectType=select/cons_tres\nJobRequeue=1\nMpiDefault=none\nSwitchType=switch/none\n"
        "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
        f"JobCompType=jobcomp/none\nMailProg=/bin/true\nPlugStackConfig={d}/plugstack.conf\n"
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN\n"
        "PartitionName=lmtu Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    monkeypatch.setenv("SLURM_CONF", str(conf))  # the client passes it on to scontrol
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={d}/munge.sock", f"--key-file={key}",
             f"--pid-file={d}/munged.pid", f"--seed-file={d}/munge.seed", f"--log-file={d}/munged.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 10
        while not (d / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(d / "ctld.out", "wb") as log:
            procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=log, stderr=log,
                                          start_new_session=True))
        deadline = time.monotonic() + 30
        while subprocess.run(["scontrol", "ping"], env=env, capture_output=True).returncode != 0:
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                pytest.fail(f"slurmctld did not come up:\n{(d / 'ctld.out').read_text()[-2000:]}")
            time.sleep(0.2)
        yield SimpleNamespace(node=node, env=env, dir=d)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def test_real_controller(ctld: SimpleNamespace) -> None:
    job_ref = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 1"], env=ctld.env,
                             capture_output=True, text=True, check=True, cwd=ctld.dir).stdout.strip()
    assert job_ref.isdigit()
    client = Slurm("scontrol", timeout_s=20)
    b = SlurmBackend(client, ctld.node, newest=lambda job: "/shared/slurm-x/ckpt-12")
    job = SimpleNamespace(id="job-1", origin=SimpleNamespace(scheduler=Scheduler.SLURM, scheduler_ref=job_ref))

    async def go() -> None:
        await b.drain("owner needs it")
        f = await client.node(ctld.node)
        assert "DRAIN" in f["State"], f
        assert f["Reason"].startswith("laminar: reclaim of node lmtu-n1: owner needs it"), f
        assert sr.drained_by_us(f["Reason"])

        await client.set_comment(job_ref, "my sweep; 3")
        await b.publish(job, 1765000000.7)
        got = await client.job(job_ref)
        assert got["Comment"] == "my sweep; 3; laminar-ckpt=1765000000 /shared/slurm-x/ckpt-12", got
        assert sr.parse_published(got["Comment"]) == (1765000000, "/shared/slurm-x/ckpt-12")
        assert got["JobState"] == "PENDING" and got["Requeue"] == "1"

        with pytest.raises(SlurmError, match=rf"scontrol requeue {job_ref}: exit status 1: .*pending"):
            await b.give_back(job, None)
        with pytest.raises(SlurmError, match=r"scontrol show node lmtu-nope --oneliner: exit status 1: Node lmtu-nope not found"):
            await client.node("lmtu-nope")

        # a node whose slurmd never registered (State=UNKNOWN): slurmctld 22.05 clears its drain
        # and still answers "Invalid node state specified" (for the UNKNOWN it keeps); the
        # refusal names the command, and the drain is gone all the same
        try:
            await b.undrain("reclaim cancelled")
        except SlurmError as e:
            assert "scontrol update NodeName=lmtu-n1 State=UNDRAIN: exit status 1: " in str(e), e
            assert "Invalid node state" in str(e), e
        f = await client.node(ctld.node)
        assert "DRAIN" not in f["State"], f

    asyncio.run(go())
