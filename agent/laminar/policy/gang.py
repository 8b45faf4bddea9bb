"""Gang placement policy: pure decisions for placing the k members of a multi-node job
all-or-nothing, shared by the agent (:mod:`laminar.zone.gangplace`), the simulated transport
(:mod:`laminar.zone.simnet`) and the benchmark (``bench/gang.py``).

Nothing here does I/O, reads a clock or draws randomness of its own (``now`` and ``rng`` are
arguments), as in :mod:`laminar.policy.placement`, whose types it uses.

A gang of ``k`` workers, each asking for the same :class:`~laminar.policy.placement.Demand`,
is placed like this (batch sampling, as in Sparrow, with late binding):

1. :func:`choose_zones` picks the zone(s) from the zone summaries' fits: one zone whose fit
   holds all ``k`` workers when one does (drawn in proportion to the fit, as a one-node job's
   zone is); several zones, largest fit first, only when the submitter allows spreading.
2. :func:`probe_count` says how many distinct nodes to probe in each: ``d * count`` (``d`` of
   :class:`~laminar.policy.placement.RetryPolicy`, widened per step as
   :func:`~laminar.policy.placement.retry_schedule` widens it), at most the zone's size.
3. :func:`pick_gang` takes the first ``k`` offers, in arrival order, on distinct nodes whose
   lease outlives the commit; the other offers are released at once.
4. The submitter commits those ``k`` and hands the members over only when every commit is
   acknowledged; otherwise it releases what it holds and goes on with the next (wider) step.

Example::

    >>> import random
    >>> from laminar.policy import placement as pl
    >>> choose_zones({1: 2.0, 2: 5.0}, 3, random.Random(0))
    ((2, 3),)
    >>> choose_zones({1: 2.0, 2: 2.0}, 3, random.Random(0)) is None
    True
    >>> choose_zones({1: 2.0, 2: 2.0}, 3, random.Random(0), spread=True)
    ((1, 2), (2, 1))
    >>> probe_count(2, 3, zone_size=100)
    6
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence

from laminar.policy import placement as pl

WORKERS_MAX = 64  # most members of one gang (the design's WORKERS_MAX)

ZonePlan = tuple[tuple[int, int], ...]
"""Where a gang goes: ``((zone, workers), ...)``, the workers summing to the gang's ``k``."""


def check_k(k: int) -> None:
    """Raises :class:`~laminar.policy.placement.PlacementError` unless ``k`` is a worker count."""
    if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= WORKERS_MAX):
        raise pl.PlacementError(f"gang: k {k!r} workers; allowed 1..{WORKERS_MAX}")


def choose_zones(fits: Mapping[int, float], k: int, rng: random.Random, *, spread: bool = False,
                 exclude: Iterable[int] = ()) -> ZonePlan | None:
    """The zone(s) for ``k`` workers from the zones' fits (copies of the worker's demand each
    zone's summary says it could take: :func:`laminar.policy.placement.zone_fit`), skipping
    ``exclude``.

    One zone when any zone's fit is at least ``k``: drawn among those with probability
    proportional to the fit (a gang stays in one zone when it fits: its members talk to each
    other). Else, with ``spread``, the fewest zones whose fits hold ``k`` together, largest
    fit first (ties: lower zone id), each given as many workers as its fit holds, the last
    the rest. None when the zones cannot hold ``k`` (without ``spread``: no one zone can).
    """
    check_k(k)
    skip = set(exclude)
    cands = sorted((z, f) for z, f in fits.items() if z not in skip and f > 0 and math.isfinite(f))
    whole = sorted((z, f) for z, f in whole_fits(fits, k).items() if z not in skip)
    if whole:
        total = sum(f for _, f in whole)
        x = rng.random() * total
        for z, f in whole:
            x -= f
            if x < 0:
                return ((z, k),)
        return ((whole[-1][0], k),)
    if not spread:
        return None
    plan: list[tuple[int, int]] = []
    left = k
    for z, f in sorted(cands, key=lambda zf: (-zf[1], zf[0])):
        take = min(left, int(f))
        if take <= 0:
            continue
        plan.append((z, take))
        left -= take
        if left == 0:
            return tuple(plan)
    return None


def whole_fits(fits: Mapping[int, float], k: int) -> dict[int, float]:
    """The zones of ``fits`` whose fit holds ``k`` workers alone (finite), with their fits: the
    zones :func:`choose_zones` draws a one-zone plan from, in the same proportion."""
    return {z: f for z, f in fits.items() if f >= k and math.isfinite(f)}


