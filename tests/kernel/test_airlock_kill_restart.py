"""A kill Airlock began before a restart is finished by the next agent, also one that an agent
of before the rename stored as rung ``reclaim``: the job ends ``killed`` (end cause
``airlock_kill``) with its work lost, not ``lost`` and not left running. Real cgroups and
processes; the stored rung is written as the older agent wrote it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from jobrig import airlock_rig, running, until

from laminar.airlock.manager import Airlock
from laminar.policy import ladder

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("stored", [ladder.KILL, "reclaim"])
def test_a_kill_cut_by_a_restart_is_finished_and_recorded_killed(tmp_path: Path, stored: str) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, store):
            job = await running(jobs, "lm-t-killcut")
            await al.stop()  # the agent went down right after it stored the rung, before the kill
            with store.tx() as db:
                db.execute("INSERT INTO airlock_rungs VALUES (?, ?, ?, 0, ?)",
                           (job.id, stored, time.time(), "pressure critical: test"))
            # the next agent's Airlock (the rig stops the first one again on the way out: a no-op)
            al = Airlock(jobs=jobs, store=store, events=al.events)
            try:
                await al.start(None)
                assert await until(lambda: jobs.get(job.id).state == "killed", 15), jobs.get(job.id)  # type: ignore[union-attr]
                ended = jobs.get(job.id)
                assert ended is not None and str(ended.end_cause) == "airlock_kill"
                assert ended.reason.startswith("airlock killed: pressure critical: test"), ended.reason
                assert await until(lambda: not job.cgroup.pids(), 10), "the job's processes outlived its kill"
                rows = store.db.execute("SELECT rung FROM airlock_rungs").fetchall()
                assert await until(lambda: not store.db.execute("SELECT rung FROM airlock_rungs").fetchall(), 10), rows
            finally:
                await al.stop()

    asyncio.run(main())
