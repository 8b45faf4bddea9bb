"""A job Airlock suspended is thawed once calm even if its class became protected meanwhile.

The ladder only looked at jobs outside the policy's ``protected`` classes, for recovery too. An
operator who protected a class during an incident (``laminarctl policy set`` with
``protected = ["long-resident", "transient"]``, to stop Airlock from touching those jobs) left
every job of that class that Airlock had already frozen frozen for good: never thawed when the
pressure ended, never escalated, shown as ``suspended`` and, on v1, holding its memory. Real
cgroups and processes; the ladder's decisions at calm are applied through ``Airlock._apply``
(the calm signals themselves are not produced here: the machine is shared).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from jobrig import airlock_rig, running, until

from laminar.policy import ladder

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]


def test_a_job_suspended_before_its_class_was_protected_is_thawed_when_calm(tmp_path: Path) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _):
            job = await running(jobs, "lm-t-prot")
            sig = al.signals(0.0)
            al._apply(ladder.Action(ladder.SUSPEND, job.id, "test: high"), 0.0, ladder.HIGH, sig)
            # Airlock asks for the freeze without waiting; the kernel reports it a moment later
            assert await until(job.cgroup.frozen, 10), "the suspended job did not freeze within 10 s"
            assert jobs.get(job.id).state == "suspended"  # type: ignore[union-attr]
            al.set_policy({"protected": ["long-resident", "transient"]})
            assert al.policy is not None
            # calm: no pressure for longer than hold_s, usage below recover_below
            now = time.monotonic()
            al.memo.last_pressure = now - 60
            al.memo.last_recover = now - 60
            actions = ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1)
            for a in actions:
                al._apply(a, now, ladder.NONE, sig)
            assert [(a.kind, a.job_id) for a in actions] == [(ladder.RECOVER, job.id)], actions
            assert await until(lambda: not job.cgroup.frozen(), 10), "the recovered job stayed frozen 10 s"
            assert jobs.get(job.id).state == "running"  # type: ignore[union-attr]
            assert job.id not in al.rungs

    asyncio.run(main())


def test_a_protected_job_is_still_never_suspended_or_reclaimed() -> None:
    """The fix thaws protected jobs; it must not make the ladder act on them otherwise."""
    pol = {**ladder_policy(), "protected": ["transient"]}
    memo = ladder.Memo()
    running = ladder.JobView("p", "transient", 0, 0.0, 1 << 30, None, None, 0)
    assert ladder.decide(100.0, ladder.CRITICAL, [running], pol, memo, 0.99) == []
    held = ladder.JobView("p", "transient", 0, 0.0, 1 << 30, ladder.SUSPEND, 0.0, 0)
    acts = ladder.decide(100.0, ladder.CRITICAL, [held], pol, ladder.Memo(), 0.99)
    assert all(a.kind not in (ladder.KILL, ladder.READDRESS, ladder.SUSPEND) for a in acts), acts


def ladder_policy() -> dict[str, object]:
    from laminar.airlock.policy import validate

    return validate({})
