"""``laminarctl bpf unload`` leaves the uplink as it was: the shaping tree goes too (real laminard).

``bpf unload`` promises the interface as it was before the agent: it removed the tc filters,
the clsact qdisc and the pins, but not the HTB tree the transfer registry puts at the uplink's
root (``4c4d:``, root class at ``shaping.link_mbit``, background held to its class). After an
unload the node's whole egress stayed shaped by an agent that no longer ran, with the
migration leaves still there; the stored transfers came back at the next start. The tree is
now deleted (only ours: an HTB root with the 4c4d handle), and the stored transfers with it,
both by the agent's unload and by ``bpf unload --force`` with no agent running.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel

HTB_HANDLE = "4c4d:"



def root_qdisc(veth_pair: Any) -> dict[str, Any] | None:
    out = veth_pair.a.run("tc", "-j", "qdisc", "show", "dev", veth_pair.ifname_a).stdout
    return next((q for q in json.loads(out or "[]") if q.get("root")), None)


def test_unload_removes_the_shaping_tree(shaping_agent: AgentProc, veth_pair: Any) -> None:
    st = shaping_agent.json("net", "transfers")
    assert st["status"]["shaping"] == "on", st
    q = root_qdisc(veth_pair)
    assert q is not None and q["kind"] == "htb" and q["handle"] == HTB_HANDLE, q
    shaping_agent.ctl("bpf", "unload")
    shaping_agent.proc.wait(30)  # type: ignore[union-attr]
    q = root_qdisc(veth_pair)
    assert q is None or q["handle"] != HTB_HANDLE, f"the HTB tree outlived bpf unload: {q}"


def test_offline_unload_removes_the_shaping_tree(shaping_agent: AgentProc, veth_pair: Any) -> None:
    assert (root_qdisc(veth_pair) or {}).get("handle") == HTB_HANDLE
    shaping_agent.kill9()
    r = shaping_agent.ctl("bpf", "unload", "--force", "--config", str(shaping_agent.config_path))
    assert r.returncode == 0, r.stderr
    q = root_qdisc(veth_pair)
    assert q is None or q["handle"] != HTB_HANDLE, f"the HTB tree outlived bpf unload --force: {q}"
