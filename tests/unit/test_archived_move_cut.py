"""A reclaim's move with no destination and no keeper puts the job's final checkpoint in the
archive (``_hold``), where any agent with room claims it. Cut (a shorter window replacing the
reclaim's plan, the agent stopping) it must not leave two copies of the job:

- cut while the copy still waits on a hung archive: the copy is given up (published neither
  then nor when the storage answers) and the job is thawed (the new plan moves it again);
- cut once the copy is archived, while the job is being stopped: the job stays frozen, never
  thawed, and the new plan stops it here instead of moving it again (the archive resumes it);
  so for a job whose late copy goes on (``archiving``).

A real component, not started, with a real store, a real archive in a temporary directory and
a real jobkit checkpoint; the ranking, the keepers' answers and the job manager's stop are
stand-ins that record what they were given; the job's cgroup too (a recorder of freeze and
thaw); the hung storage is a copy that waits on an event before it touches the archive.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from archiverig import request, zone_of
from standin_agent import standin_agent
from test_hold_archive_first import hang_copies, late_copies, migrate_store
from test_move_done_before_stop import Cgroup

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent


def homeless(tmp: Path, stop_blocks: bool) -> tuple[ReclaimComponent, Any, list[str], asyncio.Event]:
    """Node 1, reclaimed, with job-1 and no destination, no keeper and no keeper for it."""
    seen: list[str] = []
    stopping = asyncio.Event()
    c = ReclaimComponent()
    store = migrate_store(tmp)

    async def stop(jid: str, why: str, **kw: Any) -> None:
        seen.append(f"stop {jid} state={kw.get('state')} move={c.moves[jid].phase}")
        stopping.set()
        if stop_blocks and len(seen) == 1:
            await asyncio.Event().wait()  # cut while stopping

    c.agent = standin_agent(MigrateAgent, zone=zone_of(1, networked=True), store=store,
                              jobs=SimpleNamespace(stop=stop), events=SimpleNamespace(emit=lambda kind, message, **f: None))
    c.s = {"ckpt_wait_s": 0.0, "keeper": True, "archive_dir": str(tmp / "arch")}
    ckpt_dir = tmp / "ck"
    Checkpointer(job_id="job-1", ckpt_dir=ckpt_dir, install_signal=False, keep=2).save(b"w", step=7)
    job = SimpleNamespace(id="job-1", ckpt_dir=ckpt_dir, active=True, cgroup=Cgroup(), owner_uid=0, owner_gid=0,
                          spec=SimpleNamespace(as_dict=lambda: {"command": ["true"], "env": {}}))

    async def rank_keepers(key: str, size: int, window: Any, prefer: Any) -> list[Any]:
        return []

    c.mover.rank_for = lambda job, size, window, prestaged: []  # type: ignore[method-assign]
    c.keepers.rank = rank_keepers  # type: ignore[method-assign]
    c.mover.request = lambda job, take_over: {**request(), "take_over": take_over}  # type: ignore[method-assign]
    return c, job, seen, stopping


async def new_plan(c: ReclaimComponent, job: Any, window_s: float = 0.5) -> None:
    """A shorter window's plan evacuating ``job`` (``_execute``), ``window_s`` left."""
    c.reclaim = {"planned_mono": time.monotonic(), "deadline_mono": time.monotonic() + window_s,
                 "cancel": asyncio.Event()}
    c.agent.jobs.active = lambda: []
    await c.evacuation._execute([job], {})


