"""A node whose reclaim window ended counts as dead, yet its agent may be back: restarted after the
window, it cleared the reclaim (the owner gave the node back) and takes jobs again, from the
archive too. What it runs since is not claimed from the archive by another node: that node asks
it first (control op ``needs``) and leaves the record while it answers that the job lives there
(or ended there: exited, stopped by its user, moved elsewhere; one that failed there is resumed).
Before, the job it had claimed from the archive (its running record) and its own job's periodic
record were claimed and resumed a second time (a fresh-clone CI run of
tests/cluster/test_archive_late_copy_restart.py saw the job on both nodes). A node that does not
answer, or whose job there is not alive, is claimed from as before.

Two real components on loopback (node 1, which has room and looks at the archive; node 2, back
from its reclaim: each a real store, transfer endpoint and authenticated control messages), a
real archive directory with real jobkit checkpoints and records; stand-ins, named as such: the
zones (``FakeZone``), the job managers (``Jobs``), and the job's start on node 1 (``Takeover.resume_here``
recorded, not run).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from archiverig import agent_of, record, reseal, zone_keys, zone_of
from jobrig import until
from test_migrate_archive_gc import ckpt_of, claimed_and_running
from test_migrate_archive_live import files
from test_replica_gc import KEY, started
from test_replica_keeper_window import source_asked_by, stop_both

from laminar.migrate.archive_view import LIVE_RECORD
from laminar.migrate.reclaim import ReclaimComponent


def test_a_node_back_from_its_reclaim_is_asked_before_what_it_runs_is_claimed_from_the_archive(tmp_path: Path) -> None:
    async def main() -> None:
        arch = tmp_path / "arch"
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        agent_b, b = await started(tmp_path / "b")  # node 1
        agent_a, a, asked = await source_asked_by(tmp_path / "a", b, ReclaimComponent(), ("job-2", "job-3"))
        b.s.update(archive_dir=str(arch), dead_after_s=3.0)
        b.s["port"] = a.port  # node 1's control messages to node 2 reach it
        events: list[dict[str, Any]] = []
        agent_b.events.subscribe(events.append)
        resumed: list[tuple[str, str]] = []

        async def resume_here(row: Any, req: dict[str, Any], path: Path, why: str) -> str | None:
            resumed.append((str(row["key"]), path.name))  # (the job's start: not what is tested)
            return None

        b.takeover.resume_here = resume_here  # type: ignore[method-assign]
        try:
            # node 2 claimed node 3's archived job and runs it as job-2; its own job-3's periodic
            # copy is in the archive too (no keeper)
            keys = zone_keys(KEY.hex())  # the zone's key, as the components here hold it
            claimed_and_running(arch, tmp_path, "n3-job-1", agent_of(2, arch, keys), "job-2")
            agent_of(2, arch, keys).archive.periodic.publish_live("n2-job-3", ckpt_of(tmp_path, "j3", 4), record("n2-job-3", None))
            now = time.time()
            b.notices[2] = (now - 20.0, now - 80.0)  # node 2's 60 s window ended 20 s ago
            agent_b.zone.membership.state[2].last_seen = now  # and it is heard from: back

            async def round_() -> dict[str, Any]:
                wall = time.time()
                look = b.archive.look(arch, [], [], True, frozenset({1}), frozenset(), wall)
                b.archive.claims.start_claims(look, wall)
                assert await until(lambda: not b.takeover.taking, timeout=30)
                return look

            assert b.takeover.source_dead(2, time.time()) == "node 2's reclaim window ended"
            look = await round_()
            assert resumed == [], "a job node 2 runs was resumed here too"
            assert sorted(asked) == ["needs n2-job-2", "needs n2-job-3"], asked
            assert look["runs"] == [("n3-job-1", 2, (2, "job-2"))] and [x[0] for x in look["lives"]] == ["n2-job-3"]
            assert files(arch / "n3-job-1") == ["ckpt-7", "running-2.json"]
            assert files(arch / "n2-job-3") == ["ckpt-4", LIVE_RECORD]
            told = [e for e in events if e.get("phase") == "archive-runs-there"]
            assert sorted((e["key"], e["job_key"], e["state"]) for e in told) == [
                ("n2-job-3", "n2-job-3", "running"), ("n3-job-1", "n2-job-2", "running")], told

            # looked at again only after dead_after_s, and not told again
            await round_()
            assert len(asked) == 2 and resumed == []
            b.archive.claims.next_try.clear()
            await round_()
            assert len(asked) == 4 and resumed == [] and len([e for e in events
                                                              if e.get("phase") == "archive-runs-there"]) == 2

            # job-3 ended there (reclaimed at the window's end, say): its record is claimed now
            agent_a.jobs.get("job-3").state = "reclaimed"
            b.archive.claims.next_try.clear()
            await round_()
            assert resumed == [("n2-job-3", "ckpt-4")], resumed

            # job-2 ended there by itself: the job is not resumed again from the archive either
            agent_a.jobs.get("job-2").state = "exited"
            b.archive.claims.next_try.clear()
            b.archive.claims.runs_told.clear()
            await round_()
            assert resumed == [("n2-job-3", "ckpt-4")], resumed
            assert [e["state"] for e in events if e.get("phase") == "archive-runs-there"][-1] == "exited"
            assert b.archive.claims.next_try["n3-job-1"] - time.monotonic() > 500  # asked again only after minutes
            # one that failed there is resumed from the archive (its state may still be needed there)
            agent_a.jobs.get("job-2").state = "failed"
            assert not await b.archive.claims.still_runs("n3-job-1", 2, "n2-job-2")

            # (say it had not: running there) node 2 gone for good: no answer, and the job it ran is
            # claimed again from the archive
            agent_a.jobs.get("job-2").state = "running"
            await a.stop()
            b.archive.claims.next_try.clear()
            await round_()
            assert resumed == [("n2-job-3", "ckpt-4"), ("n3-job-1", "ckpt-7")], resumed
            assert asked[-1] == "needs n2-job-2"
        finally:
            await stop_both(b, a, agent_b, agent_a)

    asyncio.run(main())


def test_a_dead_runner_is_not_asked_unless_its_window_ended_or_it_placed_the_job_elsewhere(tmp_path: Path) -> None:
    """Silent past ``orphan_after_s`` with no notice: not asked (it would not answer), claimed at
    once, as before. A runner that placed the job on another node: that node is asked."""
    arch = tmp_path / "arch"
    c = agent_of(1, arch)
    c.s.update(orphan_after_s=60.0, dead_after_s=10.0)
    seen = {2: SimpleNamespace(last_seen=time.time() - 61)}
    c.agent.zone = zone_of(1)
    c.agent.zone.networked = True
    c.agent.zone.membership.state = seen
    c.notices = {}
    claimed_and_running(arch, tmp_path, "n3-job-1", agent_of(2, arch), "job-2")
    spawned: list[tuple[str, Any]] = []
    c.archive.claims.claim_and_resume = lambda key, **kw: (key, kw)  # type: ignore[method-assign,assignment]
    c._spawn = spawned.append  # type: ignore[method-assign,assignment]
    c.archive.claims.kept_here = lambda key: False  # type: ignore[method-assign]
    c.archive.claims.start_claims(c.archive.look(arch, [], [], True, frozenset({1}), frozenset(), time.time()), time.time())
    assert spawned == [("n3-job-1", {"dead_runner": 2, "ask": None})]

    # the running record says node 2 placed the job on node 4: node 4 is asked about its job
    run = arch / "n3-job-1" / "running-2.json"
    reseal(agent_of(2, arch), run, resumed={"node": 4, "job": "job-9"})
    assert files(arch / "n3-job-1") == ["ckpt-7", "running-2.json"]
    spawned.clear()
    c.takeover.taking.clear()
    c.archive.claims.start_claims(c.archive.look(arch, [], [], True, frozenset({1}), frozenset(), time.time()), time.time())
    assert spawned == [("n3-job-1", {"dead_runner": 2, "ask": (4, "n4-job-9")})]
