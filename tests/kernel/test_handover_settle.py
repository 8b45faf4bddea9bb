"""An operator ends the wait of a hand-over whose destination never answers (``laminarctl job
settle JOB --run-here|--gone``, POST /v1/migrations/{job}/settle): the destination received the
frame and vanished for good, so the move would keep its job frozen here forever (no timeout
thaws it: during a partition that could make two copies). The decision is the operator's and is
stored: a restart neither undoes it nor asks that node again.

Real pieces as in tests/kernel/test_move_cut_handover.py (its rig: the real job in real cgroups
under the real JobManager, frozen through the real freezer; the real ReclaimComponent over the
real store; two real ZoneComponents on loopback; the destination's gated job table, a named
stand-in, holds the start so the hand-over is never answered). "Gone for good" is node 2's zone
stopped and, for the restart, a roster without node 2. The route's handler is called as the
agent's API calls it (privilege is the API's: tests/kernel/test_security_routes.py refuses every
privileged route to a second user, this one included; the CLI against a real laminard below).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from agentproc import AgentProc
from jobrig import until
from standin_agent import standin_agent
from test_move_cut_handover import Mover, Placer, Rig, free_port, running_rig, sleeper, transfer_in_place

from laminar.api import ApiError
from laminar.components import MigrateAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.migrate.prestage import Prestage
from laminar.migrate.reclaim import ReclaimComponent
from laminar.store import Store
from laminar.zone.component import ZoneComponent

pytestmark = pytest.mark.kernel

NOBODY = 65534


async def settle(mig: Any, ref: str, decision: str) -> Any:
    """POST /v1/migrations/{ref}/settle as the API calls it (root)."""
    route = next(r for r in mig.routes() if r.path == "/v1/migrations/{job}/settle")
    assert route.privileged
    req = SimpleNamespace(body={"decision": decision}, params={"job": ref}, query={},
                          peer=SimpleNamespace(uid=0, gid=0, pid=1))
    return await route.handler(req)


async def get(mig: Any, path: str, **params: str) -> Any:
    route = next(r for r in mig.routes() if r.path == path and r.method == "GET")
    return await route.handler(SimpleNamespace(body=None, params=params, query={},
                                               peer=SimpleNamespace(uid=0, gid=0, pid=1)))


def record_releases(mig: Any) -> list[tuple[int, str]]:
    """The keeper releases ``mig`` sends from now on (node, key), recorded instead of sent."""
    released: list[tuple[int, str]] = []

    async def release(node: int, key: str) -> None:  # node 2 told to drop its keeper of the job
        released.append((node, key))

    mig.prestage.release = release
    return released


async def cut_move_with_node2_gone(rig: Rig, jobs: Any, name: str) -> tuple[Any, Any]:
    """``name``'s job, its Airlock re-address to node 2 cut by the agent's stop during the
    hand-over; node 2 then leaves the zone for good and the agent restarts without it, which
    cannot ask node 2 (the hand-over shown unconfirmed). Returns (mig, job)."""
    mig = await rig.start_migrate()
    job = await sleeper(jobs, name)
    await rig.cut_during_handover(mig.mover.readdress(job))
    await rig.stop_destination()
    mig = await restart_without_node2(rig)
    assert await until(lambda: any(e.get("phase") == "unconfirmed" and e.get("job") == job.id
                                   for e in rig.events), 10)
    return mig, job


async def restart_without_node2(rig: Rig) -> Any:
    """The source's agent starts again with node 2 gone from the zone's roster."""
    assert rig.src_zone is not None
    await rig.src_zone.stop()
    s = dict(rig.src_zone_s)
    s["nodes"] = [n for n in s["nodes"] if n["id"] == 1]
    rig.src_zone = ZoneComponent(settings=s, gpus=0)
    await rig.src_zone.start(None)
    return await rig.start_migrate()


def test_an_unanswered_move_is_shown_unconfirmed_and_settled_to_run_here(tmp_path: Path) -> None:
    """Node 2 got the hand-over and never answers: the move shows ``unconfirmed`` (node, since)
    and the job stays frozen. ``--run-here`` thaws it here, ends the move (not tried on another
    node) and drops the record; a restart (node 2 back and answering) leaves it running and
    does not ask node 2 again (a restart undoing the decision would ask and freeze it again)."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate()
            job = await sleeper(jobs, "lm-t-settle-here")
            with pytest.raises(ApiError) as e:  # nothing pending yet: refused, naming the job
                await settle(mig, job.id, "run-here")
            assert e.value.status == 409 and job.id in str(e.value) and "no pending hand-over" in str(e.value)
            move = asyncio.ensure_future(mig.mover.move_now(job, "lm-t loan return"))
            assert await until(lambda: any(e.get("phase") == "unconfirmed" for e in rig.events), 15)
            pending = await get(mig, "/v1/migrate/handovers")
            assert [(h["job"], h["kind"], h["node"], h["state"]) for h in pending] == \
                [(job.id, "move", 2, "unconfirmed")], pending
            assert pending[0]["since"] <= time.time()
            shown = await get(mig, "/v1/migrations/{job}", job=job.id)
            assert shown["phase"] == "unconfirmed" and shown["dest"] == 2 and shown["unconfirmed_since"]
            assert job.cgroup.frozen()
            with pytest.raises(ApiError) as e:
                await settle(mig, job.id, "maybe")
            assert e.value.status == 400
            released = record_releases(mig)
            res = await settle(mig, job.id, "run-here")
            assert res["decision"] == "run-here" and res["node"] == 2 and res["kind"] == "move"
            assert await until(lambda: released == [(2, mig.job_key(job))], 5), released
            mv = await asyncio.wait_for(move, 10)
            assert mv.phase == "failed" and "operator" in mv.error, mv
            assert not job.cgroup.frozen() and job.state == "running"
            assert rig.record(job.id) is None and await get(mig, "/v1/migrate/handovers") == []
            assert any(e.get("phase") == "settled" and e.get("job") == job.id for e in rig.events)
            await rig.stop_migrate()
            await rig.restart_destination()  # node 2 restarts: its zone answers again
            rig.events.clear()
            mig = await rig.start_migrate()
            await asyncio.sleep(1.0)  # what a restart would do (ask node 2) begins at start
            took_up = [e["message"] for e in rig.events if e.get("job") == job.id
                       and e.get("phase") in ("unconfirmed", "confirmed", "move-cut", "done", "migrated")]
            assert not took_up, f"the restart took the move up again: {took_up}"
            assert job.id not in mig.moves and await get(mig, "/v1/migrate/handovers") == []
            assert job.state == "running" and not job.cgroup.frozen()

    asyncio.run(main())


