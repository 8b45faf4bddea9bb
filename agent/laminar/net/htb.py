"""The uplink's HTB tree: the mechanism that holds background traffic at its floor and gives each
migration transfer its own rate.

The agent owns the root qdisc of the uplink while shaping is on::

    htb  M:   default M:10                       (M = HTB_MAJOR, 0x4c4d: "LM", easy to spot)
    └── M:1   link rate                           the link as the shaper sees it
        ├── M:10  background  rate=floor ceil=link   every packet nothing else claims (default)
        └── M:20  migration   rate=ceil=link-floor   the migration budget, never more
            ├── M:100 transfer  rate=ceil=r1      one leaf per active transfer, rate from the shaper
            └── M:101 transfer  rate=ceil=r2

netguard puts a migration flow's packets in its leaf by setting ``skb->priority`` to the leaf's
handle, ``(M << 16) | minor`` (HTB maps a priority equal to one of its leaf handles straight to
that leaf, before any filter); :func:`priority_of` computes it for ``lm_flows``. Leaves have
``ceil == rate`` so a transfer never borrows what background could use; background has priority
0 for spare capacity, so it gets back whatever migration leaves idle.

HTB support is found at :meth:`HtbTree.setup` by asking the kernel for the qdisc: a kernel
without ``CONFIG_NET_SCH_HTB`` gets :class:`HtbUnavailable` with a message saying so. The root
qdisc found there first is remembered (``previous_root``); only kernel defaults (``noqueue``,
``pfifo_fast``, ``mq``, ``fq_codel`` with no handle set by a person) are replaced unless
``replace_existing`` is given, and :meth:`HtbTree.teardown` deletes the tree, which puts the
kernel's default back. A tree of ours already in place (the agent restarted) is reattached as it
is, leaves included, so shaped transfers are not interrupted.

Example (root, on a test veth in a namespace)::

    from laminar.net.htb import HtbTree
    tree = HtbTree("lmt0a", link_bps=1_000_000_000, background_floor_bps=400_000_000, netns="lm-t-x")
    tree.setup()                              # HtbUnavailable / HtbError with the reason
    leaf = tree.add_leaf(88_000_000)          # -> minor 0x100; priority_of(tree.major, 0x100)
    tree.set_leaf(leaf, 120_000_000)
    tree.leaf_stats()[leaf].bytes             # bytes the leaf has sent
    tree.remove_leaf(leaf)
    tree.teardown()                           # back to the kernel's default root qdisc

``tc -s class show dev lmt0a`` shows the same tree.
"""

from __future__ import annotations

import errno
import logging
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from . import rtnl
from .rtnl import NetlinkError, Rtnl

log = logging.getLogger("laminar.net.htb")

HTB_MAJOR = 0x4C4D            # "LM": a handle no distro or person picks by accident
ROOT_MINOR = 0x1
BACKGROUND_MINOR = 0x10
MIGRATION_MINOR = 0x20
LEAF_FIRST = 0x100            # leaves M:100 .. M:fff: room for every lm_flows entry (1024)
LEAF_LAST = 0xFFF
TC_H_ROOT = 0xFFFFFFFF
MIN_RATE_BPS = 8_000          # HTB cannot hold a class at 0; a zero floor becomes this trickle
# veth and most NICs hand HTB GSO packets of up to 64 KiB; a bucket smaller than one such packet
# makes HTB's accounting coarse (it overshoots, then stalls), so no bucket is smaller than this.
MIN_BURST_BYTES = 65536 + 1600
# Root qdiscs the kernel installs by itself: replacing one loses nothing a person configured.
KERNEL_DEFAULT_ROOTS = frozenset({"noqueue", "pfifo_fast", "mq", "fq_codel", "pfifo", "noop"})
# HTB's netlink options (uapi/linux/pkt_sched.h)
TCA_HTB_PARMS, TCA_HTB_INIT, TCA_HTB_RATE64, TCA_HTB_CEIL64 = 1, 2, 6, 7
HTB_VERSION = 3
TC_LINKLAYER_ETHERNET = 1
# struct tc_htb_opt: two tc_ratespec (cell_log, linklayer, overhead, cell_align, mpu, rate),
# buffer, cbuffer, quantum, level, prio
_HTB_OPT = struct.Struct("=BBHhHI" "BBHhHI" "IIIII")
_HTB_GLOB = struct.Struct("=IIIII")  # version, rate2quantum, defcls, debug, direct_pkts
_GNET_BASIC = struct.Struct("=QI")  # bytes, packets
_GNET_QUEUE = struct.Struct("=IIIII")  # qlen, backlog, drops, requeues, overlimits
U32_MAX = 0xFFFFFFFF


