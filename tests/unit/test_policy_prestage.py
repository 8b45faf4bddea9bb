"""The prestage rule, written once (laminar.policy.prestage), keeps each caller's old behaviour.

Each ``old_*`` below is the rule as its caller wrote it before issue 32 (copied verbatim but for
the names of the facts); every combination of the facts must give the same answer through the
one function, called as that caller now calls it.
"""

from __future__ import annotations

import itertools

from laminar.policy import ckpt_schedule as cs
from laminar.policy.prestage import PRESTAGE_MODES, rollback_frac, should_prestage, unannounced_plausible

MODES = PRESTAGE_MODES
FRACS = (1e-6, 0.01, 0.02, 0.5, 1.0)
THRESHOLDS = (0.0, 0.02, 0.5, 1.0, 2.0)
WINDOWS = (-1.0, 0.0, 0.5, 60.0)


def old_reclaim(mode: str, frac: float, threshold: float, w: float, fits: bool) -> bool:
    # migrate/reclaim.py Checkpoints.should_prestage
    if mode == "always":
        return True
    if mode == "off":
        return False
    if frac >= threshold:
        return True
    if w <= 0:
        return True
    return not fits


def test_reclaim_rule_unchanged() -> None:
    for mode, frac, thr, w, fits in itertools.product(MODES, FRACS, THRESHOLDS, WINDOWS, (True, False)):
        asked: list[bool] = []

        def fit(asked: list[bool] = asked, fits: bool = fits) -> bool:
            asked.append(True)
            return fits

        got = should_prestage(mode, fit, window_s=w, unannounced_frac=frac, unannounced_threshold=thr)
        assert got == old_reclaim(mode, frac, thr, w, fits), (mode, frac, thr, w, fits)
        # the fit (all jobs' notice_fit, cached per round) is computed only where the old rule reached it
        assert bool(asked) == (mode == "auto" and frac < thr and w > 0)


def test_scheduler_rule_unchanged() -> None:
    # ckpt_schedule.plan: ``pre = prestage and not fits[j]`` (no unannounced branch; the window
    # is inside the fit, 0 for "always")
    for prestage, fits in itertools.product((True, False), (True, False)):
        assert should_prestage("auto" if prestage else "off", fits) == (prestage and not fits)


def test_scheduler_plans_unchanged() -> None:
    # plan() end to end: the prestaged flag and the rollback share as the old expressions give them
    jobs = [cs.CkptJob("a", 1e9), cs.CkptJob("b", 4e10), cs.CkptJob("c", 0.0, pause_s=0.0)]
    hazard = _ConstHazard(3600.0)
    for window, prestage in itertools.product((0.0, 30.0, 600.0), (True, False)):
        fits = cs.notice_fit(jobs, 1.25e8, window)
        plans = cs.plan(jobs, hazard, 0.0, 1.25e8, window, unannounced_frac=0.2, prestage=prestage)
        for j in jobs:
            assert plans[j.job_id].prestage == (prestage and not fits[j.job_id])


def test_archive_rule_unchanged() -> None:
    # migrate/archive.py PeriodicCopies.periodic_due: ``unannounced_frac >= prestage_unannounced``
    for frac, thr in itertools.product(FRACS, THRESHOLDS):
        assert unannounced_plausible(frac, thr) == (frac >= thr)


def test_rollback_share_unchanged() -> None:
    # ckpt_schedule.plan and sim/engine.py _plan_checkpoint: ``frac if fits else 1.0``
    for frac, fits in itertools.product(FRACS, (True, False)):
        assert rollback_frac(fits, frac) == (frac if fits else 1.0)
    cost, wait = 12.0, 30.0  # the simulator's "fits": the checkpoint's cost within ckpt_wait_s
    assert rollback_frac(cost <= wait, 0.3) == 0.3
    assert rollback_frac(wait + 1 <= wait, 0.3) == 1.0


class _ConstHazard:
    def __init__(self, mtbf_s: float) -> None:
        self.m = mtbf_s

    def mtbf_s(self, t: float, horizon_s: float = 0.0) -> float:
        return self.m
