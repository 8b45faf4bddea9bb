"""Checkpoint schedule per job: when to ask a job for a checkpoint, given the node's hazard.

The base is Young/Daly: with checkpoint cost ``C`` (seconds the checkpoint costs the job) and
mean time between failures ``M``, the interval that minimises expected lost work plus
overhead is ``sqrt(2 C M)`` (Young 1974), refined by Daly (2006) to
``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` for ``C < 2M`` and ``M`` otherwise.
Here ``M`` is not a constant: it is the inverse of the hazard's *average* rate over the
interval being chosen, so the interval solves the fixed point
``tau = daly(C, 1 / mean_rate(now, now + tau))``: it shrinks ahead of the hours a provider
takes nodes back and stretches in quiet ones.

The cost ``C`` is what one checkpoint takes: a fixed pause (quiesce, serialise), the local
write (``size / write_bps``) and, when the job's checkpoints must be shipped off the node to be
of use (see *prestaging* below), the transfer at the share of the uplink the job gets while
co-resident jobs checkpoint too. That share is a fixed point as well: job ``i`` transfers a
fraction ``d_i / tau_i`` of the time (at most all of it: 1), so another job sees on average
``1 + sum_j!=i min(1, d_j/tau_j)`` transfers sharing the link, and each ``d_i`` depends on its
share. On a link the prestaged jobs oversubscribe, each gets at least an equal share.

**Notice window.** When a reclaim is announced with a window of ``W`` seconds, every job on
the node must write a final checkpoint and move it before the window closes, through the same
uplink. :func:`notice_fit` packs the jobs into the window (smallest transfer first, which fits
the most jobs) with a safety margin; a job that does not fit is *prestaged*: each periodic
checkpoint is shipped to a standby destination as soon as it is written (an early checkpoint
and transfer, ahead of any notice), its cost includes that transfer, and in a reclaim it
resumes from the last shipped checkpoint instead of a final one.

**Staggering.** :func:`stagger` orders the checkpoints that fall due close together so their
transfers do not overlap: the earliest due goes first, each next one starts when the previous
one's transfer ends, and none is delayed by more than ``max_delay_s``.

Pure functions only; the agent and the simulator (bench/workloss.py) call the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from laminar.policy import prestage as rule


class Hazard(Protocol):
    """What the scheduler asks of a hazard (HazardModel, HazardSum)."""

    def mtbf_s(self, ts: float, horizon_s: float = 0.0) -> float: ...

# Bounds on an interval: checkpointing more often than every 30 s costs more than it saves on
# any real job; beyond 6 h the hazard estimate at the end of the interval is a guess.
MIN_INTERVAL_S = 30.0
MAX_INTERVAL_S = 6 * 3600.0
# Use only this fraction of a notice window for planned transfers: rates vary and the
# kill-switch closes the window hard.
NOTICE_MARGIN = 0.8


class ScheduleError(ValueError):
    """Bad input to the checkpoint scheduler; the message names the value and what is right."""


@dataclass(frozen=True)
class CkptJob:
    """What the scheduler needs to know about one job's checkpoints.

    ``size_bytes``: bytes of one checkpoint; ``write_bps``: local write rate (bytes/s);
    ``pause_s``: fixed cost of a checkpoint besides the write (quiesce, serialise)."""

    job_id: str
    size_bytes: float
    write_bps: float = 1e9
    pause_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ScheduleError("ckpt: job_id must be a non-empty string")
        for name in ("size_bytes", "write_bps", "pause_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ScheduleError(f"ckpt: job {self.job_id}: {name} must be a finite number >= 0, got {v!r}")
        if self.write_bps == 0:
            raise ScheduleError(f"ckpt: job {self.job_id}: write_bps must be > 0, got 0")

    @property
    def write_s(self) -> float:
        return self.pause_s + self.size_bytes / self.write_bps


@dataclass(frozen=True)
class CkptPlan:
    """The scheduler's answer for one job."""

    job_id: str
    interval_s: float  # time between checkpoints
    cost_s: float  # C used for the interval (pause + write [+ transfer at share if prestaged])
    share_bps: float  # uplink bandwidth this job's transfers get, on average
    transfer_s: float  # size / share_bps
    prestage: bool  # ship each checkpoint off-node at once: the final one would not fit the window
    mtbf_s: float  # 1 / mean hazard over the interval
    reason: str


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)``."""
    _check_nonneg("cost_s", cost_s)
    _check_pos("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum; ``M`` when ``C >= 2M``; ``inf`` when ``M`` is infinite."""
    _check_nonneg("cost_s", cost_s)
    _check_pos("mtbf_s", mtbf_s)
    if math.isinf(mtbf_s):
        return math.inf
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    r = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - cost_s


