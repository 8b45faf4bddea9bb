"""laminar.userbounds: per-user slots of work in flight, the per-user event budget, refusal counts."""

from __future__ import annotations

import pytest

from laminar.userbounds import Busy, EventBudget, Refusals, UidSlots


def test_slots_bound_each_user_and_all_users_and_never_root() -> None:
    s = UidSlots("things", per_uid=2, total=3, reason="uid_things")
    s.take(1000)
    s.take(1000)
    with pytest.raises(Busy) as e:
        s.take(1000)
    assert e.value.reason == "uid_things" and "uid 1000 already has 2 things" in e.value.message
    assert "at most 2 per user, 3 for all users" in e.value.message
    s.take(1001)
    with pytest.raises(Busy):
        s.take(1002)  # all users together: 3
    for _ in range(10):
        s.take(0)  # root is never counted nor refused
    assert s.in_flight() == 3 and s.in_flight(1000) == 2
    s.release(1000)
    s.take(1002)
    s.release(0)
    assert s.in_flight(0) == 0


def test_slots_hold_releases_on_error_and_exempts() -> None:
    s = UidSlots("things", per_uid=1, total=10, reason="r")
    with pytest.raises(RuntimeError), s.hold(5):
        assert s.in_flight(5) == 1
        raise RuntimeError
    assert s.in_flight(5) == 0
    with s.hold(5), s.hold(5, exempt=True):  # an exempt caller (the control group) is not counted
        assert s.in_flight(5) == 1


def test_event_budget_stores_a_burst_then_says_how_many_were_not() -> None:
    now = [0.0]
    said: list[tuple[int, str, int]] = []
    b = EventBudget(burst=3, per_s=1.0, on_spent=lambda uid, text, n: said.append((uid, text, n)), clock=lambda: now[0])
    assert [b.admit(1000) for _ in range(3)] == [True, True, True]
    assert [b.admit(1000) for _ in range(5)] == [False] * 5
    assert len(said) == 1 and "spent its budget of 3" in said[0][1]  # said once, not per event
    assert b.admit(0) and b.admit(None)  # root's and the agent's own: never limited
    assert b.admit(1001)  # another user's bucket is its own
    now[0] = 2.0  # two tokens back
    assert b.admit(1000)
    assert len(said) == 2 and said[1][2] == 5 and "5 event(s) caused by uid 1000 were not stored" in said[1][1]
    assert b.suppressed_total == 5


def test_event_budget_off_at_zero() -> None:
    b = EventBudget(burst=0, per_s=1.0)
    assert all(b.admit(1000) for _ in range(10_000))


def test_refusals_by_reason() -> None:
    r = Refusals()
    r.count("b")
    r.count("a", 2)
    assert r.as_dict() == {"a": 2, "b": 1} and r.total() == 3
