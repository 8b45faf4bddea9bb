"""A flow cut that outlives its transfer no longer holds an ``lm_flows`` entry for good.

A flow cut through its transfer (``laminarctl net kill-flow <transfer id> on|arm``) stays cut when
the transfer ends (the sender's socket may outlive it), without a class. Before, it stayed until
someone ran ``kill-flow … off``: every such cut held one of the map's 1,024 entries (LM_MAX_FLOWS),
and once they were all taken every transfer registration and every further cut failed with a bare
``update of lm_flows: Argument list too long``. Now:

- a cut made through a transfer expires ``shaping.flow_cut_linger_s`` after the transfer ends
  (after its armed deadline when that is later): the entry is deleted, the flow restored; the
  expiry is in the store, so an agent restart keeps it;
- an operator's cut by 5-tuple stays until ``off``, and is counted (``operator_cuts`` in
  ``laminarctl net transfers``) and listed with its origin (``laminarctl net flows``);
- a full map is refused with HTTP 507 and a message naming the limit and who holds the entries.

The data plane is real: netguard (the stand-in of test_killswitch_dataplane) on a veth in a
namespace, the registry's real HTB tree on it; the restart test runs the real laminard.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from agentproc import AgentProc, agent_factory, wait_until
from flowrig import flow_entry, shaped_registry

from laminar.api import ApiError
from laminar.bpf import abi
from laminar.net import killswitch as ks
from laminar.net.transfers import TransferRegistry

pytestmark = pytest.mark.kernel


@pytest.fixture
def reg(veth_pair) -> Iterator[tuple[Any, TransferRegistry]]:  # type: ignore[no-untyped-def]
    with shaped_registry(veth_pair, "cutexp") as (_dp, r):
        yield veth_pair, r


def test_a_transfers_cut_expires_after_the_linger_and_an_operators_cut_stays(reg) -> None:  # type: ignore[no-untyped-def]
    vp, r = reg
    r.cut_linger_s = 0.3
    by_transfer = ks.FlowKey("tcp", vp.addr_a, 40401, vp.addr_b, 7401)
    by_operator = ks.FlowKey("tcp", vp.addr_a, 40402, vp.addr_b, 7402)
    r.add("job-1", 1, by_transfer, 10_000_000, 600, transfer_id="ckpt-a")
    r.add("job-1", 1, by_operator, 10_000_000, 600, transfer_id="ckpt-b")
    assert r.flow_switch("ckpt-a", {"action": "on"})["origin"] == "transfer"
    assert r.flow_switch(str(by_operator), {"action": "on"})["origin"] == "operator"
    r.remove("ckpt-a")
    r.remove("ckpt-b")
    for key in (by_transfer, by_operator):  # both still cut, without a class
        e = flow_entry(r, key)
        assert e is not None and e.flags & abi.LM_FLOW_KILL and e.priority == 0, (key, e)
    assert r.expire_cuts() == []  # not yet: the linger runs from the transfer's end
    time.sleep(0.4)
    assert r.expire_cuts() == [by_transfer]
    assert flow_entry(r, by_transfer) is None
    e = flow_entry(r, by_operator)
    assert e is not None and e.flags & abi.LM_FLOW_KILL
    counts = r.cut_counts()
    assert counts["operator_cuts"] == 1 and counts["expiring_cuts"] == 0 and counts["flow_entries"] == 1, counts
    r.flow_switch(str(by_operator), {"action": "off"})
    assert flow_entry(r, by_operator) is None and r.cut_counts()["operator_cuts"] == 0


def test_an_armed_transfer_cut_expires_counting_from_its_deadline(reg) -> None:  # type: ignore[no-untyped-def]
    vp, r = reg
    r.cut_linger_s = 10.0
    key = ks.FlowKey("tcp", vp.addr_a, 40403, vp.addr_b, 7403)
    r.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-armed")
    r.flow_switch("ckpt-armed", {"action": "arm", "at_s": 60})
    now = time.time()
    r.remove("ckpt-armed")
    assert r.expire_cuts(now + 30) == []  # the transfer ended early: the arm still stands
    assert r.expire_cuts(now + 65) == []  # cut at 60 s, lingers 10 s more
    e = flow_entry(r, key)
    assert e is not None and e.flags & abi.LM_FLOW_ARMED
    assert r.expire_cuts(now + 71) == [key]
    assert flow_entry(r, key) is None


def test_a_transfer_registering_a_lingering_cuts_flow_keeps_it(reg) -> None:  # type: ignore[no-untyped-def]
    """The same 5-tuple registered again while the old transfer's cut lingers: the cut is the new
    transfer's now (it stays while that transfer lives), and the expiry never deletes its entry."""
    vp, r = reg
    r.cut_linger_s = 0.0
    key = ks.FlowKey("tcp", vp.addr_a, 40404, vp.addr_b, 7404)
    r.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-old")
    r.flow_switch("ckpt-old", {"action": "on"})
    r.remove("ckpt-old")
    r.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-new")
    assert r.expire_cuts(time.time() + 3600) == []
    e = flow_entry(r, key)
    assert e is not None and e.priority and e.flags & abi.LM_FLOW_KILL, e
    r.remove("ckpt-new")
    assert r.expire_cuts(time.time() + 1) == [key] and flow_entry(r, key) is None


