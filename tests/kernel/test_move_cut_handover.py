"""A move without a window (a loan return's ``move_now``, Airlock's ``readdress``) cut during its
hand-over leaves its job in a defined state: running here if the destination did not take it,
stopped here (``migrated``) if it did; never frozen for good, never two copies, never none. So
does a reclaim's move whose cancel a restart cut; and a keeper's placement of a job it takes
over confirms a hand-over whose answer timed out, also across the agent's restart.

Real pieces: the job (``sleep``, its checkpoint written by jobkit) in real cgroups under the real
JobManager (tests/jobrig.py), frozen by the move through the real freezer; the real
ReclaimComponent over the real store (restarted: a second instance on the same store); two real
ZoneComponents on loopback (node 1 the source, node 2 the destination) whose probe, commit and
hand-over go over their real UDP and TCP transports. The destination's agent being slow or
stopped is real too: its job table (a stand-in, named ``GatedJobs``: the real JobManager needs a
second cgroup tree and adds nothing to the hand-over's answer) holds the job's start on a gate,
so the source's hand-over times out after the frame arrived; its ZoneComponent is stopped and a
fresh one started on the same ports for its restart. Stand-ins on the source side, named:
the destination's ranking (``rank_for``: node 2), the checkpoint transfer (``_send``: the
destination reads the source's copy, both on this machine) and the keeper messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jobrig import job_manager, until
from ports import free_port
from standin_agent import standin_agent
from standin_origin import OriginQueries

from laminar.components import MigrateAgent, ZoneAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.spec import JobSpec
from laminar.zone.component import ZoneComponent

pytestmark = pytest.mark.kernel




class GatedJobs(OriginQueries):
    """Stand-in job table of the destination: a job 'starts' once ``gate`` is open."""

    def __init__(self) -> None:
        self.jobs: dict[str, Any] = {}
        self.gate = asyncio.Event()
        self.asked = 0

    async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0, *, origin: Any = None,
                     **_: Any) -> Any:
        self.asked += 1
        await self.gate.wait()
        jid = f"d{len(self.jobs) + 1}"
        self.jobs[jid] = SimpleNamespace(id=jid, spec=spec, state="running", active=True, gpus=[], origin=origin)
        return self.jobs[jid]

    def active(self) -> list[Any]:
        return [j for j in self.jobs.values() if j.active]

    def list(self, all_jobs: bool = True) -> list[Any]:
        return list(self.jobs.values())

    def get(self, job_id: str) -> Any:
        return self.jobs.get(job_id)


def zone_settings(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = tmp / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    udp = [free_port(socket.SOCK_DGRAM) for _ in range(2)]
    tcp = [free_port(socket.SOCK_STREAM) for _ in range(2)]
    nodes = [{"id": i + 1, "zone": 1, "addr": f"127.0.0.1:{udp[i]}", "handover_port": tcp[i]} for i in range(2)]
    # root's jobs move between the two nodes, and node 3's (gone) are placed: trusted with them (zone.root_from)
    common = {"nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1", "cpus": 8, "memory_mb": 8000,
              "handover_timeout_s": 0.5, "probe_timeout_s": 0.5, "root_from": [1, 2, 3]}
    return ({**common, "node_id": 1, "port": udp[0], "handover_port": tcp[0]},
            {**common, "node_id": 2, "port": udp[1], "handover_port": tcp[1]})


class Mover(ReclaimComponent):
    """The real component; stand-ins for the ranking, the transfer and the keeper (module docs) in
    its part ``mover``; its part ``prestage`` sends its keeper releases to :meth:`_release`."""

    def __init__(self) -> None:
        super().__init__()
        self.prestage.release = self._release  # type: ignore[method-assign]
        self.mover.rank_for = self.rank_for  # type: ignore[method-assign]
        self.mover.send = self._send  # type: ignore[method-assign]
        self.mover.send_keeper = self._make_keeper  # type: ignore[method-assign]

    def rank_for(self, job: Any, ckpt_bytes: float, window_s: float | None, prestaged: bool) -> list[Any]:
        return [SimpleNamespace(candidate=SimpleNamespace(node="2"), feasible=True, expected_loss_s=0.0, reasons=())]

    async def _send(self, job: Any, ckpt: Path, node: int, deadline_mono: float | None, mv: Any,
                    *_: Any, **__: Any) -> str:
        return str(ckpt)

    async def _make_keeper(self, job: Any, node: int, ckpt_name: str, take_over: bool = False) -> None:
        return None

    async def _release(self, node: int, key: str) -> None:
        return None


class Rig:
    """Node 1 (the source: the real job, the real ReclaimComponent) and node 2 (the destination)."""

    def __init__(self, tmp: Path, jobs: Any) -> None:
        self.tmp, self.jobs = tmp, jobs
        self.src_zone_s, self.dst_zone_s = zone_settings(tmp)
        self.dst_jobs = GatedJobs()
        self.events: list[dict[str, Any]] = []
        self.bus = EventBus(jobs.store)
        self.bus.subscribe(self.events.append)
        self.mport = free_port(socket.SOCK_STREAM)
        self.src_zone: ZoneComponent | None = None
        self.dst_zone: ZoneComponent | None = None
        self.mig: ReclaimComponent | None = None

    async def start_zones(self) -> None:
        self.src_zone = ZoneComponent(settings=self.src_zone_s, gpus=0)
        await self.src_zone.start(None)
        await self.start_destination()

    async def start_destination(self) -> None:
        self.dst_zone = ZoneComponent(settings=self.dst_zone_s, jobs=self.dst_jobs, gpus=0)
        await self.dst_zone.start(None)

    async def start_migrate(self, mig: ReclaimComponent | None = None, node: str = "lm-t-mvcut",
                            **migrate: Any) -> Any:
        """Node 1's component (``mig``: a :class:`Mover` when None; a :class:`Placer` for a keeper's
        placement) started on the rig's store, as the agent's (its start or restart)."""
        cfg = Config(validate({"agent": {"state_dir": str(self.tmp / "agent"), "node": node},
                               "migrate": {"poll_s": 60.0, "periodic": False, "port": self.mport, **migrate}}))
        agent = standin_agent(MigrateAgent, config=cfg, store=self.jobs.store, events=self.bus, jobs=self.jobs,
                                zone=self.src_zone)
        self.mig = mig = Mover() if mig is None else mig
        await mig.start(agent)
        return mig

    async def stop_migrate(self) -> None:
        """Node 1's agent stops (its component; the job and the zones stay)."""
        assert self.mig is not None
        await self.mig.stop()
        self.mig = None

    async def cut_during_handover(self, move: Coroutine[Any, Any, Any]) -> None:
        """Node 1's agent stops during ``move``'s hand-over (the move's task cancelled once node 2
        was asked to start the job, as the component's tasks at a stop)."""
        task = asyncio.ensure_future(move)
        assert await until(lambda: self.dst_jobs.asked > 0, 15), "the hand-over never reached node 2"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.stop_migrate()

    async def stop_destination(self) -> None:
        """Node 2's agent stops (its zone; its job table stays, as a restart's store)."""
        assert self.dst_zone is not None
        await self.dst_zone.stop()
        self.dst_zone = None

    async def restart_destination(self) -> None:
        await self.stop_destination()
        await self.start_destination()

    def kept_replica(self, key: str, name: str) -> tuple[str, dict[str, Any], Path, Any]:
        """The keeper held here of node 3's job (node 3 is gone): its replica's checkpoint, its
        request and its ``migrate_replicas`` row ('keeping'). Returns (key, req, ckpt, row)."""
        ckpt = Checkpointer(job_id="lm-t-kept", ckpt_dir=self.tmp / "replica",
                            install_signal=False).save(b"weights", step=5)
        req = {"spec": JobSpec(["sleep", "600"], name=name).validate().as_dict(), "owner_uid": 0, "owner_gid": 0}
        with self.jobs.store.tx() as db:
            db.execute("INSERT INTO migrate_replicas VALUES (?, 3, 'j9', ?, ?, 'keeping', NULL, ?)",
                       (key, json.dumps(req), ckpt.name, time.time()))
        row = self.jobs.store.db.execute("SELECT * FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        return key, req, ckpt, row

    async def stop(self) -> None:
        for c in (self.mig, self.src_zone, self.dst_zone):
            if c is not None:
                await c.stop()

    def record(self, jid: str) -> Any:
        return self.jobs.store.db.execute("SELECT phase, node FROM migrate_moves WHERE job_id=?", (jid,)).fetchone()


@contextlib.asynccontextmanager
async def running_rig(tmp: Path) -> AsyncIterator[tuple[Rig, Any]]:
    """The real job manager (jobrig) and the :class:`Rig` over it with both zones started;
    everything the rig started is stopped at the end, the test failing or not."""
    async with job_manager(tmp) as jobs:
        rig = Rig(tmp, jobs)
        try:
            await rig.start_zones()
            yield rig, jobs
        finally:
            await rig.stop()


def transfer_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in for the checkpoint transfer of a keeper's placement (``Takeover.place_on``, in
    laminar.migrate.takeover): node 2 reads the replica's directory here (both on this machine)."""
    import laminar.migrate.takeover as takeover_mod

    async def sent(addr: str, port: int, path: Path, key: str, *_: Any, **__: Any) -> Any:
        return SimpleNamespace(remote_path=str(path))

    monkeypatch.setattr(takeover_mod, "send_checkpoint", sent)


