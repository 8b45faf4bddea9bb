"""Hazard evidence and notice odds survive a restart of the migrate component (real SQLite store).

The component is started twice on the same store file, as laminard does after a crash or an
upgrade: what the first one saw (zone reclaim notices, a peer that fell silent without one,
node-hours of exposure) must be in the second one's hazard model and notice odds.
The zone is a stand-in (``FakeZone``: membership only, no sockets); the store, the event bus,
the config and the transfer endpoint (on 127.0.0.1) are the agent's own.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin_agent import standin_agent
from standin_origin import OriginQueries

from laminar.components import MigrateAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.migrate.evidence import EvidenceStore, NoticeOdds
from laminar.migrate.hazard import HazardError, HazardModel
from laminar.migrate.reclaim import ReclaimComponent
from laminar.store import Store


class NoJobs(OriginQueries):
    def active(self) -> list[Any]:
        return []

    def list(self) -> list[Any]:
        return []

    def get(self, job_id: str) -> None:
        return None


class FakeZone:
    """Only the membership view the migrate component reads (no sockets)."""

    networked = True
    node_id = 1
    zone = 1

    def __init__(self, peers: list[int]) -> None:
        by_node = {n: SimpleNamespace(zone=1, addr="127.0.0.1", owner="") for n in [1, *peers]}
        self.membership = SimpleNamespace(by_node=by_node, suspects=set(),
                                          state={n: SimpleNamespace(last_seen=time.time(), last_summary=None)
                                                 for n in by_node})
        self.keys: dict[int, bytes] = {}
        self.s = {"listen": "127.0.0.1"}


def make_agent(tmp: Path) -> SimpleNamespace:
    cfg = Config(validate({"agent": {"state_dir": str(tmp), "node": "lm-t-ev"},
                           "migrate": {"poll_s": 60.0, "periodic": False}}))
    store = Store(tmp / "state.db")
    return standin_agent(MigrateAgent, config=cfg, store=store, events=EventBus(store), jobs=NoJobs(), zone=None)


def run(coro: Any) -> Any:
    return asyncio.new_event_loop().run_until_complete(coro)


def test_learned_hazard_and_notice_odds_survive_a_restart(tmp_path: Path) -> None:
    async def first() -> tuple[float, float, float]:
        agent = make_agent(tmp_path)
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            prior = comp.evidence.hazards["default"].weekly_rate_per_h()
            now = time.time()
            comp.evidence.observe_exposure(now - 10 * 3600, now, nodes=3.0)  # 30 node-hours watched
            for node in (2, 3):  # two peers announce reclaims through the zone
                agent.events.emit("zone", f"node {node} reclaimed", node=node, deadline_ms=60_000)
            agent.events.emit("zone", "node 2 again", node=2, deadline_ms=30_000)  # the same reclaim
            agent.zone = FakeZone([2, 3, 4])
            agent.zone.membership.suspects.add(4)  # silent without a notice
            comp.evidence.tick(time.time())
            comp.evidence.tick(time.time())  # still silent: counted once
            learned = comp.evidence.hazards["default"].weekly_rate_per_h()
            assert comp.evidence.notice_odds.announced == 2 and comp.evidence.notice_odds.unannounced == 1
            return prior, learned, comp.evidence.notice_odds.unannounced_frac
        finally:
            await comp.stop()
            agent.store.db.close()

    prior, learned, frac = run(first())
    assert learned != pytest.approx(prior)  # the evidence moved the rate

    async def second() -> ReclaimComponent:
        agent = make_agent(tmp_path)  # a new process: a new store connection, a new component
        comp = ReclaimComponent()
        await comp.start(agent)
        await comp.stop()
        agent.store.db.close()
        return comp

    comp = run(second())
    hz = comp.evidence.hazards["default"]
    assert hz.total_events == pytest.approx(3.0)
    assert hz.total_exposure_h == pytest.approx(30.0, rel=1e-6)
    assert hz.weekly_rate_per_h() == pytest.approx(learned)
    assert comp.evidence.notice_odds.announced == 2 and comp.evidence.notice_odds.unannounced == 1
    assert comp.evidence.notice_odds.unannounced_frac == pytest.approx(frac)
    # the prior still comes from the configuration, not from the store
    assert hz.prior_rate_per_h == pytest.approx(1 / 24)


def test_a_changed_prior_applies_to_the_stored_evidence(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    seen = HazardModel("default")
    seen.observe_exposure(0.0, 7200.0)
    seen.observe_reclaim(3600.0)
    EvidenceStore(store).save("default", seen, NoticeOdds(announced=4.0))
    loaded, odds = EvidenceStore(store).load()
    m = HazardModel("default", prior_rate_per_h=2.0).merged(loaded["default"])
    assert m.total_events == 1.0 and m.total_exposure_h == pytest.approx(2.0)
    assert m.weekly_rate_per_h() == pytest.approx((2.0 * 24 + 1) / (24 + 2))
    assert odds["default"].unannounced_frac == pytest.approx(1 / 5)


def test_a_corrupt_row_is_not_evidence(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    ev = EvidenceStore(store)
    with store.tx() as db:
        db.execute("INSERT INTO migrate_hazard VALUES ('default', '[1, 2]', 'x', 0)")
    seen, _ = ev.load()
    assert "default" not in seen
    ev.save("default", HazardModel("default"))  # overwrites it
    assert "default" in ev.load()[0]


def test_notice_odds_learn_the_unannounced_share() -> None:
    o = NoticeOdds()
    assert o.unannounced_frac == 1.0  # before any evidence: every departure unannounced (cautious)
    for _ in range(9):
        o.observe(announced=True)
    assert o.unannounced_frac == pytest.approx(0.1)
    o.observe(announced=False)
    assert o.unannounced_frac == pytest.approx(2 / 11)
    with pytest.raises(HazardError, match="count"):
        o.observe(True, -1)
    with pytest.raises(HazardError, match="announced"):
        NoticeOdds(announced=float("nan"))


def test_a_peer_leaving_at_the_end_of_a_long_notice_window_is_one_announced_departure(tmp_path: Path) -> None:
    """A notice window may be hours long (campus owners): the peer falls silent at its end, more
    than an hour after its notice came. That silence was counted as a second, unannounced
    departure (the rule looked at when the notice came, not when its window ended), and the
    peer, whose departure was counted, still counted as exposed until then."""
    async def main() -> None:
        agent = make_agent(tmp_path)
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            agent.zone = FakeZone([2, 3])
            agent.events.emit("zone", "node 2 reclaimed", node=2, deadline_ms=2 * 3600 * 1000)
            assert comp.evidence.notice_odds.announced == 1
            assert comp.evidence.exposed_nodes() == 2.0  # itself and node 3: node 2's departure is counted
            now = time.time()
            comp.notices[2] = (now - 5, now - 2 * 3600 - 5)  # two hours later: its window just ended
            agent.zone.membership.suspects.add(2)
            comp.evidence.tick(time.time())
            assert comp.evidence.notice_odds.announced == 1 and comp.evidence.notice_odds.unannounced == 0
            assert comp.evidence.hazards["default"].total_events == 1.0
        finally:
            await comp.stop()
            agent.store.db.close()

    run(main())


def test_prestage_is_judged_over_the_jobs_that_share_the_window(tmp_path: Path) -> None:
    """With departures announced (no prestage for their odds), a job is prestaged when its final
    checkpoint would not leave within the expected notice window. That was judged for the job
    alone, but a reclaim moves every job through one uplink in one window: two jobs that each fit
    alone, not together, were both left without an off-node replica, and the one that did not fit
    lost its work at the reclaim. Real checkpoints on disk (their verified manifests' sizes are the
    planning sizes)."""
    from laminar import jobkit

    async def main() -> None:
        agent = make_agent(tmp_path)
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            comp.s.update(prestage="auto", expected_notice_s=10.0, path_mbit=8.0, notice_margin=1.0,
                          prestage_unannounced=0.5)
            comp.evidence.notice_odds.observe(True, 100.0)  # departures come with their notice here
            jobs = []
            for i, size in enumerate((6 << 20, 7 << 20)):  # 6.3 s and 7.3 s at 1 MB/s: each fits 10 s alone
                d = tmp_path / f"job{i}"
                jobkit.Checkpointer(job_id=f"j{i}", ckpt_dir=d, install_signal=False).save(bytes(size), step=1)
                jobs.append(SimpleNamespace(id=f"j{i}", ckpt_dir=d, active=True))
            # the planning size is the verified manifest's: the checkpoint driver checks them first
            agent.jobs = SimpleNamespace(active=lambda: jobs)
            assert comp.ckpt is not None
            await comp.ckpt.verify_new()
            alone = SimpleNamespace(active=lambda: jobs[1:])
            agent.jobs = alone
            assert not comp.checkpoints.should_prestage(jobs[1])  # alone on the node it fits the window
            agent.jobs = SimpleNamespace(active=lambda: jobs)
            assert not comp.checkpoints.should_prestage(jobs[0])  # the smaller leaves first: fits
            assert comp.checkpoints.should_prestage(jobs[1])  # behind it, the larger does not: prestaged
        finally:
            await comp.stop()
            agent.store.db.close()

    run(main())
