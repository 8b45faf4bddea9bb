"""The submitter side of a gang placement: :class:`GangPlacer` places the ``k`` members of a
multi-node job all-or-nothing through the zone's probes (issue 33; the pure decisions are in
:mod:`laminar.policy.gang`).

It talks through the same :class:`laminar.zone.submitter.Transport` as the one-node
:class:`laminar.zone.submitter.Submitter` (real UDP/TCP in the agent,
:class:`laminar.zone.simnet.SimNet` in the benchmark), with the same messages: ``Probe``,
``Offer``/``Refuse``, ``Commit``/``CommitAck``, ``Release``, ``Handover``/``HandoverAck``.

One placement, one placement id, every step of it:

1. Zone(s) by the summaries' fit for ``k`` workers (:func:`laminar.policy.gang.choose_zones`;
   several zones only with ``spread_zones``).
2. Probe ``d * k`` distinct nodes with that one id; each node arbitrates alone and holds its
   own tentative offer under a lease that covers the wait for the answers and the commits.
3. The first ``k`` offers on distinct nodes (:func:`laminar.policy.gang.pick_gang`) are bound:
   every other offer is released at once (``Release``), and the ``k`` get a ``Commit`` (a
   hold covering the hand-overs). No ``k`` offers within the probe timeout: everything held is
   released and the next step probes wider.
4. Every ``CommitAck`` positive: member 0 is handed over first (it hosts the rendezvous), then
   the others concurrently; each hand-over's spec is ``build(nodes)[i]``. A commit refused or
   silent: the committed ones are released at once and the next step probes wider. A
   hand-over that fails after others started: ``undo(started nodes)`` stops them, the rest is
   released, and the next step goes on.
5. After the steps of a round, a queue wait, then a new round; ``max_rounds`` rounds in all,
   then ``queued-out``.

What it never does: start a partial gang (no member is handed over before all ``k`` commits
are acknowledged, and a failed hand-over undoes the started ones); keep a reservation past
its lease or hold (the nodes drop them; the placer releases them sooner); wait on anything
while it holds reservations except the bounded answers to its own messages, so two gangs
competing for the same nodes never wait on each other: one that cannot get ``k`` lets go
of everything at once and tries again wider or later.

Outcomes (:class:`GangResult`): ``placed``; ``rejected`` (a node refused the member's spec
itself: every node would); ``unconfirmed`` (a member's hand-over may have reached a node that
never answered: the members are stopped, ``undo``, and the gang is not placed elsewhere on a
guess, as :class:`~laminar.zone.submitter.Submitter` does for one node); ``queued-out``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.policy import gang
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.arbiter import HANDOVER_OK, HANDOVER_REJECTED, LEASE_S, ZONE_TABLES_MAX, demand_to_probe
from laminar.zone.membership import Membership
from laminar.zone.submitter import HandoverError, Transport

log = logging.getLogger("laminar.zone")


@dataclass
class GangResult:
    """What became of one gang placement (``outcome``: placed, queued-out, rejected, unconfirmed).

    ``nodes`` are the members' nodes in member order (empty unless placed), ``zones`` the zone
    of each. ``sent`` and ``received`` count this placement's messages as the placer sees them
    (probes, commits, releases, hand-overs; answers, acks, hand-over acks)."""

    outcome: str
    placement_id: int
    k: int
    nodes: list[int] = field(default_factory=list)
    zones: list[int] = field(default_factory=list)
    members: list[tuple[int, str]] = field(default_factory=list)  # (node, address) in member order
    probed: list[int] = field(default_factory=list)
    rounds: int = 0
    steps: int = 0
    sent: int = 0
    received: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    commit_failures: int = 0
    reason: str = ""
    elapsed_ms: float = 0.0  # start to every member handed over, in ms
    bind_ms: float = 0.0  # start to every commit acknowledged (the gang decided), in ms
    offers_ms: float = 0.0  # start to the k offers in hand (the last step's probes answered), in ms

    @property
    def messages(self) -> int:
        return self.sent + self.received

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome, "placement_id": f"{self.placement_id:016x}", "k": self.k,
            "nodes": self.nodes, "zones": self.zones, "members": [list(m) for m in self.members],
            "probed": self.probed, "rounds": self.rounds, "steps": self.steps, "sent": self.sent,
            "received": self.received, "messages": self.messages, "refusals": self.refusals,
            "commit_failures": self.commit_failures, "reason": self.reason,
            "elapsed_ms": round(self.elapsed_ms, 3), "bind_ms": round(self.bind_ms, 3),
            "offers_ms": round(self.offers_ms, 3),
        }


Build = Callable[[list[int]], list[bytes]]
Undo = Callable[[list[int]], Awaitable[None]]


class _Retry(Exception):
    """This step failed after binding: release, go on with the next step (``nodes``: the
    nodes that failed it, not probed again for this placement)."""

    def __init__(self, nodes: list[int]) -> None:
        super().__init__(f"nodes {nodes}")
        self.nodes = nodes


class GangPlacer:
    """Places gangs through a transport with :mod:`laminar.policy.gang`.

    ``zone_fits(demand)``: the advertised fit per zone (as for the Submitter).
    ``probe_timeout_s``: the wait for ``k`` offers; ``commit_timeout_s`` per commit try
    (``commit_tries`` tries, the silent ones resent); ``hold_s``: the committed hold, which
    covers the hand-overs; ``max_rounds``: queue cycles before ``queued-out``.
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
        commit_timeout_s: float = 0.25,
        commit_tries: int = 2,
        handover_timeout_s: float = 10.0,
        unconfirmed_wait_s: float = 60.0,
        max_rounds: int = 3,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = asyncio.sleep,
        ids: Callable[[], int] = wire.new_id,
        zone_summary: Callable[[int], pl.ZoneSummary | None] | None = None,
    ) -> None:
        self.t = transport
        self.zone_summary = zone_summary
        # (id(fits), k) -> the draw among the zones whose fit holds k, kept while zone_fits
        # returns the same (cached) mapping: O(log zones) a gang instead of O(zones)
        self._zone_tables: dict[tuple[int, int], tuple[dict[int, float], pl.ZoneTable]] = {}
        self.m = membership
        self.zone_fits = zone_fits
        self.rng = rng or random.Random()
        self.policy = policy or pl.RetryPolicy()
        self.hold_s = hold_s
        self.probe_timeout_s = probe_timeout_s
        self.commit_timeout_s = commit_timeout_s
        self.commit_tries = max(1, commit_tries)
        self.lease_s = gang.probe_lease_s(lease_s, probe_timeout_s, commit_timeout_s, self.commit_tries)
        self.handover_timeout_s = handover_timeout_s
        self.unconfirmed_wait_s = unconfirmed_wait_s
        self.max_rounds = max_rounds
        self.clock = clock
        self.sleep = sleep
        self.ids = ids
        self.counts: dict[str, int] = {"placed": 0, "queued-out": 0, "rejected": 0, "unconfirmed": 0,
                                       "commit_failures": 0, "handover_failures": 0, "undone": 0,
                                       "late_releases": 0}

    # -- the public side -------------------------------------------------------------------

    async def place(self, demand: pl.Demand, k: int, build: Build, *, spread_zones: bool = False,
                    placement_id: int | None = None, undo: Undo | None = None) -> GangResult:
        """Place ``k`` members of ``demand`` all-or-nothing (see the module docstring). Raises
        :class:`~laminar.policy.placement.PlacementError` for a bad ``k``; never for a peer's
        misbehaviour or silence (they cost retries)."""
        gang.check_k(k)
        t0 = time.perf_counter()
        pid = placement_id or self.ids()
        res = GangResult("queued-out", pid, k)
        answers = self.t.expect(pid)
        held: dict[int, pl.Offer] = {}  # node -> its offer (tentative or committed) we still hold
        try:
            await self._place(demand, k, build, spread_zones, undo, pid, answers, held, res, t0)
        finally:
            # whatever is still held goes now (an exception, a cancelled task), and every offer
            # that came in after the binding
            self._release(pid, list(held), res)
            held.clear()
            while not answers.empty():
                node, body = answers.get_nowait()
                res.received += 1
                if isinstance(body, wire.Offer) and node not in res.nodes:
                    self._send(node, wire.Release(pid), res)
            self.t.forget(pid)
            res.elapsed_ms = (time.perf_counter() - t0) * 1000
            self.counts[res.outcome] = self.counts.get(res.outcome, 0) + 1
        return res

    def note_late_offer(self, node: int, offer: wire.Offer) -> None:
        """An offer that came after its placement ended (the transport's late-offer hook):
        released at once (a gang's lease is longer than a one-node placement's)."""
        self.counts["late_releases"] += 1
        self.t.send(node, wire.Release(offer.placement_id))

    # -- the steps --------------------------------------------------------------------------

    async def _place(self, demand: pl.Demand, k: int, build: Build, spread: bool, undo: Undo | None, pid: int,
                     answers: asyncio.Queue[tuple[int, wire.Body]], held: dict[int, pl.Offer], res: GangResult,
                     t0: float) -> None:
        probe = demand_to_probe(demand, pid, self.lease_s)
        # nodes never probed again for this placement: those that failed a commit or a
        # hand-over (a repeated hand-over with the same placement id would find a stopped
        # member's job there)
        barred: set[int] = set()
        for rnd in range(self.max_rounds):
            res.rounds = rnd + 1
            # nodes not probed again in this round: those barred, and those that refused or
            # stayed silent. A node whose offer was released (it was not needed, or another
            # member's commit failed) is probed again in a later step: it may still have the
            # room. After the queue wait a node that refused is probed again: a refusal is often
            # another gang's lease, let go of since (nodes the membership suspects stay skipped).
            avoid = set(barred)
            schedule = gang.steps(self.policy, rnd)
            tried: list[int] = []
            plan: gang.ZonePlan | None = None
            rank = -1
            for step in schedule:
                if isinstance(step, pl.Queue):
                    break
                res.steps += 1
                if plan is None or step.zone_rank != rank:
                    rank = step.zone_rank
                    plan = self._plan(demand, k, spread, tried)
                    if plan is None:
                        res.reason = (f"no zone advertises a fit for {k} workers" if not spread else
                                      f"the zones together advertise no fit for {k} workers")
                        break
                    tried.extend(z for z, _ in plan)
                targets: list[int] = []
                skip = avoid | self.m.suspects if self.m.suspects else avoid
                for zone, count in plan:
                    members = self.m.zone_list(zone)
                    n = gang.probe_count(step.d, count, len(members))
                    targets += self._targets(zone, demand, members, n, skip.union(targets))
                if len(targets) < k:
                    continue  # the zone(s) have fewer fresh nodes than workers: a wider plan next
                res.probed.extend(targets)
                for n in targets:
                    self._send(n, probe, res)
                offers = await self._collect(answers, set(targets), k, held, avoid, res)
                chosen = gang.pick_gang(offers, k, self.clock())
                res.offers_ms = (time.perf_counter() - t0) * 1000
                if chosen is None:
                    self._release(pid, list(held), res)
                    held.clear()
                    continue
                spare = [o.node for o in gang.unused(offers, chosen)]
                self._release(pid, spare, res)  # at once: a competing gang may need them
                for n in spare:
                    held.pop(n, None)
                try:
                    ports = await self._commit(pid, [o.node for o in chosen], answers, held, res)
                    res.bind_ms = (time.perf_counter() - t0) * 1000
                    nodes = [o.node for o in chosen]
                    # offers that came in since the choice (a straggler of an earlier step) go now
                    self._release(pid, [n for n in held if n not in nodes], res)
                    for n in [n for n in held if n not in nodes]:
                        del held[n]
                    if await self._handover_all(pid, nodes, ports, build, undo, held, res):
                        res.nodes = nodes
                        res.zones = [o.zone for o in chosen]
                        res.members = [(n, self.m.by_node[n].addr) for n in nodes]
                        held.clear()  # bound: each node's reservation is its member now
                    return  # placed, or rejected/unconfirmed (final: _handover_all let go of the rest)
                except _Retry as e:
                    avoid.update(e.nodes)
                    barred.update(e.nodes)
                    self._release(pid, list(held), res)
                    held.clear()
                    continue
            if rnd + 1 < self.max_rounds:
                queue = schedule[-1]
                assert isinstance(queue, pl.Queue)
                await self.sleep(queue.delay_s)
        res.reason = res.reason or f"no {k} nodes offered capacity together within the retry budget"

    def _plan(self, demand: pl.Demand, k: int, spread: bool, tried: list[int]) -> gang.ZonePlan | None:
        """:func:`laminar.policy.gang.choose_zones` for the current fits; its first draw (no zone
        tried yet) from a cached :class:`~laminar.policy.placement.ZoneTable` of the zones whose
        fit holds ``k`` (the same zone for the same ``rng`` state)."""
        fits = self.zone_fits(demand)
        if tried:
            return gang.choose_zones(fits, k, self.rng, spread=spread, exclude=tried)
        gang.check_k(k)
        got = self._zone_tables.get((id(fits), k))
        if got is None or got[0] is not fits:
            if len(self._zone_tables) >= ZONE_TABLES_MAX:
                self._zone_tables.clear()
            got = self._zone_tables[(id(fits), k)] = (fits, pl.ZoneTable.of(gang.whole_fits(fits, k)))
        zone = got[1].choose(self.rng)
        if zone is not None:
            return ((zone, k),)
        return gang.choose_zones(fits, k, self.rng, spread=True) if spread else None

    def _targets(self, zone: int, demand: pl.Demand, members: list[int], n: int, skip: set[int]) -> list[int]:
        """``n`` distinct nodes of ``zone`` to probe: up to half of them among the nodes the
        zone's summary names as having had room for the demand's shape
        (:func:`laminar.policy.gang.hinted_targets`), the rest drawn uniformly."""
        summary = self.zone_summary(zone) if self.zone_summary is not None else None
        hinted = gang.hinted_targets(summary, demand, n, self.rng, skip) if summary is not None else []
        if not hinted:
            return pl.probe_targets(members, n, self.rng, exclude=skip)
        return pl.probe_targets(members, n - len(hinted), self.rng, exclude=skip.union(hinted)) + hinted

    async def _collect(self, answers: asyncio.Queue[tuple[int, wire.Body]], waiting: set[int], k: int,
                       held: dict[int, pl.Offer], avoid: set[int], res: GangResult) -> list[pl.Offer]:
        """Gather answers until ``k`` offers are in hand, every target answered, or the probe
        timeout passed (the silent ones get a miss each). Returns the offers in arrival order;
        the nodes that refused, or stayed silent past the timeout, go to ``avoid``."""
        offers: list[pl.Offer] = []
        deadline = time.monotonic() + self.probe_timeout_s
        while waiting and len(offers) < k:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                node, body = answers.get_nowait() if not answers.empty() else await asyncio.wait_for(answers.get(), left)
            except TimeoutError:
                break
            res.received += 1
            if isinstance(body, wire.CommitAck):
                continue  # a straggler of an earlier step's commit (that step released it)
            o = self._note(node, body, res, held)
            if o is not None and node in waiting:
                offers.append(o)
            elif isinstance(body, wire.Refuse):
                avoid.add(node)
            waiting.discard(node)
        if waiting and len(offers) < k:
            now = self.clock()
            for n in waiting:
                self.m.missed(n, now)
            avoid.update(waiting)
        return offers

    def _note(self, node: int, body: wire.Body, res: GangResult, held: dict[int, pl.Offer]) -> pl.Offer | None:
        """Record an answer; an offer is held (to be bound or released) and returned."""
        if isinstance(body, wire.Offer):
            m = self.m.by_node.get(node)
            if m is None:
                return None
            alloc = tuple((i, c / 100) for i, c in body.gpu_alloc)
            r = pl.Reservation(body.placement_id, pl.Demand(), alloc, self.clock() + body.lease_ms / 1000)
            o = pl.Offer(node, m.zone, m.pool or None, r)
            held[node] = o
            return o
        if isinstance(body, wire.Refuse):
            try:
                why = pl.RefuseReason(body.reason).name.lower()
            except ValueError:
                why = f"reason_{body.reason}"
            res.refusals[why] = res.refusals.get(why, 0) + 1
        return None

    async def _commit(self, pid: int, nodes: list[int], answers: asyncio.Queue[tuple[int, wire.Body]],
                      held: dict[int, pl.Offer], res: GangResult) -> dict[int, int]:
        """Commit every node of ``nodes``; returns node -> hand-over port when all acknowledged.

        A refusal: everything held (the committed ones and those not answered yet) is released
        at once, then the acknowledgements still on their way are awaited within the same
        try's timeout and dropped (so none is taken for a later step's), and :class:`_Retry`
        is raised. A node silent through every try: the same, its release included (it may
        have committed)."""
        body = wire.Commit(pid, int(self.hold_s * 1000))
        ports: dict[int, int] = {}
        pending = set(nodes)
        refused: list[int] = []
        for _ in range(self.commit_tries):
            for n in sorted(pending):
                self._send(n, body, res)
            deadline = time.monotonic() + self.commit_timeout_s
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    n, b = answers.get_nowait() if not answers.empty() else await asyncio.wait_for(answers.get(), left)
                except TimeoutError:
                    break
                res.received += 1
                if isinstance(b, wire.CommitAck) and n in pending:
                    pending.discard(n)
                    if refused:
                        continue  # released already
                    if b.status != 0:
                        held.pop(n, None)  # it holds nothing for us
                        refused.append(n)
                        res.commit_failures += 1
                        self.counts["commit_failures"] += 1
                        try:
                            why = pl.RefuseReason(b.status).name.lower()
                        except ValueError:
                            why = f"reason_{b.status}"
                        res.refusals[f"commit_{why}"] = res.refusals.get(f"commit_{why}", 0) + 1
                        self._release(pid, list(held), res)  # at once: a competing gang may need them
                        held.clear()
                        continue
                    ports[n] = b.port or self.m.by_node[n].handover_port
                elif isinstance(b, wire.Offer) and n not in nodes:
                    self._send(n, wire.Release(pid), res)  # a late offer: not needed
                elif not isinstance(b, wire.CommitAck):
                    self._note(n, b, res, {})
            if refused:
                raise _Retry(refused)
            if not pending:
                return ports
        now = self.clock()
        for n in pending:
            self.m.missed(n, now)
        res.commit_failures += 1
        self.counts["commit_failures"] += 1
        res.refusals["commit_silent"] = res.refusals.get("commit_silent", 0) + len(pending)
        raise _Retry(sorted(pending))

    async def _handover_all(self, pid: int, nodes: list[int], ports: dict[int, int], build: Build,
                            undo: Undo | None, held: dict[int, pl.Offer], res: GangResult) -> bool:
        """Hand every member over (member 0 first, then the others concurrently). True: placed.
        False: finished otherwise (``rejected`` or ``unconfirmed``). Raises :class:`_Retry`
        when a member certainly did not start. Either way, on failure the started members are
        undone (``undo``), the committed ones not handed over are released, and ``held`` is
        emptied."""
        specs = build(list(nodes))
        if len(specs) != len(nodes):
            raise ValueError(f"gang: build returned {len(specs)} specs for {len(nodes)} members")
        outcomes: list[str | None] = [None] * len(nodes)
        first = await self._handover(pid, nodes[0], ports[nodes[0]], specs[0], res)
        outcomes[0] = first
        if first == "ok":
            rest = await asyncio.gather(*(self._handover(pid, n, ports[n], s, res)
                                          for n, s in zip(nodes[1:], specs[1:], strict=True)))
            outcomes[1:] = rest
        if all(o == "ok" for o in outcomes):
            res.outcome, res.reason = "placed", ""
            return True
        started = [n for n, o in zip(nodes, outcomes, strict=True) if o in ("ok", "unknown")]
        self._release(pid, [n for n in nodes if n not in started], res)  # committed, never handed over
        held.clear()
        if started and undo is not None:
            self.counts["undone"] += 1
            try:
                await undo(started)
            except Exception as e:  # noqa: BLE001 - the undo is the caller's; its failure is reported
                log.warning("zone: gang %x: stopping members %s after a failed hand-over failed: %s", pid, started, e)
                res.reason = f"stopping the started members {started} failed: {e}"
        if "rejected" in outcomes:
            res.outcome = "rejected"
            return False
        if "unknown" in outcomes:
            res.outcome = "unconfirmed"
            return False
        # the nodes that failed, and those whose member was started and stopped: the agent finds a
        # repeated hand-over's job by its placement id, so one of them is not chosen again
        raise _Retry([n for n, o in zip(nodes, outcomes, strict=True) if o is not None])

    async def _handover(self, pid: int, node: int, port: int, spec: bytes, res: GangResult) -> str | None:
        """One member's hand-over: ``"ok"``, ``"rejected"``, ``"failed"`` (it surely did not
        start: no reservation, or it failed to start) or ``"unknown"`` (it may have reached
        the node, which never answered within ``unconfirmed_wait_s``; repeated until then, as
        a hand-over is idempotent by placement id). None only for a member not tried."""
        delivered = False
        deadline = time.monotonic() + self.unconfirmed_wait_s
        delay = 0.2
        while True:
            self._count_sent(res)
            try:
                ack = await self.t.handover(node, port, wire.Handover(pid, spec), self.handover_timeout_s)
            except HandoverError as e:
                self.counts["handover_failures"] += 1
                delivered = delivered or e.delivered
                if not delivered:
                    self.m.missed(node, self.clock())
                    res.reason = f"hand-over to node {node} failed: {e}"
                    return "failed"
                if time.monotonic() + delay > deadline:
                    res.reason = (f"node {node} received a member's hand-over and has not answered for "
                                  f"{self.unconfirmed_wait_s:g} s")
                    return "unknown"
                await self.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            res.received += 1
            if ack.status == HANDOVER_OK:
                return "ok"
            res.reason = f"node {node}: {ack.text}"
            return "rejected" if ack.status == HANDOVER_REJECTED else "failed"

    # -- sending ----------------------------------------------------------------------------

    def _count_sent(self, res: GangResult) -> None:
        res.sent += 1

    def _send(self, node: int, body: wire.Body, res: GangResult) -> None:
        res.sent += 1
        self.t.send(node, body)

    def _release(self, pid: int, nodes: list[int], res: GangResult) -> None:
        """Release each node's reservation for ``pid`` at once (one datagram each)."""
        body = wire.Release(pid)
        for n in nodes:
            self._send(n, body, res)
