"""Airlock's rungs follow the jobs: a job that ends while Airlock holds it at a rung leaves no rung.

A job suspended by Airlock and then stopped by its owner, or re-addressed (thawed to take its
checkpoint) and then ending or moved by the migration layer, kept its rung for good: in
``laminarctl status`` (``airlock.rungs``), in the store (``airlock_rungs``), and in the test
that ends a pressure episode, so no later reaction time was recorded. Real cgroups and
processes; Airlock's decisions are applied through ``Airlock._apply`` (the pressure that would
make the ladder decide them is not produced here).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from jobrig import airlock_rig, running, until

from laminar.policy import ladder

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]


@pytest.mark.parametrize("rung", [ladder.SUSPEND, ladder.READDRESS])
def test_a_job_that_ends_at_a_rung_leaves_no_rung(tmp_path: Path, rung: str) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, store):
            job = await running(jobs, "lm-t-rung")
            sig = al.signals(0.0)
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), 0.0, ladder.HIGH, sig)
            # (the freeze is waited for 1 s (FREEZE_WAIT_S); on a loaded machine it may take hold later)
            assert jobs.get(job.id).state == "suspended" and job.cgroup.freeze_requested()  # type: ignore[union-attr]
            assert await until(job.cgroup.frozen, 10)
            if rung == ladder.READDRESS:
                al._apply(ladder.Action(ladder.READDRESS, job.id, "test: budget ran out"), 0.0, ladder.HIGH, sig)
                assert not job.cgroup.frozen()
            assert al.rungs[job.id][0] == rung
            await jobs.stop(job.id, "stopped by its owner", grace_s=1)
            assert not job.cgroup.exists()
            al.evaluate()
            assert job.id not in al.rungs, al.rungs
            assert job.id not in al.status()["rungs"]
            stored = store.db.execute("SELECT job_id FROM airlock_rungs WHERE job_id=?", (job.id,)).fetchall()
            assert not stored

    asyncio.run(main())
