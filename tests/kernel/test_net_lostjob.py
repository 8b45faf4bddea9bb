"""A job that ended while the agent was down leaves no entry in netguard's maps (real laminard).

The job manager marks such a job ``lost`` at start and removes its cgroups, but nothing deleted
its ``lm_jobs`` and ``lm_job_stats`` entries: each one stayed for good, listed by
``laminarctl killswitch status`` as ``#<num>``, armed again by every ``killswitch arm --all``,
and holding one of the map's 4096 entries, so a node whose agent restarted now and then ran out
of room, and then no new job could be registered with netguard (its kill-switch would not
work). netguard now drops, when it starts, every entry whose cgroup under the agent's root no
longer exists or holds no process.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until

pytestmark = pytest.mark.kernel


def lm_jobs_cgroups(agent: AgentProc) -> set[int]:
    dump: dict[str, Any] = agent.json("bpf", "dump", "lm_jobs")
    return {int(e["key"]["cgroup_id"]) if isinstance(e["key"], dict) else int(e["key"]) for e in dump["entries"]}


def test_entries_of_a_job_that_ended_while_the_agent_was_down_are_dropped(agent: AgentProc) -> None:
    ended = agent.json("submit", "--name", "lm-t-lost", "--", "sleep", "600")
    alive = agent.json("submit", "--name", "lm-t-alive", "--", "sleep", "600")
    wait_until(lambda: agent.json("job", "show", ended["id"])["state"] == "running", 30, "the job to run")
    wait_until(lambda: agent.json("job", "show", alive["id"])["state"] == "running", 30, "the job to run")
    cg_ended = int(agent.json("job", "show", ended["id"])["cgroup_id"])
    cg_alive = int(agent.json("job", "show", alive["id"])["cgroup_id"])
    assert {cg_ended, cg_alive} <= lm_jobs_cgroups(agent)
    agent.kill9()
    procs = Path(f"/sys/fs/cgroup/unified/{agent.cgroup_root}")
    victims = [p for p in procs.rglob("cgroup.procs") if str(ended["id"]) in str(p)]
    assert victims, list(procs.rglob("cgroup.procs"))
    for f in victims:
        for pid in f.read_text().split():
            os.kill(int(pid), signal.SIGKILL)
    wait_until(lambda: all(not f.read_text().strip() for f in victims), 10, "the job's processes to die")
    agent.start()
    assert agent.json("job", "show", ended["id"])["state"] == "lost"
    assert agent.json("job", "show", ended["id"])["end_cause"] == "ended_while_down"  # its cgroup was still there
    cgs = lm_jobs_cgroups(agent)
    assert cg_ended not in cgs, f"lm_jobs still holds cgroup {cg_ended} of a lost job"
    assert cg_alive in cgs, "the job that still runs lost its entry"
