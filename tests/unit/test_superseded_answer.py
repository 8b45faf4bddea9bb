"""The source's side of ``superseded`` (``Replicas.answer_superseded``): a keeper that
took a job over after a silence says it runs it now. The source stops only a copy that still
runs and started before the take-over, only on the word of the node that runs it, and reads
the take-over's instant in its own clock. Real component methods over stand-ins of the job
manager (named as such: ``Jobs``, ``Job``) and a stand-in for the job's stop.
(The whole path over two real agents and a real partition:
tests/cluster/test_partition_heal_superseded.py.)"""

from __future__ import annotations

import asyncio
import time
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
from standin_agent import standin_agent
from standin_origin import OriginQueries

from laminar.components import MigrateAgent
from laminar.migrate.prestage import Prestage
from laminar.migrate.replicas import Replicas
from laminar.policy.endcause import EndCause


@dataclass
class Job:  # stand-in: what answer_superseded reads of a job
    id: str
    started: float | None
    state: str = "running"
    exit_code: int | None = None

    @property
    def active(self) -> bool:
        return self.state in ("running", "suspended")


@dataclass
class Jobs(OriginQueries):  # stand-in job manager: stop records what it was asked
    jobs: dict[str, Job]
    stopped: list[tuple[str, str, str]] = field(default_factory=list)
    causes: dict[str, Any] = field(default_factory=dict)  # job: the end cause its stop was given

    def get(self, jid: str) -> Job | None:
        return self.jobs.get(jid)

    async def stop(self, jid: str, reason: str, *, grace_s: float | None = None, state: str = "stopped",
                   cause: Any = None) -> Job:
        self.stopped.append((jid, state, reason))
        self.causes[jid] = cause
        self.jobs[jid].state = state
        return self.jobs[jid]


class Lane:  # stand-in for the archive's lane: runs the call at once
    def call(self, what: str, fn: Any, *args: Any) -> asyncio.Future[Any]:
        f = asyncio.get_running_loop().create_future()
        f.set_result(fn(*args))
        return f


def source(jobs: Jobs) -> Any:
    """Node 2 with its keepers map (its real part ``prestage``, whose keeper forgets and releases
    are recorded); its replicas part (the methods under test) on it."""
    events: list[dict[str, Any]] = []
    released: list[tuple[int, str]] = []
    tasks: list[asyncio.Task[Any]] = []
    src = types.SimpleNamespace(node_id=2, agent=standin_agent(MigrateAgent, jobs=jobs), evacuating=set(),
                                _superseding=set(), events=events, released=released,
                                archive_dir=None, runner=None)
    src.prestage = Prestage(src)
    src.prestage.keeper = {"job-1": 3}
    src.prestage.releases[(1, "n2-job-1")] = (0.0, 0.0)  # node 1: its old keeper, owed a release
    src.archive = types.SimpleNamespace(lane=Lane(), root=lambda: src.archive_dir, runner=lambda key: src.runner)
    src._emit = lambda message, **kw: events.append({"message": message, **kw})
    src._spawn = lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1]

    def forget(jid: str) -> int | None:
        return src.prestage.keeper.pop(jid, None)

    async def release(node: int, key: str) -> None:
        released.append((node, key))

    src.prestage.forget_keeper = forget
    src.prestage.release = release
    src.tasks = tasks
    src.replicas = Replicas(src)  # the part under test, on the stand-in component
    return src


def body(at: float, node: int = 1, clock: float | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"key": "n2-job-1", "node": node, "job": "job-9", "at": at}
    if clock is not None:
        b["clock"] = clock
    return b


def test_a_copy_that_ran_on_through_the_take_over_is_stopped_and_its_other_keeper_released() -> None:
    async def main() -> None:
        now = time.time()
        jobs = Jobs({"job-1": Job("job-1", started=now - 600)})
        src = source(jobs)
        ans = src.replicas.answer_superseded("1", body(now - 30, clock=now))
        assert ans["stopped"] == "job-1", ans
        assert src.replicas.answer_superseded("1", body(now - 30, clock=now))["stopped"] == "job-1"  # asked again: once
        await asyncio.gather(*src.tasks)
        assert [(j, st) for j, st, _ in jobs.stopped] == [("job-1", "migrated")]
        assert jobs.causes == {"job-1": EndCause.SUPERSEDED}  # another node's copy runs it
        assert "node 1 runs it as job-9" in jobs.stopped[0][2]
        assert src.released == [(3, "n2-job-1")] and src.prestage.keeper == {}  # node 3 kept it meanwhile
        assert [e["phase"] for e in src.events] == ["superseded"]
        assert src.replicas.answer_superseded("1", body(now - 30))["stopped"] is None  # it no longer runs

    asyncio.run(main())


