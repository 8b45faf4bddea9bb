"""The periodic checkpoint driver's due and stagger logic, and one driver round, without root.

The round tests use a stand-in for the job manager (FakeJobs: no cgroups, no processes started)
whose ``request_checkpoint`` writes a real jobkit checkpoint; the job's "main process" is this
test process, with a real SIGUSR1 handler installed for the signal check.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from standin_origin import OriginQueries

from laminar import jobkit
from laminar.migrate import ckpt_driver as cd
from laminar.migrate.evidence import NoticeOdds
from laminar.migrate.hazard import HazardModel
from laminar.migrate.reclaim import CONFIG_FIELDS
from laminar.policy import ckpt_schedule as cs
from laminar.runtime.signals import catches_signal


def plan(jid: str, interval: float, cost: float = 0.1) -> cs.CkptPlan:
    return cs.CkptPlan(jid, interval, cost, 1e6, 0.0, False, 100.0, "test")


def track(jid: str, first_seen: float, interval: float, **kw: Any) -> cd.Track:
    t = cd.Track(jid, first_seen, **kw)
    t.plan = plan(jid, interval)
    return t


def test_due_counts_from_newest_checkpoint_or_signal() -> None:
    t = track("a", 100.0, 10.0)
    assert cd.due_at(t) == 110.0
    t.newest_at = 105.0
    assert cd.due_at(t) == 115.0
    t.signal_at = 120.0
    assert cd.due_at(t) == 130.0
    t.plan = None
    assert math.isinf(cd.due_at(t))


def test_nothing_due_before_the_interval() -> None:
    ts = [track("a", 0.0, 10.0), track("b", 0.0, 10.0)]
    assert cd.due_now(ts, 9.0, 1.0, 60.0) == []


def test_jobs_due_together_are_staggered_by_the_gap() -> None:
    ts = [track("a", 0.0, 10.0), track("b", 0.0, 10.0)]
    assert cd.due_now(ts, 10.0, 1.0, 60.0) == ["a"]  # b waits for a's slot
    assert ts[1].start_at == pytest.approx(11.0)
    ts[0].signal_at, ts[0].pending = 10.0, True
    # a is in flight: b still queues behind it, a is not due again
    assert cd.due_now(ts, 10.5, 1.0, 60.0) == []
    ts[0].pending, ts[0].newest_at = False, 10.2  # a committed
    assert cd.due_now(ts, 11.0, 1.0, 60.0) == ["b"]
    assert ts[0].start_at == pytest.approx(20.2)  # next interval counts from the commit


def test_pending_checkpoint_keeps_the_slot_until_it_commits() -> None:
    ts = [track("a", 0.0, 10.0, signal_at=10.0, pending=True), track("b", 0.0, 10.0)]
    # a has not committed after 5 s: b's start moves with a's elapsed time (+ the gap)
    assert cd.due_now(ts, 15.0, 1.0, 60.0) == []
    assert ts[1].start_at == pytest.approx(16.0)


def test_a_job_due_before_the_one_in_flight_still_queues_behind_it() -> None:
    # b fell due (10.05) between a's due time (10.0) and a's signal (10.1): it still waits
    a = track("a", 0.0, 10.0, signal_at=10.1, pending=True)
    b = track("b", 0.05, 10.0)
    assert cd.due_now([a, b], 10.3, 1.0, 60.0) == []
    assert b.start_at == pytest.approx(11.3)  # a is still writing: its slot lasts until now + the gap


def test_a_late_round_starts_one_job_only() -> None:
    ts = [track("a", 0.0, 10.0), track("b", 0.0, 10.0), track("c", 0.0, 10.0)]
    assert cd.due_now(ts, 15.0, 1.0, 60.0) == ["a"]


def test_stagger_never_delays_more_than_the_max() -> None:
    ts = [track("a", 0.0, 10.0, signal_at=10.0, pending=True), track("b", 0.0, 0.5)]
    # b was due at 0.5, a in flight since 10: the cap of 2 s lets b go at 2.5 regardless
    assert cd.due_now(ts, 3.0, 1.0, 2.0) == ["b"]


def test_skipped_and_planless_tracks_are_left_out() -> None:
    a = track("a", 0.0, 1.0, skip="opted out")
    b = cd.Track("b", 0.0)
    assert cd.due_now([a, b], 100.0, 1.0, 60.0) == []


def test_catches_signal_reads_the_real_disposition() -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: None); print('ok', flush=True); time.sleep(30)"
    catching = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    plain = subprocess.Popen([sys.executable, "-c", "import time; print('ok', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE)
    try:
        assert catching.stdout is not None and plain.stdout is not None
        catching.stdout.readline()
        plain.stdout.readline()
        assert catches_signal(catching.pid, "SIGUSR1")
        assert not catches_signal(plain.pid, "SIGUSR1")
        assert not catches_signal(catching.pid, "SIGNOPE")
    finally:
        for p in (catching, plain):
            p.kill()
            p.wait(10)
    assert not catches_signal(catching.pid, "SIGUSR1")  # gone


# -- one driver round over stand-in jobs ------------------------------------------------------


@dataclass
class FakeSpec:
    env: dict[str, str] = field(default_factory=dict)
    checkpoint_signal: str = "SIGUSR1"
    periodic_checkpoints: bool = True


@dataclass
class FakeJob:
    id: str
    ckpt_dir: Path
    spec: FakeSpec = field(default_factory=FakeSpec)
    pid: int = field(default_factory=os.getpid)
    step: int = 0


class FakeJobs(OriginQueries):
    """Stand-in for JobManager: a checkpoint request commits a real jobkit checkpoint at once."""

    def __init__(self, jobs: list[FakeJob]) -> None:
        self.jobs = jobs
        self.requests: list[str] = []

    def active(self) -> list[FakeJob]:
        return list(self.jobs)

    def catches_checkpoint(self, job: FakeJob) -> bool:  # as JobManager's for a job of this node alone
        return catches_signal(job.pid, job.spec.checkpoint_signal)

    def request_checkpoint(self, job: FakeJob) -> bool:
        self.requests.append(job.id)
        job.step += 1
        jobkit.Checkpointer(job.id, job.ckpt_dir, install_signal=False).save(b"x" * 1000, step=job.step)
        return True


class FakeEvents:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, message: str, **f: Any) -> None:
        self.events.append({"kind": kind, "message": message, **f})


class FakeEvidence:
    """The parts of the component's evidence (laminar.migrate.evidence.Evidence) the driver reads."""

    def __init__(self) -> None:
        self.hazards = {"default": HazardModel("default", prior_rate_per_h=100.0)}
        self.notice_odds = NoticeOdds()  # no evidence: every departure unannounced, rollback share 1
        self.exposure: list[tuple[float, float, float]] = []

    def observe_exposure(self, t0: float, t1: float, nodes: float = 1.0) -> None:
        self.exposure.append((t0, t1, nodes))
        self.hazards["default"].observe_exposure(t0, t1, nodes)

    def exposed_nodes(self) -> float:
        return 1.0


