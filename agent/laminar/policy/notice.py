"""Notice odds: the share of departures that come without a usable notice (pure).

:class:`NoticeOdds` counts departures seen with a usable notice and without (a peer that fell
silent with no reclaim notice, a replica's source that died unannounced) and gives the
posterior mean share of *unannounced* departures under a Beta prior. The checkpoint scheduler
uses it as ``unannounced_frac`` and the prestage rule (:func:`laminar.policy.prestage.should_prestage`)
keeps an off-node replica while departures without notice are plausible. The agent keeps the
counts across restarts in its store (:class:`laminar.migrate.evidence.EvidenceStore`); the
simulator and ``bench/workloss.py`` use the same class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from laminar.policy.hazard import HazardError

# Without evidence, assume departures come unannounced (share 1: the cautious side); each
# announced departure seen then lowers the share.
DEFAULT_PRIOR_ANNOUNCED = 0.0
DEFAULT_PRIOR_UNANNOUNCED = 1.0


@dataclass
class NoticeOdds:
    """Departures seen with and without a usable notice, and the posterior share of the
    unannounced ones (``Beta(prior_unannounced, prior_announced)`` prior)."""

    announced: float = 0.0
    unannounced: float = 0.0
    prior_announced: float = DEFAULT_PRIOR_ANNOUNCED
    prior_unannounced: float = DEFAULT_PRIOR_UNANNOUNCED

    def __post_init__(self) -> None:
        for name in ("announced", "unannounced", "prior_announced", "prior_unannounced"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise HazardError(f"notice odds: {name} must be a finite number >= 0, got {v!r}")
        if self.prior_announced + self.prior_unannounced <= 0:
            raise HazardError("notice odds: the prior needs some weight (prior_announced + prior_unannounced > 0)")

    def observe(self, announced: bool, count: float = 1.0) -> None:
        """Records ``count`` departures, with (``announced``) or without a usable notice."""
        if count < 0:
            raise HazardError(f"notice odds: count must be >= 0, got {count!r}")
        if announced:
            self.announced += count
        else:
            self.unannounced += count

    @property
    def unannounced_frac(self) -> float:
        """Posterior mean share of departures that come without a usable notice, in (0, 1]
        (never 0: the scheduler divides by it)."""
        a = self.unannounced + self.prior_unannounced
        b = self.announced + self.prior_announced
        return max(1e-6, min(1.0, a / (a + b)))
