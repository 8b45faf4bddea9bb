"""Elastic scaling knapsack (laminar.policy.elastic) against brute force on small instances."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.policy.elastic import (
    ElasticJob,
    ElasticOption,
    allocate_elastic,
    elastic_job,
    plan_value,
    remaining_time,
    speedup,
)


def brute_force(jobs: list[ElasticJob], free: int) -> float:
    best = 0.0
    choices = [[None, *j.options] for j in jobs]
    for combo in itertools.product(*choices):
        gpus = sum(o.gpus for o in combo if o is not None)
        if gpus <= free:
            best = max(best, sum(o.jct_reduction for o in combo if o is not None))
    return best


def random_jobs(rng: random.Random, n: int) -> list[ElasticJob]:
    jobs = []
    for i in range(n):
        k = rng.randint(0, 4)
        opts = tuple(ElasticOption(e, rng.randint(1, 6), rng.uniform(-5, 100)) for e in range(1, k + 1))
        jobs.append(ElasticJob(f"j{i}", opts))
    return jobs


@pytest.mark.parametrize("seed", range(200))
def test_knapsack_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    jobs = random_jobs(rng, rng.randint(0, 5))
    free = rng.randint(0, 15)
    plan = allocate_elastic(jobs, free)
    assert sum(o.gpus for o in plan.values()) <= free
    by_id = {j.job_id: j for j in jobs}
    for jid, o in plan.items():
        assert o in by_id[jid].options  # one option of that job's own class
    assert plan_value(plan) == pytest.approx(brute_force(jobs, free))


def test_model_options_are_concave_and_match_brute_force() -> None:
    jobs = [
        elastic_job("a", 3600, workers=1, max_workers=4, gpus_per_worker=1),
        elastic_job("b", 600, workers=1, max_workers=2, gpus_per_worker=1),
        elastic_job("c", 7200, workers=2, max_workers=4, gpus_per_worker=2),
    ]
    gains = [o.jct_reduction for o in jobs[0].options]
    assert all(x > 0 for x in gains)
    assert all(b - a < a for a, b in itertools.pairwise([0.0, *gains]) if a)  # diminishing steps
    for free in range(0, 9):
        assert plan_value(allocate_elastic(jobs, free)) == pytest.approx(brute_force(jobs, free))


def test_speedup_model() -> None:
    assert speedup(1) == 1.0
    assert speedup(0) == 0.0
    assert speedup(4, overhead=0.0) == 4.0
    assert speedup(16, overhead=0.05) == pytest.approx(16 / 1.75)
    assert remaining_time(100, 2, overhead=0.0) == 50.0


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="free_gpus -1"):
        allocate_elastic([], -1)
    with pytest.raises(ValueError, match="overhead 2"):
        speedup(2, overhead=2)
    with pytest.raises(ValueError, match="duplicate job id 'x'"):
        allocate_elastic([ElasticJob("x", ()), ElasticJob("x", ())], 3)
    with pytest.raises(ValueError, match="workers 0"):
        elastic_job("z", 10, workers=0, max_workers=2, gpus_per_worker=1)


_OPTION = st.builds(ElasticOption, st.integers(1, 4), st.integers(1, 7), st.floats(-10, 100, allow_nan=False))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_OPTION, max_size=4).map(tuple), max_size=5), st.integers(0, 20))
def test_knapsack_is_feasible_and_optimal_by_hypothesis(classes: list[tuple[ElasticOption, ...]], free: int) -> None:
    """Any small instance (options in any order, equal GPU costs, negative gains): the plan is
    one option of each chosen job's own class, within the free GPUs, and as good as brute force."""
    jobs = [ElasticJob(f"j{i}", opts) for i, opts in enumerate(classes)]
    plan = allocate_elastic(jobs, free)
    assert sum(o.gpus for o in plan.values()) <= free
    for jid, o in plan.items():
        assert o in jobs[int(jid[1:])].options and o.jct_reduction > 0
    assert plan_value(plan) == pytest.approx(brute_force(jobs, free))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e5), st.integers(1, 4), st.integers(0, 4), st.integers(1, 3)), max_size=5),
       st.integers(0, 16))
def test_knapsack_on_the_models_options_by_hypothesis(specs: list[tuple[float, int, int, int]], free: int) -> None:
    jobs = [elastic_job(f"j{i}", r, w, w + m, g) for i, (r, w, m, g) in enumerate(specs)]
    plan = allocate_elastic(jobs, free)
    assert sum(o.gpus for o in plan.values()) <= free
    assert plan_value(plan) == pytest.approx(brute_force(jobs, free))
