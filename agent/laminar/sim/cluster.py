"""The simulator's model of nodes and of placing one worker on them (both placement policies).

A :class:`SimNode` keeps per-GPU free fractions (as ``laminar.policy.placement`` does), free
cores and memory, its pool, and whether it is *serving* (an inference server doing inference,
so not available to training). Two ways to place a worker:

- :class:`ProbePlacer` (Laminar): the zone layer's pure policy from
  :mod:`laminar.policy.placement`: zone drawn in proportion to its advertised fit
  (:func:`~laminar.policy.placement.zone_fit`, :func:`~laminar.policy.placement.choose_zone`),
  ``d`` probes in it (:func:`~laminar.policy.placement.probe_targets`); zones of the
  training pool first, loaned inference servers' zones only when those advertise no fit, local arbitration on
  each probed node (:func:`~laminar.policy.placement.arbitrate`), late binding
  (:func:`~laminar.policy.placement.pick_offer`) and the bounded retry schedule
  (:func:`~laminar.policy.placement.retry_schedule`). Answers reach the submitter in
  *fit order*: a node that fits the demand more tightly answers first (the sim's
  ``fit_ordered_answers`` adapter; see docs/simulator.md). The simulator is sequential, so
  no reservation is ever outstanding when a probe arrives: ``held`` is empty.
- :class:`BestFitPlacer` (centralized baseline): scans every node and takes the one left with
  the fewest free GPUs (then cores) after placing, the classic best-fit.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from laminar.policy import placement as P
from laminar.sim.trace import NodeSpec

EPS = 1e-6
_NO_ALLOC: Any = object()  # SimNode.alloc_gpus: not computed since the node last changed

SIM_RETRY = P.RetryPolicy(d=8, d_max=32, widen=2, widen_steps=2, zones=3)
"""Probe schedule of the simulated Laminar: 8 probes, widened to 16 then 32, in up to 3 zones.

Messages per placement stay O(d), whatever the cluster size; d = 8 packs the openb trace as
tightly as a central best-fit does (docs/simulator.md), d = 2 leaves 4 points of GPUs unused.
"""


@dataclass
class SimNode:
    """Mutable state of one simulated node."""

    idx: int
    spec: NodeSpec
    zone: int
    gpu_free: list[float]
    cpus: float
    memory_mb: int
    serving: bool = False
    workers: dict[int, tuple[str, P.GpuAlloc, float, int, bool]] = field(default_factory=dict)
    # worker id -> (job id, gpu alloc, cpus, memory_mb, extra)
    # What is derived from gpu_free, cpus and memory_mb, kept until take() or give() changes
    # them (_changed); capacity() is rebuilt when serving changed too.
    _cap: P.NodeCapacity | None = field(default=None, repr=False, compare=False)
    _idle: int = field(default=-1, repr=False, compare=False)
    _free: float = field(default=-1.0, repr=False, compare=False)
    _allocs: dict[float, P.GpuAlloc | None] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_spec(cls, idx: int, spec: NodeSpec, zone: int) -> SimNode:
        return cls(idx, spec, zone, [1.0] * spec.gpus, spec.cpus, spec.memory_mb)

    @property
    def pool(self) -> str:
        return self.spec.pool

    def idle_gpus(self) -> int:
        if self._idle < 0:
            self._idle = sum(1 for f in self.gpu_free if f >= 1.0 - EPS)
        return self._idle

    def free_gpu(self) -> float:
        if self._free < 0:
            self._free = sum(self.gpu_free)
        return self._free

    def alloc_gpus(self, gpus: float) -> P.GpuAlloc | None:
        """:func:`laminar.policy.placement.allocate_gpus` on this node's GPUs as they are now."""
        a = self._allocs.get(gpus, _NO_ALLOC)
        if a is _NO_ALLOC:
            a = self._allocs[gpus] = P.allocate_gpus(self.gpu_free, gpus)
        return a

    def _changed(self) -> None:
        self._cap = None
        self._idle = -1
        self._free = -1.0
        self._allocs.clear()

    def capacity(self) -> P.NodeCapacity:
        c = self._cap
        if c is not None and c.draining == self.serving:
            return c
        c = self._cap = P.NodeCapacity(
            node=self.idx,
            zone=self.zone,
            gpu_free=tuple(min(1.0, max(0.0, round(f, 6))) for f in self.gpu_free),
            cpus=max(0.0, self.cpus),
            memory_mb=max(0, self.memory_mb),
            gpu_model=self.spec.model or None,
            pool=self.pool,
            draining=self.serving,
        )
        return c

    def take(self, wid: int, job_id: str, alloc: P.GpuAlloc, cpus: float, mem: int, extra: bool) -> None:
        self._changed()
        for i, f in alloc:
            self.gpu_free[i] = round(self.gpu_free[i] - f, 6)
            if self.gpu_free[i] < -EPS:
                raise AssertionError(f"sim: node {self.spec.name} GPU {i} over-allocated")
        self.cpus -= cpus
        self.memory_mb -= mem
        self.workers[wid] = (job_id, alloc, cpus, mem, extra)

    def give(self, wid: int) -> None:
        self._changed()
        _, alloc, cpus, mem, _ = self.workers.pop(wid)
        for i, f in alloc:
            self.gpu_free[i] = min(1.0, round(self.gpu_free[i] + f, 6))
        self.cpus += cpus
        self.memory_mb += mem


