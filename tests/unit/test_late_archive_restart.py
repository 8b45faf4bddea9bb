"""A reclaimed job with no keeper and no keeper whose copy to a hung archive goes on past its
window's wait (Keepers.hold, phase ``archiving``) has its checkpoint only in its ckpt
directory on this node until the copy lands. An agent stop or crash while the copy waits used
to end it for good. Now the copy is recorded (``migrate_late_copies``) before it starts, and
its "about to publish" mark is committed right before its record is renamed into place, so the
restarted agent takes it up (:meth:`StoppedCopies.restore_late_copies`): published when its
record never was, never published twice when it was (a published record may have been claimed,
run to its end and removed elsewhere: publishing it again would run the job twice).

A real component and a real store (the restart opens the same database file anew), a real
archive in a temporary directory and a real jobkit checkpoint; the keeper ranking, the job
manager and the hung storage are stand-ins (as in test_hold_archive_first.py). The crashed
agent is one whose archive thread never comes back: it blocks in the storage (or right before
or after the record's rename) until the test ends; nothing of it runs after the "crash".
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from archiverig import zone_of
from standin_agent import standin_agent
from test_hold_archive_first import hang_copies, holding_node

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate import archive_stopped as archive_mod
from laminar.migrate.mover import Move
from laminar.migrate.reclaim import ReclaimComponent
from laminar.policy.endcause import EndCause
from laminar.store import Store


class Crash(BaseException):
    """The crashed agent's archive thread, let go at the test's end: it publishes nothing more."""


@pytest.fixture
def dead() -> Any:
    ev = threading.Event()
    yield ev
    ev.set()  # the "crashed" agent's lane thread ends (raising Crash)


def rows(tmp: Path) -> list[dict[str, Any]]:
    db = sqlite3.connect(str(tmp / "state" / "state.db"))
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute("SELECT key, job_id, late, publishing FROM migrate_late_copies")]
    finally:
        db.close()


def crash_during_late_copy(tmp: Path, arch: Path, dead: threading.Event, where: str) -> Path:
    """Node 1 reclaimed with no keeper and no keeper, its archive hung past the window's wait:
    job-1 stops (``reclaimed``) and its copy goes on, until the agent "crashes" with the copy
    ``where``: "storage" (waiting on the storage before any byte), "before-rename" (its mark
    committed, the record not renamed) or "after-rename" (the record in place, the loop never
    told). The job's checkpoint."""
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, seen = holding_node(tmp, arch, keepers=False)
    storage = threading.Event()
    real_rename = archive_mod.os.rename

    def crash() -> None:
        if where == "storage":
            dead.wait()
            raise Crash

    reached = threading.Event()

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        if Path(dst).name != "guard.json" or threading.current_thread().name != "laminar-archive":
            return real_rename(src, dst, **kw)
        if where == "after-rename":
            real_rename(src, dst, **kw)
        reached.set()
        dead.wait()
        raise Crash

    hang_copies(c, storage, answer=crash)
    mp = pytest.MonkeyPatch()
    mp.setattr(archive_mod.os, "rename", rename)

    async def main() -> None:
        job = SimpleNamespace(id="job-1")
        mv = Move(job="job-1", key="n1-job-1", reason="owner", ckpt=ckpt.name)
        c.moves["job-1"] = mv
        await c.keepers.hold(job, mv, ckpt, 1 << 20, None, "no room", asyncio.get_running_loop().time() + 1.5)
        assert mv.phase == "archiving" and seen[:2] == ["stopped job-1", "(move archiving)"], (mv, seen)
        storage.set()
        if where != "storage":
            assert await asyncio.to_thread(reached.wait, 30)

    try:
        asyncio.run(main())
    finally:
        mp.undo()  # the crashed thread, if let go, raises before its own rename
        c.agent.store.close()
    return ckpt


