"""The ladder and jobs being stopped (`JobView.stopping`): pure decisions.

A job in its stop's grace is ending anyway: under HIGH or CRITICAL its grace is cut (``CUT``)
before any running job is suspended or killed, largest first, once per job, never in a
protected class; the ladder then waits ``KILL_SETTLE_S`` for its memory before it suspends
anything. It is never a suspension candidate itself.
"""

from __future__ import annotations

from typing import Any

from laminar.airlock.policy import validate
from laminar.policy import ladder


def policy(**over: Any) -> dict[str, Any]:
    return validate(over)


def view(jid: str, cls: str = "transient", mem_mib: int = 100, stopping: bool = False) -> ladder.JobView:
    return ladder.JobView(jid, cls, 50, 10.0, mem_mib << 20, stopping=stopping)


def test_stopping_jobs_are_cut_first_largest_first_then_the_ladder_waits_for_their_memory() -> None:
    memo = ladder.Memo()
    jobs = [view("run"), view("small", mem_mib=50, stopping=True), view("big", mem_mib=300, stopping=True)]
    acts = ladder.decide(100.0, ladder.CRITICAL, jobs, policy(), memo, 0.99)
    assert [(a.kind, a.job_id) for a in acts] == [(ladder.CUT, "big"), (ladder.CUT, "small")], acts
    assert "300 MiB" in acts[0].reason
    # within the settle time nothing else happens; once per job
    assert ladder.decide(100.1, ladder.CRITICAL, jobs, policy(), memo, 0.99) == []
    acts = ladder.decide(100.0 + ladder.KILL_SETTLE_S, ladder.CRITICAL, jobs, policy(), memo, 0.99)
    assert [(a.kind, a.job_id) for a in acts] == [(ladder.SUSPEND, "run")], acts


def test_no_cut_without_pressure_nor_in_a_protected_class_and_a_stopping_job_is_never_suspended() -> None:
    memo = ladder.Memo()
    assert ladder.decide(100.0, ladder.STEADY, [view("s", stopping=True)], policy(), memo, 0.8) == []
    prot = [view("lr", cls="long-resident", stopping=True)]
    assert ladder.decide(100.0, ladder.CRITICAL, prot, policy(), memo, 0.99) == []
    assert ladder.decide(100.0, ladder.HIGH, [view("s", stopping=True)], policy(protected=["transient"]),
                         ladder.Memo(), 0.9) == []


def test_the_memo_forgets_a_cut_job_once_it_has_ended() -> None:
    """The memo forgets a cut job once it is no longer being stopped (ended)."""
    memo = ladder.Memo()
    s = view("s", stopping=True)
    assert [a.kind for a in ladder.decide(100.0, ladder.HIGH, [s], policy(), memo, 0.9)] == [ladder.CUT]
    ladder.decide(101.0, ladder.HIGH, [], policy(), memo, 0.9)
    assert memo.cut == {}
    assert [a.kind for a in ladder.decide(102.0, ladder.HIGH, [s], policy(), memo, 0.9)] == [ladder.CUT]
