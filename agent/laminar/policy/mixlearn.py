"""Learning a node's shape mix from the probes it answers (the ``frag`` packing mode).

A node in ``[zone] packing = "frag"`` scores GPU choices by the fragmentation they add for a
*shape mix* (:mod:`laminar.policy.packing`): the worker shapes that usually arrive, with their
probabilities. With no mix configured it learns one from what it sees: the shapes of the
demands probed at it. :class:`MixLearner` keeps that estimate.

Why not simply the last few hundred probes: a node does not see the arrivals, it sees the
probes of the placements whose zone choice reached it. A packing placement probes the first
zones whose summaries say they can take the demand, lowest id first, so a node's stream is
the arrivals *filtered by its zone's free room and rank*: while its zone is one of the first
with room it sees nearly every arrival, once the zone is full for large demands it sees
mostly the small ones (and CPU-only ones), and a zone beyond the first few sees, at first,
only the demands that no earlier zone could take. A short window follows that filter: on
the Alibaba openb trace (docs/allocation.md, seed 42) the mix of the last 512 probes of the
nodes of the first 4 zones drifted to a total variation distance of 0.84 (their mean) from
the workload's mix, while the whole probe stream stayed within 0.08 of it.

The rule here (all of it O(1) amortized per probe, bounded memory):

- **Long, decayed memory.** Each probe adds a weight to its shape's count; the weight grows
  by ``2 ** (1 / half_life)`` a probe, so a probe ``half_life`` probes old counts half as much
  as a new one (an exponential decay without touching every count: the counts are rescaled
  once the weight grows large). A node keeps what it saw while it saw every arrival, and
  still follows a workload whose mix changes, over thousands of probes rather than hundreds.
- **Probes weigh by the share of the traffic the node sees.** A node whose zone is one of the
  first with room is probed for (nearly) every arrival; one whose zone is full for most
  demands, or behind the first zones, is probed for a filtered few. The node measures the
  rate it is probed at (the last ``rate_window`` probes over their time span) against the
  highest rate it has seen (decayed, with four times the half-life), and a probe counts that ratio
  (at most 1): what it saw while it saw everything counts most. The node needs only its
  clock; it assumes arrivals do not change their shapes with their rate.
- **A placement counts once per node.** A placement retried in a later round probes the same
  node again with the same id; the last ``recent_ids`` ids are remembered and a repeat is
  not counted (retries are what fails now, the large demands, and would skew the mix).
- **Bounded shapes.** At most ``max_shapes`` shapes are counted; past that the lighter half
  is dropped (a shape that rare is not in a 95 % coverage mix).
- **Shared between the nodes** (the ``frag`` agents, docs/allocation.md *The shared mix*): a
  node's filtered stream is not the arrivals' mix, but the union of every node's is. A node
  sends its own counts (:meth:`MixLearner.share`: its heaviest :data:`SHARE_SHAPES` shapes and
  its total weight, in probes) in its summaries; the zone's speaker sends the zone's merge of
  them in the zone summary; a node hands the fresh ones it holds to :meth:`MixLearner.set_peers`
  (:func:`merge_shares`: each weighted by its total), and its mix is computed over its own
  counts plus those. Merging happens once a summary round, never per probe.
- **A stable mix.** The mix (:func:`weighted_shape_mix`, FGD's popularity rule) is recomputed
  every ``refresh`` counted probes and *replaced only when it moved* by more than ``change``
  (total variation distance). Scores are cached per mix (``packing._frag``), so a mix that
  stays the same object keeps the cache warm: scoring is cheaper than with a mix renewed
  every ``refresh`` probes.

Example::

    >>> from laminar.policy.packing import Shape
    >>> m = MixLearner(min_seen=2)
    >>> for pid, s in enumerate([Shape(4000, 500, 1)] * 3 + [Shape(8000, 1000, 1)]):
    ...     _ = m.note(s, pid)
    >>> m.note(Shape(4000, 500, 1), 3)     # placement 3 probed here again: not counted
    False
    >>> [(s.gpu_milli, round(p, 2)) for s, p in m.mix()]
    [(500, 0.75), (1000, 0.25)]
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping

from laminar.policy.packing import PackingError, Shape, ShapeMix

HALF_LIFE = 4096
"""Probes after which a probe's shape counts half (the learned mix's memory)."""
MAX_SHAPES = 256
"""Distinct shapes counted at most (bounded memory); past it the lighter half is dropped."""
RECENT_IDS = 256
"""Placement ids remembered to count a placement's probes once per node."""
RATE_WINDOW = 32
"""Probes over which a node measures the rate it is probed at (for the weight of a probe)."""
MIX_CHANGE = 0.02
"""Total variation distance by which a recomputed mix must differ to replace the current one."""
SHARE_SHAPES = 16
"""Shapes a node (or a zone) shares of its mix in its summaries, the heaviest first."""
_RESCALE_AT = 1e100  # the growing weight is folded back into the counts past this