class FakeComp:
    """The parts of ReclaimComponent the driver reads."""

    def __init__(self, jobs: FakeJobs, **cfg: Any) -> None:
        self.s = {k: f.default for k, f in CONFIG_FIELDS.items()} | cfg
        self.evidence = FakeEvidence()
        self.evacuating: set[str] = set()
        self.reclaim: dict[str, Any] | None = None
        self.events = FakeEvents()
        self.agent = type("A", (), {"jobs": jobs, "config": None})()

    def _emit(self, message: str, **f: Any) -> None:
        self.events.emit("migrate", message, **f)


@pytest.fixture
def usr1_handler() -> Iterator[None]:
    old = signal.signal(signal.SIGUSR1, lambda *a: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_round_signals_due_jobs_staggered_and_measures_commits(tmp_path: Path, usr1_handler: None) -> None:
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a"), FakeJob("job-2", tmp_path / "b"),
                     FakeJob("job-3", tmp_path / "c", spec=FakeSpec(periodic_checkpoints=False))])
    comp = FakeComp(jobs, min_interval_s=1.0, max_interval_s=3.0, ckpt_pause_s=0.1, stagger_gap_s=0.5,
                    uplink_mbit=100.0)
    d = cd.CkptDriver(comp)
    t = 1_700_000_000.0
    assert d.round(t) == []
    rows = {r["job"]: r for r in d.view()}
    assert rows["job-3"]["skip"].startswith("opted out") and rows["job-3"]["interval_s"] is None
    iv = rows["job-1"]["interval_s"]
    assert 1.0 <= iv <= 3.0 and rows["job-1"]["mtbf_s"] == pytest.approx(36.0, rel=0.05)  # 100/h
    fired: list[tuple[float, str]] = []
    step = 0.1
    for i in range(1, int(30 / step)):
        now = t + i * step
        fired += [(now, j) for j in d.round(now)]
    got = [j for _, j in fired]
    assert "job-3" not in got and jobs.requests == got
    n1, n2 = got.count("job-1"), got.count("job-2")
    # 30 s at an interval of at most 3 s: each job about every interval (never more often)
    assert n1 >= 30 / 3.5 - 1 and n2 >= 30 / 3.5 - 1
    assert n1 <= 30 / 1.0 and n2 <= 30 / 1.0
    # never two signals at the same instant: the gap is kept between the jobs
    times = [ts for ts, _ in fired]
    assert len(set(times)) == len(times)
    assert min(b - a for a, b in zip(times, times[1:], strict=False)) >= 0.5 - 1e-6
    rows = {r["job"]: r for r in d.view()}
    assert rows["job-1"]["commits"] >= n1 - 1 and rows["job-1"]["size_bytes"] > 1000
    assert rows["job-1"]["latency_s"] is not None
    ev = [e for e in comp.events.events if e.get("phase") == "periodic"]
    assert len(ev) == len(fired) and all("interval_s" in e and "MTBF" in e["message"] for e in ev)


