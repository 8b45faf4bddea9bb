"""A reclaim with no room anywhere sends the job's final checkpoint to a keeper and, with
``archive_dir``, archives it beside the keeper (Keepers.hold). The keeper is handed the
keeper with ``take_over`` only once the archive holds the job's record: its take-over then finds the
record and claims it (the archive's claim is the lock: one node runs the job). Handed first, the
keeper's take-over could place the job from its replica while the archive held nothing of it, and
the record published after would be claimed by any agent with room: the job twice. When the
archive cannot take the copy, the keeper still gets the keeper (it alone keeps the job).

With no keeper either, the archive is the job's only keeper. When it does not answer within the
window: a job with a keeper thaws (its keeper keeps it; the given-up copy publishes nothing later);
a job with no keeper stops at once, and its copy goes on, published when the storage answers (any
agent with room claims it then): thawed, it would run on beside that copy.

A real component, not started, with a real store, a real archive in a temporary directory and a
real jobkit checkpoint; what crosses the network (the keeper's ranking, the transfer, the keeper
message) and the job manager's stop are stand-ins that record what they were given. The hung
archive is a stand-in too (the real one, a stopped FUSE mount, is tests/kernel/
test_archive_wait_given_up.py): its copy waits on an event before it touches the storage.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from archiverig import request, zone_of
from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate.mover import Move
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.schema import MOVES_SCHEMA, RECLAIM_SCHEMA, REPLICAS_SCHEMA
from laminar.store import Store


def migrate_store(tmp: Path) -> Store:
    """A real store under ``tmp/state`` with the migrate layer's tables."""
    (tmp / "state").mkdir()
    store = Store(tmp / "state" / "state.db")
    with store.tx() as db:
        for stmt in REPLICAS_SCHEMA + RECLAIM_SCHEMA + MOVES_SCHEMA:
            db.execute(stmt)
    return store


def late_copies(tmp: Path) -> int:
    """Late archive copies a restart would take up (``migrate_late_copies``)."""
    db = sqlite3.connect(str(tmp / "state" / "state.db"))
    try:
        return int(db.execute("SELECT COUNT(*) FROM migrate_late_copies").fetchone()[0])
    finally:
        db.close()


def holding_node(tmp: Path, archive: Path, keepers: bool = True) -> tuple[ReclaimComponent, list[str]]:
    seen: list[str] = []  # what happened, in order
    c = ReclaimComponent()
    store = migrate_store(tmp)

    async def stop(jid: str, why: str, **kw: Any) -> None:
        seen.append(f"stopped {jid}")
        mv = c.moves.get(jid)
        if mv is not None and mv.phase == "archiving":
            seen.append("(move archiving)")

    def emit(kind: str, message: str, **fields: Any) -> None:
        if fields.get("phase") in ("archiving", "archived-late", "failed"):
            seen.append(f"event {fields['phase']}")

    c.agent = standin_agent(MigrateAgent, zone=zone_of(1, networked=False), store=store,
                              jobs=SimpleNamespace(stop=stop), events=SimpleNamespace(emit=emit))
    c.s = {"archive_dir": str(archive)}

    async def rank_keepers(key: str, size: int, window: Any, prefer: Any) -> list[Any]:
        return [SimpleNamespace(feasible=keepers, candidate=SimpleNamespace(node=2), reasons=["full"])]

    async def send(job: Any, ckpt: Path, node: int, deadline: Any, mv: Any, **kw: Any) -> None:
        seen.append(f"sent {ckpt.name} to {node}")

    async def keeper(job: Any, node: int, ckpt: str, take_over: bool = False) -> None:
        rec = archive / f"n1-{job.id}" / "guard.json"
        seen.append(f"keeper to {node} take_over={take_over} archived={rec.exists()}")

    c.keepers.rank = rank_keepers  # type: ignore[method-assign]
    c.mover.send = send  # type: ignore[method-assign]
    c.mover.send_keeper = keeper  # type: ignore[method-assign]
    c.mover.request = lambda job, take_over: {**request(), "take_over": take_over}  # type: ignore[method-assign]
    return c, seen


def hang_copies(c: ReclaimComponent, storage: threading.Event, copying: threading.Event | None = None,
                answer: Callable[[], None] | None = None) -> None:
    """A stand-in for hung storage under the archive: ``c``'s copies into it (``StoppedCopies.publish_copy``,
    on its archive thread) wait until ``storage`` is set (``copying`` is set as one begins); then
    ``answer`` runs (it may raise: the storage's error, or the agent's crash) and the real copy
    is made."""
    real = c.archive.stopped.publish_copy

    def hung(*a: Any) -> Path:
        if copying is not None:
            copying.set()
        assert storage.wait(30)
        if answer is not None:
            answer()
        return real(*a)

    c.archive.stopped.publish_copy = hung  # type: ignore[method-assign]


def refuse() -> None:
    raise OSError(28, "No space left on device")


