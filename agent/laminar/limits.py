"""The agent's open-files limit (``RLIMIT_NOFILE``).

The agent holds about two descriptors per running job (a pidfd and a PSI trigger) besides its
own sockets, maps and store. The systemd unit sets ``LimitNOFILE=65536``; started any other way
(``make run``, a shell whose soft limit is 1,024) it ran out near 480 jobs: ``laminarctl status``
failed "Too many open files" and submissions were refused. So at start the agent raises its
soft limit to its hard limit (`raise_nofile`), and says so when even that holds fewer running
jobs than ``jobs.max_per_user`` lets one user have (`nofile_note`).

Jobs get none of the agent's limits, raised or not: every job starts with its owner's profile
(`laminar.runtime.joblimits`: by default soft 1,024 and hard 524,288 open files, as systemd
gives its services; a program that uses ``select()`` fails on a descriptor above 1,023, and a
job that needs more raises its soft limit up to the hard one itself).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

# Descriptors the agent holds per running job (pidfd, PSI trigger), and for itself (sockets,
# BPF maps and programs, the store, epoll sets, connections being served), with room.
FDS_PER_JOB = 2
FDS_RESERVED = 256

@dataclass(frozen=True)
class NofileLimits:
    inherited_soft: int  # the soft limit the agent was started with
    soft: int            # the soft limit now
    hard: int


def _nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def raise_nofile() -> NofileLimits:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (to fs.nr_open where the hard
    limit is unlimited) and says what it was started with. Never raises the hard limit. Raises
    OSError if the kernel refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return NofileLimits(soft, target, hard)
    return NofileLimits(soft, soft, hard)


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
