"""The agent raises its own open-files limit; its jobs get their owner's, not the agent's.

The agent holds about two descriptors per running job (a pidfd and a PSI trigger). Under the
unit (``LimitNOFILE=65536``) that is room for thousands, but started any other way (``make run``,
a shell with soft limit 1,024) it ran out near 480 jobs: ``laminarctl status`` failed "Too many
open files" and submissions were refused. Now the agent raises its soft limit to its hard limit
at start, and a job gets neither: it starts with its owner's profile (docs/operations.md, "What
a job gets: the site's limits"; by default soft 1,024, as systemd gives its services: programs
using select() fail above 1,023). A real laminard started under a small soft limit (prlimit),
real jobs (all of a job's limits: tests/kernel/test_job_limits.py).
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from agentproc import AgentProc, wait_until

pytestmark = pytest.mark.kernel


def nofile(pid: int) -> tuple[int, int]:
    """(soft, hard) open-files limit of process `pid`, from /proc/<pid>/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-files line in /proc/{pid}/limits")


def test_agent_under_a_small_soft_limit_runs_more_jobs_and_jobs_get_the_profiles_limit(
        veth_pair: object, tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard < 1024:
        pytest.skip(f"hard open-files limit {hard}: no room above a small soft limit")
    agent = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)  # type: ignore[attr-defined]
    try:
        agent.start()
        assert agent.proc is not None
        pid = int(agent.json("status")["agent"]["pid"])
        baseline = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        agent.stop()
        # A soft limit just above what the idle agent holds: room for a few jobs only, before.
        soft = baseline + 16
        jobs = 24  # two descriptors each: 48, three times the room the soft limit leaves
        agent.start(prefix=("prlimit", f"--nofile={soft}:{hard}"))
        pid = int(agent.json("status")["agent"]["pid"])
        assert nofile(pid) == (hard, hard), "the agent did not raise its soft limit to its hard limit"
        for i in range(jobs):
            agent.json("submit", "--name", f"fd{i}", "--class", "transient", "--", "sleep", "600")
        wait_until(lambda: sum(j["state"] == "running" for j in agent.json("jobs", "--active")) == jobs, 60,
                   f"{jobs} jobs running", agent.log)
        held = len(list(Path(f"/proc/{pid}/fd").iterdir()))
        assert held > soft, f"the agent holds {held} descriptors, no more than the soft limit {soft}: no proof"
        assert "Too many open files" not in agent.log()
        st = agent.json("status")  # the API still answers
        assert st["agent"]["pid"] == pid
        job_pids = [int(p) for j in agent.json("jobs", "--active") for p in j.get("pids") or []]
        assert job_pids
        want = tuple(st["jobs"]["job_limits"]["defaults"]["nofile"])  # [job_limits], as this agent can give it
        assert want[0] == 1024
        for jp in job_pids:
            assert nofile(jp) == want, f"job pid {jp}: {nofile(jp)}, not the profile's {want}"
    finally:
        agent.cleanup()
