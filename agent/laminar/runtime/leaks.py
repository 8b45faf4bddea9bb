"""Cgroups of ended jobs that could not be removed yet (a process that cannot die yet: in
uninterruptible sleep on hung storage, or frozen by a v1 freezer someone else set): recorded
(table ``jobs_leaked_cgroups``, a ``job`` event), counted (``laminar_jobs_leaked_cgroups``,
``laminar_jobs_cgroups_leaked_total``), and swept (:meth:`LeakedCgroups.sweep`: what is left
killed, the directories removed) every ``jobs.leak_sweep_s`` and at the agent's start until
they are gone."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from ..airlock.cgroups import CgroupError, JobCgroup
from .record import Job

if TYPE_CHECKING:
    from .jobs import JobManager


log = logging.getLogger("laminar.jobs")


class LeakedCgroups:
    """The leaked cgroups of a :class:`~laminar.runtime.jobs.JobManager` (``jobs.leaks``), in its
    store, its metrics registry and its events."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm
        self._gauge: Any = None
        self._counter: Any = None

    def init_metrics(self) -> None:
        """The gauge and the counter, in the manager's prometheus registry (one of its own when none)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if self._gauge is not None:  # started again (tests): the metrics exist
            return
        if self.jm.metrics is None:
            self.jm.metrics = CollectorRegistry()
        self._gauge = Gauge("laminar_jobs_leaked_cgroups", "Ended jobs whose cgroups could not be removed yet "
                                 "(retried by the sweep)", registry=self.jm.metrics)
        self._counter = Counter("laminar_jobs_cgroups_leaked", "Job cgroups whose removal failed at teardown "
                                     "(each then retried until gone)", registry=self.jm.metrics)
        self._gauge.set(len(self.rows()))  # set on every change (never read from the scrape's thread)

    def rows(self) -> list[dict[str, Any]]:
        """The leaked cgroups: job_id, job_class, since, tries, error."""
        return [dict(r) for r in self.jm.store.db.execute("SELECT * FROM jobs_leaked_cgroups ORDER BY since")]

    def record(self, job: Job, error: str) -> None:
        """The job's cgroups could not be removed: remember them for the sweep."""
        with self.jm.store.tx() as db:
            db.execute("INSERT INTO jobs_leaked_cgroups(job_id, job_class, since, tries, error) VALUES(?, ?, ?, 1, ?) "
                       "ON CONFLICT(job_id) DO UPDATE SET tries = tries + 1, error = excluded.error",
                       (job.id, job.spec.job_class, time.time(), error))
        if self._counter is not None:
            self._counter.inc()
            self._gauge.set(len(self.rows()))
        self.jm._emit("job", f"job {job.id}: its cgroup could not be removed ({error}); kept as leaked and retried "
                   f"every {self.jm.leak_sweep_s:g} s until it is gone", job=job.id, leaked_cgroup=str(job.cgroup.unified),
                   error=error)

    async def sweep(self) -> int:
        """Kill what is left in each leaked cgroup and remove it (in a worker thread); returns
        how many are still leaked. A removed one leaves the table with a ``job`` event."""
        assert self.jm.tree is not None
        for row in self.rows():
            try:
                cg = self.jm.tree.job(row["job_class"], row["job_id"])
            except CgroupError as e:  # a class this agent no longer has: say so, keep the record
                log.warning("leaked cgroup of %s: %s", row["job_id"], e)
                continue
            try:
                await asyncio.to_thread(self._kill_and_remove, cg)
            except CgroupError as e:
                with self.jm.store.tx() as db:
                    db.execute("UPDATE jobs_leaked_cgroups SET tries = tries + 1, error = ? WHERE job_id = ?",
                               (str(e), row["job_id"]))
                continue
            with self.jm.store.tx() as db:
                db.execute("DELETE FROM jobs_leaked_cgroups WHERE job_id = ?", (row["job_id"],))
            self.jm._emit("job", f"job {row['job_id']}: leaked cgroup removed after {row['tries'] + 1} tries "
                       f"({time.time() - row['since']:.0f} s)", job=row["job_id"], leaked_cgroup=str(cg.unified),
                       removed=True)
        left = len(self.rows())
        if self._gauge is not None:
            self._gauge.set(left)
        return left

    async def sweep_loop(self) -> None:
        """Now, then every ``jobs.leak_sweep_s``: the sweep (the previous agent's leaks first), and
        the pruning of ended jobs' records (`laminar.runtime.prune`: the age rule holds on an idle
        node too). Never returns; a failed sweep is logged."""
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("leaked cgroup sweep failed")
            self.jm.pruner.prune_ended()  # the age rule holds on an idle node too
            await asyncio.sleep(self.jm.leak_sweep_s)

    @staticmethod
    def _kill_and_remove(cg: JobCgroup) -> None:
        """Blocking (run in a thread): cgroup.kill what is left (a process that could not die
        before may now), then remove the directories. CgroupError while something remains."""
        if cg.populated():
            cg.kill()
            for _ in range(100):
                if not cg.populated():
                    break
                time.sleep(0.01)
        cg.remove()
