"""Self-fencing's parts (laminar/migrate/fence.py): the settings it refuses, when a node counts as
cut off, that a cut-off node takes nothing over, which jobs it fences (kept across a restart),
how it settles them once heard again, and the keeper's answer to ``taken``.

A real component started on a real SQLite store with its real transfer endpoint on loopback
(the ``taken`` question is a real authenticated control message from node 2). Stand-ins, named
as such: the zone (``FakeZone``: membership only), the job manager (``Jobs``) and the jobs'
cgroups (``Cgroup``: records freeze and thaw). The whole path over three real agents, real
jobs and a real partition: tests/cluster/test_fence.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from archiverig import agent_of, claimed_by, mark_done, zone_keys
from standin_origin import OriginQueries
from test_replica_gc import KEY, K, Source, started

from laminar.config import ConfigError, validate
from laminar.migrate.fence import FENCE_META, check_fence_settings
from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec


class Cgroup:  # stand-in: records what was asked of the job's cgroup
    def __init__(self) -> None:
        self.calls: list[str] = []

    def freeze(self, timeout: float | None = None) -> bool:
        self.calls.append("freeze")
        return True

    def thaw(self, timeout: float | None = None) -> bool:
        self.calls.append("thaw")
        return True

    def freeze_requested(self) -> bool:
        return bool(self.calls) and self.calls[-1] == "freeze"


class Jobs(OriginQueries):  # stand-in job manager: these jobs run here
    def __init__(self, jobs: list[Any]) -> None:
        self.jobs = jobs

    def active(self) -> list[Any]:
        return [j for j in self.jobs if j.active]

    def list(self) -> list[Any]:
        return list(self.jobs)

    def get(self, job_id: str) -> Any:
        return next((j for j in self.jobs if j.id == job_id), None)

    def set_state(self, job: Any, state: str, reason: str = "") -> None:
        job.state, job.reason = state, reason

    def stops(self) -> list[tuple[str, str, str]]:
        """Gives this stand-in a ``stop`` that ends the job and records (id, state, reason)."""
        stopped: list[tuple[str, str, str]] = []

        async def stop(jid: str, reason: str, *, grace_s: float | None = None, state: str = "stopped",
                       cause: Any = None) -> Any:
            stopped.append((jid, state, reason))
            j = self.get(jid)
            j.active, j.state = False, state

        self.stop = stop
        return stopped


def job(jid: str, migrated_from: str | None = None) -> SimpleNamespace:
    """A running job; ``migrated_from``: the key the job manager recorded it resumed (its origin)."""
    return SimpleNamespace(id=jid, active=True, state="running", cgroup=Cgroup(), started=time.time() - 60,
                           spec=JobSpec(command=["train"]), ckpt_dir=None, pid=None,
                           origin=JobOrigin(migrated_from=migrated_from))


def test_settings_that_cannot_work_are_refused_naming_the_values() -> None:
    check_fence_settings({"fence_after_s": 0.0, "orphan_after_s": 0.0})  # off
    check_fence_settings({"fence_after_s": 5.0, "orphan_after_s": 30.0})
    with pytest.raises(ValueError, match=r"fence_after_s = 30 must be less than orphan_after_s = 30"):
        check_fence_settings({"fence_after_s": 30.0, "orphan_after_s": 30.0})
    with pytest.raises(ValueError, match=r"fence_after_s = 5 needs orphan_after_s > 0"):
        check_fence_settings({"fence_after_s": 5.0, "orphan_after_s": 0.0})
    with pytest.raises(ConfigError, match=r"migrate.fence_after_s = -1"):
        validate({"migrate": {"fence_after_s": -1}})


def test_a_node_that_hears_nobody_is_cut_off_and_takes_nothing_over(tmp_path: Path) -> None:
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0)
            now = time.time()
            c._started = now - 100.0
            state = agent.zone.membership.state
            state[2].last_seen = now - 40.0  # node 2 silent past orphan_after_s
            state[3].last_seen = now - 1.0  # node 3 heard a second ago: this node is not cut off
            assert not c.fence.isolated(now)
            c.vouch._vouched[2] = (now, 40.0, True)  # node 3 said it has not heard node 2 for 40 s either (vouch.py)
            assert c.takeover.source_dead(2, now) == "node 2 silent for 40.0 s"
            state[3].last_seen = now - 12.0  # nobody heard for 12 s: this node is the one cut off
            assert c.fence.isolated(now)
            assert c.takeover.source_dead(2, now) is None
            c.s["fence_after_s"] = 0.0  # off: as before
            assert not c.fence.isolated(now)
            assert c.takeover.source_dead(2, now) == "node 2 silent for 40.0 s"
            c.s["fence_after_s"] = 10.0
            c._started = now - 5.0  # started 5 s ago: it cannot vouch for a longer silence
            assert not c.fence.isolated(now)
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_the_jobs_the_zone_would_resume_are_fenced_kept_across_a_restart_and_settled(tmp_path: Path) -> None:
    async def main() -> None:
        agent, c = await started(tmp_path)
        kept, archived, alone, moving = job("job-1"), job("job-2"), job("job-3"), job("job-4")
        owed = job("job-5")  # its old keeper (owed a release) still keeps it
        agent.jobs = Jobs([kept, archived, alone, moving, owed])
        events: list[dict[str, Any]] = []
        agent.events.subscribe(events.append)
        asked: list[tuple[int, str, Any]] = []
        answers: dict[int, Any] = {}

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:  # stand-in: the keeper
            asked.append((node, op, body))
            ans = answers.get(node)
            if isinstance(ans, Exception):
                raise ans
            return ans

        c._control = control  # type: ignore[method-assign]
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0)
            c.prestage.keeper.update({"job-1": 2, "job-4": 3})
            c.archive.periodic.live["job-2"] = "ckpt-5"
            c.evacuating.add("job-4")  # a move settles it itself
            c.prestage.releases[(3, "n1-job-5")] = (time.monotonic() + 3600.0, time.monotonic() + 7200.0)
            now = time.time()
            c._started = now - 100.0
            for st in agent.zone.membership.state.values():
                st.last_seen = now - 20.0
            c.fence.tick(now)
            assert sorted(c.fence.fenced_jobs) == ["job-1", "job-2", "job-5"]
            assert kept.cgroup.calls == ["freeze"] and archived.cgroup.calls == ["freeze"]
            c.fence.drop("job-5")  # (not settled below with the other two: not what is tested there)
            c.prestage.releases.clear()
            assert alone.cgroup.calls == [] and moving.cgroup.calls == []  # nothing would resume them
            assert (kept.state, alone.state) == ("suspended", "running")
            assert kept.reason.startswith("fenced: node 1 heard no member of its zone for 10 s")
            assert [e["jobs"] for e in events if e.get("phase") == "fenced"] == [["job-1", "job-2", "job-5"]]
            c.fence.tick(now + 1)  # still cut off: fenced once
            assert kept.cgroup.calls == ["freeze"]
            archived.cgroup.calls.append("thaw")  # thawed by something else meanwhile (a move that failed)
            c.fence.tick(now + 2)
            assert archived.cgroup.calls == ["freeze", "thaw", "freeze"]  # frozen again
            archived.cgroup.calls[:] = ["freeze"]
            assert sorted(agent.store.get_meta(FENCE_META)) == ["job-1", "job-2"]

            c.fence.fenced_jobs = {}  # a restart: what was fenced comes back from the store
            c.fence.restore()
            assert sorted(c.fence.fenced_jobs) == ["job-1", "job-2"]
            c._started = time.time()  # restarted just now, nobody heard yet: not cut off, but nothing settles
            for st in agent.zone.membership.state.values():
                st.last_seen = -1.0
            c.fence.tick(time.time())
            await asyncio.sleep(0.1)
            assert sorted(c.fence.fenced_jobs) == ["job-1", "job-2"] and asked == []

            # heard again; job-1's keeper (node 2) does not answer and is not gone: stays frozen
            agent.zone.membership.state[3].last_seen = time.time()
            answers[2] = OSError("no route to node 2")
            agent.zone.membership.state[2].last_seen = time.time() - 5.0
            c.fence.tick(time.time())
            await asyncio.sleep(0.2)
            assert "job-1" in c.fence.fenced_jobs and kept.cgroup.calls == ["freeze"]
            assert [(n, op) for n, op, _ in asked] == [(2, "taken")]
            assert asked[0][2] == {"key": "n1-job-1"}
            assert "job-2" not in c.fence.fenced_jobs and archived.cgroup.calls == ["freeze", "thaw"]  # no keeper: thawed

            # node 2 answers: it did not take job-1 over: thawed, the fence forgotten
            answers[2] = {"key": "n1-job-1", "runs": None, "state": "keeping"}
            c.fence.tick(time.time())
            await asyncio.sleep(0.2)
            assert kept.cgroup.calls == ["freeze", "thaw"] and c.fence.fenced_jobs == {}
            assert kept.state == "running" and kept.reason.startswith("unfenced: node 1 hears its zone again")
            assert agent.store.get_meta(FENCE_META) is None
            ev = [(e["job"], e["airlock_held"]) for e in events if e.get("phase") == "unfenced"]
            assert sorted(ev) == [("job-1", False), ("job-2", False)], ev
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def settled(tmp: Path, answers: dict[int, dict[str, Any]]) -> tuple[list[int], list[tuple[str, str, str]], Any]:
    """Job-1 (keeper: node 2) fenced 40 s ago, this node heard again: the nodes its settling asked
    (``taken``, answered from ``answers``, a stand-in for the keepers), what it stopped, and the
    job (whose cgroup stand-in records any thaw)."""
    async def main() -> tuple[list[int], list[tuple[str, str, str]], Any]:
        agent, c = await started(tmp)
        j = job("job-1")
        agent.jobs = Jobs([j])
        stopped = agent.jobs.stops()
        asked: list[int] = []

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:  # stand-in: the keepers
            asked.append(node)
            return {"key": body["key"], **answers[node]}

        async def release(node: int, key: str) -> None:
            pass

        c._control = control  # type: ignore[method-assign]
        c.prestage.release = release  # type: ignore[method-assign]
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0)
            c.prestage.keeper["job-1"] = 2
            c.fence.fenced_jobs["job-1"] = time.time() - 40.0
            c.fence.tick(time.time())  # heard from (FakeZone: everyone just now)
            for _ in range(50):
                if stopped:
                    break
                await asyncio.sleep(0.05)
            assert c.fence.fenced_jobs == {}
            return asked, stopped, j
        finally:
            await c.stop()
            agent.store.close()

    return asyncio.run(main())


def test_a_fenced_job_its_keeper_took_over_and_placed_elsewhere_is_stopped_not_thawed(tmp_path: Path) -> None:
    # the keeper had no room and placed the job on node 4
    _, stopped, j = settled(tmp_path, {2: {"runs": "job-9", "node": 4, "state": "placed"}})
    assert [(jid, st) for jid, st, _ in stopped] == [("job-1", "migrated")]
    assert "node 4 runs it as job-9" in stopped[0][2]
    assert j.cgroup.calls == []  # never thawed: it takes no step before it dies


def test_a_fenced_job_whose_keeper_was_passed_on_asks_where_it_went(tmp_path: Path) -> None:
    """Job-1's keeper (node 2), reclaimed while this node was cut off, passed the keeper on to
    node 3 with a take-over. Node 2 answers ``taken`` with ``passed_to`` 3; node 3 runs the job:
    the fenced copy is stopped, not thawed. Before, node 2's "not taken" thawed it beside node
    3's copy (bench/chaos.py --partial-partitions, seed 32)."""
    asked, stopped, j = settled(tmp_path, {2: {"runs": None, "state": "passed", "passed_to": 3},
                                           3: {"runs": "job-6", "node": 3, "state": "resumed"}})
    assert asked == [2, 3]
    assert [(jid, st) for jid, st, _ in stopped] == [("job-1", "migrated")]
    assert "node 3 runs it as job-6" in stopped[0][2]
    assert j.cgroup.calls == []  # never thawed


