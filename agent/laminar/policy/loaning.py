"""Capacity loaning: which loaned inference servers to return, and what happens to their jobs.

Idle inference servers are *loaned* to training. When inference traffic rises, the owner asks
for k servers back (``laminarctl pool return --pool inference --count k``). Returning a server stops
the training jobs that have workers on it unless they can shed those workers: an elastic job
running more than ``min_workers`` workers scales in instead of stopping. The **server preemption
cost** of a set of returned servers R is the summed weight of the jobs that R stops::

    cost(R) = sum(weight(j) for j in jobs if workers_left(j, R) < min_workers(j))
    workers_left(j, R) = workers(j) - sum(workers of j on servers in R)

A job spanning several servers stops once and is counted once. ``weight`` is what stopping the
job costs: the caller's choice, typically GPUs x seconds of work since its last checkpoint
(:func:`job_weight`), so a big job that just checkpointed may cost less than a small one that
did not.

:func:`choose_servers_to_return` picks k servers greedily: each round it takes the server whose
return adds the least cost given the servers already chosen (the marginal cost), so a server
whose jobs were already stopped by an earlier choice becomes free to take, and an elastic job's
shed capacity is used up as its workers are taken. For small candidate sets (at most
``exact_limit`` combinations) it searches all k-subsets instead, so the choice is optimal there.

:func:`plan_return` turns the choice into a :class:`ReturnPlan`: per job, ``scale_in`` (drop the
workers on returned servers), ``migrate`` (stopped, but the free GPUs elsewhere can host its
workers) or ``requeue`` (checkpoint and wait in the queue).

Example::

    >>> jobs = [LoanedJob("a", workers=2, min_workers=1, gpus_per_worker=1, weight=10,
    ...                   servers={"s1": 1, "s2": 1}),
    ...         LoanedJob("b", workers=1, min_workers=1, gpus_per_worker=4, weight=5,
    ...                   servers={"s3": 1})]
    >>> choose_servers_to_return(jobs, ["s1", "s2", "s3", "s4"], 2)
    ['s4', 's1']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

EXACT_LIMIT = 2000
"""Largest number of k-subsets :func:`choose_servers_to_return` searches exhaustively."""

Action = Literal["scale_in", "migrate", "requeue"]


@dataclass(frozen=True)
class LoanedJob:
    """A training job with workers on loaned servers (and maybe elsewhere).

    ``servers`` maps a server to the number of this job's workers on it (servers that are not
    candidates for return may appear too: their workers are never taken). ``workers`` is the
    job's total; ``min_workers`` its floor (equal to ``workers`` for a rigid job).
    """

    job_id: str
    workers: int
    min_workers: int
    gpus_per_worker: float
    weight: float
    servers: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workers < 1 or not 1 <= self.min_workers <= self.workers:
            raise ValueError(
                f"loaning: job {self.job_id}: need 1 <= min_workers ({self.min_workers}) "
                f"<= workers ({self.workers})"
            )
        if sum(self.servers.values()) > self.workers:
            raise ValueError(
                f"loaning: job {self.job_id}: {sum(self.servers.values())} workers on servers "
                f"but only {self.workers} in total"
            )
        if self.weight < 0:
            raise ValueError(f"loaning: job {self.job_id}: weight {self.weight} must be >= 0")


@dataclass(frozen=True)
class JobAction:
    """What a job does when its servers are returned."""

    job_id: str
    action: Action
    workers_removed: int
    gpus_to_place: float = 0.0


@dataclass(frozen=True)
class ReturnPlan:
    """Servers to return (in the order chosen), their preemption cost and per-job actions."""

    servers: list[str]
    cost: float
    actions: list[JobAction]

    def by_action(self, action: Action) -> list[str]:
        """Ids of the jobs given ``action``."""
        return [a.job_id for a in self.actions if a.action == action]


def job_weight(gpus: float, seconds_since_checkpoint: float, restart_s: float = 60.0) -> float:
    """Weight of stopping a job: GPU-seconds lost (since its checkpoint, plus a restart)."""
    if gpus < 0 or seconds_since_checkpoint < 0 or restart_s < 0:
        raise ValueError("loaning: job_weight arguments must be >= 0")
    return gpus * (seconds_since_checkpoint + restart_s)


def _index(jobs: Iterable[LoanedJob]) -> tuple[dict[str, LoanedJob], dict[str, list[str]]]:
    by_id: dict[str, LoanedJob] = {}
    on_server: dict[str, list[str]] = {}
    for j in jobs:
        if j.job_id in by_id:
            raise ValueError(f"loaning: duplicate job id {j.job_id!r}")
        by_id[j.job_id] = j
        for s, n in j.servers.items():
            if n > 0:
                on_server.setdefault(s, []).append(j.job_id)
    return by_id, on_server


def preemption_cost(jobs: Iterable[LoanedJob], returned: Iterable[str]) -> float:
    """Server preemption cost of returning the servers ``returned`` (see the module docs)."""
    ret = set(returned)
    cost = 0.0
    for j in jobs:
        taken = sum(n for s, n in j.servers.items() if s in ret)
        if taken and j.workers - taken < j.min_workers:
            cost += j.weight
    return cost


def choose_servers_to_return(
    jobs: Iterable[LoanedJob],
    candidates: Sequence[str],
    k: int,
    exact_limit: int = EXACT_LIMIT,
) -> list[str]:
    """The k candidate servers whose return stops the least job weight, in the order chosen.

    Greedy on marginal cost (ties: fewer resident GPUs, then candidate order); exhaustive when
    C(len(candidates), k) <= ``exact_limit``. Raises ValueError if k is negative or more than
    the candidates, or a candidate is repeated.
    """
    cands = list(candidates)
    if len(set(cands)) != len(cands):
        raise ValueError("loaning: candidate servers repeated")
    if not 0 <= k <= len(cands):
        raise ValueError(f"loaning: cannot return {k} of {len(cands)} candidate servers")
    by_id, on_server = _index(jobs)
    if k == 0:
        return []
    if math.comb(len(cands), k) <= exact_limit:
        best: tuple[float, float, tuple[int, ...]] | None = None
        for combo in itertools.combinations(range(len(cands)), k):
            chosen = [cands[i] for i in combo]
            c = preemption_cost(by_id.values(), chosen)
            resident = sum(_resident_gpus(by_id, on_server, s) for s in chosen)
            key = (c, resident, combo)
            if best is None or key < best:
                best = key
        assert best is not None
        picked = [cands[i] for i in best[2]]
        # Report them in greedy order of marginal cost so callers can return them one by one.
        return _greedy(by_id, on_server, picked, k)
    return _greedy(by_id, on_server, cands, k)


def _resident_gpus(by_id: Mapping[str, LoanedJob], on_server: Mapping[str, list[str]], s: str) -> float:
    return sum(by_id[j].servers[s] * by_id[j].gpus_per_worker for j in on_server.get(s, []))


def _greedy(
    by_id: Mapping[str, LoanedJob], on_server: Mapping[str, list[str]], cands: Sequence[str], k: int
) -> list[str]:
    taken: dict[str, int] = {}  # job -> workers already taken by chosen servers
    stopped: set[str] = set()
    chosen: list[str] = []
    remaining = list(cands)
    for _ in range(k):
        best_i, best_key = -1, (math.inf, math.inf)
        for i, s in enumerate(remaining):
            marginal = 0.0
            for jid in on_server.get(s, []):
                if jid in stopped:
                    continue
                j = by_id[jid]
                if j.workers - taken.get(jid, 0) - j.servers[s] < j.min_workers:
                    marginal += j.weight
            key = (marginal, _resident_gpus(by_id, on_server, s))
            if key < best_key:
                best_i, best_key = i, key
        s = remaining.pop(best_i)
        chosen.append(s)
        for jid in on_server.get(s, []):
            j = by_id[jid]
            taken[jid] = taken.get(jid, 0) + j.servers[s]
            if j.workers - taken[jid] < j.min_workers:
                stopped.add(jid)
    return chosen


def plan_return(
    jobs: Iterable[LoanedJob],
    candidates: Sequence[str],
    k: int,
    free_gpus_elsewhere: float = 0.0,
    exact_limit: int = EXACT_LIMIT,
    free_gpus_by_server: Mapping[str, float] | None = None,
) -> ReturnPlan:
    """Choose k servers (as :func:`choose_servers_to_return`) and what each affected job does.

    A job keeping at least ``min_workers`` scales in. A stopped job migrates when its floor of
    workers fits in the GPUs still free elsewhere and otherwise checkpoints and requeues:
    moving now costs a restart, requeuing costs the same restart plus a wait, so a move pays
    whenever a destination is free. "Free elsewhere" is ``free_gpus_elsewhere`` plus the free
    GPUs of the servers in ``free_gpus_by_server`` that are *not* returned; it is handed out to
    the heaviest stopped jobs first, as a bound (the caller's placement has the final word).
    """
    job_list = list(jobs)
    servers = choose_servers_to_return(job_list, candidates, k, exact_limit)
    ret = set(servers)
    if free_gpus_by_server:
        free_gpus_elsewhere += sum(max(0.0, float(f)) for s, f in free_gpus_by_server.items() if s not in ret)
    actions: list[JobAction] = []
    stopped: list[tuple[LoanedJob, int]] = []
    for j in job_list:
        taken = sum(n for s, n in j.servers.items() if s in ret)
        if not taken:
            continue
        if j.workers - taken >= j.min_workers:
            actions.append(JobAction(j.job_id, "scale_in", taken))
        else:
            stopped.append((j, taken))
    free = free_gpus_elsewhere
    for j, taken in sorted(stopped, key=lambda x: (-x[0].weight, x[0].job_id)):
        need = j.min_workers * j.gpus_per_worker
        if need <= free:
            free -= need
            actions.append(JobAction(j.job_id, "migrate", taken, need))
        else:
            actions.append(JobAction(j.job_id, "requeue", taken, need))
    return ReturnPlan(servers, preemption_cost(job_list, servers), actions)


def on_loan(report: Mapping[str, Any]) -> bool:
    """A server's report says it is on loan: not returned, and loanable or holding lent jobs
    (a busy server with none is serving its pool, not lent)."""
    return not report.get("returned") and bool(report.get("loanable") or report.get("jobs"))


def loaned_jobs(reports: Mapping[str, Mapping[str, Any]]) -> list[LoanedJob]:
    """The :class:`LoanedJob` rows of servers' reports (see :func:`plan_from_reports`).

    A job reported by several servers (workers on each) is one row whose ``servers`` maps
    each to its ``here`` count; its total, floor, GPUs per worker and weight come from its
    first report. Raises ValueError (naming the server and job) on a malformed row.
    """
    rows: dict[str, dict[str, Any]] = {}
    for server in sorted(reports):
        for j in reports[server].get("jobs", []) or []:
            try:
                jid = str(j["id"])
                total = int(j["workers"])
                here = int(j.get("here", total))
                row = rows.setdefault(jid, {"workers": total, "min": min(total, max(1, int(j.get("min", total)))),
                                            "gpw": float(j["gpw"]), "weight": float(j["weight"]), "servers": {}})
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"loaning: server {server}: bad job row {j!r}: {e}") from None
            if here > 0:
                row["servers"][server] = row["servers"].get(server, 0) + here
    return [LoanedJob(jid, r["workers"], r["min"], r["gpw"], r["weight"], r["servers"]) for jid, r in rows.items()]


def plan_from_reports(
    reports: Mapping[str, Mapping[str, Any]],
    k: int,
    free_gpus_elsewhere: float = 0.0,
    exact_limit: int = EXACT_LIMIT,
) -> ReturnPlan:
    """The return plan for ``k`` servers from the servers' own reports (server -> report).

    This is the whole decision of a return, shared by the agent (reports are the
    ``LOAN_ANSWER`` bodies) and the simulator (reports built from its state)::

        {"returned": bool, "loanable": bool, "free_gpus": float,
         "jobs": [{"id": str, "workers": int, "min": int, "gpw": float, "weight": float,
                   "here": int}]}

    ``workers`` is a job's total, ``here`` its workers on this server (default: all),
    ``min`` its floor (an elastic job above it scales in rather than stops). Candidates are
    the servers on loan (:func:`on_loan`); the free GPUs of loanable reported servers that are
    not returned (plus ``free_gpus_elsewhere``) decide migrate vs requeue (:func:`plan_return`).
    Raises ValueError when k is not in 1..candidates.
    """
    cands = sorted(s for s, r in reports.items() if on_loan(r))
    if not 0 < k <= len(cands):
        raise ValueError(f"loaning: cannot return {k} server(s): {len(cands)} loaned server(s) reported "
                         f"({', '.join(cands) or 'none'})")
    # Only a server that takes loans can host a moved job (a busy one's idle GPUs serve its pool).
    free = {s: float(r.get("free_gpus", 0.0) or 0.0) for s, r in reports.items()
            if r.get("loanable") and not r.get("returned")}
    return plan_return(loaned_jobs(reports), cands, k, free_gpus_elsewhere, exact_limit, free_gpus_by_server=free)
