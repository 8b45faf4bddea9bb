"""tc clsact hooks and direct-action BPF filters through netlink (pyroute2).

netguard's programs sit on the uplink's ``clsact`` qdisc, one ``bpf`` filter per direction,
in direct-action mode (the program's return value is the verdict: ``TC_ACT_OK`` passes,
``TC_ACT_SHOT`` drops). Laminar's filters use a fixed priority and handle, so attaching again
(a restarted agent with freshly loaded programs) replaces the program in place, atomically:
no packet ever meets an empty hook or two programs.

Every call opens its own netlink socket in the *calling thread's current network namespace*,
so the functions work unchanged in a process started with ``nsenter --net=/run/netns/X``::

    from laminar.bpf.libbpf import BpfObject, object_path
    from laminar.net import tc

    obj = BpfObject.open(object_path("netguard"), pin_root="/sys/fs/bpf/laminar")
    obj.load()
    idx = tc.ifindex_of(tc.default_route_ifname() or "eth0")
    created = tc.ensure_clsact(idx)            # True when we added the qdisc
    tc.attach_bpf(idx, "egress", obj.program("lm_egress").fd, "lm_egress")
    tc.attach_bpf(idx, "ingress", obj.program("lm_ingress").fd, "lm_ingress")
    tc.list_bpf_filters(idx, "egress")
    # [{'name': 'lm_egress', 'prio': 49152, 'handle': 1, 'prog_id': 123, 'direct_action': True, ...}]
    tc.detach_bpf(idx, "egress")               # removes filters whose name starts with "lm_"
    if created:
        tc.delete_clsact(idx)

Errors are the ``pyroute2.netlink.exceptions.NetlinkError`` (an ``OSError`` with the kernel's
errno) of the failing request, or ValueError/LookupError for bad arguments.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg import sched_bpf

# clsact's two hooks: the parent handles of its egress and ingress filter chains.
PARENTS = {"egress": 0xFFFFFFF3, "ingress": 0xFFFFFFF2}
# Laminar's filters: a priority of their own (tc's auto-assigned priorities start at 49152 and
# go down; 0xC0DE keeps clear of both ends) and handle 1, so replace finds the same filter.
DEFAULT_PRIO = 0xC0DE
FILTER_HANDLE = 1
ETH_P_ALL = 0x0003

# pyroute2 0.9 decodes cls_bpf options only up to TCA_BPF_FLAGS; the kernel also sends
# TCA_BPF_FLAGS_GEN, TCA_BPF_TAG and TCA_BPF_ID (uapi/linux/pkt_cls.h, in this order). Extend
# its table once so listings carry the program id (what `bpftool prog show id N` takes).
_EXTRA = (("TCA_BPF_FLAGS_GEN", "uint32"), ("TCA_BPF_TAG", "hex"), ("TCA_BPF_ID", "uint32"))
if len(sched_bpf.options.nla_map) == 9:
    sched_bpf.options.nla_map = tuple(sched_bpf.options.nla_map) + _EXTRA


def _parent(direction: str) -> int:
    try:
        return PARENTS[direction]
    except KeyError:
        raise ValueError(f"tc direction {direction!r} must be 'egress' or 'ingress'") from None


def ifindex_of(ifname: str) -> int:
    """The index of interface `ifname` in the current netns; LookupError when there is none."""
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
    if not idx:
        raise LookupError(f"no network interface {ifname!r} in this network namespace (see `ip link`)")
    return int(idx[0])


def default_route_ifname() -> str | None:
    """The interface of the IPv4 default route with the lowest metric (main table), or None."""
    with IPRoute() as ipr:
        routes = [
            r
            for r in ipr.get_routes(family=socket.AF_INET, table=254)
            if r["dst_len"] == 0 and r.get("RTA_OIF") is not None
        ]
        if not routes:
            return None
        best = min(routes, key=lambda r: r.get("RTA_PRIORITY") or 0)
        links = ipr.get_links(best.get("RTA_OIF"))
        return str(links[0].get("IFLA_IFNAME")) if links else None


def has_clsact(ifindex: int) -> bool:
    """True when the interface has a clsact qdisc."""
    with IPRoute() as ipr:
        return any(q.get("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(ifindex))


def ensure_clsact(ifindex: int) -> bool:
    """Add a clsact qdisc to the interface; True when this call created it, False when one
    was there already (ours from an earlier run, or another tool's: clsact is shared by every
    tc BPF user of the device and there can be only one, so EEXIST means "ready", not failure)."""
    with IPRoute() as ipr:
        try:
            ipr.tc("add", "clsact", ifindex)
            return True
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                return False
            raise


def delete_clsact(ifindex: int) -> bool:
    """Remove the clsact qdisc (and with it every filter on both hooks). False when there was
    none. Only call it for a clsact this process's agent created (see ensure_clsact)."""
    with IPRoute() as ipr:
        try:
            ipr.tc("del", "clsact", ifindex)
            return True
        except NetlinkError as e:
            # No qdisc: ENOENT, or EINVAL from older kernels for a missing clsact.
            if e.code in (errno.ENOENT, errno.EINVAL):
                return False
            raise