def test_the_keeper_answers_taken_only_to_the_jobs_node(tmp_path: Path) -> None:
    async def main() -> None:
        agent, c = await started(tmp_path)  # node 1, the keeper of node 2's job K (n2-job-1)
        try:
            src = Source(tmp_path, c, 2, K)
            await src.send(5)
            await src.ctl("keeper", "ckpt-5")
            assert await src.ctl("taken") == {"key": K, "runs": None, "node": None, "state": "keeping"}
            with agent.store.tx() as db:  # node 1 took it over (node 2 was silent) and runs it
                db.execute("UPDATE migrate_replicas SET state='resumed' WHERE key=?", (K,))
            agent.jobs.jobs.append(SimpleNamespace(id="job-9", state="running",
                                                   spec=JobSpec(command=["train"]),
                                                   origin=JobOrigin(migrated_from=K)))
            assert await src.ctl("taken") == {"key": K, "runs": "job-9", "node": 1, "state": "resumed"}
            with agent.store.tx() as db:  # no room here: it placed the job on node 3 instead
                db.execute("UPDATE migrate_replicas SET state='placed', job_id='node 3/job-4' WHERE key=?", (K,))
            agent.jobs.jobs.clear()
            assert await src.ctl("taken") == {"key": K, "runs": "job-4", "node": 3, "state": "placed"}
            with agent.store.tx() as db:  # reclaimed meanwhile, it passed the keeper on to node 3
                db.execute("UPDATE migrate_replicas SET state='passed', job_id='node 3' WHERE key=?", (K,))
            assert await src.ctl("taken") == {"key": K, "runs": None, "state": "passed", "passed_to": 3}
            other = Source(tmp_path, c, 3, K)  # node 3 asking about node 2's job: refused
            with pytest.raises(Exception, match="not one of its jobs"):
                await other.ctl("taken")
            assert await Source(tmp_path, c, 2, "n2-job-77").ctl("taken") == {"key": "n2-job-77", "runs": None,
                                                                              "state": None}
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_the_fenced_set_survives_only_as_json_numbers(tmp_path: Path) -> None:
    """A meta value that is not {job: time} is ignored at start, not a crash."""
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            agent.store.set_meta(FENCE_META, {"job-1": 5.0, "job-2": "x"})
            c.fence.restore()
            assert c.fence.fenced_jobs == {"job-1": 5.0}
            agent.store.set_meta(FENCE_META, ["job-1"])
            c.fence.restore()
            assert c.fence.fenced_jobs == {}
            assert json.dumps(c.fence.fenced_jobs) == "{}"
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_an_old_keeper_still_owed_a_release_is_asked_too(tmp_path: Path) -> None:
    """The keeper changed just before the partition (node 2 -> node 3): node 2, cut off from this
    node first, still keeps the job and took it over. Node 3 says it runs nothing; node 2's
    answer stops the fenced copy. Before, only the current keeper was asked and the fenced copy
    was thawed beside node 2's (bench/chaos.py --fence-after-s, seed 26)."""
    async def main() -> None:
        agent, c = await started(tmp_path)
        j = job("job-1")
        agent.jobs = Jobs([j])
        stopped = agent.jobs.stops()
        asked: list[int] = []

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:  # stand-in: the keepers
            asked.append(node)
            return {"key": body["key"], "runs": "job-9" if node == 2 else None, "state": "keeping"}

        async def release(node: int, key: str) -> None:
            pass

        c._control = control  # type: ignore[method-assign]
        c.prestage.release = release  # type: ignore[method-assign]
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0)
            c.prestage.keeper["job-1"] = 3
            # owed, not due again for an hour (the watch loop's release round leaves it alone)
            c.prestage.releases[(2, "n1-job-1")] = (time.monotonic() + 3600.0, time.monotonic() + 7200.0)
            c.fence.fenced_jobs["job-1"] = time.time() - 40.0
            c.fence.tick(time.time())
            for _ in range(50):
                if stopped:
                    break
                await asyncio.sleep(0.05)
            assert asked == [2]  # (in node order: node 2 answered first)
            assert [(jid, st) for jid, st, _ in stopped] == [("job-1", "migrated")]
            assert "node 2 runs it as job-9" in stopped[0][2] and j.cgroup.calls == []
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_fenced_job_claimed_or_run_from_the_archive_stays_frozen(tmp_path: Path) -> None:
    """A node claimed the job's periodic copy and ran it; the sweep then removed the key's
    directory and left its ``.done`` marker. The fenced copy stays frozen (the runner tells this
    node, op ``superseded``): no keeper is asked, nothing is thawed."""
    async def main() -> None:
        arch = tmp_path / "arch"
        agent, c = await started(tmp_path / "agent")
        j = job("job-1")
        agent.jobs = Jobs([j])
        asked: list[int] = []

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
            asked.append(node)
            return {"key": body["key"], "runs": None, "state": "keeping"}

        c._control = control  # type: ignore[method-assign]
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0, archive_dir=str(arch))
            c.prestage.keeper["job-1"] = 3
            (arch / ".done").mkdir(parents=True)
            (arch / ".done" / "n1-job-1").write_text(json.dumps({"runner": "4"}))  # unsigned: says nothing
            assert c.fence.archive_claimer("n1-job-1") is None
            mark_done(agent_of(3, arch, zone_keys(KEY.hex())), "n1-job-1", 4)
            c.fence.fenced_jobs["job-1"] = time.time() - 40.0
            c.fence.tick(time.time())
            await asyncio.sleep(0.3)
            assert "job-1" in c.fence.fenced_jobs and j.cgroup.calls == [] and asked == []
            (arch / ".done" / "n1-job-1").unlink()  # (no claim: the keeper is asked, and it is thawed)
            c.fence.tick(time.time())
            for _ in range(50):
                if "job-1" not in c.fence.fenced_jobs:
                    break
                await asyncio.sleep(0.05)
            assert asked == [3] and j.cgroup.calls == ["thaw"] and c.fence.fenced_jobs == {}
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_silence_after_a_notice_declares_nothing_while_no_other_member_is_heard_either(tmp_path: Path) -> None:
    """Node 2 announced a reclaim and fell silent 4 s ago (past dead_after_s, 3 s). Node 3 was
    not heard for 5 s either: this node may be the one cut off (for less than fence_after_s), so
    node 2 does not count as dead. Node 3 heard a second ago: it does. Found by the soak (seed 29:
    a node cut off 3 s resumed a job its reclaimed source still ran)."""
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0, dead_after_s=3.0)
            now = time.time()
            c._started = now - 100.0
            c.notices[2] = (now + 60.0, now - 10.0)  # node 2's window ends in a minute
            state = agent.zone.membership.state
            state[2].last_seen, state[3].last_seen = now - 4.0, now - 5.0
            assert not c.fence.isolated(now)
            assert c.takeover.source_dead(2, now) is None
            state[3].last_seen = now - 2.0  # heard only 2 s past node 2's last word (it may be this node that left)
            assert c.takeover.source_dead(2, now) is None
            state[3].last_seen = now - 0.5  # 3.5 s past it: node 2 is the silent one
            c.vouch._vouched[2] = (now, 4.0, True)  # (and node 3 said it has not heard node 2 for 4 s either: vouch.py)
            assert c.takeover.source_dead(2, now) == "node 2 went silent 4.0 s after announcing its reclaim"
            c.s["fence_after_s"] = 0.0  # off: as before
            state[3].last_seen = now - 5.0
            assert c.takeover.source_dead(2, now) == "node 2 went silent 4.0 s after announcing its reclaim"
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_window_end_declares_nothing_until_another_member_is_heard_after_it(tmp_path: Path) -> None:
    """Node 2's reclaim window ended 2 s ago. This node heard node 3 last 5 s ago, before that
    end: it may be the one cut off, and have missed the reclaim's withdrawal (or the job's move),
    so node 2 does not count as gone yet. Once node 3 is heard after the end, it does; and since
    node 2 is heard after its end too (its agent is there to answer), the keeper asks it first.
    Found by the soak (seed 29: a node cut off 5 s before the withdrawal resumed the job at the
    old window's end, beside the copy that ran on at its source)."""
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0, dead_after_s=3.0)
            now = time.time()
            c._started = now - 100.0
            end = now - 2.0
            c.notices[2] = (end, now - 20.0)
            state = agent.zone.membership.state
            state[2].last_seen, state[3].last_seen = now - 5.0, now - 5.0
            assert not c.fence.isolated(now)
            assert c.takeover.source_dead(2, now) is None
            assert c.takeover.source_dead(2, now, end, now - 20.0) is None  # (the keeper message's window too)
            state[3].last_seen = now - 0.5  # heard after the end: this node is not cut off
            assert c.takeover.source_dead(2, now) == "node 2's reclaim window ended"
            row = {"key": "n2-job-1", "src_node": 2, "updated": now - 20.0}
            req = {"window_end": end}
            assert c.takeover.missed_news(row, req, now)  # a keeper round saw it cut off at the end: asks first
            c.takeover._cut_at_end.clear()  # (as for a node that heard others all along)
            state[2].last_seen = end - 1.0  # node 2 heard a second before its end
            assert not c.takeover.missed_news(row, req, now)  # takes over at once
            state[2].last_seen = end - 4.0  # its last word 4 s before the end (past dead_after_s)
            assert c.takeover.missed_news(row, req, now)
            state[2].last_seen = now - 1.0  # heard after its end: its agent is there to answer
            assert c.takeover.missed_news(row, req, now)

            # a window that ended 0.1 s ago, between two summaries (both heard 0.6 s ago): held back
            # until another member is heard after it, but no cut-off is noted, so the keeper then
            # takes over at once (it heard the source just before the end)
            end2 = now - 0.1
            c.notices[2] = (end2, now - 20.0)
            state[2].last_seen, state[3].last_seen = now - 0.6, now - 0.6
            assert c.takeover.source_dead(2, now) is None and c.takeover._cut_at_end == {}
            state[3].last_seen = now - 0.05
            assert c.takeover.source_dead(2, now) == "node 2's reclaim window ended"
            assert not c.takeover.missed_news(row, {"window_end": end2}, now)

            c.s["fence_after_s"] = 0.0  # off: as before
            state[2].last_seen, state[3].last_seen = now - 5.0, now - 5.0
            assert c.takeover.source_dead(2, now) == "node 2's reclaim window ended"
            state[2].last_seen = now - 1.0
            assert not c.takeover.missed_news(row, req, now)

            c.s["fence_after_s"] = 10.0
            del state[3]  # a zone of two: nobody else to hear, the end declares node 2 gone
            assert c.takeover.source_dead(2, now) == "node 2's reclaim window ended"
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_fenced_copy_whose_claim_another_node_took_is_stopped(tmp_path: Path) -> None:
    """This node resumed node 2's job (its origin n2-job-7, its claim in the archive),
    was cut off and fenced it; node 3 counted it gone and took the claim (``running-3.json``) and
    runs the job. The archive's claim is the lock: the fenced copy is stopped, never thawed.
    Before, it was thawed (nobody took *its own* key over) and ran beside node 3's (seed 29)."""
    async def main() -> None:
        arch = tmp_path / "arch"
        agent, c = await started(tmp_path / "agent")
        j = job("job-4", migrated_from="n2-job-7")
        agent.jobs = Jobs([j])
        stopped = agent.jobs.stops()
        released: list[tuple[int, str]] = []

        async def release(node: int, key: str) -> None:
            released.append((node, key))

        c.prestage.release = release  # type: ignore[method-assign]
        c.prestage.keeper["job-4"] = 3  # node 3 keeps this copy too (its own key, n1-job-4)
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0, archive_dir=str(arch))
            claimed_by(arch, tmp_path, "n2-job-7", 3, (3, "job-9"), zone_keys(KEY.hex()))
            c.fence.fenced_jobs["job-4"] = time.time() - 40.0
            c.fence.tick(time.time())
            for _ in range(50):
                if stopped:
                    break
                await asyncio.sleep(0.05)
            assert [(jid, st) for jid, st, _ in stopped] == [("job-4", "migrated")]
            assert "node 3 runs it" in stopped[0][2] and j.cgroup.calls == []
            # node 3 runs the lineage (n2-job-7) but also keeps this copy's own key: released, else
            # it would resume the ended copy when it next takes this node for gone (seed 29)
            await asyncio.sleep(0.1)
            assert released == [(3, "n1-job-4")] and "job-4" not in c.prestage.keeper
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_fenced_copy_the_claimer_placed_here_is_its_claims_own(tmp_path: Path) -> None:
    """Node 3 claimed node 2's job (n2-job-7) from the archive, had no room and placed it here as
    job-4 (its running record's ``resumed`` names node 1 and job-4). This node, cut off, fenced
    it. Healed, the claim is no reason to stop it: it is the claim's copy; its keeper did not take
    it over, so it is thawed. Before, it was stopped for node 3's claim and the job ran nowhere
    any more (bench/chaos.py --partial-partitions, seed 34: a job never finished)."""
    async def main() -> None:
        arch = tmp_path / "arch"
        agent, c = await started(tmp_path / "agent")
        j = job("job-4", migrated_from="n2-job-7")
        agent.jobs = Jobs([j])
        stopped = agent.jobs.stops()

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:  # stand-in: the keeper
            return {"key": body["key"], "runs": None, "state": "keeping"}

        c._control = control  # type: ignore[method-assign]
        c.prestage.keeper["job-4"] = 2
        try:
            c.s.update(orphan_after_s=30.0, fence_after_s=10.0, archive_dir=str(arch))
            claimed_by(arch, tmp_path, "n2-job-7", 3, (1, "job-4"), zone_keys(KEY.hex()))
            c.fence.fenced_jobs["job-4"] = time.time() - 40.0
            c.fence.tick(time.time())
            for _ in range(50):
                if c.fence.fenced_jobs == {}:
                    break
                await asyncio.sleep(0.05)
            assert stopped == [] and j.cgroup.calls == ["thaw"]
            assert j.state == "running" and j.reason.startswith("unfenced: ")
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_control_message_from_a_member_counts_as_hearing_it(tmp_path: Path) -> None:
    """An authenticated control message (its hello's node, checked against the roster) says its
    node is alive as a datagram does: the zone's membership notes it. Before, a keeper that had
    just been sent the source's message could still take the source for silent (its datagrams
    not heard yet after a partition) and take its job over. A real membership (the zone's own
    class) in the zone stand-in."""
    async def main() -> None:
        agent, c = await started(tmp_path)
        try:
            from laminar.zone.membership import Member, Membership

            m = Membership(self_node=1, members=[Member(n, 1, "127.0.0.1", 7440 + n) for n in (1, 2, 3)])
            agent.zone.membership = m
            agent.zone.clock = time.monotonic
            agent.zone.wall = time.time
            assert m.state[2].last_seen < 0
            before = time.time()
            await Source(tmp_path, c, 2, K).ctl("taken")
            assert m.state[2].last_seen >= before and m.state[2].misses == 0
            assert m.state[3].last_seen < 0  # only the node that spoke
        finally:
            await c.stop()
            agent.store.close()

    asyncio.run(main())
