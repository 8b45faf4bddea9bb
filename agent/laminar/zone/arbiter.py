"""The node side of zone placement: conversions between the policy's and the wire's types, and
:class:`Arbiter`, the node-local arbitration (split out of :mod:`laminar.zone.component`).

Free of sockets and of the agent's mechanism, so the agent (:mod:`laminar.zone.component`),
the simulated transport (:mod:`laminar.zone.simnet`) and the simulator run the same code.

:class:`Arbiter` is the node answering probes. It holds the reservations (tentative under a
lease, committed for the hand-over, then *placed* while the job runs) and decides each probe
with :func:`laminar.policy.placement.arbitrate`. Packing mode (``docs/allocation.md``): with
``[zone] packing = "frag"`` it offers the least-fragmenting GPUs
(:func:`laminar.policy.packing.least_frag_alloc`) and scores its offers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from laminar.policy import mixlearn
from laminar.policy import packing as pk
from laminar.policy import placement as pl
from laminar.zone import wire

# Hand-over statuses (HandoverAck.status).
HANDOVER_OK = 0
HANDOVER_NO_RESERVATION = 1  # the committed reservation is gone (hold expired): place elsewhere
HANDOVER_REJECTED = 2  # the node refused the job spec itself: placing elsewhere fails the same way
HANDOVER_ERROR = 3  # the node failed to start the job
# Every job placed through the zone is stored with its placement id (the jobs table's
# placement_id, laminar.runtime.provenance): after an agent restart, a repeated hand-over finds
# the job by it (and never starts a second). The job reads it as LM_PLACEMENT_ID, which the agent
# never reads back (a user could set it: a refused hand-over answered with the user's job).
PLACEMENT_ENV = "LM_PLACEMENT_ID"

DEMAND_CACHE_MAX = 256  # probe shapes whose checked Demand the arbiter keeps (bounded memory)
ZONE_TABLES_MAX = 64  # zone draws a submitter keeps (one per demand shape between summary rounds)
BOUND_MEMORY = 4096  # nodes a submitter remembers binding jobs to or being refused by (stale hints)
# refusals that say the node is full for the demand (as opposed to a model or pool mismatch)
FULL_REASONS = frozenset({pl.RefuseReason.NO_GPU, pl.RefuseReason.NO_CPU, pl.RefuseReason.NO_MEMORY,
                          pl.RefuseReason.BUSY, pl.RefuseReason.DRAINING})
LAPSED_MAX = 1024  # lapsed offers an arbiter remembers for a late hand-over (bounded memory)
# An offer's lease. Unused offers are not released (that would cost a datagram per placement):
# they lapse, so the lease is what a losing offer costs its node. It covers the answer, the
# submitter's wait for the other answers (probe_timeout_s, 0.2 s) and the hand-over's connect;
# a hand-over later than that still binds if the capacity is free (Arbiter.bind).
LEASE_S = 0.1

# Packing modes of the node side ([zone] packing): "bestfit" (placement.allocate_gpus, the hot
# path) or "frag" (packing.least_frag_alloc: the least-fragmenting GPUs, and the offer carries
# its fragmentation score for a packing placement to compare).
PACKING_MODES = ("bestfit", "frag")
# A "frag" arbiter with no fixed mix learns it (laminar.policy.mixlearn.MixLearner): a count of
# the shapes probed at it, decayed with a half-life of mixlearn.HALF_LIFE probes, each placement
# counted once, each probe weighed by the rate the node is probed at (against the highest seen);
# the mix is replaced only when it moved (scores are cached per mix).
SHAPES_SEEN_MAX = mixlearn.MAX_SHAPES  # distinct probe shapes a "frag" arbiter counts (bounded memory)
MIX_MIN_SEEN = 16  # fewer probe shapes seen than this: the fixed DEFAULT_FRAG_MIX is used
MIX_REFRESH = 32  # the mix is recomputed after this many new probe shapes (it sorts the shapes)
# The shape mix a "frag" arbiter scores with before it has seen MIX_MIN_SEEN probes: the GPU
# shapes of placement.SHAPES, small ones likelier (as in the Alibaba openb trace, where most
# workers take one GPU or a share of one), no CPU term (a CPU count would be a guess). An
# assumption, not a measurement: the mix of the probes seen replaces it soon.
DEFAULT_FRAG_MIX: pk.ShapeMix = (
    (pk.Shape(0, 1000, 1), 0.35), (pk.Shape(0, 500, 1), 0.25), (pk.Shape(0, 250, 1), 0.15),
    (pk.Shape(0, 1000, 2), 0.10), (pk.Shape(0, 1000, 4), 0.10), (pk.Shape(0, 1000, 8), 0.05),
)
# Zones whose every member a packing placement probes in one round (whole zones, all answers
# awaited): laminar.sim.allocation.FRAG_SPREAD, the spread measured best in docs/allocation.md.
PACKING_SPREAD = 4


# --------------------------------------------------------------------------- conversions




def demand_to_probe(d: pl.Demand, placement_id: int, lease_s: float) -> wire.Probe:
    return wire.Probe(
        placement_id,
        int(round(d.gpus * 100)),
        int(round(d.cpus * 1000)),
        d.memory_mb,
        int(lease_s * 1000),
        d.gpu_model or "",
        d.pool or "",
    )


def probe_to_demand(p: wire.Probe) -> pl.Demand:
    """Raises PlacementError for values a Demand does not allow."""
    return pl.Demand(p.gpus_centi / 100, p.cpus_milli / 1000, p.memory_mb, p.gpu_model or None, p.pool or None)


def capacity_to_summary(c: pl.NodeCapacity) -> wire.Summary:
    return wire.Summary(
        tuple(max(0, min(100, int(math.floor(f * 100 + 1e-6)))) for f in c.gpu_free),
        int(c.cpus * 1000),
        c.memory_mb,
        c.draining,
        c.gpu_model or "",
        c.pool or "",
    )


def summary_to_capacity(node: int, zone: int, s: wire.Summary) -> pl.NodeCapacity:
    return pl.NodeCapacity(
        node, zone, tuple(g / 100 for g in s.gpu_free_centi), s.cpus_milli / 1000, s.memory_mb,
        s.gpu_model or None, s.pool or None, s.draining,
    )


def _up(x: float, unit: float) -> int:
    """``x`` in ``unit``s, rounded up (a bound stays a bound), :data:`wire.HOST_MORE` at the top."""
    if not math.isfinite(x):
        return wire.HOST_MORE
    return max(0, min(wire.HOST_MORE, math.ceil(x / unit - 1e-9)))


HOST_CPU_UNIT = 0.1  # a host bucket's CPUs on the wire: tenths of a core
HOST_MEMORY_UNIT_MB = 64  # and its memory: 64 MB units


def shares_to_wire(shares: mixlearn.Shares | None) -> tuple[tuple[wire.MixEntry, ...], int]:
    """A shared mix (:func:`laminar.policy.mixlearn.top_shares`) as the wire carries it: at most
    :data:`wire.MAX_MIX_SHAPES` entries, shares floored to 1/65535 (so they sum to at most
    one), the weight in hundredths of a probe (at least 1, capped at the u32's top); ``((),
    0)`` for None (the field is left out)."""
    if shares is None:
        return (), 0
    total, items = shares
    weight = max(1, min(0xFFFFFFFF, int(round(total * 100))))
    mix = tuple((s.cpu_milli, s.gpu_milli, s.num_gpus, max(0, min(wire.MIX_SHARE_ONE, int(p * wire.MIX_SHARE_ONE))))
                for s, p in items[:wire.MAX_MIX_SHAPES] if s.cpu_milli <= 0xFFFFFFFF and s.num_gpus <= 255)
    return (mix, weight) if mix else ((), 0)


def wire_to_shares(mix: tuple[wire.MixEntry, ...], weight: int) -> mixlearn.Shares | None:
    """The shared mix a summary carried (None when it carried none). The decoder has checked
    each entry is a packing shape, so this raises nothing for a decoded message."""
    if not mix or weight <= 0:
        return None
    return weight / 100, tuple((pk.Shape(c, g, n), p / wire.MIX_SHARE_ONE) for c, g, n, p in mix)


def zone_summary_to_msg(z: pl.ZoneSummary, mix: mixlearn.Shares | None = None) -> wire.ZoneSummaryMsg:
    """The datagram body of ``z``, with the zone's shared shape ``mix`` when given. Host buckets travel rounded up (CPUs in tenths of a core,
    memory in 64 MB units; beyond the field's top, :data:`wire.HOST_MORE`), node counts capped
    at 65535; if they would not fit one datagram beside the rest (many long GPU model names),
    the mix is left out first, then the host buckets, and the receivers fall back to the slot estimate."""
    hints = tuple(h[:wire.MAX_HINTS_PER_SHAPE] for h in z.hints[:wire.MAX_HINT_SHAPES])
    if not any(hints):
        hints = ()  # no shape is scarce: the field is left out
    hosts = tuple(tuple((min(n, 0xFFFF), _up(c, HOST_CPU_UNIT), _up(m, HOST_MEMORY_UNIT_MB))
                        for n, c, m in b[:wire.MAX_HOST_BUCKETS]) for b in z.hosts[:wire.MAX_HOST_SHAPES])
    mix_entries, mix_weight = shares_to_wire(mix)
    msg = wire.ZoneSummaryMsg(z.zone, z.nodes, z.slots, int(z.cpus * 1000), z.memory_mb, z.gpu_models[:16], hints,
                              hosts, mix_entries, mix_weight)

    def too_large(m: wire.ZoneSummaryMsg) -> bool:
        return wire.HEADER_SIZE + len(wire.encode_body(m)) + wire.MAC_SIZE > wire.MAX_DATAGRAM

    if mix_entries and too_large(msg):
        msg = replace(msg, mix=(), mix_weight=0)
    if hosts and too_large(msg):
        msg = replace(msg, hosts=())
    return msg


def msg_to_zone_summary(m: wire.ZoneSummaryMsg, issued_at: float) -> pl.ZoneSummary | None:
    """The summary ``m`` carries, or None when its slots are not one per shape. Host buckets
    come back as upper bounds (:data:`wire.HOST_MORE`: ``math.inf``); a message without them
    (an older peer's) gives a summary without them."""
    if len(m.slots) != len(pl.SHAPES):
        return None
    hosts = tuple(tuple((n, math.inf if c == wire.HOST_MORE else c * HOST_CPU_UNIT,
                         math.inf if mb == wire.HOST_MORE else float(mb * HOST_MEMORY_UNIT_MB))
                        for n, c, mb in b[:pl.MAX_HOST_BUCKETS]) for b in m.hosts[:len(pl.SHAPES)])
    return pl.ZoneSummary(m.zone, m.nodes, m.slots, m.cpus_milli / 1000, m.memory_mb, m.gpu_models, issued_at,
                          m.hints[:len(pl.SHAPES)], hosts)


def frag_offer(o: pl.Offer, frag: tuple[int, int] | None) -> pk.FragOffer:
    """An offer as :func:`laminar.policy.packing.pick_frag_offer` compares it, from what it
    carried (``wire.Offer.frag``); without a score it ranks after every scored offer."""
    alloc = tuple((i, int(round(f * pk.MILLI))) for i, f in o.gpu_alloc)
    if frag is None:
        return pk.FragOffer(o.node, alloc, math.inf, 2**32)
    return pk.FragOffer(o.node, alloc, frag[0] / 1000, frag[1])


# --------------------------------------------------------------------------- the node side


@dataclass
class Placed:
    """A reservation that became a job on this node."""

    reservation: pl.Reservation
    job_id: str = ""
    submitter: int = 0
    since: float = 0.0


class Arbiter:
    """Node-local arbitration: answers probes, commits, releases, hand-overs; holds reservations.

    ``inventory`` is the node's capacity with nothing placed; what the arbiter placed (jobs it
    accepted by hand-over) and what it holds (offers, commits) are subtracted from it. Every
    method takes ``now`` (wall clock, seconds) and does no I/O.

    ``packing`` (one of :data:`PACKING_MODES`) says which GPUs an offer takes. ``"bestfit"``
    (the default): :func:`laminar.policy.placement.arbitrate`'s best fit. ``"frag"``: the
    allocation adding the least fragmentation (:func:`laminar.policy.packing.least_frag_alloc`)
    for ``mix`` when given, else for the mix of the shapes probed here
    (:class:`laminar.policy.mixlearn.MixLearner`: each placement counted once, each probe
    weighed by the rate this node is probed at, older probes decayed with a half-life of
    :data:`laminar.policy.mixlearn.HALF_LIFE` probes; the fixed
    :data:`DEFAULT_FRAG_MIX` until :data:`MIX_MIN_SEEN` were seen), and the offer carries its
    fragmentation score (``wire.Offer.frag``). Either way the same checks decide whether the
    demand fits, counting every live reservation and placed job: only the choice of GPUs
    differs. A demand with no packing shape (a fraction above one GPU, e.g. 1.5) gets the
    best fit, without a score.
    """

    def __init__(
        self,
        inventory: pl.NodeCapacity,
        *,
        lease_s: float = LEASE_S,
        hold_s: float = 30.0,
        max_tentative: int = 64,
        packing: str = "bestfit",
        mix: pk.ShapeMix | None = None,
        max_held_per_node: int = 0,
    ) -> None:
        if packing not in PACKING_MODES:
            raise ValueError(f"arbiter: packing {packing!r}; choose one of {', '.join(PACKING_MODES)}")
        if mix is not None:
            pk.check_mix(mix)
        self.packing = packing
        self.fixed_mix = mix
        self.mix_learner = mixlearn.MixLearner(max_shapes=SHAPES_SEEN_MAX, min_seen=MIX_MIN_SEEN, refresh=MIX_REFRESH)
        # the score each frag offer carried, by placement id, so that a retransmitted probe gets
        # its offer back with the same score (pruned to the held offers when it grows)
        self._frag_of: dict[int, tuple[int, int]] = {}
        self._inventory = inventory
        self._inventory_version = 0
        self.lease_s = lease_s
        self.hold_s = hold_s
        self.max_tentative = max_tentative
        self.held: dict[int, pl.Reservation] = {}
        self.placed: dict[int, Placed] = {}
        # who probed for each offer (placement id -> node): commit, release, the releases a
        # probe carries and the binding hand-over act only for that node (laminar.zone.authority);
        # pruned to the held and lapsed offers when it grows. A placed job's is Placed.submitter.
        self.prober: dict[int, int] = {}
        # most offers (held, committed or not) one node may hold here at once (0: max_tentative)
        self.max_held_per_node = max_held_per_node
        # offers whose lease ran out, by placement id (bounded, oldest dropped first): a
        # hand-over that comes after the lease re-arbitrates the same demand (see bind())
        self.lapsed: dict[int, pl.Reservation] = {}
        self.counts: dict[str, int] = {"offers": 0, "refusals": 0, "commits": 0, "releases": 0, "expired": 0,
                                       "rebinds": 0, "rebind_refusals": 0, "frag_offers": 0,
                                       "not_prober": 0, "held_per_node": 0}
        self._placed_version = 0
        self._base_key: tuple[int, int, int] | None = None
        self._base_cache: pl.NodeCapacity | None = None
        self._demands: dict[tuple[int, int, int, str, str], pl.Demand] = {}

    @property
    def inventory(self) -> pl.NodeCapacity:
        return self._inventory

    @inventory.setter
    def inventory(self, value: pl.NodeCapacity) -> None:
        self._inventory = value
        self._inventory_version += 1

    def _base(self) -> pl.NodeCapacity:
        """The inventory less placed jobs, cached until either changes."""
        key = (self._inventory_version, len(self.placed), self._placed_version)
        if self._base_key != key:
            self._base_cache = pl.residual(self.inventory, [x.reservation for x in self.placed.values()], -math.inf)
            self._base_key = key
        assert self._base_cache is not None
        return self._base_cache

    def expire(self, now: float) -> None:
        """Forget reservations whose lease ran out (a lost release, a dead submitter)."""
        if not self.held:
            return
        dead = [pid for pid, r in self.held.items() if not r.expires_at > now]
        if not dead:
            return
        lapsed = self.lapsed
        for pid in dead:
            lapsed[pid] = self.held.pop(pid)
        while len(lapsed) > LAPSED_MAX:  # dicts keep insertion order: the oldest go first
            del lapsed[next(iter(lapsed))]
        self.counts["expired"] += len(dead)

    def view(self, now: float) -> pl.NodeCapacity:
        """Residual capacity: inventory less placed jobs and live reservations."""
        self.expire(now)
        used = [p.reservation for p in self.placed.values()]
        return pl.residual(pl.residual(self.inventory, used, -math.inf), self.held.values(), now)

    def prober_of(self, placement_id: int) -> int | None:
        """The node placement ``placement_id`` is held or placed for here (None: not known)."""
        placed = self.placed.get(placement_id)
        return placed.submitter if placed is not None else self.prober.get(placement_id)

    def not_probers(self, placement_id: int, node: int | None) -> bool:
        """Whether ``node`` asks about a placement another node probed for (counted): it acts
        on no reservation of another's. ``node`` None: the caller binds no prober (a simulator)."""
        if node is None:
            return False
        other = self.prober_of(placement_id)
        if other is None or other == node:
            return False
        self.counts["not_prober"] += 1
        return True

    def _held_by(self, node: int) -> int:
        return sum(1 for pid in self.held if self.prober.get(pid) == node)

    def on_probe(self, p: wire.Probe, now: float, node: int | None = None) -> wire.Offer | wire.Refuse:
        """Answer a probe: an offer under lease (held here) or a refusal with its reason.
        ``node``: the prober (the offer is bound to it; None: not bound, as in the simulator)."""
        if p.placement_id in self.placed:  # a late duplicate of a placement that already ran here
            return wire.Refuse(p.placement_id, pl.RefuseReason.BUSY)
        if self.not_probers(p.placement_id, node):  # another node's placement id: not that node's offer
            return wire.Refuse(p.placement_id, pl.RefuseReason.BUSY)
        # probes come in few shapes: a checked Demand (immutable) is reused for the same shape,
        # which spares its validation on the hot path; invalid shapes are checked every time
        key = (p.gpus_centi, p.cpus_milli, p.memory_mb, p.gpu_model, p.pool)
        demand = self._demands.get(key)
        if demand is None:
            try:
                demand = probe_to_demand(p)
            except pl.PlacementError:
                self.counts["refusals"] += 1
                return wire.Refuse(p.placement_id, pl.RefuseReason.NO_CPU)
            if len(self._demands) >= DEMAND_CACHE_MAX:
                self._demands.clear()
            self._demands[key] = demand
        if p.releases:  # the submitter's unused offers from this node, released by this probe
            self.drop_unused(p.releases, node)
        self.expire(now)
        base = self._base()
        lease = min(p.lease_ms / 1000, 60.0) if p.lease_ms else self.lease_s
        repeat = p.placement_id in self.held  # a retransmission gets the same offer back
        if (node is not None and not repeat and self.max_held_per_node
                and len(self.held) >= self.max_held_per_node and self._held_by(node) >= self.max_held_per_node):
            # one member holding every slot would leave no offer for the others (zone.max_held_per_node)
            self.counts["held_per_node"] += 1
            self.counts["refusals"] += 1
            return wire.Refuse(p.placement_id, pl.RefuseReason.BUSY)
        a = pl.arbitrate(
            base, list(self.held.values()), demand, now,
            placement_id=p.placement_id, lease_s=max(lease, 0.001), max_tentative=self.max_tentative,
        )
        shape = self._note_shape(demand, p.placement_id, now) if self.packing == "frag" and not repeat else None
        if isinstance(a, pl.Refusal):
            self.counts["refusals"] += 1
            return wire.Refuse(p.placement_id, int(a.reason))
        r = a.reservation
        frag: tuple[int, int] | None = self._frag_of.get(p.placement_id) if repeat else None
        if shape is not None:
            got = self._frag_choice(pl.residual(base, self.held.values(), now), shape)
            if got is not None:
                r = replace(r, gpu_alloc=got[0])
                frag = got[1]
                self.counts["frag_offers"] += 1
                if len(self._frag_of) >= 2 * max(len(self.held), 32):
                    held = self.held
                    self._frag_of = {k: v for k, v in self._frag_of.items() if k in held}
                self._frag_of[p.placement_id] = frag
        self.held[p.placement_id] = r
        if node is not None:
            if len(self.prober) >= 2 * (len(self.held) + len(self.lapsed)) + 64:
                keep = self.held.keys() | self.lapsed.keys()
                self.prober = {k: v for k, v in self.prober.items() if k in keep}
            self.prober[p.placement_id] = node
        self.counts["offers"] += 1
        remaining = max(1, int((r.expires_at - now) * 1000))
        return wire.Offer(p.placement_id, remaining, tuple((i, int(round(f * 100))) for i, f in r.gpu_alloc), frag)

    def _note_shape(self, demand: pl.Demand, placement_id: int | None = None, now: float | None = None) -> pk.Shape | None:
        """The packing shape of a probed demand, None when it has none; counted for the learned
        mix (once per ``placement_id``: a placement probed here again is not counted twice;
        weighted by the rate this node is probed at ``now``: :class:`laminar.policy.mixlearn.MixLearner`)."""
        try:
            shape = pk.shape_of(demand.gpus, demand.cpus)
        except pk.PackingError:
            return None
        if self.fixed_mix is None:
            self.mix_learner.note(shape, placement_id, now)
        return shape

    def mix_share(self) -> mixlearn.Shares | None:
        """What this node shares of its learned mix in its summaries (its own counts:
        :meth:`laminar.policy.mixlearn.MixLearner.share`); None when it learns none (a fixed
        mix, best fit) or has seen too few probes."""
        if self.packing != "frag" or self.fixed_mix is not None:
            return None
        return self.mix_learner.share()

    def set_peer_mixes(self, parts: Iterable[mixlearn.Shares]) -> None:
        """Score with this node's learned counts plus ``parts``: the fresh mixes its zone peers
        and the other zones shared (each weighted by its total,
        :func:`laminar.policy.mixlearn.merge_shares`). Called once a summary round, never per
        probe; a no-op for an arbiter that learns no mix."""
        self.set_peer_weights(mixlearn.merge_shares(parts))

    def set_peer_weights(self, weights: dict[pk.Shape, float]) -> None:
        """:meth:`set_peer_mixes` with the parts already merged (shape -> weight in probes)."""
        if self.packing != "frag" or self.fixed_mix is not None:
            return
        self.mix_learner.set_peers(weights)

    def shape_mix(self) -> pk.ShapeMix:
        """The mix a ``frag`` arbiter scores with now (see the class docs)."""
        if self.fixed_mix is not None:
            return self.fixed_mix
        mix = self.mix_learner.mix()
        return DEFAULT_FRAG_MIX if mix is None else mix

    def _frag_choice(self, free: pl.NodeCapacity, shape: pk.Shape) -> tuple[pl.GpuAlloc, tuple[int, int]] | None:
        """The least-fragmenting GPUs for ``shape`` in ``free`` (the residual arbitrate
        checked the demand against) with the offer's score ``(delta in micro-GPUs, free
        milli-GPUs after)``; None when packing finds no option that surely fits (the best
        fit stands then). Never returns more of a GPU than ``free`` has."""
        gl = pk.to_milli(free.gpu_free)
        got = pk.least_frag_alloc(gl, int(math.floor(free.cpus * 1000 + 1e-6)), shape, self.shape_mix())
        if got is None:
            return None
        alloc = tuple((i, m / pk.MILLI) for i, m in got[0])
        if len({i for i, _ in alloc}) != len(alloc) or any(free.gpu_free[i] < f - pl.EPS for i, f in alloc):
            return None  # a milli rounding the fractions do not bear out: keep the best fit
        delta = max(-(2**31), min(2**31 - 1, int(round(got[1] * 1000))))
        return alloc, (delta, sum(gl) - sum(m for _, m in got[0]))

    def on_commit(self, c: wire.Commit, now: float, handover_port: int = 0, node: int | None = None) -> wire.CommitAck:
        """Turn the offer committed for the hand-over window; idempotent by placement id. Only
        for the node that probed for it (``node``; None: not checked)."""
        if self.not_probers(c.placement_id, node):
            return wire.CommitAck(c.placement_id, int(pl.RefuseReason.UNKNOWN_PLACEMENT), handover_port)
        if c.placement_id in self.placed:
            return wire.CommitAck(c.placement_id, 0, handover_port)
        if self.inventory.draining:  # reclaimed since its offer: the job goes elsewhere
            self.held.pop(c.placement_id, None)
            self.counts["refusals"] += 1
            return wire.CommitAck(c.placement_id, int(pl.RefuseReason.DRAINING), handover_port)
        self.expire(now)
        hold = min(c.hold_ms / 1000, 600.0) if c.hold_ms else self.hold_s
        r = pl.commit(list(self.held.values()), c.placement_id, now, hold)
        if r is None and c.placement_id not in self.held:  # a commit after the lease: as in bind()
            revived = self._revive(c.placement_id, now)
            if revived is not None:
                r = pl.commit([revived], c.placement_id, now, hold)
        if r is None:
            return wire.CommitAck(c.placement_id, int(pl.RefuseReason.UNKNOWN_PLACEMENT), handover_port)
        self.held[c.placement_id] = r
        self.counts["commits"] += 1
        return wire.CommitAck(c.placement_id, 0, handover_port)

    def drop_unused(self, pids: Iterable[int], node: int | None = None) -> None:
        """Drop the tentative reservations named (offers their submitter did not bind); a
        committed one, a placed job, an unknown id or another node's offer is left alone."""
        for pid in pids:
            r = self.held.get(pid)
            if r is not None and not r.committed and not self.not_probers(pid, node):
                del self.held[pid]
                self.lapsed.pop(pid, None)
                self.counts["releases"] += 1

    def on_release(self, r: wire.Release, now: float, node: int | None = None) -> None:
        """Drop a reservation the submitter did not bind (a placed job is not touched); only
        the node that probed for it may (``node``; None: not checked)."""
        if self.not_probers(r.placement_id, node):
            return
        if self.held.pop(r.placement_id, None) is not None:
            self.counts["releases"] += 1

    def _revive(self, placement_id: int, now: float) -> pl.Reservation | None:
        """A lapsed offer arbitrated again (a new tentative reservation, not stored), or None
        when this node never offered it, forgot it, or it no longer fits."""
        old = self.lapsed.pop(placement_id, None)
        if old is None:
            return None
        a = pl.arbitrate(self._base(), list(self.held.values()), old.demand, now, placement_id=placement_id,
                         lease_s=self.lease_s, max_tentative=len(self.held) + 1)
        if isinstance(a, pl.Refusal):
            self.counts["rebind_refusals"] += 1
            return None
        self.counts["rebinds"] += 1
        if self.packing == "frag":  # the same choice of GPUs as its probe had
            try:
                shape: pk.Shape | None = pk.shape_of(old.demand.gpus, old.demand.cpus)
            except pk.PackingError:
                shape = None
            got = None if shape is None else self._frag_choice(pl.residual(self._base(), self.held.values(), now), shape)
            if got is not None:
                return replace(a.reservation, gpu_alloc=got[0])
        return a.reservation

    def bind(self, placement_id: int, now: float, submitter: int = 0) -> Placed | None:
        """The hand-over arrived: the live reservation (an offer, committed or not) becomes a
        placed job. Returns the :class:`Placed` entry (the same one again for a repeated
        hand-over, whose ``job_id`` is then set), or None when no reservation can be had.

        A hand-over that comes after its offer's lease ran out is not refused outright: the
        lapsed offer's demand is arbitrated again, against everything this node holds and
        runs now (exactly as a new probe would be), and binds when it still fits. Leases can
        therefore be short (unused offers are never released, they lapse) without costing a
        slow submitter its placement; capacity is never promised twice.

        A draining node (its owner announced the reclaim) binds nothing new, whatever it
        offered or committed before: the evacuation moves the jobs of the notice's moment only.
        """
        p = self.placed.get(placement_id)
        if p is not None:
            return p if p.submitter == submitter else None
        if self.prober.get(placement_id, submitter) != submitter:
            return None  # another node's offer (not_probers counts it at the hand-over)
        if self.inventory.draining:
            self.held.pop(placement_id, None)
            return None
        self.expire(now)
        r = self.held.pop(placement_id, None) or self._revive(placement_id, now)
        if r is None:
            return None
        p = Placed(pl.Reservation(r.placement_id, r.demand, r.gpu_alloc, math.inf, True), "", submitter, now)
        self.placed[placement_id] = p
        self._placed_version += 1
        return p

    def unbind(self, placement_id: int) -> None:
        """The job could not start, or it ended: its capacity is free again."""
        if self.placed.pop(placement_id, None) is not None:
            self._placed_version += 1

    finish = unbind

    def summary(self, now: float) -> wire.Summary:
        """This node's summary: its residual capacity, and its learned mix (:meth:`mix_share`)
        when it has one to share."""
        s = capacity_to_summary(self.view(now))
        mix, weight = shares_to_wire(self.mix_share())
        return replace(s, mix=mix, mix_weight=weight) if mix else s
