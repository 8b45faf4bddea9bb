"""The checkpoint signal of a member of a multi-node job goes to the processes that catch it.

A member's main process is a launcher (torchrun) that does not catch SIGUSR1 (its default action
kills), and its workers do. So for a job the members component calls a member (here
``standin_agent.StandInMembers``, a stand-in until laminar/members/ lands),
``JobManager.request_checkpoint`` signals every process of the job's cgroup that catches the
signal, through a pidfd each, and never the launcher; the checkpoint driver's contract check
(``catches_checkpoint``) looks at those processes too. A job of this node alone is as before:
only its main process is looked at, and one that does not catch is not signalled.

Real processes in real cgroups: the "launcher" is a Python process without a handler whose child
installs one (as torchrun's worker does through jobkit).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from jobrig import job_manager, until
from standin_agent import StandInMember, StandInMembers

from laminar.migrate.ckpt_driver import CkptDriver
from laminar.migrate.evidence import NoticeOdds
from laminar.migrate.hazard import HazardModel
from laminar.migrate.reclaim import CONFIG_FIELDS
from laminar.runtime.jobs import JobManager
from laminar.runtime.record import Job
from laminar.runtime.signals import catches_signal
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel

WORKER = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *a: open(sys.argv[1], "a").write("checkpointed\\n"))
open(sys.argv[1] + ".ready", "w").close()
while True:
    time.sleep(0.05)
"""
# the launcher: no handler of its own (SIGUSR1 would kill it), one worker that has one
LAUNCHER = f"""
import subprocess, sys
subprocess.run([sys.executable, "-c", {WORKER!r}, sys.argv[1]])
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def launched(jobs: JobManager, name: str, out: Path) -> tuple[Job, int]:
    """A launcher job whose worker has installed its handler: (the job, the worker's pid)."""
    job = await jobs.submit(JobSpec([sys.executable, "-c", LAUNCHER, str(out)], name=name).validate())
    assert await until(lambda: Path(f"{out}.ready").exists(), 20), "the worker's handler"
    workers = [p for p in job.cgroup.pids() if p != job.pid]
    assert job.pid is not None and len(workers) == 1
    assert catches_signal(workers[0], "SIGUSR1") and not catches_signal(job.pid, "SIGUSR1")
    return job, workers[0]


def test_a_members_checkpoint_signal_reaches_its_worker_and_spares_its_launcher(tmp_path: Path) -> None:
    async def main() -> None:
        members = StandInMembers()
        async with job_manager(tmp_path, members) as jobs:
            out_m, out_p = tmp_path / "member.out", tmp_path / "plain.out"
            member, worker = await launched(jobs, "lm-t-mem-ckpt", out_m)
            plain, plain_worker = await launched(jobs, "lm-t-plain-ckpt", out_p)
            members.hosted[member.id] = StandInMember(member.id, index=1, count=2)
            # the contract check: a member's worker keeps it; a job of this node alone is its main process
            assert jobs.catches_checkpoint(member) is True
            assert jobs.catches_checkpoint(plain) is False
            assert jobs.request_checkpoint(member) is True
            assert await until(lambda: out_m.exists() and out_m.read_text() == "checkpointed\n", 10)
            assert jobs.signal_catchers(member, "SIGUSR1") == [worker]  # only the worker, again
            assert await until(lambda: out_m.read_text().count("checkpointed") == 2, 10)
            # a job of this node alone: its launcher does not catch it, so nobody is signalled
            assert jobs.request_checkpoint(plain) is False
            await asyncio.sleep(0.3)
            assert not out_p.exists()
            for job, w in ((member, worker), (plain, plain_worker)):
                assert job.pid is not None and alive(job.pid) and alive(w)
                got = jobs.get(job.id)
                assert got is not None and got.state == "running"
            # the checkpoint driver's contract check reads the same: the member is driven
            comp = SimpleNamespace(s={k: f.default for k, f in CONFIG_FIELDS.items()}, evacuating=set(),
                                   reclaim=None, agent=SimpleNamespace(jobs=jobs, config=None),
                                   evidence=SimpleNamespace(hazards={"default": HazardModel("default")},
                                                            notice_odds=NoticeOdds(),
                                                            observe_exposure=lambda *a: None,
                                                            exposed_nodes=lambda: 1.0),
                                   _emit=lambda message, **f: None)
            d = CkptDriver(comp)
            d.round()
            skip = {row["job"]: row["skip"] for row in d.view()}
            assert "does not catch" in skip[plain.id] and "does not catch" not in skip[member.id], skip

    asyncio.run(main())
