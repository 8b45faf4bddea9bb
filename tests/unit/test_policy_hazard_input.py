"""The hazard model refuses non-finite times and bad spot traces by name
(HazardError) instead of hanging, overflowing or learning from NaN ticks. Real files in
tmp_path, the real loader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from laminar.migrate.hazard import HazardError, HazardModel, calibrate_from_spot_traces, load_spot_trace


def _trace(tmp_path: Path, body: str | bytes) -> Path:
    d = tmp_path / "preemption" / "1-node" / "aws-04-22-2023"
    d.mkdir(parents=True)
    p = d / "t.json"
    if isinstance(body, bytes):
        p.write_bytes(body)
    else:
        p.write_text(body)
    return p


@pytest.mark.parametrize("gap", ["NaN", "Infinity", "-Infinity", "0", "-60"])
def test_spot_trace_gap_must_be_finite_and_positive(tmp_path: Path, gap: str) -> None:
    """Was: NaN and Infinity (valid in Python's JSON) were accepted; calibrating then died
    with `cannot convert float NaN to integer` / an OverflowError naming no file."""
    p = _trace(tmp_path, '{"metadata": {"gap_seconds": ' + gap + '}, "data": [0, 0, 1, 0, 1]}')
    with pytest.raises(HazardError, match=r"t.json: metadata.gap_seconds must be a finite number > 0"):
        load_spot_trace(p)
    with pytest.raises(HazardError, match=r"t.json"):
        calibrate_from_spot_traces(tmp_path)


def test_spot_trace_not_utf8_is_a_hazard_error(tmp_path: Path) -> None:
    """Was: a UnicodeDecodeError escaped (callers catching HazardError missed it)."""
    p = _trace(tmp_path, b"\x1f\x8b\x08\x00\xff\xfe binary")
    with pytest.raises(HazardError, match=r"cannot read spot trace .*t.json"):
        load_spot_trace(p)


@pytest.mark.parametrize(("t0", "t1"), [(0.0, math.inf), (math.nan, 10.0), (0.0, math.nan), (-math.inf, 0.0)])
def test_exposure_with_non_finite_times_is_refused(t0: float, t1: float) -> None:
    """Was: observe_exposure(0, inf) looped forever (one pass per hour of an endless span);
    NaN bounds were silently ignored."""
    m = HazardModel()
    with pytest.raises(HazardError, match=r"exposure .* must be finite"):
        m.observe_exposure(t0, t1)
    assert m.total_exposure_h == 0


@pytest.mark.parametrize("ts", [math.nan, math.inf])
def test_reclaim_and_queries_with_non_finite_times_are_refused(ts: float) -> None:
    """Was: `cannot convert float NaN to integer` / OverflowError (not HazardError)."""
    m = HazardModel()
    with pytest.raises(HazardError, match=r"must be a finite"):
        m.observe_reclaim(ts)
    with pytest.raises(HazardError, match=r"must be a finite"):
        m.rate_per_s(ts)
    with pytest.raises(HazardError, match=r"must be a finite"):
        m.cumulative_hazard(0.0, ts)



def test_directory_with_an_impossible_date_is_a_hazard_error(tmp_path: Path) -> None:
    """Was: `ValueError: month must be in 1..12`, naming neither the file nor the directory."""
    d = tmp_path / "preemption" / "1-node" / "aws-13-45-2023"
    d.mkdir(parents=True)
    (d / "t.json").write_text('{"metadata": {"gap_seconds": 60}, "data": [0, 1]}')
    with pytest.raises(HazardError, match=r"t.json: directory 'aws-13-45-2023' names no real date"):
        load_spot_trace(d / "t.json")