def test_a_full_lm_flows_is_refused_with_its_limit(reg) -> None:  # type: ignore[no-untyped-def]
    vp, r = reg
    limit = r.flows.max_entries
    assert limit == abi.LM_MAX_FLOWS
    keys = [ks.FlowKey("udp", vp.addr_a, 20000 + i, vp.addr_b, 9000) for i in range(limit)]
    for k in keys:
        r.flow_switch(str(k), {"action": "on"})
    extra = ks.FlowKey("udp", vp.addr_a, 19999, vp.addr_b, 9000)
    with pytest.raises(ApiError) as cut:
        r.flow_switch(str(extra), {"action": "on"})
    assert cut.value.status == 507 and str(limit) in str(cut.value) and "LM_MAX_FLOWS" in str(cut.value), cut.value
    assert f"{limit} cuts by 5-tuple" in str(cut.value), cut.value
    with pytest.raises(ApiError) as add:
        r.add("job-1", 1, ks.FlowKey("tcp", vp.addr_a, 40405, vp.addr_b, 7405), 10_000_000, 600, transfer_id="ckpt-full")
    assert add.value.status == 507 and "LM_MAX_FLOWS" in str(add.value), add.value
    assert "ckpt-full" not in r.transfers and not r.tree.leaves(), r.tree.leaves()  # nothing left behind
    r.flow_switch(str(keys[0]), {"action": "off"})
    r.add("job-1", 1, ks.FlowKey("tcp", vp.addr_a, 40405, vp.addr_b, 7405), 10_000_000, 600, transfer_id="ckpt-full")


FLOW_T = "tcp:10.79.0.1:40410->10.79.0.2:7410"
FLOW_OP = "tcp:10.79.0.1:40411->10.79.0.2:7411"


def _flows(a: AgentProc) -> dict[str, dict[str, Any]]:
    return {f["flow"]: f for f in a.json("net", "flows")}


def test_a_transfers_cut_expires_across_an_agent_restart(veth_pair, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with agent_factory(tmp_path, veth_pair, "[shaping]\nlink_mbit = 1000\nflow_cut_linger_s = 6\n") as make:
        a = make()
        job = a.json("submit", "--name", "lm-t-cutexp", "--", "sleep", "600")
        a.json("net", "transfers", "add", "--job", job["id"], "--flow", FLOW_T, "--bytes", "100M",
               "--deadline", "+600s", "--id", "t-cut")
        a.json("net", "kill-flow", "t-cut", "on")
        a.json("net", "kill-flow", FLOW_OP, "on")
        a.json("net", "transfers", "rm", "t-cut")
        flows = _flows(a)
        assert flows[FLOW_T]["origin"] == "transfer" and flows[FLOW_T]["cut"], flows[FLOW_T]
        assert 0 < flows[FLOW_T]["expires_in_s"] <= 6, flows[FLOW_T]
        assert flows[FLOW_OP]["origin"] == "operator" and flows[FLOW_OP]["expires_in_s"] is None, flows[FLOW_OP]
        a.kill9()
        a.start()
        flows = _flows(a)
        if FLOW_T in flows:  # not yet expired (a slow restart may have taken the whole linger)
            assert flows[FLOW_T]["origin"] == "transfer" and flows[FLOW_T]["cut"], flows[FLOW_T]
        wait_until(lambda: FLOW_T not in _flows(a), 30, "the transfer's cut to expire after the restart",
                   a.log)
        flows = _flows(a)
        assert flows[FLOW_OP]["cut"] and flows[FLOW_OP]["origin"] == "operator", flows
        status = a.json("net", "transfers")["status"]
        assert status["operator_cuts"] == 1 and status["flow_entries_max"] == abi.LM_MAX_FLOWS, status
        events = a.ctl("events").stdout
        assert "expired" in events, events


def test_a_cut_by_transfer_id_racing_the_transfers_removal_still_expires(reg) -> None:  # type: ignore[no-untyped-def]
    """``kill-flow <transfer id> on`` (the loop) while the transfer is being removed (the registry's
    thread): the removal has let go of the flow entry but the transfer is still registered when the
    cut lands, so the cut (which makes a new entry) is the transfer's, with no expiry yet, and the
    transfer is gone a moment later. The interleaving is taken step by step here: the removal's
    _release_flow, the cut, then the rest of the removal. The sweep must start the cut's linger."""
    vp, r = reg
    r.cut_linger_s = 0.0
    key = ks.FlowKey("tcp", vp.addr_a, 40406, vp.addr_b, 7406)
    t = r.add("job-1", 1, key, 10_000_000, 600, transfer_id="ckpt-race")
    r._release_flow(t.flow, t.id)  # remove(), first step
    r.flow_switch("ckpt-race", {"action": "on"})  # the loop, in between
    r.tree.remove_leaf(t.minor)  # remove(), the rest
    del r.transfers[t.id]
    r.sweep_once(time.time() + 1)
    assert flow_entry(r, key) is None, "the cut of an ended transfer never expires"
