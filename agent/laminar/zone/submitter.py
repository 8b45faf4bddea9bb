"""The submitter side of zone placement: :class:`Submitter` places one job (split out of
:mod:`laminar.zone.component`).

Choose a zone by fit, probe ``d`` nodes, bind the first good offer by handing the job over (the
others lapse with their lease); bounded retries. It talks through a :class:`Transport` (real
UDP/TCP in the agent, :mod:`laminar.zone.transport`; :class:`laminar.zone.simnet.SimNet` in the
benchmark and the simulator), so this module holds no socket.

A placement with ``packing`` probes every member of the first ``packing_spread`` zones that can
take the job, awaits every answer and binds the least-fragmenting offer
(:func:`laminar.policy.packing.pick_frag_offer`).

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
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from laminar.policy import packing as pk
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.arbiter import (
    BOUND_MEMORY,
    FULL_REASONS,
    HANDOVER_OK,
    HANDOVER_REJECTED,
    LEASE_S,
    PACKING_SPREAD,
    ZONE_TABLES_MAX,
    demand_to_probe,
    frag_offer,
)
from laminar.zone.membership import Membership

log = logging.getLogger("laminar.zone")


class HandoverError(Exception):
    """A hand-over got no answer. ``delivered`` is False when the job spec surely did not
    reach the node (connection refused or reset before the frame was written), True when it
    may have (the node then may be running the job)."""

    def __init__(self, message: str, delivered: bool) -> None:
        super().__init__(message)
        self.delivered = delivered


class Transport(Protocol):
    def send(self, node: int, body: wire.Body) -> None:
        """Send ``body`` to ``node``; fire and forget (a loss costs a timeout)."""

    def expect(self, placement_id: int) -> asyncio.Queue[tuple[int, wire.Body]]:
        """Start routing answers (offer, refuse, commit-ack) for ``placement_id`` to a queue."""

    def forget(self, placement_id: int) -> None:
        """Stop routing; later offers for it are dropped (they lapse)."""

    async def handover(self, node: int, port: int, body: wire.Handover, timeout_s: float) -> wire.HandoverAck:
        """Hand the job over; raises :class:`HandoverError` without an answer."""




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
    last_refusal: str = ""  # the last node that bound an offer and then did not start the job: why
    elapsed_ms: float = 0.0  # submit to hand-over acknowledged (the job started), in ms
    bind_ms: float = 0.0  # submit to the offer bound (the placement decided), in ms
    t0: float = field(default=0.0, repr=False)
    shape: int | None = field(default=None, repr=False)  # the demand's index in placement.SHAPES

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome, "placement_id": f"{self.placement_id:016x}", "node": self.node,
            "zone": self.zone, "job_id": self.job_id, "steps": self.steps, "rounds": self.rounds,
            "probed": self.probed, "refusals": self.refusals, "reason": self.reason, "last_refusal": self.last_refusal,
            "elapsed_ms": round(self.elapsed_ms, 3), "bind_ms": round(self.bind_ms, 3),
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

    Offers the submitter does not bind are not released: they lapse when their lease (``lease_s``,
    short) runs out, which saves a datagram per unused offer; ``release_unused`` sends the
    releases anyway (the earlier protocol, kept for comparison in ``bench/placement.py``).
    """

    def __init__(
        self,
        transport: Transport,
        membership: Membership,
        zone_fits: Callable[[pl.Demand], dict[int, float]],
        *,
        rng: random.Random | None = None,
        policy: pl.RetryPolicy | None = None,
        lease_s: float = LEASE_S,
        hold_s: float = 30.0,
        probe_timeout_s: float = 0.25,
        commit_tries: int = 3,
        handover_timeout_s: float = 10.0,
        unconfirmed_wait_s: float = 60.0,
        max_rounds: int = 3,
        commit_first: bool = False,
        release_unused: bool = False,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = asyncio.sleep,
        zone_summary: Callable[[int], pl.ZoneSummary | None] | None = None,
        packing_spread: int = PACKING_SPREAD,
        ids: Callable[[], int] = wire.new_id,
    ) -> None:
        if not (isinstance(packing_spread, int) and packing_spread >= 1):
            raise ValueError(f"submitter: packing_spread {packing_spread!r} must be an integer >= 1")
        self.packing_spread = packing_spread
        self.t = transport
        self.zone_summary = zone_summary
        # (node, shape index) -> when this submitter last found that node full for that shape
        # (a refusal), or (node, -1) -> when it bound a job there: hints it then skips
        self._spent: dict[tuple[int, int], float] = {}
        self._zone_tables: dict[int, pl.ZoneTable] = {}  # id(fits) -> its zone draw
        # node -> {placement id: until when} for offers this submitter left unused; the next
        # probe to that node within the lease carries them as releases (wire.Probe.releases)
        self._unused: dict[int, dict[int, float]] = {}
        self.m = membership
        self.zone_fits = zone_fits
        self.rng = rng or random.Random()  # choices only (zones, probe targets): never an id
        self.ids = ids  # placement ids (wire.new_id; the simulator's draw from its seeded rng, reproducible)
        self.policy = policy or pl.RetryPolicy()
        self.lease_s = lease_s
        self.hold_s = hold_s
        self.probe_timeout_s = probe_timeout_s
        self.commit_tries = commit_tries
        self.handover_timeout_s = handover_timeout_s
        self.unconfirmed_wait_s = unconfirmed_wait_s
        self.max_rounds = max_rounds
        self.commit_first = commit_first
        self.release_unused = release_unused
        self.clock = clock
        self.sleep = sleep
        self.counts: dict[str, int] = {"placed": 0, "unconfirmed": 0, "rejected": 0, "queued-out": 0,
                                       "probe_timeouts": 0, "handover_failures": 0, "queue_waits": 0,
                                       "packing_placements": 0}

    def new_placement_id(self) -> int:
        return self.ids()

    async def place(self, demand: pl.Demand, spec: dict[str, Any], placement_id: int | None = None,
                    packing: bool = False) -> PlacementResult:
        """Place one job; see the module docstring for the outcomes. Never raises for a
        peer's misbehaviour or silence (they only cost retries).

        ``packing``: the packing placement (:meth:`_place_packing`: whole zones probed, every
        answer awaited, the least-fragmenting offer bound) instead of the hot path's ``d``
        probes and first good offer."""
        t0 = time.perf_counter()
        pid = placement_id or self.new_placement_id()
        res = PlacementResult("queued-out", pid, t0=t0, shape=pl.shape_index(demand.gpus))
        answers = self.t.expect(pid)
        try:
            if packing:
                self.counts["packing_placements"] += 1
                await self._place_packing(demand, spec, pid, answers, res)
            else:
                await self._place(demand, spec, pid, answers, res)
        finally:
            self.t.forget(pid)
            if not packing and not self.release_unused:
                # a probed node whose answer was still on its way when the placement ended may
                # hold an offer for it: the next probe there names it too (a node holding none
                # ignores the id), so it does not depend on that answer arriving in time
                for n in set(res.probed) - {res.node}:
                    self._note_unused(n, pid, self.lease_s)
            while not answers.empty():  # offers that came in after the binding
                node, body = answers.get_nowait()
                if isinstance(body, wire.Offer) and not (res.outcome != "queued-out" and node == res.node):
                    if self.release_unused:
                        self.t.send(node, wire.Release(pid))
                    else:
                        self._note_unused(node, pid, body.lease_ms / 1000)
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
            schedule = pl.retry_schedule(self.policy, rnd)
            queue = schedule[-1]
            assert isinstance(queue, pl.Queue)
            for step in schedule:
                if isinstance(step, pl.Queue):
                    break
                res.steps += 1
                if zone is None or step.zone_rank >= len(tried_zones):
                    zone = self._zone_table(demand).choose(self.rng, exclude=tried_zones)
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
                targets = self._targets(zone, demand, members, preferred, step.d, skip)
                if not targets:
                    continue
                probed_in_zone.update(targets)
                res.probed.extend(targets)
                for n in targets:
                    self.t.send(n, self._with_releases(probe, n))
                waiting = set(targets)
                done, timed_out = await self._collect(pid, answers, waiting, offers, res)
                if timed_out:
                    self.counts["probe_timeouts"] += 1
                    for n in waiting:  # silent past the timeout: a miss each
                        self.m.missed(n, self.clock())
                if not done and not offers:
                    continue
                outcome = await self._bind(pid, spec_json, answers, offers, dead_offers, res)
                if outcome:
                    self._release(pid, offers)
                    return
            self._release(pid, offers)
            if res.outcome != "queued-out":
                return
            if rnd + 1 < self.max_rounds:  # queued: wait, then start over (capacity may free up)
                self.counts["queue_waits"] += 1
                await self.sleep(queue.delay_s)
        res.reason = res.reason or "no node offered capacity within the retry budget"
        if res.outcome == "queued-out" and res.last_refusal and res.last_refusal not in res.reason:
            # e.g. every node with room refused the job (a user at jobs.max_per_user on each):
            # the generic "no fit" of the last round would hide why
            res.reason = f"{res.reason}; the last node that bound it did not start it: {res.last_refusal}"

    async def _place_packing(
        self, demand: pl.Demand, spec: dict[str, Any], pid: int, answers: asyncio.Queue[tuple[int, wire.Body]],
        res: PlacementResult,
    ) -> None:
        """The packing placement (``laminar-frag-wide`` of :mod:`laminar.sim.allocation`, on
        the agents): the zones whose summaries say they can take the demand
        (``zone_fits > 0``), lowest zone id first (an order every submitter shares), are
        taken ``packing_spread`` at a time; every member of those zones (suspects aside) is
        probed, every answer is awaited (at most ``probe_timeout_s``), and the offers bind
        in the order of :func:`laminar.policy.packing.pick_frag_offer` (FGD's quantized score
        of the fragmentation the offer adds, then the tighter fit, then the lower node id;
        an offer without a score, from a node in the ``bestfit`` mode, ranks last). No offer:
        the next ``packing_spread`` zones, for ``policy.zones`` groups; then a queue wait
        and a new round, ``max_rounds`` in all. Unused offers are handled as on the hot
        path (remembered and released by the next probe to their node, or they lapse).

        Cost: a probe and an answer per member of each zone probed, plus the hand-over: a
        mode for a saturated cluster or a batch of arrivals, not the hot path.

        The probes ask for a lease of ``lease_s + probe_timeout_s``: the first offers must
        outlive the wait for the last answer (a silent node costs the whole timeout)."""
        probe = demand_to_probe(demand, pid, self.lease_s + self.probe_timeout_s)
        spec_json = json.dumps(spec, separators=(",", ":")).encode()
        offers: list[pl.Offer] = []
        scores: dict[int, tuple[int, int] | None] = {}  # node -> its offer's wire.Offer.frag
        dead_offers: set[int] = set()
        spread = self.packing_spread
        for rnd in range(self.max_rounds):
            res.rounds = rnd + 1
            order = [z for z, f in sorted(self.zone_fits(demand).items()) if f > 0]
            if not order:
                res.reason = "no zone advertises a fit for the demand"
            for g in range(0, min(len(order), self.policy.zones * spread), spread):
                res.steps += 1
                suspects = self.m.suspects
                targets = [n for z in order[g:g + spread] for n in self.m.zone_list(z) if n not in suspects]
                if not targets:
                    continue
                res.probed.extend(targets)
                for n in targets:
                    self.t.send(n, self._with_releases(probe, n))
                waiting = set(targets)
                if await self._collect_all(answers, waiting, offers, scores, res):
                    self.counts["probe_timeouts"] += 1
                    for n in waiting:
                        self.m.missed(n, self.clock())
                if await self._bind(pid, spec_json, answers, offers, dead_offers, res,
                                    pick=lambda live: self._pick_packed(live, scores)):
                    self._release(pid, offers)
                    return
                self._release(pid, offers)
            if rnd + 1 < self.max_rounds:
                queue = pl.retry_schedule(self.policy, rnd)[-1]
                assert isinstance(queue, pl.Queue)
                self.counts["queue_waits"] += 1
                await self.sleep(queue.delay_s)
        res.reason = res.reason or "no node offered capacity within the retry budget"

    async def _collect_all(
        self, answers: asyncio.Queue[tuple[int, wire.Body]], waiting: set[int], offers: list[pl.Offer],
        scores: dict[int, tuple[int, int] | None], res: PlacementResult,
    ) -> bool:
        """Gather answers until every target answered or ``probe_timeout_s`` passed; each
        offer's score goes to ``scores``. True when the timeout passed with targets silent."""
        deadline = time.monotonic() + self.probe_timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            try:
                node, body = answers.get_nowait() if not answers.empty() else await asyncio.wait_for(answers.get(), left)
            except TimeoutError:
                return True
            if isinstance(body, wire.Offer):
                scores[node] = body.frag
            self._note_answer(node, body, waiting, offers, res)
        return False

    def _pick_packed(self, offers: list[pl.Offer], scores: dict[int, tuple[int, int] | None]) -> pl.Offer | None:
        """The live offer :func:`laminar.policy.packing.pick_frag_offer` ranks first (quantized,
        as ``laminar-frag-wide``); None when none is live."""
        now = self.clock()
        live = {o.node: o for o in offers if o.expires_at > now}
        best = pk.pick_frag_offer((frag_offer(o, scores.get(o.node)) for o in live.values()), quantized=True)
        return None if best is None else live[best.node]

    def _zone_table(self, demand: pl.Demand) -> pl.ZoneTable:
        """The zone draw for ``demand``'s fits, kept while ``zone_fits`` returns the same
        (cached) mapping: O(log zones) a placement instead of O(zones)."""
        fits = self.zone_fits(demand)
        tab = self._zone_tables.get(id(fits))
        if tab is None or tab.fits is not fits:
            if len(self._zone_tables) >= ZONE_TABLES_MAX:
                self._zone_tables.clear()
            tab = self._zone_tables[id(fits)] = pl.ZoneTable.of(fits)
        return tab

    def _targets(self, zone: int, demand: pl.Demand, members: list[int], preferred: list[int], d: int,
                 skip: set[int]) -> list[int]:
        """``d`` nodes to probe: drawn uniformly (pool members first), except that up to
        ``d // 2`` (at least one) come from the zone summary's hints for the demand's shape
        when it names any (:func:`laminar.policy.placement.hinted_nodes`). The uniform ones
        are sent first, so a hinted node takes the job mostly when they cannot."""
        summary = self.zone_summary(zone) if self.zone_summary is not None and not demand.pool else None
        raw = pl.hinted_nodes(summary, demand) if summary is not None else ()
        if not raw:
            return pl.probe_targets(members, d, self.rng, exclude=skip, preferred=preferred)
        # a node this submitter bound a job to, or that refused it this shape, since the summary
        # was issued is skipped: the summary cannot know that it filled up
        assert summary is not None
        by_node, spent, issued = self.m.by_node, self._spent, summary.issued_at
        k = pl.shape_index(demand.gpus)
        kk = k if k is not None else -2

        def eligible(n: int) -> bool:
            return (n not in skip and n in by_node and by_node[n].zone == zone
                    and spent.get((n, -1), -math.inf) < issued and spent.get((n, kk), -math.inf) < issued)

        want = min(max(1, d // 2), d)
        hinted: list[int] = []
        # uniform among the eligible hints by rejection: O(want) checks when most are eligible
        # (every placement takes this path), one pass over the hints when they are not
        for _ in range(2 * len(raw)):
            if len(hinted) >= want:
                break
            n = raw[self.rng.randrange(len(raw))]
            if n not in hinted and eligible(n):
                hinted.append(n)
        if len(hinted) < want:
            rest = [n for n in raw if n not in hinted and eligible(n)]
            hinted += self.rng.sample(rest, min(want - len(hinted), len(rest)))
        if not hinted:
            return pl.probe_targets(members, d, self.rng, exclude=skip, preferred=preferred)
        uniform = pl.probe_targets(members, d - len(hinted), self.rng, exclude=skip.union(hinted),
                                   preferred=preferred)
        return uniform + hinted

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
            if body.reason in FULL_REASONS and res.shape is not None:
                self._note_spent(node, res.shape)

    def _note_spent(self, node: int, shape: int) -> None:
        spent = self._spent
        spent.pop((node, shape), None)  # re-inserted last: the oldest entries go first
        spent[(node, shape)] = self.clock()
        if len(spent) > BOUND_MEMORY:
            del spent[next(iter(spent))]

    async def _bind(
        self, pid: int, spec_json: bytes, answers: asyncio.Queue[tuple[int, wire.Body]], offers: list[pl.Offer],
        dead_offers: set[int], res: PlacementResult, pick: Callable[[list[pl.Offer]], pl.Offer | None] | None = None,
    ) -> bool:
        """Commit offers in arrival order (or in ``pick``'s order) until one hands over. True
        when the placement is finished (placed, unconfirmed or rejected); False to go on
        with the schedule."""
        while True:
            offer = pick(offers) if pick is not None else pl.pick_offer(offers, self.clock(), margin_s=0.0)
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
            res.bind_ms = (time.perf_counter() - res.t0) * 1000
            outcome = await self._handover(pid, node, port, spec_json, res)
            if outcome is None:
                continue
            res.node, res.zone = node, offer.zone
            if res.outcome == "placed":
                res.reason = ""
                self._note_spent(node, -1)
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
        node certainly did not take the job, place it elsewhere.

        Once the spec may have reached the node (the frame was written), the job may be
        running there, so it is never placed elsewhere on a guess: the hand-over is repeated
        (it is idempotent by placement id, also across an agent restart) until the node
        answers, for at most ``unconfirmed_wait_s``. A node that answers "no reservation"
        has no job for this placement, so the job goes elsewhere; one that never answers
        leaves the placement ``unconfirmed``.
        """
        delivered = False
        deadline = time.monotonic() + self.unconfirmed_wait_s
        delay = 0.2
        while True:
            try:
                ack = await self.t.handover(node, port, wire.Handover(pid, spec_json), self.handover_timeout_s)
            except HandoverError as e:
                self.counts["handover_failures"] += 1
                log.info("zone: hand-over of placement %x to node %d failed (%s): %s", pid, node,
                         "it may have arrived" if e.delivered else "not delivered", e)
                delivered = delivered or e.delivered
                if not delivered:
                    self.m.missed(node, self.clock())
                    return None
                if time.monotonic() + delay > deadline:
                    break
                await self.sleep(delay)  # the node may have it: ask again until it answers
                delay = min(delay * 2, 5.0)
                continue
            if ack.status == HANDOVER_OK:
                res.outcome, res.job_id = "placed", ack.text
                return True
            if ack.status == HANDOVER_REJECTED:
                res.outcome, res.reason = "rejected", ack.text
                return True
            res.reason = res.last_refusal = ack.text  # no reservation, or the job failed to start: not running there
            return None
        res.outcome = "unconfirmed"
        res.reason = (f"node {node} received the hand-over and has not answered for {self.unconfirmed_wait_s:g} s; "
                      "not placed elsewhere, which could run the job twice")
        return True

    def _release(self, pid: int, offers: list[pl.Offer]) -> None:
        """Let go of the offers not bound: they lapse with their lease (with ``release_unused``,
        each is released by a datagram)."""
        if self.release_unused:
            for o in offers:
                self.t.send(o.node, wire.Release(pid))
        else:
            now = self.clock()
            for o in offers:
                self._note_unused(o.node, pid, o.expires_at - now)
        offers.clear()

    def note_late_offer(self, node: int, offer: wire.Offer) -> None:
        """An offer that came after its placement ended: released by a datagram with
        ``release_unused``, else remembered for the next probe to ``node``."""
        if self.release_unused:
            self.t.send(node, wire.Release(offer.placement_id))
        else:
            self._note_unused(node, offer.placement_id, offer.lease_ms / 1000)

    def _note_unused(self, node: int, pid: int, left_s: float) -> None:
        """Remember an offer left unused while its lease runs (bounded: BOUND_MEMORY nodes)."""
        if left_s <= 0:
            return
        held = self._unused.get(node)
        if held is not None and len(held) >= 2 * wire.MAX_PROBE_RELEASES:
            # a probe releases the last MAX_PROBE_RELEASES ids: the oldest go (they lapse)
            now = self.clock()
            for p in [p for p, t in held.items() if t <= now] or list(held)[:len(held) - wire.MAX_PROBE_RELEASES]:
                del held[p]
        if len(self._unused) >= BOUND_MEMORY and node not in self._unused:
            now = self.clock()
            for n in [n for n, m in self._unused.items() if all(t <= now for t in m.values())]:
                del self._unused[n]
            if len(self._unused) >= BOUND_MEMORY:
                return  # the offer lapses by itself
        self._unused.setdefault(node, {})[pid] = self.clock() + left_s

    def _with_releases(self, probe: wire.Probe, node: int) -> wire.Probe:
        """``probe`` carrying the releases of this submitter's unused offers at ``node`` that
        still hold capacity there (forgotten once sent)."""
        held = self._unused.pop(node, None)
        if not held:
            return probe
        now = self.clock()
        live = tuple(pid for pid, until in held.items() if until > now and pid != probe.placement_id)
        if not live:
            return probe
        return replace(probe, releases=live[-wire.MAX_PROBE_RELEASES:])


