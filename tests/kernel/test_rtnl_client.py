"""laminar.net.rtnl against the kernel: what it writes is read back by a second implementation
(pyroute2, and `tc`), its sockets live in the namespace they were made for, and the kernel's
refusals come back with errno, extack and the request's name.

pyroute2 reads in a child process entered into the test's namespace (``pyroute2_in``), never in
this one: its ``IPRoute(netns=...)`` changes the calling process's namespaces (seen: after one,
this process's /run/netns was empty and a netns opened by name here had only ``lo``), which made
these tests fail one run in two and would do the same to any test after them."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
from typing import Any

import pytest
from test_killswitch_dataplane import REPO, start_dataplane, stop_dataplane

from laminar.net import rtnl

pytestmark = pytest.mark.kernel
CLSACT = 0xFFFF0000


def pyroute2_in(ns, code: str, *args: object) -> Any:  # type: ignore[no-untyped-def]
    """What ``code`` (Python run in namespace `ns`, with ``ipr`` an open pyroute2 IPRoute and
    ``args`` its arguments) leaves in ``out``, through JSON."""
    prog = ("import json, sys\nfrom pyroute2 import IPRoute\nargs = json.loads(sys.argv[1])\nout = None\n"
            "with IPRoute() as ipr:\n" + "".join(f"    {line}\n" for line in code.strip().splitlines())
            + "print(json.dumps(out))\n")
    res = subprocess.run(ns.argv(sys.executable, "-c", prog, json.dumps(list(args))), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def qdisc_kinds(ns, idx: int) -> list[str]:  # type: ignore[no-untyped-def]
    return pyroute2_in(ns, 'out = [q.get_attr("TCA_KIND") for q in ipr.get_qdiscs(index=args[0])]', idx)


def test_socket_in_a_netns_sees_that_namespace_only(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    own_ns = os.readlink("/proc/thread-self/ns/net")
    with rtnl.Rtnl(netns=vp.a.name) as nl:
        idx = nl.link_index(vp.ifname_a)
        assert idx is not None and [idx] == pyroute2_in(vp.a, "out = ipr.link_lookup(ifname=args[0])", vp.ifname_a)
        assert nl.link_name(idx) == vp.ifname_a
        assert nl.link_index(vp.ifname_b) is None  # the peer is in namespace b
        assert nl.link_index("x" * 20) is None
    assert os.readlink("/proc/thread-self/ns/net") == own_ns  # the caller never moved
    with rtnl.Rtnl() as nl:
        assert nl.link_index(vp.ifname_a) is None
    with pytest.raises(FileNotFoundError, match="no network namespace 'lm-t-none-000000'"):
        rtnl.Rtnl(netns="lm-t-none-000000")


def test_default_route_of_the_namespace(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    with rtnl.Rtnl(netns=vp.a.name) as nl:
        idx = nl.link_index(vp.ifname_a)
        defaults = [r for r in nl.routes(socket.AF_INET)
                    if rtnl.route_table(r) == rtnl.RT_TABLE_MAIN and r.header[1] == 0]
        assert [rtnl.u32(r.attrs.get(rtnl.RTA_OIF)) for r in defaults] == [idx]


def test_qdisc_written_is_read_back_and_refusals_carry_errno(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    with rtnl.Rtnl(netns=vp.a.name) as nl:
        idx = nl.link_index(vp.ifname_a)
        assert idx is not None
        nl.tc(rtnl.RTM_NEWQDISC, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, idx, CLSACT, rtnl.TC_H_CLSACT,
              tc_kind="clsact", what="adding clsact")
        assert qdisc_kinds(vp.a, idx).count("clsact") == 1
        assert "qdisc clsact ffff:" in vp.a.run("tc", "qdisc", "show", "dev", vp.ifname_a).stdout
        assert [(q.tc_kind, q.handle) for q in nl.qdiscs(idx) if q.tc_kind == "clsact"] == [("clsact", CLSACT)]

        with pytest.raises(rtnl.NetlinkError) as again:
            nl.tc(rtnl.RTM_NEWQDISC, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, idx, CLSACT, rtnl.TC_H_CLSACT,
                  tc_kind="clsact", what=f"adding clsact on {vp.ifname_a}")
        assert again.value.errno == errno.EEXIST and f"adding clsact on {vp.ifname_a}: File exists" in str(again.value)

        with pytest.raises(rtnl.NetlinkError) as missing:
            nl.tc(rtnl.RTM_DELTFILTER, 0, idx, 1, 0xFFFFFFF3, (0xC0DE << 16) | socket.htons(3), tc_kind="bpf",
                  what="deleting bpf filter 'lm_nope'")
        e = missing.value
        assert e.errno == errno.ENOENT and "deleting bpf filter 'lm_nope'" in str(e)
        assert e.extack  # the kernel says which lookup failed

        nl.tc(rtnl.RTM_DELQDISC, 0, idx, CLSACT, rtnl.TC_H_CLSACT, tc_kind="clsact", what="deleting clsact")
        assert "clsact" not in qdisc_kinds(vp.a, idx)


# laminar.net.tc over the client, run in the node's namespace as the agent would be.
TC_SCRIPT = r"""
import json, sys
from laminar.net import rtnl, tc
ifname = sys.argv[1]
idx = tc.ifindex_of(ifname)
out = {"idx": idx, "default": tc.default_route_ifname(), "has_clsact": tc.has_clsact(idx),
       "egress": tc.list_bpf_filters(idx, "egress"), "ingress": tc.list_bpf_filters(idx, "ingress"),
       "ensure_again": tc.ensure_clsact(idx), "detached": tc.detach_bpf(idx, "egress")}
