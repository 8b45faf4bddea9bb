"""Restoring a flow cut by its 5-tuple removes the ``lm_flows`` entry the cut made (real laminard).

``laminarctl net kill-flow tcp:A:P->B:Q on`` cuts any flow on the uplink, registered transfer or
not, by creating an ``lm_flows`` entry (no HTB class). ``off`` cleared the entry's switch bits
but left the entry, for good: every ad-hoc cut took one of the map's 1024 entries until the map
was full, and then every migration transfer's registration (which needs an entry) and every
further cut failed. ``off`` now deletes an entry that belongs to no transfer and steers no
packets into a class; a registered transfer's entry stays (its class), switch cleared.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel

FLOWS = [f"udp:10.78.0.1:{40000 + i}->10.78.0.2:9000" for i in range(5)]


def lm_flows_entries(agent: AgentProc) -> int:
    rows: list[dict[str, Any]] = agent.json("bpf", "maps")
    return next(r["entries"] for r in rows if r["name"] == "lm_flows")


def settled_entries(agent: AgentProc, want: int) -> int:
    """The count once the agent recounts: `bpf maps` counts a hash map at most once a second
    (netguard.MAP_COUNTS_S), so the count may lag a change by that long."""
    deadline = time.monotonic() + 10
    n = lm_flows_entries(agent)
    while n != want and time.monotonic() < deadline:
        time.sleep(0.2)
        n = lm_flows_entries(agent)
    return n


def test_off_removes_the_entry_an_ad_hoc_cut_made(agent: AgentProc) -> None:
    time.sleep(1.1)  # a count taken after any entry the agent's start made
    before = lm_flows_entries(agent)
    for f in FLOWS:
        agent.json("net", "kill-flow", f, "on")
    assert settled_entries(agent, before + len(FLOWS)) == before + len(FLOWS)
    for f in FLOWS:
        res = agent.json("net", "kill-flow", f, "off")
        assert res["kill"] is False and res["armed"] is False, res
    flows = {r["flow"] for r in agent.json("net", "flows")}
    assert not flows & set(FLOWS), flows
    assert settled_entries(agent, before) == before
    # an armed cut that is disarmed goes the same way
    agent.json("net", "kill-flow", FLOWS[0], "arm", "--at", "+300s")
    assert settled_entries(agent, before + 1) == before + 1
    agent.json("net", "kill-flow", FLOWS[0], "off")
    assert settled_entries(agent, before) == before
