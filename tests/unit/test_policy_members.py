"""laminar.policy.members: the multi-node job's table and what the origin does when a member ends
(every branch of on_member_end)."""

from __future__ import annotations

import pytest

from laminar.policy import members as pm
from laminar.policy.members import Action, Effect, Event, JobView, MemberState, MultiState, on_member_end

R, X, FL, LO, ST, SG = (MemberState.RUNNING, MemberState.EXITED, MemberState.FAILED, MemberState.LOST,
                        MemberState.STOPPED, MemberState.STARTING)


def rigid(*members: MemberState, restarts: int = 0) -> JobView:
    return JobView(len(members), len(members), len(members), tuple(members), restarts)


def elastic(lo: int, hi: int, *members: MemberState, restarts: int = 0) -> JobView:
    return JobView(len(members), lo, hi, tuple(members), restarts)


def test_every_member_exited_ends_ok() -> None:
    d = on_member_end(rigid(X, X, R), 2, X)
    assert d.action is Action.END_OK and d.reason == "ok"


def test_one_exited_while_others_run_continues() -> None:
    d = on_member_end(rigid(R, R, R), 1, X)
    assert d.action is Action.CONTINUE and not d.shrink and "2 member(s) still run" in d.reason


def test_a_live_state_is_no_end() -> None:
    assert on_member_end(rigid(SG, SG), 0, R).action is Action.CONTINUE


@pytest.mark.parametrize("state", [FL, LO])
def test_rigid_member_failed_or_lost_restarts(state: MemberState) -> None:
    d = on_member_end(rigid(R, R, R), 2, state)
    assert d.action is Action.RESTART and f"member 2 {state.value}" in d.reason and "restart 1 of at most 3" in d.reason


def test_rigid_past_max_restarts_ends_failed() -> None:
    d = on_member_end(rigid(R, R, R, restarts=3), 1, FL)
    assert d.action is Action.END_FAILED and "after 3 restart(s)" in d.reason


def test_elastic_with_enough_live_continues_resizing() -> None:
    d = on_member_end(elastic(2, 4, R, R, R), 2, FL)
    assert d.action is Action.CONTINUE and d.shrink and "2 member(s) go on (min 2)" in d.reason


def test_elastic_below_min_restarts() -> None:
    d = on_member_end(elastic(2, 4, R, FL, R), 2, LO)
    assert d.action is Action.RESTART and "fewer than min 2" in d.reason


def test_elastic_below_min_past_max_restarts_ends_failed() -> None:
    assert on_member_end(elastic(2, 4, R, FL, R, restarts=3), 2, FL).action is Action.END_FAILED


def test_member_zero_failing_restarts_even_elastic() -> None:
    d = on_member_end(elastic(1, 4, R, R, R), 0, FL)
    assert d.action is Action.RESTART and "rendezvous host" in d.reason


def test_member_stopped_on_its_node_ends_the_job() -> None:
    d = on_member_end(rigid(R, R), 1, ST)
    assert d.action is Action.END_FAILED and "stopped on its node" in d.reason


def test_elastic_last_member_exits_after_a_loss_ends_ok() -> None:
    d = on_member_end(elastic(2, 3, X, LO, R), 2, X)
    assert d.action is Action.END_OK and "2 of 3" in d.reason


def test_rigid_last_member_exits_after_a_failure_restarts() -> None:
    # (a failure always restarted first; a late exit of the last live member still repairs it)
    assert on_member_end(rigid(X, FL, R), 2, X).action is Action.RESTART


def test_bad_index_and_state_are_refused() -> None:
    with pytest.raises(ValueError, match="members 0..1"):
        on_member_end(rigid(R, R), 2, FL)
    with pytest.raises(ValueError):
        on_member_end(rigid(R, R), 0, "melted")


def test_table_moves() -> None:
    assert pm.step(MultiState.PLACING, Event.PLACED) == (MultiState.STARTING, ())
    assert pm.step(MultiState.STARTING, Event.ALL_RUNNING) == (MultiState.RUNNING, ())
    assert pm.step(MultiState.RESIZING, Event.ALL_RUNNING) == (MultiState.RUNNING, ())
    assert pm.step(MultiState.RUNNING, Event.SHRINK) == (MultiState.RESIZING, ())
    assert pm.step(MultiState.RUNNING, Event.RESTART) == (MultiState.RESTARTING, (Effect.STOP_MEMBERS,))
    assert pm.step(MultiState.RESTARTING, Event.RELAUNCHED) == (MultiState.STARTING, (Effect.RELAUNCH,))
    for s in pm.NOT_ENDED:
        assert pm.step(s, Event.END) == (MultiState.ENDED, (Effect.STOP_MEMBERS,))
    # an ended job writes nothing more: late reports are no refusal
    for e in Event:
        assert not pm.writes(MultiState.ENDED, e)


def test_table_is_total() -> None:
    for s in MultiState:
        for e in Event:
            pm.step(s, e)  # never IllegalTransition


def test_mermaid_draws_every_writing_move() -> None:
    text = pm.mermaid()
    assert text.startswith("stateDiagram-v2\n")
    assert "[*] --> starting: placed" in text and "restarting --> starting: relaunched" in text


def test_airlock_kill_ends_a_rigid_job_and_costs_an_elastic_one_a_member() -> None:
    d = on_member_end(rigid(R, R, R), 1, FL, airlock_kill=True)
    assert d.action is Action.END_FAILED and "killed by Airlock" in d.reason
    d = on_member_end(elastic(2, 3, R, R, R), 1, FL, airlock_kill=True)
    assert d.action is Action.CONTINUE and d.shrink and "killed by Airlock" in d.reason
    assert on_member_end(elastic(3, 4, R, R, R), 1, FL, airlock_kill=True).action is Action.RESTART
