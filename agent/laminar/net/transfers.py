"""The transfer registry: migration transfers, their deadlines, and the HTB leaves that carry them.

A migration transfer (a checkpoint going to another node) is registered by its 5-tuple, its
job, its size and its deadline. The registry then

1. creates an HTB leaf for it under the migration class (``laminar.net.htb``) and writes an
   ``lm_flows`` entry whose ``priority`` is the leaf's handle, so netguard steers the flow's
   packets into the leaf (and counts them);
2. every tick (``shaping.tick_ms``) asks the shaper (``laminar.policy.shaper``, pure policy) for
   each transfer's rate from the bytes left and the time left, and applies the rates to the
   leaves (only when they moved by more than 2%);
3. reports a transfer the shaper finds infeasible at once: in the answer to the request that
   made it so, as a ``transfer`` event, and in metrics, so the migration layer can re-plan;
4. on removal deletes the flow entry and the leaf; a cut on the flow stays: one made through the
   transfer (``kill-flow <transfer id> on|arm``) for ``flow_cut_linger_s`` more (recorded in the
   store, so a restart keeps the expiry), one made by 5-tuple until ``kill-flow … off``. A full
   ``lm_flows`` refuses new transfers and cuts with 507 naming ``LM_MAX_FLOWS``.

Progress is what the sender reports when it reports bytes its peer's TCP acknowledged
(``"acked": true``: a migration's sender does, from TCP_INFO, every 0.2 s; ``progress`` reads
``acked``). Otherwise it is the larger of what the sender reports (``POST …/progress``) and the
bytes the transfer's HTB leaf has sent (egress, from the kernel's class counters) discounted by 6%
for headers and retransmissions (``progress`` reads ``reported`` or ``estimated``); only a report
can mark a transfer done. Counted progress is an estimate: headers and retransmissions can cost
more than 6% (a small MTU, a lossy path), so the bytes the estimate counts beyond 80% of the
leaf's bytes are *unconfirmed*, and the transfer's rate never falls below what sends its remaining
and unconfirmed bytes by its deadline (from the budget the feasible transfers leave). Acknowledged
progress is never an estimate: it has no unconfirmed bytes. It is not kept across an agent
restart (the sender, in the agent, does not outlive it either).

API::

    GET    /v1/net/transfers                      rates, statuses and reasons
    POST   /v1/net/transfers    {"id"?, "job", "flow": "tcp:10.0.0.1:40000->10.0.0.2:7000",
                                 "total_bytes", "deadline_s" (seconds from now), "max_rate_bps"?}
    POST   /v1/net/transfers/{id}/progress {"sent_bytes", "acked"?}
    DELETE /v1/net/transfers/{id}
    POST   /v1/killswitch/flow  {"flow": transfer id or 5-tuple, "action": on|off|arm, "at_s"?}
    GET    /v1/killswitch/flow

CLI: ``laminarctl net transfers`` (and ``add``, ``rm``, ``progress``), ``laminarctl net kill-flow``.

Metrics: ``laminar_transfer_rate_bps``, ``laminar_transfer_need_bps``,
``laminar_transfer_remaining_bytes`` (label ``transfer``), ``laminar_transfer_status`` (1 for
the current ``status`` and ``reason`` of each transfer), ``laminar_shaper_migration_bps``,
``laminar_shaper_infeasible``.

Config (``[shaping]``)::

    [shaping]
    enabled = true
    link_mbit = 0                  # the uplink's rate; 0 = /sys/class/net/<uplink>/speed
    background_floor_ratio = 0.4   # share of the link background traffic always keeps
    margin = 0.1                   # rate = need * (1 + margin)
    tick_ms = 100                  # how often rates are recomputed
    replace_existing = false       # replace a root qdisc a person set up on the uplink
    flow_cut_linger_s = 900        # a transfer's flow cut stays this long after the transfer ends

Bad input is refused with the value and what is allowed, and changes nothing: an unknown job,
a deadline not in the future, a rate beyond the link, a flow already registered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from laminar.policy.shaper import (
    INFEASIBLE,
    LATE,
    LinkBudget,
    ShaperParams,
    ShapingDecision,
    TransferDemand,
    changed_enough,
    decide,
    fmt_rate,
    validate_request,
)

from ..api import ApiError, Request, Route
from ..bpf import abi
from ..config import Field, register_section
from ..inputs import brief
from . import killswitch as ks
from .htb import HtbError, HtbTree, priority_of, remove_tree

if TYPE_CHECKING:
    from ..components import TransfersAgent

log = logging.getLogger("laminar.net.transfers")

CONFIG_FIELDS = {
    "enabled": Field(bool, True, "shape migration transfers with HTB on the uplink"),
    "link_mbit": Field((int, float), 0, "the uplink's rate in Mbit/s; 0 = read /sys/class/net/<uplink>/speed",
                       lambda v: None if 0 <= v <= 10_000_000 else "out of range 0..10000000"),
    "background_floor_ratio": Field(float, 0.4, "share of the link background traffic always keeps",
                                    lambda v: None if 0.0 <= v <= 0.95 else "out of range 0..0.95"),
    "margin": Field(float, 0.1, "transfer rate = need * (1 + margin)",
                    lambda v: None if 0.0 <= v <= 2.0 else "out of range 0..2"),
    "tick_ms": Field(int, 100, "how often transfer rates are recomputed",
                     lambda v: None if 10 <= v <= 10_000 else "out of range 10..10000"),
    "replace_existing": Field(bool, False, "replace a root qdisc a person set up on the uplink"),
    "flow_cut_linger_s": Field((int, float), 900, "seconds a flow cut made through a transfer id stays after the "
                               "transfer ends (or its armed deadline); a cut by 5-tuple stays until kill-flow off",
                               lambda v: None if 0 <= v <= 7 * 86400 else "out of range 0..604800"),
}
register_section("shaping", CONFIG_FIELDS)

# The leaf's byte counter includes Ethernet/IP/TCP headers and retransmissions, so it runs ahead
# of the payload (by ~4% with a 1448-byte MSS, less with GSO). Counted progress is discounted so
# a transfer is never believed done while its last bytes still wait in its leaf: only the sender's
# report can say a transfer is done.
COUNTER_PAYLOAD_SHARE = 0.94
# The share counted progress may really be: headers cost more than 6% with a small MTU (66 of 590
# bytes at MTU 576, 86 of 1280 for IPv6 at its minimum MTU) and retransmissions add to the count.
# The bytes between this bound and the estimate above are "unconfirmed": the shaper keeps a rate
# that sends them too by the deadline (shaper.TransferDemand.unconfirmed_bytes), so an estimate
# that ran ahead of the payload never leaves a transfer's last bytes at the floor rate.
COUNTER_PAYLOAD_SHARE_LOW = 0.80

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS net_transfers (
        id TEXT PRIMARY KEY,
        job TEXT NOT NULL,
        job_num INTEGER NOT NULL,
        flow TEXT NOT NULL UNIQUE,
        total_bytes INTEGER NOT NULL,
        reported_bytes INTEGER NOT NULL,
        deadline_mono_ns INTEGER NOT NULL,
        deadline_wall REAL NOT NULL,
        max_rate_bps INTEGER,
        minor INTEGER NOT NULL,
        created REAL NOT NULL)""",
    # The flow cuts the registry keeps track of (the switch bits themselves live in lm_flows):
    # origin 'transfer' (set through a transfer id: expires flow_cut_linger_s after its transfer
    # ends, expires_wall then set) or 'operator' (set by 5-tuple: stays until kill-flow ... off).
    """CREATE TABLE IF NOT EXISTS net_flow_cuts (
        flow TEXT PRIMARY KEY,
        origin TEXT NOT NULL,
        transfer TEXT,
        uid INTEGER,
        created REAL NOT NULL,
        expires_wall REAL)""",
]