async def sleeper(jobs: Any, name: str) -> Any:
    job = await jobs.submit(JobSpec(["sleep", "600"], name=name).validate())
    await until(lambda: job.pid in job.cgroup.pids(), 10)
    Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False).save(b"weights", step=5)
    return job


def test_a_hand_over_that_times_out_is_asked_again_not_thawed_into_two_copies(tmp_path: Path) -> None:
    """The destination got the hand-over and is slow to start the job (the answer times out).
    Before: the move failed, the job was thawed here and the destination started it as well."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate()
            job = await sleeper(jobs, "lm-t-mvcut-slow")
            move = asyncio.ensure_future(mig.mover.readdress(job))  # Airlock's re-address rung
            assert await until(lambda: rig.dst_jobs.asked > 0, 15), "the hand-over never reached node 2"
            # its answer times out (0.5 s): the move is asked again (or, before, gave up)
            await until(lambda: move.done() or any(e.get("phase") == "unconfirmed" for e in rig.events), 10)
            rig.dst_jobs.gate.set()  # node 2 starts the job now
            res = await asyncio.wait_for(move, 30)
            assert len(rig.dst_jobs.active()) == 1
            await until(lambda: job.state == "migrated", 10)
            assert not job.active, f"two copies: node 2 runs the job and so does this node ({res})"
            assert res["phase"] == "done" and res["dest"] == 2 and job.state == "migrated", res
            assert rig.record(job.id) is None

    asyncio.run(main())


def test_a_loan_return_move_cut_by_both_agents_stopping_runs_the_job_here_after_the_restart(tmp_path: Path) -> None:
    """The source agent stops during the hand-over (the move task cancelled, as the loan
    component's tasks at a stop) and so does the destination's before it started the job. The
    restarted source asks node 2, which has no job for the placement: the job thaws and runs here.
    Before: the job stayed frozen for good and nothing on disk said it was moving."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate()
            job = await sleeper(jobs, "lm-t-mvcut-none")
            await rig.cut_during_handover(mig.mover.move_now(job, "lm-t loan return"))
            assert job.cgroup.frozen() and job.state == "running"
            await rig.restart_destination()  # node 2's agent stops before the job started: none runs there
            rig.events.clear()
            await rig.start_migrate()  # the source's restart
            assert await until(lambda: not job.cgroup.frozen(), 20), "the restarted agent left the job frozen"
            assert job.state == "running" and rig.dst_jobs.active() == []
            assert any(e.get("phase") == "move-cut" and e.get("job") == job.id for e in rig.events), rig.events
            assert await until(lambda: rig.record(job.id) is None, 5)

    asyncio.run(main())


def test_an_airlock_move_cut_by_the_agent_stopping_is_stopped_here_once_the_destination_runs_it(
        tmp_path: Path) -> None:
    """The source agent stops during the hand-over; node 2 starts the job meanwhile. The
    restarted source asks node 2 (the same hand-over, idempotent by placement id), learns it
    runs the job and stops the copy here (``migrated``): one copy."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate()
            job = await sleeper(jobs, "lm-t-mvcut-there")
            await rig.cut_during_handover(mig.mover.readdress(job))
            rig.dst_jobs.gate.set()  # node 2 starts it while the source is down
            assert await until(lambda: len(rig.dst_jobs.active()) == 1, 10)
            t0 = time.monotonic()
            await rig.start_migrate()
            assert await until(lambda: job.state == "migrated", 20), (job.state, time.monotonic() - t0)
            assert len(rig.dst_jobs.active()) == 1 and rig.dst_jobs.asked == 1
            assert await until(lambda: rig.record(job.id) is None, 5)

    asyncio.run(main())


class Placer(Mover):
    """The real component placing a kept job's replica (a take-over); stand-ins for the
    keeper message to node 2 (``_control``) and, in the test, the checkpoint transfer
    (``send_checkpoint``: node 2 reads the replica's directory here)."""

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
        return {}


def test_a_keepers_placement_whose_hand_over_times_out_is_asked_again_not_placed_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keeper takes over a dead source's job and places it on node 2, which got the hand-over
    and is slow to start the job (the answer times out). Before: the placement was taken for
    refused (the reservation and node 2's keeper released, the replica 'waiting' for another
    try here or elsewhere) while node 2 started the job: a later try ran it twice."""
    transfer_in_place(monkeypatch)

    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate(Placer())
            key, req, ckpt, row = rig.kept_replica("n3-lm-t-mvcut-key", "lm-t-mvcut-kept")
            place = asyncio.ensure_future(mig.takeover.place_elsewhere(row, req, ckpt, "node 3 is dead"))
            assert await until(lambda: rig.dst_jobs.asked > 0, 15), "the hand-over never reached node 2"
            # its answer times out (0.5 s): asked again (or, before, taken for a refusal)
            await until(lambda: place.done() or any(e.get("phase") == "unconfirmed" for e in rig.events), 10)
            rig.dst_jobs.gate.set()  # node 2 starts the job now
            placed, why = await asyncio.wait_for(place, 30)
            assert len(rig.dst_jobs.active()) == 1
            assert placed, f"node 2 runs the job, yet the take-over goes on looking for room: two copies ({why})"
            state = jobs.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
            assert state["state"] == "placed"

    asyncio.run(main())


async def reclaim_in_handover(rig: Rig, jobs: Any, name: str) -> tuple[Any, Any]:
    """Node 1's component started, ``name``'s job running; a reclaim of node 1 (30 s) moves it to
    node 2 and waits in its hand-over (node 2's start held on the gate). Returns (mig, job)."""
    mig = await rig.start_migrate()
    job = await sleeper(jobs, name)
    mig.s["notice_margin"] = 0.1  # the plan signals the job at 10 % of the window (3 s), not near its end
    mig.evacuation.start(30.0, "lm-t owner")
    assert await until(lambda: rig.dst_jobs.asked > 0, 20), [e["message"] for e in rig.events]
    return mig, job


async def cancel_cut_during_a_reclaim_move(rig: Rig, jobs: Any, name: str) -> Any:
    """A reclaim of node 1 moves ``name``'s job to node 2, whose start of it is held on the gate;
    while the hand-over waits, the owner cancels the reclaim and the agent stops right after the
    cancel's first step (its store meta written, the stored reclaim gone: as the cancel leaves
    the store there; the cancel itself is not run, its later steps would have ended first). The
    job is frozen, its ``handover`` recorded. Returns the job."""
    from laminar.migrate import drain

    mig, job = await reclaim_in_handover(rig, jobs, name)
    jobs.store.set_meta(drain.CANCEL_META, {"node": 1, "window_end": time.time() + 25.0})
    with jobs.store.tx() as db:
        db.execute("DELETE FROM migrate_reclaim")
    await rig.stop_migrate()
    phase = jobs.store.db.execute("SELECT phase FROM migrate_moves WHERE job_id=? AND cause='reclaim'", (job.id,)).fetchone()
    assert job.cgroup.frozen() and job.state == "running" and phase["phase"] == "handover"
    return job


def test_a_reclaim_cancel_cut_by_a_restart_runs_the_job_here_when_the_destination_never_started_it(
        tmp_path: Path) -> None:
    """The restarted agent settles the cancel: node 2 (restarted too, before it started the job)
    has no job for the placement, so the job thaws and runs here. Before: the job was stopped
    here as handed over (state ``reclaimed``) without asking node 2: it ran nowhere, and the
    keeper held there never resumed it (the reclaim was withdrawn, its source alive)."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            job = await cancel_cut_during_a_reclaim_move(rig, jobs, "lm-t-mvcut-rcnone")
            await rig.restart_destination()  # node 2's agent stops before the job started: none runs there
            rig.events.clear()
            await rig.start_migrate()
            assert await until(lambda: not job.active or not job.cgroup.frozen(), 20), "left frozen"
            assert job.active and job.state == "running", f"the job runs nowhere: {job.state} here, none on node 2"
            assert rig.dst_jobs.active() == []
            assert any(e.get("phase") == "move-cut" and e.get("job") == job.id for e in rig.events), rig.events
            assert await until(lambda: rig.record(job.id) is None, 5)
            assert jobs.store.db.execute("SELECT * FROM migrate_moves WHERE cause='reclaim'").fetchall() == []

    asyncio.run(main())


def test_a_reclaim_cancel_cut_by_a_restart_stops_the_job_here_once_the_destination_runs_it(tmp_path: Path) -> None:
    """As above, but node 2 starts the job while the source is down: the restarted source asks
    it (the same hand-over), learns it runs the job and stops the copy here (``migrated``)."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            job = await cancel_cut_during_a_reclaim_move(rig, jobs, "lm-t-mvcut-rcthere")
            rig.dst_jobs.gate.set()
            assert await until(lambda: len(rig.dst_jobs.active()) == 1, 10)
            await rig.start_migrate()
            assert await until(lambda: not job.active, 20), "two copies: node 2 runs the job and so does node 1"
            assert job.state == "migrated" and len(rig.dst_jobs.active()) == 1 and rig.dst_jobs.asked == 1
            assert await until(lambda: rig.record(job.id) is None, 5)

    asyncio.run(main())


def test_a_move_finishing_after_a_reclaim_cancel_and_cut_by_a_restart_is_settled_at_the_next_start(
        tmp_path: Path) -> None:
    """The owner cancels the reclaim (the real cancel, which ends) while its move waits on node
    2's answer (the move is left to finish); the agent then stops during that hand-over, and node
    2 restarts before it started the job. The restarted source asks node 2 and thaws the job
    here. Before: the cancel had dropped the move's record while the move still ran, so nothing
    at the restart knew of it: the job stayed frozen for good."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig, job = await reclaim_in_handover(rig, jobs, "lm-t-mvcut-rcfin")
            out = await mig.withdraw.cancel_reclaim("lm-t owner changed their mind")
            assert out["finishing"] == [job.id], out
            await rig.stop_migrate()
            assert job.cgroup.frozen() and job.state == "running"
            await rig.restart_destination()  # node 2's agent stops before the job started: none runs there
            await rig.start_migrate()
            assert await until(lambda: not job.active or not job.cgroup.frozen(), 20), "left frozen for good"
            assert job.active and job.state == "running" and rig.dst_jobs.active() == []
            assert jobs.store.db.execute("SELECT * FROM migrate_moves WHERE cause='reclaim'").fetchall() == []

    asyncio.run(main())


def test_a_keepers_placement_cut_by_the_agents_stop_is_settled_by_asking_the_destination_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keeper's placement on node 2 waits for node 2's answer (its job start held on the gate)
    when the agent stops; node 2 starts the job meanwhile. The restarted agent asks node 2 (the
    same hand-over), learns it runs the job and marks the replica placed. Before: nothing
    recorded the hand-over, the keeper stayed 'keeping' and took the job over again (here or
    elsewhere) while node 2 ran it: two copies."""
    transfer_in_place(monkeypatch)

    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate(Placer())
            key, req, ckpt, row = rig.kept_replica("n3-lm-t-mvcut-key2", "lm-t-mvcut-kept2")
            place = asyncio.ensure_future(mig.takeover.place_elsewhere(row, req, ckpt, "node 3 is dead"))
            assert await until(lambda: any(e.get("phase") == "unconfirmed" for e in rig.events), 15), rig.events
            place.cancel()  # the agent stops during the wait
            await asyncio.gather(place, return_exceptions=True)
            await rig.stop_migrate()
            rig.dst_jobs.gate.set()  # node 2 starts the job while the agent is down
            assert await until(lambda: len(rig.dst_jobs.active()) == 1, 10)
            mig = await rig.start_migrate(Placer())
            state = lambda: jobs.store.db.execute(  # noqa: E731
                "SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()["state"]
            assert await until(lambda: state() == "placed", 20), \
                f"node 2 runs the job, yet the keeper here is {state()!r}: it would take it over again"
            assert len(rig.dst_jobs.active()) == 1 and rig.dst_jobs.asked == 1
            assert jobs.store.db.execute("SELECT * FROM migrate_replica_handovers").fetchall() == []
            assert key not in mig.takeover.taking

    asyncio.run(main())


def test_a_move_finishing_after_a_reclaim_cancel_keeps_its_record_when_a_new_reclaim_starts(tmp_path: Path) -> None:
    """The owner cancels the reclaim while its move waits on node 2's answer (left to finish),
    then announces a new one; the agent stops during that hand-over and restarts inside the new
    window. The restored reclaim knows the job was handed over: it is stopped here, not moved
    again (one hand-over, one copy on node 2). Before: the new reclaim's start deleted every
    record of the earlier one, the move's included, so the restored reclaim moved the job again:
    a second hand-over to node 2 (two copies once it started them)."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig, job = await reclaim_in_handover(rig, jobs, "lm-t-mvcut-rcnew")
            out = await mig.withdraw.cancel_reclaim("lm-t owner changed their mind")
            assert out["finishing"] == [job.id], out
            mig.evacuation.start(30.0, "lm-t owner again")  # the move of the cancelled one still waits
            await rig.stop_migrate()
            assert job.cgroup.frozen() and job.state == "running"
            # restores the new reclaim (a move again would signal the job at once, wait 0.5 s)
            await rig.start_migrate(notice_margin=0.1, ckpt_wait_s=0.5)
            assert await until(lambda: not job.active or rig.dst_jobs.asked > 1, 20), "neither stopped nor moved"
            assert rig.dst_jobs.asked == 1, "the restored reclaim handed the job over a second time"
            assert job.state == "reclaimed", job.state
            rig.dst_jobs.gate.set()
            assert await until(lambda: len(rig.dst_jobs.active()) == 1, 10)

    asyncio.run(main())



class ToNode2(ReclaimComponent):
    """The real component of node 1 sending node 2's transfer port (``port2``: both listen on
    127.0.0.1) its control messages; ``hold`` (when set) holds the hand-over before it is sent
    (a stand-in for a slow link, in the test that wants it late)."""

    port2 = 0
    hold: asyncio.Event | None = None

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any:
        from laminar.migrate.transfer import send_control

        addr, _, key, zone = self._peer(node)
        return await send_control(addr, self.port2, key, op, body, zone=zone, node=str(self.node_id), timeout=timeout)

    def __init__(self) -> None:
        super().__init__()
        real = self.takeover.handover

        async def handover(node: int, pid: int, req: dict[str, Any], *a: Any, **kw: Any) -> str:
            if self.hold is not None:
                await self.hold.wait()
            return await real(node, pid, req, *a, **kw)
        self.takeover.handover = handover  # type: ignore[method-assign]


class KeeperRig:
    """Node 1 (``ToNode2``) places a kept job of node 3 (gone) on node 2, which gets the
    replica by a real transfer and the keeper by a real control message; node 2 runs its own
    real ReclaimComponent (``node2``: its store and state directory) over the gated job table,
    which node 2's zone asks as an agent's does (the checkpoint's check, a take-over's job)."""

    def __init__(self, tmp: Path, jobs: Any, rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
        import laminar.migrate.takeover as takeover_mod  # the placement's transfer (Takeover.place_on)
        from laminar.store import Store

        self.tmp, self.jobs, self.rig = tmp, jobs, rig
        self.port2 = free_port(socket.SOCK_STREAM)
        real_send = takeover_mod.send_checkpoint

        async def to_node2(addr: str, port: int, *a: Any, **kw: Any) -> Any:
            return await real_send(addr, self.port2, *a, **kw)

        monkeypatch.setattr(takeover_mod, "send_checkpoint", to_node2)
        self.store2 = Store(tmp / "node2.db")
        self.node2: ReclaimComponent | None = None
        self.key = f"n3-lm-t-mvcut-{secrets.token_hex(4)}"  # node 3's job (keys are n<node>-<job>)

    async def start(self, hold: asyncio.Event | None = None) -> asyncio.Future[tuple[bool, str]]:
        """Both components started, the placement under way (its future)."""
        rig = self.rig
        await rig.start_zones()
        mig = ToNode2()
        mig.port2, mig.hold = self.port2, hold
        await rig.start_migrate(mig)
        cfg2 = Config(validate({"agent": {"state_dir": str(self.tmp / "agent2"), "node": "lm-t-mvcut2"},
                                "migrate": {"poll_s": 60.0, "periodic": False, "port": self.port2}}))
        self.node2 = ReclaimComponent()
        await self.node2.start(standin_agent(MigrateAgent, config=cfg2, store=self.store2, events=EventBus(self.store2),
                                               jobs=rig.dst_jobs, zone=rig.dst_zone))
        assert rig.dst_zone is not None
        rig.dst_zone.agent = standin_agent(ZoneAgent, migrate=self.node2)  # as the agent's: node 2's zone asks its migrate
        _, req, ckpt, row = rig.kept_replica(self.key, "lm-t-mvcut-kept3")
        return asyncio.ensure_future(mig.takeover.place_elsewhere(row, req, ckpt, "node 3 is dead"))

    async def restart_node2(self, before_start: Callable[[ReclaimComponent], None] = lambda c: None) -> None:
        """Node 2's migrate component stops (its take-over in flight cancelled) and a fresh one
        starts on the same store and state directory: the agent's restart, as the migrate layer
        sees it. ``before_start`` gets the fresh component before it starts."""
        assert self.node2 is not None and self.rig.dst_zone is not None
        await self.node2.stop()
        cfg2 = Config(validate({"agent": {"state_dir": str(self.tmp / "agent2"), "node": "lm-t-mvcut2"},
                                "migrate": {"poll_s": 60.0, "periodic": False, "port": self.port2}}))
        self.node2 = ReclaimComponent()
        before_start(self.node2)
        await self.node2.start(standin_agent(MigrateAgent, config=cfg2, store=self.store2, events=EventBus(self.store2),
                                               jobs=self.rig.dst_jobs, zone=self.rig.dst_zone))
        self.rig.dst_zone.agent = standin_agent(ZoneAgent, migrate=self.node2)

    def keeper2(self) -> Any:
        return self.store2.db.execute("SELECT request, state FROM migrate_replicas WHERE key=?",
                                      (self.key,)).fetchone()

    async def keeper_round_after_not_before(self) -> None:
        """Node 2's keeper round once its keeper's not_before passed (node 2 slower than that)."""
        assert self.node2 is not None
        keeper = self.keeper2()
        assert keeper is not None and keeper["state"] == "keeping"
        await asyncio.sleep(max(0.0, float(json.loads(keeper["request"])["not_before"]) - time.time()) + 0.2)
        await self.node2.takeover.tick(time.time())

    async def stop(self) -> None:
        try:
            if self.node2 is not None:
                await self.node2.stop()
            await self.rig.stop()
        finally:
            self.store2.close()


def test_the_keeper_a_placement_gives_its_node_waits_for_the_hand_over_in_flight_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keeper on node 1 takes over a dead source's job and places it on node 2, giving node 2
    its own keeper (take_over, not before the hand-over's timeout + 5 s). Node 2 takes longer
    than that to start the job (its start held on the gate). Node 2's keeper round then must not
    resume the job beside the hand-over. Before: it did (a second start asked of node 2's job
    table): two copies on node 2."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            rig = Rig(tmp_path, jobs)
            g = KeeperRig(tmp_path, jobs, rig, monkeypatch)
            try:
                place = await g.start()
                assert await until(lambda: rig.dst_jobs.asked > 0, 15), [e["message"] for e in rig.events]
                await g.keeper_round_after_not_before()
                assert g.node2 is not None
                assert await until(lambda: rig.dst_jobs.asked > 1 or g.key not in g.node2.takeover.taking, 10)
                assert rig.dst_jobs.asked == 1, "node 2's keeper resumed the job beside the hand-over in flight there"
                rig.dst_jobs.gate.set()  # node 2 starts the handed-over job now
                placed, why = await asyncio.wait_for(place, 30)
                assert placed, why
                await g.node2.takeover.tick(time.time())  # the job runs there: its keeper there stands down
                assert await until(lambda: g.key not in g.node2.takeover.taking, 10)
                assert len(rig.dst_jobs.active()) == 1 and rig.dst_jobs.asked == 1
                assert g.keeper2()["state"] == "handed-over"
            finally:
                await g.stop()

    asyncio.run(main())


def test_a_hand_over_that_comes_after_its_nodes_keeper_took_the_job_over_is_answered_with_that_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the hand-over reaches node 2 only after node 2's keeper resumed the job
    (node 1's hand-over held before it is sent). Node 2 answers it with the job its keeper
    started (the placement's reservation dropped, the job tagged with its placement id), and node
    1 takes the job as placed there. Before: the late hand-over bound its reservation and node 2
    started the job a second time."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            rig = Rig(tmp_path, jobs)
            g = KeeperRig(tmp_path, jobs, rig, monkeypatch)
            hold = asyncio.Event()
            try:
                rig.dst_jobs.gate.set()  # node 2 starts jobs at once
                place = await g.start(hold)
                assert await until(lambda: g.keeper2() is not None, 15), [e["message"] for e in rig.events]
                await g.keeper_round_after_not_before()
                assert await until(lambda: g.keeper2()["state"] == "resumed", 10), g.keeper2()["state"]
                assert len(rig.dst_jobs.active()) == 1
                hold.set()  # the hand-over comes now
                placed, why = await asyncio.wait_for(place, 30)
                assert len(rig.dst_jobs.active()) == 1, "node 2 started the job a second time for the late hand-over"
                assert placed, why
                assert rig.dst_jobs.asked == 1
            finally:
                await g.stop()

    asyncio.run(main())


def test_a_hand_over_that_comes_while_its_nodes_keeper_is_starting_the_job_is_answered_with_that_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but the hand-over reaches node 2 while node 2's keeper is starting the job: past
    its last look for the placement (whose reservation it dropped), its start held in node 2's
    job table (the gate) before the job is stored. Node 2 answers the hand-over with the job its
    keeper starts once that start ends, and node 1 takes the job as placed there. Before: the
    hand-over found no reservation and no job and was refused, so node 1 went on to place the
    job elsewhere (a second copy where another node had room) while node 2 ran it."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            rig = Rig(tmp_path, jobs)
            g = KeeperRig(tmp_path, jobs, rig, monkeypatch)
            hold = asyncio.Event()
            try:
                place = await g.start(hold)
                assert await until(lambda: g.keeper2() is not None, 15), [e["message"] for e in rig.events]
                await g.keeper_round_after_not_before()
                assert await until(lambda: rig.dst_jobs.asked == 1, 10), g.keeper2()["state"]  # held at the gate
                assert rig.dst_zone is not None
                hold.set()  # the hand-over comes now, while node 2's keeper is starting the job
                assert await until(lambda: rig.dst_zone.counts["handovers"] >= 1 and
                                   (place.done() or bool(rig.dst_zone.handovers.inflight)), 10)
                await asyncio.sleep(0.3)  # a refusal, were there one, reaches node 1 meanwhile
                rig.dst_jobs.gate.set()  # node 2's keeper's start ends: the job is stored
                placed, why = await asyncio.wait_for(place, 30)
                assert rig.dst_jobs.asked == 1, "node 2 was asked to start the job a second time"
                assert placed, why
                assert len(rig.dst_jobs.active()) == 1
                assert await until(lambda: g.keeper2()["state"] == "resumed", 10), g.keeper2()["state"]
            finally:
                await g.stop()

    asyncio.run(main())


def test_a_hand_over_to_a_node_whose_keeper_took_the_job_over_but_could_not_start_it_is_not_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but node 2's keeper's start of the job fails (node 2's job table refuses it, a
    stand-in for a node without room now): its take-over, which dropped the placement's
    reservation, goes on to look for room (held here while the hand-over comes). Node 1's
    hand-over must be answered with node 2's keeper's custody, node 1 taking the job as placed
    there, so only node 2's keeper goes on. Before: it was refused ('no live reservation'), node
    1's keeper went on with the job (not placed) and node 2's keeper too (its take-over's state
    written over the release node 1 sent): both would resume it, two copies."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            rig = Rig(tmp_path, jobs)
            g = KeeperRig(tmp_path, jobs, rig, monkeypatch)
            hold, onward = asyncio.Event(), asyncio.Event()
            try:
                place = await g.start(hold)
                assert g.node2 is not None and rig.dst_zone is not None
                node2 = g.node2
                real_elsewhere = node2.takeover.place_elsewhere

                async def refused(*a: Any, **kw: Any) -> Any:  # node 2 has no room for it now
                    rig.dst_jobs.asked += 1
                    await rig.dst_jobs.gate.wait()
                    raise RuntimeError("lm-t: no free GPU on node 2")

                async def held_elsewhere(*a: Any, **kw: Any) -> Any:  # node 2's take-over looks elsewhere
                    await onward.wait()
                    return await real_elsewhere(*a, **kw)

                rig.dst_jobs.submit = refused  # type: ignore[method-assign]
                node2.takeover.place_elsewhere = held_elsewhere  # type: ignore[method-assign]
                assert await until(lambda: g.keeper2() is not None, 15), [e["message"] for e in rig.events]
                await g.keeper_round_after_not_before()
                assert await until(lambda: rig.dst_jobs.asked == 1, 10), g.keeper2()["state"]  # held at the gate
                hold.set()  # the hand-over comes while node 2's keeper is starting the job
                assert await until(lambda: rig.dst_zone.counts["handovers"] >= 1, 10)
                rig.dst_jobs.gate.set()  # node 2's start fails: its take-over goes on, held before placing
                placed, why = await asyncio.wait_for(place, 30)
                onward.set()
                assert await until(lambda: g.key not in node2.takeover.taking, 30)
                state2 = g.keeper2()["state"]
                row1 = jobs.store.db.execute("SELECT state, job_id FROM migrate_replicas WHERE key=?",
                                             (g.key,)).fetchone()
                both = not placed and state2 in ("keeping", "waiting", "placed", "resumed")
                assert not both, (f"node 1's keeper goes on (state {row1['state']}: {why}) and node 2's too "
                                  f"(state {state2}): two copies")
                assert placed and row1["state"] == "placed" and "taken over by node 2" in row1["job_id"], (why, dict(row1))
                assert state2 in ("waiting", "placed"), state2  # node 2's keeper has the job
                assert not rig.dst_jobs.active()
            finally:
                onward.set()
                await g.stop()

    asyncio.run(main())


def test_a_hand_over_after_a_restart_of_the_node_whose_keeper_fenced_it_is_still_answered_with_its_custody(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, but node 2's agent restarts after its keeper's take-over dropped the placement's
    reservation, and the hand-over comes before the restarted agent's first keeper round (which
    would take the job over, and fence the placement, again). The restarted node 2 must still
    answer it with its keeper's custody. Before: the mark that the take-over fenced the placement
    was in memory only; the restarted node refused the hand-over ('no live reservation'), node
    1's keeper went on with the job (not placed) beside node 2's: two copies."""
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            rig = Rig(tmp_path, jobs)
            g = KeeperRig(tmp_path, jobs, rig, monkeypatch)
            hold, onward = asyncio.Event(), asyncio.Event()
            try:
                place = await g.start(hold)
                assert g.node2 is not None and rig.dst_zone is not None
                node2 = g.node2

                async def refused(*a: Any, **kw: Any) -> Any:  # node 2 has no room for it now
                    rig.dst_jobs.asked += 1
                    raise RuntimeError("lm-t: no free GPU on node 2")

                async def held_elsewhere(*a: Any, **kw: Any) -> Any:  # node 2's take-over looks elsewhere
                    await onward.wait()
                    raise RuntimeError("lm-t: held")

                rig.dst_jobs.submit = refused  # type: ignore[method-assign]
                node2.takeover.place_elsewhere = held_elsewhere  # type: ignore[method-assign]
                assert await until(lambda: g.keeper2() is not None, 15), [e["message"] for e in rig.events]
                await g.keeper_round_after_not_before()
                assert await until(lambda: rig.dst_jobs.asked == 1, 10), g.keeper2()["state"]  # the start failed
                assert await until(lambda: g.key in node2.takeover._fenced, 10)
                first_round = asyncio.Event()

                def slow_first_round(c: ReclaimComponent) -> None:
                    real = c.takeover.tick

                    async def held(now: float) -> None:  # the restarted agent's first keeper round comes late
                        await first_round.wait()
                        await real(now)
                    c.takeover.tick = held  # type: ignore[method-assign]

                await g.restart_node2(slow_first_round)  # before the hand-over comes
                hold.set()
                placed, why = await asyncio.wait_for(place, 30)
                first_round.set()
                state2 = g.keeper2()["state"]
                row1 = jobs.store.db.execute("SELECT state, job_id FROM migrate_replicas WHERE key=?",
                                             (g.key,)).fetchone()
                assert not (not placed and state2 in ("keeping", "waiting", "placed", "resumed")), (
                    f"node 1's keeper goes on (state {row1['state']}: {why}) and node 2's too (state {state2}): two copies")
                assert placed and row1["state"] == "placed" and "taken over by node 2" in row1["job_id"], (why, dict(row1))
                assert not rig.dst_jobs.active()
            finally:
                onward.set()
                await g.stop()

    asyncio.run(main())
