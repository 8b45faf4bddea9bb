"""In the simulator, fractional-GPU jobs never share a GPU beyond its whole
(the shares on one device sum to at most 1) under the probe placement (laminar, noloan,
requeue) as under best-fit. Real engine, a one-GPU node (a fake cluster, named so)."""

from __future__ import annotations

import pytest

from laminar.sim.engine import simulate
from laminar.sim.trace import JobSpec, NodeSpec


@pytest.mark.parametrize("policy", ["noloan", "laminar", "bestfit"])
def test_shares_summing_above_one_do_not_run_together(policy: str) -> None:
    """Was: the probe placement reserved the share rounded to 2 decimals, so a 0.444 share
    reserved 0.44 and ran beside a 0.56 share on one GPU (1.004 of it)."""
    jobs = [JobSpec("a", 0.0, 1000.0, worker_gpus=0.444), JobSpec("b", 0.0, 1000.0, worker_gpus=0.56)]
    nodes = [NodeSpec("fake-1gpu", 1, 8.0, 65_536)]
    r = simulate(jobs, nodes, policy)
    assert r.completed == 2
    assert max(r.queue.values()) >= 1000.0 - 1e-6  # the second waited for the first to finish


@pytest.mark.parametrize("policy", ["noloan", "laminar"])
def test_a_tiny_share_reserves_some_gpu(policy: str) -> None:
    """Was: a share below 0.005 rounded to 0 GPUs and ran on a GPU a whole-GPU job held."""
    jobs = [JobSpec("whole", 0.0, 1000.0, worker_gpus=1.0), JobSpec("tiny", 0.0, 1000.0, worker_gpus=0.004)]
    r = simulate(jobs, [NodeSpec("fake-1gpu", 1, 8.0, 65_536)], policy)
    assert r.completed == 2 and max(r.queue.values()) >= 1000.0 - 1e-6


def test_shares_that_fit_still_share() -> None:
    jobs = [JobSpec("a", 0.0, 1000.0, worker_gpus=0.445), JobSpec("b", 0.0, 1000.0, worker_gpus=0.55)]
    r = simulate(jobs, [NodeSpec("fake-1gpu", 1, 8.0, 65_536)], "noloan")
    assert max(r.queue.values()) == 0.0
