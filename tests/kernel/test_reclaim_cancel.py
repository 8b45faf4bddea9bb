"""An owner withdraws a reclaim, or gives the node back: ``laminarctl reclaim cancel`` on a real laminard.

Inside the window the cancel stops what has not happened: the kill-switch deadline armed for the
window's end is cleared (netguard's status), the queue hold is released (the job queued during
the window starts), the node takes placements again (the zone's residual is not draining),
``reclaim status`` shows none, the window's end stops nothing, and an agent restarted inside the
old window restores nothing (the stored reclaim went). After the window (the node is back: its
running job was stopped as ``reclaimed``) the cancel clears the draining state and the held
queue. The cancel of nothing is refused naming it. A one-node zone: the running job has nowhere
to move, so nothing moves before the cancel. (The peers' side, a notice and a keeper's window
forgotten, is tests/unit/test_reclaim_cancel_unit.py.)
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from agentproc import AgentProc, api_json, wait_until
from test_reclaim_restart import _draining, _job, _reclaim  # one copy of the status readers

pytestmark = pytest.mark.kernel

LOOP = "while true; do sleep 1; done"
NOTICE_S = 6.0  # long enough to submit and cancel inside it on a loaded VM; waited out once
SHORT_S = 2.0  # the window the second reclaim lets pass before its cancel


def _armed(agent: AgentProc, jid: str) -> Any:
    rows = {r["job"]: r for r in agent.json("killswitch", "status")["jobs"]}
    return rows[jid]


def _events(agent: AgentProc) -> list[dict[str, Any]]:
    out = agent.ctl("-o", "json", "events", "--kind", "migrate", "--limit", "200", check=False).stdout
    try:
        evs = json.loads(out)
    except ValueError:
        return []
    return evs if isinstance(evs, list) else []


def test_reclaim_cancel_inside_the_window_and_after_it(agent: AgentProc) -> None:
    # nothing to cancel: refused, naming it
    r = agent.ctl("reclaim", "cancel", check=False)
    assert r.returncode != 0 and "no reclaim" in r.stderr, (r.returncode, r.stderr)
    status, body = api_json(agent.sock, "POST", "/v1/reclaim/cancel", "{}")
    assert status == 404 and "no reclaim" in body["error"], (status, body)
    status, body = api_json(agent.sock, "POST", "/v1/reclaim/cancel", '{"node": "two"}')
    assert status == 400 and "'two'" in body["error"], (status, body)

    running = agent.json("submit", "--name", "lm-t-rc-running", "--", "sh", "-c", LOOP)
    wait_until(lambda: _job(agent, running["id"])["state"] == "running", 30, "the first job to run")
    res = agent.json("reclaim", "--notice", f"{NOTICE_S:g}s", "--reason", "lm-t owner")
    window_end = float(res["reclaim"]["deadline"])
    assert running["id"] in res["reclaim"]["armed"]
    assert _armed(agent, running["id"])["armed_in_s"] is not None
    queued = agent.json("submit", "--name", "lm-t-rc-queued", "--", "sh", "-c", LOOP)
    assert _job(agent, queued["id"])["state"] == "queued", "a reclaimed node holds its queue"
    assert _draining(agent)

    out = agent.json("reclaim", "cancel", "--reason", "lm-t rebalance passed")
    assert time.time() < window_end, "the cancel came after the window: make NOTICE_S longer"
    assert out["in_window"] and out["disarmed"] == [running["id"]] and out["released"] and out["undrained"], out
    row = _armed(agent, running["id"])
    assert row["armed_in_s"] is None and not row["kill"], f"the kill-switch must not stay armed: {row}"
    wait_until(lambda: _job(agent, queued["id"])["state"] == "running", 30, "the held queued job to start", agent.log)
    assert _reclaim(agent) is None
    assert not _draining(agent), "the node must take placements again"
    assert any(e.get("phase") == "reclaim-cancelled" and e.get("in_window") for e in _events(agent))

    # a restart inside the old window restores nothing; past its end nothing is stopped
    agent.stop()
    agent.start()
    assert _reclaim(agent) is None, "the cancelled reclaim was restored by a restart"
    assert not _draining(agent)
    while time.time() < window_end + 1.0:
        time.sleep(0.2)
    assert _job(agent, running["id"])["state"] == "running", "the old window's end stopped a job"
    assert _job(agent, queued["id"])["state"] == "running"
    assert not any(e.get("phase") in ("reclaim-restored", "reclaim-cleared") for e in _events(agent))

    # after the window: the node was taken and is given back
    agent.json("reclaim", "--notice", f"{SHORT_S:g}s", "--reason", "lm-t owner again")
    for jid in (running["id"], queued["id"]):
        wait_until(lambda jid=jid: _job(agent, jid)["state"] == "reclaimed", SHORT_S + 30,
                   f"{jid} to be stopped at the window's end", agent.log)
    late = agent.json("submit", "--name", "lm-t-rc-late", "--", "sh", "-c", LOOP)
    assert _job(agent, late["id"])["state"] == "queued" and _draining(agent), "the node stays draining until told"
    out = agent.json("reclaim", "cancel")
    assert not out["in_window"] and out["undrained"] and out["released"], out
    assert _reclaim(agent) is None and not _draining(agent)
    wait_until(lambda: _job(agent, late["id"])["state"] == "running", 30, "the job queued after the window to start")
    r = agent.ctl("reclaim", "cancel", check=False)
    assert r.returncode != 0 and "no reclaim" in r.stderr, "a second cancel has nothing to cancel"
