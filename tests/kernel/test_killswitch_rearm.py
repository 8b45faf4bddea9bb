"""Arming again never reopens what an armed deadline has already cut.

An armed switch cuts in the data plane once ``bpf_ktime_get_ns()`` passes ``kill_at_ns``. Arming
the same flow, job or the lent switch again wrote the new deadline over the passed one, so traffic
that had been cut at the end of a reclaim window flowed again, at once and silently, until the new
deadline (``arm`` read as "cut at T" but did "restore now, cut at T"); only ``off`` is meant to
restore. A passed armed deadline now turns into a plain cut when the switch is armed again (the
new deadline is kept, and ``off`` clears both), and the answer says the cut stays.

The flow case runs real UDP traffic through netguard on a veth (the stand-in of
test_killswitch_dataplane); the job and lent cases run the real laminard and read its pinned maps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from test_killswitch_dataplane import arrivals, flood, receiver, start_dataplane, stop_dataplane

from laminar.bpf import abi
from laminar.bpf.libbpf import BpfMap
from laminar.net import killswitch as ks

pytestmark = pytest.mark.kernel


@pytest.fixture
def node(veth_pair) -> Iterator[tuple[Any, Any]]:  # type: ignore[no-untyped-def]
    dp = start_dataplane(veth_pair.a.argv(), veth_pair.ifname_a, "rearm")
    try:
        yield veth_pair, dp
    finally:
        stop_dataplane(dp)


def test_rearming_a_flow_cut_by_its_deadline_keeps_it_cut(node) -> None:  # type: ignore[no-untyped-def]
    vp, dp = node
    flows = dp.map("lm_flows")
    key = ks.FlowKey("udp", vp.addr_a, 41031, vp.addr_b, 9031)
    rx = receiver(vp.b, 4.0, 9031)
    tx = flood(vp.a, vp.addr_b, 9031, 41031, 3.0)
    time.sleep(0.3)
    deadline = ks.deadline_ns(0.5)
    ks.apply_flow_switch(flows, key, "arm", deadline)
    time.sleep(1.0)  # cut by its deadline
    rearmed = time.monotonic_ns()
    entry = ks.apply_flow_switch(flows, key, "arm", ks.deadline_ns(30))
    tx.wait(timeout=30)
    times = arrivals(rx)[9031]
    assert [t for t in times if t < deadline], "the flood did not get through before the deadline"
    reopened = [t for t in times if t - rearmed > 50_000_000]
    assert reopened == [], f"arming again reopened the cut flow: {len(reopened)} packets got through"
    assert entry.flags & ks.LM_FLOW_KILL and entry.describe()["cut"]
    ks.apply_flow_switch(flows, key, "off", None)
    e = ks.FlowEntry.unpack(flows.lookup(key.pack()) or b"")
    assert not e.flags & (ks.LM_FLOW_KILL | ks.LM_FLOW_ARMED)


def _job_entry(a: AgentProc, cgroup_id: int) -> abi.LmJob:
    m = BpfMap.from_pin(a.pin_root / "lm_jobs")
    try:
        raw = m.lookup(int(cgroup_id).to_bytes(8, "little"))
    finally:
        m.close()
    assert raw is not None
    return abi.LmJob.from_buffer_copy(raw)


def _global(a: AgentProc) -> abi.LmGlobal:
    m = BpfMap.from_pin(a.pin_root / "lm_global")
    try:
        raw = m.lookup(abi.u32(0))
    finally:
        m.close()
    assert raw is not None
    return abi.LmGlobal.from_buffer_copy(raw)


def _cut(flags: int, kill_bit: int, armed_bit: int, kill_at_ns: int) -> bool:
    return bool(flags & kill_bit) or bool(flags & armed_bit and time.monotonic_ns() >= kill_at_ns)


def test_rearming_a_job_or_the_lent_switch_after_its_deadline_keeps_the_cut(agent: AgentProc) -> None:
    a = agent
    job = a.json("submit", "--name", "lm-t-rearm", "--", "sleep", "600")
    a.json("killswitch", "arm", "--job", job["id"], "--at", "+0.3s")
    a.json("killswitch", "arm", "--lent", "--at", "+0.3s")
    wait_until(lambda: _cut((e := _job_entry(a, job["cgroup_id"])).flags, abi.LM_JOB_KILL, abi.LM_JOB_ARMED,
                            e.kill_at_ns), 10, "the job's armed deadline to pass")
    wait_until(lambda: _cut((g := _global(a)).flags, abi.LM_GLOBAL_KILL_LENT, abi.LM_GLOBAL_ARMED, g.kill_at_ns),
               10, "the lent deadline to pass")
    res = a.json("killswitch", "arm", "--job", job["id"], "--at", "+600s")
    e = _job_entry(a, job["cgroup_id"])
    assert _cut(e.flags, abi.LM_JOB_KILL, abi.LM_JOB_ARMED, e.kill_at_ns), "arming again reopened the cut job"
    assert "stays cut" in res["message"], res
    res = a.json("killswitch", "arm", "--lent", "--at", "+600s")
    g = _global(a)
    assert _cut(g.flags, abi.LM_GLOBAL_KILL_LENT, abi.LM_GLOBAL_ARMED, g.kill_at_ns), "arming again reopened lent"
    assert "stays cut" in res["message"], res
    a.json("killswitch", "off", "--job", job["id"])
    a.json("killswitch", "off", "--lent")
    e, g = _job_entry(a, job["cgroup_id"]), _global(a)
    assert not e.flags & (abi.LM_JOB_KILL | abi.LM_JOB_ARMED)
    assert not g.flags & (abi.LM_GLOBAL_KILL_LENT | abi.LM_GLOBAL_ARMED)
