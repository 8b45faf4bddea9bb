"""Storage keepers and the keeper's retry schedule (laminar.policy.keeper): pure policy."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from laminar.policy.keeper import KeeperCandidate, KeeperError, RetrySchedule, choose_keeper

GB = 1e9
LINK = 1.25e9  # 10 Gbit/s


def hc(node: str, free: float | None = 100 * GB, surv: float = 0.9, zone: str = "1", bps: float = LINK) -> KeeperCandidate:
    return KeeperCandidate(node, zone, free, bps, surv)


def order(ranked: list) -> list[str]:
    return [r.candidate.node for r in ranked]


def test_best_survival_with_the_disk_space_holds() -> None:
    r = choose_keeper([hc("a", surv=0.80), hc("b", surv=0.99, free=1 * GB), hc("c", surv=0.95)], 8 * GB, 120)
    assert order(r) == ["c", "a", "b"]
    assert [x.feasible for x in r] == [True, True, False]
    assert any("needs 8.00 GB of disk, 1.00 GB free" in s for s in r[2].reasons)


def test_reserve_counts_against_the_free_space() -> None:
    r = choose_keeper([hc("a", free=9 * GB)], 8 * GB, None, reserve_bytes=2 * GB)
    assert not r[0].feasible
    assert choose_keeper([hc("a", free=10 * GB)], 8 * GB, None, reserve_bytes=2 * GB)[0].feasible


def test_unknown_disk_space_is_infeasible() -> None:
    r = choose_keeper([hc("silent", free=None, surv=1.0), hc("ok", surv=0.5)], GB, 60)
    assert order(r) == ["ok", "silent"]
    assert not r[1].feasible and "free disk space unknown" in r[1].reasons


def test_transfer_must_fit_the_usable_window() -> None:
    # 8 GB at 0.1 GB/s = 80 s; a 90 s window with margin 0.8 leaves 72 s
    slow = hc("slow", surv=0.99, bps=0.1 * GB)
    fast = hc("fast", surv=0.90)
    r = choose_keeper([slow, fast], 8 * GB, 90, margin=0.8)
    assert order(r) == ["fast", "slow"] and not r[1].feasible
    assert r[1].transfer_s == pytest.approx(80.0)
    # no deadline (prestaging): the slow one is fine and survives better
    assert order(choose_keeper([slow, fast], 8 * GB, None)) == ["slow", "fast"]


def test_ties_prefer_the_keeper_then_the_zone_then_the_faster_path() -> None:
    cands = [hc("z2", zone="2"), hc("slow", bps=LINK / 2), hc("fast"), hc("keeper", bps=LINK / 4, zone="2")]
    assert order(choose_keeper(cands, GB, None, src_zone="1", prefer={"keeper"})) == ["keeper", "fast", "slow", "z2"]
    # survival beats the preference
    cands.append(hc("safe", surv=0.999))
    assert order(choose_keeper(cands, GB, None, src_zone="1", prefer={"keeper"}))[0] == "safe"


def test_bad_input_names_the_value() -> None:
    with pytest.raises(KeeperError, match="survival"):
        hc("x", surv=1.5)
    with pytest.raises(KeeperError, match="path_bps"):
        hc("x", bps=0)
    with pytest.raises(KeeperError, match="free_bytes"):
        hc("x", free=-1)
    with pytest.raises(KeeperError, match="ckpt_bytes"):
        choose_keeper([], -1, None)
    with pytest.raises(KeeperError, match="window_s"):
        choose_keeper([], 1, float("nan"))
    with pytest.raises(KeeperError, match="margin"):
        choose_keeper([], 1, 10, margin=0)


def test_retry_delays_double_up_to_the_cap() -> None:
    r = RetrySchedule(2.0, 2.0, 30.0)
    assert [r.delay(k) for k in range(7)] == [2, 4, 8, 16, 30, 30, 30]
    assert r.delay(10_000) == 30.0  # no overflow
    assert RetrySchedule(5.0, 1.0, 5.0).delay(50) == 5.0


def test_first_look_at_or_after() -> None:
    r = RetrySchedule(2.0, 2.0, 30.0)
    # looks at 100, 102, 106, 114, 130, 160, 190, ...
    assert r.first_at_or_after(100, 50) == 100
    assert r.first_at_or_after(100, 100) == 100
    assert r.first_at_or_after(100, 101) == 102
    assert r.first_at_or_after(100, 114) == 114
    assert r.first_at_or_after(100, 115) == 130
    assert r.first_at_or_after(100, 131) == 160
    assert r.first_at_or_after(100, 1000) == 1000  # 130 + 29 * 30
    assert r.first_at_or_after(100, 1000.5) == 1030
    assert r.first_at_or_after(100, math.inf) == math.inf


@given(st.floats(0.1, 10), st.floats(1, 4), st.floats(10, 100), st.floats(0, 5000))
def test_first_look_is_a_look_and_never_more_than_the_cap_late(base: float, factor: float, cap: float, dt: float) -> None:
    r = RetrySchedule(base, factor, max(cap, base))
    at = r.first_at_or_after(0.0, dt)
    assert at >= dt - 1e-9
    assert at - dt <= r.max_s + 1e-6
    # it is one of the schedule's looks: walk the looks
    t, k = 0.0, 0
    while t < at - 1e-6:
        t += r.delay(k)
        k += 1
    assert t == pytest.approx(at, abs=1e-6)


def test_bad_schedule_names_the_value() -> None:
    with pytest.raises(KeeperError, match="base_s"):
        RetrySchedule(0, 2, 30)
    with pytest.raises(KeeperError, match="factor"):
        RetrySchedule(1, 0.5, 30)
    with pytest.raises(KeeperError, match="max_s"):
        RetrySchedule(10, 2, 5)
    with pytest.raises(KeeperError, match="attempt"):
        RetrySchedule().delay(-1)