def hazard_interval(
    cost_s: float,
    hazard: Hazard,
    now: float,
    min_interval_s: float = MIN_INTERVAL_S,
    max_interval_s: float = MAX_INTERVAL_S,
    rollback_frac: float = 1.0,
) -> tuple[float, float]:
    """The Daly interval under a time-varying hazard: the fixed point of
    ``tau = daly(C, 1 / mean_rate(now, now + tau))``, clamped to [min, max].

    ``rollback_frac`` is the fraction of departures that roll the job back to its last
    periodic checkpoint: 1 for a job whose final checkpoint would not fit the notice window;
    for one that fits, only departures that come without a usable notice (the agent counts
    them), so its MTBF is the hazard's divided by that fraction.

    Returns ``(interval_s, mtbf_s)`` where ``mtbf_s`` is the one the interval was computed
    with. Converges in a few iterations (the map is a contraction for piecewise-constant
    rates); stops after 50 and returns the last iterate."""
    _check_nonneg("cost_s", cost_s)
    if not 0 < rollback_frac <= 1:
        raise ScheduleError(f"ckpt: rollback_frac must be in (0, 1], got {rollback_frac!r}")
    if not 0 < min_interval_s <= max_interval_s:
        raise ScheduleError(f"ckpt: need 0 < min_interval_s <= max_interval_s, got {min_interval_s}, {max_interval_s}")
    tau = min(max(daly_interval(cost_s, hazard.mtbf_s(now) / rollback_frac), min_interval_s), max_interval_s)
    mtbf = hazard.mtbf_s(now, tau) / rollback_frac
    for _ in range(50):
        mtbf = hazard.mtbf_s(now, tau) / rollback_frac
        nxt = min(max(daly_interval(cost_s, mtbf), min_interval_s), max_interval_s)
        if abs(nxt - tau) <= 1e-3 * tau:
            tau = nxt
            break
        tau = 0.5 * (tau + nxt)  # damped: a rate step at an hour edge could make it oscillate
    return tau, mtbf


def notice_fit(jobs: Sequence[CkptJob], link_bps: float, window_s: float, margin: float = NOTICE_MARGIN) -> dict[str, bool]:
    """Which jobs' final checkpoints (write, then transfer over the shared uplink one after
    another) fit a notice window of ``window_s``. Smallest transfer first fits the most jobs.
    Writes happen in parallel on the jobs' own disks, transfers take the uplink in turn."""
    _check_pos("link_bps", link_bps)
    _check_nonneg("window_s", window_s)
    if not isinstance(margin, (int, float)) or not 0 < margin <= 1:
        raise ScheduleError(f"ckpt: margin must be a share of the window in (0, 1], got {margin!r}")
    budget = window_s * margin
    fits: dict[str, bool] = {}
    used = 0.0
    for j in sorted(jobs, key=lambda j: (j.size_bytes, j.job_id)):
        t = j.size_bytes / link_bps
        done = max(used, j.write_s) + t
        if done <= budget:
            fits[j.job_id] = True
            used = done
        else:
            fits[j.job_id] = False
    return fits


