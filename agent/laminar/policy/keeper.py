"""Storage keepers and the keeper's retry schedule (pure policy: no I/O, no clock).

When a node is reclaimed and no live peer has *compute* room for a job during the notice
window, the job's final checkpoint still leaves the node: it goes to a **storage keeper**, a
live peer with the disk space, chosen by :func:`choose_keeper`, and that peer becomes the
job's keeper. The job then loses only the steps after its final checkpoint instead of rolling
back to an older replica. The keeper places the job once room frees anywhere (itself
included), retrying on :class:`RetrySchedule`.

:func:`choose_keeper` ranks candidates:

* **feasible** only with a known amount of free disk (``free_bytes``) that holds the
  checkpoint plus ``reserve_bytes`` (the keeper keeps room for its own work), and a transfer
  (``ckpt_bytes / path_bps``) that fits the usable part of the window (``window_s * margin``;
  ``window_s`` None: no deadline);
* ordered by **survival** over the horizon (the keeper must outlive the wait for room),
  then nodes in ``prefer`` (the job's keeper: it already holds the job's older checkpoints),
  then the source's zone, then the shorter transfer, then the node's name.

:class:`RetrySchedule` is exponential backoff with a cap: attempt ``k`` (0-based) waits
``min(max_s, base_s * factor**k)`` after attempt ``k - 1``. :meth:`RetrySchedule.first_at_or_after`
is when a keeper that first looked at ``start`` looks again at or after ``t`` (what the
benchmark uses to model the lag between room freeing and the keeper noticing it).

Example::

    ranked = choose_keeper([KeeperCandidate("2", "1", 50e9, 1.25e9, 0.97),
                            KeeperCandidate("3", "1", 1e9, 1.25e9, 0.99)], ckpt_bytes=8e9, window_s=120)
    ranked[0].candidate.node   # "2": node 3 lacks the disk space
    RetrySchedule(2, 2, 30).delay(3)   # 16.0
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from laminar.policy.ckpt_schedule import NOTICE_MARGIN

SURVIVAL_TIE = 1e-3  # survival odds closer than this count as equal (the next keys decide)


class KeeperError(ValueError):
    """Bad input to the keeper choice or the retry schedule; the message names the value."""


@dataclass(frozen=True)
class KeeperCandidate:
    """A live peer that could hold a checkpoint. ``free_bytes`` None: its disk space is not
    known (it did not answer), which makes it infeasible."""

    node: str
    zone: str
    free_bytes: float | None
    path_bps: float
    survival: float

    def __post_init__(self) -> None:
        if not (isinstance(self.path_bps, (int, float)) and self.path_bps > 0 and math.isfinite(self.path_bps)):
            raise KeeperError(f"keeper: {self.node}: path_bps must be a finite number > 0, got {self.path_bps!r}")
        if not (isinstance(self.survival, (int, float)) and 0.0 <= self.survival <= 1.0):
            raise KeeperError(f"keeper: {self.node}: survival must be in 0..1, got {self.survival!r}")
        if self.free_bytes is not None and (not isinstance(self.free_bytes, (int, float)) or self.free_bytes < 0
                                            or math.isnan(self.free_bytes)):
            raise KeeperError(f"keeper: {self.node}: free_bytes must be >= 0 or None, got {self.free_bytes!r}")


@dataclass(frozen=True)
class RankedKeeper:
    candidate: KeeperCandidate
    feasible: bool
    transfer_s: float
    reasons: tuple[str, ...]


def choose_keeper(
    candidates: Sequence[KeeperCandidate],
    ckpt_bytes: float,
    window_s: float | None,
    *,
    margin: float = NOTICE_MARGIN,
    reserve_bytes: float = 0.0,
    src_zone: str | None = None,
    prefer: Collection[str] = (),
) -> list[RankedKeeper]:
    """Every candidate, feasible ones first in the order the module docstring gives, then the
    infeasible ones with their reasons. Raises KeeperError for a negative or NaN size,
    window or reserve, or a margin outside (0, 1]."""
    for name, v in (("ckpt_bytes", ckpt_bytes), ("reserve_bytes", reserve_bytes)):
        if not isinstance(v, (int, float)) or v < 0 or math.isnan(v):
            raise KeeperError(f"keeper: {name} must be >= 0, got {v!r}")
    if window_s is not None and (not isinstance(window_s, (int, float)) or window_s < 0 or math.isnan(window_s)):
        raise KeeperError(f"keeper: window_s must be >= 0 or None, got {window_s!r}")
    if not isinstance(margin, (int, float)) or not 0.0 < margin <= 1.0:
        raise KeeperError(f"keeper: margin must be in (0, 1], got {margin!r}")
    out = []
    for c in candidates:
        reasons: list[str] = []
        feasible = True
        need = ckpt_bytes + reserve_bytes
        if c.free_bytes is None:
            feasible = False
            reasons.append("free disk space unknown")
        elif c.free_bytes < need:
            feasible = False
            reasons.append(f"needs {need / 1e9:.2f} GB of disk, {c.free_bytes / 1e9:.2f} GB free")
        else:
            reasons.append(f"disk {c.free_bytes / 1e9:.2f} GB free")
        transfer_s = ckpt_bytes / c.path_bps
        if window_s is not None:
            usable = window_s * margin
            if transfer_s > usable:
                feasible = False
                reasons.append(f"transfer {transfer_s:.1f}s does not fit the window ({usable:.1f}s usable)")
            else:
                reasons.append(f"transfer {transfer_s:.1f}s fits the window ({usable:.1f}s usable)")
        reasons.append(f"survival {c.survival:.3f}")
        if c.node in prefer:
            reasons.append("already holds the job's checkpoints")
        out.append(RankedKeeper(c, feasible, transfer_s, tuple(reasons)))

    def key(r: RankedKeeper) -> tuple[bool, float, bool, bool, float, str]:
        c = r.candidate
        return (not r.feasible, -round(c.survival / SURVIVAL_TIE), c.node not in prefer,
                src_zone is not None and c.zone != src_zone, r.transfer_s, c.node)

    out.sort(key=key)
    return out


@dataclass(frozen=True)
class RetrySchedule:
    """Exponential backoff with a cap for a keeper looking for room (see the module docstring)."""

    base_s: float = 2.0
    factor: float = 2.0
    max_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("base_s", "max_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise KeeperError(f"retry schedule: {name} must be a finite number of seconds > 0, got {v!r}")
        if not isinstance(self.factor, (int, float)) or not 1.0 <= self.factor < math.inf:
            raise KeeperError(f"retry schedule: factor must be >= 1, got {self.factor!r}")
        if self.max_s < self.base_s:
            raise KeeperError(f"retry schedule: max_s {self.max_s!r} must be >= base_s {self.base_s!r}")

    def delay(self, attempt: int) -> float:
        """Seconds between attempt ``attempt - 1`` and ``attempt`` (attempt >= 0: the wait
        after the first look is ``delay(0)``)."""
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise KeeperError(f"retry schedule: attempt must be an integer >= 0, got {attempt!r}")
        if self.factor == 1.0:
            return float(self.base_s)
        # past this many doublings the cap holds (avoids float overflow for large attempts)
        if attempt >= math.log(self.max_s / self.base_s, self.factor) + 1:
            return float(self.max_s)
        return float(min(self.max_s, self.base_s * self.factor ** attempt))

    def first_at_or_after(self, start: float, t: float) -> float:
        """The first look at or after ``t`` of a keeper that looked first at ``start`` and then
        after ``delay(0)``, ``delay(1)``, ... (``t <= start``: ``start``)."""
        if not (math.isfinite(start) and not math.isnan(t)):
            raise KeeperError(f"retry schedule: start {start!r} and t {t!r} must be numbers (start finite)")
        if t <= start:
            return start
        if math.isinf(t):
            return math.inf
        at, k = start, 0
        while at < t:
            d = self.delay(k)
            if d >= self.max_s:  # the cap holds from here: jump
                n = math.ceil((t - at) / self.max_s)
                return at + n * self.max_s
            at += d
            k += 1
        return at
