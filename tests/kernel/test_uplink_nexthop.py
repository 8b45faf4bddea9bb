"""The uplink netguard attaches to when ``net.uplink`` is unset and the default route uses a
nexthop object (``ip nexthop add id N via A dev X; ip route add default nhid N``: what FRR
and other routing daemons install on kernels since 5.3), a single nexthop or a group (ECMP),
IPv4 and IPv6. Real namespaces with real routes; laminar.net.tc runs inside them as the agent
would (read-only: ``netguard.resolve_uplink('')``, through ``tc.default_route_ifname``).

A route with a nexthop object carries RTA_NH_ID. With ``net.ipv4.nexthop_compat_mode = 1``
(the default; it governs IPv6 routes too) the kernel also fills in the legacy RTA_OIF /
RTA_MULTIPATH. With it 0 (set by operators who run a routing daemon with nexthop objects, to
halve route dumps) a route carries RTA_NH_ID alone: the uplink detection looks the nexthop up
(RTM_GETNEXTHOP; a group's members each). Before, it did not, saw no interface, and the agent
refused to start saying there was no default route, which was not so."""

from __future__ import annotations

import pytest
from conftest import delete_netns, kernel_ready
from test_uplink_ecmp import _node, _uplink_in

pytestmark = [pytest.mark.kernel, pytest.mark.skipif(kernel_ready() is not None, reason=str(kernel_ready()))]

def _gw(v6: bool, i: int, last: int = 254) -> str:
    return f"fd6f:{i}::{last:x}" if v6 else f"10.67.{i}.{last}"


def _default_via_nexthop(ns, v6: bool, devs: list[int], compat: int) -> None:  # type: ignore[no-untyped-def]
    """The default route through nexthop object(s): one nexthop per interface in ``devs``, a
    group of them when there are several; ``compat`` is net.ipv4.nexthop_compat_mode."""
    ns.run("sysctl", "-qw", f"net.ipv4.nexthop_compat_mode={compat}")
    family = ["-6"] if v6 else []
    ids = []
    for n, i in enumerate(devs, start=1):
        ns.run("ip", *family, "nexthop", "add", "id", str(n), "via", _gw(v6, i), "dev", f"lmtec{i}")
        ids.append(str(n))
    nhid = ids[0]
    if len(ids) > 1:
        nhid = "100"
        ns.run("ip", "nexthop", "add", "id", nhid, "group", "/".join(ids))
    ns.run("ip", *family, "route", "add", "default", "nhid", nhid)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_a_default_route_through_a_nexthop_object_is_that_uplink(v6: bool) -> None:
    ns = _node("nh1")
    try:
        _default_via_nexthop(ns, v6, [1], compat=1)
        assert _uplink_in(ns) == {"uplink": "lmtec1"}
    finally:
        delete_netns(ns)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_a_default_route_through_a_nexthop_group_over_two_interfaces_is_refused_naming_both(v6: bool) -> None:
    ns = _node("nhg")
    try:
        _default_via_nexthop(ns, v6, [1, 2], compat=1)
        got = _uplink_in(ns)
        assert "error" in got, got
        assert "lmtec1" in got["error"] and "lmtec2" in got["error"] and "net.uplink" in got["error"], got
    finally:
        delete_netns(ns)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_without_compat_mode_a_default_route_through_a_nexthop_object_is_that_uplink(v6: bool) -> None:
    ns = _node("nh1c")
    try:
        _default_via_nexthop(ns, v6, [1], compat=0)
        assert _uplink_in(ns) == {"uplink": "lmtec1"}
    finally:
        delete_netns(ns)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_without_compat_mode_a_nexthop_group_over_two_interfaces_is_refused_naming_both(v6: bool) -> None:
    ns = _node("nhgc")
    try:
        _default_via_nexthop(ns, v6, [1, 2], compat=0)
        got = _uplink_in(ns)
        assert "error" in got, got
        assert "lmtec1" in got["error"] and "lmtec2" in got["error"] and "net.uplink" in got["error"], got
    finally:
        delete_netns(ns)