def test_round_leaves_jobs_alone_during_a_reclaim_and_when_switched_off(tmp_path: Path, usr1_handler: None) -> None:
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a")])
    comp = FakeComp(jobs, min_interval_s=1.0, max_interval_s=1.0, periodic=False)
    d = cd.CkptDriver(comp)
    t = 1_700_000_000.0
    for i in range(50):
        d.round(t + i * 0.2)
    assert jobs.requests == [] and "periodic checkpoints are off" in d.view()[0]["skip"]
    comp.s["periodic"] = True

    async def never() -> None:
        await asyncio.sleep(3600)

    loop = asyncio.new_event_loop()
    task = loop.create_task(never())
    try:
        comp.reclaim = {"task": task}
        for i in range(50, 100):
            d.round(t + i * 0.2)
        assert jobs.requests == [] and d.view()[0]["skip"] == "this node is being reclaimed"
    finally:
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.close()
    comp.reclaim = None
    for i in range(100, 130):
        d.round(t + i * 0.2)
    assert jobs.requests  # driven again once the reclaim is over


# -- hashing off the event loop ----------------------------------------------------------------


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every verify_checkpoint call: (checkpoint name, on the main thread?)."""
    import threading

    calls: list[tuple[str, bool]] = []
    real = jobkit.verify_checkpoint

    def spy(p: Any, **kw: Any) -> Any:
        calls.append((Path(p).name, threading.current_thread() is threading.main_thread()))
        return real(p, **kw)

    monkeypatch.setattr(jobkit, "verify_checkpoint", spy)
    return calls


def test_wait_new_checkpoint_hashes_in_a_thread_and_each_checkpoint_once(tmp_path: Path, hashed: list) -> None:
    ck = jobkit.Checkpointer("j", tmp_path, install_signal=False, keep=10)
    old = ck.save(b"a" * 1000, step=1)
    bad = ck.save(b"b" * 1000, step=2)
    (bad / "state.bin").write_bytes(b"corrupt")  # fails its manifest

    async def main() -> Path | None:
        async def later() -> None:
            await asyncio.sleep(0.4)
            ck.save(b"c" * 1000, step=3)

        t = asyncio.create_task(later())
        got = await cd.wait_new_checkpoint(tmp_path, old, 10.0, lambda: True, poll_s=0.02)
        await t
        return got

    got = asyncio.run(main())
    assert got is not None and got.name == "ckpt-3"
    assert hashed and not any(main for _, main in hashed)  # never on the event loop's thread
    assert [n for n, _ in hashed].count("ckpt-2") == 1  # the corrupt one once, not every poll
    assert "ckpt-1" not in [n for n, _ in hashed]  # not newer than `after`
    # none newer within the timeout: None
    assert asyncio.run(cd.wait_new_checkpoint(tmp_path, got, 0.2, lambda: True, poll_s=0.02)) is None


def test_driver_run_verifies_new_commits_in_a_thread(tmp_path: Path, usr1_handler: None, hashed: list) -> None:
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a")])
    comp = FakeComp(jobs, min_interval_s=0.2, max_interval_s=0.2, ckpt_pause_s=0.01, stagger_gap_s=0.01, poll_s=0.05)
    d = cd.CkptDriver(comp)

    async def main() -> None:
        task = asyncio.create_task(d.run())
        try:
            for _ in range(200):
                await asyncio.sleep(0.05)
                if d.counts["commits"] >= 2:
                    break
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert d.counts["commits"] >= 2 and d.counts["signals"] >= 2
    assert hashed and not any(main for _, main in hashed)
    # each commit hashed once, not once per round
    names = [n for n, _ in hashed]
    assert len(names) == len(set(names))


def test_a_wall_clock_step_is_not_counted_as_exposure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds on the real clocks: a year's step of the wall clock between two rounds a second
    apart adds about a second of exposure, not a year (which would drive the learned departure
    rate, and so the checkpoint interval, to the no-evidence maximum)."""
    comp = FakeComp(FakeJobs([]), min_interval_s=1.0, max_interval_s=3.0)
    d = cd.CkptDriver(comp)
    wall = [1_700_000_000.0]
    mono = [1000.0]
    monkeypatch.setattr(cd.time, "time", lambda: wall[0])
    monkeypatch.setattr(cd.time, "monotonic", lambda: mono[0])
    d.round()
    wall[0] += 1.0
    mono[0] += 1.0
    d.round()
    wall[0] += 365 * 86400.0  # the step
    mono[0] += 1.0
    d.round()
    wall[0] -= 3600.0  # and one back
    mono[0] += 1.0
    d.round()
    assert sum(t1 - t0 for t0, t1, _ in comp.evidence.exposure) == pytest.approx(2.0)
    assert len(comp.evidence.exposure) == 2  # the round after the backward step counts nothing


