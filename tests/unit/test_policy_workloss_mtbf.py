"""bench/workloss.py gives the baselines (Slurm requeue, pipeline redundancy)
their static Daly interval from the pool's MTBF; that MTBF counts only up time inside the run.

A real 1-node preemption trace file written to tmp_path, read by the real loader, built into a
pool by the bench's own build_pool."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import workloss  # noqa: E402

from laminar.migrate.hazard import load_spot_trace  # noqa: E402


def _trace(tmp_path: Path, name: str, data: list[int]) -> Path:
    d = tmp_path / "preemption" / "1-node" / "aws-04-22-2023"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 3600}, "data": data}))
    return p


def test_baseline_mtbf_counts_no_up_time_past_the_run(tmp_path: Path) -> None:
    """Was: the intervals build_pool stretches 10 days past the end counted as exposure: this
    pool (21 node-hours up, 2 departures) had an MTBF of 130.5 h instead of 10.5 h."""
    # trace a: up 0-5 h, preempted 5-6 h, up 6-10 h, preempted 10-12 h (two departures);
    # trace b: up 0-12 h, to the run's end (never departs)
    a = load_spot_trace(_trace(tmp_path, "a", [0] * 5 + [1] + [0] * 4 + [1] * 2))
    b = load_spot_trace(_trace(tmp_path, "b", [0] * 12))
    pool, t0, end = workloss.build_pool([a, b], rotations=1)
    assert end - t0 == 12 * 3600
    # up: a 5 h + 4 h, b 12 h (not 12 h + 10 days): 21 node-hours over 2 departures
    assert workloss.pool_job_mtbf(pool, end, 1) == pytest.approx(21 * 3600 / 2)
    assert workloss.pool_job_mtbf(pool, end, 3) == pytest.approx(21 * 3600 / 2 / 3)
