"""The jobs API under a real laminard: bad stop input changes nothing; who may stop whose job.

Python's JSON reader takes ``Infinity`` and ``NaN``; a stop with ``"grace_s": Infinity`` used to
be accepted: the job was recorded as stopped, sent SIGTERM and then waited on forever (a job
that ignores SIGTERM was never killed, and every later stop was refused because one was under
way). It is now refused with 400, naming the value, and the job runs on untouched.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from agentproc import NOBODY, AgentProc, api_json, wait_until

pytestmark = pytest.mark.kernel

IGNORES_TERM = "trap '' TERM; while true; do sleep 1; done"


@pytest.mark.parametrize("grace", ["Infinity", "NaN", "1e300"])
def test_stop_with_a_grace_that_never_ends_is_refused_and_changes_nothing(agent: AgentProc, grace: str) -> None:
    job = agent.json("submit", "--name", "lm-t-grace", "--", "sh", "-c", IGNORES_TERM)
    status, out = api_json(agent.sock, "POST", f"/v1/jobs/{job['id']}/stop", f'{{"grace_s": {grace}}}')
    assert status == 400, out
    assert "grace_s" in out["error"] and "3600" in out["error"], out
    after = agent.json("job", "show", job["id"])
    assert after["state"] == "running" and after["ended"] is None, after
    # and it can still be stopped the ordinary way
    assert agent.json("job", "stop", job["id"], "--grace", "0")["state"] == "stopped"


def test_only_the_owner_root_or_the_control_group_may_stop_a_job(agent: AgentProc) -> None:
    job = agent.json("submit", "--name", "lm-t-roots", "--", "sleep", "600")
    r = agent.ctl("job", "stop", job["id"], user=NOBODY, check=False)
    assert r.returncode == 4, (r.returncode, r.stderr)
    assert "permission denied" in r.stderr and f"belongs to uid {job['owner_uid']}" in r.stderr
    assert agent.json("job", "show", job["id"])["state"] == "running"
    mine = json.loads(agent.ctl("-o", "json", "submit", "--name", "lm-t-nobody", "--", "sleep", "600",
                                user=NOBODY).stdout)
    assert mine["owner_uid"] == NOBODY
    wait_until(lambda: agent.json("job", "show", mine["id"])["state"] == "running", 30, "nobody's job to run")
    r = agent.ctl("-o", "json", "job", "stop", mine["id"], "--grace", "0", user=NOBODY, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "stopped"


def test_stop_does_not_block_the_agent_on_a_main_process_the_kill_missed(agent: AgentProc, tmp_path: Path) -> None:
    """``cgroup.kill`` cannot end a main process that is not in the job's cgroup any more (a root
    job can move itself out) or that sleeps uninterruptibly (a hung storage mount): 10 s after the
    kill the stop tears the job down anyway. It used to ``wait()`` for that process inside the
    event loop, which froze the whole agent (API, Airlock, kill-switches) for as long as the
    process lived. Now the stop completes and the main process is killed directly."""
    escaped = tmp_path / "lm-t-escaped"
    job = agent.json("submit", "--name", "lm-t-escape", "--", "sh", "-c",
                     f"echo $$ > /sys/fs/cgroup/unified/cgroup.procs; echo $$ > {escaped}; exec sleep 600")
    wait_until(lambda: escaped.exists() and escaped.read_text().strip(), 30, "the main process to leave its cgroup")
    pid = int(escaped.read_text())
    try:
        r = agent.ctl("-o", "json", "job", "stop", job["id"], "--grace", "0", check=False, timeout=90)
        assert r.returncode == 0, r.stderr
        final = json.loads(r.stdout)
        assert final["state"] == "stopped" and final["ended"] is not None, final
        agent.json("status")  # the agent answers
        wait_until(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
                   or " Z " in Path(f"/proc/{pid}/stat").read_text(), 30, "the escaped main process to be killed")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
