"""The checkpoint signal, and any signal the agent sends a job's processes: sent only to a
process that catches it (``SigCgt`` of /proc/<pid>/status, :func:`catches_signal`), since the
default action of SIGUSR1, SIGUSR2 and most signals kills; and only through a handle that names
the job's own process (a pidfd, or the agent's own child not reaped yet), never a bare pid that
another process may have by now. A part of the job manager (``jobs.signals``); Airlock, a move,
a member's origin and a loan reach it through the job manager (``request_checkpoint``,
``catches_checkpoint``, ``signal_catchers``, ``signal_main``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from ..airlock.cgroups import CgroupError
from .record import Job

if TYPE_CHECKING:
    from .jobs import JobManager


def catches_signal(pid: int, signame: str) -> bool:
    """Whether process ``pid`` has a handler for ``signame`` (``SigCgt`` of /proc/<pid>/status).
    False when the process is gone or the signal is unknown."""
    try:
        num = int(signal.Signals[signame])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (num - 1) & 1)
    except (OSError, KeyError, ValueError):
        return False
    return False


def signal_if_caught(pid: int | None, signame: str) -> bool:
    """Send ``signame`` to process ``pid`` only if it has a handler for it
    (:func:`catches_signal`): the default action of SIGUSR1, SIGUSR2 and most signals kills.
    True when sent; False when the process is gone or does not catch it."""
    if not pid or not catches_signal(int(pid), signame):
        return False
    try:
        os.kill(int(pid), signal.Signals[signame])
        return True
    except ProcessLookupError:
        return False


class Signals:
    """The signals a :class:`~laminar.runtime.jobs.JobManager` sends its jobs (``jobs.signals``)."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm

    def request_checkpoint(self, job: Job) -> bool:
        """Send the job its checkpoint signal (main process) if that process catches it
        (:func:`catches_signal`). False if it is gone or does not catch it: the default action
        of SIGUSR1 (and most signals) kills, so a job without a handler (not yet installed,
        or no checkpoint contract) is left running instead of killed.

        A member of a multi-node job (:meth:`JobManager.member_of`) is signalled in every process of its
        cgroup that catches it (:meth:`signal_catchers`): its main process is a launcher
        (torchrun) that does not catch it and would die of it, its workers do. True when at
        least one process was sent it."""
        if self.jm.member_of(job) is not None or job.origin.scheduler is not None:
            # a member's launcher, an adopted task's shell: not the process that checkpoints
            return bool(self.signal_catchers(job, job.spec.checkpoint_signal))
        return self.signal_main(job, job.spec.checkpoint_signal)

    def catches_checkpoint(self, job: Job) -> bool:
        """Whether the job keeps the checkpoint contract now: its main process catches its
        checkpoint signal, or, for a member of a multi-node job, some process of its cgroup does
        (what :meth:`request_checkpoint` would signal)."""
        sig = job.spec.checkpoint_signal
        if self.jm.member_of(job) is not None or job.origin.scheduler is not None:
            try:
                pids = job.cgroup.pids()
            except (CgroupError, OSError):
                return False
            return any(catches_signal(pid, sig) for pid in pids)
        return job.pid is not None and catches_signal(int(job.pid), sig)

    def signal_catchers(self, job: Job, signame: str) -> list[int]:
        """Send ``signame`` to every process of the job's cgroup (sub-cgroups included) that
        catches it; returns the pids sent it. Each process is opened as a pidfd first and
        only then looked at (in the job's cgroup still, a handler for the signal): the signal
        goes through that pidfd, so a pid that ended and was reused meanwhile is never
        signalled (the pidfd names the ended process: ESRCH). A process that does not catch
        it (torchrun's launcher, a shell) is left alone: the default action kills."""
        try:
            num = signal.Signals[signame]
            pids = job.cgroup.pids()
        except (KeyError, CgroupError, OSError):
            return []
        sent: list[int] = []
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # gone
                continue
            try:
                # looked at after the open: the pidfd holds the process that had the pid then
                if pid not in job.cgroup.pids() or not catches_signal(pid, signame):
                    continue
                signal.pidfd_send_signal(fd, num)
                sent.append(pid)
            except (ProcessLookupError, CgroupError, OSError):
                continue
            finally:
                os.close(fd)
        return sent

    def signal_main(self, job: Job, signame: str) -> bool:
        """Send ``signame`` to the job's main process if it catches it; True when sent. Through
        the pidfd the agent watches it by (a pid number may be another process's by then: a
        reattached job's main process is not the agent's child, so nothing holds its pid), else
        by number only to the agent's own child not reaped yet (its pid cannot be reused before
        the agent reaps it); never to a pid the agent holds no handle on."""
        pid, fd = job.pid, self.jm.exits.pidfds.get(job.id)
        if not pid or (fd is None and job.id not in self.jm.exits.popen) or not catches_signal(int(pid), signame):
            return False
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.Signals[signame])
            else:
                os.kill(int(pid), signal.Signals[signame])
            return True
        except (ProcessLookupError, KeyError):
            return False
