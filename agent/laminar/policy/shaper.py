"""The deadline shaper: pure policy that turns transfers and deadlines into HTB leaf rates.

Every tick the transfer registry hands the shaper what each migration transfer still has to
send and when it must be done; the shaper answers with a :class:`ShapingDecision`: a rate per
transfer and the reason for it. Nothing here touches the kernel, so the agent and the simulator
call the same code.

The rule (ReclaimNet's deadline-aware migration traffic control):

* a transfer needs ``remaining_bytes * 8 / (deadline - now)`` bit/s to finish on time; it is
  given that times ``1 + margin`` (the margin absorbs tick delay, TCP ramp-up and HTB burst
  error);
* the migration classes together never get more than the *migration budget*, ``link_bps -
  background_floor_bps``, so background traffic always keeps its floor;
* transfers are admitted earliest deadline first; when the budget cannot carry every margin,
  margins shrink (still on time); a transfer whose bare need does not fit (alone, or after the
  transfers due before it) is **infeasible** and is reported at once, with the reason, so the
  migration layer can choose another plan instead of discovering the miss at the deadline;
* infeasible transfers still get whatever budget the feasible ones leave (best effort), so a
  re-plan that keeps them loses as little as possible;
* a transfer whose progress is only estimated (counted on the wire, not reported by its sender)
  says how many bytes the estimate may have counted that were not payload
  (``unconfirmed_bytes``): its rate never falls below what sends ``remaining + unconfirmed`` by
  its deadline (with the margin), taken from the budget the feasible transfers leave, before the
  infeasible ones get theirs. Its status still follows ``remaining_bytes``. Without this, an
  estimate that ran ahead of the payload left the transfer's last bytes at ``MIN_RATE_BPS``
  until its deadline.

Example::

    >>> from laminar.policy.shaper import LinkBudget, ShaperParams, TransferDemand, decide
    >>> link = LinkBudget(link_bps=1_000_000_000, background_floor_bps=400_000_000)
    >>> d = decide([TransferDemand("ckpt-7", remaining_bytes=500_000_000, deadline_s=20.0)],
    ...            now_s=10.0, link=link, params=ShaperParams(margin=0.1))
    >>> d.rates["ckpt-7"].rate_bps, d.rates["ckpt-7"].feasible
    (440000000, True)

Units: rates are integer bits per second, sizes bytes, times seconds on one monotonic clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

# HTB cannot hold a class at 0 bit/s; a finished or starved transfer sits at this trickle so its
# class stays valid (and a stray retransmission still gets out). 8 kbit/s is HTB's own practical floor.
MIN_RATE_BPS = 8_000

# Status words: one word for one thing, shown in `laminarctl net transfers` and metrics labels.
ON_TIME = "on-time"      # gets need * (1 + margin)
TIGHT = "tight"          # gets its need, but less than the full margin
INFEASIBLE = "infeasible"  # cannot finish by its deadline under the budget
LATE = "late"            # the deadline has passed with bytes left
DONE = "done"            # nothing left to send
STATUSES = (ON_TIME, TIGHT, INFEASIBLE, LATE, DONE)


@dataclass(frozen=True)
class LinkBudget:
    """The uplink as the shaper sees it: its rate and the floor kept for background traffic."""

    link_bps: int
    background_floor_bps: int

    def __post_init__(self) -> None:
        if self.link_bps <= 0:
            raise ValueError(f"link rate {self.link_bps} bit/s must be > 0")
        if not 0 <= self.background_floor_bps < self.link_bps:
            raise ValueError(
                f"background floor {self.background_floor_bps} bit/s must be in 0..{self.link_bps - 1} "
                f"(below the link rate {self.link_bps} bit/s, or migration gets nothing)")

    @property
    def migration_budget_bps(self) -> int:
        """What all migration classes together may use: the link less the background floor."""
        return self.link_bps - self.background_floor_bps


@dataclass(frozen=True)
class ShaperParams:
    """Tunables. ``margin`` 0.1: a 10 s window at 100 ms ticks loses at most ~1% to tick lag,
    TCP slow start costs a few RTTs, HTB's burst error is ~1%; 10% covers all three."""

    margin: float = 0.10
    min_rate_bps: int = MIN_RATE_BPS

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin <= 10.0:
            raise ValueError(f"shaper margin {self.margin} out of range 0..10 (0.1 means 10% above the need)")
        if self.min_rate_bps < 1:
            raise ValueError(f"min rate {self.min_rate_bps} bit/s must be >= 1")


@dataclass(frozen=True)
class TransferDemand:
    """One transfer's state at this tick. ``max_rate_bps`` (optional) caps what it may get.
    ``unconfirmed_bytes``: bytes that may still be left beyond ``remaining_bytes`` because the
    progress is an estimate (0 when the sender reported it); see the module docstring."""

    id: str
    remaining_bytes: int
    deadline_s: float
    max_rate_bps: int | None = None
    unconfirmed_bytes: int = 0


