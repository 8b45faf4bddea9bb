"""The uplink netguard attaches to when ``net.uplink`` is unset and the default route is ECMP
(``ip route add default nexthop via A dev X nexthop via B dev Y``: one route with
RTA_MULTIPATH and no RTA_OIF), IPv4 and IPv6. Nexthops all on one interface: that interface.
Nexthops over two interfaces: refused, naming both and net.uplink, since netguard's programs
on one of them would see only the flows hashed to it. Real namespaces with real routes;
laminar.net.tc runs inside them as the agent would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, delete_netns, kernel_ready, make_netns

pytestmark = [pytest.mark.kernel, pytest.mark.skipif(kernel_ready() is not None, reason=str(kernel_ready()))]

SCRIPT = """
import json
from laminar.net import netguard
try:
    print(json.dumps({"uplink": netguard.resolve_uplink('')[0]}))
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
"""


def _uplink_in(ns) -> dict[str, str]:  # type: ignore[no-untyped-def]
    env = {**os.environ, "PYTHONPATH": f"{REPO}/agent"}
    res = subprocess.run(ns.argv(sys.executable, "-c", SCRIPT), capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _node(tag: str):  # type: ignore[no-untyped-def]
    """A namespace with three up interfaces lmtec0..2, each with an IPv4 and an IPv6 subnet."""
    ns = make_netns(tag)
    for i in range(3):
        ns.run("ip", "link", "add", f"lmtec{i}", "type", "veth", "peer", "name", f"lmtec{i}p")
        ns.run("ip", "link", "set", f"lmtec{i}p", "up")
        ns.run("ip", "link", "set", f"lmtec{i}", "up")
        ns.run("ip", "addr", "add", f"10.67.{i}.1/24", "dev", f"lmtec{i}")
        ns.run("ip", "addr", "add", f"fd6f:{i}::1/64", "dev", f"lmtec{i}", "nodad")
    return ns


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_an_ecmp_default_route_over_two_interfaces_is_refused_naming_both(v6: bool) -> None:
    ns = _node("ecmp2")
    try:
        if v6:
            ns.run("ip", "-6", "route", "add", "default", "nexthop", "via", "fd6f:1::fe", "dev", "lmtec1",
                   "nexthop", "via", "fd6f:2::fe", "dev", "lmtec2")
        else:
            ns.run("ip", "route", "add", "default", "nexthop", "via", "10.67.1.254", "dev", "lmtec1",
                   "nexthop", "via", "10.67.2.254", "dev", "lmtec2")
        got = _uplink_in(ns)
        assert "error" in got, got
        assert "lmtec1" in got["error"] and "lmtec2" in got["error"] and "net.uplink" in got["error"], got
        assert "no default route" not in got["error"], got
    finally:
        delete_netns(ns)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_an_ecmp_default_route_on_one_interface_is_that_uplink(v6: bool) -> None:
    ns = _node("ecmp1")
    try:
        if v6:
            ns.run("ip", "-6", "route", "add", "default", "nexthop", "via", "fd6f:2::fe", "dev", "lmtec2",
                   "nexthop", "via", "fd6f:2::fd", "dev", "lmtec2")
        else:
            ns.run("ip", "route", "add", "default", "nexthop", "via", "10.67.2.254", "dev", "lmtec2",
                   "nexthop", "via", "10.67.2.253", "dev", "lmtec2")
        assert _uplink_in(ns) == {"uplink": "lmtec2"}
    finally:
        delete_netns(ns)


def test_a_lower_metric_single_default_route_wins_over_an_ecmp_one() -> None:
    ns = _node("ecmpm")
    try:
        ns.run("ip", "route", "add", "default", "metric", "200", "nexthop", "via", "10.67.1.254", "dev", "lmtec1",
               "nexthop", "via", "10.67.2.254", "dev", "lmtec2")
        ns.run("ip", "route", "add", "default", "metric", "100", "via", "10.67.0.254", "dev", "lmtec0")
        assert _uplink_in(ns) == {"uplink": "lmtec0"}
        # and the ECMP route is found when it has the lowest metric
        ns.run("ip", "route", "del", "default", "metric", "100")
        ns.run("ip", "route", "add", "default", "metric", "300", "via", "10.67.0.254", "dev", "lmtec0")
        got = _uplink_in(ns)
        assert "error" in got and "lmtec1" in got["error"] and "lmtec2" in got["error"], got
    finally:
        delete_netns(ns)