def test_a_job_started_after_the_take_over_is_another_job_and_is_left_alone() -> None:
    """A node whose state was wiped numbers its jobs again: ``n2-job-1`` is a new job."""
    now = time.time()
    jobs = Jobs({"job-1": Job("job-1", started=now - 10)})
    src = source(jobs)
    ans = src.replicas.answer_superseded("1", body(now - 30))
    assert ans["stopped"] is None and "started after" in ans["why"], ans
    assert not src.tasks and jobs.stopped == []


def test_the_take_over_instant_is_read_in_the_sources_clock() -> None:
    """The keeper's clock runs 120 s behind: its take-over 60 s ago reads 180 s ago raw. A job
    started 90 s ago started before the take-over (stopped); read raw, it would have seemed to
    start after it. And the other way round with a keeper's clock ahead."""
    async def main() -> None:
        now = time.time()
        jobs = Jobs({"job-1": Job("job-1", started=now - 90)})
        src = source(jobs)
        keeper_now = now - 120
        assert src.replicas.answer_superseded("1", body(keeper_now - 60, clock=keeper_now))["stopped"] == "job-1"
        await asyncio.gather(*src.tasks)
        jobs2 = Jobs({"job-1": Job("job-1", started=now - 90)})
        src2 = source(jobs2)
        keeper_ahead = now + 120  # its clock runs ahead: its take-over 100 s ago was 100 s ago here too,
        # after the job's start (90 s ago): another job; read raw (20 s in the future) it would be stopped
        assert src2.replicas.answer_superseded("1", body(keeper_ahead - 100, clock=keeper_ahead))["stopped"] is None

    asyncio.run(main())


def test_a_node_that_does_not_keep_the_job_is_believed_only_when_the_archive_names_it() -> None:
    """Node 4 never kept ``n2-job-1``: without an archive its word stops nothing; with one,
    the job stops only when the archive names node 4 the runner of its claim."""
    async def main() -> None:
        now = time.time()
        jobs = Jobs({"job-1": Job("job-1", started=now - 600)})
        src = source(jobs)
        ans = src.replicas.answer_superseded("4", body(now - 30, node=4))
        assert ans["stopped"] is None and "neither keeps" in ans["why"] and not src.tasks, ans
        src.archive_dir = "/archive"
        src.runner = "5"  # the archive says node 5 claimed it
        ans = src.replicas.answer_superseded("4", body(now - 30, node=4))
        assert ans["stopped"] is None and ans["checks"] == "job-1", ans
        await asyncio.gather(*src.tasks)
        assert jobs.stopped == [] and jobs.jobs["job-1"].state == "running" and src.events == []
        src.runner = "4"
        src.replicas.answer_superseded("4", body(now - 30, node=4))
        await asyncio.gather(*src.tasks)
        assert [(j, st) for j, st, _ in jobs.stopped] == [("job-1", "migrated")]
        assert jobs.causes == {"job-1": EndCause.SUPERSEDED}  # another node's copy runs it

    asyncio.run(main())


def test_only_the_node_that_runs_the_job_may_say_so_and_a_bad_body_is_refused() -> None:
    now = time.time()
    jobs = Jobs({"job-1": Job("job-1", started=now - 600)})
    src = source(jobs)
    with pytest.raises(ValueError, match="node 4 cannot speak for node 1"):  # node 4 does not keep it
        src.replicas.answer_superseded("4", body(now))
    for bad in ({"key": "n2-job-1", "node": 1, "job": "job-9"}, {"key": "n2-job-1", "node": 1, "job": "job-9", "at": "x"},
                {"key": "n2-job-1", "node": 1, "job": "job-9", "at": float("nan")}):
        with pytest.raises(ValueError):
            src.replicas.answer_superseded("1", bad)
    assert src.replicas.answer_superseded("1", {**body(now), "key": "n5-job-1"})["stopped"] is None  # not a job of node 2
    assert not src.tasks and jobs.stopped == [] and jobs.jobs["job-1"].state == "running"


