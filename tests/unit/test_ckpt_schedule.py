"""Checkpoint scheduler: Young/Daly under a time-varying hazard, bandwidth shares, notice window."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laminar.migrate.hazard import HazardModel
from laminar.policy.ckpt_schedule import (
    CkptJob,
    ScheduleError,
    daly_interval,
    hazard_interval,
    notice_fit,
    notice_schedule,
    plan,
    stagger,
    young_interval,
)

MONDAY = datetime(2023, 4, 24, tzinfo=UTC).timestamp()
GB = 1e9


def test_young_and_daly_agree_when_cost_is_small() -> None:
    assert young_interval(10, 3600) == pytest.approx(math.sqrt(2 * 10 * 3600))
    assert daly_interval(10, 36000) == pytest.approx(young_interval(10, 36000), rel=0.02)
    assert daly_interval(100, 40) == 40  # C >= 2M: checkpoint every M
    assert daly_interval(10, math.inf) == math.inf


@given(st.floats(0.1, 1000), st.floats(60, 1e6))
def test_the_daly_interval_minimises_expected_waste(cost: float, mtbf: float) -> None:
    """Expected waste fraction for exponential failures, W(t) = C/t + (t + C)/(2M) to first
    order; the Daly interval is within a few percent of the minimiser of the exact
    exponential model, whose waste must not beat it by more than a little."""
    tau = daly_interval(cost, mtbf)

    def waste(t: float) -> float:  # exact expected time per unit of work (Daly's model)
        return mtbf * math.exp(cost / mtbf) * (math.exp((t + cost) / mtbf) - 1) / (t * math.exp(cost / mtbf))

    if cost < 2 * mtbf:
        assert waste(tau) <= min(waste(tau * 0.5), waste(tau * 2)) * 1.0001


def test_interval_shrinks_when_the_hazard_rises() -> None:
    calm = HazardModel(prior_rate_per_h=0.05)
    stormy = HazardModel(prior_rate_per_h=2.0)
    t_calm, m_calm = hazard_interval(20, calm, MONDAY)
    t_storm, m_storm = hazard_interval(20, stormy, MONDAY)
    assert t_storm < t_calm
    assert m_calm == pytest.approx(3600 / 0.05)
    assert t_storm == pytest.approx(daly_interval(20, 1800), rel=1e-3)


def test_interval_looks_ahead_to_a_coming_peak() -> None:
    """At 08:00 on Mondays, with departures concentrated at 09:00-10:00, the interval is shorter
    than the rate at 08:00 alone would give: the average over the interval counts the peak."""
    m = HazardModel(prior_rate_per_h=0.02, smooth_bins=0, bin_strength_h=0.5)
    for w in range(6):
        t = MONDAY + w * 7 * 86400
        m.observe_exposure(t, t + 7 * 86400)
        for k in range(10):
            m.observe_reclaim(t + 9 * 3600 + k * 300)
    now = MONDAY + 7 * 3600 + 1800
    rate_now_mtbf = m.mtbf_s(now)
    tau, mtbf = hazard_interval(120, m, now)
    assert mtbf < rate_now_mtbf
    assert tau < daly_interval(120, rate_now_mtbf)


def test_shares_drop_when_coresident_jobs_prestage_too() -> None:
    h = HazardModel(prior_rate_per_h=1.0)
    one = plan([CkptJob("a", 20 * GB)], h, MONDAY, link_bps=1.25e9, notice_window_s=5)
    three = plan([CkptJob(n, 20 * GB) for n in "abc"], h, MONDAY, link_bps=1.25e9, notice_window_s=5)
    assert one["a"].prestage and three["a"].prestage
    assert three["a"].share_bps < one["a"].share_bps
    assert three["a"].cost_s > one["a"].cost_s
    assert three["a"].interval_s > one["a"].interval_s  # dearer checkpoints, taken less often


def test_jobs_that_fit_the_window_pay_only_the_write() -> None:
    h = HazardModel(prior_rate_per_h=0.5)
    jobs = [CkptJob("small", 1 * GB, write_bps=2 * GB), CkptJob("big", 100 * GB, write_bps=2 * GB)]
    p = plan(jobs, h, MONDAY, link_bps=1.25e9, notice_window_s=60)
    assert not p["small"].prestage and p["small"].cost_s == pytest.approx(0.5)
    assert p["big"].prestage and p["big"].cost_s > 50
    assert "prestaged" in p["big"].reason


def test_only_unannounced_departures_count_for_jobs_that_fit_the_window() -> None:
    h = HazardModel(prior_rate_per_h=1.0)
    p_all = plan([CkptJob("a", 1 * GB, write_bps=2 * GB)], h, MONDAY, 1.25e9, 60)
    p_some = plan([CkptJob("a", 1 * GB, write_bps=2 * GB)], h, MONDAY, 1.25e9, 60, unannounced_frac=0.1)
    assert p_some["a"].mtbf_s == pytest.approx(10 * p_all["a"].mtbf_s)
    assert p_some["a"].interval_s > 3 * p_all["a"].interval_s
    with pytest.raises(ScheduleError, match="rollback_frac"):
        hazard_interval(1, h, MONDAY, rollback_frac=0)


def test_notice_fit_packs_smallest_first() -> None:
    fast = 1e12  # local writes take no time here: only the uplink counts
    jobs = [CkptJob("a", 30 * GB, fast), CkptJob("b", 10 * GB, fast), CkptJob("c", 10 * GB, fast)]
    # 1 GB/s, 30 s window * 0.8 = 24 s: b and c (10 s each) fit, a does not
    assert notice_fit(jobs, 1 * GB, 30) == {"a": False, "b": True, "c": True}
    steps = {s.job_id: s for s in notice_schedule(jobs, 1 * GB, 30)}
    assert steps["b"].final and steps["c"].final and not steps["a"].final
    assert steps["c"].transfer_start_s >= steps["b"].transfer_start_s + 10 - 1e-6
    # they keep training until the latest safe moment: 24 s usable, 20 s needed
    assert steps["b"].signal_at_s == pytest.approx(4.0, abs=0.05) and steps["a"].signal_at_s == 0
    assert steps["c"].deadline_s <= 24.0 + 1e-9
    # with slow local disks the writes delay the transfers: only b fits
    slow = [CkptJob(j.job_id, j.size_bytes, write_bps=1 * GB) for j in jobs]
    assert notice_fit(slow, 1 * GB, 30) == {"a": False, "b": True, "c": False}


def test_stagger_avoids_overlap_within_the_delay_bound() -> None:
    s = stagger([("a", 100, 10), ("b", 102, 10), ("c", 200, 5)])
    assert s == {"a": 100, "b": 110, "c": 200}
    s = stagger([("a", 100, 50), ("b", 101, 10)], max_delay_s=20)
    assert s["b"] == 121


def test_bad_input_is_named() -> None:
    with pytest.raises(ScheduleError, match="size_bytes"):
        CkptJob("x", -1)
    with pytest.raises(ScheduleError, match="duplicate"):
        plan([CkptJob("x", 1), CkptJob("x", 2)], HazardModel(), MONDAY, 1e9, 10)
    with pytest.raises(ScheduleError, match="link_bps"):
        notice_fit([CkptJob("x", 1)], 0, 10)