class CorruptFirstJobs(FakeJobs):
    """The job's first checkpoint commits but does not verify (its data file is damaged after
    the manifest was written: a bad disk, a writer of its own killed half-way); later ones are
    good."""

    def request_checkpoint(self, job: FakeJob) -> bool:
        super().request_checkpoint(job)
        if len(self.requests) == 1:
            (job.ckpt_dir / f"ckpt-{job.step}" / "state.bin").write_bytes(b"damaged")
        return True


def test_a_checkpoint_that_does_not_verify_is_a_miss_and_the_job_is_asked_again(tmp_path: Path,
                                                                                 usr1_handler: None) -> None:
    """A signalled job whose newest checkpoint directory does not verify has not checkpointed:
    after ckpt_wait_s it is a miss and the job is asked again at its next due time (it was left
    pending for ever: never signalled again, and holding the stagger slot)."""
    jobs = CorruptFirstJobs([FakeJob("job-1", tmp_path / "a")])
    comp = FakeComp(jobs, min_interval_s=1.0, max_interval_s=1.0, ckpt_pause_s=0.1, ckpt_wait_s=2.0)
    d = cd.CkptDriver(comp)
    t = 1_700_000_000.0
    for i in range(100):  # 10 s
        d.round(t + i * 0.1)
    assert len(jobs.requests) >= 3, jobs.requests
    row = d.view()[0]
    assert row["misses"] == 1 and row["commits"] >= 1 and row["newest"] != "ckpt-1"


def test_commits_below_a_damaged_higher_step_are_seen(tmp_path: Path, usr1_handler: None) -> None:
    """A damaged checkpoint of a higher step (left by an earlier run of the job) stays the
    highest name listed; the job's new commits at lower steps are still commits (the threaded
    driver cached the verification by the highest name only and never looked again)."""
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a")])
    ck = jobkit.Checkpointer("job-1", tmp_path / "a", install_signal=False, keep=10)
    (ck.save(b"y" * 1000, step=1000) / "state.bin").write_bytes(b"damaged")
    comp = FakeComp(jobs, min_interval_s=0.2, max_interval_s=0.2, ckpt_pause_s=0.01, stagger_gap_s=0.01,
                    poll_s=0.05, ckpt_wait_s=30.0)
    d = cd.CkptDriver(comp)

    async def main() -> None:
        task = asyncio.create_task(d.run())
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if d.counts["commits"] >= 3:
                    break
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert d.counts["commits"] >= 3 and d.counts["signals"] >= 3, (d.counts, jobs.requests)


