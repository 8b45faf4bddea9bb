"""bench/workloss.py's pipeline-redundancy baseline (docs/baselines.md): after a failover that
found no free node it runs degraded, and takes a free node as soon as one is up (Bamboo and
Oobleck add joining nodes to the pipeline); only a second departure *while degraded* exceeds
the redundancy and rolls back.

Real 1-node preemption trace files written to tmp_path, read by the real loader, built into a
pool by the bench's own build_pool, run through the bench's own simulate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import workloss  # noqa: E402

from laminar.migrate.hazard import load_spot_trace  # noqa: E402

H = 3600.0


def _trace(tmp_path: Path, name: str, data: list[int]) -> Path:
    d = tmp_path / "preemption" / "1-node" / "aws-04-22-2023"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 3600}, "data": data}))
    return p


def _pool(tmp_path: Path) -> tuple[list[workloss.Node], float, float]:
    # a: up 0-9 h; b: up 0-4 h; c: preempted until 6 h, then up (1 = preempted)
    a = load_spot_trace(_trace(tmp_path, "a", [0] * 9 + [1] * 3))
    b = load_spot_trace(_trace(tmp_path, "b", [0] * 4 + [1] * 8))
    c = load_spot_trace(_trace(tmp_path, "c", [1] * 6 + [0] * 6))
    return workloss.build_pool([a, b, c], rotations=1)


def test_degraded_pipeline_takes_the_node_that_frees_before_the_next_departure(tmp_path: Path) -> None:
    """Was: the pipeline stayed degraded (one node of two) from b's departure at 4 h until a's
    at 9 h, though c was up and free from 6 h: a's departure counted as a second loss and
    rolled the job back to its last checkpoint, a handicap the baseline's definition does
    not have."""
    pool, t0, end = _pool(tmp_path)
    assert end - t0 == 12 * H
    p = workloss.Params(nodes_per_job=2, rotations=1)
    r = workloss.simulate("redundancy", pool, t0, end, p, seed=0)
    assert r.reclaims == 2  # b at 4 h, a at 9 h
    assert r.rollback_node_s == 0.0  # a's departure found the pipeline whole again: a failover
    # failover at 4 h (no free node), c joins at 6 h (a re-plan), failover at 9 h
    assert r.down["reconfig"] == 3 * p.reconfig_s
    assert r.down["requeue_delay"] == 0.0 and r.down["wait_capacity"] == 0.0
    # degraded 4 h -> 6 h and 9 h -> 12 h (b is gone for good): progress at 1/2 of the rate there
    assert abs(r.useful_node_s - (2 * 4 * H + 1 * (2 * H - 30) + 2 * (3 * H - 30) + 1 * (3 * H - 30))) < 1.0


def test_the_other_policies_are_unchanged_on_the_same_pool(tmp_path: Path) -> None:
    pool, t0, end = _pool(tmp_path)
    p = workloss.Params(nodes_per_job=2, rotations=1)
    req = workloss.simulate("requeue", pool, t0, end, p, seed=0)
    assert req.reclaims == 2 and req.down["reconfig"] == 0.0 and req.rollback_node_s > 0