TRANSFER_CUT = "transfer"  # a cut set through a transfer id: lingers, then expires
# The longest flow name read (a transfer id, or a 5-tuple: IPv6 ones are under 100 characters):
# a longer one was parsed, quoted whole in the error and kept in the parse cache.
FLOW_TEXT_MAX = 128
OPERATOR_CUT = "operator"  # a cut set by 5-tuple: stays until kill-flow ... off
DEFAULT_CUT_LINGER_S = 900.0  # a TCP connection whose every packet is dropped gives up in ~15 min (tcp_retries2)
SWEEP_S = 1.0  # how often expired cuts are looked for


def link_speed_bps(ifname: str) -> int | None:
    """The interface's speed from sysfs in bit/s, or None when the driver does not say (veth, -1)."""
    try:
        mbit = int(Path(f"/sys/class/net/{ifname}/speed").read_text().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1_000_000 if mbit > 0 else None


@dataclass
class Transfer:
    id: str
    job: str
    job_num: int
    flow: ks.FlowKey
    total_bytes: int
    deadline_mono_ns: int
    deadline_wall: float
    minor: int
    reported_bytes: int = 0
    counted_bytes: int = 0
    # the sender reports what its peer's TCP acknowledged: reported_bytes alone is the progress
    # (the leaf's count, which runs ahead of it by what is in flight, is not used)
    acked: bool = False
    max_rate_bps: int | None = None
    created: float = field(default_factory=time.time)
    rate_bps: int = 0
    need_bps: float = 0.0
    status: str = ""
    reason: str = ""

    @property
    def sent_bytes(self) -> int:
        if self.acked:
            return min(self.total_bytes, self.reported_bytes)
        counted = min(int(self.counted_bytes * COUNTER_PAYLOAD_SHARE), self.total_bytes - 1)
        return min(self.total_bytes, max(self.reported_bytes, counted))

    @property
    def progress(self) -> str:
        """Where ``sent_bytes`` comes from: ``acked`` (the sender reports the bytes its peer
        acknowledged), ``reported`` (a report, at least the leaf's estimate) or ``estimated``
        (the leaf's count, discounted for headers)."""
        if self.acked:
            return "acked"
        return "reported" if 0 < self.reported_bytes >= self.sent_bytes else "estimated"

    @property
    def unconfirmed_bytes(self) -> int:
        """Bytes ``sent_bytes`` may count that did not go out as payload: its counted part past
        ``COUNTER_PAYLOAD_SHARE_LOW`` of the leaf's bytes (0 once the sender reported them all,
        and always 0 when it reports acknowledged bytes)."""
        if self.acked:
            return 0
        surely = max(self.reported_bytes, min(int(self.counted_bytes * COUNTER_PAYLOAD_SHARE_LOW), self.total_bytes))
        return max(0, self.sent_bytes - surely)

    def demand(self) -> TransferDemand:
        return TransferDemand(self.id, self.total_bytes - self.sent_bytes, self.deadline_mono_ns / 1e9, self.max_rate_bps,
                              self.unconfirmed_bytes)

    def as_dict(self, now_ns: int, major: int) -> dict[str, Any]:
        return {"id": self.id, "job": self.job, "flow": str(self.flow), "class": f"{major:x}:{self.minor:x}",
                "total_bytes": self.total_bytes, "sent_bytes": self.sent_bytes, "progress": self.progress,
                "estimated": self.progress == "estimated",
                "remaining_bytes": self.total_bytes - self.sent_bytes,
                "deadline_in_s": round((self.deadline_mono_ns - now_ns) / 1e9, 3), "deadline": self.deadline_wall,
                "rate_bps": self.rate_bps, "rate": fmt_rate(self.rate_bps),
                "need_bps": None if self.need_bps == float("inf") else round(self.need_bps),
                "status": self.status, "reason": self.reason, "max_rate_bps": self.max_rate_bps}


@dataclass
class FlowCut:
    """A flow cut (or armed) in ``lm_flows`` as the registry knows it: who set it and, for a cut set
    through a transfer that has ended, when its entry goes (wall clock, so a restart keeps it)."""

    origin: str  # TRANSFER_CUT or OPERATOR_CUT
    transfer: str | None = None
    uid: int | None = None
    created: float = field(default_factory=time.time)
    expires_wall: float | None = None  # None: while its transfer lives, or an operator's cut

    def describe(self, now_wall: float) -> dict[str, Any]:
        return {"origin": self.origin, "cut_by_transfer": self.transfer,
                "expires_in_s": None if self.expires_wall is None else round(self.expires_wall - now_wall, 3)}


def flows_full_message(flows_map: Any, transfers: int, cuts: dict[ks.FlowKey, FlowCut]) -> str:
    """The error for an lm_flows map with no room: its limit, who holds the entries, and the way out."""
    limit = getattr(flows_map, "max_entries", abi.LM_MAX_FLOWS)
    operator = sum(1 for c in cuts.values() if c.origin == OPERATOR_CUT)
    lingering = sum(1 for c in cuts.values() if c.expires_wall is not None)
    return (f"lm_flows is full: all {limit} entries are in use (LM_MAX_FLOWS in bpf/laminar.h): {transfers} "
            f"registered transfers, {operator} cuts by 5-tuple that stay until restored, {lingering} cuts of ended "
            "transfers waiting to expire (shaping.flow_cut_linger_s). `laminarctl net flows` lists them; "
            "`laminarctl net kill-flow <flow> off` frees an entry")


def _is_full(e: BaseException) -> bool:
    import errno

    return isinstance(e, OSError) and e.errno == errno.E2BIG


class TransferRegistry:
    """Component ``laminar.net.transfers:TransferRegistry`` (agent attribute ``transfers``)."""

    agent_attr = "transfers"
    status_key = "transfers"

    def __init__(self, *, tree: HtbTree | None = None, flows_map: Any = None) -> None:
        # tree/flows_map may be given for tests and benchmarks that drive the registry directly.
        self.tree = tree
        self.flows = flows_map
        self.agent: TransfersAgent | None = None  # what the registry reads of it: laminar.components
        self.transfers: dict[str, Transfer] = {}
        self.link: LinkBudget | None = None
        self.params = ShaperParams()
        self.tick_s = 0.1
        self.disabled_reason = ""
        self.last: ShapingDecision | None = None
        self._task: asyncio.Task[None] | None = None
        self._metrics: dict[str, Gauge] = {}
        self._status_labels: dict[str, tuple[str, str]] = {}
        # Every netlink (and map) operation of the registry runs on this one thread, in order, so
        # a tick's class changes never interleave with another's and the loop stays free meanwhile.
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Every read-modify-write (and delete) of an lm_flows entry holds this lock from the lookup
        # to the update: the registry's thread writes a flow's class (_write_flow) while the loop
        # flips its switch (flow_switch), and without it one writer's update carried the value it
        # had read before the other's, so a kill bit set in between was silently cleared. Held
        # for one or two map syscalls only (never across netlink), so a switch never waits on a tick.
        self.flows_lock = threading.Lock()
        # Flow cuts by who set them (see FlowCut); changed under flows_lock, mirrored in net_flow_cuts.
        self.cuts: dict[ks.FlowKey, FlowCut] = {}
        self.cut_linger_s = DEFAULT_CUT_LINGER_S
        self._sweeper: asyncio.Task[None] | None = None
        self._cuts_db_lock = threading.Lock()
        self._dirty_cuts: set[ks.FlowKey] = set()

    def _emit(self, kind: str, message: str, **fields: Any) -> None:
        """Emits an event on the agent's loop (the event bus is not thread-safe; ticks run on a thread)."""
        agent = self.agent
        if agent is None:
            return
        loop = agent.loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(lambda: agent.events.emit(kind, message, **fields))
        else:
            agent.events.emit(kind, message, **fields)

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lm-transfers")
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kw))

    # --- lifecycle --------------------------------------------------------------------------

    def configure(self, link_bps: int, background_floor_bps: int, margin: float = 0.1, tick_s: float = 0.1) -> None:
        self.link = LinkBudget(link_bps, background_floor_bps)
        self.params = ShaperParams(margin=margin)
        self.tick_s = tick_s

    @property
    def _agent(self) -> TransfersAgent:
        """The agent the registry was started with (every caller runs after ``start``)."""
        if self.agent is None:
            raise RuntimeError("transfers: not started")
        return self.agent

    async def start(self, agent: TransfersAgent) -> None:
        self.agent = agent
        try:
            cfg = agent.config.section("shaping")
        except KeyError:  # the config was loaded before this module registered its section
            cfg = {k: f.default for k, f in CONFIG_FIELDS.items()}
        agent.store.ensure_schema("transfers", SCHEMA)
        self._init_metrics(agent.metrics)
        ng = agent.netguard
        if self.flows is None and ng is not None:
            self.flows = ng.maps.get("lm_flows")
        self.cut_linger_s = float(cfg.get("flow_cut_linger_s", DEFAULT_CUT_LINGER_S))
        if self.flows is not None:
            # Cuts outlive the agent (pins): take over their records, expire what expired meanwhile,
            # and keep expiring them even when shaping is off (they were made while it was on).
            await self._run(self._load_cuts)
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        if not cfg["enabled"]:
            self.disabled_reason = "shaping.enabled = false"
        elif self.tree is None:
            ifname = ng.ifname if ng is not None else agent.config.net.uplink
            link = int(cfg["link_mbit"] * 1_000_000) or link_speed_bps(ifname)
            if not link:
                self.disabled_reason = (f"the speed of {ifname} is unknown (sysfs says none); set shaping.link_mbit "
                                        "to the uplink's rate")
            else:
                floor = int(link * cfg["background_floor_ratio"])
                self.configure(link, floor, cfg["margin"], cfg["tick_ms"] / 1000)
                self.tree = HtbTree(ifname, link, floor, replace_existing=cfg["replace_existing"])
                try:
                    await self._run(self.tree.setup)
                except HtbError as e:  # HtbUnavailable included: say why, keep the agent up
                    self.disabled_reason = str(e)
                    self.tree = None
        elif self.link is None:
            self.configure(self.tree.link_bps, self.tree.background_floor_bps, cfg["margin"], cfg["tick_ms"] / 1000)
        if self.disabled_reason:
            ifindex = getattr(ng, "ifindex", None) if ng is not None else None
            await self._run(self._unshape_leftovers, ifindex)
            if self.flows is not None:
                await self._run(self._orphan_cuts)
            log.warning("shaping off: %s", self.disabled_reason)
            agent.events.emit("transfer", f"shaping of migration transfers is off: {self.disabled_reason}")
            return
        await self._run(self._reattach)
        self._task = asyncio.get_running_loop().create_task(self._ticker())

    async def stop(self) -> None:
        # Leaves and flow entries stay: transfers keep their rates while no agent runs (and cuts
        # keep cutting; their expiry is in the store for the next agent).
        for task in (self._task, self._sweeper):
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._task = self._sweeper = None
        if self.tree is not None:
            await self._run(self.tree.close)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _unshape_leftovers(self, ifindex: int | None) -> None:
        """Shaping is off in this run: what an earlier run with shaping on left goes, or it would
        stay for good with nobody to change it: the stored transfers (their flow entries let go:
        deleted, or a switch on them kept without a class), any other entry steering into a class,
        and the HTB tree on the uplink (only ours, ``htb.remove_tree``)."""
        rows = self._agent.store.db.execute("SELECT id, flow FROM net_transfers").fetchall()
        for r in rows:
            try:
                self._release_flow(ks.FlowKey.parse(r["flow"]), r["id"])
            except ks.KillSwitchError:
                pass
        if self.flows is not None:
            with self.flows_lock:
                for key, e in ks.read_flows(self.flows):
                    if not e.priority:
                        continue
                    if e.flags & (abi.LM_FLOW_KILL | abi.LM_FLOW_ARMED):
                        e.priority = 0
                        self.flows.update(key.pack(), e.pack())
                    else:
                        self.flows.delete(key.pack())
        if rows:
            with self._agent.store.tx() as db:
                db.execute("DELETE FROM net_transfers")
        removed = remove_tree(ifindex) if ifindex else False
        if rows or removed:
            self._emit("transfer", f"shaping is off ({self.disabled_reason}): the shaping tree left by an earlier run "
                                   f"{'removed from the uplink' if removed else 'was gone'}, {len(rows)} stored "
                                   "transfers forgotten (their flows unshaped; a cut on a flow stays)",
                       transfers=[r["id"] for r in rows], tree_removed=removed)

    # --- flow cuts: who made them, and when a transfer's cut expires ------------------------

    def _save_cut(self, flow: str, cut: FlowCut | None) -> None:
        """Mirrors one record in net_flow_cuts (None: deleted)."""
        if self.agent is None:
            return
        with self._agent.store.tx() as db:
            if cut is None:
                db.execute("DELETE FROM net_flow_cuts WHERE flow=?", (flow,))
            else:
                db.execute("INSERT OR REPLACE INTO net_flow_cuts VALUES (?,?,?,?,?,?)",
                           (flow, cut.origin, cut.transfer, cut.uid, cut.created, cut.expires_wall))

    def _flush_cuts(self) -> None:
        """Writes the records changed since the last flush as they are now (whoever changed them
        last): every change is followed by a flush, so the store ends with the last state whatever
        the order. Called outside flows_lock (an fsync must not hold up a kill-switch)."""
        with self._cuts_db_lock:
            while self._dirty_cuts:
                key = self._dirty_cuts.pop()
                self._save_cut(str(key), self.cuts.get(key))

    def _set_cut(self, key: ks.FlowKey, cut: FlowCut | None) -> None:
        """Records (or forgets) the cut on ``key`` in memory; the caller flushes it to the store
        (_flush_cuts) once it has let go of flows_lock. Call with flows_lock held."""
        if cut is None:
            if self.cuts.pop(key, None) is None:
                return
        else:
            self.cuts[key] = cut
        self._dirty_cuts.add(key)

    def _load_cuts(self) -> None:
        """Reads the cut records from the store; drops those whose lm_flows entry is gone or holds no
        switch any more (the pins were rebuilt, or the entry was restored outside this agent), then
        expires what expired while no agent ran."""
        assert self.flows is not None
        rows = self._agent.store.db.execute("SELECT * FROM net_flow_cuts").fetchall()
        with self.flows_lock:
            for r in rows:
                try:
                    key = ks.FlowKey.parse(r["flow"])
                except ks.KillSwitchError:
                    self._save_cut(r["flow"], None)
                    continue
                raw = self.flows.lookup(key.pack())
                if raw is None or not ks.FlowEntry.unpack(raw).flags & (abi.LM_FLOW_KILL | abi.LM_FLOW_ARMED):
                    self._save_cut(r["flow"], None)
                    continue
                self.cuts[key] = FlowCut(r["origin"], r["transfer"], r["uid"], r["created"], r["expires_wall"])
        self.expire_cuts()

    def _linger(self, key: ks.FlowKey, entry: ks.FlowEntry, tid: str | None) -> FlowCut | None:
        """The transfer ``tid`` let go of flow ``key`` whose entry still holds a switch: a cut made
        through the transfer (or one nobody recorded: made before records existed) gets its expiry,
        ``flow_cut_linger_s`` from now, or from its armed deadline when that is later; an
        operator's cut by 5-tuple stays. Call with flows_lock held. Returns the record."""
        cut = self.cuts.get(key)
        if cut is not None and cut.origin == OPERATOR_CUT:
            return cut
        now_wall, start = time.time(), time.time()
        if entry.flags & abi.LM_FLOW_ARMED and not entry.flags & abi.LM_FLOW_KILL:
            start = max(start, now_wall + (entry.kill_at_ns - time.monotonic_ns()) / 1e9)
        cut = FlowCut(TRANSFER_CUT, cut.transfer if cut is not None else tid,
                      cut.uid if cut is not None else None, cut.created if cut is not None else now_wall,
                      start + self.cut_linger_s)
        self._set_cut(key, cut)
        return cut

    def expire_cuts(self, now_wall: float | None = None) -> list[ks.FlowKey]:
        """Deletes the lm_flows entries of transfers' cuts whose linger is over (the flow restored,
        the entry freed) and forgets them. A flow a transfer registered again meanwhile keeps its
        entry (its class) and its switch. Returns the flows restored."""
        now = time.time() if now_wall is None else now_wall
        done: list[ks.FlowKey] = []
        if self.flows is None:
            return done
        with self.flows_lock:
            owned = {t.flow for t in list(self.transfers.values())}
            for key, cut in list(self.cuts.items()):
                if cut.expires_wall is None or cut.expires_wall > now:
                    continue
                if key not in owned:
                    self.flows.delete(key.pack())
                    done.append(key)
                self._set_cut(key, None)
        self._flush_cuts()
        for key in done:
            self._emit("killswitch", f"kill-switch: flow {key} restored and its lm_flows entry freed: the cut made "
                                     f"through its transfer expired {self.cut_linger_s:g} s after the transfer ended "
                                     "(shaping.flow_cut_linger_s)", scope="flow", flow=str(key), action="expired")
        return done

    def _sweep_due(self, now_wall: float) -> bool:
        """Whether a sweep has work: a cut whose linger is over, or a transfer's cut whose transfer
        is gone with no linger started (a cut by transfer id that landed while the transfer was
        being removed: after its flow was let go, before it left the registry)."""
        return any((c.expires_wall is not None and c.expires_wall <= now_wall)
                   or (c.origin == TRANSFER_CUT and c.expires_wall is None and c.transfer not in self.transfers)
                   for c in list(self.cuts.values()))

    def sweep_once(self, now_wall: float | None = None) -> list[ks.FlowKey]:
        """Starts the linger of transfers' cuts whose transfer is gone, then expires what is due.
        Runs on the registry's thread (add and remove run there too, so neither is half done)."""
        self._orphan_cuts()
        return self.expire_cuts(now_wall)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            if not self._sweep_due(time.time()):
                continue
            try:
                await self._run(self.sweep_once)
            except Exception:  # one bad round must not stop the expiry
                log.exception("flow cut expiry failed")

    def _orphan_cuts(self) -> None:
        """A cut made through a transfer that is no longer registered (its row went while no agent
        ran) starts its linger now, as if the transfer had just ended."""
        if self.flows is None:
            return
        with self.flows_lock:
            for key, cut in list(self.cuts.items()):
                if cut.origin != TRANSFER_CUT or cut.expires_wall is not None:
                    continue
                if any(t.flow == key for t in self.transfers.values()):
                    continue
                raw = self.flows.lookup(key.pack())
                if raw is None:
                    self._set_cut(key, None)
                else:
                    self._linger(key, ks.FlowEntry.unpack(raw), cut.transfer)
        self._flush_cuts()

    def cut_counts(self) -> dict[str, int]:
        """How lm_flows is used: entries, its limit, and the cuts that hold entries of their own."""
        entries = sum(1 for _ in self.flows.keys()) if self.flows is not None else 0
        return {"flow_entries": entries,
                "flow_entries_max": int(getattr(self.flows, "max_entries", abi.LM_MAX_FLOWS)),
                "operator_cuts": sum(1 for c in self.cuts.values() if c.origin == OPERATOR_CUT),
                "expiring_cuts": sum(1 for c in self.cuts.values() if c.expires_wall is not None)}

    def _reattach(self) -> None:
        """Re-reads transfers from the store and reconciles them with the kernel's leaves.

        The deadline is taken from the stored wall-clock time (a monotonic value means nothing
        after a reboot). A transfer whose deadline passed while no agent ran is dropped, leaf,
        flow entry and row: nobody is left to remove it (the agent's own sender died with it),
        and kept it would be 'late' for good."""
        assert self.tree is not None
        rows = self._agent.store.db.execute("SELECT * FROM net_transfers").fetchall()
        kernel_leaves = self.tree.leaves()
        now_mono, now_wall = time.monotonic_ns(), time.time()
        for r in rows:
            deadline = now_mono + int((r["deadline_wall"] - now_wall) * 1e9)
            flow = ks.FlowKey.parse(r["flow"])
            if deadline <= now_mono:
                self._release_flow(flow, r["id"])
                if r["minor"] in kernel_leaves:
                    self.tree.remove_leaf(r["minor"])
                with self._agent.store.tx() as db:
                    db.execute("DELETE FROM net_transfers WHERE id=?", (r["id"],))
                self._emit("transfer", f"transfer {r['id']} of job {r['job']} dropped at start: its deadline passed "
                                       f"{now_wall - r['deadline_wall']:.1f} s ago while no agent ran",
                           transfer=r["id"], job=r["job"])
                continue
            t = Transfer(r["id"], r["job"], r["job_num"], flow, r["total_bytes"],
                         deadline, r["deadline_wall"], r["minor"], r["reported_bytes"],
                         max_rate_bps=r["max_rate_bps"], created=r["created"])
            if t.minor not in kernel_leaves:  # the tree was rebuilt: give it its leaf back
                self.tree.add_leaf(self.params.min_rate_bps, t.minor)
            self.transfers[t.id] = t
            self._write_flow(t)
        for minor in set(kernel_leaves) - {t.minor for t in self.transfers.values()}:
            self.tree.remove_leaf(minor)  # a leaf with no transfer behind it
        self._orphan_cuts()
        if self.transfers:
            self.tick()

    # --- policy applied ---------------------------------------------------------------------

    def tick(self, now_ns: int | None = None) -> ShapingDecision:
        """One shaping round: progress from counters, rates from the shaper, rates to the leaves."""
        assert self.tree is not None and self.link is not None
        now = time.monotonic_ns() if now_ns is None else now_ns
        stats = self.tree.leaf_stats() if self.transfers else {}
        for t in self.transfers.values():
            s = stats.get(t.minor)
            if s is not None:
                t.counted_bytes = s.bytes
        decision = decide([t.demand() for t in self.transfers.values()], now / 1e9, self.link, self.params)
        for tid, r in decision.rates.items():
            t = self.transfers[tid]
            if changed_enough(self.tree.leaves().get(t.minor), r.rate_bps):
                self.tree.set_leaf(t.minor, min(r.rate_bps, self.tree.migration_budget_bps))
            became_bad = r.status in (INFEASIBLE, LATE) and t.status != r.status
            t.rate_bps, t.need_bps, t.status, t.reason = self.tree.leaves()[t.minor], r.need_bps, r.status, r.reason
            if became_bad:
                self._emit("transfer", f"transfer {tid} {r.status}: {r.reason}", transfer=tid,
                                       job=t.job, status=r.status, reason=r.reason)
        self.last = decision
        self._update_metrics()
        return decision

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if not self.transfers:
                continue
            try:
                await self._run(self.tick)
            except Exception:  # one bad round must not stop shaping
                log.exception("shaper tick failed")

    # --- operations -------------------------------------------------------------------------

    def _job(self, job_id: str) -> tuple[str, int]:
        jobs = self.agent.jobs if self.agent is not None else None
        if jobs is None:
            raise ApiError(503, "no job manager on this agent, so the transfer's job cannot be checked")
        job = jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"unknown job {job_id!r}; `laminarctl jobs` lists the jobs on this node")
        return job.id, int(job.num)

    def add(self, job: str, job_num: int, flow: ks.FlowKey, total_bytes: int, deadline_in_s: float, *,
            transfer_id: str | None = None, sent_bytes: int = 0, max_rate_bps: int | None = None) -> Transfer:
        """Registers a transfer and gives it its leaf and flow entry at once. Raises ApiError (4xx)
        for bad input, with nothing changed."""
        if self.tree is None or self.link is None:
            raise ApiError(503, f"shaping is off on this node: {self.disabled_reason}")
        tid = transfer_id or f"t-{secrets.token_hex(4)}"
        if not tid or len(tid) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in tid):
            raise ApiError(400, f"transfer id {tid!r}: 1-64 letters, digits, '-', '_' or '.'")
        if tid in self.transfers:
            raise ApiError(409, f"transfer {tid!r} already registered")
        if any(t.flow == flow for t in self.transfers.values()):
            raise ApiError(409, f"flow {flow} already belongs to a registered transfer")
        # NaN and the infinities fail the range test too (a deadline <= 0 is refused below, as past)
        if isinstance(deadline_in_s, bool) or not isinstance(deadline_in_s, int | float) \
                or not -ks.MAX_ARM_S <= deadline_in_s <= ks.MAX_ARM_S:
            raise ApiError(400, f"deadline_s = {deadline_in_s!r}: expected seconds from now, > 0 and at most "
                                f"{ks.MAX_ARM_S} (a week)")
        now = time.monotonic_ns()
        deadline = now + int(deadline_in_s * 1e9)
        why = validate_request(total_bytes, sent_bytes, deadline / 1e9, now / 1e9, self.link, max_rate_bps)
        if why:
            raise ApiError(400, f"transfer refused: {why}")
        t = Transfer(tid, job, job_num, flow, total_bytes, deadline, time.time() + deadline_in_s, 0,
                     reported_bytes=sent_bytes, max_rate_bps=max_rate_bps)
        # The rate it starts at is the one the shaper gives it among the others.
        d = decide([x.demand() for x in self.transfers.values()] + [t.demand()], now / 1e9, self.link, self.params)
        first = min(d.rates[tid].rate_bps, self.tree.migration_budget_bps)
        t.minor = self.tree.add_leaf(first)
        try:
            self._write_flow(t)
            if self.agent is not None:
                with self._agent.store.tx() as db:
                    db.execute("INSERT INTO net_transfers VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                               (t.id, t.job, t.job_num, str(t.flow), t.total_bytes, t.reported_bytes,
                                t.deadline_mono_ns, t.deadline_wall, t.max_rate_bps, t.minor, t.created))
        except Exception:
            self._release_flow(flow, tid)
            self.tree.remove_leaf(t.minor)
            raise
        self.transfers[tid] = t
        self.tick(now)
        self._emit("transfer", f"transfer {tid} of job {job} registered: {flow}, {total_bytes} bytes "
                   f"in {deadline_in_s:g} s -> {t.status} ({t.reason})",
                   transfer=tid, job=job, status=t.status)
        return t

    def _write_flow(self, t: Transfer) -> None:
        if self.flows is None:
            return
        assert self.tree is not None
        kb, priority = t.flow.pack(), priority_of(self.tree.major, t.minor)
        with self.flows_lock:  # keeps a switch set meanwhile (see flows_lock)
            raw = self.flows.lookup(kb)
            entry = ks.FlowEntry.unpack(raw) if raw is not None else ks.FlowEntry()
            entry.job_id = t.job_num
            entry.priority = priority
            try:
                self.flows.update(kb, entry.pack())
            except OSError as e:
                if _is_full(e):
                    raise ApiError(507, f"transfer {t.id} refused: "
                                        + flows_full_message(self.flows, len(self.transfers), self.cuts)) from None
                raise
            cut = self.cuts.get(t.flow)
            if cut is not None and cut.expires_wall is not None:
                # an ended transfer's cut on this 5-tuple now lives as long as the new transfer
                self._set_cut(t.flow, FlowCut(TRANSFER_CUT, t.id, cut.uid, cut.created, None))
        self._flush_cuts()

    def _release_flow(self, flow: ks.FlowKey, tid: str | None = None) -> FlowCut | None:
        """Transfer ``tid`` lets go of its flow entry: deleted, unless a switch is set on it (cut or
        armed), which stays, with no class (priority 0): the sender's socket may outlive the
        transfer. A cut made through the transfer stays ``flow_cut_linger_s`` more (from its armed
        deadline when later), then :meth:`expire_cuts` deletes the entry; an operator's cut by
        5-tuple stays until ``kill-flow … off``. Returns the cut left in place, if any."""
        if self.flows is None:
            return None
        kb = flow.pack()
        left: FlowCut | None = None
        with self.flows_lock:
            raw = self.flows.lookup(kb)
            entry = ks.FlowEntry.unpack(raw) if raw is not None else None
            if entry is not None and entry.flags & (abi.LM_FLOW_KILL | abi.LM_FLOW_ARMED):
                entry.priority = 0  # its leaf goes away
                self.flows.update(kb, entry.pack())
                left = self._linger(flow, entry, tid)
            else:
                if entry is not None:
                    self.flows.delete(kb)
                self._set_cut(flow, None)
        self._flush_cuts()
        return left

    def remove(self, tid: str) -> Transfer:
        """Removes a transfer: its flow entry, its leaf, its row. A switch set on the flow (cut or
        armed) outlives the transfer: the entry stays, without a class, until ``kill-flow … off``."""
        t = self.transfers.get(tid)
        if t is None:
            raise ApiError(404, f"unknown transfer {tid!r}; `laminarctl net transfers` lists them")
        self._release_flow(t.flow, tid)
        if self.tree is not None:
            self.tree.remove_leaf(t.minor)
        if self.agent is not None:
            with self._agent.store.tx() as db:
                db.execute("DELETE FROM net_transfers WHERE id=?", (tid,))
        del self.transfers[tid]
        self._forget_metrics(tid)
        return t

    def report(self, tid: str, sent_bytes: Any, acked: Any = False) -> Transfer:
        """Records the sender's progress. ``acked``: ``sent_bytes`` are bytes the peer's TCP has
        acknowledged (the migration sender's report); from then on they alone are the transfer's
        progress, never the leaf's estimate. Raises ApiError for an unknown transfer or bad input."""
        t = self.transfers.get(tid)
        if t is None:
            raise ApiError(404, f"unknown transfer {tid!r}")
        if isinstance(sent_bytes, bool) or not isinstance(sent_bytes, int) or not 0 <= sent_bytes <= t.total_bytes:
            raise ApiError(400, f"sent_bytes = {brief(sent_bytes)}: expected an integer in 0..{t.total_bytes}")
        if not isinstance(acked, bool):
            raise ApiError(400, f"acked = {acked!r}: expected true or false")
        t.reported_bytes = max(t.reported_bytes, sent_bytes)
        t.acked = t.acked or acked
        if self.agent is not None:
            with self._agent.store.tx() as db:
                db.execute("UPDATE net_transfers SET reported_bytes=? WHERE id=?", (t.reported_bytes, tid))
        return t

    def resolve_flow(self, name: str) -> tuple[ks.FlowKey, int]:
        """A transfer id or a 5-tuple -> (flow key, job num). Raises ApiError (a name longer than
        FLOW_TEXT_MAX: 400, before it is parsed or remembered by the parse cache)."""
        if len(name) > FLOW_TEXT_MAX:
            raise ApiError(400, f"flow {name[:60]!r}... ({len(name)} characters): a transfer id or a 5-tuple is at "
                                f"most {FLOW_TEXT_MAX} characters")
        t = self.transfers.get(name)
        if t is not None:
            return t.flow, t.job_num
        if "->" in name:
            try:
                return ks.FlowKey.parse(name), 0
            except ks.KillSwitchError as e:
                raise ApiError(400, str(e)) from None
        raise ApiError(404, f"unknown transfer {name!r} (give a transfer id from `laminarctl net transfers` or a "
                            "5-tuple like tcp:10.0.0.1:40000->10.0.0.2:7000)")

    def flow_switch(self, name: str, body: Any, uid: int | None = None) -> dict[str, Any]:
        """``kill-flow NAME on|off|arm``: NAME is a transfer id (the cut is the transfer's: it expires
        ``flow_cut_linger_s`` after the transfer ends) or a 5-tuple (an operator's cut: it stays
        until ``off``, counted and listed). Raises ApiError; a full lm_flows is refused (507) with
        its limit and who holds the entries."""
        if self.flows is None:
            raise ApiError(503, "netguard's lm_flows map is not loaded on this agent")
        key, job_num = self.resolve_flow(name)
        by_transfer = name in self.transfers
        try:
            action, deadline = ks.parse_action(body)
        except ks.KillSwitchError as e:
            raise ApiError(e.status, str(e)) from None
        removed = False
        stays_cut = False
        with self.flows_lock:  # the switch and the delete below see no write from the registry's thread
            if action == "arm":
                raw = self.flows.lookup(key.pack())
                was = ks.FlowEntry.unpack(raw) if raw is not None else None
                stays_cut = was is not None and ks.cut_by_deadline(was.flags, was.kill_at_ns)
            try:
                entry = ks.apply_flow_switch(self.flows, key, action, deadline, job_num=job_num)
            except ks.KillSwitchError as e:
                raise ApiError(e.status, str(e)) from None
            except OSError as e:
                if _is_full(e):
                    raise ApiError(507, f"kill-switch: flow {name} ({key}) not cut: "
                                        + flows_full_message(self.flows, len(self.transfers), self.cuts)) from None
                raise
            old = self.cuts.get(key)
            if action == "off":
                self._set_cut(key, None)
            elif old is None or (old.origin == TRANSFER_CUT and not by_transfer):
                # a cut by 5-tuple is the operator's for good, even on a transfer's flow
                self._set_cut(key, FlowCut(TRANSFER_CUT if by_transfer else OPERATOR_CUT,
                                           name if by_transfer else None, uid))
            # list(): a snapshot taken at once (add/remove change the dict on the registry's thread)
            if action == "off" and not entry.priority and not any(t.flow == key for t in list(self.transfers.values())):
                # The entry only held this switch (an ad-hoc cut by 5-tuple, no class): kept, every
                # such cut would hold one of the map's LM_MAX_FLOWS entries for good, and a full map
                # refuses every transfer. A transfer registering this 5-tuple writes its class under
                # the same lock, so an entry with a class is never deleted here.
                self.flows.delete(key.pack())
                removed = True
        # The record goes to the store after the answer (an fsync): the switch is enforced already.
        loop = self.agent.loop if self.agent is not None else None
        if loop is not None and loop.is_running():
            loop.call_soon(self._flush_cuts)
        else:
            self._flush_cuts()
        verb = {"on": "cut", "off": "restored", "arm": f"armed to cut in {body.get('at_s')} s"}[action]
        if stays_cut:
            verb += "; it was cut by its armed deadline already and stays cut (off restores it)"
        cut = self.cuts.get(key)
        return {"message": f"kill-switch: flow {name} ({key}) {verb}", "flow": str(key), "action": action,
                "deadline_ns": deadline, "entry_removed": removed, **entry.describe(),
                **(cut.describe(time.time()) if cut is not None else {"origin": None})}

    # --- status, metrics, API -------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        now = time.monotonic_ns()
        major = self.tree.major if self.tree is not None else 0
        return [t.as_dict(now, major) for t in sorted(self.transfers.values(), key=lambda t: t.deadline_mono_ns)]

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shaping": "off" if self.disabled_reason else "on", "transfers": len(self.transfers),
                               **self.cut_counts()}
        if self.disabled_reason:
            out["why_off"] = self.disabled_reason
        if self.link is not None and self.tree is not None:
            out.update(ifname=self.tree.ifname, link=fmt_rate(self.link.link_bps),
                       background_floor=fmt_rate(self.link.background_floor_bps),
                       migration_budget=fmt_rate(self.link.migration_budget_bps), margin=self.params.margin,
                       tick_ms=round(self.tick_s * 1000), reattached_tree=self.tree.reattached,
                       infeasible=sum(1 for t in self.transfers.values() if t.status in (INFEASIBLE, LATE)))
        return out

    def _init_metrics(self, registry: Any) -> None:
        if registry is None or self._metrics:
            return
        g = {
            "rate": Gauge("laminar_transfer_rate_bps", "HTB leaf rate of a migration transfer", ["transfer"],
                          registry=registry),
            "need": Gauge("laminar_transfer_need_bps", "Rate a transfer needs to meet its deadline (no margin)",
                          ["transfer"], registry=registry),
            "remaining": Gauge("laminar_transfer_remaining_bytes", "Bytes a transfer still has to send",
                               ["transfer"], registry=registry),
            "status": Gauge("laminar_transfer_status", "1 for each transfer's current status and reason",
                            ["transfer", "status", "reason"], registry=registry),
            "migration": Gauge("laminar_shaper_migration_bps", "Sum of the transfer rates handed out",
                               registry=registry),
            "infeasible": Gauge("laminar_shaper_infeasible", "Transfers that cannot meet their deadline now",
                                registry=registry),
        }
        self._metrics = g

    def _update_metrics(self) -> None:
        if not self._metrics:
            return
        m = self._metrics
        for t in self.transfers.values():
            m["rate"].labels(t.id).set(t.rate_bps)
            m["need"].labels(t.id).set(t.need_bps if t.need_bps != float("inf") else -1)
            m["remaining"].labels(t.id).set(t.total_bytes - t.sent_bytes)
            reason = t.reason.split(";")[0]  # the stable part; the best-effort figure changes every tick
            old = self._status_labels.get(t.id)
            if old != (t.status, reason):
                if old is not None:
                    m["status"].remove(t.id, *old)
                m["status"].labels(t.id, t.status, reason).set(1)
                self._status_labels[t.id] = (t.status, reason)
        m["migration"].set(sum(t.rate_bps for t in self.transfers.values()))
        m["infeasible"].set(sum(1 for t in self.transfers.values() if t.status in (INFEASIBLE, LATE)))

    def _forget_metrics(self, tid: str) -> None:
        if not self._metrics:
            return
        for name in ("rate", "need", "remaining"):
            try:
                self._metrics[name].remove(tid)
            except KeyError:
                pass
        old = self._status_labels.pop(tid, None)
        if old is not None:
            self._metrics["status"].remove(tid, *old)

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/net/transfers", self._api_list),
            Route("POST", "/v1/net/transfers", self._api_add, privileged=True),
            Route("POST", "/v1/net/transfers/{id}/progress", self._api_progress, privileged=True),
            Route("DELETE", "/v1/net/transfers/{id}", self._api_remove, privileged=True),
            Route("GET", "/v1/killswitch/flow", self._api_flows),
            Route("POST", "/v1/killswitch/flow", self._api_flow_switch, privileged=True),
        ]

    async def _api_list(self, req: Request) -> dict[str, Any]:
        return {"status": self.status(), "transfers": self.rows()}

    async def _api_add(self, req: Request) -> dict[str, Any]:
        b = req.body
        if not isinstance(b, dict):
            raise ApiError(400, "body must be a JSON object with job, flow, total_bytes, deadline_s")
        for key in ("job", "flow", "total_bytes", "deadline_s"):
            if key not in b:
                raise ApiError(400, f"missing {key!r}: expected job (id), flow (tcp:SADDR:SPORT->DADDR:DPORT), "
                                    "total_bytes (> 0), deadline_s (seconds from now)")
        total = b["total_bytes"]
        # integers past 2**63 (10**400 was a 500: float() of it overflowed in the check below)
        if isinstance(total, bool) or not isinstance(total, int) or not 0 < total < 1 << 63:
            raise ApiError(400, f"total_bytes = {brief(total)}: expected an integer > 0 and below 2**63")
        max_rate = b.get("max_rate_bps")
        if max_rate is not None and (isinstance(max_rate, bool) or not isinstance(max_rate, int)
                                     or not 0 <= max_rate < 1 << 63):
            raise ApiError(400, f"max_rate_bps = {brief(max_rate)}: expected an integer (bit/s) below 2**63")
        sent = b.get("sent_bytes", 0)
        if isinstance(sent, bool) or not isinstance(sent, int) or not 0 <= sent < 1 << 63:
            raise ApiError(400, f"sent_bytes = {brief(sent)}: expected an integer >= 0 and below 2**63")
        if not isinstance(b["flow"], str) or len(b["flow"]) > FLOW_TEXT_MAX:
            raise ApiError(400, f"flow {str(b['flow'])[:60]!r}: expected a 5-tuple like tcp:10.0.0.1:40000->10.0.0.2:7000 "
                                f"(at most {FLOW_TEXT_MAX} characters)")
        if not isinstance(b["job"], str) or len(b["job"]) > 64:
            raise ApiError(400, f"job {str(b['job'])[:60]!r}: expected a job id (job-3)")
        try:
            flow = ks.FlowKey.parse(b["flow"])
        except ks.KillSwitchError as e:
            raise ApiError(400, str(e)) from None
        job, job_num = self._job(b["job"])
        t = await self._run(self.add, job, job_num, flow, total, b["deadline_s"], transfer_id=b.get("id"),
                            sent_bytes=sent, max_rate_bps=max_rate)
        return t.as_dict(time.monotonic_ns(), self.tree.major if self.tree else 0)

    async def _api_progress(self, req: Request) -> dict[str, Any]:
        body = req.body if isinstance(req.body, dict) else {}
        t = await self._run(self.report, req.params["id"], body.get("sent_bytes"), body.get("acked", False))
        return t.as_dict(time.monotonic_ns(), self.tree.major if self.tree else 0)

    async def _api_remove(self, req: Request) -> dict[str, Any]:
        t = await self._run(self.remove, req.params["id"])
        if self.agent is not None:
            self._agent.events.emit("transfer", f"transfer {t.id} removed", transfer=t.id, job=t.job)
        return {"removed": t.id, "class_removed": f"{self.tree.major:x}:{t.minor:x}" if self.tree else None}

    async def _api_flows(self, req: Request) -> list[dict[str, Any]]:
        if self.flows is None:
            return []
        names = {t.flow: t.id for t in self.transfers.values()}
        flows = await self._run(ks.read_flows, self.flows)
        now = time.time()
        out = []
        for k, e in flows:
            cut = self.cuts.get(k)
            out.append({"flow": str(k), "transfer": names.get(k), **e.describe(),
                        **(cut.describe(now) if cut is not None else {"origin": None})})
        return out

    async def _api_flow_switch(self, req: Request) -> dict[str, Any]:
        body = req.body if isinstance(req.body, dict) else {}
        name = body.get("flow")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "missing 'flow': a transfer id or a 5-tuple like tcp:10.0.0.1:40000->10.0.0.2:7000")
        # On the loop, not the netlink thread: a map update is one syscall, and a kill-switch must not
        # wait behind a shaper tick. (_write_flow on the thread only rewrites flows being added.)
        res = self.flow_switch(name, body, uid=req.peer.uid)
        if self.agent is not None:
            # The switch is enforced from the map write on; the event (a SQLite row and a log line,
            # a few hundred us here) follows the answer, in the loop's next round: before the agent
            # reads any request sent after the answer, so `laminarctl events` right after shows it.
            emit = functools.partial(self.agent.events.emit, "killswitch", res["message"], scope="flow",
                                     flow=res["flow"], action=res["action"], uid=req.peer.uid,
                                     deadline_ns=res["deadline_ns"])
            loop = self.agent.loop
            if loop is not None and loop.is_running():
                loop.call_soon(emit)
            else:
                emit()
        return res
