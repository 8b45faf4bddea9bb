"""Destination choice: resource fit, notice window, survival, topology, reasons."""

from __future__ import annotations

import pytest

from laminar.migrate.hazard import HazardModel
from laminar.policy.destination import Candidate, DestinationError, MoveRequest, Resources, rank

GiB = 2**30
FREE = Resources(gpus=4, mem_bytes=64 * GiB, cpus=32)


def req(**kw: object) -> MoveRequest:
    base: dict[str, object] = dict(
        job_id="j1", need=Resources(1, 8 * GiB, 4), ckpt_bytes=4e9, remaining_s=7200, window_s=60,
        src_node="a", src_zone="z1", src_rack="r1",
    )
    base.update(kw)
    return MoveRequest(**base)  # type: ignore[arg-type]


def test_same_rack_wins_when_all_else_is_equal() -> None:
    cs = [
        Candidate("far", "z2", "r9", FREE, 1e9, survival=0.9),
        Candidate("rack", "z1", "r1", FREE, 1e9, survival=0.9),
        Candidate("zone", "z1", "r2", FREE, 1e9, survival=0.9),
    ]
    assert [r.candidate.node for r in rank(req(), cs)] == ["rack", "zone", "far"]


def test_survival_beats_a_small_topology_gain() -> None:
    cs = [Candidate("risky", "z1", "r1", FREE, 1e9, survival=0.2), Candidate("safe", "z1", "r2", FREE, 1e9, survival=0.99)]
    r = rank(req(), cs)
    assert r[0].candidate.node == "safe"
    assert r[0].expected_loss_s < r[1].expected_loss_s


def test_infeasible_candidates_come_last_with_reasons() -> None:
    cs = [
        Candidate("slow", "z1", "r1", FREE, 10e6, survival=1.0),  # 4 GB at 10 MB/s: 400 s > 48 s
        Candidate("small", "z1", "r1", Resources(0, 4 * GiB, 2), 1e9, survival=1.0),
        Candidate("a", "z1", "r1", FREE, 1e9, survival=1.0),  # the source itself
        Candidate("ok", "z2", "r5", FREE, 1e9, survival=0.5),
    ]
    r = rank(req(), cs)
    assert r[0].candidate.node == "ok" and r[0].feasible
    by = {x.candidate.node: x for x in r}
    assert not by["slow"].feasible and any("does not fit the window" in s for s in by["slow"].reasons)
    assert not by["small"].feasible and any("needs 1 GPUs, 0 free" in s for s in by["small"].reasons)
    assert not by["a"].feasible and by["a"].reasons == ("is the node being reclaimed",)


def test_prestaged_checkpoint_lifts_the_window_limit() -> None:
    c = Candidate("slow", "z1", "r1", FREE, 10e6, survival=1.0)
    assert not rank(req(), [c])[0].feasible
    r = rank(req(prestaged_on=frozenset({"slow"})), [c])[0]
    assert r.feasible and r.transfer_s == 0


def test_no_window_means_no_deadline() -> None:
    c = Candidate("slow", "z1", "r1", FREE, 10e6, survival=1.0)
    assert rank(req(window_s=None), [c])[0].feasible


def test_survival_from_hazard_models() -> None:
    c_calm = Candidate("calm", "z1", "r1", FREE, 1e9, provider="campus")
    c_spot = Candidate("spot", "z1", "r1", FREE, 1e9, provider="aws")
    hz = {"campus": HazardModel(prior_rate_per_h=0.01), "aws": HazardModel(prior_rate_per_h=1.0)}
    r = rank(req(), [c_spot, c_calm], hazards=hz, now=1.7e9)
    assert [x.candidate.node for x in r] == ["calm", "spot"]
    assert r[0].survival == pytest.approx(HazardModel(prior_rate_per_h=0.01).survival(1.7e9, 7200))
    with pytest.raises(DestinationError, match="provider 'aws' has no hazard model"):
        rank(req(), [c_spot], hazards={}, now=0)


def test_bad_input_is_named() -> None:
    with pytest.raises(DestinationError, match="path_bps"):
        Candidate("x", "z", "r", FREE, 0)
    with pytest.raises(DestinationError, match="survival"):
        Candidate("x", "z", "r", FREE, 1, survival=1.5)
    with pytest.raises(DestinationError, match="remaining_s"):
        req(remaining_s=-1)


def test_a_nan_window_is_refused_not_taken_as_fitting() -> None:
    """A NaN window compared false with every transfer, so any destination 'fit the window'."""
    with pytest.raises(DestinationError, match="window_s"):
        req(window_s=float("nan"))


@pytest.mark.parametrize("field", ["ckpt_bytes", "remaining_s"])
def test_infinite_sizes_and_times_are_refused(field: str) -> None:
    with pytest.raises(DestinationError, match=field):
        req(**{field: float("inf")})
    with pytest.raises(DestinationError, match="path_bps"):
        Candidate("b", "z1", "r1", FREE, float("inf"), survival=0.9)


def test_every_accepted_request_ranks_with_a_number() -> None:
    """No input the constructors accept gives a NaN score (NaN sorts anywhere: an infinite
    checkpoint to a node sure to survive scored inf * 0 = NaN and the ranking was arbitrary)."""
    import math

    from hypothesis import given, settings
    from hypothesis import strategies as st

    finite = st.floats(min_value=0, max_value=1e15, allow_nan=False, allow_infinity=False)

    @settings(max_examples=300, deadline=None)
    @given(size=finite, remaining=finite, window=st.none() | finite,
           cands=st.lists(st.tuples(st.floats(1e-3, 1e15), st.floats(0, 1)), min_size=1, max_size=4))
    def check(size: float, remaining: float, window: float | None, cands: list[tuple[float, float]]) -> None:
        r = req(ckpt_bytes=size, remaining_s=remaining, window_s=window)
        got = rank(r, [Candidate(f"n{i}", "z1", "r1", FREE, bps, survival=s) for i, (bps, s) in enumerate(cands)])
        assert all(not math.isnan(x.expected_loss_s) for x in got)
        feas = [x.expected_loss_s for x in got if x.feasible]
        assert feas == sorted(feas)

    check()