def test_a_cut_move_whose_node_left_the_zone_is_settled_gone_and_stays_so(tmp_path: Path) -> None:
    """The source stops during the hand-over; node 2 leaves the zone for good. The restarted
    source cannot ask it: the job stays frozen (``unasked``). ``--gone`` stops it here as
    ``migrated``; the record goes, so the next start does nothing to it."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig, job = await cut_move_with_node2_gone(rig, jobs, "lm-t-settle-gone")
            pending = await get(mig, "/v1/migrate/handovers")
            assert [(h["job"], h["state"], h["node"]) for h in pending] == [(job.id, "unasked", 2)], pending
            assert job.cgroup.frozen() and job.active
            res = await settle(mig, job.id.removeprefix("job-"), "gone")  # the number works too
            assert res["job"] == job.id and res["decision"] == "gone"
            assert await until(lambda: job.state == "migrated", 10), job.state
            assert rig.record(job.id) is None
            await rig.stop_migrate()
            await rig.start_migrate()
            assert rig.record(job.id) is None and job.state == "migrated"

    asyncio.run(main())


def test_a_settle_cut_by_the_agents_stop_is_finished_by_the_restart(tmp_path: Path) -> None:
    """``--gone`` is stored before the job is stopped: an agent stopped in between (the stop
    here hangs, the request is cut) finishes it at its next start (the job ``migrated``), and
    does not go back to waiting for node 2."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig, job = await cut_move_with_node2_gone(rig, jobs, "lm-t-settle-cut")
            real_stop, hung = jobs.stop, asyncio.Event()

            async def hanging_stop(*a: Any, **kw: Any) -> Any:
                hung.set()
                await asyncio.Event().wait()

            jobs.stop = hanging_stop
            req = asyncio.ensure_future(settle(mig, job.id, "gone"))
            assert await until(hung.is_set, 10)
            req.cancel()  # the agent stops mid-settle
            await asyncio.gather(req, return_exceptions=True)
            jobs.stop = real_stop
            await rig.stop_migrate()
            assert job.active, "stopped before the restart: nothing left to test"
            rig.events.clear()
            mig = await restart_without_node2(rig)
            assert await until(lambda: job.state == "migrated", 10), job.state
            assert await until(lambda: rig.record(job.id) is None, 5)
            assert not any(e.get("phase") == "unconfirmed" for e in rig.events), rig.events

    asyncio.run(main())


