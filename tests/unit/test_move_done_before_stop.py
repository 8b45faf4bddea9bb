"""A move's record says ``done`` before the job is stopped here (state ``migrated``): whoever sees
the job read ``migrated`` (``laminarctl job show --follow``, a test, an operator) sees its move
done, never still at ``handover``. A move cut from then on (the agent stopping, the window's end)
leaves the job frozen, as one cut at ``handover`` does: the destination runs it, and a thawed
copy here would run beside it. The record a restart reads stays ``handover`` (it asks the
destination, which says it runs the job, and stops the copy here).

A real component, not started, with a real store and a real jobkit checkpoint; what crosses the
network (the ranking, the reservation, the transfer, the keeper, the hand-over) and the job
manager's stop are stand-ins that record what they were given; the job's cgroup too (a recorder
of freeze and thaw)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from standin_agent import standin_agent
from test_hold_archive_first import migrate_store

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent


class Cgroup:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def frozen(self) -> bool:
        return False

    def memory_in_use(self) -> int:
        return 0  # the stand-in job holds no memory: a reclaim plans it at the default size

    def freeze(self, timeout: float = 0.0) -> bool:
        self.calls.append("freeze")
        return True

    def thaw(self, timeout: float = 0.0) -> bool:
        self.calls.append("thaw")
        return True


def moving(tmp: Path, stop_blocks: bool) -> tuple[ReclaimComponent, Any, list[str], asyncio.Event]:
    seen: list[str] = []
    stopped = asyncio.Event()
    c = ReclaimComponent()
    store = migrate_store(tmp)

    async def stop(jid: str, why: str, **kw: Any) -> None:
        mv = c.moves[jid]
        seen.append(f"stop {jid} state={kw.get('state')} move={mv.phase}")
        stopped.set()
        if stop_blocks:
            await asyncio.Event().wait()  # cut while stopping

    t = SimpleNamespace(send=lambda node, body: seen.append(f"datagram {type(body).__name__}"))
    zone = SimpleNamespace(node_id=1, networked=True, submitter=SimpleNamespace(t=t))
    c.agent = standin_agent(MigrateAgent, zone=zone, store=store, jobs=SimpleNamespace(stop=stop),
                              events=SimpleNamespace(emit=lambda kind, message, **f: None))
    c.s = {"ckpt_wait_s": 0.0, "keeper": True}
    ckpt_dir = tmp / "ck"
    Checkpointer(job_id="job-1", ckpt_dir=ckpt_dir, install_signal=False, keep=2).save(b"w", step=7)
    job = SimpleNamespace(id="job-1", ckpt_dir=ckpt_dir, active=True, cgroup=Cgroup(), owner_uid=0, owner_gid=0,
                          spec=SimpleNamespace(as_dict=lambda: {"command": ["true"], "env": {}}))

    async def reserve(node: int, demand: Any, hold_s: float) -> int:
        return 41

    async def send(job: Any, ckpt: Path, node: int, deadline: Any, mv: Any, **kw: Any) -> str:
        return f"/remote/{ckpt.name}"

    async def keeper(job: Any, node: int, ckpt: str, take_over: bool = False) -> None:
        seen.append(f"keeper to {node}")

    async def handover(node: int, pid: int, req: Any, **kw: Any) -> str:
        seen.append(f"handover to {node}")
        return "job-9"

    ranked = SimpleNamespace(feasible=True, candidate=SimpleNamespace(node=2), expected_loss_s=1.0, reasons=[])
    c.mover.rank_for = lambda job, size, window, prestaged: [ranked]  # type: ignore[method-assign]
    c._need = lambda job: (None, None)  # type: ignore[method-assign]
    c.mover.reserve = reserve  # type: ignore[method-assign]
    c.mover.send = send  # type: ignore[method-assign]
    c.mover.send_keeper = keeper  # type: ignore[method-assign]
    c.takeover.handover = handover  # type: ignore[method-assign]
    return c, job, seen, stopped


def move_phase_record(c: ReclaimComponent) -> str | None:
    row = c.agent.store.db.execute("SELECT phase FROM migrate_moves WHERE job_id='job-1'").fetchone()
    return None if row is None else str(row["phase"])


def test_the_move_is_done_before_the_job_is_stopped_here(tmp_path: Path) -> None:
    c, job, seen, _ = moving(tmp_path, stop_blocks=False)

    async def main() -> Any:
        try:
            return await c.mover.move(job, "a test", None, final=False)
        finally:
            c.archive.lane.close()

    mv = asyncio.run(main())
    assert seen == ["keeper to 2", "handover to 2", "stop job-1 state=migrated move=done"]
    assert mv.phase == "done" and mv.dest == 2 and mv.dest_job == "job-9" and mv.ended is not None
    assert job.cgroup.calls == ["freeze"]
    assert move_phase_record(c) is None  # nothing left for a restart to settle
    c.agent.store.close()


def test_a_move_cut_while_its_job_is_being_stopped_leaves_it_frozen_for_a_restart_to_settle(tmp_path: Path) -> None:
    c, job, seen, stopped = moving(tmp_path, stop_blocks=True)

    async def main() -> None:
        task = asyncio.ensure_future(c.mover.move(job, "a test", None, final=False))
        try:
            await asyncio.wait_for(stopped.wait(), 10)
            task.cancel()  # the agent stops while the job is being stopped here
            await asyncio.gather(task, return_exceptions=True)
            assert task.cancelled()
        finally:
            c.archive.lane.close()

    asyncio.run(main())
    assert seen[-1] == "stop job-1 state=migrated move=done"
    assert job.cgroup.calls == ["freeze"]  # not thawed: node 2 runs it
    assert c.moves["job-1"].phase == "done"
    # a restart asks node 2 (which says it runs the job) and stops the copy here
    assert move_phase_record(c) == "handover"
    c.agent.store.close()