def hold(c: ReclaimComponent, ckpt: Path, window_s: float = 30.0, storage: threading.Event | None = None,
         seen: list[str] | None = None, refuses: bool = False) -> Move:
    """The reclaim's _hold of job-1 with ``window_s`` of its window left; ``storage``: the archive
    answers only once it is set (after _hold returned; then the lane's work is waited for), with
    an error when it ``refuses`` the copy."""
    job = SimpleNamespace(id="job-1")
    mv = Move(job="job-1", key="n1-job-1", reason="owner", ckpt=ckpt.name)  # as _move has set it
    c.moves["job-1"] = mv
    if storage is not None:
        hang_copies(c, storage, answer=refuse if refuses else None)

    async def main() -> None:
        try:
            try:
                await c.keepers.hold(job, mv, ckpt, 1 << 20, None, "no room", time.monotonic() + window_s)
            except Exception as e:
                (seen if seen is not None else []).append(f"raised {type(e).__name__}")
            if storage is not None:
                storage.set()
                await c.archive.lane.call("the test's end", lambda: None)  # behind the late copy
                await asyncio.sleep(0)  # its done callback
        finally:
            c.archive.lane.close()
            c.agent.store.close()

    asyncio.run(main())
    return mv


def test_the_keeper_keeps_before_the_stop_and_takes_over_once_the_archive_holds_the_record(tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp_path, tmp_path / "arch")
    mv = hold(c, ckpt)
    assert mv.phase == "held" and mv.dest == 2
    # kept (as a keeper: it takes over at the window's end) before the job stops: an agent
    # crash after the stop leaves the job its keeper; told to take over once archived
    assert seen == ["sent ckpt-7 to 2", "keeper to 2 take_over=False archived=False", "stopped job-1",
                    "keeper to 2 take_over=True archived=True"]
    assert (tmp_path / "arch" / "n1-job-1" / "guard.json").exists()
    assert c.prestage.keeper["job-1"] == 2


def test_an_archive_that_refuses_the_copy_still_makes_the_storage_keeper_the_jobs_keeper(tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    (tmp_path / "not-a-dir").write_text("")  # the archive's path is a file: every copy fails
    c, seen = holding_node(tmp_path, tmp_path / "not-a-dir" / "arch")
    mv = hold(c, ckpt)
    assert mv.phase == "held" and mv.dest == 2
    assert seen == ["sent ckpt-7 to 2", "keeper to 2 take_over=False archived=False", "stopped job-1",
                    "keeper to 2 take_over=True archived=False"]
    assert c.prestage.keeper["job-1"] == 2


def test_a_storage_keeper_that_does_not_take_the_job_is_passed_over_and_the_job_is_not_stopped_for_it(
        tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp_path, tmp_path / "arch")

    async def silent_keeper(job: Any, node: int, ckpt: str, take_over: bool = False) -> None:
        seen.append(f"keeper to {node} take_over={take_over}: no answer")
        raise TimeoutError("node 2 did not answer")

    c.mover.send_keeper = silent_keeper  # type: ignore[method-assign]
    c.s["archive_dir"] = ""  # no archive: the move fails, and the job runs on here
    c.prestage.keeper["job-1"] = 3  # an older keeper: kept, not released
    mv = hold(c, ckpt, seen=seen)
    assert seen == ["sent ckpt-7 to 2", "keeper to 2 take_over=False: no answer", "raised MigrateError"]
    assert mv.phase != "held" and c.prestage.keeper["job-1"] == 3


def test_no_storage_keeper_no_prestaged_keeper_and_a_hung_archive_the_job_stops_and_its_copy_is_published_late(tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp_path, tmp_path / "arch", keepers=False)
    mv = hold(c, ckpt, window_s=1.5, storage=threading.Event(), seen=seen)
    assert seen == ["stopped job-1", "(move archiving)", "event archiving", "event archived-late"]
    # the move read archiving until the copy landed, archived since
    assert mv.phase == "archived" and mv.dest is None
    assert c.counts["archive_late"] == 1 and c.counts["archived"] == 1
    assert (tmp_path / "arch" / "n1-job-1" / "guard.json").exists()  # claimable by any agent with room
    assert (tmp_path / "arch" / "n1-job-1" / "ckpt-7").is_dir()
    assert late_copies(tmp_path) == 0  # landed: a restart does not take it up (test_late_archive_restart.py)


def test_no_storage_keeper_no_prestaged_keeper_and_a_hung_archive_that_then_refuses_the_copy_the_move_fails_and_says_so(
        tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp_path, tmp_path / "arch", keepers=False)
    mv = hold(c, ckpt, window_s=1.5, storage=threading.Event(), seen=seen, refuses=True)
    assert seen == ["stopped job-1", "(move archiving)", "event archiving", "event failed"]
    assert mv.phase == "failed" and "No space left on device" in mv.error and "ckpt-7" in mv.error, mv
    assert c.counts["archive_late"] == 1 and c.counts["archived"] == 0 and c.counts["failed"] == 1
    assert not (tmp_path / "arch" / "n1-job-1" / "guard.json").exists()
    assert ckpt.is_dir()  # the job's own copy stays
    assert late_copies(tmp_path) == 0


def test_no_storage_keeper_and_a_hung_archive_a_job_with_a_prestaged_keeper_thaws_and_nothing_is_published(tmp_path: Path) -> None:
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp_path, tmp_path / "arch", keepers=False)
    c.prestage.keeper["job-1"] = 3
    hold(c, ckpt, window_s=1.5, storage=threading.Event(), seen=seen)
    assert seen == ["raised MigrateError"]  # the move fails: the job thaws, its keeper keeps it
    assert not list((tmp_path / "arch").glob("*/*.json"))  # the given-up copy published nothing
    assert late_copies(tmp_path) == 0  # its keeper keeps it: nothing for a restart to take up
