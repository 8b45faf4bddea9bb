"""The end of a job: its main process watched (a pidfd, else ``cgroup.events`` polled), then,
when it is gone, its exit recorded (code, state, reason, end cause), what is left in its cgroup
killed, the cgroups removed (off the loop: a busy cgroup's removal is retried for about a second;
one that cannot be removed is recorded as leaked, `laminar.runtime.leaks`), netguard told, and
whoever waits for it (`JobManager.wait`, a stop) woken. A part of the job manager (``jobs.exits``)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from typing import TYPE_CHECKING

from ..airlock.cgroups import CgroupError
from ..policy import endcause
from .launch import workers_file
from .record import Job

if TYPE_CHECKING:
    from .jobs import JobManager

log = logging.getLogger("laminar.jobs")

# A job whose main process cannot be watched by a pidfd (a reattached job whose main process is
# gone but whose cgroup is not empty; a pidfd_open that failed) is watched by polling
# cgroup.events at this interval; POLLPRI on cgroup.events would do too, this is simpler.
REATTACH_POLL_S = 0.5


class Exits:
    """How the jobs of a :class:`~laminar.runtime.jobs.JobManager` end (``jobs.exits``): the
    watch on each one's main process and what is done when it is gone."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm
        self.popen: dict[str, subprocess.Popen[bytes]] = {}  # the agent's own children, not reaped yet
        self.pidfds: dict[str, int] = {}  # the main processes watched, by job id
        self._waiters: dict[str, asyncio.Event] = {}  # set at a job's end

    def waiter(self, job_id: str) -> asyncio.Event:
        """The event set when job ``job_id`` has ended (made on first ask)."""
        return self._waiters.setdefault(job_id, asyncio.Event())

    def wake(self, job_id: str) -> None:
        """Job ``job_id`` has ended: whoever waits for it goes on."""
        ev = self._waiters.pop(job_id, None)
        if ev is not None:
            ev.set()

    def watch(self, job: Job) -> None:
        jm = self.jm
        assert jm.loop is not None and job.pid is not None
        try:
            fd = os.pidfd_open(job.pid)
        except ProcessLookupError:
            jm._spawn_task(self.on_exit(job.id))
            return
        except OSError as e:
            log.warning("job %s: pidfd_open failed (%s); watching cgroup.events instead", job.id, e)
            jm._spawn_task(self.poll_populated(job.id))
            return
        self.pidfds[job.id] = fd
        jm.loop.add_reader(fd, self.pidfd_ready, job.id)

    def unwatch(self, job_id: str) -> None:
        fd = self.pidfds.pop(job_id, None)
        if fd is not None:
            if self.jm.loop is not None:
                self.jm.loop.remove_reader(fd)
            os.close(fd)

    def unwatch_all(self) -> None:
        """Stop watching every job (the agent stops; the jobs keep running)."""
        for jid in list(self.pidfds):
            self.unwatch(jid)
        self.popen.clear()

    def pidfd_ready(self, job_id: str) -> None:
        jm = self.jm
        self.unwatch(job_id)
        job = jm.jobs.get(job_id)
        if job is not None and job.origin.scheduler is not None:  # adopted: it ends when its cgroup empties
            jm._spawn_task(jm.adoption.watch_populated(job_id))
            return
        jm._spawn_task(self.on_exit(job_id))

    async def poll_populated(self, job_id: str) -> None:
        # Until the cgroup empties, also while the job is being stopped: a stop records its state
        # first and then waits its grace, which ending the watch at once (teardown: kill) cut short.
        jm = self.jm
        job = jm.jobs.get(job_id)
        while job is not None and jm.jobs.get(job_id) is job and job.cgroup.populated():
            await asyncio.sleep(REATTACH_POLL_S)
        await self.on_exit(job_id)

    async def on_exit(self, job_id: str) -> None:
        """The main process is gone: record the exit code, kill leftovers, remove cgroups."""
        jm = self.jm
        job = jm.jobs.get(job_id)
        if job is None:
            return
        self.unwatch(job_id)
        proc = self.popen.pop(job_id, None)
        # Never wait() here: in the event loop that would freeze the agent for as long as a main
        # process the stop's kill could not end lives on (see stop). When its pidfd fired it has
        # exited and poll() reaps it; otherwise its code is unknown.
        code = proc.poll() if proc is not None else None
        if job.origin.scheduler is not None:  # adopted: the code its scheduler's side told, if any
            code = job.exit_code
            if job.active:
                job.reason = jm.adoption.end_reason(job)
        if job.active:
            job.state = "exited"
            job.end_cause = endcause.exited(code)
            job.reason = job.reason or (f"exit code {code}" if code is not None else "exited (adopted: exit code unknown)")
            if code == 126 and job.reason == "exit code 126":
                # The shell could not exec the command; with an empty log that is most often
                # ENOMEM at a full memory limit (exec's kernel charges are not held like faults).
                # A class with a cap admits only what fits (airlock.admission), so this is a
                # class without one, overcommitted up to Airlock's usage-based cap.
                job.reason += (" (the command could not be executed; see its log, and whether its class was at its "
                               "memory limit: give the class a cap, policy class_caps_mb, so jobs queue instead)")
        job.exit_code = code
        job.ended = time.time()
        await self.teardown(job)
        jm.table.persist(job)
        jm.jobs.pop(job_id, None)
        jm._emit("job", f"job {job_id} {job.state}: {job.reason}", job=job_id, state=job.state, exit_code=code,
                 end_cause=None if job.end_cause is None else str(job.end_cause), by_uid=job.owner_uid,
                 work_lost_s=job.work_lost_s)
        self.wake(job_id)
        jm.admit()  # its charge is gone with its cgroup: room for the queue
        jm.pruner.prune_ended()

    async def teardown(self, job: Job) -> None:
        """Kill what is left in the cgroup, wait for it to empty, remove it, unregister, and
        remove the job's workers file (and a temporary one a crash left) if it has one."""
        jm = self.jm
        try:
            if job.cgroup.exists() and job.cgroup.populated():
                job.cgroup.kill()
                for _ in range(200):
                    if not job.cgroup.populated():
                        break
                    await asyncio.sleep(0.01)
        except CgroupError as e:
            log.warning("job %s: cgroup cleanup: %s", job.id, e)
        try:
            # rmdir of a busy directory is retried for ~1 s (cgroups._rmdir_retry): not on the loop
            await asyncio.to_thread(job.cgroup.remove)
        except CgroupError as e:
            log.warning("job %s: cgroup cleanup: %s", job.id, e)
            jm.leaks.record(job, str(e))
        if jm.netguard is not None:
            try:
                jm.netguard.unregister_job(job.cgroup_id)
            except Exception as e:
                log.debug("job %s: netguard.unregister_job: %s", job.id, e)
        jm.adoption.ended(job)
        if job.spec.elastic_min is not None and jm.state_dir is not None:
            workers = workers_file(jm.state_dir, job.id)
            for f in (workers, workers.with_suffix(".tmp")):
                try:
                    f.unlink(missing_ok=True)
                except OSError as e:
                    log.warning("job %s: cannot remove %s: %s", job.id, f, e)
