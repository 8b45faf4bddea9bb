"""A reclaim with no room anywhere sends the job's final checkpoint to a holder and, with
``archive_dir``, archives it beside the holder (ReclaimComponent._hold). The holder is handed the
guard with ``take_over`` only once the archive holds the job's record: its take-over then finds the
record and claims it (the archive's claim is the lock: one node runs the job). Handed first, the
holder's take-over could place the job from its replica while the archive held nothing of it, and
the record published after would be claimed by any agent with room: the job twice. When the
archive cannot take the copy, the holder still gets the guard (it alone keeps the job).

A real component, not started, with a real store, a real archive in a temporary directory and a
real jobkit checkpoint; what crosses the network (the holder's ranking, the transfer, the guard
message) and the job manager's stop are stand-ins that record what they were given.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import Move, ReclaimComponent
from laminar.migrate.schema import MOVES_SCHEMA, RECLAIM_SCHEMA, REPLICAS_SCHEMA
from laminar.store import Store


def holding_node(tmp: Path, archive: Path) -> tuple[ReclaimComponent, list[str]]:
    seen: list[str] = []  # what happened, in order
    c = ReclaimComponent()
    (tmp / "state").mkdir()
    store = Store(tmp / "state" / "state.db")
    with store.tx() as db:
        for stmt in REPLICAS_SCHEMA + RECLAIM_SCHEMA + MOVES_SCHEMA:
            db.execute(stmt)

    async def stop(jid: str, why: str, **kw: Any) -> None:
        seen.append(f"stopped {jid}")

    c.agent = SimpleNamespace(zone=SimpleNamespace(node_id=1, networked=False), store=store,
                              jobs=SimpleNamespace(stop=stop), events=SimpleNamespace(emit=lambda *a, **k: None))
    c.s = {"archive_dir": str(archive)}

    async def rank_holders(key: str, size: int, window: Any, prefer: Any) -> list[Any]:
        return [SimpleNamespace(feasible=True, candidate=SimpleNamespace(node=2), reasons=[])]

    async def send(job: Any, ckpt: Path, node: int, deadline: Any, mv: Any, **kw: Any) -> None:
        seen.append(f"sent {ckpt.name} to {node}")

    async def guard(job: Any, node: int, ckpt: str, take_over: bool = False) -> None:
        rec = archive / f"n1-{job.id}" / "guard.json"
        seen.append(f"guard to {node} take_over={take_over} archived={rec.exists()}")

    c.rank_holders = rank_holders  # type: ignore[method-assign]
    c._send = send  # type: ignore[method-assign]
    c._guard = guard  # type: ignore[method-assign]
    c._request = lambda job, take_over: {"spec": {}, "take_over": take_over}  # type: ignore[method-assign]
    return c, seen


def hold(c: ReclaimComponent, ckpt: Path) -> Move:
    job = SimpleNamespace(id="job-1")
    mv = Move(job="job-1", key="n1-job-1", reason="owner")

    async def main() -> None:
        try:
            await c._hold(job, mv, ckpt, 1 << 20, None, "no room", time.monotonic() + 30.0)
        finally:
            c._lane.close()
            c.agent.store.close()

    asyncio.run(main())
    return mv


def test_the_holder_takes_the_guard_once_the_archive_holds_the_record(tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp_path, tmp_path / "arch")
    mv = hold(c, ckpt)
    assert mv.phase == "held" and mv.dest == 2
    assert seen == ["sent ckpt-7 to 2", "stopped job-1", "guard to 2 take_over=True archived=True"]
    assert (tmp_path / "arch" / "n1-job-1" / "guard.json").exists()
    assert c.buddy["job-1"] == 2


def test_an_archive_that_refuses_the_copy_still_leaves_the_holder_the_guard(tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    (tmp_path / "not-a-dir").write_text("")  # the archive's path is a file: every copy fails
    c, seen = holding_node(tmp_path, tmp_path / "not-a-dir" / "arch")
    mv = hold(c, ckpt)
    assert mv.phase == "held" and mv.dest == 2
    assert seen == ["sent ckpt-7 to 2", "stopped job-1", "guard to 2 take_over=True archived=False"]
    assert c.buddy["job-1"] == 2
