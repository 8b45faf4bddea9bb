"""SimNet: a simulated zone transport (a FAKE network) for clusters this machine cannot hold.

A 100,000-node zone cannot exist on a 2-core VM, so the placement benchmark runs the real
policy and the real node and submitter code (:class:`laminar.zone.arbiter.Arbiter`,
:class:`laminar.zone.submitter.Submitter`, :mod:`laminar.policy.placement`) over this in-process
transport instead of sockets. Each message is still encoded, signed, checked and decoded by
:mod:`laminar.zone.wire` (``use_wire=True``), so its CPU cost is the agent's; delivery is instant
and lossless, and every message is counted.

Gang placements (:meth:`SimNet.place_gang`) run the real
:class:`laminar.zone.gangplace.GangPlacer` the same way; with ``async_delivery`` each message is
delivered on a later turn of the event loop, so that many concurrent gangs interleave message by
message, and ``silent``, ``drop_commits`` and ``lose_before_commit`` make nodes fail.

Only the network is fake. What it cannot show (latency, loss, a dead peer) the netns cluster
tests and ``bench/placement.py``'s netns part measure on real sockets.

Example::

    >>> import asyncio, random
    >>> from laminar.policy import placement as pl
    >>> net = SimNet.build(nodes=50, zone_size=25, gpus_per_node=8, rng=random.Random(1))
    >>> res = asyncio.run(net.place(pl.Demand(gpus=1, cpus=4, memory_mb=8000)))
    >>> res.outcome, net.messages <= 2 * 2 + 2
    ('placed', True)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.arbiter import HANDOVER_NO_RESERVATION, HANDOVER_OK, Arbiter, zone_summary_to_msg
from laminar.zone.gangplace import GangPlacer, GangResult
from laminar.zone.keys import ZoneKeys
from laminar.zone.membership import Member, Membership
from laminar.zone.submitter import HandoverError, PlacementResult, Submitter

SIM_KEY = ZoneKeys({-1: b"simulated-zone-key-32-bytes-long"}, "simnet (fake)")


@dataclass
class SimNet:
    """A fake cluster: one :class:`Arbiter` per node, one submitter node, instant delivery."""

    arbiters: dict[int, Arbiter]
    membership: Membership
    rng: random.Random
    submitter_node: int
    use_wire: bool = True
    release_unused: bool = False  # the earlier protocol: unused offers released by a datagram
    hints: int = pl.HINTS_PER_SHAPE  # nodes per shape the zone summaries name (0: none, the earlier protocol)
    clock_s: float = 1_700_000_000.0
    messages: int = 0
    by_type: Counter[str] = field(default_factory=Counter)
    zone_summaries: dict[int, pl.ZoneSummary] = field(default_factory=dict)
    _fits_cache: dict[tuple[Any, ...], dict[int, float]] = field(default_factory=dict)
    _fits_demand: dict[tuple[Any, ...], pl.Demand] = field(default_factory=dict)
    _encoders: dict[int, wire.Encoder] = field(default_factory=dict)
    _decoders: dict[int, wire.Decoder] = field(default_factory=dict)
    _waiting: dict[int, asyncio.Queue[tuple[int, wire.Body]]] = field(default_factory=dict)
    _late_offer: Callable[[int, wire.Offer], None] | None = None
    _dirty: set[int] = field(default_factory=set)  # zones, and nodes, changed since the last summary
    _touched: set[int] = field(default_factory=set)
    _views: dict[int, pl.NodeCapacity] = field(default_factory=dict)  # node -> residual at the last summary
    _slots: dict[int, tuple[int, ...]] = field(default_factory=dict)  # id(view) -> its shape slots
    _holding: dict[int, float] = field(default_factory=dict)  # node -> when its first held offer lapses
    # Gang placement (laminar.zone.gangplace) and its failure cases. ``async_delivery``: each
    # message is delivered on a later turn of the event loop (loop.call_soon), not inside
    # send(), so that concurrent placements interleave message by message as on a network
    # (still no time passes on the fake clock). ``silent``: nodes that drop every message (a
    # dead node; a hand-over to one is refused before it is written). ``lose_before_commit``:
    # nodes whose offer is gone when a commit comes (as if its lease ran out and another
    # placement took the capacity): the real Arbiter then refuses the commit. ``drop_commits``:
    # nodes that answer probes but drop commits (died after their offer).
    async_delivery: bool = False
    silent: set[int] = field(default_factory=set)
    lose_before_commit: set[int] = field(default_factory=set)
    drop_commits: set[int] = field(default_factory=set)  # nodes that answer probes, never commits

    @classmethod
    def build(
        cls,
        nodes: int,
        zone_size: int,
        gpus_per_node: int = 8,
        rng: random.Random | None = None,
        fill: float = 0.5,
        use_wire: bool = True,
        summaries: bool = True,
        packing: str = "bestfit",
    ) -> SimNet:
        """``nodes`` fake nodes in zones of ``zone_size``, each GPU already ``fill`` used on
        average (idle, half or fully used GPUs drawn at random), 64 CPUs and 512 GB. The zone
        summaries are computed unless ``summaries`` is False (call :meth:`refresh_summaries`).
        ``packing``: the arbiters' packing mode (``[zone] packing``: bestfit or frag)."""
        rng = rng or random.Random(0)
        members = [Member(n, 1 + (n - 1) // zone_size, f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", 7440, 7441)
                   for n in range(1, nodes + 1)]
        arbiters = {}
        # one draw for all GPUs: the same stream of random() as one draw per GPU, faster
        free = rng.choices((1.0, 0.5, 0.0), weights=(1 - fill, fill * 0.4, fill * 0.8), k=nodes * gpus_per_node)
        for i, m in enumerate(members):
            gpus = tuple(free[i * gpus_per_node:(i + 1) * gpus_per_node])
            inv = pl.NodeCapacity(m.node, m.zone, gpus, 64.0, 512_000, "H100")
            arbiters[m.node] = Arbiter(inv, hold_s=30.0, packing=packing)  # the agent's default lease
        membership = Membership(self_node=1, members=members)
        net = cls(arbiters, membership, rng, submitter_node=1, use_wire=use_wire)
        if summaries:
            net.refresh_summaries()
        return net

    # -- the fake network -------------------------------------------------------------------

    def now(self) -> float:
        return self.clock_s

    def _carry(self, src: int, dst: int, body: wire.Body) -> wire.Body:
        """Count one message; with ``wire``, encode it as ``src`` and decode it as ``dst``."""
        self.messages += 1
        self.by_type[type(body).__name__] += 1
        if not self.use_wire:
            return body
        enc = self._encoders.get(src)
        if enc is None:
            enc = self._encoders[src] = wire.Encoder(src, SIM_KEY, seq0=1)
        dec = self._decoders.get(dst)
        if dec is None:
            dec = self._decoders[dst] = wire.Decoder(SIM_KEY, _AnyNode(), max_size=wire.MAX_FRAME)
        zone = self.membership.by_node[dst].zone
        return dec.decode(enc.encode(body, zone, self.clock_s, max_size=wire.MAX_FRAME), self.clock_s).body

    # -- Transport (for the submitter) -------------------------------------------------------

    def send(self, node: int, body: wire.Body) -> None:
        a = self.arbiters.get(node)
        if a is None:
            return
        if self.async_delivery:
            asyncio.get_running_loop().call_soon(self._deliver, node, body)
        else:
            self._deliver(node, body)

    def _deliver(self, node: int, body: wire.Body) -> None:
        a = self.arbiters[node]
        got = self._carry(self.submitter_node, node, body)
        if node in self.silent or (node in self.drop_commits and isinstance(got, wire.Commit)):
            return  # counted as sent; a dead node answers nothing
        self.touch(node)
        reply: wire.Body | None = None
        if isinstance(got, wire.Probe):
            reply = a.on_probe(got, self.clock_s)
        elif isinstance(got, wire.Commit):
            if node in self.lose_before_commit and got.placement_id in a.held:
                a.held.pop(got.placement_id)  # its lease ran out and the capacity went to another
                a.lapsed.pop(got.placement_id, None)
            reply = a.on_commit(got, self.clock_s, 7441)
        elif isinstance(got, wire.Release):
            a.on_release(got, self.clock_s)
        if reply is not None:
            back = self._carry(node, self.submitter_node, reply)
            self.membership.seen(node, self.clock_s)
            assert isinstance(back, wire.Offer | wire.Refuse | wire.CommitAck)
            if self.async_delivery:
                asyncio.get_running_loop().call_soon(self._answer, node, back)
            else:
                self._answer(node, back)

    def _answer(self, node: int, back: wire.Offer | wire.Refuse | wire.CommitAck) -> None:
        if not self._router_route(node, back) and isinstance(back, wire.Offer) and self._late_offer is not None:
            self._late_offer(node, back)  # a late offer: released or remembered by the submitter

    def _router_route(self, node: int, body: wire.Offer | wire.Refuse | wire.CommitAck) -> bool:
        q = self._waiting.get(body.placement_id)
        if q is None:
            return False
        q.put_nowait((node, body))
        return True

    def expect(self, placement_id: int) -> asyncio.Queue[tuple[int, wire.Body]]:
        q: asyncio.Queue[tuple[int, wire.Body]] = asyncio.Queue()
        self._waiting[placement_id] = q
        return q

    def forget(self, placement_id: int) -> None:
        self._waiting.pop(placement_id, None)

    async def handover(self, node: int, port: int, body: wire.Handover, timeout_s: float) -> wire.HandoverAck:
        if node in self.silent:
            raise HandoverError(f"node {node}: connection refused (simulated dead node)", delivered=False)
        if self.async_delivery:
            await asyncio.sleep(0)  # the connect: other placements run meanwhile
        got = self._carry(self.submitter_node, node, body)
        self.touch(node)
        assert isinstance(got, wire.Handover)
        p = self.arbiters[node].bind(got.placement_id, self.clock_s, self.submitter_node)
        if p is None:
            ack = wire.HandoverAck(got.placement_id, HANDOVER_NO_RESERVATION, "no committed reservation")
        else:
            p.job_id = p.job_id or f"sim-{got.placement_id:x}"
            ack = wire.HandoverAck(got.placement_id, HANDOVER_OK, p.job_id)
        back = self._carry(node, self.submitter_node, ack)
        assert isinstance(back, wire.HandoverAck)
        if self.async_delivery:
            await asyncio.sleep(0)
        return back

    # -- zone summaries ------------------------------------------------------------------------

    def touch(self, node: int) -> None:
        """Mark ``node``'s zone summary for recomputation (its capacity may have changed)."""
        m = self.membership.by_node.get(node)
        if m is not None:
            self._dirty.add(m.zone)
            self._touched.add(node)

    def _node_view(self, node: int, fresh: bool) -> pl.NodeCapacity:
        """The node's residual capacity (cached unless ``fresh``), its shape slots with it."""
        v = self._views.get(node)
        if v is None or fresh:
            a = self.arbiters[node]
            v = self._views[node] = a.view(self.clock_s)
            self._slots[id(v)] = pl.shape_slots(v)
            if a.held:
                self._holding[node] = min(r.expires_at for r in a.held.values())
            else:
                self._holding.pop(node, None)
        return v

    def refresh_summaries(self, only_changed: bool = False) -> None:
        """Recompute the zone summaries from their nodes' residual capacity, as the agents'
        summary traffic would (its cost is the background rate, not part of a placement).

        ``only_changed`` recomputes only what may have changed through placing: nodes that got
        a message or finished a job since the last refresh (:meth:`touch`), or whose held offer
        lapsed since, and their zones; the rest is still exact. Without it every node and zone
        is recomputed (needed after changing arbiters directly)."""
        now = self.clock_s
        lapsed = {n for n, t in self._holding.items() if t <= now}  # an offer's lease ran out there
        incremental = only_changed and bool(self.zone_summaries)
        if incremental:
            stale = self._touched | lapsed
            zones = self._dirty | {self.membership.by_node[n].zone for n in lapsed}
        else:
            self._views.clear()
            self._slots.clear()
            self._holding.clear()
            stale, zones = set(), set(self.membership.zones())
        by_zone: dict[int, list[pl.NodeCapacity]] = {}
        for z in sorted(zones):
            by_zone[z] = [self._node_view(n, n in stale) for n in self.membership.zone_list(z) if n in self.arbiters]
        if len(self._slots) > 2 * len(self.arbiters):  # drop the slots of views no longer current
            live = {id(v) for v in self._views.values()}
            self._slots = {k: v for k, v in self._slots.items() if k in live}
        hint_rng = random.Random(int(now * 1000))  # its own stream: placements' draws stay as they were
        slots = self._slots
        fresh = {z: pl.summarize_zone(z, caps, now, rng=hint_rng, hints=self.hints, slots_of=lambda v: slots[id(v)])
                 for z, caps in by_zone.items()}
        # what a zone-summary datagram would carry must fit one datagram
        for s in fresh.values():
            wire.Encoder(0, SIM_KEY, seq0=1).encode(zone_summary_to_msg(s), 1, self.clock_s)
        self.zone_summaries = {**self.zone_summaries, **fresh}
        self._dirty = set()
        self._touched = set()
        # the fits of the demand shapes seen so far, for the zones whose summary changed: new
        # mappings (a submitter keeps its zone draw per mapping), computed here with the
        # summaries (background work, as in the agent where they change once a summary round)
        if incremental:
            self._fits_cache = {k: {**f, **{z: pl.zone_fit(fresh[z], self._fits_demand[k]) for z in fresh}}
                                for k, f in self._fits_cache.items()}
        else:
            self._fits_cache.clear()

    def zone_fits(self, demand: pl.Demand) -> dict[int, float]:
        """Fit per zone for ``demand``, cached until the summaries change (as the agent does)."""
        key = (demand.gpus, demand.cpus, demand.memory_mb, demand.gpu_model)
        f = self._fits_cache.get(key)
        if f is None:
            f = {z: pl.zone_fit(s, demand) for z, s in self.zone_summaries.items()}
            self._fits_cache[key] = f
            self._fits_demand[key] = demand
        return f

    # -- placing ------------------------------------------------------------------------------

    def submitter(self, policy: pl.RetryPolicy | None = None) -> Submitter:
        """A submitter on node 1 with the agent's defaults (lease, no releases unless
        ``release_unused``), one queue round, and sleeps that only advance the fake clock."""
        async def no_sleep(s: float) -> None:
            self.clock_s += s

        sub = Submitter(
            self, self.membership, self.zone_fits, rng=self.rng, policy=policy,
            ids=lambda: self.rng.getrandbits(63) | 1,  # a simulation's ids: from its seed, reproducible
            probe_timeout_s=0.05, max_rounds=1, clock=self.now, sleep=no_sleep,
            release_unused=self.release_unused, zone_summary=lambda z: self.zone_summaries.get(z),
        )
        self._late_offer = sub.note_late_offer
        return sub

    def gang_placer(self, policy: pl.RetryPolicy | None = None, max_rounds: int = 1,
                    probe_timeout_s: float = 0.05) -> GangPlacer:
        """A gang placer on node 1 over this fake network (see :meth:`submitter`); offers that
        come after their placement ended are released by it. ``probe_timeout_s`` is real
        time (only a silent node makes the placer wait for it)."""
        async def no_sleep(s: float) -> None:
            self.clock_s += s

        gp = GangPlacer(
            self, self.membership, self.zone_fits, rng=self.rng, policy=policy,
            ids=lambda: self.rng.getrandbits(63) | 1, probe_timeout_s=probe_timeout_s,
            commit_timeout_s=probe_timeout_s, max_rounds=max_rounds, clock=self.now, sleep=no_sleep,
            zone_summary=(lambda z: self.zone_summaries.get(z)) if self.hints else None,
        )
        self._late_offer = gp.note_late_offer
        return gp

    async def place_gang(self, demand: pl.Demand, k: int, placer: GangPlacer | None = None,
                         spread_zones: bool = False) -> GangResult:
        """Place a gang of ``k`` workers from node 1 (each member's spec a tiny JSON naming its
        index); a failed hand-over's started members are stopped (their jobs finished)."""
        gp = placer or self.gang_placer()

        def build(nodes: list[int]) -> list[bytes]:
            return [b'{"name":"sim","member":{"index":%d,"count":%d}}' % (i, len(nodes)) for i in range(len(nodes))]

        async def undo(nodes: list[int]) -> None:
            for n in nodes:
                self.finish(n, pid_of[0])

        pid_of = [gp.ids()]
        return await gp.place(demand, k, build, spread_zones=spread_zones, placement_id=pid_of[0], undo=undo)

    def finish(self, node: int, placement_id: int) -> None:
        """The job of ``placement_id`` on ``node`` ended: its capacity is free again."""
        self.arbiters[node].finish(placement_id)
        self.touch(node)

    async def place(self, demand: pl.Demand, spec: dict[str, Any] | None = None,
                    submitter: Submitter | None = None, packing: bool = False) -> PlacementResult:
        """Place one job from node 1; ``packing``: the packing placement (whole zones probed,
        the least-fragmenting offer bound; see :meth:`Submitter._place_packing`)."""
        s = submitter or self.submitter()
        return await s.place(demand, spec or {"name": "sim"}, packing=packing)


class _AnyNode(dict[int, int]):
    """Membership lookup for the fake network's decoders: every node id is known."""

    def __contains__(self, key: object) -> bool:
        return True


def run_placements(net: SimNet, demands: list[pl.Demand], keep_running: int,
                   refresh_every: int = 50, interval_s: float = 0.001) -> tuple[list[PlacementResult], float, int]:
    """Place ``demands`` one after another, ``interval_s`` of fake time apart; jobs finish FIFO
    once more than ``keep_running`` run (a steady state). Returns the results, the CPU seconds
    spent placing (summary refreshes excluded) and the messages sent while placing.

    ``interval_s`` matters since unused offers lapse instead of being released: the offers of
    the last ``lease / interval_s`` placements still hold their nodes' capacity."""
    sub = net.submitter()
    running: list[tuple[int, int]] = []
    results = []
    cpu = 0.0
    msgs = 0

    async def go() -> None:
        nonlocal cpu, msgs
        for i, d in enumerate(demands):
            if i and i % refresh_every == 0:
                net.refresh_summaries(only_changed=True)
            m0 = net.messages
            c0 = time.process_time()
            r = await sub.place(d, {"name": f"sim-{i}"})
            cpu += time.process_time() - c0
            msgs += net.messages - m0
            results.append(r)
            net.clock_s += interval_s
            if r.outcome == "placed" and r.node is not None:
                running.append((r.node, r.placement_id))
            while len(running) > keep_running:
                node, pid = running.pop(0)
                net.arbiters[node].finish(pid)
                net.touch(node)

    asyncio.run(go())
    return results, cpu, msgs