def restart(tmp: Path, arch: Path, state: str = "reclaimed", left_out: list[set[str]] | None = None,
            cause: EndCause | None = EndCause.ARCHIVED) -> tuple[ReclaimComponent, list[tuple[str, str]]]:
    """The agent restarted on the same state directory, job-1 ``state`` there: the migrate
    component's late-copy restore, run to its end. Its events (phase, message; a stop of the
    job is one too, "stopped"). ``left_out``: gets the jobs the restored reclaim must not move,
    as the restore left them for it. ``cause``: job-1's end cause (for an ended job)."""
    events: list[tuple[str, str]] = []
    store = Store(tmp / "state" / "state.db")
    c = ReclaimComponent()
    job = SimpleNamespace(id="job-1", state=state, cgroup=SimpleNamespace(thaw=lambda timeout: True),
                          end_cause=None if state in ("running", "suspended") else cause)

    async def stop(jid: str, why: str, state: str = "", **kw: Any) -> None:
        events.append(("stopped", f"{jid} {state}: {why}"))
        job.state, job.end_cause = state, kw.get("cause")

    c.agent = standin_agent(MigrateAgent,
        zone=zone_of(1), store=store,
        jobs=SimpleNamespace(get=lambda jid: job if jid == "job-1" else None, stop=stop),
        events=SimpleNamespace(emit=lambda kind, message, **f: events.append((str(f.get("phase")), message))))
    c.s = {"archive_dir": str(arch)}

    async def main() -> None:
        try:
            c.archive.stopped.restore_late_copies()
            if left_out is not None:
                left_out.append(set(c.archive.stopped.late_stopping))
            while c._tasks:
                await asyncio.gather(*list(c._tasks))
        finally:
            c.archive.lane.close()
            store.close()

    asyncio.run(main())
    return c, events


def hold_in_time(tmp: Path, arch: Path, stop: Any) -> Move:
    """Node 1's _hold of job-1 (no keeper, no keeper) whose archive answers in time; ``stop``:
    the job manager's stop. The move."""
    ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp / "ck", install_signal=False, keep=2).save(b"w", step=7)
    c, _ = holding_node(tmp, arch, keepers=False)
    c.agent.jobs.stop = stop
    mv = Move(job="job-1", key="n1-job-1", reason="owner", ckpt=ckpt.name)
    c.moves["job-1"] = mv

    async def main() -> None:
        try:
            await c.keepers.hold(SimpleNamespace(id="job-1"), mv, ckpt, 1 << 20, None, "no room",
                          asyncio.get_running_loop().time() + 30)
        finally:
            c.archive.lane.close()
            c.agent.store.close()

    asyncio.run(main())
    return mv


def keeper_record(arch: Path) -> dict[str, Any]:
    return dict(json.loads((arch / "n1-job-1" / "guard.json").read_text())["body"])


def test_a_restart_while_the_storage_hangs_takes_the_copy_up_and_publishes_it(tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "storage")
    assert rows(tmp_path) == [{"key": "n1-job-1", "job_id": "job-1", "late": 1, "publishing": 0}]
    assert not (arch / "n1-job-1" / "guard.json").exists()
    c, events = restart(tmp_path, arch)
    assert keeper_record(arch)["ckpt"] == "ckpt-7"  # claimable by any agent with room
    assert (arch / "n1-job-1" / "ckpt-7").is_dir()
    assert c.moves["job-1"].phase == "archived" and c.counts["archived"] == 1
    assert [p for p, _ in events] == ["archiving", "archived-late"]
    assert rows(tmp_path) == []


def test_a_crash_between_the_mark_and_the_rename_publishes_the_record_after_the_restart(
        tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "before-rename")
    assert rows(tmp_path)[0]["publishing"] == 1  # the mark was committed before the rename
    assert not (arch / "n1-job-1" / "guard.json").exists()
    assert list((arch / "n1-job-1").glob(".guard-1-*.tmp"))  # the record that was never renamed
    c, events = restart(tmp_path, arch)
    assert keeper_record(arch)["ckpt"] == "ckpt-7"
    assert c.moves["job-1"].phase == "archived"
    assert rows(tmp_path) == []


def test_a_record_published_before_the_crash_is_not_published_again(tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "after-rename")
    before = keeper_record(arch)
    c, events = restart(tmp_path, arch)
    assert keeper_record(arch) == before  # the same record, not written again
    assert c.moves["job-1"].phase == "archived"
    assert rows(tmp_path) == []


