"""An agent restarted with shaping off takes the last run's shaping tree off the uplink.

With ``shaping.enabled = false`` (or an uplink whose speed it cannot tell and no
``shaping.link_mbit``) the transfer registry did nothing at start, so the tree the previous run put
on the uplink stayed there for good: the HTB root ``4c4d:``, every transfer's leaf frozen at its
last rate with nobody left to change it (a transfer at a low rate stayed starved, long after its
deadline), and the ``lm_flows`` entries still steering the flows into those leaves. The uplink is
now restored at start (as ``bpf unload`` does for the tree), the flows' classes cleared (a switch on
a flow stays) and the stored transfers forgotten, with an event saying so.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel

HTB_HANDLE = "4c4d:"
FLOW = "tcp:10.79.3.1:40700->10.79.3.2:7700"
FLOW_CUT = "tcp:10.79.3.1:40701->10.79.3.2:7701"


def root_qdisc(veth_pair: Any) -> dict[str, Any] | None:
    out = veth_pair.a.run("tc", "-j", "qdisc", "show", "dev", veth_pair.ifname_a).stdout
    return next((q for q in json.loads(out or "[]") if q.get("root")), None)


def test_restart_with_shaping_off_restores_the_uplink(shaping_agent: AgentProc, veth_pair: Any) -> None:
    a = shaping_agent
    job = a.json("submit", "--name", "lm-t-shapeoff", "--", "sleep", "600")
    for tid, flow in (("t-off", FLOW), ("t-cut", FLOW_CUT)):
        a.json("net", "transfers", "add", "--job", job["id"], "--flow", flow, "--bytes", "1G", "--deadline", "+600s",
               "--id", tid)
    a.json("net", "kill-flow", "t-cut", "on")
    assert (root_qdisc(veth_pair) or {}).get("handle") == HTB_HANDLE
    a.stop()
    a.config_path.write_text(a.config_path.read_text().replace("link_mbit = 1000", "link_mbit = 1000\nenabled = false"))
    a.start()
    q = root_qdisc(veth_pair)
    assert q is None or q.get("handle") != HTB_HANDLE, f"the shaping tree outlived shaping.enabled = false: {q}"
    out = a.json("net", "transfers")
    assert out["status"]["shaping"] == "off" and out["transfers"] == [], out
    flows = {f["flow"]: f for f in a.json("net", "flows")}
    assert FLOW not in flows, flows  # its entry only held the class
    assert flows[FLOW_CUT]["kill"] and flows[FLOW_CUT]["priority"] is None, flows[FLOW_CUT]  # the cut stays
    assert "shaping tree" in a.ctl("events").stdout