def attach_bpf(ifindex: int, direction: str, prog_fd: int, name: str, prio: int = DEFAULT_PRIO) -> None:
    """Attach the sched_cls program `prog_fd` as a direct-action filter on the clsact hook
    `direction` ("egress" or "ingress"), named `name` (shown by `tc filter show`).

    An existing filter at (`prio`, handle 1) is replaced in place: the kernel swaps the program
    under RCU, so traffic sees the old program or the new one, never none. The clsact qdisc
    must exist (ensure_clsact)."""
    parent = _parent(direction)
    if not 1 <= prio <= 0xFFFF:
        raise ValueError(f"tc filter prio {prio} out of range 1..65535")
    with IPRoute() as ipr:
        ipr.tc(
            "replace-filter",
            "bpf",
            ifindex,
            FILTER_HANDLE,
            fd=prog_fd,
            name=name,
            parent=parent,
            prio=prio,
            protocol=ETH_P_ALL,
            direct_action=True,
        )


def _filter_dict(msg: Any) -> dict[str, Any] | None:
    if msg.get("TCA_KIND") != "bpf" or not msg["handle"]:
        return None  # the per-prio chain header a dump also returns has handle 0
    opts = msg.get("TCA_OPTIONS")
    if opts is None:
        return None
    flags = opts.get("TCA_BPF_FLAGS") or 0
    tag = opts.get("TCA_BPF_TAG")
    return {
        "name": opts.get("TCA_BPF_NAME") or "",
        "prio": (msg["info"] >> 16) & 0xFFFF,
        "protocol": socket.ntohs(msg["info"] & 0xFFFF),
        "handle": msg["handle"],
        "prog_id": opts.get("TCA_BPF_ID"),
        "tag": tag.replace(":", "") if isinstance(tag, str) else tag,
        "direct_action": bool(flags & sched_bpf.TCA_BPF_FLAG_ACT_DIRECT),
    }


def list_bpf_filters(ifindex: int, direction: str) -> list[dict[str, Any]]:
    """The bpf filters on the clsact hook `direction`: dicts with name, prio, protocol,
    handle, prog_id, tag, direct_action. Empty when there is no clsact."""
    parent = _parent(direction)
    with IPRoute() as ipr:
        try:
            msgs = list(ipr.get_filters(index=ifindex, parent=parent))
        except NetlinkError as e:
            if e.code in (errno.ENOENT, errno.EINVAL):
                return []
            raise
    return [f for f in (_filter_dict(m) for m in msgs) if f is not None]


def detach_bpf(ifindex: int, direction: str, name_prefix: str = "lm_") -> int:
    """Delete the bpf filters on hook `direction` whose name starts with `name_prefix`
    (Laminar's own; other tools' filters stay). Returns how many were deleted."""
    parent = _parent(direction)
    done = 0
    for f in list_bpf_filters(ifindex, direction):
        if not f["name"].startswith(name_prefix):
            continue
        with IPRoute() as ipr:
            try:
                ipr.tc(
                    "del-filter",
                    "bpf",
                    ifindex,
                    f["handle"],
                    parent=parent,
                    prio=f["prio"],
                    protocol=f["protocol"],
                )
                done += 1
            except NetlinkError as e:
                if e.code != errno.ENOENT:  # gone meanwhile: the goal is reached
                    raise
    return done
