"""The prestage rule: whether a job's checkpoints are shipped off its node as they are written.

A job is *prestaged* when its newest checkpoint should already sit on another node before any
notice comes: its final checkpoint would not make it out within the notice window expected
(``[migrate] expected_notice_s``, judged over all the node's jobs sharing one uplink:
:func:`laminar.policy.ckpt_schedule.notice_fit`), or departures without notice are plausible
(the learned share of unannounced departures, :class:`laminar.policy.notice.NoticeOdds`, is at
least ``prestage_unannounced``). ``prestage = "always"`` / ``"off"`` override the rule.

One rule, several callers, each passing the facts it has (issue 32 found it written four times):

- the reclaim component decides whether to send (every fact; the fit computed only when the
  other facts leave it open, hence ``fits`` may be a callable);
- the checkpoint scheduler (:func:`laminar.policy.ckpt_schedule.plan`) costs the transfer of a
  prestaged job into its interval; it judges the fit alone (no unannounced branch: there the
  unannounced share sets the rollback share instead, :func:`rollback_frac`);
- the archive's periodic copies follow the unannounced branch alone (:func:`unannounced_plausible`);
- the simulator and the scheduler weigh a job's departures by :func:`rollback_frac`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

PRESTAGE_MODES = ("auto", "always", "off")


def unannounced_plausible(unannounced_frac: float, threshold: float) -> bool:
    """Departures without notice are plausible: their learned share is at least ``threshold``."""
    return unannounced_frac >= threshold


def should_prestage(mode: str, fits: bool | Callable[[], bool], *, window_s: float | None = None,
                    unannounced_frac: float = 0.0, unannounced_threshold: float = math.inf) -> bool:
    """Whether a job is prestaged. ``mode``: one of :data:`PRESTAGE_MODES`. ``fits``: whether its
    final checkpoint fits the notice window beside the node's other jobs (or a callable giving
    it, called only when the answer depends on it). ``window_s``: the window expected; None when
    ``fits`` already judged it. The unannounced branch applies only with a threshold."""
    if mode == "always":
        return True
    if mode == "off":
        return False
    if unannounced_plausible(unannounced_frac, unannounced_threshold):
        return True  # departures without notice are plausible: keep an off-node replica
    if window_s is not None and window_s <= 0:
        return True  # no notice expected: nothing fits it
    return not (fits() if callable(fits) else fits)


def rollback_frac(fits: bool, unannounced_frac: float) -> float:
    """The share of departures that roll a job back to its last checkpoint: only those without
    notice when its final checkpoint fits the window, every one when it does not."""
    return unannounced_frac if fits else 1.0
