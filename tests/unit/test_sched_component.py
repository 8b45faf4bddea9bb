"""The scheduler component (:class:`laminar.sched.component.SchedulerComponent`) with stand-in
backends (``StandInBackend``: records what it is asked, refuses when told to) and a stand-in job
manager (``StandInJobs``: the jobs it is given; its checkpoint signal is a real SIGUSR1 to a real
job process). Real: the job, a child python process using ``laminar.jobkit.Checkpointer`` that
saves a checkpoint when signalled; its checkpoints on disk, listed by the real scanner and
checked by the real verify; the store and event bus.

Checked: an evacuation asks the job for its checkpoint, waits for one newer than the signal,
publishes it and only then gives the job back (after the node's drain) with that path; a job
that does not catch its signal is given back at once with the newest verified checkpoint it
had; a scheduler that refuses the give-back is an event and an answer, not an exception; the
round publishes each adopted job's changed checkpoint once, and a failing publish is one event
per different error; a withdrawn reclaim undrains, and a job it was checkpointing is not given
back; a job not adopted, or adopted from a
scheduler not enabled here, is not the component's."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin_agent import standin_agent

from laminar.components import SchedAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.policy.sched import Scheduler
from laminar.runtime.ckpt_scan import CkptScanner
from laminar.runtime.provenance import JobOrigin
from laminar.sched.backend import BackendError
from laminar.sched.component import SchedulerComponent
from laminar.store import Store

# The job: steps of 0.05 s; a checkpoint at step 0, then one whenever it is signalled.
JOB = r'''
import sys, time
from laminar.jobkit import Checkpointer
ck = Checkpointer(job_id="t", ckpt_dir=sys.argv[1], keep=4)
ck.save({"step": 0}, step=0)
print("ready", flush=True)
for i in range(1, 100000):
    time.sleep(0.05)
    if ck.requested():
        ck.save({"step": i}, step=i)
'''


class StandInBackend:
    """A stand-in scheduler backend (the test's): records each call; ``refuse`` names the calls
    it refuses with a BackendError."""

    def __init__(self, scheduler: Scheduler = Scheduler.SLURM, refuse: tuple[str, ...] = ()) -> None:
        self.scheduler = scheduler
        self.refuse = set(refuse)
        self.calls: list[tuple[Any, ...]] = []
        self.ticks = 0

    def _maybe_refuse(self, what: str) -> None:
        if what in self.refuse:
            raise BackendError(f"standin: {what} refused (scontrol: Access/permission denied)")

    async def drain(self, reason: str) -> None:
        self.calls.append(("drain", reason))
        self._maybe_refuse("drain")

    async def undrain(self, reason: str) -> None:
        self.calls.append(("undrain", reason))
        self._maybe_refuse("undrain")

    async def give_back(self, job: Any, ckpt: str | None, deadline_mono: float | None = None) -> str:
        self.calls.append(("give_back", job.id, ckpt))
        self._maybe_refuse("give_back")
        return f"standin requeued {job.origin.scheduler_ref}"

    async def publish(self, job: Any, ckpt_time: float) -> None:
        self.calls.append(("publish", job.id, int(ckpt_time)))
        self._maybe_refuse("publish")

    async def tick(self) -> None:
        self.ticks += 1


class StandInJobs:
    """A stand-in job manager (the test's): the jobs given, the real checkpoint scanner, and the
    checkpoint signal sent for real (False for a job marked as not catching it)."""

    def __init__(self, jobs: list[Any]) -> None:
        self.jobs = {j.id: j for j in jobs}
        self.ckpt_scan = CkptScanner()
        self.signalled: list[str] = []

    def active(self) -> list[Any]:
        return [j for j in self.jobs.values() if j.active]

    def request_checkpoint(self, job: Any) -> bool:
        if not job.catches:
            return False
        os.kill(job.pid, signal.SIGUSR1)
        self.signalled.append(job.id)
        return True


def _job(jid: str, ckpt_dir: Path, pid: int = 0, scheduler: Scheduler | None = Scheduler.SLURM,
         ref: str = "1234", catches: bool = True) -> SimpleNamespace:
    j = SimpleNamespace(id=jid, pid=pid, ckpt_dir=ckpt_dir, owner_uid=os.getuid(), active=True, catches=catches,
                        origin=JobOrigin(scheduler=scheduler, scheduler_ref=ref if scheduler else None), seen=None,
                        ckpt_verified=None)
    # ``seen``: its newest verified checkpoint's commit time (the checkpoint driver's, in the agent)
    j.verified_checkpoint = lambda: None if j.seen is None else (str(ckpt_dir / "ckpt-1"), j.seen)
    return j


@pytest.fixture()
def rig(tmp_path: Path):
    procs: list[subprocess.Popen[str]] = []

    def start_job(ckpt_dir: Path) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "agent")}
        p = subprocess.Popen([sys.executable, "-c", JOB, str(ckpt_dir)], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        return p

    store = Store(tmp_path / "laminar.db")
    events = EventBus(store)
    seen: list[dict[str, Any]] = []
    events.subscribe(seen.append)

    def make(jobs: list[Any], backends: list[Any]) -> tuple[SchedulerComponent, Any]:
        agent = standin_agent(SchedAgent, config=Config(validate({"schedulers": {"tick_s": 0.05}})), store=store,
                              events=events, jobs=StandInJobs(jobs))
        return SchedulerComponent(backends), agent

    yield SimpleNamespace(start_job=start_job, make=make, events=seen, tmp=tmp_path)
    for p in procs:
        p.kill()
        p.wait()
    store.close()


def _sched_events(events: list[dict[str, Any]]) -> list[str]:
    return [e.get("outcome", "") for e in events if e["kind"] == "sched"]


def test_evacuate_checkpoints_publishes_then_gives_back(rig: SimpleNamespace) -> None:
    d = rig.tmp / "slurm-1234"
    p = rig.start_job(d)
    job = _job("job-1", d, p.pid)
    b = StandInBackend()
    comp, agent = rig.make([job], [b])

    async def go() -> dict[str, Any]:
        await comp.start(agent)
        comp.start_drain("owner needs it")
        t0 = time.monotonic()
        out = await comp.evacuate(job, time.monotonic() + 30.0)
        assert time.monotonic() - t0 < 10  # the checkpoint came at the job's next step, not at the window's end
        await comp.stop()
        return out

    out = asyncio.run(go())
    assert agent.jobs.signalled == ["job-1"]
    assert out["outcome"] == "given-back" and out["new_checkpoint"] is True
    ckpt = out["checkpoint"]
    assert ckpt is not None and Path(ckpt).parent == d and Path(ckpt).name != "ckpt-0"  # newer than the signal
    names = [c[0] for c in b.calls]
    assert names == ["drain", "publish", "give_back"], b.calls  # drained first; published before it is given back
    assert b.calls[2] == ("give_back", "job-1", ckpt)
    assert abs(b.calls[1][2] - time.time()) < 30
    assert comp.counts["given_back"] == 1 and comp.counts["ckpt_new"] == 1
    assert _sched_events(rig.events) == ["", "drained", "checkpoint-asked", "given-back"]


def test_a_job_without_the_signal_is_given_back_with_what_it_has(rig: SimpleNamespace) -> None:
    d = rig.tmp / "slurm-77"
    p = rig.start_job(d)  # it has ckpt-0
    job = _job("job-2", d, p.pid, ref="77", catches=False)
    b = StandInBackend()
    comp, agent = rig.make([job], [b])

    async def go() -> dict[str, Any]:
        await comp.start(agent)
        t0 = time.monotonic()
        out = await comp.evacuate(job, time.monotonic() + 60.0)
        assert time.monotonic() - t0 < 5  # not waited for
        await comp.stop()
        return out

    out = asyncio.run(go())
    assert out["outcome"] == "given-back" and out["new_checkpoint"] is False
    assert out["checkpoint"] == str(d / "ckpt-0")
    assert b.calls == [("give_back", "job-2", str(d / "ckpt-0"))]
    assert "no-signal" in _sched_events(rig.events)


def test_a_reclaim_withdrawn_while_the_job_checkpoints_does_not_give_it_back(rig: SimpleNamespace) -> None:
    """The owner withdraws the reclaim while the job is asked for its checkpoint (one that never
    comes here: the job takes its signal and writes nothing): the job is not requeued, it runs
    on here, and the wait ends with the withdrawal, not with the window."""
    d = rig.tmp / "slurm-9"
    d.mkdir()
    quiet = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert quiet.stdout is not None and quiet.stdout.readline().strip() == "ready"
        job = _job("job-9", d, quiet.pid, ref="9")
        b = StandInBackend()
        comp, agent = rig.make([job], [b])

        async def go() -> tuple[dict[str, Any], float]:
            await comp.start(agent)
            cancel = asyncio.Event()
            t0 = time.monotonic()
            task = asyncio.ensure_future(comp.evacuate(job, time.monotonic() + 120.0, cancel))
            await asyncio.sleep(0.5)
            assert not task.done()  # waiting for the checkpoint
            cancel.set()
            out = await asyncio.wait_for(task, 30)
            await comp.stop()
            return out, time.monotonic() - t0

        out, took = asyncio.run(go())
        assert out["outcome"] == "withdrawn" and took < 30, (out, took)
        assert agent.jobs.signalled == ["job-9"]
        assert [c for c in b.calls if c[0] == "give_back"] == []
        assert comp.counts["withdrawn"] == 1 and comp.counts["given_back"] == 0
        assert _sched_events(rig.events)[-1] == "withdrawn"
        assert quiet.poll() is None  # it runs on
    finally:
        quiet.kill()
        quiet.wait()


def test_a_refused_give_back_is_an_event_not_an_exception(rig: SimpleNamespace) -> None:
    d = rig.tmp / "slurm-5"
    d.mkdir()
    job = _job("job-3", d, ref="5", catches=False)
    b = StandInBackend(refuse=("give_back", "drain"))
    comp, agent = rig.make([job], [b])

    async def go() -> dict[str, Any]:
        await comp.start(agent)
        await comp.drain("r")
        out = await comp.evacuate(job, time.monotonic() + 30.0)
        await comp.stop()
        return out

    out = asyncio.run(go())
    assert out["outcome"] == "give-back-failed" and "permission denied" in out["error"]
    assert out["checkpoint"] is None  # none there
    assert comp.drained == {} and comp.counts["give_back_failed"] == 1
    assert "drain-failed" in _sched_events(rig.events) and "give-back-failed" in _sched_events(rig.events)


def test_the_round_publishes_changes_once(rig: SimpleNamespace) -> None:
    d = rig.tmp / "x"
    adopted = _job("job-4", d, ref="44")
    other = _job("job-5", d, scheduler=None)  # launched by Laminar: nothing to publish
    kube = _job("job-6", d, scheduler=Scheduler.KUBERNETES, ref="ns/pod")  # its scheduler is not enabled here
    b = StandInBackend(refuse=("publish",))
    comp, agent = rig.make([adopted, other, kube], [b])
    assert comp.backend_for(other) is None

    async def go() -> None:
        await comp.start(agent)
        assert comp.handles(adopted) and not comp.handles(other) and not comp.handles(kube)
        await comp.tick()  # no checkpoint yet: nothing
        adopted.seen = 1000.0
        for _ in range(3):
            await comp.tick()  # refused three times: one event
        b.refuse.clear()
        await comp.tick()
        await comp.tick()  # told: not again
        adopted.seen = 1000.4  # the same whole second
        await comp.tick()
        adopted.seen = 1001.0
        await comp.tick()
        adopted.active = False
        await comp.tick()
        await comp.stop()

    asyncio.run(go())
    assert b.calls == [("publish", "job-4", 1000)] * 4 + [("publish", "job-4", 1001)]
    assert _sched_events(rig.events).count("publish-failed") == 1
    assert comp.published == {}  # ended: forgotten
    assert b.ticks >= 8


def test_undrain_after_a_withdrawal(rig: SimpleNamespace) -> None:
    b = StandInBackend()
    comp, agent = rig.make([], [b])

    async def go() -> None:
        await comp.start(agent)
        comp.start_drain("owner")
        comp.start_drain("owner")  # one drain
        await comp.undrain("reclaim cancelled")  # waits for the drain first
        await comp.stop()

    asyncio.run(go())
    assert b.calls == [("drain", "owner"), ("undrain", "reclaim cancelled")]
    assert comp.drained == {} and comp.counts == {**comp.counts, "drained": 1, "undrained": 1}


def test_no_scheduler_enabled_no_backend(rig: SimpleNamespace) -> None:
    comp, agent = rig.make([], None)  # type: ignore[arg-type]

    async def go() -> None:
        await comp.start(agent)  # [slurm] enabled is false by default
        comp.start_drain("r")
        await comp.undrain("r")
        await comp.stop()

    asyncio.run(go())
    assert comp.backends == [] and comp.status()["schedulers"] == []


def test_slurm_enabled_builds_its_backend(tmp_path: Path) -> None:
    from laminar.sched.slurm import SlurmBackend

    store = Store(tmp_path / "laminar.db")
    cfg = Config(validate({"slurm": {"enabled": True, "node_name": "lmt1", "scontrol": "/nonexistent/scontrol"}}))
    agent = standin_agent(SchedAgent, config=cfg, store=store, events=EventBus(store), jobs=StandInJobs([]))
    comp = SchedulerComponent()

    async def go() -> None:
        await comp.start(agent)
        await comp.stop()

    asyncio.run(go())
    store.close()
    (b,) = comp.backends
    assert isinstance(b, SlurmBackend) and b.node == "lmt1" and b.scheduler == Scheduler.SLURM
    assert comp.status()["schedulers"] == ["slurm"]
