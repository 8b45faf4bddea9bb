"""The discrete-event simulator: jobs arrive, wait, run, scale, are returned with their servers and finish.

Events sit in a ``heapq`` ordered by (time, sequence number), so two runs with the same seed,
trace and policy give the same result. Event kinds: a job arrives; a job finishes (stale
finish events, superseded by a change of the job's worker count, are skipped by version);
the inference load ticks (every ``infer_tick_s``); the elastic rebalance ticks (every
``elastic_tick_s``). After the events of one instant, the scheduler runs one pass.

Model:

- A job runs ``workers`` workers (a gang: all start together), each on one node. Its work is
  ``duration x speedup(workers)`` single-worker seconds; on w workers it progresses at
  ``speedup(w)`` (:func:`laminar.policy.elastic.speedup`).
- The queue is served first come, first served with backfilling over the first
  ``queue_window`` jobs: a job that does not fit does not block the ones behind it.
- **Inference pool** (a fake: a model of load, not a trace): ``inference_nodes`` servers whose
  needed count follows a diurnal curve, ``u(t) = low + (high - low) * (1 - cos(2 pi t /
  period)) / 2`` plus seeded noise, so the night is at ``low`` and midday at ``high``. A
  server is *serving* (inference uses it) or idle. With loaning, idle servers are loaned to
  training; when the curve rises, k servers are returned.
- **Return** (``laminar``, ``bestfit``): :func:`laminar.policy.loaning.plan_return` picks the k
  loaned servers of least preemption cost (job weight: GPUs x seconds since the job's last
  checkpoint plus a restart, :func:`laminar.policy.loaning.job_weight`); jobs scale in, migrate
  (re-placed at once, paying ``restart_s``) or checkpoint and requeue at the head of the queue
  (the return's notice lets them checkpoint: no work lost, ``restart_s`` paid). **Slurm
  preempt-and-requeue** (``requeue``): idle servers first, then by index; jobs on returned
  servers are killed and requeued from the start (all progress lost).
- **Elastic scaling** (``laminar``, ``bestfit``): every ``elastic_tick_s``, after the queue's
  pass, the idle whole GPUs beyond the queued jobs' demand go to elastic jobs by
  :func:`laminar.policy.elastic.allocate_elastic`;
  the extra workers are placed by the same placement policy. Extra workers are opportunistic:
  a queued job that does not fit sheds extra workers on a node where that makes it fit.
- **Checkpoints** (the migration layer's policy, as the agent's checkpoint driver runs it): a
  running job checkpoints every :func:`laminar.policy.ckpt_schedule.hazard_interval` (Daly
  under the time-varying hazard of the nodes it runs on), each checkpoint pausing it for its
  cost (``ckpt_pause_s`` plus its shard at ``write_gbps``). The hazard is one
  :class:`laminar.migrate.hazard.HazardModel` per pool, with the agent's default prior,
  learned from the exposure of the pool's nodes and the servers returned from it (each return
  an announced departure, :class:`laminar.migrate.evidence.NoticeOdds`). A returned job gets
  ``ckpt_wait_s`` for its final checkpoint (the agent's ``loan.ckpt_wait_s``): written in time,
  it resumes from it; too large to be, it rolls back to its newest periodic one (work lost).
  Slurm's ``requeue`` takes no checkpoints (its jobs start over). A job whose checkpoints cost
  nothing (``ckpt_pause_s`` and ``ckpt_gb_per_gpu`` 0) takes no periodic ones: a return
  checkpoints it at once for free (the model before 2026-12-01).
- **Destination choice** (``laminar``): a returned job that migrates goes, worker by worker,
  to the usable node :func:`laminar.policy.destination.rank` puts first among those it fits on
  (survival over the job's remaining time from the node's pool hazard, the zone as topology),
  as the agent's ``move_now`` ranks its roster's members.

Metrics (:class:`SimResult`): per job queuing time (first start - arrival) and JCT (finish -
arrival), averaged over every job and over the GPU jobs only (``*_gpu_s``: jobs asking for a
GPU or a share of one; the CPU-only pods of a GPU trace are not what a GPU scheduler is
judged on); cluster usage (GPU-seconds allocated to training plus GPUs serving inference, over
total GPU-seconds, between time 0 and the last arrival); counts of returns, scale-ins,
migrations, requeues and work lost.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from laminar.policy import ckpt_schedule as CS
from laminar.policy import destination as D
from laminar.policy import elastic as E
from laminar.policy import loaning as L
from laminar.policy import placement as P
from laminar.policy.hazard import DEFAULT_PRIOR_RATE_PER_H, DEFAULT_PRIOR_STRENGTH_H, HazardModel, HazardSum
from laminar.policy.notice import NoticeOdds
from laminar.policy.prestage import rollback_frac
from laminar.sim.cluster import BestFitPlacer, ProbePlacer, SimNode, fits_fast
from laminar.sim.trace import JobSpec, NodeSpec


@dataclass(frozen=True)
class Policy:
    """What a policy name turns on."""

    name: str
    placement: str  # "probe" | "bestfit"
    loaning: str | None  # "cost" | "index" | None
    elastic: bool
    kill_loses_work: bool = False


POLICIES: dict[str, Policy] = {
    "laminar": Policy("laminar", "probe", "cost", True),
    "bestfit": Policy("bestfit", "bestfit", "cost", True),
    "noloan": Policy("noloan", "probe", None, False),
    "requeue": Policy("requeue", "probe", "index", False, kill_loses_work=True),
}


@dataclass(frozen=True)
class SimConfig:
    """Knobs of one run (defaults are the benchmark's)."""

    seed: int = 0
    zone_size: int = 64
    queue_window: int = 256
    infer_tick_s: float = 900.0
    infer_low: float = 0.3
    infer_high: float = 0.9
    infer_period_s: float = 86_400.0
    infer_noise: float = 0.05
    elastic_tick_s: float = 300.0
    elastic_overhead: float = E.DEFAULT_OVERHEAD
    restart_s: float = 60.0
    # The checkpoint contract (docs/simulator.md, *Checkpoints*). The sizes are an assumption
    # (no trace in ../shared/data says them): 2 GB per GPU a worker holds (a share: its part).
    ckpt_gb_per_gpu: float = 2.0
    ckpt_pause_s: float = 2.0  # the agent's migrate.ckpt_pause_s (quiesce, serialise)
    write_gbps: float = 1.0  # the agent's migrate.write_mbit (8000)
    link_gbps: float = 1.25  # a node's uplink (10 Gbit/s): what a migrated job's checkpoint crosses
    ckpt_wait_s: float = 10.0  # the agent's loan.ckpt_wait_s: a returned job's time for its final checkpoint
    epoch_ts: float = 0.0  # Unix time of t = 0 (the hazard bins by hour of the week)
    hazard_prior_per_h: float = DEFAULT_PRIOR_RATE_PER_H  # the agent's [migrate.hazard] defaults
    hazard_prior_strength_h: float = DEFAULT_PRIOR_STRENGTH_H
    progress: bool = False
    progress_every_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("ckpt_gb_per_gpu", "ckpt_pause_s", "ckpt_wait_s", "restart_s", "hazard_prior_per_h"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"sim: {name} {v!r} must be a finite number >= 0")
        for name in ("write_gbps", "link_gbps", "hazard_prior_strength_h"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"sim: {name} {v!r} must be a finite number > 0")
        if not (isinstance(self.epoch_ts, (int, float)) and math.isfinite(self.epoch_ts)):
            raise ValueError(f"sim: epoch_ts {self.epoch_ts!r} must be a finite number of Unix seconds")


@dataclass
class _Job:
    spec: JobSpec
    work: float
    done: float = 0.0
    last: float = 0.0
    workers: list[int] = field(default_factory=list)  # worker ids
    started: float | None = None
    run_start: float = 0.0  # start of the current run (for checkpoints)
    finish: float | None = None
    version: int = 0
    requeues: int = 0
    ckpt_done: float = 0.0  # progress at its newest checkpoint (what a rollback returns to)
    ckpt_at: float = 0.0  # when that checkpoint was taken (or the job last started from one)
    ckpt_version: int = 0  # stale periodic-checkpoint events are skipped by this


@dataclass
class SimResult:
    """What one run measured."""

    policy: str
    jobs: int
    completed: int
    avg_queue_s: float
    median_queue_s: float
    p99_queue_s: float
    avg_jct_s: float
    median_jct_s: float
    p99_jct_s: float
    usage: float
    training_usage: float
    makespan_s: float
    returns: int = 0
    servers_returned: int = 0
    scale_ins: int = 0
    migrations: int = 0
    requeues: int = 0
    lost_gpu_s: float = 0.0
    elastic_grants: int = 0
    checkpoints: int = 0  # periodic checkpoints taken
    ckpt_pause_gpu_s: float = 0.0  # GPU-seconds the jobs spent paused for them
    rollbacks: int = 0  # returned jobs whose final checkpoint did not make ckpt_wait_s
    migrations_to_loaned: int = 0  # migrations whose destination (a worker's) was a loaned server
    gpu_jobs: int = 0
    avg_queue_gpu_s: float = 0.0
    avg_jct_gpu_s: float = 0.0
    probes: int = 0
    wall_s: float = 0.0
    jct: dict[str, float] = field(default_factory=dict, repr=False)
    queue: dict[str, float] = field(default_factory=dict, repr=False)

    def summary(self) -> dict[str, Any]:
        """Flat dict of the figures (no per-job maps)."""
        d = {k: v for k, v in self.__dict__.items() if k not in ("jct", "queue")}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


ARRIVE, FINISH, INFER, ELASTIC, CKPT = 0, 1, 2, 3, 4


class Simulator:
    """One run of ``jobs`` on ``nodes`` under ``policy`` (see the module docs)."""

    def __init__(
        self,
        jobs: Sequence[JobSpec],
        nodes: Sequence[NodeSpec],
        policy: str | Policy,
        config: SimConfig | None = None,
        on_progress: Callable[[float, int, int], None] | None = None,
    ) -> None:
        self.cfg = config or SimConfig()
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"sim: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.rng = random.Random(self.cfg.seed)
        self.noise_rng = random.Random(f"infer:{self.cfg.seed}")
        self.nodes: list[SimNode] = []
        zone_of: dict[str, int] = {}
        counts: dict[str, int] = {}
        for i, spec in enumerate(nodes):
            c = counts.get(spec.pool, 0)
            counts[spec.pool] = c + 1
            key = f"{spec.pool}:{c // self.cfg.zone_size}"
            zone = zone_of.setdefault(key, len(zone_of))
            self.nodes.append(SimNode.from_spec(i, spec, zone))
        self.inference = [n for n in self.nodes if n.pool == "inference"]
        self.training_members = [n.idx for n in self.nodes if n.pool != "inference"]
        loan = self.policy.loaning is not None
        members = [n.idx for n in self.nodes] if loan else self.training_members
        self.member_nodes = [self.nodes[i] for i in members]
        self.placer: ProbePlacer | BestFitPlacer
        if self.policy.placement == "probe":
            self.placer = ProbePlacer(self.nodes, self.rng, members=members)
        else:
            self.placer = BestFitPlacer(self.nodes)
        for j in jobs:
            if not (math.isfinite(j.arrival) and j.arrival >= 0 and math.isfinite(j.duration) and j.duration >= 0):
                raise ValueError(
                    f"sim: job {j.job_id}: arrival {j.arrival:g} and duration {j.duration:g} must be finite and >= 0"
                )
            if j.workers < 1 or not (0 <= j.worker_gpus and math.isfinite(j.worker_gpus)):
                raise ValueError(f"sim: job {j.job_id}: {j.workers} workers of {j.worker_gpus:g} GPUs")
        self.jobs = {j.job_id: _Job(j, j.duration * E.speedup(j.workers, self.cfg.elastic_overhead)) for j in jobs}
        if len(self.jobs) != len(jobs):
            ids = [j.job_id for j in jobs]
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"sim: duplicate job id {dup!r} in the trace")
        self.queue: deque[str] = deque()
        self.events: list[tuple[float, int, int, str, int]] = []
        self._seq = 0
        self._wid = 0
        self.worker_node: dict[int, int] = {}
        self.worker_extra: dict[int, bool] = {}
        self.on_progress = on_progress
        self.horizon = max((j.arrival for j in jobs), default=0.0)
        self.total_gpus = sum(n.spec.gpus for n in self.nodes)
        self.alloc_train = 0.0
        self.area_train = 0.0
        self.area_infer = 0.0
        self.now = 0.0
        self.running: set[str] = set()
        self.n_extra = 0
        self.idle_hist = [0] * (max((n.spec.gpus for n in self.nodes), default=0) + 1)
        self.free_total = 0.0
        self._usable_cache: list[SimNode] | None = None
        self.last_progress = 0.0
        for n in self.member_nodes:
            self._track(n, +1)
        # The migration layer's evidence, one hazard per pool (the agent's default prior): the
        # exposure of the nodes that may be taken back and the servers returned, each an
        # announced departure.
        self.hazards = {pool: HazardModel(pool, self.cfg.hazard_prior_per_h, self.cfg.hazard_prior_strength_h)
                        for pool in sorted({n.pool for n in self.nodes})}
        self.notice_odds = NoticeOdds()
        self.exposed_to = 0.0
        self.res = SimResult(self.policy.name, len(jobs), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    # ------------------------------------------------------------------ events and time

    def _push(self, t: float, kind: int, job_id: str = "", version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, job_id, version))

    def _advance(self, t: float) -> None:
        lo, hi = self.now, min(t, self.horizon)
        if hi > lo:
            serving = sum(n.spec.gpus for n in self.inference if n.serving)
            self.area_train += self.alloc_train * (hi - lo)
            self.area_infer += serving * (hi - lo)
        self.now = t

    def _rate(self, j: _Job) -> float:
        return E.speedup(len(j.workers), self.cfg.elastic_overhead) if j.workers else 0.0

    def _sync(self, j: _Job) -> None:
        if j.workers:
            j.done = min(j.work, j.done + self._rate(j) * (self.now - j.last))
        j.last = self.now

    def _reschedule_finish(self, j: _Job) -> None:
        j.version += 1
        r = self._rate(j)
        if r > 0:
            self._push(self.now + max(0.0, j.work - j.done) / r, FINISH, j.spec.job_id, j.version)

    # ------------------------------------------------------------------ running

    def run(self) -> SimResult:
        """Run to completion (every job finished, or nothing can make progress)."""
        wall0 = time.monotonic()
        for j in self.jobs.values():
            self._push(j.spec.arrival, ARRIVE, j.spec.job_id)
        if self.inference:
            self._set_inference(0.0, initial=True)
            self._push(self.cfg.infer_tick_s, INFER)
        if self.policy.elastic:
            self._push(self.cfg.elastic_tick_s, ELASTIC)
        last_report = wall0
        finished = 0
        while self.events:
            t = self.events[0][0]
            self._advance(t)
            elastic_due = False
            while self.events and self.events[0][0] == t:
                _, _, kind, jid, ver = heapq.heappop(self.events)
                if kind == ARRIVE:
                    self.queue.append(jid)
                elif kind == FINISH:
                    j = self.jobs[jid]
                    if ver == j.version and j.finish is None and j.workers:
                        self._sync(j)
                        self._release_all(j)
                        j.finish = t
                        self.running.discard(jid)
                        self.last_progress = t
                        finished += 1
                elif kind == INFER:
                    self._set_inference(t)
                    if finished < len(self.jobs):
                        self._push(t + self.cfg.infer_tick_s, INFER)
                elif kind == ELASTIC:
                    elastic_due = True
                    if finished < len(self.jobs):
                        self._push(t + self.cfg.elastic_tick_s, ELASTIC)
                elif kind == CKPT:
                    j = self.jobs[jid]
                    if ver == j.ckpt_version and j.finish is None and j.workers:
                        self._checkpoint(j)
            self._schedule()
            if elastic_due:
                self._rebalance_elastic()
            if self.cfg.progress and time.monotonic() - last_report >= self.cfg.progress_every_s:
                last_report = time.monotonic()
                print(
                    f"sim[{self.policy.name}]: t={t / 3600:.1f} h, {finished}/{len(self.jobs)} jobs done, "
                    f"{len(self.queue)} queued",
                    file=sys.stderr,
                    flush=True,
                )
            if self.on_progress is not None:
                self.on_progress(t, finished, len(self.jobs))
            if finished == len(self.jobs):
                break
            if (
                not self.running
                and self.now - self.last_progress > 2 * self.cfg.infer_period_s
                and all(e[2] in (INFER, ELASTIC, CKPT) for e in self.events)
            ):
                break  # only ticks left and nothing has run for two periods: the rest never fit
        self.res.wall_s = time.monotonic() - wall0
        return self._result()

    def _result(self) -> SimResult:
        r = self.res
        q, jct = [], []
        for jid, j in self.jobs.items():
            if j.finish is not None and j.started is not None:
                r.queue[jid] = j.started - j.spec.arrival
                r.jct[jid] = j.finish - j.spec.arrival
                q.append(r.queue[jid])
                jct.append(r.jct[jid])
        r.completed = len(jct)
        gq = [r.queue[jid] for jid, j in self.jobs.items() if jid in r.jct and j.spec.worker_gpus > 0]
        gj = [r.jct[jid] for jid, j in self.jobs.items() if jid in r.jct and j.spec.worker_gpus > 0]
        r.gpu_jobs = len(gj)
        r.avg_queue_gpu_s = statistics.fmean(gq) if gq else 0.0
        r.avg_jct_gpu_s = statistics.fmean(gj) if gj else 0.0
        r.avg_queue_s = statistics.fmean(q) if q else 0.0
        r.median_queue_s = statistics.median(q) if q else 0.0
        r.p99_queue_s = _pct(q, 0.99)
        r.avg_jct_s = statistics.fmean(jct) if jct else 0.0
        r.median_jct_s = statistics.median(jct) if jct else 0.0
        r.p99_jct_s = _pct(jct, 0.99)
        span = self.horizon if self.horizon > 0 else 1.0
        r.training_usage = self.area_train / (self.total_gpus * span) if self.total_gpus else 0.0
        r.usage = (self.area_train + self.area_infer) / (self.total_gpus * span) if self.total_gpus else 0.0
        r.makespan_s = max((j.finish for j in self.jobs.values() if j.finish is not None), default=0.0)
        r.probes = self.placer.probes
        return r

    # ------------------------------------------------------------------ placement

    def _is_usable(self, n: SimNode) -> bool:
        return not n.serving and (self.policy.loaning is not None or n.pool != "inference")

    def _track(self, n: SimNode, sign: int) -> None:
        if self._is_usable(n):
            self.idle_hist[n.idle_gpus()] += sign
            self.free_total += sign * n.free_gpu()

    def _set_serving(self, n: SimNode, serving: bool) -> None:
        if n.serving == serving:
            return
        self._track(n, -1)
        n.serving = serving
        self._track(n, +1)
        self._usable_cache = None
        self._touch(n)

    def _max_idle(self) -> int:
        for k in range(len(self.idle_hist) - 1, -1, -1):
            if self.idle_hist[k] > 0:
                return k
        return 0

    def _usable(self) -> list[SimNode]:
        if self._usable_cache is None:
            self._usable_cache = [n for n in self.member_nodes if not n.serving]
        return self._usable_cache

    def _place_worker(self, j: _Job, usable: list[SimNode], extra: bool, src: SimNode | None = None) -> bool:
        """One worker of ``j`` placed on ``usable``; ``src``: the server a move leaves, whose
        job then goes where destination choice ranks first (``laminar``; :meth:`_destination`)."""
        s = j.spec
        if src is not None and self.policy.placement == "probe":
            got = self._destination(j, src, [(n, a) for n in usable if n is not src and (
                a := fits_fast(n, s.worker_gpus, s.worker_cpus, s.worker_memory_mb)) is not None])
        else:
            got = self.placer.place(usable, s.worker_gpus, s.worker_cpus, s.worker_memory_mb, self.now)
        if got is None:
            return False
        node, alloc = got
        self._put(j, node, alloc, extra)
        return True

    def _put(self, j: _Job, node: SimNode, alloc: Any, extra: bool) -> None:
        s = j.spec
        self._wid += 1
        self._track(node, -1)
        node.take(self._wid, s.job_id, alloc, s.worker_cpus, s.worker_memory_mb, extra)
        self._track(node, +1)
        self.worker_node[self._wid] = node.idx
        self.worker_extra[self._wid] = extra
        self.n_extra += extra
        j.workers.append(self._wid)
        self.alloc_train += s.worker_gpus
        self._touch(node)

    def _touch(self, node: SimNode) -> None:
        if isinstance(self.placer, ProbePlacer):
            self.placer.touch(node)

    def _remove_worker(self, j: _Job, wid: int) -> None:
        node = self.nodes[self.worker_node.pop(wid)]
        self.n_extra -= self.worker_extra.pop(wid, False)
        self._track(node, -1)
        node.give(wid)
        self._track(node, +1)
        j.workers.remove(wid)
        self.alloc_train -= j.spec.worker_gpus
        self._touch(node)
        # A job that lost a base worker keeps its floor: its extra workers become base ones.
        base = sum(1 for w in j.workers if not self.worker_extra[w])
        for w in j.workers:
            if base >= j.spec.workers:
                break
            if self.worker_extra[w]:
                self.worker_extra[w] = False
                self.n_extra -= 1
                n = self.nodes[self.worker_node[w]]
                jid, alloc, cpus, mem, _ = n.workers[w]
                n.workers[w] = (jid, alloc, cpus, mem, False)
                base += 1

    def _release_all(self, j: _Job) -> None:
        for wid in list(j.workers):
            self._remove_worker(j, wid)

    def _start(self, j: _Job, usable: list[SimNode], src: SimNode | None = None) -> bool:
        """Place the job's gang of ``workers``; all or nothing. ``src``: a move's source
        (:meth:`_place_worker`)."""
        s = j.spec
        for _ in range(s.workers):
            if not self._place_worker(j, usable, extra=False, src=src):
                self._release_all(j)
                return False
        self._began(j)
        return True

    def _began(self, j: _Job) -> None:
        if j.started is None:
            j.started = self.now
        j.run_start = self.now
        j.last = self.now
        # it starts from its newest checkpoint (or from nothing): that one is its rollback point
        j.ckpt_done, j.ckpt_at = j.done, self.now
        self.running.add(j.spec.job_id)
        self.last_progress = self.now
        self._reschedule_finish(j)
        self._plan_checkpoint(j)

    # ------------------------------------------------------------------ checkpoints and moves

    def _ckpt_cost(self, j: _Job) -> float:
        """Seconds one checkpoint of ``j`` pauses it: the fixed part and its largest shard's
        write (its workers write theirs side by side)."""
        c = self.cfg
        return c.ckpt_pause_s + j.spec.worker_gpus * c.ckpt_gb_per_gpu / c.write_gbps

    def _job_hazard(self, j: _Job) -> HazardSum:
        """The departure hazard of ``j``: any node it runs on taken back stops it."""
        return HazardSum([self.hazards[self.nodes[i].pool] for i in sorted({self.worker_node[w] for w in j.workers})])

    def _plan_checkpoint(self, j: _Job, after_s: float = 0.0) -> None:
        """The next periodic checkpoint of ``j``, one interval after ``after_s`` from now: the
        agent's driver's interval (:func:`laminar.policy.ckpt_schedule.hazard_interval`). A job
        whose final checkpoint makes ``ckpt_wait_s`` is rolled back only by departures without
        notice (the share the evidence gives), one whose final one does not by every one."""
        j.ckpt_version += 1
        cost = self._ckpt_cost(j)
        if self.policy.kill_loses_work or cost <= 0 or not j.workers:
            return
        frac = rollback_frac(cost <= self.cfg.ckpt_wait_s, self.notice_odds.unannounced_frac)
        tau, _ = CS.hazard_interval(cost, self._job_hazard(j), self.cfg.epoch_ts + self.now + after_s, rollback_frac=frac)
        self._push(self.now + after_s + tau, CKPT, j.spec.job_id, j.ckpt_version)

    def _checkpoint(self, j: _Job) -> None:
        """A periodic checkpoint: the job's progress now is its rollback point; it pauses for
        the checkpoint's cost."""
        self._sync(j)
        cost = self._ckpt_cost(j)
        # the pause is work added (its progress units are no training): restored, the job has
        # them behind it
        j.work += cost * self._rate(j)
        j.ckpt_done, j.ckpt_at = j.done + cost * self._rate(j), self.now
        self.res.checkpoints += 1
        self.res.ckpt_pause_gpu_s += cost * len(j.workers) * j.spec.worker_gpus
        self._reschedule_finish(j)
        self._plan_checkpoint(j, after_s=cost)

    def _final_checkpoint(self, j: _Job) -> float:
        """A returned job's final checkpoint (``j`` synced): the seconds it costs the job. One
        that takes longer than ``ckpt_wait_s`` is not waited for: the job rolls back to its
        newest periodic checkpoint (work lost) and has cost the whole wait."""
        cost = self._ckpt_cost(j)
        if cost <= self.cfg.ckpt_wait_s:
            return cost
        self.res.rollbacks += 1
        lost = max(0.0, j.done - j.ckpt_done)  # (none while its newest checkpoint's pause runs)
        self.res.lost_gpu_s += lost / E.speedup(j.spec.workers, self.cfg.elastic_overhead) * j.spec.gpus
        j.done -= lost
        return self.cfg.ckpt_wait_s

    def _destination(self, j: _Job, src: SimNode, fits: list[tuple[SimNode, P.GpuAlloc]]
                     ) -> tuple[SimNode, P.GpuAlloc] | None:
        """Where a worker of ``j`` leaving ``src`` goes, as the agent's move chooses
        (``Mover.candidates`` and ``rank_for``): every usable node it fits on, ranked
        by :func:`laminar.policy.destination.rank` (survival over the job's remaining time from
        the node's pool hazard, the zone as topology: the sim has no racks, the checkpoint shard
        over the uplink); equal scores go to the tightest fit (rank's own tie-break, the node's
        name, would undo the packing). None when it fits nowhere."""
        if not fits:
            return None
        s = j.spec
        need = D.Resources(math.ceil(s.worker_gpus), s.worker_memory_mb << 20, s.worker_cpus)
        rate = E.speedup(s.workers, self.cfg.elastic_overhead)
        remaining = max(0.0, j.work - j.done) / rate
        ts = self.cfg.epoch_ts + self.now
        survival = {pool: m.survival(ts, remaining) for pool, m in self.hazards.items()}
        req = D.MoveRequest(s.job_id, need, s.worker_gpus * self.cfg.ckpt_gb_per_gpu * 1e9, remaining, None,
                            str(src.idx), str(src.zone), str(src.zone))
        cands = [D.Candidate(str(n.idx), str(n.zone), str(n.zone), need, self.cfg.link_gbps * 1e9,
                             survival=survival[n.pool], provider=n.pool) for n, _ in fits]  # each fits: checked
        ranked = D.rank(req, cands, restart_s=self.cfg.restart_s)
        best = ranked[0].expected_loss_s
        tied = {int(r.candidate.node) for r in ranked if r.feasible and r.expected_loss_s <= best + 1e-9}
        if not tied:
            return None
        return min(((n, a) for n, a in fits if n.idx in tied), key=lambda na: (na[0].free_gpu() - s.worker_gpus, na[0].idx))

    def _schedule(self) -> None:
        if not self.queue:
            return
        usable = self._usable()
        if not usable:
            return
        kept: list[str] = []
        scanned = 0
        failed: set[tuple[float, int, float, int]] = set()  # shapes that did not fit this pass
        while self.queue and scanned < self.cfg.queue_window:
            jid = self.queue.popleft()
            scanned += 1
            j = self.jobs[jid]
            s = j.spec
            shape = (s.worker_gpus, s.workers, s.worker_cpus, s.worker_memory_mb)
            if shape in failed:
                kept.append(jid)
                continue
            need_whole = int(s.worker_gpus + 1e-9) if s.worker_gpus >= 1 else 0
            quick_no = need_whole > self._max_idle() or s.gpus > self.free_total + 1e-9
            if not quick_no and self._start(j, usable):
                continue
            if self.policy.elastic and self.n_extra > 0 and self._shed_for(j, usable):
                continue
            failed.add(shape)
            kept.append(jid)
        self.queue.extendleft(reversed(kept))

    def _shed_for(self, j: _Job, usable: list[SimNode]) -> bool:
        """Start ``j`` on nodes made to fit by scaling in extra (elastic) workers there.

        Extra workers are opportunistic: a node arbitrating a probe counts them as free. One
        worker of ``j`` per node; all or nothing.
        """
        s = j.spec
        picks: list[tuple[SimNode, list[int]]] = []
        for n in usable:
            extras = [w for w, rec in n.workers.items() if rec[4]]
            if not extras:
                continue
            saved = [(w, n.workers[w]) for w in extras]
            drop: list[int] = []
            ok = False
            for w, _ in saved:
                n.give(w)
                drop.append(w)
                if fits_fast(n, s.worker_gpus, s.worker_cpus, s.worker_memory_mb) is not None:
                    ok = True
                    break
            for w, rec in saved:
                if w in drop:
                    n.take(w, *rec)
            if ok:
                picks.append((n, drop))
                if len(picks) == s.workers:
                    break
        if len(picks) < s.workers:
            return False
        for n, drop in picks:
            for w in drop:
                owner = self.jobs[n.workers[w][0]]
                self._sync(owner)
                self._remove_worker(owner, w)
                self._reschedule_finish(owner)
                self.res.scale_ins += 1
            alloc = fits_fast(n, s.worker_gpus, s.worker_cpus, s.worker_memory_mb)
            assert alloc is not None
            self._put(j, n, alloc, extra=False)
        self._began(j)
        return True

    # ------------------------------------------------------------------ elastic

    def _rebalance_elastic(self) -> None:
        # Second phase of a pass (as Lyra/Aryl: queued jobs first, then the GPUs left over go to
        # elastic jobs by the knapsack). GPUs that the jobs still queued would take are held
        # back for them (shedding extra workers for a large gang can fail), so elastic jobs
        # grow only into the surplus: idle GPUs beyond the queued jobs' demand.
        usable = self._usable()
        free = sum(n.idle_gpus() for n in usable)
        if self.queue:
            free -= math.ceil(sum(self.jobs[q].spec.gpus for q in self.queue) - 1e-9)
        if free <= 0:
            return
        cands = []
        for jid in sorted(self.running):
            j = self.jobs[jid]
            s = j.spec
            if s.elastic and j.workers and j.finish is None and len(j.workers) < s.max_workers and s.worker_gpus >= 1:
                self._sync(j)
                cands.append(
                    E.elastic_job(
                        s.job_id,
                        (j.work - j.done),
                        len(j.workers),
                        s.max_workers,
                        int(s.worker_gpus),
                        self.cfg.elastic_overhead,
                    )
                )
        if not cands:
            return
        plan = E.allocate_elastic(cands, free)
        for jid, opt in plan.items():
            j = self.jobs[jid]
            self._sync(j)
            added = 0
            for _ in range(opt.extra_workers):
                if not self._place_worker(j, usable, extra=True):
                    break
                added += 1
            if added:
                self.res.elastic_grants += added
                self._reschedule_finish(j)

    # ------------------------------------------------------------------ inference and return

    def _needed(self, t: float) -> int:
        c = self.cfg
        u = c.infer_low + (c.infer_high - c.infer_low) * (1 - math.cos(2 * math.pi * t / c.infer_period_s)) / 2
        u += self.noise_rng.uniform(-c.infer_noise, c.infer_noise)
        return max(0, min(len(self.inference), math.ceil(max(0.0, u) * len(self.inference))))

    def _observe_exposure(self, t: float) -> None:
        """Hazard evidence up to ``t``: node-hours of the nodes that could have been taken back
        since the last call (the training pool's nodes; the loaned servers)."""
        t0, self.exposed_to = self.exposed_to, t
        if t <= t0:
            return
        counts: dict[str, int] = {}
        for n in self.nodes:
            if n.pool != "inference" or (self.policy.loaning is not None and not n.serving):
                counts[n.pool] = counts.get(n.pool, 0) + 1
        for pool, k in counts.items():
            self.hazards[pool].observe_exposure(self.cfg.epoch_ts + t0, self.cfg.epoch_ts + t, k)

    def _set_inference(self, t: float, initial: bool = False) -> None:
        self._observe_exposure(t)
        need = self._needed(t)
        serving = [n for n in self.inference if n.serving]
        if initial:
            for n in self.inference[:need]:
                self._set_serving(n, True)
            return
        if need < len(serving):
            for n in sorted(serving, key=lambda n: -n.idx)[: len(serving) - need]:
                self._set_serving(n, False)
        elif need > len(serving):
            self._return_servers(need - len(serving))

    def _return_servers(self, k: int) -> None:
        cands = [n for n in self.inference if not n.serving]
        k = min(k, len(cands))
        if k <= 0:
            return
        self.res.returns += 1
        if self.policy.loaning is None:
            for n in cands[:k]:  # nothing was loaned: idle servers go straight back
                self._set_serving(n, True)
            return
        if self.policy.loaning == "index":
            chosen = sorted(cands, key=lambda n: (bool(n.workers), n.idx))[:k]
            self._return_requeue(chosen)
            return
        # The servers' reports, as the agents answer a return's query (LOAN_ANSWER), and the
        # same pure decision the agent runs on them (loaning.plan_from_reports).
        cand_set = {n.idx for n in cands}
        reports: dict[str, dict[str, Any]] = {}
        rows: dict[str, dict[str, Any]] = {}
        for n in cands:
            here: dict[str, int] = {}
            for rec in n.workers.values():
                here[rec[0]] = here.get(rec[0], 0) + 1
            jobs = []
            for jid in sorted(here):
                if jid not in rows:
                    j = self.jobs[jid]
                    self._sync(j)
                    since_ckpt = self.now - j.ckpt_at
                    rows[jid] = {"id": jid, "workers": len(j.workers), "min": j.spec.workers,
                                 "gpw": j.spec.worker_gpus,
                                 "weight": L.job_weight(j.spec.gpus, since_ckpt, self.cfg.restart_s)}
                jobs.append({**rows[jid], "here": here[jid]})
            reports[str(n.idx)] = {"loanable": True, "returned": False, "free_gpus": n.idle_gpus(), "jobs": jobs}
        usable_rest = [n for n in self._usable() if n.idx not in cand_set]
        free_elsewhere = float(sum(n.idle_gpus() for n in usable_rest))
        plan = L.plan_from_reports(reports, k, free_gpus_elsewhere=free_elsewhere, exact_limit=0)
        returned = {int(s) for s in plan.servers}
        self.res.servers_returned += len(returned)
        if returned:
            self.hazards["inference"].observe_reclaim(self.cfg.epoch_ts + self.now, len(returned))
            self.notice_odds.observe(True, len(returned))
        for i in returned:
            self._set_serving(self.nodes[i], True)
        for act in plan.actions:
            j = self.jobs[act.job_id]
            self._sync(j)
            if act.action == "scale_in":
                for w in [w for w in j.workers if self.worker_node[w] in returned]:
                    self._remove_worker(j, w)
                self.res.scale_ins += act.workers_removed
                self._reschedule_finish(j)
            else:
                src_idx = next((self.worker_node[w] for w in j.workers if self.worker_node[w] in returned), None)
                src = None if src_idx is None else self.nodes[src_idx]
                paused = self._final_checkpoint(j)
                self._release_all(j)
                j.version += 1
                rate = E.speedup(j.spec.workers, self.cfg.elastic_overhead)
                j.work += (paused + self.cfg.restart_s) * rate
                j.requeues += 1
                self.running.discard(j.spec.job_id)
                if act.action == "migrate" and self._start(j, self._usable(), src=src):
                    # the checkpoint crosses the uplink before the job starts there
                    j.work += j.spec.worker_gpus * self.cfg.ckpt_gb_per_gpu / self.cfg.link_gbps * rate
                    self._reschedule_finish(j)
                    self.res.migrations += 1
                    self.res.migrations_to_loaned += any(self.nodes[self.worker_node[w]].pool == "inference"
                                                         for w in j.workers)
                else:
                    self.res.requeues += 1
                    self.queue.appendleft(j.spec.job_id)

    def _return_requeue(self, chosen: list[SimNode]) -> None:
        """Slurm preempt-and-requeue: kill every job on the returned servers, restart from 0."""
        self.res.servers_returned += len(chosen)
        victims: dict[str, _Job] = {}
        for n in chosen:
            for rec in n.workers.values():
                victims[rec[0]] = self.jobs[rec[0]]
        for n in chosen:
            self._set_serving(n, True)
        for jid in sorted(victims):
            j = victims[jid]
            self._sync(j)
            self.res.lost_gpu_s += j.done / max(E.speedup(j.spec.workers, self.cfg.elastic_overhead), 1e-9) * j.spec.gpus
            self._release_all(j)
            j.version += 1
            j.done = 0.0
            self.running.discard(jid)
            j.requeues += 1
            self.res.requeues += 1
            self.queue.appendleft(jid)


def best_case_jct(jobs: Sequence[JobSpec], overhead: float = E.DEFAULT_OVERHEAD, gpu_only: bool = True) -> float:
    """Mean JCT no scheduler can beat on ``jobs``: no queuing, every elastic job at its
    ``max_workers`` from its first second, every rigid job at its trace duration.

    A baseline's mean JCT over this is the ceiling of any ``jct_speedup`` from loaning and
    elastic scaling on that job mix (``gpu_only``: over the GPU jobs, as the headline metric).
    """
    sel = [j for j in jobs if j.worker_gpus > 0 or not gpu_only]
    if not sel:
        return 0.0
    return statistics.fmean(
        j.duration * (E.speedup(j.workers, overhead) / E.speedup(j.max_workers, overhead) if j.elastic else 1.0)
        for j in sel
    )


def simulate(
    jobs: Sequence[JobSpec], nodes: Sequence[NodeSpec], policy: str, config: SimConfig | None = None
) -> SimResult:
    """Run one simulation; see :class:`Simulator`."""
    return Simulator(jobs, nodes, policy, config).run()
