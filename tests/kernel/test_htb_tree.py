"""The HTB tree and the transfer registry's classes on a real veth (laminar.net.htb, net.transfers)."""

from __future__ import annotations

import pytest
from test_killswitch_dataplane import start_dataplane, stop_dataplane

from laminar.api import ApiError
from laminar.net import killswitch as ks
from laminar.net.htb import (
    BACKGROUND_MINOR,
    HTB_MAJOR,
    MIGRATION_MINOR,
    ROOT_MINOR,
    HtbTree,
    HtbUnavailable,
    priority_of,
)
from laminar.net.transfers import TransferRegistry

pytestmark = pytest.mark.kernel
MBIT = 1_000_000


def classes(ns, ifname: str) -> str:  # type: ignore[no-untyped-def]
    return ns.run("tc", "class", "show", "dev", ifname).stdout


def test_tree_setup_adopt_teardown(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    tree = HtbTree(vp.ifname_a, 200 * MBIT, 80 * MBIT, netns=vp.a.name)
    try:
        tree.setup()
        out = classes(vp.a, vp.ifname_a)
        for minor in (ROOT_MINOR, BACKGROUND_MINOR, MIGRATION_MINOR):
            assert f"class htb {HTB_MAJOR:x}:{minor:x} " in out
        leaf = tree.add_leaf(30 * MBIT)
        assert f"class htb {HTB_MAJOR:x}:{leaf:x} parent {HTB_MAJOR:x}:{MIGRATION_MINOR:x}" in classes(vp.a, vp.ifname_a)
        # A second tree object (the agent restarted) adopts the tree and its leaf.
        again = HtbTree(vp.ifname_a, 200 * MBIT, 80 * MBIT, netns=vp.a.name)
        again.setup()
        assert again.reattached and again.leaves() == {leaf: 30 * MBIT}
        again.close()
        with pytest.raises(ValueError, match="migration budget"):
            tree.add_leaf(500 * MBIT)
        tree.teardown()
        assert "htb" not in vp.a.run("tc", "qdisc", "show", "dev", vp.ifname_a).stdout
    finally:
        tree.teardown()


def test_refuses_a_root_qdisc_a_person_set_up(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    vp.a.run("tc", "qdisc", "add", "dev", vp.ifname_a, "root", "handle", "7:", "tbf", "rate", "10mbit",
             "burst", "32k", "latency", "50ms")
    tree = HtbTree(vp.ifname_a, 200 * MBIT, 80 * MBIT, netns=vp.a.name)
    with pytest.raises(HtbUnavailable, match="tbf 7:"):
        tree.setup()
    assert "qdisc tbf 7:" in vp.a.run("tc", "qdisc", "show", "dev", vp.ifname_a).stdout  # untouched
    tree.close()


def test_removing_a_transfer_removes_its_class_and_flow(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    dp = start_dataplane(vp.a.argv(), vp.ifname_a, "htb")
    tree = HtbTree(vp.ifname_a, 200 * MBIT, 80 * MBIT, netns=vp.a.name)
    try:
        tree.setup()
        flows = dp.map("lm_flows")
        reg = TransferRegistry(tree=tree, flows_map=flows)
        reg.configure(200 * MBIT, 80 * MBIT)
        key = ks.FlowKey("tcp", vp.addr_a, 40100, vp.addr_b, 7100)
        t = reg.add("job-1", 7, key, 50_000_000, 10.0, transfer_id="ckpt-1")
        assert t.status == "on-time" and t.rate_bps == 44 * MBIT  # 40 Mbit/s need + 10%
        entry = ks.FlowEntry.unpack(flows.lookup(key.pack()) or b"")
        assert entry.priority == priority_of(HTB_MAJOR, t.minor) and entry.job_id == 7
        assert f"{HTB_MAJOR:x}:{t.minor:x}" in classes(vp.a, vp.ifname_a)

        # Bad input: nothing changes.
        before = classes(vp.a, vp.ifname_a)
        for kwargs, why in ((dict(total_bytes=10, deadline_in_s=-1.0), "in the past"),
                            (dict(total_bytes=2_000_000_000, deadline_in_s=1.0), "beyond the link"),
                            (dict(total_bytes=10, deadline_in_s=5.0, max_rate_bps=10**12), "beyond the link")):
            with pytest.raises(ApiError, match=why):
                reg.add("job-1", 7, ks.FlowKey("tcp", vp.addr_a, 40101, vp.addr_b, 7100), **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ApiError, match="already belongs"):
            reg.add("job-1", 7, key, 10, 5.0)
        assert classes(vp.a, vp.ifname_a) == before
        assert len(list(flows.items())) == 1

        reg.remove("ckpt-1")
        assert f"{HTB_MAJOR:x}:{t.minor:x}" not in classes(vp.a, vp.ifname_a)
        assert flows.lookup(key.pack()) is None
        with pytest.raises(ApiError, match="unknown transfer"):
            reg.remove("ckpt-1")
    finally:
        tree.teardown()
        stop_dataplane(dp)