def test_a_record_published_claimed_and_gone_before_the_restart_is_never_published_again(
        tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    ckpt = crash_during_late_copy(tmp_path, arch, dead, "after-rename")
    # meanwhile another agent claimed it, ran the job to its end and the sweep removed the directory
    for f in (arch / "n1-job-1").rglob("*"):
        if f.is_file():
            f.unlink()
    for d in sorted((arch / "n1-job-1").rglob("*"), reverse=True):
        d.rmdir()
    c, events = restart(tmp_path, arch)
    assert not (arch / "n1-job-1" / "guard.json").exists()  # the job would run twice
    assert events[-1][0] == "archived" and "not published again" in events[-1][1], events
    assert ckpt.is_dir()  # the job's own copy stays
    assert rows(tmp_path) == []


def test_a_job_that_is_not_reclaimed_after_the_restart_is_left_to_the_restored_reclaim(
        tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "storage")
    c, events = restart(tmp_path, arch, state="running")
    assert not (arch / "n1-job-1" / "guard.json").exists() and "job-1" not in c.moves
    assert events == [] and rows(tmp_path) == []


@pytest.mark.parametrize("cause", [EndCause.HANDED_OVER, EndCause.HELD_ELSEWHERE, EndCause.UNKNOWN])
def test_a_job_reclaimed_into_another_nodes_keeping_is_not_published_after_the_restart(
        tmp_path: Path, dead: Any, cause: EndCause) -> None:
    """A job ``reclaimed`` here whose end says another node runs it or resumes it (its hand-over
    was sent, a keeper keeps its checkpoint) or does not say: the late copy is not taken up,
    read from the end cause, not from the state (a published copy would run the job twice)."""
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "storage")
    c, events = restart(tmp_path, arch, cause=cause)
    assert not (arch / "n1-job-1" / "guard.json").exists() and "job-1" not in c.moves
    assert events == [] and rows(tmp_path) == []


def test_a_copy_cut_after_the_window_ended_is_taken_up(tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "storage")
    c, events = restart(tmp_path, arch, cause=EndCause.WINDOW_ENDED)
    assert keeper_record(arch)["ckpt"] == "ckpt-7" and c.moves["job-1"].phase == "archived"


def test_a_job_still_running_whose_record_was_published_is_stopped_not_moved_again(tmp_path: Path, dead: Any) -> None:
    """The agent stopped between the record's publish and the job's stop (the job was frozen;
    the restart's restore would thaw it and move it again): the archive is its way back, so it
    is stopped here and left out of the restored reclaim's moves."""
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "after-rename")
    before = keeper_record(arch)
    left_out: list[set[str]] = []
    c, events = restart(tmp_path, arch, state="running", left_out=left_out)
    assert left_out == [{"job-1"}] and c.archive.stopped.late_stopping == set()
    assert [p for p, _ in events] == ["stopped", "archiving", "archived-late"], events
    assert events[0][1].startswith("job-1 reclaimed:")
    assert keeper_record(arch) == before and c.moves["job-1"].phase == "archived"
    assert rows(tmp_path) == []


def test_a_published_record_of_a_job_the_user_stopped_meanwhile_is_said(tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    crash_during_late_copy(tmp_path, arch, dead, "after-rename")
    c, events = restart(tmp_path, arch, state="stopped")
    assert [p for p, _ in events] == ["archive-uncertain"] and "another agent may resume it" in events[0][1]
    assert rows(tmp_path) == []


def test_a_checkpoint_gone_from_this_node_fails_the_move_and_publishes_nothing(tmp_path: Path, dead: Any) -> None:
    arch = tmp_path / "arch"
    ckpt = crash_during_late_copy(tmp_path, arch, dead, "storage")
    for f in ckpt.iterdir():
        f.unlink()
    ckpt.rmdir()
    c, events = restart(tmp_path, arch)
    mv = c.moves["job-1"]
    assert mv.phase == "failed" and "ckpt-7" in mv.error, mv
    assert not (arch / "n1-job-1" / "guard.json").exists()
    assert rows(tmp_path) == []


def test_a_copy_in_time_is_recorded_as_publishing_until_its_job_is_stopped(tmp_path: Path) -> None:
    """A crash between the copy's publish and the job's stop leaves a row the restart reads (the
    record may be claimed while the job is here too: said); after the stop the row is gone."""
    from test_hold_archive_first import late_copies

    arch = tmp_path / "arch"
    at_stop: list[list[dict[str, Any]]] = []

    async def stop(jid: str, why: str, **kw: Any) -> None:
        at_stop.append(rows(tmp_path))

    assert hold_in_time(tmp_path, arch, stop).phase == "archived"
    assert at_stop == [[{"key": "n1-job-1", "job_id": "job-1", "late": 0, "publishing": 1}]]
    assert late_copies(tmp_path) == 0
    assert keeper_record(arch)["ckpt"] == "ckpt-7"


def test_a_crash_right_after_a_copy_in_time_stopped_its_job_publishes_nothing_again(tmp_path: Path) -> None:
    arch = tmp_path / "arch"

    async def stop(jid: str, why: str, **kw: Any) -> None:
        raise Crash  # the job stopped, then the agent died before it dropped the row

    with pytest.raises(Crash):
        hold_in_time(tmp_path, arch, stop)
    before = keeper_record(arch)
    c2, events = restart(tmp_path, arch)
    assert keeper_record(arch) == before and c2.moves["job-1"].phase == "archived"
    assert rows(tmp_path) == []
