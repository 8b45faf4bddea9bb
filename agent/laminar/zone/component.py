"""The zone component of laminard: node-local arbitration and the submitter side of placement.

Two halves, both free of sockets so the agent and the simulated transport run the same code:

- :class:`Arbiter` is the node answering probes. It holds the reservations (tentative under a
  lease, committed for the hand-over, then *placed* while the job runs) and decides each probe
  with :func:`laminar.zone.placement.arbitrate`.
- :class:`Submitter` places one job: choose a zone by fit, probe ``d`` nodes, bind the first
  good offer, release the rest, hand the job over; bounded retries. It talks through a
  :class:`laminar.zone.transport.Transport` (real UDP/TCP in the agent,
  :class:`laminar.zone.simnet.SimNet` in the benchmark).

:class:`ZoneComponent` wires them into the agent: the UDP endpoint, the TCP hand-over server,
summaries and heartbeats at a bounded rate, and the API routes ``GET /v1/zone/peers``,
``GET /v1/zone/stats`` and ``POST /v1/placements``.

A placement's outcome is a :class:`PlacementResult`: ``placed`` (node, zone, job id),
``unconfirmed`` (the hand-over reached a node that died before acknowledging it: the job may
be running there, so it is *not* placed again elsewhere, which could double it), ``rejected``
(the job spec was refused by the chosen node: placing it elsewhere would fail the same way) or
``queued-out`` (no capacity found within the retry budget).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.zone import placement as pl
from laminar.zone import wire
from laminar.zone.membership import Membership
from laminar.zone.transport import HandoverError, Transport

log = logging.getLogger("laminar.zone")

# Hand-over statuses (HandoverAck.status).
HANDOVER_OK = 0
HANDOVER_NO_RESERVATION = 1  # the committed reservation is gone (hold expired): place elsewhere
HANDOVER_REJECTED = 2  # the node refused the job spec itself: placing elsewhere fails the same way
HANDOVER_ERROR = 3  # the node failed to start the job


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


def zone_summary_to_msg(z: pl.ZoneSummary) -> wire.ZoneSummaryMsg:
    return wire.ZoneSummaryMsg(z.zone, z.nodes, z.slots, int(z.cpus * 1000), z.memory_mb, z.gpu_models[:16])


def msg_to_zone_summary(m: wire.ZoneSummaryMsg, issued_at: float) -> pl.ZoneSummary | None:
    if len(m.slots) != len(pl.SHAPES):
        return None
    return pl.ZoneSummary(m.zone, m.nodes, m.slots, m.cpus_milli / 1000, m.memory_mb, m.gpu_models, issued_at)


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
    """

    def __init__(
        self,
        inventory: pl.NodeCapacity,
        *,
        lease_s: float = 2.0,
        hold_s: float = 30.0,
        max_tentative: int = 64,
    ) -> None:
        self.inventory = inventory
        self.lease_s = lease_s
        self.hold_s = hold_s
        self.max_tentative = max_tentative
        self.held: dict[int, pl.Reservation] = {}
        self.placed: dict[int, Placed] = {}
        self.counts: dict[str, int] = {"offers": 0, "refusals": 0, "commits": 0, "releases": 0, "expired": 0}

    def expire(self, now: float) -> None:
        """Forget reservations whose lease ran out (a lost release, a dead submitter)."""
        dead = [pid for pid, r in self.held.items() if not r.live(now)]
        for pid in dead:
            del self.held[pid]
        self.counts["expired"] += len(dead)

    def view(self, now: float) -> pl.NodeCapacity:
        """Residual capacity: inventory less placed jobs and live reservations."""
        self.expire(now)
        used = [p.reservation for p in self.placed.values()]
        return pl.residual(pl.residual(self.inventory, used, -math.inf), self.held.values(), now)

    def on_probe(self, p: wire.Probe, now: float) -> wire.Offer | wire.Refuse:
        """Answer a probe: an offer under lease (held here) or a refusal with its reason."""
        if p.placement_id in self.placed:  # a late duplicate of a placement that already ran here
            return wire.Refuse(p.placement_id, pl.RefuseReason.BUSY)
        try:
            demand = probe_to_demand(p)
        except pl.PlacementError:
            self.counts["refusals"] += 1
            return wire.Refuse(p.placement_id, pl.RefuseReason.NO_CPU)
        self.expire(now)
        base = pl.residual(self.inventory, [x.reservation for x in self.placed.values()], -math.inf)
        lease = min(p.lease_ms / 1000, 60.0) if p.lease_ms else self.lease_s
        a = pl.arbitrate(
            base, list(self.held.values()), demand, now,
            placement_id=p.placement_id, lease_s=max(lease, 0.001), max_tentative=self.max_tentative,
        )
        if isinstance(a, pl.Refusal):
            self.counts["refusals"] += 1
            return wire.Refuse(p.placement_id, int(a.reason))
        self.held[p.placement_id] = a.reservation
        self.counts["offers"] += 1
        remaining = max(1, int((a.expires_at - now) * 1000))
        return wire.Offer(p.placement_id, remaining, tuple((i, int(round(f * 100))) for i, f in a.gpu_alloc))

    def on_commit(self, c: wire.Commit, now: float, handover_port: int = 0) -> wire.CommitAck:
        """Turn the offer committed for the hand-over window; idempotent by placement id."""
        if c.placement_id in self.placed:
            return wire.CommitAck(c.placement_id, 0, handover_port)
        self.expire(now)
        hold = min(c.hold_ms / 1000, 600.0) if c.hold_ms else self.hold_s
        r = pl.commit(list(self.held.values()), c.placement_id, now, hold)
        if r is None:
            return wire.CommitAck(c.placement_id, int(pl.RefuseReason.UNKNOWN_PLACEMENT), handover_port)
        self.held[c.placement_id] = r
        self.counts["commits"] += 1
        return wire.CommitAck(c.placement_id, 0, handover_port)

    def on_release(self, r: wire.Release, now: float) -> None:
        """Drop a reservation the submitter did not bind (a placed job is not touched)."""
        if self.held.pop(r.placement_id, None) is not None:
            self.counts["releases"] += 1

    def bind(self, placement_id: int, now: float, submitter: int = 0) -> Placed | None:
        """The hand-over arrived: the live reservation (an offer, committed or not) becomes a
        placed job. Returns the :class:`Placed` entry (the same one again for a repeated
        hand-over, whose ``job_id`` is then set), or None when no live reservation exists."""
        p = self.placed.get(placement_id)
        if p is not None:
            return p
        self.expire(now)
        r = self.held.get(placement_id)
        if r is None:
            return None
        del self.held[placement_id]
        p = Placed(pl.Reservation(r.placement_id, r.demand, r.gpu_alloc, math.inf, True), "", submitter, now)
        self.placed[placement_id] = p
        return p

    def unbind(self, placement_id: int) -> None:
        """The job could not start, or it ended: its capacity is free again."""
        self.placed.pop(placement_id, None)

    finish = unbind

    def summary(self, now: float) -> wire.Summary:
        return capacity_to_summary(self.view(now))


