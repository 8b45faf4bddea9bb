"""While a job's lineage is unsettled, who keeps it does not change, a keeper that took it over
is heard, and a keeper resumes a job stopped for good. Five holes the soak found
(bench/chaos.py --no-archive --concurrent 2, seed 43: a job ran twice for 3,595 steps, and a
fenced copy was thawed beside a take-over; seed 44: a job resumed 76 s late):

- a fenced job is not prestaged: a new keeper would know nothing of a take-over and the old one
  (the one that may have made it, and the one the fence's settling asks) would be released;
- a prestage in flight when its job is stopped for a take-over (``superseded``) withdraws the
  keeper it sends after: else that node keeps a job no longer run here, and takes it over the
  next time this node falls silent, beside the copy that superseded it;
- a keeper that took the job over and placed it on another node answers a ``release`` with
  ``superseded`` naming that node (as ``taken`` does), and the source believes it while the
  release is on its way;
- a reclaim moves a fenced job only once its fence is settled (a move is refused meanwhile);
- a keeper whose source stopped the job for good while the keeper could not hear it (the source
  rebooted: ``lost``; its window ended while the keeper's agent was down: ``reclaimed``) resumes
  it once it hears the source again, instead of waiting for the source's next silence;
- (and one the same logs showed) a prestage whose checkpoint the job's own rotation removed
  under it does not make the peer avoided.

Real pieces (the rig of test_gc_keepers): migrate components of node 1, node 2 (the source) and
node 3, each on its own SQLite store with its endpoint on 127.0.0.<node>; the source's own
prestage, real transfers and real authenticated ``keeper``, ``release`` and ``superseded``
answers. Stand-ins, named as such: the zone (``Zone``), the job managers (``Jobs`` with a
``stop`` that records); in the reclaim test, the zone (``HeldZone``) and the job manager
(``RestoreJobs``) of test_reclaim_cancel_unit, and the move (recorded, not run) where the test is
when a move begins, and the fence's settling (one that has not ended). The whole fence over real agents and a real partition:
tests/cluster/test_fence.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from jobrig import until
from test_gc_keepers import Jobs, K, free_port, held, job_of, node, prestage_round, run, state
from test_migrate_evidence import make_agent
from test_reclaim_cancel_unit import HeldZone
from test_reclaim_restore import RestoreJobs

from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent
from laminar.policy.endcause import EndCause
from laminar.runtime.record import LOST_WITH_CGROUP


class StoppingJobs(Jobs):
    """Stand-in job manager whose ``stop`` ends the job and records (id, state)."""

    def __init__(self, jobs: list[Any]) -> None:
        super().__init__(jobs)
        self.stopped: list[tuple[str, str]] = []

    async def stop(self, jid: str, reason: str, *, grace_s: float | None = None, state: str = "stopped",
                   cause: Any = None) -> Any:
        j = self.get(jid)
        j.state, j.end_cause = state, cause
        self.stopped.append((jid, state))
        return j


def running(tmp: Path) -> tuple[int, Any, StoppingJobs]:
    """A port for the nodes' endpoints, node 2's job-1 (running for a minute) and its manager."""
    job = job_of(tmp)
    job.started = time.time() - 60
    return free_port(), job, StoppingJobs([job])


def save(job: Any, step: int) -> None:
    Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False, keep=10).save(
        f"weights-{step}".encode(), step=step)


async def kept_by_node_1(src: ReclaimComponent, n1: ReclaimComponent, job: Any) -> None:
    """Node 2 (``src``) prestages its job's checkpoint 5 to node 1, which keeps it then."""
    src.prestage.set_keeper("job-1", 1)
    save(job, 5)
    await prestage_round(src)
    assert await until(lambda: state(n1) == "keeping", timeout=20)


