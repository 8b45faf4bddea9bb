"""A reclaim survives an agent restart: a real laminard restarted inside and after the window.

The reclaim is stored with its window's end in wall-clock time. An agent restarted inside the
window restores it: its queue stays held (a job queued on the node does not start on capacity
about to go), the node stays draining in the zone, ``laminarctl reclaim status`` shows the
restored reclaim, and at the window's end what still runs is stopped (state ``reclaimed``). An
agent started after the window ended clears the stored reclaim (the owner gave the node back)
with an event saying so, and the queued job starts. A one-node zone: the running job has
nowhere to move, so it runs until the window ends.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from agentproc import AgentProc, api_json, wait_until

pytestmark = pytest.mark.kernel

LOOP = "while true; do sleep 1; done"
# The window outlives one agent restart on a loaded 2-core VM; the test waits it out once.
NOTICE_S = 15.0


def _job(agent: AgentProc, jid: str) -> dict[str, Any]:
    return agent.json("job", "show", jid)


def _reclaim(agent: AgentProc) -> dict[str, Any] | None:
    st: dict[str, Any] = agent.json("reclaim", "status")
    return st.get("reclaim")


def _draining(agent: AgentProc) -> bool:
    return bool(api_json(agent.sock, "GET", "/v1/zone/stats")[1]["residual"]["draining"])


def _events(agent: AgentProc) -> list[dict[str, Any]]:
    out = agent.ctl("-o", "json", "events", "--kind", "migrate", "--limit", "200", check=False).stdout
    try:
        evs = json.loads(out)
    except ValueError:
        return []
    return evs if isinstance(evs, list) else []


def test_reclaim_restored_after_restart_in_window_and_cleared_after(agent: AgentProc) -> None:
    running = agent.json("submit", "--name", "lm-t-rr-running", "--", "sh", "-c", LOOP)
    wait_until(lambda: _job(agent, running["id"])["state"] == "running", 30, "the first job to run")
    res = agent.json("reclaim", "--notice", f"{NOTICE_S:g}s", "--reason", "lm-t owner")
    window_end = float(res["reclaim"]["deadline"])
    assert running["id"] in res["reclaim"]["armed"]
    queued = agent.json("submit", "--name", "lm-t-rr-queued", "--", "sh", "-c", LOOP)
    assert _job(agent, queued["id"])["state"] == "queued", "a reclaimed node holds its queue"
    assert _draining(agent)

    agent.stop()
    agent.start()
    assert time.time() < window_end, "the restart outlived the window: make NOTICE_S longer"
    rc = _reclaim(agent)
    assert rc is not None and rc.get("restored"), f"the restarted agent lost the reclaim: {rc}"
    assert abs(float(rc["deadline"]) - window_end) < 1e-3, "the window's end must be the one announced"
    assert running["id"] in rc["armed"], "the kill-switch is armed again for the window's end"
    assert _draining(agent), "the node must stay draining in the zone"
    q = _job(agent, queued["id"])
    assert q["state"] == "queued" and "reclaimed" in (q.get("reason") or ""), \
        f"the queued job must stay queued, held, on a node being taken away: {q}"

    # the restored window's end stops what still runs
    wait_until(lambda: _job(agent, running["id"])["state"] == "reclaimed", NOTICE_S + 30,
               "the running job to be stopped at the window's end", agent.log)
    assert _job(agent, running["id"])["end_cause"] == "window_ended"
    assert _job(agent, queued["id"])["state"] == "queued"

    # started after the window ended: the node is a node again
    agent.stop()
    agent.start()
    assert _reclaim(agent) is None
    assert not _draining(agent)
    wait_until(lambda: _job(agent, queued["id"])["state"] == "running", 30, "the queued job to start")
    assert any(e.get("phase") == "reclaim-cleared" for e in _events(agent)), \
        "an event says the stored reclaim was cleared"


def test_a_window_that_ended_while_the_agent_was_down_stops_what_it_cut(agent: AgentProc) -> None:
    """The agent is down when the window ends (a crash, an upgrade): nobody stopped the running
    job, but the data plane cut its traffic at the armed deadline (the pinned maps outlive the
    agent). The agent started after the window must do what the window's end does: stop the job
    (state ``reclaimed``; a keeper elsewhere resumes it), not adopt it as a running job whose
    traffic stays cut for good while the node is said to take jobs again."""
    notice = 6.0
    running = agent.json("submit", "--name", "lm-t-rr-down", "--", "sh", "-c", LOOP)
    wait_until(lambda: _job(agent, running["id"])["state"] == "running", 30, "the job to run")
    res = agent.json("reclaim", "--notice", f"{notice:g}s", "--reason", "lm-t owner")
    window_end = float(res["reclaim"]["deadline"])
    assert running["id"] in res["reclaim"]["armed"]
    agent.stop()
    assert time.time() < window_end, "the agent stopped after the window ended: make the notice longer"
    while time.time() < window_end + 1.0:
        time.sleep(0.2)
    agent.start()
    assert _reclaim(agent) is None
    wait_until(lambda: _job(agent, running["id"])["state"] == "reclaimed", 30,
               "the job the window's end cut to be stopped as reclaimed", agent.log)
    assert _job(agent, running["id"])["end_cause"] == "window_ended"