@dataclass(frozen=True)
class TransferRate:
    """The shaper's answer for one transfer."""

    id: str
    rate_bps: int          # the HTB leaf rate (and ceil) to apply
    need_bps: float        # remaining / time left, no margin (inf once the deadline has passed)
    status: str            # one of STATUSES
    reason: str            # one line a person can act on

    @property
    def feasible(self) -> bool:
        return self.status in (ON_TIME, TIGHT, DONE)


@dataclass(frozen=True)
class ShapingDecision:
    """Rates and reasons for every transfer at one tick."""

    now_s: float
    link: LinkBudget
    rates: dict[str, TransferRate] = field(default_factory=dict)

    @property
    def infeasible(self) -> list[TransferRate]:
        """Transfers that will miss their deadline under this plan (the migration layer re-plans)."""
        return [r for r in self.rates.values() if not r.feasible]

    @property
    def migration_bps(self) -> int:
        """The sum of the leaf rates handed out (never above the migration budget, bar trickles)."""
        return sum(r.rate_bps for r in self.rates.values())


def fmt_rate(bps: float) -> str:
    """``1.5e9`` -> ``'1.50 Gbit/s'``: the unit people read rates in."""
    if math.isinf(bps):
        return "inf"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.2f} {unit}"
    return f"{bps:.0f} bit/s"


def need_bps(remaining_bytes: int, deadline_s: float, now_s: float) -> float:
    """Bit/s needed to send ``remaining_bytes`` by ``deadline_s``; ``inf`` if the deadline is not
    after ``now_s`` and bytes remain, 0.0 if nothing remains."""
    if remaining_bytes <= 0:
        return 0.0
    left = deadline_s - now_s
    if left <= 0:
        return math.inf
    return remaining_bytes * 8.0 / left


def decide(transfers: Iterable[TransferDemand], now_s: float, link: LinkBudget,
           params: ShaperParams | None = None) -> ShapingDecision:
    """Rates for every transfer at ``now_s`` (see the module docstring for the rule).

    Contract: every transfer gets an entry; rates are integers >= ``params.min_rate_bps``; the
    rates of feasible transfers sum to at most the migration budget; a feasible transfer's rate
    is at least its need (it finishes on time if it keeps that rate), and at least the need of
    ``remaining + unconfirmed`` bytes as far as the budget left by the feasible transfers' own
    rates allows. Raises ValueError for a duplicate id or a negative size.
    """
    p = params or ShaperParams()
    budget = float(link.migration_budget_bps)
    demands = list(transfers)
    seen: set[str] = set()
    for t in demands:
        if t.id in seen:
            raise ValueError(f"transfer id {t.id!r} given twice")
        seen.add(t.id)
        if t.remaining_bytes < 0:
            raise ValueError(f"transfer {t.id!r}: remaining bytes {t.remaining_bytes} must be >= 0")
        if t.unconfirmed_bytes < 0:
            raise ValueError(f"transfer {t.id!r}: unconfirmed bytes {t.unconfirmed_bytes} must be >= 0")

    out: dict[str, TransferRate] = {}
    admitted: list[tuple[TransferDemand, float]] = []  # (demand, need) in deadline order
    rejected: list[tuple[TransferDemand, float, str, str]] = []  # (demand, need, status, reason)
    used = 0.0
    for t in sorted(demands, key=lambda t: (t.deadline_s, t.id)):
        need = need_bps(t.remaining_bytes, t.deadline_s, now_s)
        if t.remaining_bytes == 0:
            out[t.id] = TransferRate(t.id, p.min_rate_bps, 0.0, DONE, "all bytes sent")
            continue
        if math.isinf(need):
            rejected.append((t, need, LATE,
                             f"deadline passed {now_s - t.deadline_s:.1f} s ago with {t.remaining_bytes} bytes left"))
            continue
        cap = t.max_rate_bps
        if cap is not None and need > cap:
            rejected.append((t, need, INFEASIBLE,
                             f"needs {fmt_rate(need)} for {t.remaining_bytes} bytes in {t.deadline_s - now_s:.1f} s, "
                             f"above its own cap {fmt_rate(cap)}"))
            continue
        if need > budget:
            rejected.append((t, need, INFEASIBLE,
                             f"needs {fmt_rate(need)} for {t.remaining_bytes} bytes in {t.deadline_s - now_s:.1f} s; "
                             f"the migration budget is {fmt_rate(budget)} (link {fmt_rate(link.link_bps)} less "
                             f"background floor {fmt_rate(link.background_floor_bps)})"))
            continue
        if used + need > budget:
            rejected.append((t, need, INFEASIBLE,
                             f"needs {fmt_rate(need)} but transfers due earlier hold {fmt_rate(used)} of the "
                             f"{fmt_rate(budget)} migration budget; {fmt_rate(budget - used)} left"))
            continue
        admitted.append((t, need))
        used += need

    # Margins: all of them if they fit, else the spare budget shared in proportion to need.
    want_total = sum(n * (1.0 + p.margin) for _, n in admitted)
    full_margin = want_total <= budget
    spare = budget - used
    for t, need in admitted:
        if full_margin:
            rate = need * (1.0 + p.margin)
            status, reason = ON_TIME, f"needs {fmt_rate(need)}; +{p.margin:.0%} margin"
        else:
            extra = spare * (need / used) if used > 0 else 0.0
            rate = need + extra
            status = TIGHT
            reason = (f"needs {fmt_rate(need)}; margin cut to {extra / need:.1%} (of {p.margin:.0%}) "
                      f"because the migration budget {fmt_rate(budget)} is nearly full")
        if t.max_rate_bps is not None:
            rate = min(rate, float(t.max_rate_bps))
        # ceil keeps a feasible rate >= its need (at most 1 bit/s over the budget per transfer).
        out[t.id] = TransferRate(t.id, max(p.min_rate_bps, math.ceil(rate)), need, status, reason)

    # Estimated progress: raise a feasible transfer to what sends its unconfirmed bytes as well by its
    # deadline, from what the admitted rates leave (in deadline order), so an estimate that ran ahead
    # of the payload never leaves the last bytes at the floor rate.
    left = max(0.0, budget - sum(out[t.id].rate_bps for t, _ in admitted))
    for t, _need in admitted:
        if t.unconfirmed_bytes <= 0 or left <= 0:
            continue
        r = out[t.id]
        want = need_bps(t.remaining_bytes + t.unconfirmed_bytes, t.deadline_s, now_s) * (1.0 + p.margin)
        if t.max_rate_bps is not None:
            want = min(want, float(t.max_rate_bps))
        give = min(left, max(0.0, want - r.rate_bps))
        if give >= 1:
            left -= math.ceil(give)
            out[t.id] = TransferRate(t.id, r.rate_bps + math.ceil(give), r.need_bps, r.status,
                                     f"{r.reason}; raised to {fmt_rate(r.rate_bps + math.ceil(give))} for "
                                     f"{t.unconfirmed_bytes} bytes its estimated progress may have counted")
    left = max(0.0, left)

    # Best effort for the rest: what the admitted ones leave, in deadline order, capped at their want.
    for t, need, status, reason in rejected:
        need_all = need_bps(t.remaining_bytes + t.unconfirmed_bytes, t.deadline_s, now_s)
        want = need_all * (1.0 + p.margin) if not math.isinf(need_all) else left
        if t.max_rate_bps is not None:
            want = min(want, float(t.max_rate_bps))
        give = min(left, want)
        left -= give
        rate = max(p.min_rate_bps, math.floor(give))
        out[t.id] = TransferRate(t.id, rate, need, status, f"{reason}; best effort at {fmt_rate(rate)}")
    return ShapingDecision(now_s, link, out)