# --------------------------------------------------------------------------- the submitter side


@dataclass
class PlacementResult:
    """What became of one placement (``outcome``: placed, unconfirmed, rejected, queued-out)."""

    outcome: str
    placement_id: int
    node: int | None = None
    zone: int | None = None
    job_id: str = ""
    steps: int = 0
    rounds: int = 0
    probed: list[int] = field(default_factory=list)
    refusals: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    elapsed_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome, "placement_id": f"{self.placement_id:016x}", "node": self.node,
            "zone": self.zone, "job_id": self.job_id, "steps": self.steps, "rounds": self.rounds,
            "probed": self.probed, "refusals": self.refusals, "reason": self.reason,
            "elapsed_ms": round(self.elapsed_ms, 3),
        }


class Submitter:
    """Places jobs through a transport with the placement policy.

    ``zone_fits(demand)`` returns the advertised fit per zone (from the summaries this node
    holds). ``clock()`` is the wall clock (seconds). ``max_rounds`` bounds the queue cycles
    before a placement gives up as ``queued-out``.

    By default the hand-over itself binds the offer (the node turns the tentative reservation
    into the job), which saves a round trip; ``commit_first`` sends a UDP commit first, which
    holds the capacity for ``hold_s`` (for a hand-over that must wait, e.g. a checkpoint
    transfer before a re-addressed job starts).
    """

    def __init__(
        self,
        transport: Transport,
        membership: Membership,
        zone_fits: Callable[[pl.Demand], dict[int, float]],
        *,
        rng: random.Random | None = None,
        policy: pl.RetryPolicy | None = None,
        lease_s: float = 2.0,
        hold_s: float = 30.0,
        probe_timeout_s: float = 0.25,
        commit_tries: int = 3,
        handover_timeout_s: float = 10.0,
        handover_tries: int = 3,
        max_rounds: int = 3,
        commit_first: bool = False,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.t = transport
        self.m = membership
        self.zone_fits = zone_fits
        self.rng = rng or random.Random()
        self.policy = policy or pl.RetryPolicy()
        self.lease_s = lease_s
        self.hold_s = hold_s
        self.probe_timeout_s = probe_timeout_s
        self.commit_tries = commit_tries
        self.handover_timeout_s = handover_timeout_s
        self.handover_tries = handover_tries
        self.max_rounds = max_rounds
        self.commit_first = commit_first
        self.clock = clock
        self.sleep = sleep
        self.counts: dict[str, int] = {"placed": 0, "unconfirmed": 0, "rejected": 0, "queued-out": 0}

    def new_placement_id(self) -> int:
        return self.rng.getrandbits(63) | 1

    async def place(self, demand: pl.Demand, spec: dict[str, Any], placement_id: int | None = None) -> PlacementResult:
        """Place one job; see the module docstring for the outcomes. Never raises for a
        peer's misbehaviour or silence (they only cost retries)."""
        t0 = time.perf_counter()
        pid = placement_id or self.new_placement_id()
        res = PlacementResult("queued-out", pid)
        answers = self.t.expect(pid)
        try:
            await self._place(demand, spec, pid, answers, res)
        finally:
            self.t.forget(pid)
            while not answers.empty():  # offers that came in after the binding: release them
                node, body = answers.get_nowait()
                if isinstance(body, wire.Offer) and not (res.outcome != "queued-out" and node == res.node):
                    self.t.send(node, wire.Release(pid))
            res.elapsed_ms = (time.perf_counter() - t0) * 1000
            self.counts[res.outcome] = self.counts.get(res.outcome, 0) + 1
        return res

    async def _place(
        self, demand: pl.Demand, spec: dict[str, Any], pid: int, answers: asyncio.Queue[tuple[int, wire.Body]],
        res: PlacementResult,
    ) -> None:
        probe = demand_to_probe(demand, pid, self.lease_s)
        spec_json = json.dumps(spec, separators=(",", ":")).encode()
        offers: list[pl.Offer] = []  # received, not yet bound nor released, in arrival order
        dead_offers: set[int] = set()
        for rnd in range(self.max_rounds):
            res.rounds = rnd + 1
            tried_zones: list[int] = []
            zone: int | None = None
            probed_in_zone: set[int] = set()
            for step in pl.retry_schedule(self.policy, rnd):
                if isinstance(step, pl.Queue):
                    if rnd + 1 < self.max_rounds:
                        await self.sleep(step.delay_s)
                    break
                res.steps += 1
                if zone is None or step.zone_rank >= len(tried_zones):
                    zone = pl.choose_zone(self.zone_fits(demand), self.rng, exclude=tried_zones)
                    if zone is None:
                        res.reason = "no zone advertises a fit for the demand"
                        break
                    tried_zones.append(zone)
                    probed_in_zone = set()
                # O(d): draw from the zone's shared member list, skipping suspects and nodes
                # already probed for this placement (both small sets)
                members = self.m.zone_list(zone)
                preferred = self.m.pool_list(zone, demand.pool) if demand.pool else []
                skip = probed_in_zone | self.m.suspects if self.m.suspects else probed_in_zone
                targets = pl.probe_targets(members, step.d, self.rng, exclude=skip, preferred=preferred)
                if not targets:
                    continue
                probed_in_zone.update(targets)
                res.probed.extend(targets)
                for n in targets:
                    self.t.send(n, probe)
                waiting = set(targets)
                done, timed_out = await self._collect(pid, answers, waiting, offers, res)
                if timed_out:
                    for n in waiting:  # silent past the timeout: a miss each
                        self.m.missed(n, self.clock())
                if not done and not offers:
                    continue
                outcome = await self._bind(pid, spec_json, answers, offers, dead_offers, res)
                if outcome:
                    self._release(pid, offers)
                    return
            self._release(pid, offers)
            offers.clear()
            if res.outcome != "queued-out":
                return
        res.reason = res.reason or "no node offered capacity within the retry budget"

    async def _collect(
        self, pid: int, answers: asyncio.Queue[tuple[int, wire.Body]], waiting: set[int], offers: list[pl.Offer],
        res: PlacementResult,
    ) -> tuple[bool, bool]:
        """Gather answers until one good offer arrived, all targets answered, or the timeout.
        Returns (a good offer is in hand, the timeout passed with targets still silent)."""
        deadline = time.monotonic() + self.probe_timeout_s
        while waiting:
            if pl.pick_offer(offers, self.clock(), margin_s=0.0) is not None:
                return True, False
            left = deadline - time.monotonic()
            if left <= 0:
                return pl.pick_offer(offers, self.clock()) is not None, True
            try:
                node, body = answers.get_nowait() if not answers.empty() else await asyncio.wait_for(answers.get(), left)
            except TimeoutError:
                return pl.pick_offer(offers, self.clock()) is not None, True
            self._note_answer(node, body, waiting, offers, res)
        return pl.pick_offer(offers, self.clock()) is not None, False

    def _note_answer(self, node: int, body: wire.Body, waiting: set[int], offers: list[pl.Offer], res: PlacementResult) -> None:
        waiting.discard(node)
        now = self.clock()
        if isinstance(body, wire.Offer):
            m = self.m.by_node.get(node)
            if m is None:
                return
            alloc = tuple((i, c / 100) for i, c in body.gpu_alloc)
            r = pl.Reservation(body.placement_id, pl.Demand(), alloc, now + body.lease_ms / 1000)
            offers.append(pl.Offer(node, m.zone, m.pool or None, r))
        elif isinstance(body, wire.Refuse):
            try:
                why = pl.RefuseReason(body.reason).name.lower()
            except ValueError:
                why = f"reason_{body.reason}"
            res.refusals[why] = res.refusals.get(why, 0) + 1

    async def _bind(
        self, pid: int, spec_json: bytes, answers: asyncio.Queue[tuple[int, wire.Body]], offers: list[pl.Offer],
        dead_offers: set[int], res: PlacementResult,
    ) -> bool:
        """Commit offers in arrival order until one hands over. True when the placement is
        finished (placed, unconfirmed or rejected); False to go on with the schedule."""
        while True:
            offer = pl.pick_offer(offers, self.clock(), margin_s=0.0)
            if offer is None:
                return False
            offers.remove(offer)
            node = offer.node
            port = self.m.by_node[node].handover_port
            if self.commit_first:
                ack = await self._commit(pid, node, answers, offers, res)
                if ack is None or ack.status != 0:
                    continue
                port = ack.port or port
            outcome = await self._handover(pid, node, port, spec_json, res)
            if outcome is None:
                continue
            res.node, res.zone = node, offer.zone
            return True

    async def _commit(
        self, pid: int, node: int, answers: asyncio.Queue[tuple[int, wire.Body]], offers: list[pl.Offer],
        res: PlacementResult,
    ) -> wire.CommitAck | None:
        body = wire.Commit(pid, int(self.hold_s * 1000))
        per_try = self.probe_timeout_s
        for _ in range(self.commit_tries):
            self.t.send(node, body)
            deadline = time.monotonic() + per_try
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    n, b = await asyncio.wait_for(answers.get(), left)
                except TimeoutError:
                    break
                if n == node and isinstance(b, wire.CommitAck):
                    return b
                self._note_answer(n, b, set(), offers, res)
        self.m.missed(node, self.clock())
        return None

    async def _handover(self, pid: int, node: int, port: int, spec_json: bytes, res: PlacementResult) -> bool | None:
        """True: finished (placed, unconfirmed or rejected: ``res.outcome`` says); None: the
        node certainly did not take the job, place it elsewhere."""
        delivered = False
        for _ in range(self.handover_tries):
            try:
                ack = await self.t.handover(node, port, wire.Handover(pid, spec_json), self.handover_timeout_s)
            except HandoverError as e:
                delivered = delivered or e.delivered
                if not delivered:
                    self.m.missed(node, self.clock())
                    return None
                continue  # the node may have it: ask again, the hand-over is idempotent
            if ack.status == HANDOVER_OK:
                res.outcome, res.job_id = "placed", ack.text
                return True
            if ack.status == HANDOVER_REJECTED:
                res.outcome, res.reason = "rejected", ack.text
                return True
            if ack.status == HANDOVER_NO_RESERVATION and not delivered:
                return None
            res.reason = ack.text
            if not delivered:
                return None
        res.outcome = "unconfirmed"
        res.reason = f"node {node} took the hand-over and went silent; not placed elsewhere to avoid doubling the job"
        return True

    def _release(self, pid: int, offers: list[pl.Offer]) -> None:
        for o in offers:
            self.t.send(o.node, wire.Release(pid))
        offers.clear()
