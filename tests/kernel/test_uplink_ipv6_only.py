"""The uplink netguard attaches to when ``net.uplink`` is unset, on an IPv6-only node: the
interface of its IPv6 default route (a node on an IPv6-only fabric has no IPv4 default route).
Real namespaces with real routes; laminar.net.tc runs inside them as the agent would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, delete_netns, kernel_ready, make_netns

pytestmark = [pytest.mark.kernel, pytest.mark.skipif(kernel_ready() is not None, reason=str(kernel_ready()))]

SCRIPT = "import json; from laminar.net import tc, netguard; print(json.dumps([tc.default_route_ifname(), " \
         "netguard.resolve_uplink('')[0]]))"


def _uplink_in(ns) -> list[str]:  # type: ignore[no-untyped-def]
    env = {**os.environ, "PYTHONPATH": f"{REPO}/agent"}
    res = subprocess.run(ns.argv(sys.executable, "-c", SCRIPT), capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return list(json.loads(res.stdout))


def test_an_ipv6_only_node_attaches_to_its_ipv6_default_routes_interface() -> None:
    ns = make_netns("v6up")
    try:
        # two interfaces: the IPv6 default route leaves by the second, so the first is no guess
        for i in (0, 1):
            ns.run("ip", "link", "add", f"lmt6up{i}", "type", "veth", "peer", "name", f"lmt6up{i}p")
            ns.run("ip", "link", "set", f"lmt6up{i}p", "up")
            ns.run("ip", "link", "set", f"lmt6up{i}", "up")
            ns.run("ip", "addr", "add", f"fd6e:{i}::1/64", "dev", f"lmt6up{i}", "nodad")
        ns.run("ip", "-6", "route", "add", "default", "via", "fd6e:1::fe", "dev", "lmt6up1")
        assert _uplink_in(ns) == ["lmt6up1", "lmt6up1"]
        # an IPv4 default route, where there is one, still wins (dual-stack nodes as before)
        ns.run("ip", "addr", "add", "10.66.0.1/24", "dev", "lmt6up0")
        ns.run("ip", "route", "add", "default", "via", "10.66.0.254", "dev", "lmt6up0")
        assert _uplink_in(ns) == ["lmt6up0", "lmt6up0"]
    finally:
        delete_netns(ns)