@pytest.mark.parametrize("decision", ["run-here", "gone"])
def test_a_reclaim_move_left_to_finish_by_a_cancel_is_listed_and_settled(tmp_path: Path, decision: str) -> None:
    """A reclaim's move waits on node 2's answer when the owner cancels the reclaim: the move
    is left to finish, so no window's end bounds its wait any more, and node 2 is gone for
    good. The hand-over is listed as pending; ``--run-here`` thaws the job here, ends the move
    and drops the reclaim's record of it; ``--gone`` stops the job here as ``migrated`` and
    drops that record too. Before: not listed, and the settle was refused
    (409, 'a reclaim's move ends with its window, or reclaim cancel'): the job stayed frozen
    until an agent restart."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate()
            job = await sleeper(jobs, "lm-t-settle-rc")
            mig.s["notice_margin"] = 0.1  # the plan signals the job at 10 % of the window (3 s)
            mig.evacuation.start(30.0, "lm-t owner")
            assert await until(lambda: any(e.get("phase") == "unconfirmed" and e.get("job") == job.id
                                           for e in rig.events), 20), [e["message"] for e in rig.events]
            out = await mig.withdraw.cancel_reclaim("lm-t owner changed their mind")
            assert out["finishing"] == [job.id], out
            await rig.stop_destination()  # node 2 is gone for good
            pending = await get(mig, "/v1/migrate/handovers")
            assert [(h["job"], h["kind"], h["node"], h["state"]) for h in pending] == \
                [(job.id, "move", 2, "unconfirmed")], pending
            released = record_releases(mig)
            res = await settle(mig, job.id, decision)
            assert res["decision"] == decision and res["node"] == 2 and res["kind"] == "move", res
            if decision == "run-here":
                assert await until(lambda: not job.cgroup.frozen(), 10), "left frozen"
                assert job.active and job.state == "running"
                assert mig.moves[job.id].phase == "failed" and "operator" in mig.moves[job.id].error
                assert await until(lambda: released == [(2, mig.job_key(job))], 5), released
            else:
                # (the move's phase is set once the job's stop returned)
                assert await until(lambda: job.state == "migrated" and mig.moves[job.id].phase == "done", 10), \
                    (job.state, mig.moves[job.id])
                assert released == []
            assert await until(lambda: jobs.store.db.execute("SELECT * FROM migrate_moves WHERE cause='reclaim'").fetchall()
                               == [], 5)
            assert await get(mig, "/v1/migrate/handovers") == []

    asyncio.run(main())


class ReleasingPlacer(Placer):
    """:class:`Placer` recording the keeper releases it sends (node, key)."""

    released: list[tuple[int, str]] = []

    async def _release(self, node: int, key: str) -> None:
        self.released.append((node, key))


@pytest.mark.parametrize("end", ["refused", "settled"])
def test_a_keepers_cut_placement_that_ends_without_a_job_there_releases_that_nodes_keeper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str) -> None:
    """A keeper's placement on node 2 is cut by the agent's stop during its hand-over (node 2's
    start of the job held on the gate). The restarted agent asks node 2 again and the placement
    ends with no job there: node 2 restarted and answers that it has no reservation for it
    (``refused``), or it stays silent and the operator settles ``--run-here`` (``settled``). The
    keeper goes on here, so node 2 is told to drop the take-over keeper the placement gave it, as
    a placement refused before the stop does: else node 2 resumes the job at that keeper's
    ``not_before`` (or whenever it comes back) while the keeper here takes it over too: two
    copies. Before: no release was sent on this path."""
    transfer_in_place(monkeypatch)

    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            mig = await rig.start_migrate(ReleasingPlacer(), node="lm-t-settle")
            key, req, ckpt, row = rig.kept_replica(f"n3-lm-t-settle-rel-{end}", "lm-t-settle-rel")
            place = asyncio.ensure_future(mig.takeover.place_elsewhere(row, req, ckpt, "node 3 is dead"))
            assert await until(lambda: any(e.get("phase") == "unconfirmed" for e in rig.events), 15), rig.events
            place.cancel()  # the agent stops during the wait (a crash would not even try a release)
            await asyncio.gather(place, return_exceptions=True)
            await rig.stop_migrate()
            ReleasingPlacer.released = []
            await rig.stop_destination()  # node 2's agent stops before the job started there
            if end == "refused":
                await rig.start_destination()  # back, with no reservation for the placement
            rig.events.clear()
            mig = await rig.start_migrate(ReleasingPlacer(), node="lm-t-settle")
            if end == "refused":
                assert await until(lambda: any(e.get("phase") == "placement-cut" for e in rig.events), 15), \
                    rig.events
            else:
                assert await until(lambda: any(e.get("phase") == "unconfirmed" and e.get("job") == key
                                               for e in rig.events), 15), rig.events
                res = await settle(mig, key, "run-here")
                assert res["kind"] == "placement" and res["decision"] == "run-here"
            assert await until(lambda: (2, key) in ReleasingPlacer.released, 5), \
                f"node 2 keeps the take-over keeper of {key} while the keeper here goes on: two copies"
            assert key not in mig.takeover.taking
            assert jobs.store.db.execute("SELECT * FROM migrate_replica_handovers").fetchall() == []
            assert rig.dst_jobs.active() == []

    asyncio.run(main())


def test_a_keepers_cut_placement_whose_node_left_is_settled_as_placed(tmp_path: Path) -> None:
    """A keeper's placement recorded as handed over to node 2 (cut by a stop), node 2 gone from
    the roster: the key is held (no other take-over) until ``--gone`` marks it placed there,
    and ``--run-here`` on nothing pending is refused."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            key = "lm-t-settle-key"
            req = {"spec": {"command": ["sleep", "600"]}, "owner_uid": 0, "owner_gid": 0}
            await rig.start_migrate()  # creates the tables
            await rig.stop_migrate()
            with jobs.store.tx() as db:  # what Takeover.place_on leaves when a stop cuts its hand-over
                db.execute("INSERT INTO migrate_replicas VALUES (?, 3, 'j9', ?, 'ckpt-5', 'keeping', NULL, ?)",
                           (key, json.dumps(req), time.time()))
                db.execute("INSERT INTO migrate_replica_handovers VALUES (?, 2, 77, ?, ?)",
                           (key, json.dumps(req), time.time()))
            mig = await restart_without_node2(rig)
            assert await until(lambda: any(e.get("phase") == "unconfirmed" and e.get("key") == key
                                           for e in rig.events), 10)
            assert key in mig.takeover.taking
            pending = await get(mig, "/v1/migrate/handovers")
            assert [(h["job"], h["kind"], h["state"]) for h in pending] == [(key, "placement", "unasked")]
            res = await settle(mig, key, "gone")
            assert res["kind"] == "placement" and res["state"] == "placed"
            assert key not in mig.takeover.taking and await get(mig, "/v1/migrate/handovers") == []
            with pytest.raises(ApiError) as e:
                await settle(mig, key, "run-here")
            assert e.value.status == 409 and key in str(e.value)

    asyncio.run(main())


