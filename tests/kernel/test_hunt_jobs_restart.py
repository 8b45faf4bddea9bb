"""A stop that an agent crash interrupts is finished by the next agent: real laminard, real jobs.

``laminarctl job stop`` records the job as stopped at once and then waits out the grace
(SIGTERM, then ``cgroup.kill``). An agent killed with ``kill -9`` inside that grace left a job
that ignores SIGTERM running in its cgroups for good: the record said ``stopped`` (no end time),
and the next agent reattached only queued, running and suspended jobs, so nothing watched,
stopped or removed it (docs/operations.md, "What survives what").
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from agentproc import VENV_BIN, AgentProc, wait_until

pytestmark = pytest.mark.kernel

IGNORES_TERM = "trap '' TERM; while true; do sleep 1; done"


def _procs(cgroup: str) -> list[str] | None:
    try:
        return (Path(cgroup) / "cgroup.procs").read_text().split()
    except OSError:
        return None


def test_stop_interrupted_by_kill9_is_finished_after_restart(agent: AgentProc) -> None:
    job = agent.json("submit", "--name", "lm-t-ignores-term", "--", "sh", "-c", IGNORES_TERM)
    wait_until(lambda: _procs(job["cgroup"]), 30, "the job's processes")
    stopper = subprocess.Popen(agent.argv(str(VENV_BIN / "laminarctl"), "--socket", str(agent.sock), "job", "stop",
                                          job["id"], "--grace", "120"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: agent.json("job", "show", job["id"])["state"] == "stopped", 30, "the stop to be recorded")
        time.sleep(0.5)  # inside the 120 s grace: SIGTERM sent (and ignored), no kill yet
        assert _procs(job["cgroup"]), "the job must still run inside the grace"
        agent.kill9()
    finally:
        stopper.wait(30)
    agent.start()
    # The new agent finishes the stop: processes gone, cgroups removed, the end recorded.
    wait_until(lambda: _procs(job["cgroup"]) is None, 60, "the stopped job's cgroup to be removed",
               lambda: f"procs {_procs(job['cgroup'])}; job {agent.json('job', 'show', job['id'])}\n{agent.log()}")
    final = agent.json("job", "show", job["id"])
    assert final["state"] == "stopped", final
    assert final["ended"] is not None, final
    assert "stopped by" in final["reason"], final
    assert job["id"] not in [j["id"] for j in agent.json("jobs", "--active")]


# The main process sleeps and exits; its child traps SIGTERM, then "checkpoints" (1 s) and exits.
LEFTOVER = r"""
import os, signal, sys, time
out = sys.argv[1]
if os.fork() == 0:
    def term(*_):
        open(out + ".term", "w").close()
        time.sleep(1)
        open(out + ".saved", "w").close()
        os._exit(0)
    signal.signal(signal.SIGTERM, term)
    open(out + ".ready", "w").close()
    while True:
        time.sleep(0.1)
time.sleep(3)
"""


def test_stop_of_an_adopted_job_without_its_main_process_keeps_the_grace(agent: AgentProc, tmp_path: Path) -> None:
    """A job whose main process ended while the agent was down, with a child still running, is
    reattached and watched through cgroup.events. Stopping it sends SIGTERM and waits the grace
    as for any job; the watch used to end (and kill the job) as soon as the stop was recorded."""
    import sys

    script = tmp_path / "leftover.py"
    script.write_text(LEFTOVER)
    out = tmp_path / "lm-t-child"
    job = agent.json("submit", "--name", "lm-t-leftover", "--", sys.executable, str(script), str(out))
    wait_until(lambda: Path(str(out) + ".ready").exists(), 30, "the child to catch SIGTERM")
    agent.kill9()
    wait_until(lambda: str(job["pid"]) not in (_procs(job["cgroup"]) or []), 30, "the main process to exit")
    assert _procs(job["cgroup"]), "the child lives on in the cgroup"
    agent.start()
    adopted = agent.json("job", "show", job["id"])
    assert adopted["state"] == "running" and adopted["reattached"], adopted
    final = agent.json("job", "stop", job["id"], "--grace", "60")
    assert Path(str(out) + ".term").exists()
    assert Path(str(out) + ".saved").exists(), "the child was killed inside its grace"
    assert final["state"] == "stopped" and final["ended"] is not None, final
    assert _procs(job["cgroup"]) is None