def fits_fast(n: SimNode, gpus: float, cpus: float, mem: int) -> P.GpuAlloc | None:
    """Allocation for one worker on ``n`` (ignoring ``serving``), or None."""
    if cpus > n.cpus + EPS or mem > n.memory_mb:
        return None
    if gpus <= 0:
        return ()
    return n.alloc_gpus(gpus)


def demand_of(gpus: float, cpus: float, mem: int) -> P.Demand:
    """The probe's demand for one worker. GPUs go in hundredths (the zone layer's unit),
    rounded *up*: the node reserves what the offer allocates, so rounding down (0.444 to
    0.44) let shares on one GPU sum above 1."""
    return P.Demand(gpus=math.ceil(gpus * 100 - 1e-6) / 100, cpus=cpus, memory_mb=int(mem))


class BestFitPlacer:
    """Centralized best-fit over every usable node (the baseline)."""

    name = "bestfit"

    def __init__(self, nodes: Sequence[SimNode]) -> None:
        self.nodes = nodes
        self.probes = 0

    def place(self, usable: Sequence[SimNode], gpus: float, cpus: float, mem: int, now: float) -> tuple[SimNode, P.GpuAlloc] | None:
        best: tuple[bool, float, float, int] | None = None
        pick: tuple[SimNode, P.GpuAlloc] | None = None
        need_idle = int(gpus + EPS) if gpus >= 1 else 0
        for n in usable:
            self.probes += 1
            if need_idle and n.idle_gpus() < need_idle:
                continue
            a = fits_fast(n, gpus, cpus, mem)
            if a is None:
                continue
            key = (n.pool != "training", n.free_gpu() - gpus, n.cpus - cpus, n.idx)
            if best is None or key < best:
                best, pick = key, (n, a)
        return pick


class ProbePlacer:
    """Laminar's probe-first placement through :mod:`laminar.policy.placement`."""

    name = "probe"

    def __init__(
        self,
        nodes: Sequence[SimNode],
        rng: random.Random,
        retry: P.RetryPolicy | None = None,
        members: Sequence[int] | None = None,
    ) -> None:
        self.nodes = nodes
        self.rng = rng
        self.retry = retry or SIM_RETRY
        self.zones: dict[int, list[int]] = {}
        for i in members if members is not None else range(len(nodes)):
            self.zones.setdefault(nodes[i].zone, []).append(i)
        self._summary: dict[int, P.ZoneSummary] = {}
        self._dirty: set[int] = set(self.zones)
        self.probes = 0
        self.messages = 0
        self._pid = 0

    def touch(self, node: SimNode) -> None:
        """Mark a node's zone summary stale (capacity or serving state changed)."""
        self._dirty.add(node.zone)

    def summary(self, z: int) -> P.ZoneSummary:
        if z in self._dirty or z not in self._summary:
            self._summary[z] = P.summarize_zone(z, (self.nodes[i].capacity() for i in self.zones[z]))
            self._dirty.discard(z)
        return self._summary[z]

    def place(self, usable: Sequence[SimNode], gpus: float, cpus: float, mem: int, now: float) -> tuple[SimNode, P.GpuAlloc] | None:
        demand = demand_of(gpus, cpus, mem)
        every = {z: P.zone_fit(self.summary(z), demand) for z in self.zones}
        own = {z: f for z, f in every.items() if self.nodes[self.zones[z][0]].pool == "training"}
        # Loaned servers' zones only once the training pool's zones advertise no (more) fit.
        fitmap = own if any(f > 0 for f in own.values()) else every
        tried: list[int] = []
        zone: int | None = None
        probed: set[int] = set()
        for step in P.retry_schedule(self.retry):
            if isinstance(step, P.Queue):
                return None
            if step.zone_rank >= len(tried):
                zone = P.choose_zone(fitmap, self.rng, exclude=tried)
                if zone is None and fitmap is not every:
                    fitmap = every
                    zone = P.choose_zone(fitmap, self.rng, exclude=tried)
                if zone is None:
                    return None
                tried.append(zone)
                probed = set()
            assert zone is not None
            targets = P.probe_targets(self.zones[zone], step.d, self.rng, exclude=probed)
            probed.update(targets)
            self._pid += 1
            answers = [
                P.arbitrate(self.nodes[t].capacity(), [], demand, now, placement_id=self._pid, lease_s=2.0)
                for t in targets
            ]
            self.probes += len(targets)
            offer = P.pick_offer(fit_ordered_answers(answers, self.nodes, gpus), now)
            if offer is not None:
                self.messages += P.max_messages_per_attempt(len(targets))
                return self.nodes[offer.node], offer.gpu_alloc
            self.messages += 2 * len(targets)
        return None


def fit_ordered_answers(answers: Sequence[P.Offer | P.Refusal], nodes: Sequence[SimNode], gpus: float) -> list[P.Offer | P.Refusal]:
    """Adapter (sim side): answers in the order a fit-delayed reply would deliver them.

    A node that would be left with fewer free GPUs (a tighter fit) answers first; refusals
    last. ``laminar.policy.placement.pick_offer`` then binds the first, as it does in the agent.
    """
    def key(a: P.Offer | P.Refusal) -> tuple[int, float, int]:
        if isinstance(a, P.Refusal):
            return (1, math.inf, a.node)
        n = nodes[a.node]
        return (0, n.free_gpu() - gpus, a.node)

    return sorted(answers, key=key)
