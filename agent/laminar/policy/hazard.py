"""Departure hazard per provider: how likely a node is to be taken back, as a function of time.

A provider (a cloud's spot market, a campus owner, an inference pool that lends servers) takes
nodes back at a rate that depends on the time of the week: owners come back on Monday morning,
spot markets are busiest in business hours. :class:`HazardModel` keeps that rate for the 168
hours of the week (UTC, Monday 00:00 = hour 0) as a Gamma-Poisson posterior:

* **prior** from the configuration: ``prior_rate_per_h`` departures per node-hour with the
  weight of ``prior_strength_h`` node-hours of evidence (``[migrate.hazard]`` in laminard.toml);
* **evidence** from what the agent has seen: node-hours of exposure (:meth:`observe_exposure`)
  and departures (:meth:`observe_reclaim`), binned by hour of week;
* **smoothing**: neighbouring hours share evidence through a circular triangular kernel of
  half-width ``smooth_bins`` hours, and each hour's estimate is shrunk toward the provider's
  all-week rate (empirical Bayes, weight ``bin_strength_h``), so an hour seen once does not swing.

The model answers the questions the checkpoint scheduler and destination choice ask:
``rate_per_s(t)``, ``cumulative_hazard(t0, t1)``, ``survival(t, horizon_s)`` and
``mtbf_s(t, horizon_s)`` (integrated exactly over the hour bins, not sampled).

Everything here is pure: no clock, no I/O. Calibrating a model from the SkyPilot spot traces
reads files, so it lives with the agent's mechanism: :mod:`laminar.policy.hazard`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

HOURS_PER_WEEK = 168
# 1970-01-01 was a Thursday: add three days so that hour 0 of the week is Monday 00:00 UTC.
_EPOCH_HOUR_OFFSET = 3 * 24

# Defaults for the prior, chosen so an agent with no history neither panics nor ignores risk:
# one departure per 24 node-hours is in the range the AWS V100 spot traces show (one per 2-8 h
# in a busy zone, none for days in a quiet one), weighted like one day of evidence.
DEFAULT_PRIOR_RATE_PER_H = 1.0 / 24.0
DEFAULT_PRIOR_STRENGTH_H = 24.0
# Three hours either side: business-hour peaks in the traces span several hours.
DEFAULT_SMOOTH_BINS = 3
# How strongly one hour of the week is pulled toward the all-week rate (node-hours).
DEFAULT_BIN_STRENGTH_H = 6.0


class HazardError(ValueError):
    """Bad input to the hazard model; the message names the value and what would be right."""


def hour_of_week(ts: float) -> int:
    """Hour of the week (0..167, Monday 00:00 UTC = 0) of a Unix timestamp; HazardError when
    ``ts`` is not a finite number."""
    _check_time("timestamp", ts)
    return (math.floor(ts / 3600.0) + _EPOCH_HOUR_OFFSET) % HOURS_PER_WEEK


def _check_time(name: str, v: float) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise HazardError(f"hazard: {name} must be a finite number of Unix seconds, got {v!r}")
    return float(v)


def _check_pos(name: str, v: float, allow_zero: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or math.isinf(v):
        raise HazardError(f"hazard: {name} must be a finite number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise HazardError(f"hazard: {name} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)


@dataclass
class HazardModel:
    """Departure rate of one provider's nodes by hour of week (see the module docstring).

    ``events[h]`` and ``exposure_h[h]`` are the raw evidence for hour ``h``: departures seen and
    node-hours watched. Rates are derived on demand and cached until new evidence arrives.
    """

    provider: str = "default"
    prior_rate_per_h: float = DEFAULT_PRIOR_RATE_PER_H
    prior_strength_h: float = DEFAULT_PRIOR_STRENGTH_H
    smooth_bins: int = DEFAULT_SMOOTH_BINS
    bin_strength_h: float = DEFAULT_BIN_STRENGTH_H
    events: list[float] = field(default_factory=lambda: [0.0] * HOURS_PER_WEEK)
    exposure_h: list[float] = field(default_factory=lambda: [0.0] * HOURS_PER_WEEK)
    _rates: list[float] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_pos("prior_rate_per_h", self.prior_rate_per_h, allow_zero=True)
        _check_pos("prior_strength_h", self.prior_strength_h)
        _check_pos("bin_strength_h", self.bin_strength_h)
        if not isinstance(self.smooth_bins, int) or not 0 <= self.smooth_bins < HOURS_PER_WEEK // 2:
            raise HazardError(f"hazard: smooth_bins must be an integer in 0..83, got {self.smooth_bins!r}")
        for name in ("events", "exposure_h"):
            v = getattr(self, name)
            if len(v) != HOURS_PER_WEEK:
                raise HazardError(f"hazard: {name} must have {HOURS_PER_WEEK} entries, got {len(v)}")
            for x in v:
                _check_pos(name, x, allow_zero=True)

    # -- evidence ---------------------------------------------------------------------------

    def observe_exposure(self, t0: float, t1: float, nodes: float = 1.0) -> None:
        """Records that ``nodes`` nodes of this provider were up (and could have been taken back)
        from ``t0`` to ``t1`` (Unix seconds). Raises HazardError if t1 < t0, either is not
        finite, or nodes < 0."""
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (t0, t1)):
            raise HazardError(f"hazard: exposure bounds must be finite Unix seconds, got {t0!r} .. {t1!r}")
        if t1 < t0:
            raise HazardError(f"hazard: exposure ends before it starts ({t0!r} .. {t1!r})")
        _check_pos("nodes", nodes, allow_zero=True)
        for h, secs in _split_by_hour(t0, t1):
            self.exposure_h[h] += nodes * secs / 3600.0
        self._rates = None

    def observe_reclaim(self, ts: float, count: float = 1.0) -> None:
        """Records ``count`` departures (reclaims, preemptions) at time ``ts``."""
        _check_pos("count", count, allow_zero=True)
        self.events[hour_of_week(ts)] += count
        self._rates = None

    @property
    def total_events(self) -> float:
        return float(sum(self.events))

    @property
    def total_exposure_h(self) -> float:
        return float(sum(self.exposure_h))

    # -- rates ------------------------------------------------------------------------------

    def weekly_rate_per_h(self) -> float:
        """The all-week posterior mean rate (departures per node-hour)."""
        a = self.prior_rate_per_h * self.prior_strength_h + self.total_events
        return a / (self.prior_strength_h + self.total_exposure_h)

    def rates_per_h(self) -> list[float]:
        """The posterior mean rate of each hour of the week (departures per node-hour)."""
        if self._rates is not None:
            return self._rates
        w = self.smooth_bins
        kernel = [float(w + 1 - abs(d)) for d in range(-w, w + 1)]
        norm = sum(kernel)
        kernel = [k / norm for k in kernel]
        g = self.weekly_rate_per_h()
        out = []
        for h in range(HOURS_PER_WEEK):
            k = t = 0.0
            for i, kw in enumerate(kernel):
                b = (h + i - w) % HOURS_PER_WEEK
                k += kw * self.events[b]
                t += kw * self.exposure_h[b]
            out.append((g * self.bin_strength_h + k) / (self.bin_strength_h + t))
        self._rates = out
        return out

    def rate_per_h(self, ts: float) -> float:
        """Departure rate (per node-hour) at time ``ts``."""
        return self.rates_per_h()[hour_of_week(ts)]

    def rate_per_s(self, ts: float) -> float:
        """Departure rate (per node-second) at time ``ts``."""
        return self.rate_per_h(ts) / 3600.0

    def cumulative_hazard(self, t0: float, t1: float) -> float:
        """Integral of the rate from ``t0`` to ``t1`` (expected departures of one node), exact
        over the hour bins. Raises HazardError if t1 < t0 or either is not finite."""
        _check_time("interval start", t0)
        _check_time("interval end", t1)
        if t1 < t0:
            raise HazardError(f"hazard: interval ends before it starts ({t0!r} .. {t1!r})")
        rates = self.rates_per_h()
        span = t1 - t0
        weeks = math.floor(span / (HOURS_PER_WEEK * 3600.0))
        total = weeks * sum(rates)  # whole weeks: every hour once, one hour each
        start = t0 + weeks * HOURS_PER_WEEK * 3600.0
        for h, secs in _split_by_hour(start, t1):
            total += rates[h] * secs / 3600.0
        return total

    def survival(self, ts: float, horizon_s: float) -> float:
        """Probability that a node up at ``ts`` is still up ``horizon_s`` seconds later."""
        _check_pos("horizon_s", horizon_s, allow_zero=True)
        return math.exp(-self.cumulative_hazard(ts, ts + horizon_s))

    def mean_rate_per_s(self, ts: float, horizon_s: float) -> float:
        """Average departure rate over ``[ts, ts + horizon_s]`` (per second); the instantaneous
        rate at ``ts`` when the horizon is 0."""
        _check_pos("horizon_s", horizon_s, allow_zero=True)
        if horizon_s == 0:
            return self.rate_per_s(ts)
        return self.cumulative_hazard(ts, ts + horizon_s) / horizon_s

    def mtbf_s(self, ts: float, horizon_s: float = 0.0) -> float:
        """Mean time between departures implied by the average rate over the horizon (seconds);
        ``math.inf`` when the rate is zero."""
        r = self.mean_rate_per_s(ts, horizon_s)
        return math.inf if r <= 0 else 1.0 / r

    def log_likelihood(self, exposure: Iterable[tuple[float, float]], departures: Iterable[float]) -> float:
        """Log-likelihood of observed departures under this model as an inhomogeneous Poisson
        process: sum(log rate at each departure, per hour) - expected departures over the
        exposure intervals. Used to check a calibration against held-out traces."""
        ll = 0.0
        for t0, t1 in exposure:
            ll -= self.cumulative_hazard(t0, t1)
        for ts in departures:
            r = self.rate_per_h(ts)
            ll += math.log(r) if r > 0 else -math.inf
        return ll

    # -- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "prior_rate_per_h": self.prior_rate_per_h,
            "prior_strength_h": self.prior_strength_h,
            "smooth_bins": self.smooth_bins,
            "bin_strength_h": self.bin_strength_h,
            "events": list(self.events),
            "exposure_h": list(self.exposure_h),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HazardModel:
        """Inverse of :meth:`to_dict`; raises HazardError naming a missing or bad field."""
        try:
            return cls(
                provider=str(d["provider"]),
                prior_rate_per_h=d["prior_rate_per_h"],
                prior_strength_h=d["prior_strength_h"],
                smooth_bins=d["smooth_bins"],
                bin_strength_h=d["bin_strength_h"],
                events=[float(x) for x in d["events"]],
                exposure_h=[float(x) for x in d["exposure_h"]],
            )
        except KeyError as e:
            raise HazardError(f"hazard: saved model lacks field {e.args[0]!r}") from None

    def merged(self, other: HazardModel) -> HazardModel:
        """A new model with this model's prior and the evidence of both."""
        return HazardModel(
            provider=self.provider,
            prior_rate_per_h=self.prior_rate_per_h,
            prior_strength_h=self.prior_strength_h,
            smooth_bins=self.smooth_bins,
            bin_strength_h=self.bin_strength_h,
            events=[a + b for a, b in zip(self.events, other.events, strict=True)],
            exposure_h=[a + b for a, b in zip(self.exposure_h, other.exposure_h, strict=True)],
        )


