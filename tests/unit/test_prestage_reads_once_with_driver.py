"""A prestaged checkpoint is read once on its source, not twice: the checkpoint driver's check of
each new checkpoint (jobkit's, a whole read) and the prestage's manifest build (another whole
read) are one read now. For a job the agent prestages, the driver's check *is* the transfer
manifest's build, and the prestage sends with it; when both look at a new checkpoint at once,
the second awaits the first's. The archive's periodic copy and a move's start take the driver's
answer too, reading nothing (the copy is checked as it is made, the send against the manifest).

What a user relies on and these tests hold: the keeper commits exactly the job's checkpoint; a
checkpoint that rots in place after the driver's check is not sent as it was checked (its
manifest is built again, and the rotten file refused). Real jobkit checkpoints, a real Receiver
over loopback, the agent's own CkptDriver, ``Prestage.ship`` and ``Archive.look``; stand-ins, named as
such: the agent (a namespace with a zone and the job list) and the keeper message (recorded).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from test_move_sends_the_checked_manifest import component, job_at, read_where  # noqa: F401  (fixture)
from xferrig import make_ckpt, rot, with_receiver

from laminar import jobkit
from laminar.migrate import transfer as T
from laminar.migrate.ckpt_driver import CkptDriver
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.spec import JobSpec

KB = 1 << 10


def prestaging(tmp: Path, port: int, job: Any) -> tuple[ReclaimComponent, list[tuple[int, str]]]:
    """A component that prestages ``job`` (``prestage = "always"``) to its keeper, node 7 (the
    Receiver on ``port``), with its checkpoint driver: (it, the keeper messages it sent)."""
    c = component(tmp / "xfer", port)
    c.s.update(prestage="always")
    c.agent.zone.membership = SimpleNamespace(suspects=set())
    c.agent.zone.networked = True
    c.agent.jobs = SimpleNamespace(active=lambda: [job], get=lambda jid: job if jid == job.id else None)
    c.ckpt = CkptDriver(c)
    c.prestage.keeper[job.id] = 7  # its keeper already: no ranking
    kept: list[tuple[int, str]] = []

    async def keeper(job: Any, node: int, ckpt_name: str, take_over: bool = False) -> None:
        kept.append((node, ckpt_name))

    c.mover.send_keeper = keeper  # type: ignore[method-assign]
    c._emit = lambda message, **fields: None  # type: ignore[method-assign]
    c.prestage.set_keeper = lambda job_id, node: None  # type: ignore[method-assign]
    return c, kept


def same_bytes(committed: Any, ck: Path) -> None:
    got = T.verified_checkpoint(committed.path)
    for f in ck.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name


def test_the_driver_check_and_the_prestage_read_a_checkpoint_once(tmp_path: Path,
                                                                   read_where: list[tuple[str, bool]]) -> None:  # noqa: F811
    ck = make_ckpt(tmp_path, 700 * KB, step=40)
    job = job_at(ck.parent)
    committed: list[Any] = []

    async def body(rcv: T.Receiver, port: int) -> tuple[Path, list[tuple[int, str]]]:
        rcv.on_commit = committed.append
        c, kept = prestaging(tmp_path, port, job)
        await c.ckpt.verify_new()  # the driver's round finds the new checkpoint first
        assert sorted(w for w, _ in read_where) == [f"chunks {ck.name}", f"verify {ck.name}"], read_where
        await c.prestage.ship(job)
        assert c.prestage.shipped.get(job.id) == ck.name
        assert len(read_where) == 2, f"the prestage read the checkpoint again: {read_where}"
        # the archive's periodic copy takes the driver's answer: nothing read
        look = c.archive.look(tmp_path / "arch", [], [(job.id, str(ck.parent), None, c.checkpoints.driver_checked(job))],
                               False, frozenset(), frozenset(), 0.0)
        assert look["ckpts"] == {job.id: ck} and len(read_where) == 2, read_where

        # a new checkpoint, both looking at once: one read between them, whichever comes first
        read_where.clear()
        ck2 = jobkit.Checkpointer(job_id="j1", ckpt_dir=ck.parent, install_signal=False).save(
            b"x" * (300 * KB), step=50)
        await asyncio.gather(c.prestage.ship(job), c.ckpt.verify_new())
        assert sorted(w for w, _ in read_where) == [f"chunks {ck2.name}", f"verify {ck2.name}"], read_where
        assert not any(main for _, main in read_where), f"read whole on the event loop: {read_where}"
        assert c.prestage.shipped.get(job.id) == ck2.name
        return ck2, kept

    ck2, kept = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert kept == [(7, ck.name), (7, ck2.name)] and len(committed) == 2
    same_bytes(committed[0], ck)
    same_bytes(committed[1], ck2)


def test_a_checkpoint_that_rots_after_the_driver_check_is_not_sent_as_checked(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 700 * KB, step=40)
    job = job_at(ck.parent)
    committed: list[Any] = []

    async def body(rcv: T.Receiver, port: int) -> list[tuple[int, str]]:
        rcv.on_commit = committed.append
        c, kept = prestaging(tmp_path, port, job)
        await c.ckpt.verify_new()
        assert c.ckpt.checked(job) is not None and c.ckpt.checked(job)[0] == ck  # type: ignore[index]
        big = max(ck.iterdir(), key=lambda f: f.stat().st_size)
        rot(big, 1000)  # in place, its mtime put back: the listing and the file's identity unchanged
        await c.prestage.ship(job)
        return kept

    kept = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert committed == [] and kept == [], "a rotten checkpoint was sent"


def test_the_archive_rounds_read_a_running_jobs_checkpoint_only_to_copy_it(
        tmp_path: Path, read_where: list[tuple[str, bool]]) -> None:  # noqa: F811
    """With the archive's periodic copies on (departures without notice are plausible), each
    round (every ``poll_s``) hashed every running job's newest checkpoint whole to find it, copied
    or not: a checkpoint of 10 GB read without end. Now a round takes the driver's answer: the
    checkpoint is read when it is copied (the copy checked as it is made), and then no more."""
    from test_archive_claims_reclaimed import component as archiving

    ck = make_ckpt(tmp_path, 700 * KB, step=40)
    job = SimpleNamespace(id="job-1", ckpt_dir=ck.parent, active=True, state="running", spec=JobSpec(["train"]),
                          owner_uid=0, owner_gid=0, gpus=[])
    c = archiving(2, tmp_path / "arch", tmp_path / "s2")
    c.s.update(prestage="off", prestage_unannounced=0.0, poll_s=0.5)  # copies due: every departure may be unannounced
    c.agent.jobs = SimpleNamespace(active=lambda: [job], get=lambda jid: job if jid == job.id else None, list=lambda: [job])
    c.reclaim = None
    c.ckpt = CkptDriver(c)
    c.ckpt.threaded = True  # (its loop's flag: the rounds wait for its check)
    c._emit = lambda message, **fields: None  # type: ignore[method-assign]
    c.prestage.keeper = {}

    async def main() -> None:
        try:
            await c.archive.run_round()  # not checked yet: waits for the driver, reads nothing
            assert read_where == [] and not (tmp_path / "arch" / "n2-job-1").exists()
            await c.ckpt.verify_new()  # the driver's check: one read (jobkit's: no prestage here)
            assert [w for w, _ in read_where] == [f"verify {ck.name}"], read_where
            await c.archive.run_round()  # copied: the copy checked as it is made
            assert await until_copied(c)
            assert [w for w, _ in read_where if w == f"verify {ck.name}"] == [f"verify {ck.name}"], read_where
            copied = len(read_where)  # the driver's check, and the copy's
            for _ in range(5):
                await c.archive.run_round()
                await asyncio.sleep(0)
            assert len(read_where) == copied, f"the rounds read the checkpoint again: {read_where[copied:]}"
        finally:
            c.archive.lane.close()
            c.agent.store.close()

    async def until_copied(comp: ReclaimComponent) -> bool:
        for _ in range(200):
            if comp.archive.periodic.live.get(job.id) == ck.name:
                return True
            await asyncio.sleep(0.02)
        return False

    asyncio.run(main())
    assert (tmp_path / "arch" / "n2-job-1" / ck.name).is_dir()


def test_a_second_asker_of_a_check_in_flight_gets_the_same_answer(tmp_path: Path) -> None:
    """A move's start asks the driver while its round's check of the same listing is in flight:
    it awaits that check and gets (newest, manifest), as the first asker does (it got the lane's
    three-tuple once, and the move failed: the reclaim's window ended with the job unmoved)."""
    ck = make_ckpt(tmp_path, 300 * KB, step=40)
    job = job_at(ck.parent)

    async def body(rcv: T.Receiver, port: int) -> None:
        c, _ = prestaging(tmp_path, port, job)
        c.s.update(prestage="off")
        first, second = await asyncio.gather(c.ckpt.check(job, manifest=False), c.ckpt.check(job, manifest=False))
        assert first == second and first[0] == ck, (first, second)

    asyncio.run(with_receiver(tmp_path / "rcv", body))
