"""tc clsact hooks and direct-action BPF filters through netlink (:mod:`laminar.net.rtnl`).

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

Errors are the :class:`laminar.net.rtnl.NetlinkError` (an ``OSError`` with the kernel's
errno and extended-ack text, its message naming the interface and filter) of the failing
request, or ValueError/LookupError for bad arguments. The calls are synchronous and fast (one
netlink round trip to the local kernel), so the agent's event loop calls them directly.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from . import rtnl
from .rtnl import NetlinkError, Rtnl

# clsact's two hooks: the parent handles of its egress and ingress filter chains.
PARENTS = {"egress": 0xFFFFFFF3, "ingress": 0xFFFFFFF2}
# Laminar's filters: a priority of their own (tc's auto-assigned priorities start at 49152 and
# go down; 0xC0DE keeps clear of both ends) and handle 1, so replace finds the same filter.
DEFAULT_PRIO = 0xC0DE
FILTER_HANDLE = 1
ETH_P_ALL = 0x0003
CLSACT_HANDLE = 0xFFFF0000
# cls_bpf's options (uapi/linux/pkt_cls.h)
TCA_BPF_FD, TCA_BPF_NAME, TCA_BPF_FLAGS, TCA_BPF_TAG, TCA_BPF_ID = 6, 7, 8, 10, 11
TCA_BPF_FLAG_ACT_DIRECT = 1


def _info(prio: int, protocol: int) -> int:
    """tcm_info of a filter: priority in the upper 16 bits, protocol (network order) below."""
    return (prio << 16) | socket.htons(protocol)


def _parent(direction: str) -> int:
    try:
        return PARENTS[direction]
    except KeyError:
        raise ValueError(f"tc direction {direction!r} must be 'egress' or 'ingress'") from None


def ifindex_of(ifname: str) -> int:
    """The index of interface `ifname` in the current netns; LookupError when there is none."""
    with Rtnl() as nl:
        idx = nl.link_index(ifname)
    if idx is None:
        raise LookupError(f"no network interface {ifname!r} in this network namespace (see `ip link`)")
    return idx


def ifindex_of_or_none(ifname: str) -> int | None:
    """The index of interface `ifname` in the current netns, None when there is none."""
    with Rtnl() as nl:
        return nl.link_index(ifname)


class AmbiguousUplink(LookupError):
    """The default route is ECMP over several interfaces (``ifnames``): no one of them carries
    all of the node's traffic, so none is *the* uplink."""

    def __init__(self, ifnames: list[str]) -> None:
        super().__init__(f"the default route is ECMP (multipath) over {len(ifnames)} interfaces: {', '.join(ifnames)}")
        self.ifnames = ifnames


def default_route_ifname() -> str | None:
    """The interface of the IPv4 default route with the lowest metric (main table), else (an
    IPv6-only node) of the IPv6 one, or None. A multipath (ECMP) default route counts with its
    nexthops' interfaces: all on one interface, that one; on several, :class:`AmbiguousUplink`
    naming them (the kernel hashes each flow to one nexthop, so programs on one interface
    would see only the flows hashed to it)."""
    with Rtnl() as nl:
        for family in (socket.AF_INET, socket.AF_INET6):
            routes = [
                (r, oifs)
                for r in nl.routes(family)
                if rtnl.route_table(r) == rtnl.RT_TABLE_MAIN and r.header[1] == 0 and (oifs := nl.route_interfaces(r))
            ]
            if routes:
                break
        else:
            return None
        _, oifs = min(routes, key=lambda ro: rtnl.u32(ro[0].attrs.get(rtnl.RTA_PRIORITY)) or 0)
        names = [nl.link_name(i) or f"ifindex {i}" for i in oifs]
        if len(names) > 1:
            raise AmbiguousUplink(names)
        return names[0]


def has_clsact(ifindex: int) -> bool:
    """True when the interface has a clsact qdisc."""
    with Rtnl() as nl:
        return any(q.tc_kind == "clsact" for q in nl.qdiscs(ifindex))


def ensure_clsact(ifindex: int) -> bool:
    """Add a clsact qdisc to the interface; True when this call created it, False when one
    was there already (ours from an earlier run, or another tool's: clsact is shared by every
    tc BPF user of the device and there can be only one, so EEXIST means "ready", not failure)."""
    with Rtnl() as nl:
        try:
            nl.tc(rtnl.RTM_NEWQDISC, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, ifindex, CLSACT_HANDLE, rtnl.TC_H_CLSACT,
                  tc_kind="clsact", what=f"adding the clsact qdisc on ifindex {ifindex}")
            return True
        except NetlinkError as e:
            if e.code == errno.EEXIST:
                return False
            raise


