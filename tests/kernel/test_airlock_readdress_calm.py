"""A re-addressed job whose pressure ends leaves its rung, and a later episode treats it as running.

Airlock's re-address rung thaws a suspended job so it can take its checkpoint, then waits for
the migration layer (or the rung's budget). When the pressure ended first, the job stayed at
``readdress`` for good: shown so in ``laminarctl jobs``/status and the store, never suspended
again (only running jobs are), and at the first stall of any later episode killed at once,
its budget long spent, while lower-value jobs were merely suspended; the episode never ended
either, so no reaction time was recorded again. Real cgroups and processes; the ladder's
decisions at explicit levels are applied through ``Airlock._apply`` (the machine is shared:
real calm and real pressure cannot be produced on demand here).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import pytest
from jobrig import airlock_rig, running
from standin_agent import standin_agent

from laminar.airlock.cgroups import CgroupTree, detect
from laminar.airlock.manager import Airlock
from laminar.components import AirlockAgent
from laminar.events import EventBus
from laminar.policy import ladder
from laminar.runtime.jobs import JobManager
from laminar.store import Store

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]


def test_a_readdressed_job_is_back_to_running_once_calm(tmp_path: Path) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, store):
            assert al.policy is not None
            job = await running(jobs, "lm-t-readdr")
            t0 = time.monotonic()
            sig = al.signals(t0)
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), t0, ladder.HIGH, sig)
            al._apply(ladder.Action(ladder.READDRESS, job.id, "test: suspend budget ran out"), t0, ladder.HIGH, sig)
            assert al.rungs[job.id][0] == ladder.READDRESS and not job.cgroup.frozen()
            # the pressure ends before the readdress budget (30 s): calm for hold_s
            al.memo.last_pressure = t0
            now = t0 + al.policy["hysteresis"]["hold_s"] + 0.1
            for a in ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1):
                al._apply(a, now, ladder.NONE, sig)
            assert job.id not in al.rungs, al.rungs
            assert not store.db.execute("SELECT 1 FROM airlock_rungs WHERE job_id=?", (job.id,)).fetchall()
            assert jobs.get(job.id).state == "running"  # type: ignore[union-attr]
            # an hour later a new episode: the job is a running candidate, not a spent budget
            later = t0 + 3600
            acts = ladder.decide(later, ladder.HIGH, al.views(later), al.policy.doc, al.memo, 0.9)
            assert [(a.kind, a.job_id) for a in acts] == [(ladder.SUSPEND, job.id)], acts

    asyncio.run(main())


def test_a_job_frozen_by_a_move_the_crash_ended_is_thawed_once_calm(tmp_path: Path) -> None:
    """The agent died while the migration layer moved a re-addressed job (the move freezes it
    for the transfer). The restarted agent took the rung over as readdress, frozen: nothing
    would ever thaw it (the move died with the old process), recovery dropped the rung and
    left the job frozen, shown as running."""
    async def main() -> None:
        root = f"laminar-t-{secrets.token_hex(3)}"
        store = Store(tmp_path / "laminar.db")
        bus = EventBus(store)
        jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=bus, gpus_declared=[])
        al = Airlock(jobs=jobs, store=store, events=bus)
        try:
            await jobs.start(None)
            await al.start(None)
            job = await running(jobs, "lm-t-moved")
            t0 = time.monotonic()
            sig = al.signals(t0)
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), t0, ladder.HIGH, sig)
            al._apply(ladder.Action(ladder.READDRESS, job.id, "test: suspend budget ran out"), t0, ladder.HIGH, sig)
            assert job.cgroup.freeze()  # what migrate's move does before its transfer
            await al.stop()
            await jobs.stop()
            # the restart
            jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=bus, gpus_declared=[])
            al = Airlock(jobs=jobs, store=store, events=bus)
            await jobs.start(None)
            await al.start(None)
            assert al.policy is not None
            now = time.monotonic() + al.policy["hysteresis"]["hold_s"] + 0.1
            for a in ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1):
                al._apply(a, now, ladder.NONE, sig)
            again = jobs.get(job.id)
            assert again is not None and not again.cgroup.frozen(), "left frozen after the restart"
            assert again.state == "running" and job.id not in al.rungs
        finally:
            await al.stop()
            await jobs.stop()
            CgroupTree(detect(), root).purge()
            store.close()

    asyncio.run(main())


def test_a_job_under_a_move_is_left_to_the_move(tmp_path: Path) -> None:
    """A job the migration layer is moving (``agent.migrate.evacuating``) is not Airlock's: a
    suspended job whose move froze it was thawed once calm, mid-transfer (it ran here past the
    checkpoint the destination resumes from: two copies at once), and a critical stall chose it
    for kill though it resumes elsewhere. The agent here is a stand-in (a namespace with the
    migration layer's ``evacuating`` set), named as such; the cgroups and processes are real."""
    from types import SimpleNamespace

    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, store):
            assert al.policy is not None
            job = await running(jobs, "lm-t-moving")
            other = await running(jobs, "lm-t-staying")
            t0 = time.monotonic()
            sig = al.signals(t0)
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), t0, ladder.HIGH, sig)
            assert job.cgroup.frozen() or job.cgroup.freeze_requested()
            al.agent = standin_agent(AirlockAgent, migrate=SimpleNamespace(evacuating={job.id}))  # stand-in agent
            al.memo.last_pressure = t0
            now = t0 + al.policy["hysteresis"]["hold_s"] + 0.1
            acts = ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1)
            assert all(a.job_id != job.id for a in acts), acts  # no thaw of the moving job
            later = t0 + 3600
            acts = ladder.decide(later, ladder.CRITICAL, al.views(later), al.policy.doc, al.memo, 1.0)
            assert acts and all(a.job_id == other.id for a in acts), acts
            al.agent = standin_agent(AirlockAgent, migrate=SimpleNamespace(evacuating=set()))  # the move failed
            assert job.id in {v.id for v in al.views(later)}

    asyncio.run(main())
