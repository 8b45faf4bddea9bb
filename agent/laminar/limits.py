"""The agent's open-files limit (``RLIMIT_NOFILE``), and the one its jobs get.

The agent holds about two descriptors per running job (a pidfd and a PSI trigger) besides its
own sockets, maps and store. The systemd unit sets ``LimitNOFILE=65536``; started any other way
(``make run``, a shell whose soft limit is 1,024) it ran out near 480 jobs: ``laminarctl status``
failed "Too many open files" and submissions were refused. So at start the agent raises its
soft limit to its hard limit (`raise_nofile`), and says so when even that holds fewer running
jobs than ``jobs.max_per_user`` lets one user have (`nofile_note`).

Jobs do not get the raised limit: a job gets the soft limit the agent was started with
(`job_nofile_soft`; 65,536 under the unit, as docs/operations.md says; a shell's 1,024 under
``make run``), restored as root before the drop to the job's owner. That is what systemd does
for its own services (it raises its own soft limit, and gives services 1,024 soft): a program
that uses ``select()`` fails on a descriptor above 1,023, and a job that needs more raises its
soft limit up to the hard one itself.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

# Descriptors the agent holds per running job (pidfd, PSI trigger), and for itself (sockets,
# BPF maps and programs, the store, epoll sets, connections being served), with room.
FDS_PER_JOB = 2
FDS_RESERVED = 256

_job_soft: int | None = None


@dataclass(frozen=True)
class NofileLimits:
    inherited_soft: int  # the soft limit the agent was started with (what jobs get)
    soft: int            # the soft limit now
    hard: int


def _nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def raise_nofile() -> NofileLimits:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (to fs.nr_open where the hard
    limit is unlimited) and remembers the soft limit it was started with, for the jobs
    (`job_nofile_soft`). Never raises the hard limit. Raises OSError if the kernel refuses."""
    global _job_soft
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        _job_soft = soft
        return NofileLimits(soft, target, hard)
    return NofileLimits(soft, soft, hard)


def job_nofile_soft() -> int | None:
    """The soft limit a job is to get (the one the agent was started with), or None when the
    agent did not raise its own (the job inherits the agent's as it is)."""
    return _job_soft


def jobs_held(soft: int) -> int:
    """About how many running jobs an agent with open-files soft limit `soft` can hold."""
    return max(0, (soft - FDS_RESERVED) // FDS_PER_JOB)


def nofile_note(limits: NofileLimits, max_per_user: int) -> str | None:
    """A warning when the agent's open-files limit holds fewer running jobs than one user may
    have (``jobs.max_per_user``); None when it holds them."""
    held = jobs_held(limits.soft)
    if held >= max_per_user:
        return None
    return (f"open-files limit {limits.soft} (hard {limits.hard}) holds about {held} running jobs, fewer than "
            f"jobs.max_per_user = {max_per_user} for one user: start the agent with a higher hard limit "
            f"(the unit sets LimitNOFILE=65536; from a shell: ulimit -Hn as root)")
