"""laminar.policy.gang: the pure decisions of a gang placement (no I/O, no clock)."""

from __future__ import annotations

import random

import pytest

from laminar.policy import gang
from laminar.policy import placement as pl


def _offer(node: int, expires: float = 10.0, zone: int = 1) -> pl.Offer:
    return pl.Offer(node, zone, None, pl.Reservation(7, pl.Demand(), (), expires))


def test_one_zone_when_one_fits_drawn_by_fit() -> None:
    fits = {1: 2.0, 2: 4.0, 3: 12.0}
    seen = {gang.choose_zones(fits, 4, random.Random(s)) for s in range(200)}
    assert seen == {((2, 4),), ((3, 4),)}  # zone 1 cannot hold 4
    picks = [gang.choose_zones(fits, 4, random.Random(s)) for s in range(2000)]
    assert picks.count(((3, 4),)) > 2.5 * picks.count(((2, 4),))  # proportional to fit: 12 vs 4


def test_several_zones_only_with_spread() -> None:
    fits = {1: 2.0, 2: 3.0, 3: 1.0}
    assert gang.choose_zones(fits, 4, random.Random(0)) is None
    assert gang.choose_zones(fits, 4, random.Random(0), spread=True) == ((2, 3), (1, 1))
    assert gang.choose_zones(fits, 7, random.Random(0), spread=True) is None  # 6 in all
    # a zone that fits alone wins over a spread even when spreading is allowed
    assert gang.choose_zones({1: 2.0, 2: 9.0}, 3, random.Random(0), spread=True) == ((2, 3),)


def test_exclude_and_bad_fits() -> None:
    fits = {1: 5.0, 2: float("inf"), 3: -1.0, 4: 0.5}
    assert gang.choose_zones(fits, 3, random.Random(0), exclude=[1]) is None
    assert gang.choose_zones(fits, 3, random.Random(0)) == ((1, 3),)


@pytest.mark.parametrize("k", [0, -1, 65, 2.0, True])
def test_bad_k_refused_with_value(k: object) -> None:
    with pytest.raises(pl.PlacementError, match=r"k .* workers; allowed 1\.\.64"):
        gang.choose_zones({1: 9.0}, k, random.Random(0))  # type: ignore[arg-type]


def test_probe_count_d_times_k_within_zone() -> None:
    assert gang.probe_count(2, 3, 100) == 6
    assert gang.probe_count(4, 8, 20) == 20
    with pytest.raises(pl.PlacementError):
        gang.probe_count(0, 3, 100)


def test_steps_widen_as_the_retry_policy() -> None:
    policy = pl.RetryPolicy(d=2, d_max=8, widen=2, widen_steps=2, zones=2)
    probes = [s for s in gang.steps(policy) if isinstance(s, pl.Probe)]
    assert [(s.zone_rank, s.d) for s in probes] == [(0, 2), (0, 4), (0, 8), (1, 2), (1, 4), (1, 8)]
    assert isinstance(gang.steps(policy, 1)[-1], pl.Queue)


def test_pick_gang_first_k_distinct_live() -> None:
    offers = [_offer(5), _offer(5), _offer(3, expires=0.5), _offer(8), _offer(2), _offer(9)]
    got = gang.pick_gang(offers, 3, now=1.0)
    assert got is not None and [o.node for o in got] == [5, 8, 2]
    assert gang.pick_gang(offers, 5, now=1.0) is None  # only 4 live distinct nodes
    assert gang.pick_gang(offers, 2, now=9.5, margin_s=1.0) is None
    assert [o.node for o in gang.unused(offers, got)] == [3, 9]


def test_lease_covers_answers_and_commits() -> None:
    assert gang.probe_lease_s(0.1, 0.25, 0.25, 2) == pytest.approx(0.85)


def test_message_bounds() -> None:
    assert gang.messages_bound_per_worker(2) == 9
    assert gang.sent_bound_per_worker(2) == 5
    with pytest.raises(pl.PlacementError):
        gang.messages_bound_per_worker(0)


def test_zone_table_of_whole_fits_draws_as_choose_zones() -> None:
    # the placer's cached draw (a ZoneTable of the zones whose fit holds k) picks the zone
    # choose_zones picks for the same rng state
    fits = {z: float((z * 37) % 11) for z in range(1, 40)}
    tab = pl.ZoneTable.of(gang.whole_fits(fits, 4))
    for s in range(300):
        assert gang.choose_zones(fits, 4, random.Random(s)) == ((tab.choose(random.Random(s)), 4),)
