"""Hazard model: Bayesian hour-of-week rates, exact integration, calibration on the spot traces."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laminar.migrate.hazard import (
    HOURS_PER_WEEK,
    HazardError,
    HazardModel,
    calibrate_from_spot_traces,
    hour_of_week,
    load_spot_trace,
    model_from_traces,
    spot_trace_files,
)

SPOT = Path(__file__).resolve().parents[3] / "shared/data/spot-traces"
MONDAY = datetime(2023, 4, 24, tzinfo=UTC).timestamp()  # a Monday, 00:00 UTC


def test_hour_of_week_starts_monday_utc() -> None:
    assert hour_of_week(MONDAY) == 0
    assert hour_of_week(MONDAY + 3600 * 25) == 25
    assert hour_of_week(MONDAY - 1) == HOURS_PER_WEEK - 1


def test_no_evidence_gives_the_prior_everywhere() -> None:
    m = HazardModel(prior_rate_per_h=0.5)
    assert all(r == pytest.approx(0.5) for r in m.rates_per_h())
    # constant rate: survival is exp(-rate * hours), across hour and week boundaries
    assert m.survival(MONDAY + 1234, 10 * 3600) == pytest.approx(math.exp(-5.0))
    assert m.survival(MONDAY, 2 * 7 * 24 * 3600 + 1800) == pytest.approx(math.exp(-0.5 * (336.5)))


def test_evidence_moves_the_rate_at_that_hour_of_week_only_nearby() -> None:
    m = HazardModel(prior_rate_per_h=0.01, smooth_bins=1, bin_strength_h=1.0)
    for week in range(8):
        t = MONDAY + week * 7 * 86400 + 9 * 3600  # Mondays 09:00
        m.observe_exposure(t, t + 3600)
        m.observe_reclaim(t + 600)
    for week in range(8):  # plenty of quiet exposure elsewhere
        t = MONDAY + week * 7 * 86400
        m.observe_exposure(t + 30 * 3600, t + 100 * 3600)
    peak = m.rate_per_h(MONDAY + 9 * 3600)
    quiet = m.rate_per_h(MONDAY + 60 * 3600)
    assert peak > 5 * quiet
    # smoothing shares the evidence with the neighbouring hours, not with far ones
    assert m.rate_per_h(MONDAY + 10 * 3600) > quiet
    assert m.rate_per_h(MONDAY + 12 * 3600) == pytest.approx(m.rate_per_h(MONDAY + 13 * 3600), rel=0.5)


@pytest.mark.skipif(not SPOT.exists(), reason=f"spot traces not at {SPOT}")
def test_cumulative_hazard_is_additive() -> None:
    m = calibrate_from_spot_traces(SPOT / "preemption/1-node/aws-04-22-2023")
    t0, t1, t2 = MONDAY + 1000, MONDAY + 50_000, MONDAY + 400_000
    assert m.cumulative_hazard(t0, t2) == pytest.approx(m.cumulative_hazard(t0, t1) + m.cumulative_hazard(t1, t2))


@given(st.floats(0, 1e6), st.floats(0, 1e6))
def test_survival_is_monotone_in_horizon(h1: float, h2: float) -> None:
    m = HazardModel(prior_rate_per_h=0.2)
    m.observe_exposure(MONDAY, MONDAY + 86400)
    m.observe_reclaim(MONDAY + 5000, 3)
    lo, hi = sorted((h1, h2))
    assert 0.0 <= m.survival(MONDAY, hi) <= m.survival(MONDAY, lo) <= 1.0


def test_roundtrip_and_bad_input() -> None:
    m = HazardModel(provider="campus", prior_rate_per_h=0.1)
    m.observe_exposure(MONDAY, MONDAY + 7200)
    m.observe_reclaim(MONDAY + 100)
    m2 = HazardModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert m2.rates_per_h() == m.rates_per_h()
    with pytest.raises(HazardError, match="prior_rate_per_h"):
        HazardModel(prior_rate_per_h=-1)
    with pytest.raises(HazardError, match="smooth_bins"):
        HazardModel(smooth_bins=100)
    with pytest.raises(HazardError, match="ends before"):
        m.observe_exposure(10, 5)
    with pytest.raises(HazardError, match="lacks field 'events'"):
        HazardModel.from_dict({k: v for k, v in m.to_dict().items() if k != "events"})


def test_spot_trace_reading_follows_1_means_preempted(tmp_path: Path) -> None:
    d = tmp_path / "aws-04-22-2023"
    d.mkdir()
    f = d / "zone_v100_1.json"
    f.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [1, 0, 0, 1, 1, 0, 1]}))
    tr = load_spot_trace(f)
    start = datetime(2023, 4, 22, tzinfo=UTC).timestamp()
    assert tr.start_ts == start
    assert tr.departures() == [start + 180, start + 360]
    assert tr.up_intervals() == [(start + 60, start + 180), (start + 300, start + 360)]
    m = model_from_traces([tr], prior_strength_h=1e-9, bin_strength_h=1e-9)
    assert m.total_events == 2
    assert m.total_exposure_h == pytest.approx(180 / 3600)


def test_spot_trace_errors_name_the_value(tmp_path: Path) -> None:
    f = tmp_path / "x.json"
    f.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [0, 4]}))
    with pytest.raises(HazardError, match=r"data\[1\] = 4"):
        load_spot_trace(f, start_ts=0)
    f.write_text(json.dumps({"metadata": {"gap_seconds": 0}, "data": [0]}))
    with pytest.raises(HazardError, match="gap_seconds"):
        load_spot_trace(f, start_ts=0)
    f.write_text(json.dumps({"metadata": {"gap_seconds": 5}, "data": [0]}))
    with pytest.raises(HazardError, match="pass start_ts"):
        load_spot_trace(f)
    with pytest.raises(HazardError, match="no 1-node preemption traces"):
        spot_trace_files(tmp_path)


@pytest.mark.skipif(not SPOT.exists(), reason=f"spot traces not at {SPOT}")
def test_calibration_on_real_traces_predicts_held_out_departures_better_than_the_prior() -> None:
    """Fit on three AWS V100 zones, score the fourth: the calibrated model must explain the
    held-out zone's departures better than the uninformed prior (higher log-likelihood)."""
    files = spot_trace_files(SPOT / "preemption/1-node/aws-04-22-2023")
    assert len(files) == 4
    traces = [load_spot_trace(f) for f in files]
    held = traces[-1]
    fitted = model_from_traces(traces[:-1])
    prior = HazardModel()
    ll_fit = fitted.log_likelihood(held.up_intervals(), held.departures())
    ll_prior = prior.log_likelihood(held.up_intervals(), held.departures())
    assert ll_fit > ll_prior
    # the AWS V100 zones of April 2023 lost a running instance every hour or two
    assert 0.2 < fitted.weekly_rate_per_h() < 5.0
    assert fitted.total_events == sum(len(t.departures()) for t in traces[:-1])


def test_an_availability_trace_file_is_not_read_as_preemptions() -> None:
    """A 1-node *availability* trace holds 0/1 too, but 1 means an instance is available: read
    as a preemption trace it was silently inverted (available hours counted as preempted, every
    return of capacity as up time ending) when ``migrate.spot_traces`` named such a file."""
    f = SPOT / "availability/1-node/aws-02-15-2023/us-east-1a_v100_1.json"
    if not f.exists():
        pytest.skip(f"spot traces not at {SPOT}")
    with pytest.raises(HazardError, match="availability"):
        calibrate_from_spot_traces(f)
    with pytest.raises(HazardError, match="availability"):
        load_spot_trace(f)