def test_the_cli_refuses_a_job_with_nothing_pending_and_a_caller_without_privilege(agent: AgentProc) -> None:
    """A real laminard: `job settle` of a job with no pending hand-over is refused (exit 1),
    naming the job and where to look; a user without privilege gets exit 4 (403); `migrations
    --pending` says there is none."""
    job = agent.json("submit", "--name", "lm-t-settle-cli", "--", "sleep", "600")
    r = agent.ctl("job", "settle", job["id"], "--run-here", check=False)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert job["id"] in r.stderr and "no pending hand-over" in r.stderr and "--pending" in r.stderr, r.stderr
    r = agent.ctl("job", "settle", job["id"], "--gone", check=False, user=NOBODY)
    assert r.returncode == 4 and "permission denied" in r.stderr, (r.returncode, r.stderr)
    assert agent.json("job", "show", job["id"])["state"] == "running"
    assert agent.json("migrations", "--pending") == []
    assert "no pending hand-over" in agent.ctl("migrations", "--pending").stderr + \
        agent.ctl("migrations", "--pending").stdout


class Releaser(Mover):
    """:class:`Mover` whose checkpoint transfer, keeper messages and keeper releases are the real
    ones (to node 2's real transfer endpoint, :func:`start_node2_migrate`)."""

    def __init__(self) -> None:
        super().__init__()
        del self.mover.send, self.mover.send_keeper  # the part's own again

    async def _release(self, node: int, key: str) -> None:  # the part's own (Mover's sends them here)
        await Prestage.release(self.prestage, node, key)