def changed_enough(old_bps: int | None, new_bps: int, hysteresis: float = 0.02) -> bool:
    """Whether a leaf's rate should be re-applied: it has none yet, or the new rate differs from
    the old one by more than ``hysteresis`` (a fraction). The margin (10% by default) is far
    above the 2% default, so a skipped small change cannot make a transfer late; it keeps
    netlink quiet on steady transfers."""
    if old_bps is None or old_bps <= 0:
        return True
    return abs(new_bps - old_bps) / old_bps > hysteresis


def validate_request(total_bytes: int, sent_bytes: int, deadline_s: float, now_s: float, link: LinkBudget,
                     max_rate_bps: int | None = None) -> str | None:
    """Why a new transfer must be refused outright, or None. Refused: sizes out of range, a
    deadline not in the future, a cap or a need beyond the link itself (no plan can carry it).
    A need beyond the migration budget but within the link is *accepted* and reported infeasible,
    since the migration layer may re-plan around it (a bigger window, another destination)."""
    if total_bytes <= 0:
        return f"total_bytes {total_bytes} must be > 0"
    if not 0 <= sent_bytes <= total_bytes:
        return f"sent_bytes {sent_bytes} must be in 0..{total_bytes} (total_bytes)"
    if deadline_s <= now_s:
        return f"deadline is {now_s - deadline_s:.3f} s in the past; give one in the future"
    if max_rate_bps is not None:
        if max_rate_bps <= 0:
            return f"max_rate_bps {max_rate_bps} must be > 0"
        if max_rate_bps > link.link_bps:
            return f"max_rate_bps {fmt_rate(max_rate_bps)} is beyond the link rate {fmt_rate(link.link_bps)}"
    need = need_bps(total_bytes - sent_bytes, deadline_s, now_s)
    if need > link.link_bps:
        return (f"needs {fmt_rate(need)} to send {total_bytes - sent_bytes} bytes in {deadline_s - now_s:.1f} s, "
                f"beyond the link rate {fmt_rate(link.link_bps)}; give a later deadline")
    return None
