"""The survival ladder (pure) and a member of a multi-node job (issue 33): valued for the whole
job (its work at risk counts once per member, its class and priority are the job's), never
re-addressed; a job of this node alone is valued as before."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from laminar.airlock.policy import validate
from laminar.policy import ladder
from laminar.policy.ladder import HIGH, STEADY, JobView, Memo, decide

P = validate({})
GIB = 1 << 30


def jv(i: str, cls: str = "transient", prio: int = 50, work: float = 0.0, mem: int = 100 << 20, **kw) -> JobView:
    return JobView(i, cls, prio, work, mem, **kw)


def test_a_member_counts_the_work_at_risk_of_every_member() -> None:
    one = ladder.survival_value(jv("m", work=1800.0, members=1), P)
    four = ladder.survival_value(jv("m", work=1800.0, members=4), P)
    # work weight 1 per hour: 1 + 0.5 for the node alone, 1 + 4 * 0.5 for the job of four
    assert four / one == (1 + 4 * 0.5) / (1 + 0.5)
    assert ladder.survival_value(jv("m", work=1800.0), P) == one  # the default is a job of this node alone


def test_a_member_is_not_the_cheap_victim_because_only_its_share_is_here() -> None:
    """Two jobs of one class and priority with the same memory here and the same time since
    their checkpoints: the local job yields first, the member of a job of 8 (8 times the work
    lost if it is killed) stays."""
    local = jv("job-3", work=1200.0, mem=2 * GIB)
    member = jv("job-7-n3", work=1200.0, mem=2 * GIB, members=8)
    assert [j.id for _, j in ladder.rank([member, local], P)] == ["job-3", "job-7-n3"]
    got = decide(0.0, HIGH, [member, local], P, Memo(), 0.9)
    assert [(a.kind, a.job_id) for a in got] == [("suspend", "job-3")]


def test_with_nothing_at_risk_a_member_is_valued_as_a_local_job() -> None:
    """Just checkpointed: nothing to lose anywhere, so memory and class decide as for any job."""
    assert ladder.survival_value(jv("m", members=8), P) == ladder.survival_value(jv("m"), P)
    small = jv("job-3", mem=1 * GIB)
    member = jv("job-7-n3", mem=4 * GIB, members=8)
    assert [j.id for _, j in ladder.rank([member, small], P)] == ["job-7-n3", "job-3"]


def test_the_class_and_priority_are_the_jobs() -> None:
    """A long-resident member stays above a transient local job whatever its share here."""
    lr = jv("job-7-n3", "long-resident", prio=10, mem=8 * GIB, members=2)
    t = jv("job-3", "transient", prio=90, work=36000.0, mem=GIB // 4)
    assert [j.id for _, j in ladder.rank([lr, t], P)] == ["job-3", "job-7-n3"]


@given(st.integers(1, 63), st.floats(1.0, 1e6), st.integers(0, 1 << 40))
def test_more_members_are_worth_more_when_work_is_at_risk(k: int, work: float, mem: int) -> None:
    assert ladder.survival_value(jv("m", work=work, mem=mem, members=k + 1), P) > \
        ladder.survival_value(jv("m", work=work, mem=mem, members=k), P)


def test_a_suspended_member_is_never_readdressed_its_budget_ends_in_a_kill() -> None:
    memo = Memo()
    local = jv("job-3", rung="suspend", rung_since=0.0)
    member = jv("job-7-n3", rung="suspend", rung_since=0.0, members=3)
    got = {a.job_id: a.kind for a in decide(5.0, STEADY, [local], P, memo)}
    assert got == {"job-3": "readdress"}  # as before for a job of this node alone
    got = {a.job_id: a.kind for a in decide(5.0, STEADY, [member], P, Memo())}
    assert got == {"job-7-n3": "kill"}
