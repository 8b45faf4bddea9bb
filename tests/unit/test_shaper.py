"""The deadline shaper's policy (laminar.policy.shaper): pure, no privileges."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.policy.shaper import (
    DONE,
    INFEASIBLE,
    LATE,
    ON_TIME,
    TIGHT,
    LinkBudget,
    ShaperParams,
    TransferDemand,
    changed_enough,
    decide,
    need_bps,
    validate_request,
)

GBIT = 1_000_000_000
MBIT = 1_000_000
LINK = LinkBudget(link_bps=GBIT, background_floor_bps=400 * MBIT)  # migration budget 600 Mbit/s


def test_rate_is_need_plus_margin() -> None:
    # 100 MB in 10 s = 80 Mbit/s; +10% = 88 Mbit/s.
    d = decide([TransferDemand("a", 100_000_000, 10.0)], now_s=0.0, link=LINK, params=ShaperParams(margin=0.1))
    r = d.rates["a"]
    assert r.status == ON_TIME and r.feasible
    assert r.need_bps == pytest.approx(80 * MBIT)
    assert r.rate_bps == 88 * MBIT
    assert "80.00 Mbit/s" in r.reason
    assert d.infeasible == []


def test_rate_follows_progress_and_time() -> None:
    p = ShaperParams(margin=0.0)
    early = decide([TransferDemand("a", 100_000_000, 10.0)], now_s=0.0, link=LINK, params=p).rates["a"]
    # Half the time gone, 3/4 of the bytes left: the rate goes up to 1.5x.
    later = decide([TransferDemand("a", 75_000_000, 10.0)], now_s=5.0, link=LINK, params=p).rates["a"]
    assert later.rate_bps == pytest.approx(early.rate_bps * 1.5, rel=1e-6)


def test_background_floor_is_kept() -> None:
    # Two transfers that each fit but whose margins do not: margins shrink, the sum stays in budget.
    ts = [TransferDemand("a", 350_000_000, 10.0), TransferDemand("b", 350_000_000, 10.0)]  # 280+280 Mbit/s
    d = decide(ts, now_s=0.0, link=LINK, params=ShaperParams(margin=0.2))
    assert {r.status for r in d.rates.values()} == {TIGHT}
    assert d.migration_bps <= LINK.migration_budget_bps + 2  # rounding up of two rates
    for r in d.rates.values():
        assert r.rate_bps >= r.need_bps
        assert "margin cut" in r.reason


def test_infeasible_alone_is_reported_with_reason() -> None:
    # 1 GB in 10 s = 800 Mbit/s > 600 Mbit/s budget (but < the 1 Gbit/s link).
    d = decide([TransferDemand("big", GBIT, 10.0)], now_s=0.0, link=LINK)
    r = d.rates["big"]
    assert r.status == INFEASIBLE and not r.feasible
    assert "800.00 Mbit/s" in r.reason and "migration budget is 600.00 Mbit/s" in r.reason
    assert "background floor 400.00 Mbit/s" in r.reason
    # Best effort: it still gets the whole budget, not more.
    assert r.rate_bps == LINK.migration_budget_bps
    assert [x.id for x in d.infeasible] == ["big"]


def test_earliest_deadline_first_admission() -> None:
    # Each needs 400 Mbit/s; only one fits. The earlier deadline is admitted, the later one is not,
    # and is told why.
    ts = [TransferDemand("late-due", 500_000_000, 10.0), TransferDemand("early-due", 250_000_000, 5.0)]
    d = decide(ts, now_s=0.0, link=LINK, params=ShaperParams(margin=0.0))
    assert d.rates["early-due"].status == ON_TIME
    assert d.rates["late-due"].status == INFEASIBLE
    assert "due earlier" in d.rates["late-due"].reason
    # Feasible ones are served first; the infeasible one gets exactly what is left.
    assert d.rates["late-due"].rate_bps == LINK.migration_budget_bps - d.rates["early-due"].rate_bps


def test_late_and_done() -> None:
    ts = [TransferDemand("late", 1000, 5.0), TransferDemand("done", 0, 50.0)]
    d = decide(ts, now_s=6.0, link=LINK)
    assert d.rates["late"].status == LATE and math.isinf(d.rates["late"].need_bps)
    assert "passed 1.0 s ago" in d.rates["late"].reason
    assert d.rates["done"].status == DONE and d.rates["done"].feasible
    assert d.rates["done"].rate_bps == ShaperParams().min_rate_bps


def test_max_rate_cap() -> None:
    d = decide([TransferDemand("capped", 100_000_000, 10.0, max_rate_bps=50 * MBIT)], now_s=0.0, link=LINK)
    assert d.rates["capped"].status == INFEASIBLE and "own cap" in d.rates["capped"].reason
    assert d.rates["capped"].rate_bps == 50 * MBIT


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="given twice"):
        decide([TransferDemand("a", 1, 1.0), TransferDemand("a", 1, 2.0)], 0.0, LINK)
    with pytest.raises(ValueError, match="remaining bytes -1"):
        decide([TransferDemand("a", -1, 1.0)], 0.0, LINK)
    with pytest.raises(ValueError, match="background floor"):
        LinkBudget(link_bps=100, background_floor_bps=100)
    with pytest.raises(ValueError, match="margin"):
        ShaperParams(margin=-0.5)


def test_validate_request() -> None:
    assert validate_request(100, 0, 10.0, 0.0, LINK) is None
    assert "in the past" in (validate_request(100, 0, 5.0, 6.0, LINK) or "")
    assert "total_bytes 0" in (validate_request(0, 0, 10.0, 0.0, LINK) or "")
    assert "sent_bytes 200" in (validate_request(100, 200, 10.0, 0.0, LINK) or "")
    assert "beyond the link rate" in (validate_request(100, 0, 10.0, 0.0, LINK, max_rate_bps=2 * GBIT) or "")
    # 2 GB in 10 s = 1.6 Gbit/s > the link: refused outright.
    why = validate_request(2 * GBIT, 0, 10.0, 0.0, LINK)
    assert why is not None and "1.60 Gbit/s" in why and "beyond the link rate 1.00 Gbit/s" in why
    # Above the migration budget but within the link: accepted (and later reported infeasible).
    assert validate_request(GBIT, 0, 10.0, 0.0, LINK) is None


def test_changed_enough() -> None:
    assert changed_enough(None, 10)
    assert not changed_enough(100 * MBIT, 101 * MBIT)
    assert changed_enough(100 * MBIT, 103 * MBIT)
    assert changed_enough(100 * MBIT, 97 * MBIT)


def test_need_bps() -> None:
    assert need_bps(0, 1.0, 5.0) == 0.0
    assert math.isinf(need_bps(1, 1.0, 5.0))
    assert need_bps(125, 2.0, 1.0) == 1000.0


demand = st.builds(
    TransferDemand,
    id=st.uuids().map(str),
    remaining_bytes=st.integers(0, 10 * GBIT),
    deadline_s=st.floats(-5.0, 120.0),
    max_rate_bps=st.one_of(st.none(), st.integers(10_000, 2 * GBIT)),
    unconfirmed_bytes=st.integers(0, GBIT),
)


@settings(max_examples=300, deadline=None)
@given(ts=st.lists(demand, max_size=12, unique_by=lambda t: t.id), margin=st.floats(0.0, 1.0),
       floor=st.integers(0, GBIT - 1))
def test_invariants(ts: list[TransferDemand], margin: float, floor: int) -> None:
    link = LinkBudget(GBIT, floor)
    p = ShaperParams(margin=margin)
    d = decide(ts, now_s=0.0, link=link, params=p)
    assert set(d.rates) == {t.id for t in ts}
    feasible = [r for r in d.rates.values() if r.feasible and r.status != DONE]
    for r in d.rates.values():
        assert isinstance(r.rate_bps, int) and r.rate_bps >= p.min_rate_bps
        assert r.reason
    for r in feasible:
        assert r.rate_bps >= r.need_bps  # keeping this rate finishes on time
    # The floor holds: the rates together exceed the budget by no more than one bit of rounding
    # and one HTB trickle (min_rate_bps) per transfer.
    assert d.migration_bps <= link.migration_budget_bps + len(ts) * (p.min_rate_bps + 1)


def test_unconfirmed_bytes_keep_a_rate_that_sends_them_by_the_deadline() -> None:
    """Progress counted on the wire can run ahead of the payload: 1 byte left by the estimate, 200 kB
    maybe left really. The rate is not the 8 kbit/s floor but what sends both by the deadline
    (with the margin); the status still follows the estimate, and the floor comes from spare budget."""
    p = ShaperParams(margin=0.1)
    alone = decide([TransferDemand("a", 1, 20.0, unconfirmed_bytes=200_000)], now_s=0.0, link=LINK, params=p).rates["a"]
    assert alone.rate_bps >= 200_001 * 8 / 20.0 * 1.1
    assert alone.status == "on-time" and "unconfirmed" not in alone.status and "estimated progress" in alone.reason
    before = decide([TransferDemand("a", 1, 20.0)], now_s=0.0, link=LINK, params=p).rates["a"]
    assert before.rate_bps == p.min_rate_bps  # what counted progress alone gave
    # The budget (600 Mbit/s) is held by a transfer due earlier: the raise takes only what is left.
    full = decide([TransferDemand("first", 700_000_000, 10.0), TransferDemand("a", 1, 20.0, unconfirmed_bytes=GBIT)],
                  now_s=0.0, link=LINK, params=p)
    assert full.rates["first"].rate_bps >= 560 * MBIT
    assert full.migration_bps <= LINK.migration_budget_bps + 2 * (p.min_rate_bps + 1)  # rounding and trickles
    with pytest.raises(ValueError, match="unconfirmed bytes -1"):
        decide([TransferDemand("a", 1, 20.0, unconfirmed_bytes=-1)], now_s=0.0, link=LINK)
