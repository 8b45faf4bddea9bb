"""Destination choice: where a job goes when its node is reclaimed.

The zone probes answer with candidates (node, zone, rack, free resources, path bandwidth from
the source, and the candidate's own survival probability over the horizon the probe asked
for, or its provider so the caller's hazard models can compute it). :func:`rank` turns them
into an ordered list with the reasons for each place:

* **resource fit**: GPUs, memory and CPUs the job needs must be free, else the candidate is
  infeasible;
* **notice-window feasibility**: ``checkpoint bytes / path bandwidth`` must fit the usable
  part of the window (``NOTICE_MARGIN``), else infeasible (unless the job's checkpoint is
  already prestaged there, which the caller says with ``prestaged_on``);
* **survival**: the probability the candidate is not itself reclaimed during the job's
  expected remaining time; a job moved to a node that departs soon moves again;
* **topology**: the same rack, then the same zone, are cheaper (bandwidth is usually in the
  path figure already; cross-zone moves also pay ``cross_zone_penalty_s``).

The score is the expected seconds the job loses by going there:
``transfer_s + topology penalty + (1 - survival) * (transfer_s + restart_s + half the remaining
time's exposure)``, lower is better; the cost of a later departure is an estimate of moving
again plus, on average, half the work between checkpoints. Pure: no I/O, no clock.

Example::

    ranked = rank(MoveRequest("j1", Resources(1, 8 << 30, 4), ckpt_bytes=4e9, remaining_s=7200,
                              window_s=60, src_node="a", src_zone="z1", src_rack="r1"), candidates)
    best = next((r for r in ranked if r.feasible), None)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from laminar.policy.ckpt_schedule import NOTICE_MARGIN
from laminar.policy.hazard import HazardModel

CROSS_ZONE_PENALTY_S = 30.0  # handover through another zone's agents, colder caches, egress
CROSS_RACK_PENALTY_S = 2.0  # a tie-break: spine hops add latency and share oversubscribed links
RESTART_S = 20.0  # typical process start + checkpoint load for a training job


class DestinationError(ValueError):
    """Bad input to destination choice; the message names the value and what would be right."""


@dataclass(frozen=True)
class Resources:
    gpus: int = 0
    mem_bytes: int = 0
    cpus: float = 0.0

    def fits_in(self, free: Resources) -> list[str]:
        """What does not fit in ``free`` (empty when everything does)."""
        short = []
        if self.gpus > free.gpus:
            short.append(f"needs {self.gpus} GPUs, {free.gpus} free")
        if self.mem_bytes > free.mem_bytes:
            short.append(f"needs {self.mem_bytes / 2**30:.1f} GiB, {free.mem_bytes / 2**30:.1f} GiB free")
        if self.cpus > free.cpus:
            short.append(f"needs {self.cpus:g} CPUs, {free.cpus:g} free")
        return short


@dataclass(frozen=True)
class Candidate:
    """One node that answered a probe. ``survival`` is its probability of not being reclaimed
    over the horizon asked for (None: compute it from ``provider``'s hazard model)."""

    node: str
    zone: str
    rack: str
    free: Resources
    path_bps: float  # bytes/s from the source along the path (probe estimate)
    survival: float | None = None
    provider: str = "default"

    def __post_init__(self) -> None:
        if not (isinstance(self.path_bps, (int, float)) and 0 < self.path_bps < math.inf):
            raise DestinationError(f"destination: {self.node}: path_bps must be a finite number > 0, got {self.path_bps!r}")
        if self.survival is not None and not 0.0 <= self.survival <= 1.0:
            raise DestinationError(f"destination: {self.node}: survival must be in 0..1, got {self.survival!r}")


@dataclass(frozen=True)
class MoveRequest:
    job_id: str
    need: Resources
    ckpt_bytes: float
    remaining_s: float  # expected run time left
    window_s: float | None  # notice window left; None: no deadline (e.g. a planned move)
    src_node: str
    src_zone: str
    src_rack: str
    prestaged_on: frozenset[str] = field(default_factory=frozenset)  # nodes that hold its last checkpoint

    def __post_init__(self) -> None:
        for name in ("ckpt_bytes", "remaining_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < math.inf:
                raise DestinationError(f"destination: job {self.job_id}: {name} must be a finite number >= 0, got {v!r}")
        w = self.window_s
        if w is not None and (not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w < math.inf):
            raise DestinationError(f"destination: job {self.job_id}: window_s must be a finite number >= 0 or None "
                                   f"(no deadline), got {w!r}")


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    feasible: bool
    expected_loss_s: float  # the score; lower is better (inf when infeasible)
    survival: float
    transfer_s: float
    reasons: tuple[str, ...]


def rank(
    req: MoveRequest,
    candidates: Sequence[Candidate],
    hazards: Mapping[str, HazardModel] | None = None,
    now: float | None = None,
    margin: float = NOTICE_MARGIN,
    restart_s: float = RESTART_S,
) -> list[Ranked]:
    """Every candidate, feasible ones first by expected loss (ties: node name), then the
    infeasible ones with the reasons. A candidate without ``survival`` needs its provider in
    ``hazards`` and ``now``; else DestinationError names the node."""
    out: list[Ranked] = []
    for c in candidates:
        reasons: list[str] = []
        feasible = True
        if c.node == req.src_node:
            out.append(Ranked(c, False, math.inf, 0.0, 0.0, ("is the node being reclaimed",)))
            continue
        short = req.need.fits_in(c.free)
        if short:
            feasible = False
            reasons.extend(short)
        surv = _survival(c, req.remaining_s, hazards, now)
        prestaged = c.node in req.prestaged_on
        transfer_s = 0.0 if prestaged else req.ckpt_bytes / c.path_bps
        if prestaged:
            reasons.append("checkpoint already prestaged here")
        elif req.window_s is not None:
            usable = req.window_s * margin
            if transfer_s > usable:
                feasible = False
                reasons.append(f"transfer {transfer_s:.1f}s does not fit the window ({usable:.1f}s usable of {req.window_s:.1f}s)")
            else:
                reasons.append(f"transfer {transfer_s:.1f}s fits the window ({usable:.1f}s usable)")
        if c.zone != req.src_zone:
            topo = CROSS_ZONE_PENALTY_S
            reasons.append(f"other zone (+{topo:.0f}s)")
        elif c.rack != req.src_rack:
            topo = CROSS_RACK_PENALTY_S
            reasons.append(f"same zone, other rack (+{topo:.0f}s)")
        else:
            topo = 0.0
            reasons.append("same rack")
        reasons.append(f"survival {surv:.3f} over {req.remaining_s:.0f}s")
        # A later departure costs another move plus, on average, half the remaining time's
        # exposure at risk between checkpoints (bounded by the interval, approximated by half).
        later = (1.0 - surv) * (transfer_s + restart_s + 0.5 * min(req.remaining_s, 3600.0))
        loss = transfer_s + topo + later if feasible else math.inf
        out.append(Ranked(c, feasible, loss, surv, transfer_s, tuple(reasons)))
    out.sort(key=lambda r: (not r.feasible, r.expected_loss_s, r.candidate.node))
    return out


def _survival(c: Candidate, horizon_s: float, hazards: Mapping[str, HazardModel] | None, now: float | None) -> float:
    if c.survival is not None:
        return c.survival
    if hazards is None or now is None or c.provider not in hazards:
        raise DestinationError(
            f"destination: {c.node} reports no survival and provider {c.provider!r} has no hazard model "
            f"(known: {sorted(hazards or {})})"
        )
    return hazards[c.provider].survival(now, horizon_s)
