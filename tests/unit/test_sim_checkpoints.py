"""The simulator's checkpoint contract and destination choice run the migration layer's policy
code (laminar.policy.ckpt_schedule, .hazard, .destination), worked out by hand on tiny
clusters (FAKE nodes, as every simulated cluster).

The hazard in these runs is the prior alone (no inference pool, or a prior so strong that the
evidence moves nothing): a constant rate r per hour, so the interval is Daly's for an MTBF of
1 / r, which the tests compute with the policy's own ``daly_interval``.
"""

from __future__ import annotations

import math

import pytest

from laminar.policy.ckpt_schedule import daly_interval
from laminar.sim.cluster import fits_fast
from laminar.sim.engine import SimConfig, Simulator, simulate
from laminar.sim.trace import JobSpec, NodeSpec

# One checkpoint costs 3 s: a 2 s pause and 1 GB (1 GPU at 1 GB per GPU) at 1 GB/s.
COST = {"ckpt_pause_s": 2.0, "ckpt_gb_per_gpu": 1.0, "write_gbps": 1.0}
MTBF_S = 7200.0  # a prior of 0.5 departures per node-hour ...
PRIOR = {"hazard_prior_per_h": 3600.0 / MTBF_S, "hazard_prior_strength_h": 1e9}  # ... that evidence cannot move
TAU = daly_interval(3.0, MTBF_S)  # 205.85 s


def one_gpu(name: str, pool: str) -> NodeSpec:
    return NodeSpec(name, 1, 8, 16384, "T4", pool)


def test_periodic_checkpoints_pause_the_job_at_the_hazard_interval() -> None:
    """A 1,000 s job alone on a training node. The departures that would roll it back are all
    departures (none was seen with a notice yet), so it checkpoints every TAU of progress:
    at 205.85, 411.7, 617.6 and 823.4 s of it (the fifth would be at 1,029), each pausing it
    3 s: it ends at 1,012. Slurm's requeue takes no checkpoints: 1,000."""
    assert 4 * TAU < 1000 < 5 * TAU
    job = [JobSpec("a", 0, 1000, 1, 1.0, 1, 1024, 1)]
    cfg = SimConfig(**COST, **PRIOR)
    lam = simulate(job, [one_gpu("t0", "training")], "laminar", cfg)
    assert lam.checkpoints == 4 and lam.jct == {"a": pytest.approx(1012)}
    assert lam.ckpt_pause_gpu_s == pytest.approx(12)
    slurm = simulate(job, [one_gpu("t0", "training")], "requeue", cfg)
    assert slurm.checkpoints == 0 and slurm.jct == {"a": 1000}


def loan_run(ckpt_wait_s: float) -> Simulator:
    """train-0 and infer-0, 1 GPU each; a on train-0, b on the loaned infer-0, 2,000 s each;
    infer-0 is returned at the tick t = 900 (u = 0.5 of one server) and b requeued (no GPU free
    elsewhere)."""
    jobs = [JobSpec("a", 0, 2000, 1, 1.0, 1, 1024, 1), JobSpec("b", 0, 2000, 1, 1.0, 1, 1024, 1)]
    cfg = SimConfig(infer_low=0, infer_high=1, infer_period_s=3600, infer_noise=0, infer_tick_s=900,
                    ckpt_wait_s=ckpt_wait_s, **COST, **PRIOR)
    sim = Simulator(jobs, [one_gpu("train-0", "training"), one_gpu("infer-0", "inference")], "laminar", cfg)
    sim.run()
    return sim


def test_a_returned_job_whose_final_checkpoint_misses_the_wait_rolls_back_to_its_newest() -> None:
    """b checkpointed at TAU, 2 TAU + 3, 3 TAU + 6 and 4 TAU + 9 = 832.4 s (progress 4 TAU =
    823.4 s); at the return (t = 900) it has done 900 - 12 = 888 s. Its final checkpoint takes
    3 s: with 10 s to write it, b keeps its 888 s; with 2 s, it is not waited for and b rolls
    back to 823.4 s (64.6 GPU-s lost)."""
    kept = loan_run(ckpt_wait_s=10.0)
    assert kept.res.requeues == 1 and kept.res.rollbacks == 0 and kept.res.lost_gpu_s == 0
    rolled = loan_run(ckpt_wait_s=2.0)
    assert rolled.res.requeues == 1 and rolled.res.rollbacks == 1
    assert rolled.res.lost_gpu_s == pytest.approx(888 - 4 * TAU)
    assert rolled.res.jct["b"] > kept.res.jct["b"] + 60  # the 64.6 s are run again