def test_a_wall_clock_step_back_does_not_stall_periodic_checkpoints(tmp_path: Path, usr1_handler: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds on the real clocks: when the wall clock steps back a day (NTP correcting an RTC
    that ran ahead), the jobs are still asked at their interval; the driver's times were wall
    clock, so every job's next checkpoint moved a day into the future and none was asked
    until then (and a forward step made every job due at once)."""
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a"), FakeJob("job-2", tmp_path / "b")])
    comp = FakeComp(jobs, min_interval_s=1.0, max_interval_s=1.0, ckpt_pause_s=0.1, stagger_gap_s=0.1)
    d = cd.CkptDriver(comp)
    wall = [1_700_000_000.0]
    mono = [1000.0]
    monkeypatch.setattr(cd.time, "time", lambda: wall[0])
    monkeypatch.setattr(cd.time, "monotonic", lambda: mono[0])

    def run(seconds: float) -> list[str]:
        got: list[str] = []
        for _ in range(int(seconds / 0.1)):
            wall[0] += 0.1
            mono[0] += 0.1
            got += d.round()
        return got

    assert len(run(5.0)) >= 6
    wall[0] -= 86400.0
    after = run(5.0)
    assert after.count("job-1") >= 3 and after.count("job-2") >= 3, after
    wall[0] += 2 * 86400.0
    burst = run(0.3)
    assert len(burst) <= 1, burst  # not every job at once: each keeps its place in the interval
    assert len(run(5.0)) >= 6


def test_the_plan_uses_the_configured_notice_margin(tmp_path: Path, usr1_handler: None) -> None:
    """Whether a job's final checkpoint fits the notice window is judged with the operator's
    ``notice_margin``, as the reclaim does: a 64 MiB checkpoint over 16 Mbit/s (33.6 s) fits
    60 s at the default margin 0.8 but not at 0.3, so the job is prestaged and rolls back on
    every departure (the driver used 0.8 whatever the configuration, planned the job as fitting,
    with the interval of one that moves at notice time, several times too long)."""
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a")])
    base = dict(uplink_mbit=16.0, expected_notice_s=60.0, min_interval_s=1.0, max_interval_s=21600.0)
    comp = FakeComp(jobs, **base)
    comp.evidence.notice_odds = NoticeOdds(announced=99.0)  # departures come with notice: fitting jobs rarely roll back
    d = cd.CkptDriver(comp)
    d.round(1_700_000_000.0)
    fit = d.view()[0]
    assert fit["prestage"] is False
    comp2 = FakeComp(jobs, notice_margin=0.3, **base)
    comp2.evidence.notice_odds = NoticeOdds(announced=99.0)
    d2 = cd.CkptDriver(comp2)
    d2.round(1_700_000_000.0)
    tight = d2.view()[0]
    assert tight["prestage"] is True, tight
    assert tight["interval_s"] < fit["interval_s"]


def test_with_prestage_off_no_transfer_is_planned(tmp_path: Path, usr1_handler: None) -> None:
    """With ``prestage = "off"`` no checkpoint is shipped before a notice: a job whose final
    checkpoint does not fit the window costs its local write per checkpoint and rolls back on
    every departure. The driver planned it as prestaged (a transfer of 33.6 s in C and in the
    link's busy share, ``prestage: true`` in ``laminarctl checkpoints``): an interval longer
    than Daly's for a transfer that never happens."""
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a")])
    base = dict(uplink_mbit=16.0, expected_notice_s=10.0, min_interval_s=1.0, max_interval_s=21600.0,
                ckpt_pause_s=2.0)
    auto = cd.CkptDriver(FakeComp(jobs, **base))
    auto.round(1_700_000_000.0)
    off = cd.CkptDriver(FakeComp(jobs, prestage="off", **base))
    off.round(1_700_000_000.0)
    a, o = auto.view()[0], off.view()[0]
    assert a["prestage"] is True and a["cost_s"] > 30
    assert o["prestage"] is False, o
    assert o["cost_s"] < 3 and o["interval_s"] < a["interval_s"]
    assert "prestag" in o["reason"] and "off" in o["reason"]


def test_a_reclaimed_node_is_no_longer_exposure(tmp_path: Path) -> None:
    """Once this node's reclaim is announced it has departed (the departure is counted then)
    and its queue stays held: the time after it is not node-time that could end in a departure.
    It was still counted (one node-hour an hour for as long as the agent ran on the reclaimed
    node), pulling the learned departure rate down."""
    comp = FakeComp(FakeJobs([]), min_interval_s=1.0, max_interval_s=3.0)
    d = cd.CkptDriver(comp)
    t = 1_700_000_000.0
    for i in range(10):
        d.round(t + i * 0.1)

    async def nothing() -> None:
        return None

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(nothing())
        loop.run_until_complete(task)
    finally:
        loop.close()
    comp.reclaim = {"task": task}
    for i in range(10, 40):
        d.round(t + i * 0.1)
    exposed = sum((t1 - t0) * n for t0, t1, n in comp.evidence.exposure)
    assert exposed == pytest.approx(0.9)
    assert comp.evidence.hazards["default"].total_exposure_h == pytest.approx(0.9 / 3600)


def test_a_checkpoint_saved_again_at_the_same_step_is_new(tmp_path: Path, usr1_handler: None) -> None:
    """jobkit replaces a checkpoint saved twice at one step (a job that numbers checkpoints by
    epoch, asked mid-epoch): the replacement is the checkpoint asked for. The wait of a move or a
    loan return took only a higher step as new (it waited all of ckpt_wait_s, out of the notice
    window, and moved 'the last one'), and the driver counted a miss."""
    ck = jobkit.Checkpointer("j", tmp_path / "w", install_signal=False)
    old = ck.save(b"epoch 5, start", step=5)

    async def main() -> Path | None:
        async def later() -> None:
            await asyncio.sleep(0.3)
            ck.save(b"epoch 5, asked mid-epoch", step=5)

        t = asyncio.create_task(later())
        got = await cd.wait_new_checkpoint(tmp_path / "w", old, 30.0, lambda: True, poll_s=0.02)
        await t
        return got

    got = asyncio.run(main())
    assert got is not None and (got / "state.bin").read_bytes() == b"epoch 5, asked mid-epoch"

    class SameStepJobs(FakeJobs):
        def request_checkpoint(self, job: FakeJob) -> bool:
            self.requests.append(job.id)
            jobkit.Checkpointer(job.id, job.ckpt_dir, install_signal=False).save(os.urandom(100), step=1)
            return True

    jobs = SameStepJobs([FakeJob("job-1", tmp_path / "a")])
    comp = FakeComp(jobs, min_interval_s=1.0, max_interval_s=1.0, ckpt_pause_s=0.1, ckpt_wait_s=2.0)
    d = cd.CkptDriver(comp)
    t0 = 1_700_000_000.0
    for i in range(60):
        d.round(t0 + i * 0.1)
    row = d.view()[0]
    assert len(jobs.requests) >= 3 and row["misses"] == 0 and row["commits"] >= len(jobs.requests) - 1, (row, jobs.requests)


def test_the_notice_fit_is_judged_at_the_path_rate_the_reclaim_moves_at(tmp_path: Path, usr1_handler: None) -> None:
    """A final checkpoint leaves over the path to a peer (``path_mbit``), however fast the
    node's uplink: 64 MiB fits 60 s at a 25 Gbit/s uplink, not over a 10 Mbit/s path (53.7 s).
    The driver judged the fit at the uplink only, planned the job as one that moves at notice
    time (MTBF divided by the unannounced share) while the reclaim prestages it and rolls it
    back to its last periodic checkpoint."""
    jobs = FakeJobs([FakeJob("job-1", tmp_path / "a")])
    comp = FakeComp(jobs, uplink_mbit=25000.0, path_mbit=10.0, expected_notice_s=60.0, min_interval_s=1.0,
                    max_interval_s=21600.0)
    comp.evidence.notice_odds = NoticeOdds(announced=99.0)
    d = cd.CkptDriver(comp)
    d.round(1_700_000_000.0)
    row = d.view()[0]
    assert row["prestage"] is True, row
    assert row["share_mbit"] <= 10.0 + 1e-9


def test_contradicting_interval_bounds_are_named() -> None:
    s = {k: f.default for k, f in CONFIG_FIELDS.items()}
    cd.check_settings(s)
    with pytest.raises(ValueError, match="min_interval_s = 600 is above migrate.max_interval_s = 300"):
        cd.check_settings(s | {"min_interval_s": 600.0, "max_interval_s": 300.0})
