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
import secrets
from pathlib import Path

import pytest

from laminar.airlock import ladder
from laminar.airlock.cgroups import CgroupTree, detect
from laminar.airlock.manager import Airlock
from laminar.events import EventBus
from laminar.runtime.jobs import JobManager, JobSpec
from laminar.store import Store

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("rung", [ladder.SUSPEND, ladder.READDRESS])
def test_a_job_that_ends_at_a_rung_leaves_no_rung(tmp_path: Path, rung: str) -> None:
    async def main() -> None:
        root = f"laminar-t-{secrets.token_hex(3)}"
        store = Store(tmp_path / "laminar.db")
        bus = EventBus(store)
        jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=bus, gpus_declared=[])
        al = Airlock(jobs=jobs, store=store, events=bus)
        try:
            await jobs.start(None)
            await al.start(None)
            job = await jobs.submit(JobSpec(["sleep", "600"], name="lm-t-rung", job_class="transient").validate())
            for _ in range(200):
                if job.pid in job.cgroup.pids():
                    break
                await asyncio.sleep(0.05)
            sig = al.signals(0.0)
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), 0.0, ladder.HIGH, sig)
            assert job.cgroup.frozen() and jobs.get(job.id).state == "suspended"  # type: ignore[union-attr]
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
        finally:
            await al.stop()
            await jobs.stop()
            CgroupTree(detect(), root).purge()
            store.close()

    asyncio.run(main())