def plan(
    jobs: Sequence[CkptJob],
    hazard: Hazard,
    now: float,
    link_bps: float,
    notice_window_s: float,
    min_interval_s: float = MIN_INTERVAL_S,
    max_interval_s: float = MAX_INTERVAL_S,
    unannounced_frac: float = 1.0,
    margin: float = NOTICE_MARGIN,
    prestage: bool = True,
) -> dict[str, CkptPlan]:
    """Checkpoint intervals for the co-resident ``jobs`` of one node whose provider has
    ``hazard``, at time ``now``, with an uplink of ``link_bps`` bytes/s and the provider's
    notice window (0 when it gives none: every job is then prestaged).

    Jobs whose final checkpoint fits the window need no transfer per periodic checkpoint (they
    move at reclaim time), so their cost is the write only; the others are prestaged and pay
    the transfer at their bandwidth share (the fixed point of the module docstring).
    ``unannounced_frac``: the share of departures that come without a usable notice; it sets
    how often the jobs that fit the window still roll back (1, the default, assumes all do).
    ``margin``: the share of the window planned transfers may use (the reclaim's
    ``notice_margin``; the fit must be judged as the reclaim will judge it). ``prestage``:
    False when checkpoints are never shipped ahead of a notice (``prestage = "off"``): a job
    that does not fit then pays only its write per checkpoint and rolls back on every
    departure."""
    ids = [j.job_id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ScheduleError(f"ckpt: duplicate job ids in {ids}")
    if not jobs:
        return {}
    fits = notice_fit(jobs, link_bps, notice_window_s, margin)
    share = {j.job_id: link_bps for j in jobs}
    busy = {j.job_id: 0.0 for j in jobs}  # fraction of time each job's transfer uses the link
    out: dict[str, CkptPlan] = {}
    for _ in range(20):
        out = {}
        for j in jobs:
            pre = rule.should_prestage("auto" if prestage else "off", fits[j.job_id])
            others = sum(b for k, b in busy.items() if k != j.job_id)
            share[j.job_id] = link_bps / (1.0 + others)
            transfer_s = j.size_bytes / share[j.job_id]
            cost = j.write_s + (transfer_s if pre else 0.0)
            tau, mtbf = hazard_interval(cost, hazard, now, min_interval_s, max_interval_s,
                                        rule.rollback_frac(fits[j.job_id], unannounced_frac))
            if pre:
                why = (f"final checkpoint would not fit the {notice_window_s:.0f}s window: prestaged, C includes "
                       f"transfer at {share[j.job_id] / 1e6:.1f} MB/s")
            elif fits[j.job_id]:
                why = f"final checkpoint fits the {notice_window_s:.0f}s window: C is the local write"
            else:
                why = (f"final checkpoint would not fit the {notice_window_s:.0f}s window and prestaging is off: "
                       "every departure rolls back to the last checkpoint, C is the local write")
            out[j.job_id] = CkptPlan(j.job_id, tau, cost, share[j.job_id], transfer_s, pre, mtbf, why)
        # A job's transfers cannot hold the link more than all the time: busy fractions are at
        # most 1, so a job's share is never below link / (prestaged jobs). Unbounded, an
        # oversubscribed link (transfers longer than the intervals) made the iteration diverge
        # to absurd shares and then divide by zero.
        new_busy = {k: (min(1.0, p.transfer_s / p.interval_s) if p.prestage else 0.0) for k, p in out.items()}
        if all(abs(new_busy[k] - busy[k]) < 1e-6 for k in busy):
            break
        busy = new_busy
    return out


def stagger(due: Sequence[tuple[str, float, float]], max_delay_s: float = math.inf) -> dict[str, float]:
    """Start times for checkpoints ``(job_id, due_at, transfer_s)`` so their transfers do not
    overlap: earliest due first, each starting when the previous transfer ends, but never more
    than ``max_delay_s`` after it was due (then it overlaps rather than waits)."""
    _check_nonneg("max_delay_s", max_delay_s)
    out: dict[str, float] = {}
    free_at = -math.inf
    for job_id, due_at, dur in sorted(due, key=lambda d: (d[1], d[0])):
        start = min(max(due_at, free_at), due_at + max_delay_s)
        out[job_id] = start
        free_at = max(free_at, start + dur)
    return out


@dataclass(frozen=True)
class NoticeStep:
    """One job's part of an evacuation within a notice window."""

    job_id: str
    signal_at_s: float  # seconds after the notice: send the checkpoint signal (as late as is safe)
    transfer_start_s: float  # seconds after the notice: the transfer may start
    deadline_s: float  # seconds after the notice: the transfer must be done (for the shaper)
    final: bool  # True: a final checkpoint moves; False: resume from the last prestaged one


def notice_schedule(jobs: Sequence[CkptJob], link_bps: float, window_s: float, margin: float = NOTICE_MARGIN) -> list[NoticeStep]:
    """The evacuation timetable for a reclaim with ``window_s`` of notice: the jobs that fit
    are signalled together as late as the margined window allows (they keep training until
    then; writes run in parallel), transfers go smallest first, each with the deadline the
    shaper enforces; jobs that do not fit get no final checkpoint (``final=False``)
    and move their last prestaged checkpoint, due by the window's end."""
    fits = notice_fit(jobs, link_bps, window_s, margin)
    slots: list[tuple[str, float, float]] = []
    used = 0.0
    for j in sorted(jobs, key=lambda j: (j.size_bytes, j.job_id)):
        if fits[j.job_id]:
            start = max(used, j.write_s)
            used = start + j.size_bytes / link_bps
            slots.append((j.job_id, start, used))
    # Jobs keep training until the latest time that still meets the (margined) window: the
    # whole timetable slides by the slack.
    slack = max(0.0, window_s * margin - used)
    steps = [NoticeStep(jid, slack, slack + st, min(window_s * margin, slack + end / margin), True) for jid, st, end in slots]
    steps += [NoticeStep(j.job_id, 0.0, 0.0, window_s * margin, False) for j in jobs if not fits[j.job_id]]
    return steps


def _check_pos(name: str, v: float) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v <= 0:
        raise ScheduleError(f"ckpt: {name} must be a number > 0, got {v!r}")


def _check_nonneg(name: str, v: float) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v < 0:
        raise ScheduleError(f"ckpt: {name} must be a number >= 0, got {v!r}")