def test_a_release_answered_with_superseded_stops_the_copy_as_the_op_would() -> None:
    """After the heal the source's release of its old keeper (node 1, not reached during the
    partition) may arrive before node 1's ``superseded``: node 1's answer to it says it runs the
    job, and the source stops its copy on it, while node 1 still counts as the keeper owed the
    release. Before the release is dropped, not after: else nothing would vouch for node 1."""
    async def main() -> None:
        now = time.time()
        jobs = Jobs({"job-1": Job("job-1", started=now - 600)})
        src = source(jobs)
        src.prestage.keeper = {"job-1": 3}
        src.prestage._release_void = lambda node, key: False
        src.prestage.owe_release = lambda node, key: None
        src.prestage.drop_release = lambda pair: src.prestage.releases.pop(pair, None)

        sent: list[tuple[int, str]] = []

        async def control(node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
            sent.append((node, op))
            if node != 1:
                return {"released": body["key"]}
            return {"released": body["key"], "superseded": {"node": 1, "job": "job-9", "at": now - 30, "clock": now}}

        src._control = control
        src.prestage.release = types.MethodType(Prestage.release, src.prestage)
        await src.prestage.release(1, "n2-job-1")
        while not all(t.done() for t in src.tasks):  # the stop, and the release of node 3 it spawns
            await asyncio.gather(*src.tasks)
        assert [(j, st) for j, st, _ in jobs.stopped] == [("job-1", "migrated")]
        assert jobs.causes == {"job-1": EndCause.SUPERSEDED}  # another node's copy runs it
        assert src.prestage.releases == {} and [e["phase"] for e in src.events] == ["superseded"]
        assert sent == [(1, "release"), (3, "release")]  # node 3, its keeper meanwhile, no longer keeps it

    asyncio.run(main())


def test_the_keeper_speaks_for_the_node_it_placed_the_job_on() -> None:
    """Node 3, the job's keeper, took it over with no room of its own and placed it on node 1
    (its replica state ``placed``): it tells the source that node 1 runs it. Before, only the node
    running the job could say so, and it never did (its job came by a hand-over: it keeps no
    keeper row), so the source's copy ran on beside it to its end (bench/chaos.py
    --fence-after-s, seed 27)."""
    async def main() -> None:
        now = time.time()
        jobs = Jobs({"job-1": Job("job-1", started=now - 600)})
        src = source(jobs)
        ans = src.replicas.answer_superseded("3", body(now - 30, node=1, clock=now))
        assert ans["stopped"] == "job-1" and "node 1 runs it as job-9" in ans["why"], ans
        await asyncio.gather(*src.tasks)
        assert [(j, st) for j, st, _ in jobs.stopped] == [("job-1", "migrated")]
        assert jobs.causes == {"job-1": EndCause.SUPERSEDED}  # another node's copy runs it
        assert "node 1 runs it as job-9" in jobs.stopped[0][2]

    asyncio.run(main())


def test_a_source_that_checks_the_archive_is_asked_again_until_it_stops_its_copy() -> None:
    """The source of a job taken over from the archive stops its copy only once the archive names
    the taker its runner; it read none once while the claim was being published (CI, a real
    partition: tests/cluster/test_partition_heal_superseded.py), answered "checks", and the
    taker took that for told: both copies ran on. The taker asks again until the copy stops."""
    import math

    from laminar.migrate.takeover import SUPERSEDED_TRIES, Takeover

    answers = [{"key": "n1-job-1", "stopped": None, "checks": "job-1"},
               {"key": "n1-job-1", "stopped": "job-1", "why": "job-1 stopped"}]
    asked: list[tuple[int, str, dict[str, Any]]] = []

    async def control(node: int, op: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
        asked.append((node, op, body))
        return answers[len(asked) - 1]

    host = types.SimpleNamespace(_control=control, node_id=3, _emit=lambda *a, **k: None)
    t = Takeover(host)  # type: ignore[arg-type]

    async def go() -> None:
        t._superseded_next["n1-job-1"] = (math.inf, 1)
        await t._tell_superseded("n1-job-1", 1, "job-1", time.time() - 5)
        due, tries = t._superseded_next["n1-job-1"]
        assert math.isfinite(due) and tries == 1, "checked in the archive, not stopped yet: asked again"
        await t._tell_superseded("n1-job-1", 1, "job-1", time.time() - 5)
        assert t._superseded_next["n1-job-1"] == (math.inf, SUPERSEDED_TRIES), "stopped: told"

    asyncio.run(go())
    assert [(n, op) for n, op, _ in asked] == [(1, "superseded"), (1, "superseded")]