class HazardSum:
    """The hazard of losing any of several nodes (a multi-node job): the sum of their models'
    rates. Offers the same questions as :class:`HazardModel` (rate, cumulative hazard,
    survival, MTBF), so the checkpoint scheduler takes either."""

    def __init__(self, models: Sequence[HazardModel]) -> None:
        if not models:
            raise HazardError("hazard: HazardSum needs at least one model")
        self.models = list(models)

    def rate_per_s(self, ts: float) -> float:
        return sum(m.rate_per_s(ts) for m in self.models)

    def cumulative_hazard(self, t0: float, t1: float) -> float:
        return sum(m.cumulative_hazard(t0, t1) for m in self.models)

    def survival(self, ts: float, horizon_s: float) -> float:
        _check_pos("horizon_s", horizon_s, allow_zero=True)
        return math.exp(-self.cumulative_hazard(ts, ts + horizon_s))

    def mean_rate_per_s(self, ts: float, horizon_s: float) -> float:
        _check_pos("horizon_s", horizon_s, allow_zero=True)
        if horizon_s == 0:
            return self.rate_per_s(ts)
        return self.cumulative_hazard(ts, ts + horizon_s) / horizon_s

    def mtbf_s(self, ts: float, horizon_s: float = 0.0) -> float:
        r = self.mean_rate_per_s(ts, horizon_s)
        return math.inf if r <= 0 else 1.0 / r


def _split_by_hour(t0: float, t1: float) -> Iterable[tuple[int, float]]:
    """Yields (hour of week, seconds) for the pieces of [t0, t1) cut at whole hours."""
    t = t0
    while t < t1:
        edge = (math.floor(t / 3600.0) + 1) * 3600.0
        end = min(edge, t1)
        yield hour_of_week(t), end - t
        t = end