class HtbError(RuntimeError):
    """A netlink operation on the tree failed; the message names the interface, class and errno."""


class HtbUnavailable(HtbError):
    """The kernel has no HTB qdisc, or the uplink has a root qdisc a person set up."""


def priority_of(major: int, minor: int) -> int:
    """The ``skb->priority`` that puts a packet into HTB class ``major:minor``:
    ``(major << 16) | minor`` (e.g. 0x4c4d:100 -> 0x4c4d0100). Raises ValueError out of range."""
    if not 0 < major <= 0xFFFF or not 0 < minor <= 0xFFFF:
        raise ValueError(f"HTB class {major:x}:{minor:x} out of range (major and minor must be 1..ffff)")
    return (major << 16) | minor


@dataclass(frozen=True)
class LeafStats:
    """What the kernel reports for one leaf (``tc -s class show``)."""

    minor: int
    rate_bps: int
    ceil_bps: int
    bytes: int
    packets: int
    drops: int


def _burst(rate_bytes: int) -> int:
    # tc's own default (one timer tick's worth plus an MTU), but never below one GSO packet.
    return max(rate_bytes // 1000 + 1600, MIN_BURST_BYTES)


def _quantum(rate_bytes: int) -> int:
    # What r2q=10 would give, clamped to the range the kernel accepts without a warning.
    return max(1600, min(200_000, rate_bytes // 10))


@lru_cache(maxsize=1)
def _tick_in_usec() -> float:
    """Packet-scheduler ticks per microsecond, from /proc/net/psched (as tc computes it)."""
    try:
        t2us, us2t, clock_res = (int(x, 16) for x in open("/proc/net/psched").read().split()[:3])
    except (OSError, ValueError):
        return 15.625  # every kernel since 2.6.31: 1000/64 with a 1 GHz clock
    if clock_res == 1_000_000_000:
        t2us = us2t  # tc_core_init's compatibility rule for a nanosecond clock
    return t2us / us2t * (clock_res / 1_000_000)


def _xmittime(rate_bytes: int, size: int) -> int:
    """The time to send `size` bytes at `rate_bytes`/s in scheduler ticks (tc's tc_calc_xmittime),
    what HTB takes as a bucket size (buffer, cbuffer)."""
    return min(U32_MAX, int(int(1_000_000 * size / rate_bytes) * _tick_in_usec()))


def class_options(rate_b: int, ceil_b: int, burst: int, cburst: int, quantum: int, prio: int) -> bytes:
    """TCA_OPTIONS of an HTB class: rate and ceil in bytes/s (the 64-bit attributes above
    4 GB/s), buckets in bytes, quantum in bytes, priority."""
    opt = _HTB_OPT.pack(0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(rate_b, U32_MAX),
                        0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(ceil_b, U32_MAX),
                        _xmittime(rate_b, burst), _xmittime(ceil_b, cburst), quantum, 0, prio)
    out = rtnl.attr(TCA_HTB_PARMS, opt)
    if rate_b > U32_MAX:
        out += rtnl.attr_u64(TCA_HTB_RATE64, rate_b)
    if ceil_b > U32_MAX:
        out += rtnl.attr_u64(TCA_HTB_CEIL64, ceil_b)
    return out


def qdisc_options(default_minor: int, r2q: int = 10) -> bytes:
    """TCA_OPTIONS of an HTB root qdisc: unclassified traffic goes to class ``major:default_minor``."""
    return rtnl.attr(TCA_HTB_INIT, _HTB_GLOB.pack(HTB_VERSION, r2q, default_minor, 0, 0))


def remove_tree(ifindex: int, major: int = HTB_MAJOR) -> bool:
    """Deletes the agent's HTB tree from the interface's root (``laminarctl bpf unload``): only an
    HTB root whose handle is ``major:``, never a root qdisc someone else set up. The kernel puts
    its default root qdisc back. Returns whether there was one to delete."""
    with Rtnl() as nl:
        for q in nl.qdiscs(ifindex):
            if q.parent == TC_H_ROOT and q.tc_kind == "htb" and q.handle == major << 16:
                try:
                    nl.tc(rtnl.RTM_DELQDISC, 0, ifindex, major << 16, TC_H_ROOT, tc_kind="htb",
                          what=f"deleting the HTB root qdisc {major:x}: of ifindex {ifindex}")
                except NetlinkError as e:
                    if e.code in (errno.ENOENT, errno.EINVAL):
                        return False
                    raise
                return True
    return False


class HtbTree:
    """The HTB tree on one interface (optionally in a named network namespace).

    Not thread-safe; the agent calls it from its event loop only. Every method raises
    :class:`HtbError` (with the interface and class) when the kernel refuses an operation.
    """

    def __init__(self, ifname: str, link_bps: int, background_floor_bps: int, *, netns: str | None = None,
                 major: int = HTB_MAJOR, replace_existing: bool = False) -> None:
        if link_bps < 2 * MIN_RATE_BPS:
            raise ValueError(f"link rate {link_bps} bit/s too small; give the uplink's rate in bit/s (e.g. 10e9)")
        if not 0 <= background_floor_bps < link_bps:
            raise ValueError(f"background floor {background_floor_bps} bit/s must be in 0..{link_bps - 1} "
                             f"(below the link rate {link_bps} bit/s)")
        priority_of(major, LEAF_LAST)  # validates major
        self.ifname = ifname
        self.netns = netns
        self.major = major
        self.link_bps = int(link_bps)
        self.background_floor_bps = int(background_floor_bps)
        self.replace_existing = replace_existing
        self.previous_root: dict[str, Any] | None = None
        self.reattached = False
        self._leaves: dict[int, int] = {}  # minor -> rate_bps as last applied
        self._nl: Rtnl | None = None
        self._ifindex = 0

    # --- helpers --------------------------------------------------------------------------

    def handle(self, minor: int) -> int:
        return (self.major << 16) | minor

    @property
    def migration_budget_bps(self) -> int:
        return self.link_bps - self.background_floor_bps

    @property
    def nl(self) -> Rtnl:
        """The tree's netlink socket (in its netns), opened on first use; HtbError when the
        interface is not there."""
        if self._nl is None:
            where = f" in netns {self.netns}" if self.netns else ""
            try:
                nl = Rtnl(netns=self.netns)
            except OSError as e:
                raise HtbError(f"htb: no interface {self.ifname!r}{where}: {e}") from e
            try:
                idx = nl.link_index(self.ifname)
            except OSError:
                nl.close()
                raise
            if idx is None:
                nl.close()
                raise HtbError(f"htb: no interface {self.ifname!r}{where}")
            self._nl, self._ifindex = nl, idx
        return self._nl

    @property
    def ifindex(self) -> int:
        _ = self.nl
        return self._ifindex

    def _tc(self, what: str, kind: int, flags: int, handle: int, parent: int, options: bytes | None = None) -> None:
        try:
            self.nl.tc(kind, flags, self.ifindex, handle, parent, tc_kind="htb", options=options,
                         what=f"htb: {what} on {self.ifname}")
        except NetlinkError as e:
            raise HtbError(f"htb: {what} on {self.ifname}: {e.reason} (errno {e.code})") from e

    def _class(self, cmd: str, minor: int, parent_minor: int | None, rate_bps: int, ceil_bps: int,
               prio: int) -> None:
        """`cmd` is "add-class" (fails when it exists) or "change-class" (fails when it does not)."""
        rate_b = max(MIN_RATE_BPS, rate_bps) // 8
        ceil_b = max(MIN_RATE_BPS, ceil_bps) // 8
        parent = self.handle(parent_minor) if parent_minor is not None else self.major << 16
        flags = rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL if cmd == "add-class" else 0
        self._tc(f"{cmd} class {self.major:x}:{minor:x} at {rate_bps} bit/s", rtnl.RTM_NEWTCLASS, flags,
                 self.handle(minor), parent,
                 class_options(rate_b, ceil_b, _burst(rate_b), _burst(ceil_b), _quantum(rate_b), prio))

    def root_qdisc(self) -> dict[str, Any] | None:
        """The interface's root qdisc as ``{"kind", "handle"}``, or None (noqueue shows none)."""
        for q in self.nl.qdiscs(self.ifindex):
            if q.parent == TC_H_ROOT:
                return {"kind": q.tc_kind, "handle": q.handle}
        return None

    def _classes(self) -> dict[int, rtnl.Message]:
        out = {}
        for c in self.nl.classes(self.ifindex):
            if c.handle >> 16 == self.major:
                out[c.handle & 0xFFFF] = c
        return out

    # --- lifecycle ------------------------------------------------------------------------

    def setup(self) -> None:
        """Creates the tree (or reattaches ours if it is already there). Raises HtbUnavailable when
        the kernel has no HTB or a root qdisc a person configured is in place (and
        replace_existing is off); HtbError for any other refusal. Changes nothing on failure."""
        root = self.root_qdisc()
        if root and root["kind"] == "htb" and root["handle"] == self.major << 16:
            classes = self._classes()
            if {ROOT_MINOR, BACKGROUND_MINOR, MIGRATION_MINOR} <= set(classes):
                self.reattached = True
                self.previous_root = None  # not known any more; teardown restores the kernel default
                self._leaves = {m: self._rate_of(c) for m, c in classes.items() if LEAF_FIRST <= m <= LEAF_LAST}
                self.set_link(self.link_bps, self.background_floor_bps)
                log.info("htb: reattached the tree on %s with %d leaves", self.ifname, len(self._leaves))
                return
        if root and root["kind"] not in KERNEL_DEFAULT_ROOTS and not self.replace_existing:
            raise HtbUnavailable(
                f"htb: {self.ifname} already has a root qdisc {root['kind']} {root['handle'] >> 16:x}: that a "
                f"person or another tool set up; remove it or set shaping.replace_existing = true")
        self.previous_root = root
        try:
            # "replace" swaps a kernel default root in one step (no moment without a qdisc).
            self.nl.tc(rtnl.RTM_NEWQDISC, rtnl.NLM_F_CREATE | rtnl.NLM_F_REPLACE, self.ifindex, self.major << 16,
                         TC_H_ROOT, tc_kind="htb", options=qdisc_options(BACKGROUND_MINOR, r2q=10),
                         what=f"htb: adding the root qdisc {self.major:x}: on {self.ifname}")
        except NetlinkError as e:
            if e.code in (errno.ENOENT, errno.EOPNOTSUPP):
                raise HtbUnavailable(
                    f"htb: the kernel refused an HTB qdisc on {self.ifname} (errno {e.code}: {e.reason}); "
                    f"it needs CONFIG_NET_SCH_HTB (module sch_htb). Shaping of migration transfers is off") from e
            raise HtbError(f"htb: adding the root qdisc on {self.ifname} failed: errno {e.code}: {e.reason}") from e
        try:
            self._class("add-class", ROOT_MINOR, None, self.link_bps, self.link_bps, 0)
            self._class("add-class", BACKGROUND_MINOR, ROOT_MINOR, self.background_floor_bps, self.link_bps, 0)
            budget = self.migration_budget_bps
            self._class("add-class", MIGRATION_MINOR, ROOT_MINOR, budget, budget, 1)
        except HtbError:
            self.teardown()
            raise
        log.info("htb: tree on %s: link %d bit/s, background floor %d bit/s (previous root: %s)",
                 self.ifname, self.link_bps, self.background_floor_bps, root)

    def teardown(self) -> None:
        """Deletes the tree (all leaves with it); the kernel puts its default root qdisc back.
        Safe to call twice; a vanished interface is not an error."""
        if self._nl is None and not self._interface_exists():
            return
        try:
            root = self.root_qdisc()
            if root and root["kind"] == "htb" and root["handle"] == self.major << 16:
                self._tc("delete root qdisc", rtnl.RTM_DELQDISC, 0, self.major << 16, TC_H_ROOT)
        except HtbError as e:
            if "no interface" not in str(e):
                raise
        finally:
            self._leaves.clear()
            self.close()

    def _interface_exists(self) -> bool:
        try:
            _ = self.nl
            return True
        except HtbError:
            return False

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None

    def set_link(self, link_bps: int, background_floor_bps: int) -> None:
        """Re-applies the link rate and background floor (config reload, reattachment)."""
        if not 0 <= background_floor_bps < link_bps:
            raise ValueError(f"background floor {background_floor_bps} bit/s must be below the link {link_bps} bit/s")
        self.link_bps, self.background_floor_bps = int(link_bps), int(background_floor_bps)
        self._class("change-class", ROOT_MINOR, None, self.link_bps, self.link_bps, 0)
        self._class("change-class", BACKGROUND_MINOR, ROOT_MINOR, self.background_floor_bps, self.link_bps, 0)
        budget = self.migration_budget_bps
        self._class("change-class", MIGRATION_MINOR, ROOT_MINOR, budget, budget, 1)

    # --- leaves ---------------------------------------------------------------------------

    def leaves(self) -> dict[int, int]:
        """Active leaves: minor -> rate (bit/s) as last applied."""
        return dict(self._leaves)

    def add_leaf(self, rate_bps: int, minor: int | None = None) -> int:
        """Creates a leaf under the migration class at ``rate_bps`` (ceil the same) and returns
        its minor (the first free one from 0x100 unless given). Raises ValueError for a rate
        beyond the migration budget, HtbError when the kernel refuses or no minor is free."""
        self._check_rate(rate_bps)
        if minor is None:
            minor = next((m for m in range(LEAF_FIRST, LEAF_LAST + 1) if m not in self._leaves), None)
            if minor is None:
                raise HtbError(f"htb: no free leaf on {self.ifname} ({LEAF_LAST - LEAF_FIRST + 1} in use)")
        elif not LEAF_FIRST <= minor <= LEAF_LAST or minor in self._leaves:
            raise ValueError(f"leaf minor {minor:x} in use or outside {LEAF_FIRST:x}..{LEAF_LAST:x}")
        self._class("add-class", minor, MIGRATION_MINOR, rate_bps, rate_bps, 1)
        self._leaves[minor] = int(rate_bps)
        return minor

    def set_leaf(self, minor: int, rate_bps: int) -> None:
        """Changes a leaf's rate (and ceil). Raises KeyError for an unknown leaf."""
        if minor not in self._leaves:
            raise KeyError(f"htb: no leaf {self.major:x}:{minor:x} on {self.ifname}")
        self._check_rate(rate_bps)
        self._class("change-class", minor, MIGRATION_MINOR, rate_bps, rate_bps, 1)
        self._leaves[minor] = int(rate_bps)

    def remove_leaf(self, minor: int) -> None:
        """Deletes a leaf; a leaf the kernel no longer has is not an error."""
        self._leaves.pop(minor, None)
        try:
            self.nl.tc(rtnl.RTM_DELTCLASS, 0, self.ifindex, self.handle(minor), self.handle(MIGRATION_MINOR),
                         tc_kind="htb", what=f"htb: deleting class {self.major:x}:{minor:x} on {self.ifname}")
        except NetlinkError as e:
            if e.code != errno.ENOENT:
                raise HtbError(f"htb: deleting {self.major:x}:{minor:x} on {self.ifname}: errno {e.code}") from e

    def _check_rate(self, rate_bps: int) -> None:
        if rate_bps <= 0 or rate_bps > self.migration_budget_bps + MIN_RATE_BPS:
            raise ValueError(f"leaf rate {rate_bps} bit/s out of range 1..{self.migration_budget_bps} "
                             f"(the migration budget: link {self.link_bps} less background floor "
                             f"{self.background_floor_bps})")

    @staticmethod
    def _rate_of(c: rtnl.Message, which: str = "rate") -> int:
        """A class's rate or ceil in bit/s from a netlink dump (the 64-bit attribute above 4 GB/s)."""
        opts = c.nested(rtnl.TCA_OPTIONS)
        big = rtnl.u64(opts.get(TCA_HTB_RATE64 if which == "rate" else TCA_HTB_CEIL64))
        if big:
            return big * 8
        parms = opts.get(TCA_HTB_PARMS)
        if parms is None:
            return 0
        if len(parms) < _HTB_OPT.size:
            raise rtnl.MalformedReply(f"TCA_HTB_PARMS of class {c.handle >> 16:x}:{c.handle & 0xFFFF:x}: "
                                      f"{len(parms)} bytes, it needs {_HTB_OPT.size}")
        fields = _HTB_OPT.unpack_from(parms)
        return int(fields[5] if which == "rate" else fields[11]) * 8

    def leaf_stats(self) -> dict[int, LeafStats]:
        """Counters of every class of ours from the kernel, keyed by minor (background and the
        migration parent included: BACKGROUND_MINOR, MIGRATION_MINOR)."""
        out = {}
        for minor, c in self._classes().items():
            stats = c.nested(rtnl.TCA_STATS2)
            basic, queue = stats.get(rtnl.TCA_STATS_BASIC, b""), stats.get(rtnl.TCA_STATS_QUEUE, b"")
            nbytes, packets = _GNET_BASIC.unpack_from(basic) if len(basic) >= _GNET_BASIC.size else (0, 0)
            packets = rtnl.u64(stats.get(rtnl.TCA_STATS_PKT64)) or packets  # the 64-bit count past 2**32
            drops = _GNET_QUEUE.unpack_from(queue)[2] if len(queue) >= _GNET_QUEUE.size else 0
            out[minor] = LeafStats(minor, self._rate_of(c), self._rate_of(c, "ceil"), int(nbytes), int(packets),
                                   int(drops))
        return out
