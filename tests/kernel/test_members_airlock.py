"""Airlock and a member of a multi-node job (issue 33), on real cgroups and processes.

A local job that is a member (the members component says so: ``standin_agent.StandInMembers``,
a stand-in until laminar/members/ lands) is valued for its whole job, and what Airlock does to it
(suspend, recover, kill) is told to the members component, which reaches the job's other members
through its origin. A member frozen by the origin's order is the job manager's ``members`` hold
(runtime/holds.py), which Airlock's recovery never releases. A job of this node alone is handled
as before, and nothing is told of it.

The ladder's decisions are taken at explicit levels from Airlock's own view and applied through
``Airlock._apply``, as tests/kernel/test_holds_freeze.py does (real pressure cannot be produced on
demand on a shared machine).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from jobrig import airlock_rig, running, until
from standin_agent import StandInMember, StandInMembers

from laminar.policy import ladder

pytestmark = pytest.mark.kernel


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def act(al: Any, kind: str, job_id: str, level: int = ladder.HIGH) -> None:
    now = time.monotonic()
    al._apply(ladder.Action(kind, job_id, f"test: {kind}"), now, level, al.signals(now))


def calm(al: Any, t0: float) -> list[ladder.Action]:
    """The pressure has ended for hold_s: Airlock decides on what it sees and acts."""
    al.memo.last_pressure = t0
    now = t0 + al.policy["hysteresis"]["hold_s"] + 0.1
    got = ladder.decide(now, ladder.NONE, al.views(now), al.policy.doc, al.memo, 0.1)
    for a in got:
        al._apply(a, now, ladder.NONE, al.signals(now))
    return got


async def recovered(al: Any, job_id: str) -> None:
    """Calm until Airlock has recovered ``job_id`` (one recovery per ``hysteresis.step_s``)."""
    for _ in range(50):
        calm(al, time.monotonic())
        if job_id not in al.rungs:
            return
        await asyncio.sleep(al.policy["hysteresis"]["step_s"])
    raise AssertionError(f"Airlock did not recover {job_id}")


def test_a_members_suspend_recover_and_kill_are_told_to_the_members_component(tmp_path: Path) -> None:
    async def main() -> None:
        members = StandInMembers()
        async with airlock_rig(tmp_path, members) as (jobs, al, _store):
            local = await running(jobs, "lm-t-mem-local")
            member = await running(jobs, "lm-t-mem-member")
            members.hosted[member.id] = StandInMember(member.id, index=1, count=4)
            views = {v.id: v for v in al.views(time.monotonic())}
            assert views[member.id].members == 4 and views[local.id].members == 1
            act(al, ladder.SUSPEND, local.id)
            act(al, ladder.SUSPEND, member.id)
            assert await until(lambda: local.cgroup.frozen() and member.cgroup.frozen(), 10)
            assert members.airlock == [(member.id, "suspend", None)]  # nothing of the local job
            await recovered(al, local.id)
            await recovered(al, member.id)
            assert await until(lambda: not local.cgroup.frozen() and not member.cgroup.frozen(), 10)
            assert members.airlock == [(member.id, "suspend", None), (member.id, "recover", None)]
            assert jobs.get(member.id).state == "running"
            act(al, ladder.KILL, member.id, ladder.CRITICAL)
            assert await until(lambda: jobs.get(member.id).state == "killed" and not alive(member.pid), 10)
            (job, action, lost), = members.airlock[2:]
            assert (job, action) == (member.id, "kill") and lost is not None and lost >= 0
            assert jobs.get(member.id).work_lost_s == pytest.approx(lost)
            assert jobs.get(local.id).state == "running"

    asyncio.run(main())


def test_a_member_frozen_with_its_job_stays_frozen_through_airlocks_recovery(tmp_path: Path) -> None:
    """The origin's freeze (``freeze_member``) holds of its own: Airlock recovering another job,
    or this one from its own suspend, leaves it frozen; ``thaw_member`` releases only that hold."""
    async def main() -> None:
        members = StandInMembers()
        async with airlock_rig(tmp_path, members) as (jobs, al, _store):
            other = await running(jobs, "lm-t-mem-other")
            member = await running(jobs, "lm-t-mem-frozen")
            members.hosted[member.id] = StandInMember(member.id, index=2, count=3)
            assert jobs.freeze_member(member.id) is True
            assert await until(member.cgroup.frozen, 10)
            assert jobs.holds.reasons(member.id) == ["members"] and jobs.get(member.id).state == "suspended"
            # frozen already by its job: no candidate for a suspension here (it would free nothing)
            assert member.id not in {v.id for v in al.views(time.monotonic())}
            act(al, ladder.SUSPEND, other.id)
            assert await until(other.cgroup.frozen, 10)
            t0 = time.monotonic()
            got = calm(al, t0)
            assert [(a.kind, a.job_id) for a in got] == [(ladder.RECOVER, other.id)]
            assert await until(lambda: not other.cgroup.frozen(), 10)
            await asyncio.sleep(0.2)
            assert member.cgroup.frozen() and jobs.holds.reasons(member.id) == ["members"]
            assert jobs.get(member.id).state == "suspended"
            # Airlock suspends it too (under pressure here), then recovers it: its own hold goes,
            # the job's stays
            act(al, ladder.SUSPEND, member.id)
            assert jobs.holds.reasons(member.id) == ["airlock", "members"]
            await recovered(al, member.id)
            assert member.id not in al.rungs and jobs.holds.reasons(member.id) == ["members"]
            await asyncio.sleep(0.2)
            assert member.cgroup.frozen() and jobs.get(member.id).state == "suspended"
            assert [a for _, a, _ in members.airlock] == ["suspend", "recover"]
            # the origin's thaw: its own hold, the last one: thawed
            assert jobs.thaw_member(member.id) is True
            assert await until(lambda: not member.cgroup.frozen(), 10)
            assert jobs.holds.reasons(member.id) == [] and jobs.get(member.id).state == "running"
            assert alive(member.pid) and alive(other.pid)

    asyncio.run(main())


def test_thaw_member_releases_only_its_own_hold(tmp_path: Path) -> None:
    """A member Airlock suspended and its job froze too: the origin's thaw leaves Airlock's hold
    (the node is still under pressure); Airlock's recovery thaws it."""
    async def main() -> None:
        members = StandInMembers()
        async with airlock_rig(tmp_path, members) as (jobs, al, _store):
            member = await running(jobs, "lm-t-mem-both")
            members.hosted[member.id] = StandInMember(member.id, index=0, count=2, rigid=False)
            act(al, ladder.SUSPEND, member.id)
            assert jobs.freeze_member(member.id) is True
            assert await until(member.cgroup.frozen, 10)
            assert jobs.thaw_member(member.id) is False
            await asyncio.sleep(0.2)
            assert member.cgroup.frozen() and jobs.holds.reasons(member.id) == ["airlock"]
            assert jobs.get(member.id).state == "suspended"
            await recovered(al, member.id)
            assert await until(lambda: not member.cgroup.frozen(), 10)
            assert jobs.get(member.id).state == "running" and jobs.holds.reasons(member.id) == []
            assert jobs.thaw_member("job-404-n9") is False and jobs.freeze_member("job-404-n9") is False

    asyncio.run(main())
