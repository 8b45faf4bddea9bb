"""The checkpoint plan's uplink-share fixed point stays bounded when the
prestaged jobs' transfers would need more than the whole uplink (large checkpoints, a slow
link, a high hazard: the spot traces show MTBFs of 0.1-0.5 h)."""

from __future__ import annotations

import math

from laminar.migrate.hazard import HazardModel
from laminar.policy import ckpt_schedule as cs


def test_oversubscribed_uplink_gives_each_job_at_least_a_fair_share() -> None:
    """Was: 4 jobs of 100 GB over 1 Gbit/s at 2 departures per node-hour diverged: each job
    was planned a share of 0.1 MB/s and a 10-day transfer (share = link / (1 + the others'
    busy fractions), with busy fractions far above 1)."""
    m = HazardModel(prior_rate_per_h=2.0)
    link = 125e6
    jobs = [cs.CkptJob(f"j{i}", 100e9, 1e9, 2.0) for i in range(4)]
    plans = cs.plan(jobs, m, 1.79e9, link, 120.0)
    for p in plans.values():
        assert p.prestage
        assert p.share_bps >= link / 4 * (1 - 1e-9)
        assert p.transfer_s <= 100e9 / (link / 4) * (1 + 1e-9)
        assert math.isfinite(p.cost_s) and cs.MIN_INTERVAL_S <= p.interval_s <= cs.MAX_INTERVAL_S


def test_extreme_oversubscription_does_not_divide_by_zero() -> None:
    """Was: ZeroDivisionError (the busy fractions overflowed to inf, the share to 0): the
    agent's checkpoint round failed every poll, so no job on the node got a periodic
    checkpoint."""
    m = HazardModel()
    jobs = [cs.CkptJob(f"j{i}", 1e15, 1e12) for i in range(3)]
    plans = cs.plan(jobs, m, 1.79e9, 1e-3, 10.0)
    assert all(p.share_bps >= 1e-3 / 3 * (1 - 1e-9) and math.isfinite(p.transfer_s) for p in plans.values())


def test_an_undersubscribed_link_is_planned_as_before() -> None:
    """The bound only matters past saturation: small checkpoints keep nearly the whole link."""
    m = HazardModel()
    jobs = [cs.CkptJob(f"j{i}", 1e9, 1e9) for i in range(3)]
    plans = cs.plan(jobs, m, 1.79e9, 125e6, 0.0)
    for p in plans.values():
        assert p.share_bps > 0.95 * 125e6
