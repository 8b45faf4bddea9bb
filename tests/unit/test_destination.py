"""Destination choice: resource fit, notice window, survival, topology, reasons."""

from __future__ import annotations

import pytest

from laminar.migrate.destination import Candidate, DestinationError, MoveRequest, Resources, rank
from laminar.migrate.hazard import HazardModel

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
