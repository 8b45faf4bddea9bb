"""bench/workloss.py's reductions against a baseline that lost nothing: undefined, reported as
null in the JSON (with the reason) and "n/a" in text, never as a number.

Pure functions of the bench (no trace needed): red, reductions, both_configs, fmt_red."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import workloss  # noqa: E402


def test_reduction_against_zero_is_undefined_not_zero() -> None:
    """Was: 0.0 (it reads as "no improvement") whenever the baseline's total was 0."""
    assert workloss.red(0.0, 0.0) is None
    assert workloss.red(5.0, 0.0) is None
    assert workloss.red(5.0, 10.0) == 50.0
    assert workloss.red(0.0, 10.0) == 100.0
    assert workloss.red(15.0, 10.0) == -50.0


@pytest.mark.parametrize("a,b", [(-1.0, 10.0), (1.0, -2.0), (math.nan, 1.0), (1.0, math.inf)])
def test_reduction_refuses_impossible_totals(a: float, b: float) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        workloss.red(a, b)


def test_headline_keys_null_with_reason_when_a_baseline_lost_nothing() -> None:
    # requeue lost work but had no downtime; redundancy lost nothing at all
    tot = {"laminar": (10.0, 7200.0), "requeue": (40.0, 0.0), "redundancy": (0.0, 0.0)}
    out = workloss.reductions(tot)
    assert out["workloss_reduction_vs_requeue_pct"] == 75.0
    assert out["workloss_reduction_vs_redundancy_pct"] is None
    assert "redundancy had no work lost" in str(out["workloss_reduction_vs_redundancy_pct_na_reason"])
    assert out["downtime_reduction_vs_requeue_pct"] is None
    assert out["downtime_reduction_pct"] is None  # against the baseline with the least downtime: 0
    assert "undefined" in str(out["downtime_reduction_pct_na_reason"])
    assert "workloss_reduction_vs_requeue_pct_na_reason" not in out
    doc = json.loads(json.dumps(out))
    assert doc["downtime_reduction_pct"] is None  # null in the JSON
    assert workloss.fmt_red(out["downtime_reduction_pct"]) == "n/a"
    assert workloss.fmt_red(out["workloss_reduction_vs_requeue_pct"]) == "-75.0%"


def test_downtime_reduction_is_against_the_baseline_with_least_downtime() -> None:
    tot = {"laminar": (10.0, 60.0), "requeue": (40.0, 120.0), "redundancy": (30.0, 80.0)}
    out = workloss.reductions(tot)
    assert out["downtime_reduction_vs_requeue_pct"] == 50.0
    assert out["downtime_reduction_vs_redundancy_pct"] == 25.0
    assert out["downtime_reduction_pct"] == 25.0
    assert not any(k.endswith("_na_reason") for k in out)


def test_both_configs_carries_the_reason_of_the_run_without_archive() -> None:
    base = {"requeue_work_lost_node_h": 0.0, "redundancy_work_lost_node_h": 0.0}
    arch = {**base, **workloss.reductions({"laminar": (1.0, 1.0), "requeue": (2.0, 2.0), "redundancy": (4.0, 4.0)})}
    no = {**base, **workloss.reductions({"laminar": (3.0, 1.0), "requeue": (0.0, 2.0), "redundancy": (4.0, 4.0)})}
    out = workloss.both_configs(arch, no)
    assert out["workloss_reduction_vs_requeue_pct"] == 50.0
    assert out["workloss_reduction_vs_requeue_pct_no_archive"] is None
    assert "requeue had no work lost" in str(out["workloss_reduction_vs_requeue_pct_no_archive_na_reason"])
