"""Transfers taken over after a restart keep true deadlines; ones already past theirs are dropped.

The registry re-read its transfers from the store at start and shaped them on. Two faults:

- a transfer whose deadline passed while the agent was down (the agent's own migration sender
  died with it, so nobody would ever remove it) came back ``late`` and stayed for good: its HTB
  leaf and ``lm_flows`` entry on the uplink, ``laminarctl net transfers`` exiting 5 (a transfer
  will miss its deadline: re-plan) on every call, ``laminar_shaper_infeasible`` >= 1;
- the deadline was kept as a CLOCK_MONOTONIC value, which means nothing after a reboot: a row
  left by a boot with 10 more days of uptime came back due in 10 days (on-time, its rate
  reserved). The deadline is now taken from the stored wall-clock time.

Real laminard with shaping on a veth in a netns; the reboot is faked by shifting the stored
monotonic deadline by what a previous boot's longer uptime would have made it (named here).
"""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel

FLOW_LATE = "tcp:10.77.0.1:40001->10.77.0.2:7000"
FLOW_ON = "tcp:10.77.0.1:40002->10.77.0.2:7000"



def test_adopted_transfers_past_their_deadline_go_and_the_others_keep_true_deadlines(shaping_agent: AgentProc) -> None:
    a = shaping_agent
    job = a.json("submit", "--name", "lm-t-adopt", "--", "sleep", "600")
    a.json("net", "transfers", "add", "--job", job["id"], "--flow", FLOW_LATE, "--bytes", "100M", "--deadline", "+3s",
           "--id", "t-late")
    a.json("net", "transfers", "add", "--job", job["id"], "--flow", FLOW_ON, "--bytes", "1G", "--deadline", "+600s",
           "--id", "t-on")
    a.kill9()
    db = sqlite3.connect(a.state_dir / "laminar.db")
    try:
        # What a previous boot with 10 more days of uptime would have stored (the fake reboot).
        db.execute("UPDATE net_transfers SET deadline_mono_ns = deadline_mono_ns + ? WHERE id='t-on'",
                   (10 * 86400 * 10**9,))
        db.commit()
    finally:
        db.close()
    time.sleep(3.5)  # t-late's deadline passes while no agent runs
    a.start()
    r = a.ctl("-o", "json", "net", "transfers", check=False)
    out = json.loads(r.stdout)
    rows = {t["id"]: t for t in out["transfers"]}
    assert "t-late" not in rows, rows.get("t-late")
    assert r.returncode == 0, (r.returncode, rows)
    assert 0 < rows["t-on"]["deadline_in_s"] <= 600, rows["t-on"]
    flows = {f["flow"] for f in a.json("net", "flows")}
    assert FLOW_LATE not in flows and FLOW_ON in flows, flows