out["egress_after"] = tc.list_bpf_filters(idx, "egress")
try:
    with rtnl.Rtnl() as nl:
        tc.delete_bpf_filter(nl, idx, "egress", "lm_egress", tc.DEFAULT_PRIO)
except rtnl.NetlinkError as e:
    out["missing"] = [e.errno, str(e)]
try:
    tc.ifindex_of("lmtnone0")
except LookupError as e:
    out["lookup"] = str(e)
out["deleted"] = tc.delete_clsact(idx)
out["deleted_again"] = tc.delete_clsact(idx)
out["has_after"] = tc.has_clsact(idx)
out["ingress_without_clsact"] = tc.list_bpf_filters(idx, "ingress")
print(json.dumps(out))
"""


def test_tc_filters_listed_detached_and_refused(veth_pair) -> None:  # type: ignore[no-untyped-def]
    vp = veth_pair
    dp = start_dataplane(vp.a.argv(), vp.ifname_a, "rtnl")
    try:
        shown = vp.a.run("tc", "filter", "show", "dev", vp.ifname_a, "egress").stdout
        m = re.search(r"pref (\d+) bpf .*handle 0x1 lm_egress direct-action .*id (\d+) name lm_egress tag ([0-9a-f]+)",
                      shown)
        assert m, shown
        env = {**os.environ, "PYTHONPATH": f"{REPO}/agent"}
        res = subprocess.run(vp.a.argv(sys.executable, "-c", TC_SCRIPT, vp.ifname_a), capture_output=True,
                             text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["default"] == vp.ifname_a and out["has_clsact"] and out["ensure_again"] is False
        assert out["egress"] == [{"name": "lm_egress", "prio": int(m.group(1)), "protocol": 3, "handle": 1,
                                  "prog_id": int(m.group(2)), "tag": m.group(3), "direct_action": True}]
        assert [f["name"] for f in out["ingress"]] == ["lm_ingress"]
        assert out["detached"] == 1 and out["egress_after"] == []
        assert out["missing"][0] == errno.ENOENT and "deleting bpf filter 'lm_egress'" in out["missing"][1]
        assert "no network interface 'lmtnone0'" in out["lookup"]
        assert out["deleted"] is True and out["deleted_again"] is False and out["has_after"] is False
        assert out["ingress_without_clsact"] == []
    finally:
        stop_dataplane(dp)


def test_htb_classes_written_are_read_back_by_pyroute2(veth_pair) -> None:  # type: ignore[no-untyped-def]
    from laminar.net.htb import BACKGROUND_MINOR, HTB_MAJOR, MIGRATION_MINOR, ROOT_MINOR, HtbTree

    vp = veth_pair
    gbit = 1_000_000_000
    tree = HtbTree(vp.ifname_a, 40 * gbit, 10 * gbit, netns=vp.a.name)  # above 4 GB/s: the 64-bit rates
    try:
        tree.setup()
        leaf = tree.add_leaf(300_000_000)
        tree.set_leaf(leaf, 200_000_000)
        vp.a.run(sys.executable, "-c", "import socket,sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                 "[s.sendto(b'x' * 100, (sys.argv[1], 9)) for _ in range(5)]", vp.addr_b)  # to background
        read = pyroute2_in(vp.a, """