def test_a_move_cut_while_its_copy_waits_on_a_hung_archive_gives_the_copy_up_and_thaws_the_job(
        tmp_path: Path) -> None:
    c, job, seen, _ = homeless(tmp_path, stop_blocks=False)
    storage, copying = threading.Event(), threading.Event()
    hang_copies(c, storage, copying)

    async def main() -> None:
        task = asyncio.ensure_future(c.mover.move(job, "a test", time.monotonic() + 30, final=False))
        try:
            assert await asyncio.to_thread(copying.wait, 10)
            task.cancel()  # a shorter window replaces the plan (or the agent stops)
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
            storage.set()  # the storage answers
            await c.archive.lane.call("the test's end", lambda: None)  # behind the copy
        finally:
            c.archive.lane.close()

    asyncio.run(main())
    assert seen == []  # never stopped here
    assert job.cgroup.calls == ["freeze", "thaw"]  # thawed: the new plan moves it again
    assert not list((tmp_path / "arch").glob("*/*.json"))  # nothing claimable: it would run twice
    assert late_copies(tmp_path) == 0
    c.agent.store.close()


def test_a_move_cut_after_the_archive_has_the_job_leaves_it_frozen_and_a_new_plan_stops_it(tmp_path: Path) -> None:
    c, job, seen, stopping = homeless(tmp_path, stop_blocks=True)

    async def main() -> None:
        task = asyncio.ensure_future(c.mover.move(job, "a test", time.monotonic() + 30, final=False))
        try:
            await asyncio.wait_for(stopping.wait(), 10)
            task.cancel()  # a shorter window replaces the plan while the job is being stopped
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
            assert job.cgroup.calls == ["freeze"]  # not thawed: the archive's record is claimable
            await new_plan(c, job)  # its evacuation: the job is stopped here, not moved again
        finally:
            c.archive.lane.close()

    asyncio.run(main())
    assert seen == ["stop job-1 state=reclaimed move=hold", "stop job-1 state=reclaimed move=hold"]
    assert job.cgroup.calls == ["freeze", "thaw"]  # thawed by the stop (a frozen job takes no signal)
    assert (tmp_path / "arch" / "n1-job-1" / "guard.json").exists()
    c.agent.store.close()


def test_a_move_cut_while_it_stops_a_job_whose_late_copy_goes_on_leaves_it_frozen_and_a_new_plan_stops_it(
        tmp_path: Path) -> None:
    c, job, seen, stopping = homeless(tmp_path, stop_blocks=True)
    storage = threading.Event()
    hang_copies(c, storage)

    async def main() -> None:
        task = asyncio.ensure_future(c.mover.move(job, "a test", time.monotonic() + 1.5, final=False))
        try:
            await asyncio.wait_for(stopping.wait(), 10)  # past the window's wait: the job stops, its copy goes on
            assert c.moves["job-1"].phase == "archiving"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert job.cgroup.calls == ["freeze"]  # not thawed: its copy will be claimable
            await new_plan(c, job)
            storage.set()  # the storage answers: the copy lands
            await c.archive.lane.call("the test's end", lambda: None)
            await asyncio.sleep(0)
        finally:
            c.archive.lane.close()

    asyncio.run(main())
    assert seen == ["stop job-1 state=reclaimed move=archiving", "stop job-1 state=reclaimed move=archiving"]
    assert (tmp_path / "arch" / "n1-job-1" / "guard.json").exists()  # published: the job's way back
    assert c.moves["job-1"].phase == "archived"
    c.agent.store.close()


def test_a_plan_cut_while_its_moves_unwind_leaves_no_unread_error(tmp_path: Path) -> None:
    """A shorter window (or the agent's stop) cuts the plan while its move is being stopped: the
    plan's gather ends with a CancelledError nobody awaited, which asyncio logged as
    "_GatheringFuture exception was never retrieved" (seen in a CI log)."""
    c, job, _, stopping = homeless(tmp_path, stop_blocks=True)
    c.agent.jobs.request_checkpoint = lambda job: True  # (asked; ckpt_wait_s 0: it moves from the one it has)
    unread: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unread.append(ctx["message"]))
        try:
            plan = asyncio.ensure_future(new_plan(c, job, 30.0))
            await asyncio.wait_for(stopping.wait(), 10)
            plan.cancel()
            await asyncio.gather(plan, return_exceptions=True)
            for _ in range(5):
                await asyncio.sleep(0)
            gc.collect()
        finally:
            c.archive.lane.close()

    asyncio.run(main())
    assert unread == []
    c.agent.store.close()
