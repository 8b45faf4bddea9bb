"""A loan return cut by the agent's stop is carried out again at the next start: a returned
server does not keep running its lent jobs after a restart.

Real pieces: the returned server (node 1, pool ``inference``) is a real ZoneComponent on
loopback with the real JobManager over real cgroups (tests/jobrig.py) and the real store; its
lent job is placed through that zone (a ``training`` demand: a loan, so it runs with
``lent``), a real process that catches the checkpoint signal and never writes a checkpoint, so
the return's requeue waits for one (``ckpt_wait_s``) and the agent's stop cuts it there; the
restart is a second ZoneComponent on the same store and job table. Node 2 of the roster
(``training``) is never started: the requeued job finds no room and the test asserts only what
the returned server does.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jobrig import job_manager, until
from ports import free_port
from standin_agent import StandInMigrate, standin_agent

from laminar.components import ZoneAgent
from laminar.events import EventBus
from laminar.policy import placement as pl
from laminar.zone.component import ZoneComponent

pytestmark = pytest.mark.kernel

# The job: catches the checkpoint signal (SIGUSR1), says so, and never writes a checkpoint.
JOB = "import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: None); open(sys.argv[1], 'w').close(); time.sleep(600)"




def settings(tmp: Path) -> dict[str, Any]:
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    udp = [free_port(socket.SOCK_DGRAM) for _ in range(2)]
    nodes = [{"id": i + 1, "zone": 1, "addr": f"127.0.0.1:{udp[i]}", "handover_port": free_port(socket.SOCK_STREAM),
              "pool": pool} for i, pool in enumerate(("inference", "training"))]
    return {"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1", "port": udp[0],
            "handover_port": nodes[0]["handover_port"], "cpus": 8, "memory_mb": 8000, "probe_timeout_s": 0.3,
            "handover_timeout_s": 2.0}


def test_a_return_cut_by_the_agents_stop_requeues_the_lent_job_at_the_next_start(tmp_path: Path) -> None:
    """Before: the restarted server kept ``returned`` only (the return's requeue list lived in
    memory): its lent job ran on there, on a server its pool had taken back."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            events: list[dict[str, Any]] = []
            bus = EventBus(jobs.store)
            bus.subscribe(events.append)
            agent = standin_agent(ZoneAgent, store=jobs.store, events=bus, jobs=jobs)
            s = settings(tmp_path)
            zone = ZoneComponent(settings=s, gpus=0, loan={"elastic_interval_s": 0, "ckpt_wait_s": 60.0})
            await zone.start(agent)
            try:
                ready = tmp_path / "ready"
                res = await zone.place({"command": [os.environ.get("PYTHON", "python3"), "-c", JOB, str(ready)],
                                        "name": "lm-t-loanrs"}, pl.Demand(cpus=1.0, memory_mb=64, pool="training"))
                assert res.outcome == "placed" and res.node == 1, res.as_dict()
                job = jobs.get(str(res.job_id))
                assert job is not None and job.spec.lent, "the training job should run here on loan"
                assert await until(lambda: ready.exists(), 20), "the job never caught its checkpoint signal"
                done = zone.loan.do_return({"plan": "lm-t-p1", "actions": {job.id: "requeue"}}, 2)
                assert done["jobs"] == {job.id: "requeue"}
                assert await until(lambda: zone.loan.requeues[job.id]["phase"] == "checkpointing", 5)
                await asyncio.sleep(0.3)  # the return waits for the checkpoint (ckpt_wait_s)...
            finally:
                await zone.stop()  # ... and the agent's stop cuts it there
            assert job.active and job.state == "running"
            events.clear()
            zone = ZoneComponent(settings=s, gpus=0, loan={"elastic_interval_s": 0, "ckpt_wait_s": 0.5,
                                                           "requeue_for_s": 1.0})
            await zone.start(agent)  # the agent's restart
            try:
                assert zone.loan.returned
                assert await until(lambda: not job.active, 20), \
                    "the returned server keeps running its lent job after the restart"
                assert job.state == "requeued", job.state
                assert any(e.get("kind") == "zone" and e.get("restarted") and job.id in (e.get("jobs") or {})
                           for e in events), events
            finally:
                await zone.stop()

    asyncio.run(main())


