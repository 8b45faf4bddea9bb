"""The survival ladder (pure): ordering, levels, rungs, budgets, hysteresis, oom_score_adj."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from laminar.airlock.policy import validate
from laminar.policy import ladder
from laminar.policy.ladder import CRITICAL, HIGH, NONE, STEADY, JobView, Memo, Signals, decide

P = validate({})


def jv(i: str, cls: str = "transient", prio: int = 50, work: float = 0.0, mem: int = 100 << 20, **kw) -> JobView:
    return JobView(i, cls, prio, work, mem, **kw)


def test_transients_rank_below_long_resident() -> None:
    order = [j.id for _, j in ladder.rank([jv("lr", "long-resident"), jv("t"), jv("s", "standard")], P)]
    assert order == ["t", "s", "lr"]


@given(st.sampled_from(["long-resident", "standard", "transient"]), st.integers(0, 99),
       st.floats(0, 1e6), st.integers(0, 1 << 40))
def test_value_is_monotone(cls: str, prio: int, work: float, mem: int) -> None:
    base = ladder.survival_value(jv("a", cls, prio, work, mem), P)
    assert ladder.survival_value(jv("a", cls, prio + 1, work, mem), P) > base
    assert ladder.survival_value(jv("a", cls, prio, work + 3600, mem), P) > base
    assert ladder.survival_value(jv("a", cls, prio, work, mem + (1 << 30)), P) < base


def test_levels() -> None:
    assert ladder.pressure_level(Signals(usage=0.5), P) == NONE
    assert ladder.pressure_level(Signals(usage=0.8), P) == STEADY
    assert ladder.pressure_level(Signals(usage=0.86), P) == HIGH
    assert ladder.pressure_level(Signals(usage=0.8, stall_event=True), P) == HIGH
    assert ladder.pressure_level(Signals(usage=0.8, psi_full=0.5), P) == CRITICAL
    assert ladder.pressure_level(Signals(usage=0.96), P) == CRITICAL
    assert ladder.pressure_level(Signals(usage=0.1, under_oom=True), P) == CRITICAL


def test_high_suspends_lowest_value_and_never_protected() -> None:
    jobs = [jv("lr", "long-resident", mem=4 << 30), jv("t1", prio=60), jv("t2", prio=10)]
    acts = decide(10.0, HIGH, jobs, P, Memo(), usage=0.9)
    assert [(a.kind, a.job_id) for a in acts] == [("suspend", "t2")]
    assert acts[0].reason


def test_high_suspends_more_only_while_usage_grows() -> None:
    memo = Memo()
    jobs = [jv("t1", prio=60), jv("t2", prio=10)]
    decide(10.0, HIGH, jobs, P, memo, usage=0.88)
    jobs = [jv("t1", prio=60), jv("t2", prio=10, rung="suspend", rung_since=10.0)]
    assert decide(10.2, HIGH, jobs, P, memo, usage=0.88) == []
    assert [a.job_id for a in decide(10.3, HIGH, jobs, P, memo, usage=0.92)] == ["t1"]


def test_critical_reclaims_lowest_suspended() -> None:
    jobs = [jv("t1", prio=60, rung="suspend", rung_since=9.9), jv("t2", prio=10, rung="suspend", rung_since=9.9)]
    acts = decide(10.0, CRITICAL, jobs, P, Memo(), usage=0.97)
    assert [(a.kind, a.job_id) for a in acts] == [("kill", "t2")]


def test_budget_escalates_through_readdress_to_reclaim() -> None:
    memo = Memo()
    j = jv("t", rung="suspend", rung_since=0.0)
    assert [a.kind for a in decide(4.9, STEADY, [j], P, memo)] == []
    assert [a.kind for a in decide(5.0, STEADY, [j], P, memo)] == ["readdress"]
    j2 = jv("t", rung="readdress", rung_since=5.0, hops=1)
    assert [a.kind for a in decide(35.0, STEADY, [j2], P, memo)] == ["kill"]
    nohops = validate({"rungs": {"readdress": {"max_hops": 0}}})
    assert [a.kind for a in decide(5.0, STEADY, [j], nohops, Memo())] == ["kill"]


def test_recovery_waits_for_calm_and_thaws_highest_value_first() -> None:
    memo = Memo()
    jobs = [jv("t1", prio=60, rung="suspend", rung_since=0.0), jv("t2", prio=10, rung="suspend", rung_since=0.0)]
    decide(1.0, HIGH, jobs, P, memo, usage=0.9)
    assert decide(2.0, NONE, jobs, P, memo) == []           # calm for 1 s < hold_s 2 s
    acts = decide(3.0, NONE, jobs, P, memo)
    assert [(a.kind, a.job_id) for a in acts] == [("recover", "t1")]
    assert decide(3.5, NONE, jobs[1:], P, memo) == []       # one per step_s
    assert [a.job_id for a in decide(4.0, NONE, jobs[1:], P, memo)] == ["t2"]


def test_no_flapping_in_the_band() -> None:
    memo = Memo()
    jobs = [jv("t", rung="suspend", rung_since=0.0)]
    decide(1.0, HIGH, jobs, P, memo, usage=0.9)
    for t in range(2, 5):
        assert not [a for a in decide(float(t), STEADY, jobs, P, memo) if a.kind == "recover"]


def test_oom_score_adj_mirrors_order() -> None:
    lr = ladder.oom_score_adj("long-resident", 0)
    st_ = ladder.oom_score_adj("standard", 0)
    tr = ladder.oom_score_adj("transient", 100)
    assert 0 <= lr < st_ < tr <= 1000
    assert ladder.oom_score_adj("transient", 0) == 1000
    assert ladder.oom_score_adj("transient", 90) < ladder.oom_score_adj("transient", 10)


def test_budget_reclaims_are_paced_lowest_value_first_and_wait_at_none() -> None:
    """Jobs suspended together run out of budget together; they are killed one per
    KILL_SETTLE_S, lowest survival value first, and not at all once pressure is gone."""
    nohops = validate({"rungs": {"readdress": {"max_hops": 0}}})
    jobs = [jv("hi", prio=90, rung="suspend", rung_since=0.0), jv("lo", prio=10, rung="suspend", rung_since=0.0)]
    memo = Memo()
    first = decide(10.0, STEADY, jobs, nohops, memo)
    assert [(a.kind, a.job_id) for a in first] == [("kill", "lo")]
    assert decide(10.0 + ladder.KILL_SETTLE_S / 2, STEADY, jobs[:1], nohops, memo) == []
    later = decide(10.0 + ladder.KILL_SETTLE_S, STEADY, jobs[:1], nohops, memo)
    assert [(a.kind, a.job_id) for a in later] == [("kill", "hi")]
    # No pressure: nobody is killed however long ago the budget ran out; the calm node thaws instead.
    calm = decide(20.0, NONE, jobs, nohops, Memo())
    assert [(a.kind, a.job_id) for a in calm] == [("recover", "hi")]


def test_a_readdressed_job_leaves_its_rung_once_calm_and_is_not_reclaimed_in_a_later_episode() -> None:
    """A job thawed for its checkpoint (readdress) whose pressure ended kept that rung for good:
    never suspended again, and killed at the first stall of the next episode, its budget
    long spent, before any lower-value job was even suspended."""
    memo = Memo()
    j = jv("t", prio=90, rung="readdress", rung_since=5.0, hops=1)
    decide(6.0, HIGH, [j], P, memo, usage=0.9)
    assert decide(7.0, NONE, [j], P, memo) == []            # calm for 1 s < hold_s 2 s
    acts = decide(8.5, NONE, [j], P, memo)
    assert [(a.kind, a.job_id) for a in acts] == [("recover", "t")]
    # what follows once the manager dropped the rung: the next episode suspends the lowest value
    later = decide(3600.0, HIGH, [jv("t", prio=90), jv("low", prio=1)], P, memo, usage=0.9)
    assert [(a.kind, a.job_id) for a in later] == [("suspend", "low")]


def test_stalls_count_only_while_the_budget_or_the_machine_is_short() -> None:
    """A stall with the budget and the machine mostly free is a job at its own limit (or a
    cgroup that is not a job): no other job's suspension or kill can lift it."""
    for sig in (Signals(usage=0.06, stall_event=True, node_usage=0.2), Signals(usage=0.06, psi_some=0.5, psi_full=0.5),
                Signals(usage=0.06, critical_event=True, node_usage=0.3)):
        assert ladder.pressure_level(sig, P) == NONE, sig
    assert ladder.pressure_level(Signals(usage=0.06, stall_event=True, node_usage=0.9), P) == HIGH
    assert ladder.pressure_level(Signals(usage=None, psi_full=0.5, node_usage=0.8), P) == CRITICAL
    assert ladder.pressure_level(Signals(usage=0.06, under_oom=True), P) == CRITICAL  # waits at the budget or a cap
