"""An agent restarted on another uplink leaves nothing on the old one (real laminard).

The agent records what it attached (``netguard.attachment``: the uplink, whether it created the
clsact qdisc, the pin root) so that ``laminarctl bpf unload`` can put the interface back. When
``net.uplink`` changed between two runs (an operator who first let the agent pick the default
route's interface, then named the bond), the new run overwrote the record with the new uplink and
left the old one as it was: netguard's filters (still cutting the jobs whose switch is on, with the
same pinned maps), the clsact qdisc the agent had made, and the shaping tree (HTB root ``4c4d:``,
all egress of that interface held to its classes). ``bpf unload`` then restored the new uplink only,
and nothing ever removed what was left on the old one. The agent now moves off the old uplink when
it starts on a new one.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel

HTB_HANDLE = "4c4d:"


def _tc(ns: Any, what: str, ifname: str, *extra: str) -> Any:
    out = ns.run("tc", "-j", what, "show", "dev", ifname, *extra).stdout
    return json.loads(out or "[]")


def leftovers(ns: Any, ifname: str) -> dict[str, Any]:
    """What the agent may have put on ``ifname``: lm_ filters, clsact, its HTB root."""
    qdiscs = _tc(ns, "qdisc", ifname)
    filters = [f for d in ("egress", "ingress") for f in _tc(ns, "filter", ifname, d)
               if str(f.get("options", {}).get("bpf_name", "")).startswith("lm_")]
    return {"filters": filters, "clsact": any(q.get("kind") == "clsact" for q in qdiscs),
            "htb": [q for q in qdiscs if q.get("kind") == "htb" and q.get("handle") == HTB_HANDLE]}


def test_restart_on_another_uplink_leaves_the_old_one_as_it_was(veth_pair: Any, tmp_path: Any) -> None:
    vp = veth_pair
    other, peer = f"lmt{secrets.token_hex(3)}c", f"lmt{secrets.token_hex(3)}d"
    vp.a.run("ip", "link", "add", other, "type", "veth", "peer", "name", peer)  # both ends in the node's netns
    for i in (other, peer):
        vp.a.run("ip", "link", "set", i, "up")
    a = AgentProc(tmp_path, vp.ifname_a, vp.a, extra_toml="[shaping]\nlink_mbit = 1000\n")
    try:
        a.start()
        before = leftovers(vp.a, vp.ifname_a)
        assert before["filters"] and before["clsact"] and before["htb"], before
        a.stop()
        a.config_path.write_text(a.config_path.read_text().replace(f'uplink = "{vp.ifname_a}"', f'uplink = "{other}"'))
        a.start()
        now = leftovers(vp.a, other)
        assert now["filters"] and now["clsact"] and now["htb"], now
        old = leftovers(vp.a, vp.ifname_a)
        assert old == {"filters": [], "clsact": False, "htb": []}, f"left on the old uplink {vp.ifname_a}: {old}"
        a.stop()
        r = a.ctl("bpf", "unload", "--force", "--config", str(a.config_path), check=False)
        assert r.returncode == 0, r.stderr
        for ifname in (vp.ifname_a, other):
            assert leftovers(vp.a, ifname) == {"filters": [], "clsact": False, "htb": []}, ifname
    finally:
        a.cleanup()
        vp.a.run("ip", "link", "del", other, check=False)
