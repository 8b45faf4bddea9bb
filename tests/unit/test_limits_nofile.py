"""laminar.limits: the agent's open-files limit raised to its hard limit, and the warning when
even the hard limit holds fewer jobs than one user may run (jobs get their owner's limits:
tests/unit/test_joblimits.py, tests/kernel/test_job_limits.py)."""

from __future__ import annotations

import subprocess
import sys

from laminar.limits import FDS_PER_JOB, FDS_RESERVED, NofileLimits, jobs_held, nofile_note


def test_the_note_names_the_limit_and_the_jobs_it_holds() -> None:
    enough = FDS_RESERVED + FDS_PER_JOB * 256
    assert nofile_note(NofileLimits(1024, enough, enough), 256) is None
    note = nofile_note(NofileLimits(512, 512, 512), 256)
    assert note is not None and "512" in note and f"{jobs_held(512)} running jobs" in note
    assert "jobs.max_per_user = 256" in note
    assert jobs_held(10) == 0


def test_raise_nofile_raises_the_soft_limit_and_says_the_start_one() -> None:
    code = ("import resource\n"
            "from laminar import limits\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
            "lim = limits.raise_nofile()\n"
            "now = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "assert lim.inherited_soft == 64 and lim.soft == now[0], lim\n"
            "assert now[1] == hard and (hard == resource.RLIM_INFINITY or now[0] == hard), now\n"
            "again = limits.raise_nofile()\n"  # a second call finds nothing to raise
            "assert again.soft == now[0] == again.inherited_soft\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
