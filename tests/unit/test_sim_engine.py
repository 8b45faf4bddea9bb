"""Simulator runs on tiny hand-written traces whose results are worked out by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from laminar.sim.engine import SimConfig, best_case_jct, simulate
from laminar.sim.trace import JobSpec, NodeSpec, read_openb_nodes, read_openb_pods

PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,1000,1024,1,1000,,BE,Succeeded,0,100,0
p1,1000,1024,2,1000,,BE,Succeeded,0,50,0
p2,1000,1024,2,1000,,BE,Succeeded,10,40,10
p3,1000,1024,1,500,,LS,Running,20,80,20
"""
NODES = """sn,cpu_milli,memory_mib,gpu,model
n0,8000,16384,2,T4
n1,8000,16384,1,T4
"""


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[list[JobSpec], list[NodeSpec]]:
    (tmp_path / "pods.csv").write_text(PODS)
    (tmp_path / "nodes.csv").write_text(NODES)
    return read_openb_pods(tmp_path / "pods.csv"), read_openb_nodes(tmp_path / "nodes.csv")


@pytest.mark.parametrize("policy", ["bestfit", "laminar", "noloan", "requeue"])
def test_tiny_trace_by_hand(tiny: tuple[list[JobSpec], list[NodeSpec]], policy: str) -> None:
    """Two nodes: n0 with 2 GPUs, n1 with 1. Durations: p0 100, p1 50, p2 30, p3 60.

    t=0   p0 (1 GPU) goes to n1 (the tighter fit: 0 GPUs left there, 1 on n0); p1 (2) to n0.
    t=10  p2 (2 GPUs) arrives: no node has 2 idle GPUs; it waits.
    t=20  p3 (half a GPU) arrives: every GPU is taken; it waits behind p2.
    t=50  p1 ends; p2 starts on n0 (queued 40 s), ends at 80. p3 still finds no GPU.
    t=80  p2 ends; p3 starts on n0 (queued 60 s), ends at 140.
    t=100 p0 ends.
    JCTs: p0 100, p1 50, p2 80 - 10 = 70, p3 140 - 20 = 120 (mean 85); queuing mean 25.
    Usage up to the last arrival (t=20): 3 of 3 GPUs allocated throughout: 1.0.
    With no inference pool and no elastic job, every policy must give the same answer.
    """
    jobs, nodes = tiny
    r = simulate(jobs, nodes, policy, SimConfig(seed=3))
    assert r.jct == {"p0": 100, "p1": 50, "p2": 70, "p3": 120}
    assert r.queue == {"p0": 0, "p1": 0, "p2": 40, "p3": 60}
    assert r.avg_jct_s == 85 and r.avg_queue_s == 25
    assert r.completed == 4 and r.makespan_s == 140
    assert r.usage == pytest.approx(1.0)


FREE_CKPT: dict[str, Any] = {"ckpt_pause_s": 0.0, "ckpt_gb_per_gpu": 0.0}
"""Checkpoints that cost nothing: no periodic ones, a return's final one free (the model's
checkpoints before 2026-12-01), for the tests whose hand computation is about something else."""


def loan_cluster() -> list[NodeSpec]:
    return [NodeSpec("train-0", 1, 8, 16384, "T4", "training"), NodeSpec("infer-0", 1, 8, 16384, "T4", "inference")]


def two_jobs(duration: float) -> list[JobSpec]:
    return [JobSpec("a", 0, duration, 1, 1.0, 1, 1024, 1), JobSpec("b", 0, duration, 1, 1.0, 1, 1024, 1)]


def test_loaning_runs_the_second_job_on_the_idle_inference_server() -> None:
    """Inference needs no server (low = high = 0): laminar loans it, noloan leaves it idle.

    laminar: a on train-0, b on infer-0, both 0..100: JCTs 100, 100.
    noloan:  b waits for a: queued 100, JCT 200.
    """
    cfg = SimConfig(infer_low=0, infer_high=0, infer_noise=0)
    lam = simulate(two_jobs(100), loan_cluster(), "laminar", cfg)
    assert lam.jct == {"a": 100, "b": 100} and lam.queue == {"a": 0, "b": 0}
    nol = simulate(two_jobs(100), loan_cluster(), "noloan", cfg)
    assert nol.jct == {"a": 100, "b": 200} and nol.queue == {"a": 0, "b": 100}


def test_reclaim_checkpoints_and_requeues_versus_slurm_requeue() -> None:
    """Inference load u(t) = (1 - cos(2 pi t / 3600)) / 2 on one server, checked every 900 s.

    t=0: u=0, the server is loaned; a runs on train-0, b on infer-0 (2000 s each).
    t=900: u=0.5, one server needed: b's server is reclaimed. No GPU free elsewhere, so b
    checkpoints (900 s done) and requeues at the head of the queue, paying a 60 s restart.
    t=2000: a ends; b restarts on train-0 with 2000 - 900 + 60 = 1160 s left: ends at 3160.
    Slurm preempt-and-requeue: b is killed at 900 and starts over at 2000: ends at 4000.
    Checkpoints cost nothing here (FREE_CKPT): b's at the return is free, none is periodic.
    """
    cfg = SimConfig(infer_low=0, infer_high=1, infer_period_s=3600, infer_noise=0, infer_tick_s=900, restart_s=60,
                    **FREE_CKPT)
    lam = simulate(two_jobs(2000), loan_cluster(), "laminar", cfg)
    assert lam.jct == {"a": 2000, "b": 3160}
    assert lam.requeues == 1 and lam.servers_returned == 1 and lam.lost_gpu_s == 0
    slurm = simulate(two_jobs(2000), loan_cluster(), "requeue", cfg)
    assert slurm.jct == {"a": 2000, "b": 4000}
    assert slurm.requeues == 1 and slurm.lost_gpu_s == pytest.approx(900)


