"""Holds (laminar/runtime/holds.py): a job is frozen while any hold remains and thawed when the
last one is released; a release of a reason not held does nothing and is counted; the holds
survive a restart (the real store), but a job that ended holds nothing.

A real SQLite store. Stand-ins, named as such: the job manager (``Jobs``) and the jobs' cgroups
(``Cgroup``: records what is asked of the freezer, and says frozen as the last ask did). The
real freezer with a real agent: tests/kernel/test_holds_agent.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from laminar.runtime.holds import HOLDS_META, Hold, Holds, holds_of
from laminar.store import Store


class Cgroup:  # stand-in: records freeze and thaw asks
    def __init__(self) -> None:
        self.calls: list[str] = []

    def freeze(self, timeout: float | None = None) -> bool:
        self.calls.append("freeze")
        return True

    def thaw(self, timeout: float | None = None) -> bool:
        self.calls.append("thaw")
        return True

    def frozen(self) -> bool:
        return self.freeze_requested()

    def freeze_requested(self) -> bool:
        return bool(self.calls) and self.calls[-1] == "freeze"


class Jobs:  # stand-in job manager
    def __init__(self, *ids: str) -> None:
        self.jobs = {i: SimpleNamespace(id=i, active=True, cgroup=Cgroup()) for i in ids}

    def get(self, job_id: str) -> Any:
        return self.jobs.get(job_id)


def test_two_holders_the_job_thaws_only_when_both_released() -> None:
    jobs = Jobs("job-1")
    h = Holds(jobs)
    cg = jobs.get("job-1").cgroup
    h.hold("job-1", Hold.AIRLOCK)
    h.hold("job-1", Hold.MOVE)
    assert cg.calls == ["freeze"]  # the second hold finds it frozen: nothing more is asked
    assert h.reasons("job-1") == ["airlock", "move"]
    assert h.release("job-1", Hold.AIRLOCK) is False  # the move still holds it
    assert cg.calls == ["freeze"] and cg.frozen()
    assert h.others("job-1", Hold.AIRLOCK) == ["move"]
    assert h.release("job-1", Hold.MOVE) is True
    assert cg.calls == ["freeze", "thaw"] and not cg.frozen()
    assert h.reasons("job-1") == [] and not h.held("job-1")


def test_the_waiting_forms_thaw_only_at_the_last_release() -> None:
    jobs = Jobs("job-1")
    h = Holds(jobs)
    cg = jobs.get("job-1").cgroup

    async def main() -> None:
        assert await h.hold_wait("job-1", Hold.MOVE, 0.5) is True
        h.hold("job-1", Hold.FENCE)
        assert await h.release_wait("job-1", Hold.MOVE, 0.5) is False
        assert cg.frozen() and h.held_by(Hold.FENCE) == {"job-1"}
        assert await h.release_wait("job-1", Hold.FENCE, 0.5) is True
        assert not cg.frozen()

    asyncio.run(main())


def test_a_release_of_a_reason_not_held_is_a_counted_no_op() -> None:
    jobs = Jobs("job-1")
    h = Holds(jobs)
    cg = jobs.get("job-1").cgroup
    h.hold("job-1", Hold.FENCE)
    assert h.release("job-1", Hold.AIRLOCK) is False
    assert h.release("job-2", Hold.MOVE) is False  # (a job never held)
    assert h.counts["release_not_held"] == 2
    assert cg.calls == ["freeze"] and h.reasons("job-1") == ["fence"]


def test_a_hold_asks_for_the_freeze_again_when_a_stop_thawed_the_job_under_it() -> None:
    jobs = Jobs("job-1")
    h = Holds(jobs)
    cg = jobs.get("job-1").cgroup
    h.hold("job-1", Hold.FENCE)
    cg.thaw()  # (thawed by someone else)
    h.hold("job-1", Hold.FENCE)
    assert cg.calls == ["freeze", "thaw", "freeze"]


def test_drop_and_reattach_leave_the_kernel_alone() -> None:
    jobs = Jobs("job-1")
    h = Holds(jobs)
    cg = jobs.get("job-1").cgroup
    h.reattach("job-1", Hold.AIRLOCK)
    assert h.held("job-1", Hold.AIRLOCK) and cg.calls == []
    assert h.drop("job-1", Hold.AIRLOCK) is True and h.drop("job-1", Hold.AIRLOCK) is False
    assert cg.calls == []


def test_holds_survive_a_restart_but_not_the_end_of_their_job(tmp_path: Path) -> None:
    store = Store(tmp_path / "laminar.db")
    try:
        jobs = Jobs("job-1", "job-2")
        h = Holds(jobs, store)
        h.hold("job-1", Hold.AIRLOCK)
        h.hold("job-1", Hold.MOVE)
        h.hold("job-2", Hold.FENCE)
        jobs.jobs["job-2"].active = False  # it ends while the agent is down
        again = Holds(Jobs("job-1", "job-2"), store)  # (its job manager reattached both)
        again.jobs.jobs["job-2"].active = False
        again.load()
        assert again.reasons("job-1") == ["airlock", "move"]
        assert again.reasons("job-2") == []
        assert set(store.get_meta(HOLDS_META)) == {"job-1"}
        assert again.release("job-1", Hold.MOVE) is False  # Airlock's still holds it
        assert again.release("job-1", Hold.AIRLOCK) is True
        assert store.get_meta(HOLDS_META) == {}
    finally:
        store.close()


def test_an_upgrade_takes_the_fenced_jobs_the_previous_version_kept_as_fence_holds(tmp_path: Path) -> None:
    store = Store(tmp_path / "laminar.db")
    try:
        store.set_meta("migrate.fenced", {"job-1": 1000.0})
        h = Holds(Jobs("job-1"), store)
        h.load()
        assert h.reasons("job-1") == ["fence"]
    finally:
        store.close()


def test_a_stand_in_job_manager_gets_one_shared_set() -> None:
    jobs = Jobs("job-1")
    assert holds_of(jobs) is holds_of(jobs)