from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime
idx = ipr.link_lookup(ifname=args[0])[0]
root = [q for q in ipr.get_qdiscs(index=idx) if q["parent"] == 0xFFFFFFFF][0]
glob = root.get_nested("TCA_OPTIONS", "TCA_HTB_INIT")
out = {"root": [root.get_attr("TCA_KIND"), root["handle"]],
       "glob": [glob["defcls"], glob["rate2quantum"], glob["version"] >> 16],
       "xmittime": calc_xmittime(args[1], args[2]), "classes": {}}
for c in ipr.get_classes(index=idx):
    parms = c.get_nested("TCA_OPTIONS", "TCA_HTB_PARMS")
    out["classes"][c["handle"] & 0xFFFF] = {
        "parent": c["parent"], "parms": [parms[k] for k in ("rate", "ceil", "prio", "quantum", "buffer", "cbuffer")],
        "rate64": c.get_nested("TCA_OPTIONS", "TCA_HTB_RATE64"), "ceil64": c.get_nested("TCA_OPTIONS", "TCA_HTB_CEIL64"),
        "bytes": c.get_nested("TCA_STATS2", "TCA_STATS_BASIC")["bytes"]}
""", vp.ifname_a, 200_000_000 // 8, max(200_000_000 // 8 // 1000 + 1600, 65536 + 1600))
        assert read["root"] == ["htb", HTB_MAJOR << 16]
        assert read["glob"] == [BACKGROUND_MINOR, 10, 3]
        got = {int(k): v for k, v in read["classes"].items()}
        assert set(got) == {ROOT_MINOR, BACKGROUND_MINOR, MIGRATION_MINOR, leaf}
        assert got[leaf]["parent"] == (HTB_MAJOR << 16) | MIGRATION_MINOR
        rate_b = 200_000_000 // 8
        xmit = read["xmittime"]  # tc's own arithmetic
        assert got[leaf]["parms"] == [rate_b, rate_b, 1, 200_000, xmit, xmit]
        link_b = 40 * gbit // 8
        assert got[ROOT_MINOR]["rate64"] == link_b
        assert got[BACKGROUND_MINOR]["ceil64"] == link_b
        assert "rate 40Gbit ceil 40Gbit" in vp.a.run("tc", "class", "show", "dev", vp.ifname_a).stdout
        stats = tree.leaf_stats()
        assert (stats[leaf].rate_bps, stats[leaf].ceil_bps) == (200_000_000, 200_000_000)
        assert (stats[ROOT_MINOR].rate_bps, stats[BACKGROUND_MINOR].rate_bps) == (40 * gbit, 10 * gbit)
        assert stats[BACKGROUND_MINOR].bytes >= got[BACKGROUND_MINOR]["bytes"] > 0  # read later: never fewer
        tree.remove_leaf(leaf)
        tree.remove_leaf(leaf)  # gone already: not an error
        assert leaf not in tree.leaf_stats()
    finally:
        tree.teardown()