def test_a_requeue_cut_while_it_looks_for_room_is_placed_again_at_the_next_start(tmp_path: Path) -> None:
    """The return's requeue stopped the lent job here (state ``requeued``) and was looking for
    room elsewhere (node 2, the only other node, is down) when the agent stopped. The restarted
    server places it again, with the spec and demand the requeue had: the same job, resumed
    from what it was stopped with. Before: only still-active lent jobs were returned again, so
    this one, stopped here and placed nowhere, was lost."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            events: list[dict[str, Any]] = []
            bus = EventBus(jobs.store)
            bus.subscribe(events.append)
            agent = standin_agent(ZoneAgent, store=jobs.store, events=bus, jobs=jobs)
            s = settings(tmp_path)
            zone = ZoneComponent(settings=s, gpus=0, loan={"elastic_interval_s": 0, "ckpt_wait_s": 0.5,
                                                           "requeue_for_s": 600.0})
            await zone.start(agent)
            try:
                ready = tmp_path / "ready"
                res = await zone.place({"command": [os.environ.get("PYTHON", "python3"), "-c", JOB, str(ready)],
                                        "name": "lm-t-loanrq"}, pl.Demand(cpus=1.0, memory_mb=64, pool="training"))
                assert res.outcome == "placed" and res.node == 1, res.as_dict()
                job = jobs.get(str(res.job_id))
                assert job is not None and job.spec.lent
                assert await until(lambda: ready.exists(), 20), "the job never caught its checkpoint signal"
                zone.loan.do_return({"plan": "lm-t-p2", "actions": {job.id: "requeue"}}, 2)
                assert await until(lambda: zone.loan.requeues[job.id].get("attempts", 0) >= 1, 20), \
                    zone.loan.requeues[job.id]
                assert job.state == "requeued" and not job.active
            finally:
                await zone.stop()  # cut while it looks for room
            events.clear()
            zone = ZoneComponent(settings=s, gpus=0, loan={"elastic_interval_s": 0, "ckpt_wait_s": 0.5,
                                                           "requeue_for_s": 600.0})
            await zone.start(agent)  # the agent's restart
            try:
                assert await until(lambda: zone.loan.requeues.get(job.id, {}).get("attempts", 0) >= 1, 20), \
                    f"the requeued job is placed nowhere and no longer looked for room for: {zone.loan.requeues}"
                rq = zone.loan.requeues[job.id]
                assert rq["phase"] == "placing" and rq["restarted"], rq
                assert any(e.get("kind") == "zone" and e.get("restarted") and job.id in (e.get("placing") or [])
                           for e in events), events
            finally:
                await zone.stop()

    asyncio.run(main())


# The job: writes one checkpoint through jobkit, catches the checkpoint signal, writes no other.
SAVES_ONCE = ("import signal, sys, time; from laminar import jobkit; c = jobkit.Checkpointer(install_signal=False); "
              "c.save(b'w' * 65536, step=7); signal.signal(signal.SIGUSR1, lambda *a: None); "
              "open(sys.argv[1], 'w').close(); time.sleep(600)")


def test_a_returns_requeue_takes_the_checkpoint_drivers_answer_and_reads_nothing_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A return's requeue found the job's newest verified checkpoint with
    ``jobkit.latest_checkpoint`` (a whole read and hash; seconds for many GB) before it even asked
    for the final one. With the migration layer's checkpoint driver holding a check of the job's
    listing, it takes that answer and reads nothing; the job is requeued from that checkpoint
    (it wrote no other). The driver is the real CkptDriver over a stand-in component (the agent's
    job list only); the zone, job manager, cgroups and job are real."""
    import sys

    from laminar import jobkit
    from laminar.migrate.ckpt_driver import CkptDriver

    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            agent = standin_agent(ZoneAgent, store=jobs.store, events=EventBus(jobs.store), jobs=jobs)
            agent.migrate = StandInMigrate(ckpt=CkptDriver(SimpleNamespace(agent=agent, s={})))
            zone = ZoneComponent(settings=settings(tmp_path), gpus=0,
                                 loan={"elastic_interval_s": 0, "ckpt_wait_s": 0.5, "requeue_for_s": 600.0})
            await zone.start(agent)
            try:
                ready = tmp_path / "ready"
                res = await zone.place({"command": [sys.executable, "-c", SAVES_ONCE, str(ready)],
                                        "name": "lm-t-loanck"}, pl.Demand(cpus=1.0, memory_mb=256, pool="training"))
                assert res.outcome == "placed" and res.node == 1, res.as_dict()
                job = jobs.get(str(res.job_id))
                assert job is not None and job.spec.lent
                assert await until(lambda: ready.exists(), 30), "the job never wrote its checkpoint"
                await agent.migrate.ckpt.verify_new()  # the driver's check of the listing
                newest = agent.migrate.ckpt.checked(job)[0]
                assert newest is not None and newest.name == "ckpt-7"
                reads: list[str] = []
                latest = jobkit.latest_checkpoint
                monkeypatch.setattr(jobkit, "latest_checkpoint", lambda d: reads.append(str(d)) or latest(d))
                zone.loan.do_return({"plan": "lm-t-p3", "actions": {job.id: "requeue"}}, 2)
                # the return is a departure of this node with notice, told to the migration layer's
                # evidence (what times lent jobs' checkpoints)
                assert [announced for _, announced in agent.migrate.departures] == [True]
                assert await until(lambda: zone.loan.requeues[job.id].get("attempts", 0) >= 1, 30), \
                    zone.loan.requeues[job.id]
                rq = zone.loan.requeues[job.id]
                assert reads == [], f"the requeue read the job's checkpoints whole: {reads}"
                assert rq["checkpoint"] == str(newest) and job.state == "requeued", rq
            finally:
                await zone.stop()

    asyncio.run(main())
