"""What a restored reclaim does not do twice: a real ReclaimComponent over a real store that holds
a reclaim stored by an agent that restarted inside its window (``migrate_reclaim``,
``migrate_moves``, cause ``reclaim``).

Stand-ins, named as such: the job manager (``RestoreJobs``: jobs with a cgroup that records
thaws) and the zone (``PlacingZone``: records reclaim notices and placements; not networked, so
running jobs have nowhere to move). The real-agent restart is tests/kernel/test_reclaim_restart.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from archiverig import agent_of, record, zone_keys
from jobrig import until
from standin_origin import OriginQueries
from test_migrate_evidence import make_agent

from laminar.migrate import drain
from laminar.migrate.reclaim import MOVES_SCHEMA, RECLAIM_SCHEMA, ReclaimComponent
from laminar.policy.endcause import EndCause
from laminar.runtime.spec import JobSpec

# A reclaim's record of a job's move (migrate_moves, cause reclaim): job id, phase, node, updated.
RECLAIM_ROW = "INSERT INTO migrate_moves VALUES (?, 'reclaim', ?, '', 0, ?, NULL, NULL, ?)"


class Cgroup:
    def __init__(self) -> None:
        self.thawed = 0

    def thaw(self, timeout: float = 0.0) -> bool:
        self.thawed += 1
        return True

    def frozen(self) -> bool:
        return False

    def memory_in_use(self) -> int:
        return 0  # the stand-in job holds no memory: a reclaim plans it at the default size

    def freeze(self, timeout: float = 0.0) -> bool:
        return True


class RestoreJobs(OriginQueries):
    """Stand-in job manager: running and queued jobs, the queue hold, stops."""

    def __init__(self) -> None:
        self.jobs: dict[str, Any] = {}
        self.held: str | None = None
        self.stops: dict[str, str] = {}
        self.causes: dict[str, Any] = {}  # job: the end cause its stop was given

    def add(self, jid: str, state: str) -> Any:
        j = SimpleNamespace(id=jid, num=len(self.jobs) + 1, state=state, active=state == "running", cgroup=Cgroup(),
                            cgroup_id=100 + len(self.jobs), spec=JobSpec(["sleep", "1"]).validate(), gpus=[],
                            ckpt_dir=None, owner_uid=0, owner_gid=0, ended=None)
        self.jobs[jid] = j
        return j

    def active(self) -> list[Any]:
        return [j for j in self.jobs.values() if j.active]

    def queued(self) -> list[Any]:
        return [j for j in self.jobs.values() if j.state == "queued"]

    def list(self) -> list[Any]:
        return list(self.jobs.values())

    def get(self, jid: str) -> Any:
        return self.jobs.get(jid)

    def hold_queue(self, reason: str | None) -> None:
        self.held = reason

    def request_checkpoint(self, job: Any) -> bool:
        return False

    async def stop(self, jid: str, reason: str, grace_s: float = 0.0, state: str = "stopped", **kw: Any) -> None:
        self.stops[jid] = state
        self.causes[jid] = kw.get("cause")
        self.jobs[jid].state, self.jobs[jid].active = state, False


class PlacingZone:
    """Stand-in zone (not networked): records reclaim notices and placements (each one placed)."""

    networked = False
    node_id = 5

    def __init__(self) -> None:
        self.notices: list[float] = []
        self.placed: list[str] = []

    def reclaim_notice(self, deadline_s: float, reason: str) -> int:
        self.notices.append(deadline_s)
        return 0

    async def place(self, spec: dict[str, Any], demand: Any, uid: int = 0, gid: int = 0,
                    origin: dict[str, Any] | None = None) -> Any:
        self.placed.append((origin or {})["requeued_from"])
        return SimpleNamespace(outcome="placed", node=7, job_id=f"job-{len(self.placed)}", reason="")


def test_a_restored_reclaim_does_not_move_handed_over_jobs_nor_place_unsettled_ones_again(tmp_path: Path) -> None:
    async def main() -> None:
        agent = make_agent(tmp_path)
        agent.jobs = jobs = RestoreJobs()
        agent.zone = zone = PlacingZone()
        handed, frozen = jobs.add("job-1", "running"), jobs.add("job-2", "running")
        jobs.add("job-3", "queued")  # its placement was asked for before the restart
        jobs.add("job-4", "queued")  # never tried
        agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
        agent.store.ensure_schema("migrate-moves", MOVES_SCHEMA)
        now = time.time()
        with agent.store.tx() as db:  # what the agent before the restart stored
            db.execute("INSERT INTO migrate_reclaim VALUES (5, 30, 'owner', ?, ?)", (now - 20, now + 10))
            db.executemany(RECLAIM_ROW,
                           [("job-1", "handover", 7, now - 5), ("job-2", "frozen", None, now - 6),
                            ("job-3", "placing", None, now - 4)])
        assert drain.held_at_start(agent.store) == drain.hold_reason(5)  # what the job manager holds at start
        seen: list[dict[str, Any]] = []
        agent.events.subscribe(seen.append)
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            rc = comp.evacuation.status()["reclaim"]
            assert rc is not None and rc["restored"] and rc["handed_over"] == ["job-1"]
            assert abs(rc["deadline"] - (now + 10)) < 1e-6
            assert jobs.held == drain.hold_reason(5)
            assert zone.notices and zone.notices[0] <= 10.0  # draining again, peers told of what is left
            assert await until(lambda: jobs.stops.get("job-1") == "reclaimed")  # stopped here, not moved again
            assert jobs.causes["job-1"] == EndCause.HANDED_OVER
            assert "job-1" not in comp.moves
            assert frozen.cgroup.thawed >= 1  # its move froze it: thawed, planned to move again
            assert [st["job_id"] for st in rc["plan"]] == ["job-2"]
            assert await until(lambda: zone.placed == ["n5-job-4"])  # job-3 is never placed twice
            assert jobs.jobs["job-3"].state == "queued"
            assert any(e.get("outcome") == "unsettled" and e.get("job") == "job-3" for e in seen)
            assert handed.state == "reclaimed"
        finally:
            await comp.stop()

        # started again after the window ended: cleared, with an event
        with agent.store.tx() as db:
            db.execute("UPDATE migrate_reclaim SET deadline=?", (time.time() - 1,))
        assert drain.held_at_start(agent.store) is None
        jobs.held = None
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            assert comp.evacuation.status()["reclaim"] is None
            assert agent.store.db.execute("SELECT COUNT(*) FROM migrate_reclaim").fetchone()[0] == 0
            assert agent.store.db.execute("SELECT COUNT(*) FROM migrate_moves WHERE cause='reclaim'").fetchone()[0] == 0
            assert any(e.get("phase") == "reclaim-cleared" for e in seen)
            assert jobs.held is None
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())


def test_held_at_start_without_a_stored_reclaim(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    try:
        assert drain.held_at_start(agent.store) is None  # no table yet (a first start)
        agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
        assert drain.held_at_start(agent.store) is None
    finally:
        agent.store.db.close()


def test_a_restored_window_is_measured_by_the_boot_clock_not_a_stepped_wall_clock(tmp_path: Path,
                                                                                  monkeypatch: Any) -> None:
    """The wall clock steps (an NTP step, a resumed VM, an operator's ``date``) between a reclaim
    and an agent restart on the same boot: the window restored must be what is left of it, not
    what the stepped wall clock says. Before, a step forward made the restart clear a reclaim
    still under way (queued jobs started on a node about to go, nothing moved) and a step back
    restored a window longer than its notice (checkpoints signalled and the kill-switch armed
    after the owner takes the node). The step is ``time.time`` moved by an hour (the machine's
    clock is shared: never set it)."""
    real = time.time

    async def main() -> None:
        agent = make_agent(tmp_path)
        agent.jobs = jobs = RestoreJobs()
        agent.zone = PlacingZone()
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            comp.evacuation.start(30.0, "lm-t owner")
        finally:
            await comp.stop()
        for step in (3600.0, -3600.0):
            monkeypatch.setattr(time, "time", lambda s=step: real() + s)
            jobs.held = None  # a job manager starting afresh
            assert drain.held_at_start(agent.store) == drain.hold_reason(5), f"clock stepped {step:+g} s"
            comp = ReclaimComponent()
            await comp.start(agent)
            try:
                rc = comp.evacuation.status()["reclaim"]
                assert rc is not None, f"clock stepped {step:+g} s: the reclaim under way was cleared"
                assert 20.0 < rc["left_s"] <= 30.0, f"clock stepped {step:+g} s: {rc['left_s']} s left restored"
                assert jobs.held == drain.hold_reason(5)
            finally:
                await comp.stop()
            monkeypatch.setattr(time, "time", real)
        agent.store.db.close()

    asyncio.run(main())


def test_an_agent_restarted_during_a_cancel_settles_what_the_cancel_left(tmp_path: Path) -> None:
    """The agent restarts between a cancel's first step (the stored reclaim removed: nothing is
    restored) and its last (the records of what the reclaim did to jobs removed): a queued job
    whose placement elsewhere was unsettled, a job whose hand-over was sent and one a move froze
    are still recorded. Before, the restart ignored those records: the queued job started here
    while it may run on node 7 (twice), the handed-over job ran on here beside its copy there, the
    frozen one stayed frozen, and the records stayed behind."""
    async def main() -> None:
        agent = make_agent(tmp_path)
        agent.jobs = jobs = RestoreJobs()
        agent.zone = zone = PlacingZone()
        handed, frozen = jobs.add("job-1", "running"), jobs.add("job-2", "running")
        unsettled, other = jobs.add("job-3", "queued"), jobs.add("job-4", "queued")
        agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
        agent.store.ensure_schema("migrate-moves", MOVES_SCHEMA)
        now = time.time()
        agent.store.set_meta(drain.CANCEL_META, {"node": 5, "window_end": now + 20})  # what the cancel wrote first
        with agent.store.tx() as db:  # the cancel removed migrate_reclaim, then the agent restarted
            db.executemany(RECLAIM_ROW,
                           [("job-1", "handover", 7, now - 5), ("job-2", "frozen", None, now - 6),
                            ("job-3", "placing", None, now - 4)])
        held = drain.held_at_start(agent.store)
        assert held is not None, "the queue must be held until the unsettled placement is settled"
        jobs.held = held
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            assert comp.evacuation.status()["reclaim"] is None
            assert await until(lambda: jobs.held is None)
            assert jobs.stops.get("job-3") == "stopped", "the queued job whose placement may have run is not started"
            assert jobs.causes["job-3"] == EndCause.PLACEMENT_UNSETTLED
            assert jobs.stops.get("job-1") in ("reclaimed", "migrated"), "the handed-over job runs on here"
            assert frozen.cgroup.thawed >= 1 and frozen.state == "running"
            assert other.state == "queued" and "job-4" not in jobs.stops
            assert agent.store.db.execute("SELECT COUNT(*) FROM migrate_moves WHERE cause='reclaim'").fetchone()[0] == 0
            assert zone.placed == [] and handed.state != "running" and unsettled.state == "stopped"
            assert await until(lambda: agent.store.get_meta(drain.CANCEL_META) is None)
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())


def restarting_in_a_reclaim_with_a_move(tmp_path: Path, phase: str, reason: str) -> tuple[Any, RestoreJobs, Any, Any]:
    """An agent (not started yet) whose store holds what the agent before its restart stored:
    a reclaim of node 5 (30 s, 10 s left) and a move of ``job-1`` to node 7 (``migrate_moves``
    phase ``phase``, for ``reason``); ``job-1`` and ``job-2`` run. Returns (agent, jobs, job-1, job-2)."""
    agent = make_agent(tmp_path)
    agent.jobs = jobs = RestoreJobs()
    agent.zone = PlacingZone()
    one, two = jobs.add("job-1", "running"), jobs.add("job-2", "running")
    agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
    agent.store.ensure_schema("migrate-moves", MOVES_SCHEMA)
    now = time.time()
    with agent.store.tx() as db:
        db.execute("INSERT INTO migrate_reclaim VALUES (5, 30, 'owner', ?, ?)", (now - 20, now + 10))
        db.execute("INSERT INTO migrate_moves VALUES ('job-1', 'move_now', ?, ?, 1, 7, 3, '{}', ?)", (phase, reason, now - 2))
    return agent, jobs, one, two


def test_a_restored_reclaim_does_not_move_a_job_whose_settled_stop_the_restart_finishes(tmp_path: Path) -> None:
    """The agent restarts inside a reclaim's window while an operator's ``--gone`` settle of a
    move (``migrate_moves`` phase ``gone``: node 7 runs the job) was stopping the job here. The
    restart finishes that stop; the restored reclaim must not begin a move of the same job
    meanwhile (a second hand-over: a copy elsewhere beside node 7's). Before, the restored
    reclaim moved it while its stop ran (``job-1`` in ``moves``)."""
    async def main() -> None:
        agent, jobs, settled, other = restarting_in_a_reclaim_with_a_move(tmp_path, "gone", "lm-t loan return")
        release = asyncio.Event()
        real_stop = jobs.stop

        async def slow_stop(jid: str, *a: Any, **kw: Any) -> None:  # the settled stop takes a while
            if jid == "job-1":
                await release.wait()
            await real_stop(jid, *a, **kw)

        jobs.stop = slow_stop  # type: ignore[method-assign]
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            rc = comp.evacuation.status()["reclaim"]
            assert rc is not None and rc["restored"]
            assert await until(lambda: comp.moves.get("job-2") is not None and comp.moves["job-2"].ended)
            assert "job-1" not in comp.moves, "the restored reclaim moved a job whose settled stop was running"
            release.set()
            assert await until(lambda: settled.state == "migrated")
            assert await until(lambda: comp.evacuation.status()["reclaim"] is not None and "job-1" not in comp.evacuating)
            assert "job-1" not in comp.moves and other.state == "running"
        finally:
            release.set()
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())


def test_a_restored_reclaim_does_not_move_a_job_whose_cut_move_cannot_be_asked(tmp_path: Path) -> None:
    """The agent restarts inside a reclaim's window with a move cut during its hand-over
    (``migrate_moves`` phase ``handover`` to node 7) that this start cannot ask (node 7 is not in
    the zone's roster: the stand-in zone has none). The job stays frozen here until an operator
    settles it, and no other move may take it meanwhile (node 7 may run it: a second hand-over
    is a second copy). Before, the settle that could not ask dropped the job from ``evacuating``
    and the restored reclaim moved it (``job-1`` placed elsewhere). An operator's ``--run-here``
    then ends the hold: the job is thawed and the reclaim may move it."""
    async def main() -> None:
        agent, _, cut, other = restarting_in_a_reclaim_with_a_move(tmp_path, "handover", "airlock re-address")
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            rc = comp.evacuation.status()["reclaim"]
            assert rc is not None and rc["restored"]
            assert await until(lambda: comp.moves.get("job-1") is not None and comp.moves["job-1"].ended)
            assert "cannot ask node 7" in comp.moves["job-1"].error
            assert await until(lambda: comp.moves.get("job-2") is not None and comp.moves["job-2"].ended)
            await asyncio.sleep(0.5)  # the reclaim's wait for job-1 looks every 0.2 s
            assert comp.moves["job-1"].dest == 7 and comp.moves["job-1"].phase == "handover", \
                "the restored reclaim moved a job whose cut hand-over to node 7 could not be asked"
            assert "job-1" in comp.evacuating and cut.cgroup.thawed == 0
            assert [h["job"] for h in comp.settle.pending_handovers()] == ["job-1"]
            out = await comp.settle.settle_handover("job-1", "run-here", by="lm-t operator")
            assert out["decision"] == "run-here" and cut.cgroup.thawed == 1
            assert "job-1" not in comp.evacuating  # the settle ends the hold
            assert other.state == "running"
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())


def test_a_restored_reclaim_stops_a_job_whose_archived_record_was_being_published_and_never_moves_it(
        tmp_path: Path) -> None:
    """The agent stopped between the publish of a job's record in the archive (no keeper, no
    keeper: the archive was its only keeper) and the job's stop, the job frozen by its move. Its
    restart stops the job (the archive resumes it: it runs once) and leaves it out of the
    restored reclaim's plan; the record is not written again (migrate_late_copies)."""
    import json

    from laminar.config import Config, validate
    from laminar.jobkit import Checkpointer

    async def main() -> None:
        agent = make_agent(tmp_path)
        arch = tmp_path / "arch"
        agent.config = Config(validate({"agent": {"state_dir": str(tmp_path), "node": "lm-t-ev"},
                                        "migrate": {"poll_s": 60.0, "periodic": False, "archive_dir": str(arch)}}))
        agent.jobs = jobs = RestoreJobs()
        agent.zone = PlacingZone()
        agent.zone.zone, agent.zone.keys = 1, zone_keys()  # the zone's key: what signs its archive records
        archived, other = jobs.add("job-1", "running"), jobs.add("job-2", "running")
        ckpt = Checkpointer(job_id="job-1", ckpt_dir=tmp_path / "ck", install_signal=False, keep=2).save(b"w", step=3)
        agent_of(5, arch).archive.stopped.publish("n5-job-1", ckpt, record("n5-job-1"))  # published before the restart
        published = (arch / "n5-job-1" / "guard.json").read_bytes()
        agent.store.ensure_schema("migrate-reclaim", RECLAIM_SCHEMA)
        agent.store.ensure_schema("migrate-moves", MOVES_SCHEMA)
        now = time.time()
        with agent.store.tx() as db:  # what the agent before the restart stored
            db.execute("INSERT INTO migrate_reclaim VALUES (5, 30, 'owner', ?, ?)", (now - 20, now + 10))
            db.executemany(RECLAIM_ROW,
                           [("job-1", "frozen", None, now - 6), ("job-2", "frozen", None, now - 6)])
            db.execute("INSERT INTO migrate_late_copies VALUES ('n5-job-1', 'job-1', ?, ?, 0, 1, ?)",
                       (str(ckpt), json.dumps({"key": "n5-job-1", "src_node": 5, "src_job": "job-1"}), now - 5))
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            rc = comp.evacuation.status()["reclaim"]
            assert rc is not None and rc["restored"]
            assert [st["job_id"] for st in rc["plan"]] == ["job-2"]  # job-1 is not moved again
            assert await until(lambda: jobs.stops.get("job-1") == "reclaimed")
            assert jobs.causes["job-1"] == EndCause.ARCHIVED
            assert await until(lambda: comp.moves.get("job-1") is not None and comp.moves["job-1"].phase == "archived")
            assert (arch / "n5-job-1" / "guard.json").read_bytes() == published  # not written again
            assert archived.state == "reclaimed" and other.state == "running"
            assert agent.store.db.execute("SELECT COUNT(*) FROM migrate_late_copies").fetchone()[0] == 0
        finally:
            await comp.stop()

    asyncio.run(main())
