"""Loaned-server return choice (laminar.policy.loaning) against brute force on small instances."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.policy import loaning as L
from laminar.policy.loaning import (
    LoanedJob,
    choose_servers_to_return,
    plan_return,
    preemption_cost,
)


def brute_cost(jobs: list[LoanedJob], servers: list[str], k: int) -> float:
    return min(preemption_cost(jobs, c) for c in itertools.combinations(servers, k))


def random_instance(rng: random.Random, n_servers: int, n_jobs: int, rigid_single: bool = False):
    servers = [f"s{i}" for i in range(n_servers)]
    jobs = []
    for i in range(n_jobs):
        if rigid_single:
            on = {rng.choice(servers): rng.randint(1, 2)}
            w = sum(on.values())
            jobs.append(LoanedJob(f"j{i}", w, w, 1, rng.uniform(1, 50), on))
            continue
        span = rng.sample(servers, rng.randint(1, min(3, n_servers)))
        on = {s: rng.randint(1, 2) for s in span}
        w = sum(on.values()) + rng.randint(0, 2)  # some workers on servers not up for return
        mn = rng.randint(1, w)
        jobs.append(LoanedJob(f"j{i}", w, mn, rng.choice([0.5, 1, 2]), rng.uniform(1, 50), on))
    return servers, jobs


@pytest.mark.parametrize("seed", range(150))
def test_exact_choice_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    servers, jobs = random_instance(rng, rng.randint(1, 7), rng.randint(0, 8))
    k = rng.randint(0, len(servers))
    chosen = choose_servers_to_return(jobs, servers, k)
    assert len(chosen) == k and len(set(chosen)) == k and set(chosen) <= set(servers)
    assert preemption_cost(jobs, chosen) == pytest.approx(brute_cost(jobs, servers, k))


@pytest.mark.parametrize("seed", range(100))
def test_greedy_is_optimal_when_jobs_are_rigid_and_on_one_server(seed: int) -> None:
    """Costs are then independent per server, so the greedy order is optimal."""
    rng = random.Random(1000 + seed)
    servers, jobs = random_instance(rng, rng.randint(1, 8), rng.randint(0, 10), rigid_single=True)
    k = rng.randint(0, len(servers))
    chosen = choose_servers_to_return(jobs, servers, k, exact_limit=0)  # force the greedy path
    assert preemption_cost(jobs, chosen) == pytest.approx(brute_cost(jobs, servers, k))


@pytest.mark.parametrize("seed", range(100))
def test_greedy_updates_costs_as_it_goes(seed: int) -> None:
    """Greedy never does worse than returning the k servers of least stand-alone cost."""
    rng = random.Random(5000 + seed)
    servers, jobs = random_instance(rng, rng.randint(2, 8), rng.randint(1, 10))
    k = rng.randint(1, len(servers))
    greedy = preemption_cost(jobs, choose_servers_to_return(jobs, servers, k, exact_limit=0))
    assert greedy >= brute_cost(jobs, servers, k) - 1e-9


def test_greedy_uses_up_shed_capacity_and_counts_a_job_once() -> None:
    # E can shed 2 of its 4 workers: the first two of a, b, c are free, the third would stop E.
    jobs = [
        LoanedJob("E", workers=4, min_workers=2, gpus_per_worker=1, weight=100, servers={"a": 1, "b": 1, "c": 1}),
        LoanedJob("R", workers=1, min_workers=1, gpus_per_worker=1, weight=10, servers={"d": 1}),
    ]
    assert choose_servers_to_return(jobs, ["a", "b", "c", "d"], 3, exact_limit=0) == ["a", "b", "d"]
    # A job spanning two servers stops once: once one is taken, the other costs nothing more.
    span = [LoanedJob("big", 2, 2, 8, 100.0, {"a": 1, "b": 1}), LoanedJob("small", 1, 1, 1, 160.0, {"c": 1})]
    assert choose_servers_to_return(span, ["a", "b", "c"], 2, exact_limit=0) == ["a", "b"]


def test_elastic_job_scales_in_instead_of_stopping() -> None:
    jobs = [
        LoanedJob("elastic", workers=4, min_workers=2, gpus_per_worker=1, weight=80, servers={"s1": 2}),
        LoanedJob("rigid", workers=1, min_workers=1, gpus_per_worker=1, weight=10, servers={"s2": 1}),
    ]
    assert choose_servers_to_return(jobs, ["s1", "s2"], 1) == ["s1"]
    plan = plan_return(jobs, ["s1", "s2"], 2, free_gpus_elsewhere=0)
    assert plan.servers == ["s1", "s2"]
    assert plan.by_action("scale_in") == ["elastic"]
    assert plan.by_action("requeue") == ["rigid"]
    assert plan.cost == 10
    plan = plan_return(jobs, ["s1", "s2"], 2, free_gpus_elsewhere=1)
    assert plan.by_action("migrate") == ["rigid"]


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="cannot return 3 of 2"):
        choose_servers_to_return([], ["a", "b"], 3)
    with pytest.raises(ValueError, match="min_workers"):
        LoanedJob("x", workers=1, min_workers=2, gpus_per_worker=1, weight=1)
    with pytest.raises(ValueError, match="duplicate job id 'x'"):
        choose_servers_to_return([LoanedJob("x", 1, 1, 1, 1), LoanedJob("x", 1, 1, 1, 1)], ["a"], 1)


def test_plan_from_reports_merges_a_job_across_servers_and_scales_it_in() -> None:
    # job "e" runs 3 workers (floor 1): 1 on s1, 1 on s2, 1 on a training node (not reported)
    reports = {
        "s1": {"loanable": True, "free_gpus": 0, "jobs": [
            {"id": "e", "workers": 3, "min": 1, "gpw": 1, "weight": 50.0, "here": 1}]},
        "s2": {"loanable": True, "free_gpus": 0, "jobs": [
            {"id": "e", "workers": 3, "min": 1, "gpw": 1, "weight": 50.0, "here": 1},
            {"id": "r", "workers": 1, "min": 1, "gpw": 1, "weight": 10.0}]},
    }
    jobs = {j.job_id: j for j in L.loaned_jobs(reports)}
    assert jobs["e"].servers == {"s1": 1, "s2": 1} and jobs["e"].workers == 3
    plan = L.plan_from_reports(reports, 1)
    assert plan.servers == ["s1"] and plan.cost == 0.0  # e sheds one worker, nothing stops
    assert [(a.job_id, a.action, a.workers_removed) for a in plan.actions] == [("e", "scale_in", 1)]
    plan2 = L.plan_from_reports(reports, 2)
    assert plan2.cost == 10.0  # e keeps 1 worker (its floor); r stops
    assert {a.job_id: a.action for a in plan2.actions} == {"e": "scale_in", "r": "requeue"}


def test_plan_from_reports_migrates_when_a_loanable_server_has_room() -> None:
    reports = {
        "s1": {"loanable": True, "free_gpus": 0, "jobs": [{"id": "a", "workers": 1, "min": 1, "gpw": 2, "weight": 9.0}]},
        "s2": {"loanable": True, "free_gpus": 1, "jobs": [{"id": "b", "workers": 1, "min": 1, "gpw": 1, "weight": 99.0}]},
        "busy": {"loanable": False, "free_gpus": 8, "jobs": []},  # serving its pool: not a destination
    }
    plan = L.plan_from_reports(reports, 1)
    assert plan.servers == ["s1"]
    assert [(a.job_id, a.action) for a in plan.actions] == [("a", "requeue")]  # 2 GPUs needed, 1 free
    plan = L.plan_from_reports(reports, 1, free_gpus_elsewhere=1.0)
    assert [(a.job_id, a.action, a.gpus_to_place) for a in plan.actions] == [("a", "migrate", 2.0)]
    with pytest.raises(ValueError, match="cannot return 3 server"):
        L.plan_from_reports(reports, 3)
    with pytest.raises(ValueError, match="server s9: bad job row"):
        L.loaned_jobs({"s9": {"jobs": [{"id": "x"}]}})


@st.composite
def _instances(draw: st.DrawFn) -> tuple[list[str], list[LoanedJob], int]:
    servers = [f"s{i}" for i in range(draw(st.integers(1, 6)))]
    jobs = []
    for i in range(draw(st.integers(0, 6))):
        span = draw(st.lists(st.sampled_from([*servers, "train1", "train2"]), min_size=1, max_size=3, unique=True))
        on = {s: draw(st.integers(1, 3)) for s in span}
        w = sum(on.values()) + draw(st.integers(0, 2))
        jobs.append(LoanedJob(f"j{i}", w, draw(st.integers(1, w)), draw(st.sampled_from([0.5, 1.0, 2.0])),
                              draw(st.floats(0, 50)), on))
    return servers, jobs, draw(st.integers(0, len(servers)))


@settings(max_examples=400, deadline=None)
@given(_instances())
def test_exact_choice_is_least_preempting_by_hypothesis(inst: tuple[list[str], list[LoanedJob], int]) -> None:
    """Jobs spanning candidate and non-candidate servers, elastic floors, zero weights: the
    choice on small sets is the least-preempting k-subset, and for one server, greedy too."""
    servers, jobs, k = inst
    chosen = choose_servers_to_return(jobs, servers, k)
    assert len(chosen) == k == len(set(chosen)) and set(chosen) <= set(servers)
    assert preemption_cost(jobs, chosen) == pytest.approx(brute_cost(jobs, servers, k))
    one = choose_servers_to_return(jobs, servers, 1, exact_limit=0)
    assert preemption_cost(jobs, one) == pytest.approx(brute_cost(jobs, servers, 1))
    plan = plan_return(jobs, servers, k)
    stopped = {a.job_id for a in plan.actions if a.action != "scale_in"}
    assert sum(j.weight for j in jobs if j.job_id in stopped) == pytest.approx(plan.cost)