def probe_count(d: int, workers: int, zone_size: int) -> int:
    """Distinct nodes to probe for ``workers`` members in a zone of ``zone_size`` nodes:
    ``d * workers`` (batch sampling), at most the zone's size."""
    if d < 1 or workers < 0 or zone_size < 0:
        raise pl.PlacementError(f"gang: probe_count d {d!r} must be >= 1, workers {workers!r} and "
                                f"zone_size {zone_size!r} >= 0")
    return min(d * workers, zone_size)


def hinted_targets(summary: pl.ZoneSummary, demand: pl.Demand, n: int, rng: random.Random,
                   exclude: Iterable[int] = ()) -> list[int]:
    """Up to ``n // 2`` distinct nodes, drawn uniformly among those ``summary`` names as having
    had room for ``demand``'s GPU shape (:func:`laminar.policy.placement.hinted_nodes`; a
    zone names them only for the shapes not every node can take), skipping ``exclude``. The
    gang's other probes are drawn uniformly, so a stale hint costs one refusal, not a round."""
    raw = pl.hinted_nodes(summary, demand)
    if not raw or n < 2:
        return []
    skip = set(exclude)
    pool = [x for x in raw if x not in skip]
    return rng.sample(pool, min(n // 2, len(pool)))


def steps(policy: pl.RetryPolicy, round: int = 0) -> list[pl.Probe | pl.Queue]:
    """One round of a gang's steps: exactly :func:`laminar.policy.placement.retry_schedule`
    (``Probe(zone_rank, d)``: probe ``d`` nodes a worker in the ``zone_rank``-th zone plan;
    ``d`` widens within a zone plan; then a new plan without the zones tried; then
    ``Queue``)."""
    return pl.retry_schedule(policy, round)


def pick_gang(offers: Sequence[pl.Offer], k: int, now: float, margin_s: float = 0.0) -> list[pl.Offer] | None:
    """Late binding for a gang: the first ``k`` offers in arrival order on distinct nodes whose
    lease outlives ``now + margin_s`` (time to commit), or None when fewer than ``k`` such are
    in hand. A node's later offers (a retransmitted answer) count once."""
    out: list[pl.Offer] = []
    seen: set[int] = set()
    for o in offers:
        if o.node in seen or not o.expires_at > now + margin_s:
            continue
        seen.add(o.node)
        out.append(o)
        if len(out) == k:
            return out
    return None


def unused(offers: Iterable[pl.Offer], chosen: Iterable[pl.Offer]) -> list[pl.Offer]:
    """The offers not in ``chosen`` (each to be released at once), one per node."""
    taken = {o.node for o in chosen}
    out: list[pl.Offer] = []
    for o in offers:
        if o.node not in taken:
            taken.add(o.node)
            out.append(o)
    return out


def probe_lease_s(base_lease_s: float, probe_timeout_s: float, commit_timeout_s: float, commit_tries: int) -> float:
    """The lease a gang's probes ask for: the node's usual lease plus the longest wait for the
    other answers and for every commit try (the first offer must outlive the last commit's
    answer, or its node drops it before the commit comes; a lapsed offer is revived by a
    commit when it still fits, :meth:`laminar.zone.arbiter.Arbiter.on_commit`, but a losing
    offer must not be held past it)."""
    return base_lease_s + probe_timeout_s + commit_timeout_s * max(1, commit_tries)


def messages_bound_per_worker(d: int) -> int:
    """Messages one worker of a gang costs at most in one successful step (every message,
    both directions, as ``bench/gang.py`` counts them): ``d`` probes and ``d`` answers, the
    commit and its acknowledgement, the TCP hand-over and its acknowledgement, and a release
    for each of the other ``d - 1`` offers: ``3d + 3``. A failed step adds its own probes,
    answers and releases; a refused answer saves its release."""
    if d < 1:
        raise pl.PlacementError(f"gang: d {d!r} must be >= 1")
    return 3 * d + 3


def sent_bound_per_worker(d: int) -> int:
    """The submitter's share of :func:`messages_bound_per_worker`: ``d`` probes, a commit, a
    hand-over and ``d - 1`` releases, ``2d + 1``."""
    if d < 1:
        raise pl.PlacementError(f"gang: d {d!r} must be >= 1")
    return 2 * d + 1
