"""What a restarted agent does with the jobs it finds (reattach): the store's jobs that had not
ended when the previous agent went down are taken up again. A job whose cgroup still holds
processes is watched again (by its main process's pidfd, or, that process gone, by polling
``cgroup.events``, `laminar.runtime.exits.REATTACH_POLL_S`; an adopted job by its own watch,
`laminar.runtime.adopt`); a queued job stays queued; a stop the previous agent had begun is
finished; the rest are recorded as lost (or failed, if they were starting), what is left of them
killed and their cgroups removed. A part of the job manager (``jobs.reattach``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..airlock.cgroups import CgroupError
from ..policy import endcause
from ..policy.endcause import EndCause
from .record import LIVE_STATES, LOST_WITH_CGROUP, QUEUED

if TYPE_CHECKING:
    from .jobs import JobManager

log = logging.getLogger("laminar.jobs")


class Reattach:
    """The jobs a :class:`~laminar.runtime.jobs.JobManager` finds at its start (``jobs.reattach``)."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm

    def all(self) -> None:
        """Reattach stored active jobs whose cgroups still hold processes; mark the rest lost.
        Queued jobs stay queued, in their order (they start once Airlock gives the caps).
        A job the previous process had begun to stop (stopped, reclaimed, ... with no end
        recorded: it died inside the grace) has its stop finished: what is left of it is
        killed, its cgroups removed and its end recorded, keeping the state and reason."""
        jm = self.jm
        rows = jm.store.db.execute("SELECT * FROM jobs WHERE state IN ('queued', 'running', 'suspended', 'starting') "
                                   "OR ended IS NULL ORDER BY num").fetchall()
        for row in rows:
            job = jm.table.from_row(row)
            if job.state not in (*LIVE_STATES, "starting"):
                # a stop in progress when the previous process died: finish it (exits.on_exit keeps
                # the state and reason the stop recorded, kills what is left, removes the cgroups)
                jm.jobs[job.id] = job
                jm._emit("job", f"job {job.id} was being stopped ({job.state}) when the agent went down; "
                         "finishing the stop", job=job.id, state=job.state)
                jm._spawn_task(jm.exits.on_exit(job.id))
                continue
            if job.state == QUEUED:
                jm.jobs[job.id] = job
                jm._emit("job", f"job {job.id} still queued after the restart: {job.reason}", job=job.id,
                         state=QUEUED)
                continue
            if job.state != "starting" and job.cgroup.exists() and job.cgroup.populated():
                job.reattached = True
                # The frozen flag in the kernel is the truth about suspension.
                try:
                    job.state = "suspended" if job.cgroup.frozen() else "running"
                except CgroupError:
                    pass
                jm.jobs[job.id] = job
                if jm.netguard is not None:
                    try:
                        jm.netguard.register_job(job.cgroup_id, job.num, job.spec.lent)
                    except Exception as e:
                        log.warning("job %s: netguard.register_job failed: %s", job.id, e)
                if job.origin.scheduler is not None:  # adopted from a scheduler: its own watch
                    if job.pid is not None and job.pid not in job.cgroup.pids():
                        job.pid = None
                    jm.adoption.register_net(job)
                    jm.adoption.watch(job)
                elif job.pid is not None and job.pid in job.cgroup.pids():
                    jm.exits.watch(job)  # its pidfd pins the process: what is signalled is the job's
                else:
                    # its main process is gone (init reaped it) and its pid is free for any process:
                    # signalled by number, root's checkpoint requests would reach whatever took it
                    job.pid = None
                    jm._spawn_task(jm.exits.poll_populated(job.id))
                jm.table.persist(job)
                jm._emit("job", f"job {job.id} reattached ({job.state}, pid {job.pid})", job=job.id,
                         pid=job.pid, cgroup_id=job.cgroup_id)
            elif job.origin.scheduler is not None and job.state != "starting":
                # adopted: its processes ended while the agent was down; its scheduler, not a keeper,
                # starts it again (laminar.runtime.adopt)
                job.state, job.end_cause, job.ended = "exited", endcause.exited(job.exit_code), time.time()
                job.reason = f"{jm.adoption.end_reason(job)} (while the agent was down)"
                try:
                    if job.cgroup.exists() and not job.cgroup.populated():
                        job.cgroup.remove()  # the agent's own only: an in-place one's remove() is a no-op
                except CgroupError as e:
                    log.warning("job %s: cleanup: %s", job.id, e)
                jm.table.persist(job)
                jm._emit("job", f"job {job.id} {job.state}: {job.reason}", job=job.id, state=job.state,
                         end_cause=str(job.end_cause))
            else:
                gone = not job.cgroup.exists()
                job.state = "lost" if job.state != "starting" else "failed"
                job.reason = ("agent stopped while the job was starting" if job.state != "lost" else
                              LOST_WITH_CGROUP if gone else endcause.ENDED_WHILE_DOWN_TEXT)
                job.end_cause = (EndCause.START_FAILED if job.state != "lost" else
                                 EndCause.LOST_WITH_CGROUP if gone else EndCause.ENDED_WHILE_DOWN)
                job.ended = time.time()
                try:
                    if job.cgroup.exists():
                        if job.cgroup.populated():
                            job.cgroup.kill()
                        job.cgroup.remove()
                except CgroupError as e:
                    log.warning("job %s: cleanup: %s", job.id, e)
                    jm.leaks.record(job, str(e))
                jm.table.persist(job)
                jm._emit("job", f"job {job.id} {job.state}: {job.reason}", job=job.id, state=job.state,
                         end_cause=str(job.end_cause))
