"""bench/workloss.py counts downtime inside the run only: a reclaim just before the end of the
traces charges its requeue, wait and restart up to the end, not past it, and a job that can
never get its nodes back is down until the end, not forever.

Real 1-node preemption trace files (60 s ticks) written to tmp_path, read by the real loader,
built into a pool by the bench's own build_pool, run through the bench's own simulate."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import workloss  # noqa: E402

from laminar.migrate.hazard import load_spot_trace  # noqa: E402

TICKS = 120  # 60 s each: the run is 2 h


def _pool(tmp_path: Path, c_data: list[int]) -> tuple[list[workloss.Node], float, float]:
    d = tmp_path / "preemption" / "1-node" / "aws-04-22-2023"
    d.mkdir(parents=True, exist_ok=True)
    traces = []
    # a: up all along; b: leaves 60 s before the end; c: as given (1 = preempted)
    for name, data in (("a", [0] * TICKS), ("b", [0] * (TICKS - 1) + [1]), ("c", c_data)):
        (d / f"{name}.json").write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": data}))
        traces.append(load_spot_trace(d / f"{name}.json"))
    return workloss.build_pool(traces, rotations=1)


def test_a_requeue_just_before_the_end_is_charged_up_to_the_end(tmp_path: Path) -> None:
    """Was: 90 s of downtime (30 s requeue, 60 s restart) for the last 60 s of the run."""
    # c is up from 1 h on, so the job (on a and b, the only nodes up at its start) restarts on a and c
    pool, t0, end = _pool(tmp_path, [1] * 60 + [0] * 60)
    p = workloss.Params(nodes_per_job=2, rotations=1)
    r = workloss.simulate("requeue", pool, t0, end, p, seed=0)
    assert r.reclaims == 1
    assert r.downtime_s == 60.0  # b left at end - 60 s
    assert r.down["requeue_delay"] == 30.0 and r.down["restart"] == 30.0
    assert sum(r.down.values()) == r.downtime_s


def test_a_job_that_never_gets_its_nodes_back_is_down_until_the_end(tmp_path: Path) -> None:
    """Was: an infinite downtime (the wait for nodes that never come), which made every total
    and every reduction against it meaningless."""
    pool, t0, end = _pool(tmp_path, [1] * TICKS)  # c never up: after b leaves only a is left
    p = workloss.Params(nodes_per_job=2, rotations=1)
    for policy in ("requeue", "redundancy"):
        r = workloss.simulate(policy, pool, t0, end, p, seed=0)
        assert math.isfinite(r.downtime_s), policy
        assert r.downtime_s <= 60.0, (policy, r.down)
        assert sum(r.down.values()) == r.downtime_s
