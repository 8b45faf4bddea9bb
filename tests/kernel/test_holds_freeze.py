"""Two components hold one job frozen (laminar/runtime/holds.py): the job stays frozen, in the
kernel's own flag, until both have released it, and runs on after.

Real cgroups and processes under the real JobManager, the real Airlock (its decisions applied
through ``Airlock._apply`` at explicit levels, as tests/kernel/test_airlock_readdress_calm.py
does: real pressure cannot be produced on demand on a shared machine), the real migration
component's move (its zone the lone stand-in of test_replica_gc_move_freeze: the move fails
with "no destination fits" after its freeze). The fence's hold is taken and released as
migrate/fence.py does (a real partition: tests/cluster/test_fence.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from jobrig import airlock_rig, until
from test_replica_gc_move_freeze import component, sleeper_with_checkpoint

from laminar.policy import ladder
from laminar.runtime.holds import Hold

pytestmark = pytest.mark.kernel


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def calm(al: Any, t0: float) -> None:
    """The pressure has ended for hold_s: Airlock decides on what it sees and acts."""
    al.memo.last_pressure = t0
    now = t0 + al.policy["hysteresis"]["hold_s"] + 0.1
    for a in ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1):
        al._apply(a, now, ladder.NONE, al.signals(now))


def test_a_job_airlock_and_a_fence_hold_stays_frozen_until_both_release(tmp_path: Path) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _store):
            job: Any = await sleeper_with_checkpoint(jobs, "lm-t-holds-fence")
            t0 = time.monotonic()
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), t0, ladder.HIGH, al.signals(t0))
            assert await until(job.cgroup.frozen, 10)
            jobs.holds.hold(job, Hold.FENCE)  # the node is cut off from its zone (fence.py's _fence)
            assert jobs.holds.reasons(job.id) == ["airlock", "fence"]
            calm(al, t0)  # Airlock leaves a job the fence holds alone: no recover
            assert job.id in al.rungs and job.cgroup.frozen()
            # heard again, nobody took it over (fence.py's _unfence_one): Airlock's hold remains
            assert jobs.holds.release(job, Hold.FENCE) is False
            await asyncio.sleep(0.2)
            assert job.cgroup.frozen() and job.cgroup.freeze_requested()
            assert jobs.holds.reasons(job.id) == ["airlock"]
            calm(al, time.monotonic())  # now Airlock recovers it: the last hold, thawed
            assert job.id not in al.rungs
            assert await until(lambda: not job.cgroup.frozen(), 10), "the last release did not thaw the job"
            assert jobs.holds.reasons(job.id) == [] and alive(job.pid)
            assert jobs.get(job.id).state == "running"

    asyncio.run(main())


def test_a_failed_move_of_a_job_airlock_suspended_leaves_it_to_airlocks_hold(tmp_path: Path) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _store):
            job: Any = await sleeper_with_checkpoint(jobs, "lm-t-holds-move")
            t0 = time.monotonic()
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), t0, ladder.HIGH, al.signals(t0))
            assert await until(job.cgroup.frozen, 10)
            mig = component(jobs)
            seen: list[list[str]] = []
            real = mig.mover.rank_for

            def rank_for(*a: Any, **kw: Any) -> Any:  # (after the move's freeze: who holds it then)
                seen.append(jobs.holds.reasons(job.id))
                return real(*a, **kw)

            mig.mover.rank_for = rank_for  # type: ignore[method-assign]
            mv = await mig.mover.move_now(job, "test: move with nowhere to go")
            assert mv.phase == "failed" and "no destination fits" in mv.error, mv
            assert seen == [["airlock", "move"]], seen
            assert job.cgroup.frozen(), "the failed move thawed a job Airlock holds"
            assert jobs.holds.reasons(job.id) == ["airlock"]
            calm(al, time.monotonic())
            assert await until(lambda: not job.cgroup.frozen(), 10), "Airlock's release did not thaw the job"
            assert jobs.holds.reasons(job.id) == [] and alive(job.pid)

    asyncio.run(main())
