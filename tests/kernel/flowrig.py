"""The flow-cut rig shared by the registry tests: real netguard, a real HTB tree, the real registry.

``shaped_registry(vp, tag)`` loads and attaches netguard on node ``a`` of a veth pair (the
stand-in process of test_killswitch_dataplane, maps pinned under a ``laminar-t-<tag>-<pid>``
root), builds the shaping tree on the same veth (1000 Mbit/s link, 400 Mbit/s floor) and yields
the data plane and a ``TransferRegistry`` writing its pinned ``lm_flows``; both are torn down
after, even when the test fails. ``flow_entry(reg, key)`` reads one flow's entry.

    with shaped_registry(veth_pair, "mytag") as (dp, reg):
        reg.add("job-1", 1, ks.FlowKey("tcp", vp.addr_a, 40000, vp.addr_b, 7000), 10_000_000, 600)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from test_killswitch_dataplane import DataPlane, start_dataplane, stop_dataplane

from laminar.net import killswitch as ks
from laminar.net.htb import HtbTree
from laminar.net.transfers import TransferRegistry

MBIT = 1_000_000
LINK_BPS, FLOOR_BPS = 1000 * MBIT, 400 * MBIT


@contextmanager
def shaped_registry(vp: Any, tag: str) -> Iterator[tuple[DataPlane, TransferRegistry]]:
    """netguard + HTB tree on ``vp.ifname_a`` (in ``vp.a``) and a registry over them; see the module."""
    dp = start_dataplane(vp.a.argv(), vp.ifname_a, tag)
    tree = HtbTree(vp.ifname_a, LINK_BPS, FLOOR_BPS, netns=vp.a.name)
    try:
        tree.setup()
        reg = TransferRegistry(tree=tree, flows_map=dp.map("lm_flows"))
        reg.configure(LINK_BPS, FLOOR_BPS)
        yield dp, reg
    finally:
        tree.teardown()
        stop_dataplane(dp)


def flow_entry(reg: TransferRegistry, key: ks.FlowKey) -> ks.FlowEntry | None:
    """The flow's ``lm_flows`` entry, or None."""
    raw = reg.flows.lookup(key.pack())
    return ks.FlowEntry.unpack(raw) if raw is not None else None
