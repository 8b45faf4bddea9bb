"""The admission queue under real cgroups and processes (`JobManager` on its own, no agent).

A queued job whose start fails when its turn comes (its working directory was removed while it
waited, say) is recorded as failed; the room it was to take must go to the jobs behind it at
once. Before the fix the pass that started it had already counted its charge, so the next job
stayed queued, saying it waited for room that was free, until some other job happened to end.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from jobrig import job_manager, until

from laminar.policy import admission
from laminar.runtime.record import Job
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel



def test_a_failed_start_from_the_queue_gives_its_room_to_the_next_job(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            jobs.set_admission(lambda: admission.Limits({"transient": 300}))
            gone = tmp_path / "lm-t-gone"
            gone.mkdir()

            def spec(name: str, cwd: str | None = None) -> JobSpec:
                return JobSpec(["sleep", "600"], name=name, memory_mb=200, job_class="transient", cwd=cwd).validate()

            x = await jobs.submit(spec("lm-t-x"))
            a = await jobs.submit(spec("lm-t-a", str(gone)))
            b = await jobs.submit(spec("lm-t-b"))
            assert (x.state, a.state, b.state) == ("running", "queued", "queued")
            shutil.rmtree(gone)  # a's start will fail at its turn
            await jobs.stop(x.id, "make room", grace_s=0)

            def record(job_id: str) -> Job:
                j = jobs.get(job_id)
                assert j is not None
                return j

            assert await until(lambda: record(a.id).state == "failed", 20), record(a.id)
            assert "start failed" in record(a.id).reason
            # b fits the room a did not take: it starts now, not when some other job ends
            assert await until(lambda: record(b.id).state == "running", 10), record(b.id)
            # its shell joins the cgroups right after the spawn: let it, so the purge below finds it
            assert await until(lambda: record(b.id).pid in record(b.id).cgroup.pids(), 20)

    asyncio.run(main())
