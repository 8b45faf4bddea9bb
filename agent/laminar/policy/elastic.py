"""Elastic scaling: give free GPUs to elastic jobs by a multiple-choice knapsack (pure policy).

An elastic job runs between ``min_workers`` and ``max_workers`` workers. When GPUs free up (a job
ends, an inference server is loaned), the zone offers them to elastic jobs. Each job contributes
one *class* of options: "add e extra workers" for e = 1..(max_workers - workers), costing
``e * gpus_per_worker`` GPUs and shortening the job's remaining time by some seconds. At most one
option per job may be chosen (choosing none is always allowed), and the GPUs of the chosen
options must fit in the free GPUs G. :func:`allocate_elastic` solves this multiple-choice
knapsack exactly by dynamic programming over integer GPUs, in O(jobs x G x options) time.

JCT reduction model (:func:`speedup`, :func:`elastic_job`)::

    speedup(w) = w / (1 + overhead * (w - 1))

is the throughput of w data-parallel workers relative to one: linear for ``overhead = 0``,
saturating at ``1 / overhead`` as w grows (each extra worker adds gradient exchange that
every step pays; the Amdahl form with a serial fraction ``overhead``). A job with
``remaining_work`` (seconds of work for *one* worker) on w workers has ``remaining_work /
speedup(w)`` seconds left, so adding e workers reduces its JCT by::

    remaining_work / speedup(w) - remaining_work / speedup(w + e)

which is positive and concave in e: each extra worker is worth less than the one before. The
default overhead 0.05 (a 16-worker job runs 9.1x a single worker) is an assumption of this
model, stated so the simulator's figures can be read against it.

Example::

    >>> jobs = [elastic_job("a", remaining_work=3600, workers=1, max_workers=4, gpus_per_worker=1),
    ...         elastic_job("b", remaining_work=600, workers=1, max_workers=2, gpus_per_worker=1)]
    >>> plan = allocate_elastic(jobs, free_gpus=2)
    >>> {j: o.extra_workers for j, o in plan.items()}
    {'a': 2}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEFAULT_OVERHEAD = 0.05
"""Serial fraction of a data-parallel step in :func:`speedup` (0.05: 16 workers give 9.1x)."""


@dataclass(frozen=True)
class ElasticOption:
    """One choice for one job: add ``extra_workers`` workers, costing ``gpus`` GPUs."""

    extra_workers: int
    gpus: int
    jct_reduction: float


@dataclass(frozen=True)
class ElasticJob:
    """An elastic job's options; choosing none of them (no change) is always allowed."""

    job_id: str
    options: tuple[ElasticOption, ...]


def speedup(workers: float, overhead: float = DEFAULT_OVERHEAD) -> float:
    """Throughput of ``workers`` data-parallel workers relative to one worker.

    ``workers`` >= 0 (0 gives 0); ``overhead`` in [0, 1]. Raises ValueError otherwise.
    """
    if workers < 0:
        raise ValueError(f"elastic: workers {workers} must be >= 0")
    if not 0.0 <= overhead <= 1.0:
        raise ValueError(f"elastic: overhead {overhead} out of range 0..1")
    if workers == 0:
        return 0.0
    return workers / (1.0 + overhead * (workers - 1))


def remaining_time(remaining_work: float, workers: int, overhead: float = DEFAULT_OVERHEAD) -> float:
    """Seconds left for ``remaining_work`` single-worker seconds on ``workers`` workers (inf if 0)."""
    s = speedup(workers, overhead)
    return float("inf") if s == 0 else remaining_work / s


def elastic_job(
    job_id: str,
    remaining_work: float,
    workers: int,
    max_workers: int,
    gpus_per_worker: int,
    overhead: float = DEFAULT_OVERHEAD,
    most: int | None = None,
) -> ElasticJob:
    """The options of a job now running ``workers`` workers with ``remaining_work`` left.

    Options are e = 1..(max_workers - workers) extra workers, and at most ``most`` (the GPUs
    free to give, when known: options beyond them can never be chosen, and a job's maximum is
    its owner's to choose, so without this a huge one built millions of options each round); a
    job at or above its maximum has none. ``gpus_per_worker`` must be >= 1 (a fractional-GPU
    worker is not scaled by GPUs).
    """
    if remaining_work < 0:
        raise ValueError(f"elastic: job {job_id}: remaining_work {remaining_work} must be >= 0")
    if workers < 1:
        raise ValueError(f"elastic: job {job_id}: workers {workers} must be >= 1")
    if gpus_per_worker < 1:
        raise ValueError(f"elastic: job {job_id}: gpus_per_worker {gpus_per_worker} must be >= 1")
    now = remaining_time(remaining_work, workers, overhead)
    opts = tuple(
        ElasticOption(e, e * gpus_per_worker, now - remaining_time(remaining_work, workers + e, overhead))
        for e in range(1, max(0, min(max_workers - workers, most if most is not None else max_workers - workers)) + 1)
    )
    return ElasticJob(job_id, opts)


def allocate_elastic(jobs: Iterable[ElasticJob], free_gpus: int) -> dict[str, ElasticOption]:
    """Pick at most one option per job maximizing total JCT reduction within ``free_gpus``.

    Exact (dynamic programming over integer GPUs 0..free_gpus). Options with non-positive
    reduction or more GPUs than free are never chosen. Returns {job_id: chosen option} for the
    jobs that get extra workers; ties go to the plan found first (jobs in the given order,
    fewer GPUs first), so the result is deterministic for a given input order.
    Raises ValueError on negative ``free_gpus`` or a duplicate job id.
    """
    if free_gpus < 0:
        raise ValueError(f"elastic: free_gpus {free_gpus} must be >= 0")
    job_list = list(jobs)
    seen: set[str] = set()
    for j in job_list:
        if j.job_id in seen:
            raise ValueError(f"elastic: duplicate job id {j.job_id!r}")
        seen.add(j.job_id)
    useful = [
        (j, [o for o in j.options if 0 < o.gpus <= free_gpus and o.jct_reduction > 0]) for j in job_list
    ]
    useful = [(j, opts) for j, opts in useful if opts]
    if not useful or free_gpus == 0:
        return {}
    cap = min(free_gpus, sum(max(o.gpus for o in opts) for _, opts in useful))
    neg = float("-inf")
    best = [0.0] + [neg] * cap  # best[g]: max reduction using exactly g GPUs
    choice: list[list[int]] = []  # choice[i][g]: option index chosen for job i at g, -1 none
    for _, opts in useful:
        new = best[:]
        pick = [-1] * (cap + 1)
        for k, o in enumerate(opts):
            w, v = o.gpus, o.jct_reduction
            for g in range(cap, w - 1, -1):
                prev = best[g - w]
                if prev != neg and prev + v > new[g]:
                    new[g] = prev + v
                    pick[g] = k
        best = new
        choice.append(pick)
    g = max(range(cap + 1), key=lambda x: (best[x], -x))
    plan: dict[str, ElasticOption] = {}
    for i in range(len(useful) - 1, -1, -1):
        k = choice[i][g]
        if k >= 0:
            job, opts = useful[i]
            plan[job.job_id] = opts[k]
            g -= opts[k].gpus
    return plan


def plan_value(plan: Mapping[str, ElasticOption]) -> float:
    """Total JCT reduction of a plan."""
    return sum(o.jct_reduction for o in plan.values())