def delete_clsact(ifindex: int) -> bool:
    """Remove the clsact qdisc (and with it every filter on both hooks). False when there was
    none. Only call it for a clsact this process's agent created (see ensure_clsact)."""
    with Rtnl() as nl:
        try:
            nl.tc(rtnl.RTM_DELQDISC, 0, ifindex, CLSACT_HANDLE, rtnl.TC_H_CLSACT, tc_kind="clsact",
                  what=f"deleting the clsact qdisc on ifindex {ifindex}")
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
    options = (rtnl.attr_u32(TCA_BPF_FD, prog_fd) + rtnl.attr_str(TCA_BPF_NAME, name)
               + rtnl.attr_u32(TCA_BPF_FLAGS, TCA_BPF_FLAG_ACT_DIRECT))
    with Rtnl() as nl:
        nl.tc(rtnl.RTM_NEWTFILTER, rtnl.NLM_F_CREATE | rtnl.NLM_F_REPLACE, ifindex, FILTER_HANDLE, parent,
              _info(prio, ETH_P_ALL), tc_kind="bpf", options=options,
              what=f"attaching bpf filter {name!r} (prio {prio}) on {direction} of ifindex {ifindex}")


def _filter_dict(msg: rtnl.Message) -> dict[str, Any] | None:
    if msg.tc_kind != "bpf" or not msg.handle:
        return None  # the per-prio chain header a dump also returns has handle 0
    if rtnl.TCA_OPTIONS not in msg.attrs:
        return None
    opts = msg.nested(rtnl.TCA_OPTIONS)
    flags = rtnl.u32(opts.get(TCA_BPF_FLAGS)) or 0
    tag = opts.get(TCA_BPF_TAG)
    return {
        "name": rtnl.string(opts.get(TCA_BPF_NAME)) or "",
        "prio": (msg.info >> 16) & 0xFFFF,
        "protocol": socket.ntohs(msg.info & 0xFFFF),
        "handle": msg.handle,
        "prog_id": rtnl.u32(opts.get(TCA_BPF_ID)),
        "tag": tag.hex() if tag is not None else None,
        "direct_action": bool(flags & TCA_BPF_FLAG_ACT_DIRECT),
    }


def list_bpf_filters(ifindex: int, direction: str) -> list[dict[str, Any]]:
    """The bpf filters on the clsact hook `direction`: dicts with name, prio, protocol,
    handle, prog_id, tag, direct_action. Empty when there is no clsact."""
    parent = _parent(direction)
    with Rtnl() as nl:
        try:
            msgs = nl.filters(ifindex, parent)
        except NetlinkError as e:
            if e.code in (errno.ENOENT, errno.EINVAL):
                return []
            raise
    return [f for f in (_filter_dict(m) for m in msgs) if f is not None]


def detach_bpf(ifindex: int, direction: str, name_prefix: str = "lm_") -> int:
    """Delete the bpf filters on hook `direction` whose name starts with `name_prefix`
    (Laminar's own; other tools' filters stay). Returns how many were deleted."""
    done = 0
    for f in list_bpf_filters(ifindex, direction):
        if not f["name"].startswith(name_prefix):
            continue
        with Rtnl() as nl:
            try:
                delete_bpf_filter(nl, ifindex, direction, f["name"], f["prio"], f["handle"], f["protocol"])
                done += 1
            except NetlinkError as e:
                if e.code != errno.ENOENT:  # gone meanwhile: the goal is reached
                    raise
    return done


def delete_bpf_filter(nl: Rtnl, ifindex: int, direction: str, name: str, prio: int, handle: int = FILTER_HANDLE,
                      protocol: int = ETH_P_ALL) -> None:
    """Deletes one bpf filter (`name` only names it in the error: the kernel finds it by prio,
    protocol and handle). Raises NetlinkError (ENOENT when there is no such filter)."""
    nl.tc(rtnl.RTM_DELTFILTER, 0, ifindex, handle, _parent(direction), _info(prio, protocol), tc_kind="bpf",
          what=f"deleting bpf filter {name!r} (prio {prio}, handle {handle}) on {direction} of ifindex {ifindex}")