def test_a_fenced_job_is_not_prestaged_so_its_keeper_does_not_change(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as n1, node(tmp_path, 3, [1, 2, 3], port) as n3, \
                node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
            src.prestage.set_keeper("job-1", 1)
            save(job, 5)
            await prestage_round(src)
            assert await until(lambda: src.prestage.shipped.get("job-1") == "ckpt-5", timeout=20)
            assert state(n1) == "keeping"
            # cut off: the job is fenced. Its next checkpoint (written before the freeze took)
            # would go to node 3 (node 1 avoided, as after a failed prestage)
            src.fence.fenced_jobs["job-1"] = time.time()
            src.prestage.avoid("job-1", 1, 60.0)
            save(job, 10)
            await prestage_round(src)
            await asyncio.sleep(1.0)
            assert not src.prestage.prestaging and src.prestage.shipped.get("job-1") == "ckpt-5"
            assert src.prestage.keeper["job-1"] == 1 and state(n1) == "keeping"  # node 1 still keeps it: it is asked
            assert state(n3) is None and held(n3) == []
            assert not any(k == K for _, k in src.prestage.releases)
            # settled (thawed: nobody took it over): prestaged again, to node 3 now
            del src.fence.fenced_jobs["job-1"]
            await prestage_round(src)
            assert await until(lambda: src.prestage.shipped.get("job-1") == "ckpt-10", timeout=20), src.prestage.shipped
            assert src.prestage.keeper["job-1"] == 3 and state(n3) == "keeping"

    run(main())


def test_a_keeper_a_prestage_sends_after_its_job_was_superseded_is_withdrawn(tmp_path: Path) -> None:
    port, job, jobs = running(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as n1, node(tmp_path, 2, [1, 2, 3], port, jobs) as src:
            real_keeper = src.mover.send_keeper

            async def keeper(j: Any, n: int, ckpt_name: str, take_over: bool = False) -> None:
                # node 3, which took the job over while node 2 was silent, says so while the
                # prestage's checkpoint is at node 1 and its keeper not yet sent
                src._superseding.add(j.id)
                await src.replicas.stop_superseded(j, 3, "job-4", K)
                await real_keeper(j, n, ckpt_name, take_over)

            src.mover.send_keeper = keeper  # type: ignore[method-assign]
            save(job, 5)
            await prestage_round(src)
            assert await until(lambda: not src.prestage.prestaging, timeout=20)
            assert jobs.stopped == [("job-1", "migrated")]
            assert await until(lambda: state(n1) == "released", timeout=20), state(n1)
            assert "job-1" not in src.prestage.keeper and not src.prestage.releases

    run(main())


def test_a_keeper_that_placed_the_job_elsewhere_answers_the_release_with_where(tmp_path: Path) -> None:
    port, job, jobs = running(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as n1, node(tmp_path, 2, [1, 2, 3], port, jobs) as src:
            await kept_by_node_1(src, n1, job)
            # node 2 was silent: node 1 took the job over and, with no room, placed it on node 3
            with n1.agent.store.tx() as db:
                db.execute("UPDATE migrate_replicas SET state='placed', job_id='node 3/job-4', updated=? WHERE key=?",
                           (time.time() - 10, K))
            # meanwhile node 2 handed the keeper to another keeper and releases node 1
            src.prestage.set_keeper("job-1", 4)
            await src.prestage.release(1, K)
            assert await until(lambda: bool(jobs.stopped), timeout=10)
            assert jobs.stopped == [("job-1", "migrated")]
            ev = [str(e["message"]) for e in src.agent.store.db.execute("SELECT message, fields FROM events").fetchall()
                  if '"superseded"' in e["fields"]]
            assert ev and "node 3 took it over as job-4" in ev[0], ev
            assert (1, K) not in src.prestage.releases

    run(main())


def test_a_reclaim_moves_a_fenced_job_only_once_its_fence_is_settled(tmp_path: Path) -> None:
    async def main() -> None:
        agent = make_agent(tmp_path)
        agent.jobs = jobs = RestoreJobs()
        agent.zone = HeldZone()
        settles = jobs.add("job-1", "running")
        jobs.add("job-2", "running")  # its fence is never settled
        comp = ReclaimComponent()
        await comp.start(agent)
        moved: list[str] = []
        real_move = comp.mover.move

        async def move(job: Any, reason: str, deadline_mono: float | None, final: bool = True,
                       transfer_deadline: float | None = None) -> Any:
            moved.append(job.id)

        async def unsettled(jid: str) -> None:  # stand-in: a settling whose keeper does not answer yet
            comp.fence._unfencing.discard(jid)

        comp.fence._unfence = unsettled  # type: ignore[method-assign]
        try:
            now = time.time()
            comp.fence.fenced_jobs.update({"job-1": now, "job-2": now})
            # a move of a fenced job is refused, and leaves it as it was (frozen by its fence)
            mv = await real_move(settles, "lm-t", None)
            assert mv.phase == "failed" and "job-1 is fenced" in str(mv.error), mv
            assert settles.cgroup.thawed == 0 and settles.active
            assert "job-1" not in comp.evacuating
            comp.mover.move = move  # type: ignore[method-assign]
            comp.ckpt_latency.update({"job-1": 60.0, "job-2": 60.0})  # signalled at once
            comp.evacuation.start(2.0, "lm-t owner")
            await asyncio.sleep(0.8)
            assert moved == [], "a fenced job is not moved before its fence is settled"
            del comp.fence.fenced_jobs["job-1"]  # settled: thawed, nobody took it over
            assert await until(lambda: moved == ["job-1"], timeout=5), moved
            assert await until(lambda: "job-2" in jobs.stops, timeout=5)
            assert moved == ["job-1"] and jobs.stops["job-2"] == "reclaimed"  # stopped at the window's end
            assert jobs.causes["job-2"] == EndCause.WINDOW_ENDED
        finally:
            await comp.stop()
            agent.store.close()

    asyncio.run(main())


def test_a_keeper_resumes_a_job_its_source_stopped_for_good_while_it_could_not_hear(tmp_path: Path) -> None:
    """Node 2 rebooted faster than ``orphan_after_s`` (or its reclaim window ended while its
    keeper's agent was down): its job is ``lost`` there and nobody took it over. Once node 1, the
    keeper, hears node 2 again after the silence (or first hears it after its own start), it asks
    (``needs``) and, told the job was stopped for good there, makes its keeper a take-over. Before,
    it kept on until node 2's next silence (bench/chaos.py --no-archive, seed 44: 76 s and an
    older replica), or for ever."""
    port, job, jobs = running(tmp_path)

    def request(comp: ReclaimComponent) -> dict[str, Any]:
        row = comp.agent.store.db.execute("SELECT request FROM migrate_replicas WHERE key=?", (K,)).fetchone()
        return dict(json.loads(row["request"]))

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as n1, node(tmp_path, 2, [1, 2, 3], port, jobs) as src:
            await kept_by_node_1(src, n1, job)
            events: list[dict[str, Any]] = []
            n1.agent.events.subscribe(events.append)
            n1.replicas.recheck_keepers(time.time())  # first heard since its start: asked; the job runs
            assert await until(lambda: K not in n1.replicas._keeper_checking and K in n1.replicas.keeper_asked, timeout=10)
            assert not request(n1).get("take_over") and state(n1) == "keeping"
            heard = n1.zone.membership.state[2]

            async def silent_then_heard() -> None:
                heard.last_seen = time.time() - 20.0  # silent for 20 s (less than orphan_after_s) ...
                n1.replicas.recheck_keepers(time.time())
                await asyncio.sleep(0.3)
                assert not request(n1).get("take_over")
                heard.last_seen = time.time()  # ... and heard again: asked
                n1.replicas.recheck_keepers(time.time())
                assert K in n1.replicas._keeper_checking  # (its question spawned; answered below)
                assert await until(lambda: K not in n1.replicas._keeper_checking, timeout=10)

            # its processes ended while node 2's agent was down, its cgroup still there: it may
            # have finished by itself, and is not resumed elsewhere
            job.state, job.reason = "lost", "ended while the agent was down (exit code unknown)"
            job.end_cause = EndCause.ENDED_WHILE_DOWN
            await silent_then_heard()
            assert not request(n1).get("take_over")
            job.reason = LOST_WITH_CGROUP  # node 2's agent found its cgroup gone: the node rebooted
            job.end_cause = EndCause.LOST_WITH_CGROUP
            n1.replicas.recheck_keepers(time.time())  # heard all along: not asked again
            await asyncio.sleep(0.5)
            assert not request(n1).get("take_over")
            await silent_then_heard()
            assert await until(lambda: bool(request(n1).get("take_over")), timeout=10), request(n1)
            assert request(n1)["stopped_there"] == "lost" and state(n1) == "keeping"
            ev = [e for e in events if e.get("phase") == "stopped-there"]
            assert len(ev) == 1 and "node 2 says the job was lost there" in ev[0]["message"], ev

    run(main())


def test_a_checkpoint_the_job_rotated_away_mid_prestage_is_no_fault_of_the_peer(tmp_path: Path) -> None:
    """The job's own rotation (jobkit's ``keep``) removed the checkpoint a prestage was sending:
    the peer is not avoided for it (before, it was, for PRESTAGE_FAIL_AVOID_S: seed 44's logs),
    while a failure at the peer still is."""
    port, job, jobs = running(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 2, [1, 2, 3], port, jobs) as src:
            src.prestage.set_keeper("job-1", 1)
            failures = [FileNotFoundError(2, "No such file or directory", str(job.ckpt_dir / "ckpt-5" / "data")),
                        ConnectionRefusedError(111, "Connect call failed")]

            async def send(*a: Any, **kw: Any) -> str:
                raise failures.pop(0)

            src.mover.send = send  # type: ignore[method-assign]
            save(job, 5)
            await prestage_round(src)
            assert await until(lambda: not src.prestage.prestaging, timeout=10)
            assert len(failures) == 1 and 1 not in src.prestage.avoided("job-1")
            save(job, 6)
            await prestage_round(src)
            assert await until(lambda: not failures and not src.prestage.prestaging, timeout=10)
            assert 1 in src.prestage.avoided("job-1") and src.prestage.keeper["job-1"] == 1

    run(main())
