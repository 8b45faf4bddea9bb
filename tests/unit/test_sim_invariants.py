"""The simulator's books balance at every instant, under every policy: each GPU's shares and
its free fraction add up to one GPU, the training allocation is the sum of the running jobs'
workers, every job is in exactly one state (waiting to arrive, queued, running, finished),
no worker sits on a serving inference server, a running job keeps its floor of base workers,
time never runs backwards, and every job finishes once.

A FAKE cluster and trace (named so): 8 training and 8 inference nodes of 4 GPUs, 150 jobs
mixing GPU shares, whole and multi-GPU workers, gangs and CPU-only jobs, half of the
whole-GPU ones elastic; a fast inference cycle (2 h) so reclaims, scale-ins, migrations and
requeues all happen."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest

from laminar.sim.engine import SimConfig, Simulator
from laminar.sim.trace import JobSpec, NodeSpec, with_elasticity

CFG = SimConfig(seed=5, infer_tick_s=300.0, infer_period_s=7200.0, elastic_tick_s=120.0, zone_size=4)


def _scenario() -> tuple[list[JobSpec], list[NodeSpec]]:
    rng = random.Random(11)
    jobs = []
    t = 0.0
    for i in range(150):
        gpus, workers = rng.choice([(0.25, 1), (0.5, 1), (0.3, 1), (1.0, 1), (2.0, 1), (1.0, 3), (4.0, 2), (0.0, 1)])
        jobs.append(JobSpec(f"j{i:03d}", round(t, 3), rng.uniform(60, 5000), workers, gpus, rng.choice([1.0, 4.0]),
                            rng.choice([1024, 8192]), workers))
        t += rng.expovariate(1 / 60)
    nodes = [NodeSpec(f"t{i}", 4, 32.0, 65_536, "G", "training") for i in range(8)]
    nodes += [NodeSpec(f"i{i}", 4, 32.0, 65_536, "G", "inference") for i in range(8)]
    return with_elasticity(jobs, 0.5, 2, seed=5), nodes


class Checked(Simulator):
    """The engine itself, with its books checked after each step of a pass."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.t_seen = -1.0
        self.checks = 0

    def _schedule(self) -> None:
        super()._schedule()
        self.check()

    def _rebalance_elastic(self) -> None:
        super()._rebalance_elastic()
        self.check()

    def _set_inference(self, t: float, initial: bool = False) -> None:
        super()._set_inference(t, initial)
        self.check()

    def check(self) -> None:
        self.checks += 1
        assert self.now >= self.t_seen, (self.now, self.t_seen)
        self.t_seen = self.now
        alloc = 0.0
        extras = 0
        for jid, j in self.jobs.items():
            assert bool(j.workers) == (jid in self.running), jid
            if j.workers:
                assert j.finish is None and j.started is not None and j.started >= j.spec.arrival, jid
                base = sum(1 for w in j.workers if not self.worker_extra[w])
                assert base == j.spec.workers, (jid, base)
                assert len(j.workers) <= j.spec.max_workers, jid
                extras += len(j.workers) - base
            alloc += len(j.workers) * j.spec.worker_gpus
            for w in j.workers:
                n = self.nodes[self.worker_node[w]]
                assert n.workers[w][0] == jid and not n.serving, (jid, n.spec.name)
        assert alloc == pytest.approx(self.alloc_train, abs=1e-6)
        assert extras == self.n_extra
        queued = list(self.queue)
        assert len(queued) == len(set(queued))
        assert all(not self.jobs[q].workers and self.jobs[q].finish is None for q in queued)
        for n in self.nodes:
            used: dict[int, float] = defaultdict(float)
            for _, alloc_n, _, _, _ in n.workers.values():
                for i, f in alloc_n:
                    used[i] += f
            for i in range(n.spec.gpus):
                assert -1e-6 <= n.gpu_free[i] <= 1 + 1e-6, (n.spec.name, i, n.gpu_free[i])
                assert used[i] + n.gpu_free[i] == pytest.approx(1.0, abs=1e-5), (n.spec.name, i)
            assert n.cpus >= -1e-6 and n.memory_mb >= 0, n.spec.name
            assert all(self.worker_node[w] == n.idx for w in n.workers)
        assert sum(n.free_gpu() for n in self._usable()) == pytest.approx(self.free_total, abs=1e-4)


@pytest.mark.parametrize("policy", ["laminar", "bestfit", "noloan", "requeue"])
def test_books_balance_at_every_instant(policy: str) -> None:
    jobs, nodes = _scenario()
    sim = Checked(jobs, nodes, policy, CFG)
    r = sim.run()
    assert sim.checks > 300
    assert r.completed == r.jobs == len(jobs) == len(r.jct) == len(r.queue)
    for j in sim.jobs.values():
        assert j.finish is not None and j.started is not None and j.spec.arrival <= j.started <= j.finish
        assert not j.workers
    assert sim.alloc_train == pytest.approx(0.0, abs=1e-6) and sim.n_extra == 0
    if policy in ("laminar", "bestfit"):  # the paths that move workers ran
        assert r.servers_returned > 0 and r.elastic_grants > 0 and r.scale_ins > 0
        assert r.migrations + r.requeues > 0
    if policy == "requeue":
        assert r.requeues > 0 and r.lost_gpu_s > 0