def weighted_shape_mix(weights: Mapping[Shape, float], coverage: float = 0.95) -> ShapeMix:
    """:func:`laminar.policy.packing.shape_mix` for weighted shapes: ``weights`` maps a shape to
    its (positive) weight; the heaviest shapes (ties: the larger shape first) are kept until
    they cover ``coverage`` of the total weight, their probabilities renormalized to 1. With
    integer weights (counts) it is exactly ``shape_mix`` of that many copies of each shape."""
    if not (0 < coverage <= 1):
        raise PackingError(f"weighted_shape_mix: coverage {coverage!r} must be in (0, 1]")
    items = [(s, w) for s, w in weights.items() if w > 0]
    total = sum(w for _, w in items)
    if not items or not math.isfinite(total):
        raise PackingError(f"weighted_shape_mix: need positive finite weights, got total {total!r}")
    items.sort(key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpus), reverse=True)
    kept: list[tuple[Shape, float]] = []
    cum = 0.0
    for s, w in items:
        if cum >= coverage * total * (1 - 1e-12):
            break
        kept.append((s, w))
        cum += w
    return tuple((s, w / cum) for s, w in kept)


def mix_distance(a: ShapeMix, b: ShapeMix) -> float:
    """Total variation distance between two mixes: 0 the same, 1 no shape in common."""
    pa, pb = dict(a), dict(b)
    return 0.5 * sum(abs(pa.get(s, 0.0) - pb.get(s, 0.0)) for s in pa.keys() | pb.keys())


Shares = tuple[float, tuple[tuple[Shape, float], ...]]
"""A mix as shared: the total weight (in probes, > 0) and the heaviest shapes with their share
of that total (each in [0, 1], summing to at most 1)."""


def top_shares(weights: Mapping[Shape, float], k: int = SHARE_SHAPES) -> Shares | None:
    """``weights`` (shape -> weight) as :data:`Shares`: the total of the positive finite weights
    and the ``k`` heaviest shapes (ties: the larger shape first) with their share of it; None
    when no weight is positive."""
    if k < 1:
        raise ValueError(f"top_shares: k {k!r} must be >= 1")
    items = [(s, w) for s, w in weights.items() if w > 0 and math.isfinite(w)]
    total = sum(w for _, w in items)
    if not items or not (total > 0 and math.isfinite(total)):
        return None
    items.sort(key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpus), reverse=True)
    return total, tuple((s, w / total) for s, w in items[:k])


def merge_shares(parts: Iterable[Shares], into: dict[Shape, float] | None = None) -> dict[Shape, float]:
    """The weights (shape -> weight, in probes) of several shared mixes together: each shape's
    share times its part's total, summed over ``parts`` (added to ``into`` when given).
    Parts with a total that is not positive and finite are skipped."""
    out = {} if into is None else into
    for total, shares in parts:
        if not (total > 0 and math.isfinite(total)):
            continue
        for s, p in shares:
            if p > 0:
                out[s] = out.get(s, 0.0) + total * p
    return out