def test_elastic_job_grows_into_idle_gpus_and_finishes_sooner() -> None:
    """One elastic job (1 worker, up to 2) alone on a 2-GPU node, elastic tick at 100 s.

    Work = 1000 s on 1 worker. At t=100 the knapsack gives it the idle GPU; with overhead 0
    it runs at 2x: 900 s left take 450 s, so it ends at 550 instead of 1000.
    """
    nodes = [NodeSpec("n0", 2, 8, 16384, "T4", "training")]
    job = [JobSpec("e", 0, 1000, 1, 1.0, 1, 1024, 2)]
    cfg = SimConfig(elastic_tick_s=100, elastic_overhead=0.0, **FREE_CKPT)
    assert simulate(job, nodes, "laminar", cfg).jct == {"e": pytest.approx(550)}
    assert simulate(job, nodes, "noloan", cfg).jct == {"e": 1000}


def test_same_seed_same_result(tiny: tuple[list[JobSpec], list[NodeSpec]]) -> None:
    jobs, nodes = tiny
    a = simulate(jobs, nodes, "laminar", SimConfig(seed=7)).summary()
    b = simulate(jobs, nodes, "laminar", SimConfig(seed=7)).summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_elastic_growth_leaves_the_queued_demand_alone() -> None:
    """A 4-GPU node: e (1 GPU, elastic to 3) and r (2 GPUs) start at 0; q (2 GPUs) arrives at
    50 and waits (1 GPU idle). At the ticks (100, 200, ...) the idle GPU is not granted: q's
    demand (2) exceeds it. e and r end at 1000, q starts then and ends at 1500."""
    nodes = [NodeSpec("n0", 4, 8, 16384, "T4", "training")]
    jobs = [JobSpec("e", 0, 1000, 1, 1.0, 1, 1024, 3), JobSpec("r", 0, 1000, 1, 2.0, 1, 1024, 1),
            JobSpec("q", 50, 500, 1, 2.0, 1, 1024, 1)]
    res = simulate(jobs, nodes, "laminar", SimConfig(elastic_tick_s=100, elastic_overhead=0.0, **FREE_CKPT))
    assert res.elastic_grants == 0
    assert res.jct == {"e": 1000, "r": 1000, "q": pytest.approx(1450)}


def test_reclaim_scales_in_the_elastic_job_whose_extra_worker_is_on_the_returned_server() -> None:
    """Training node t0 and inference server i0, 1 GPU each. The inference load is 0 at t=0
    (i0 idle, loaned) and above 0 from the first tick (t=100): i0 is reclaimed.

    e (1 worker, elastic to 2, work 1000 s, overhead 0) starts on t0 (the training pool
    first), grows onto i0 at the elastic tick t=10, runs at 2x until 100 (190 s of work done),
    then the return plan scales it in (its floor, 1 worker, stays on t0): 810 s left at 1x,
    it ends at 910. Nothing is requeued."""
    nodes = [NodeSpec("t0", 1, 8, 16384, "T4", "training"), NodeSpec("i0", 1, 8, 16384, "T4", "inference")]
    jobs = [JobSpec("e", 0, 1000, 1, 1.0, 1, 1024, 2)]
    cfg = SimConfig(elastic_tick_s=10, elastic_overhead=0.0, infer_tick_s=100, infer_low=0.0, infer_high=1.0,
                    infer_noise=0.0, **FREE_CKPT)
    res = simulate(jobs, nodes, "laminar", cfg)
    assert (res.returns, res.servers_returned, res.scale_ins, res.requeues) == (1, 1, 1, 0)
    assert res.jct == {"e": pytest.approx(910)}


def test_gpu_job_figures_leave_cpu_only_jobs_out_and_the_jct_ceiling_by_hand() -> None:
    nodes = [NodeSpec("n0", 2, 8, 16384, "T4", "training")]
    jobs = [JobSpec("g", 0, 100, 1, 1.0, 1, 1024, 2), JobSpec("c", 0, 300, 1, 0.0, 1, 1024, 1)]
    res = simulate(jobs, nodes, "noloan", SimConfig())
    assert res.avg_jct_s == 200 and res.gpu_jobs == 1 and res.avg_jct_gpu_s == 100
    # no queue, g at its 2 workers from the start: 100 x speedup(1)/speedup(2) = 50 (overhead 0)
    assert best_case_jct(jobs, overhead=0.0) == 50
    assert best_case_jct(jobs, overhead=0.0, gpu_only=False) == 175