async def start_node2_migrate(rig: Rig, port: int) -> Any:
    """Node 2's real ReclaimComponent (its own store and state directory under the rig's tmp,
    its transfer endpoint on ``port``, its zone the rig's destination zone), started as its
    agent starts it (again on the same store: its restart)."""
    store = Store(rig.tmp / "node2.db")
    cfg = Config(validate({"agent": {"state_dir": str(rig.tmp / "node2"), "node": "lm-t-settle-n2"},
                           "migrate": {"poll_s": 60.0, "periodic": False, "port": port}}))
    mig = ReclaimComponent()
    await mig.start(standin_agent(MigrateAgent, config=cfg, store=store, events=EventBus(store), jobs=rig.dst_jobs,
                                    zone=rig.dst_zone))
    return mig


async def stop_node2_migrate(mig: Any) -> None:
    with contextlib.suppress(Exception):
        await mig.stop()
    mig.agent.store.close()


def test_a_release_a_run_here_settle_decided_reaches_node2_after_the_agents_restart(tmp_path: Path) -> None:
    """A loan return's move hands node 2 the job's checkpoint and keeper (node 2 is its keeper now),
    then its hand-over goes unanswered. Node 2's agent stops; the operator settles ``--run-here``:
    the job runs on here, so node 2 must drop its keeper of it (else, back, it keeps an older
    checkpoint of a job it does not run and resumes it when this node is declared dead: two
    copies). The release cannot arrive while node 2 is down, and this agent restarts before it
    is back. Once node 2's agent is back, the restarted agent sends the release again and node 2's
    keeper ends (``released``). Before: the release was not even sent (node 2 was still the job's
    keeper, so the release counted as void) and nothing of it outlived the restart."""
    async def main() -> None:
        async with running_rig(tmp_path) as (rig, jobs):
            port2 = free_port(socket.SOCK_STREAM)
            node2 = await start_node2_migrate(rig, port2)
            try:
                mig = await rig.start_migrate(Releaser(), prestage="off")
                mig.s["port"] = port2  # the transfer port is the same on every node: node 2's, on this host
                job = await sleeper(jobs, "lm-t-settle-rel2")
                key = mig.job_key(job)
                move = asyncio.ensure_future(mig.mover.move_now(job, "lm-t loan return"))
                assert await until(lambda: any(e.get("phase") == "unconfirmed" for e in rig.events), 20), rig.events
                assert replica_state(node2, key) == "keeping" and mig.prestage.keeper.get(job.id) == 2
                await stop_node2_migrate(node2)  # node 2's agent is down: its endpoint refuses
                await rig.stop_destination()
                res = await settle(mig, job.id, "run-here")
                assert res["decision"] == "run-here"
                await asyncio.wait_for(move, 10)
                assert job.state == "running" and not job.cgroup.frozen()
                await asyncio.sleep(0.5)  # the release's first try (refused: node 2 is down)
                await rig.stop_migrate()  # this agent restarts while node 2 is still down
                mig = await rig.start_migrate(Releaser(), prestage="off", poll_s=0.2)
                mig.s["port"] = port2
                await asyncio.sleep(1.0)  # a few rounds with node 2 down: still pending, not given up
                assert {"node": 2, "key": key} in mig.status()["releases_pending"], mig.status()
                await rig.start_destination()
                node2 = await start_node2_migrate(rig, port2)  # node 2's agent is back
                assert replica_state(node2, key) == "keeping"
                assert await until(lambda: replica_state(node2, key) == "released", 15), \
                    f"node 2 still keeps {key}, a job that runs on node 1: it would resume a second copy"
                assert await until(lambda: mig.status()["releases_pending"] == [], 5), mig.status()
                assert jobs.store.db.execute("SELECT * FROM migrate_releases").fetchall() == []
                assert job.state == "running" and mig.prestage.keeper.get(job.id) is None
            finally:
                await stop_node2_migrate(node2)

    asyncio.run(main())


def replica_state(mig: Any, key: str) -> str | None:
    row = mig.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    return None if row is None else str(row["state"])