def test_the_return_takes_the_server_whose_job_checkpointed_last() -> None:
    """Two loaned servers, no training pool; a starts at 0, b at 300; one server is wanted back
    at t = 900 (u = 0.07 of two servers, never above one). The return's cost is GPUs x seconds
    since the job's newest checkpoint (plus a restart): a checkpointed at 832.4 s (68 s before),
    b at 300 + 2 TAU + 3 = 714.7 s (185 s before): a's server goes back and a waits for b.
    Without periodic checkpoints (free ones) the cost counts from each job's start: a's 900 s
    against b's 600 s, and b's server goes back instead."""
    jobs = [JobSpec("a", 0, 2000, 1, 1.0, 1, 1024, 1), JobSpec("b", 300, 2000, 1, 1.0, 1, 1024, 1)]
    nodes = [one_gpu("infer-0", "inference"), one_gpu("infer-1", "inference")]
    base = {"infer_low": 0.0, "infer_high": 0.5, "infer_period_s": 7200, "infer_noise": 0.0, "infer_tick_s": 900}
    timed = simulate(jobs, nodes, "laminar", SimConfig(**base, **COST, **PRIOR))
    assert timed.servers_returned == 1 and timed.requeues == 1
    assert timed.jct["a"] > 300 + timed.jct["b"]  # a was requeued: it ends after b
    free = simulate(jobs, nodes, "laminar", SimConfig(**base, ckpt_pause_s=0.0, ckpt_gb_per_gpu=0.0))
    assert free.servers_returned == 1 and free.requeues == 1 and free.checkpoints == 0
    assert free.jct["a"] == 2000 and 300 + free.jct["b"] > 2000  # b was requeued: it ends after a


def test_destination_choice_weighs_the_pools_hazard_against_the_zone() -> None:
    """A worker leaving loaned server infer-0 fits on infer-1, in its own zone, and on t0, in the
    training pool's. With the pools' hazards equal, the same zone wins (another zone costs 30 s);
    once the inference pool is seen to take servers back often, t0 wins (a later return would
    cost a move and half an hour of exposure). Among equals, the tightest fit."""
    nodes = [NodeSpec("t0", 2, 8, 16384, "T4", "training"), one_gpu("infer-0", "inference"),
             one_gpu("infer-1", "inference"), one_gpu("t1", "training")]
    sim = Simulator([JobSpec("a", 0, 7200, 1, 1.0, 1, 1024, 1)], nodes, "laminar", SimConfig(**COST))
    job = sim.jobs["a"]
    t0, src, infer1, t1 = sim.nodes
    assert src.zone == infer1.zone != t0.zone == t1.zone
    fits = [(n, fits_fast(n, 1.0, 1.0, 1024)) for n in (t0, infer1, t1)]
    assert sim._destination(job, src, fits)[0] is infer1
    for h in range(168):  # the inference pool takes a server back every other hour, the week round
        ts = h * 3600.0 + 1800.0
        sim.hazards["inference"].observe_exposure(ts - 1800, ts + 1800, 1)
        sim.hazards["inference"].observe_reclaim(ts, 0.5)
    assert sim.hazards["inference"].survival(0.0, 7200) < 0.5 < sim.hazards["training"].survival(0.0, 7200)
    # t0 and t1 tie (same pool and zone): t1 is the tighter fit (1 GPU left: none after)
    assert sim._destination(job, src, fits)[0] is t1
    assert sim._destination(job, src, []) is None


@pytest.mark.parametrize("bad", [{"ckpt_wait_s": -1.0}, {"write_gbps": 0.0}, {"link_gbps": math.inf},
                                 {"ckpt_gb_per_gpu": math.nan}, {"hazard_prior_strength_h": 0.0}])
def test_bad_checkpoint_settings_are_refused_by_name(bad: dict[str, float]) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SimConfig(**bad)