class MixLearner:
    """A node's estimate of the shape mix from the probes it sees (see the module docs).

    :meth:`note` counts one probe's shape (O(1) amortized); :meth:`mix` is the mix to score
    with, None until ``min_seen`` probes were counted. ``half_life`` in probes (``math.inf``:
    no decay); ``rate_window``: probes over which the probe rate is measured (0: every probe
    weighs 1, the rate is not used); ``refresh``: counted probes between two
    recomputations; ``change``: how far (total variation) a recomputed mix must have moved to
    replace the current one (0: always replaced); ``coverage`` as in
    :func:`laminar.policy.packing.shape_mix`. Memory: at most ``max_shapes`` counts and
    ``recent_ids`` ids.
    """

    def __init__(
        self, *, half_life: float = HALF_LIFE, max_shapes: int = MAX_SHAPES, recent_ids: int = RECENT_IDS,
        rate_window: int = RATE_WINDOW, min_seen: int = 16, refresh: int = 32, change: float = MIX_CHANGE, coverage: float = 0.95,
    ) -> None:
        if not (half_life > 0):
            raise ValueError(f"mix learner: half_life {half_life!r} must be > 0 probes (math.inf: no decay)")
        for name, v in (("max_shapes", max_shapes), ("min_seen", min_seen), ("refresh", refresh)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"mix learner: {name} {v!r} must be an integer >= 1")
        for name, v in (("recent_ids", recent_ids), ("rate_window", rate_window)):
            if not (isinstance(v, int) and v >= 0):
                raise ValueError(f"mix learner: {name} {v!r} must be an integer >= 0")
        if rate_window == 1:
            raise ValueError("mix learner: rate_window 1 measures no rate; use 0 (no rate) or >= 2")
        if not (0 <= change < 1):
            raise ValueError(f"mix learner: change {change!r} must be in [0, 1)")
        if not (0 < coverage <= 1):
            raise ValueError(f"mix learner: coverage {coverage!r} must be in (0, 1]")
        self.half_life = half_life
        self.max_shapes = max_shapes
        self.recent_ids = recent_ids
        self.rate_window = rate_window
        self.min_seen = min_seen
        self.refresh = refresh
        self.change = change
        self.coverage = coverage
        self._growth = 2.0 ** (1.0 / half_life)  # 1.0 for math.inf
        self._inc = 1.0
        self.counts: dict[Shape, float] = {}
        self._recent: dict[int, None] = {}  # insertion-ordered: the oldest id first
        self._times: collections.deque[float] = collections.deque(maxlen=max(rate_window, 1))
        self._max_rate = 0.0  # the highest probe rate seen here (probes/s), decayed
        self._max_decay = 2.0 ** (-1.0 / (4 * half_life))  # 1.0 for math.inf
        self.seen = 0  # probes counted (repeats of a placement not included)
        self.repeats = 0  # probes not counted: a placement already counted here
        self._since = 0
        self._mix: ShapeMix | None = None
        self._peers: dict[Shape, float] = {}  # the other nodes' weights (set_peers), in probes
        self._peer_total = 0.0
        self._peers_new = False

    def note(self, shape: Shape, placement_id: int | None = None, now: float | None = None) -> bool:
        """Count one probe of ``shape`` for ``placement_id`` (None: count it whatever its id)
        that came at ``now`` (seconds, any monotonic-enough clock; None: weight 1). False when
        the placement was counted here lately (not counted again)."""
        if placement_id is not None and self.recent_ids:
            recent = self._recent
            if placement_id in recent:
                self.repeats += 1
                return False
            recent[placement_id] = None
            if len(recent) > self.recent_ids:
                del recent[next(iter(recent))]
        weight = self._rate_weight(now) if now is not None and self.rate_window else 1.0
        counts = self.counts
        counts[shape] = counts.get(shape, 0.0) + self._inc * weight
        if self._growth != 1.0:
            self._inc *= self._growth
            if self._inc > _RESCALE_AT:
                inc = self._inc
                for s in counts:
                    counts[s] /= inc
                self._inc = 1.0
        if len(counts) > self.max_shapes:
            keep = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[: self.max_shapes // 2]
            self.counts = dict(keep)
        self.seen += 1
        self._since += 1
        return True

    def _rate_weight(self, now: float) -> float:
        """The probe rate here over the last ``rate_window`` probes, as a share (0..1] of the
        highest rate seen (decayed with four times the counts' half-life). Until the window is full, or when the
        clock did not advance over it: 1."""
        times = self._times
        times.append(now)
        self._max_rate *= self._max_decay
        if len(times) < self.rate_window:
            return 1.0
        span = now - times[0]
        if not (span > 0 and math.isfinite(span)):
            return 1.0  # a burst at one instant (or a clock step back): as fast as ever seen
        rate = (len(times) - 1) / span
        if rate >= self._max_rate:
            self._max_rate = rate
            return 1.0
        return rate / self._max_rate

    def mix(self) -> ShapeMix | None:
        """The mix to score with now: None until ``min_seen`` probes were counted (here, or
        in the peers' weights together); else the weighted mix of this node's counts and
        the peers' (:meth:`set_peers`), recomputed every ``refresh`` counted probes and after
        new peer weights, and kept (the same object) while a recomputation moved less than
        ``change``."""
        if self.seen < self.min_seen and self._peer_total < self.min_seen:
            return None
        if self._mix is None or self._since >= self.refresh or self._peers_new:
            weights = self.own_weights()
            if self._peers:
                for s, w in self._peers.items():
                    weights[s] = weights.get(s, 0.0) + w
            new = weighted_shape_mix(weights, self.coverage)
            if self._mix is None or mix_distance(new, self._mix) > self.change:
                self._mix = new
            self._since = 0
            self._peers_new = False
        return self._mix

    def own_weights(self) -> dict[Shape, float]:
        """This node's decayed counts in probes (the newest probe weighs its rate weight, at
        most 1; one ``half_life`` older, half that): comparable between nodes."""
        inc = self._inc
        return {s: w / inc for s, w in self.counts.items()}

    def share(self, k: int = SHARE_SHAPES) -> Shares | None:
        """What this node shares of its mix (its own counts only, never the peers'): its total
        weight in probes and its ``k`` heaviest shapes' shares; None before ``min_seen``
        probes were counted here."""
        if self.seen < self.min_seen:
            return None
        return top_shares(self.own_weights(), k)

    def set_peers(self, weights: Mapping[Shape, float]) -> None:
        """Score with this node's counts plus ``weights`` (shape -> weight in probes: the fresh
        mixes of the zone peers and of the other zones, :func:`merge_shares`), replacing the
        previous peers' weights; the mix is recomputed at the next :meth:`mix` (and replaced
        only when it moved by more than ``change``). An empty mapping: this node's counts alone."""
        peers = {s: float(w) for s, w in weights.items() if w > 0 and math.isfinite(w)}
        self._peers = peers
        self._peer_total = sum(peers.values())
        self._peers_new = True

    def weights(self) -> dict[Shape, float]:
        """Each counted shape's share of the (decayed) weight, summing to 1 (for inspection)."""
        total = sum(self.counts.values())
        return {s: w / total for s, w in self.counts.items()} if total > 0 else {}
