"""A keeper whose source's ``release`` was lost ends when its source says the job no longer needs
it (control op ``needs``), and never otherwise (ReclaimComponent's replica GC, the stale keeper).

Real pieces: three migrate components (node 1: the old keeper, node 2: the source, node 3: a new
keeper), each with its own SQLite store and its transfer endpoint listening on its own loopback
address (127.0.0.<node>, one port for all, as in a zone); the source's checkpoints are real
jobkit checkpoints it prestages itself (``Prestage.tick``: snapshot, transfer, ``keeper``), and
the question and answer are real authenticated control messages. Stand-ins, named as such: the
zone (``Zone``: membership, addresses and keys, no sockets) and the source's job manager
(``Jobs``: one job whose state the test sets, as the job's exit would).

The lost release is made the way it happens: the source agent restarts without its keeper map
and the job ends while it is down, so it never sends ``release`` to node 1. (An agent keeps the
map in its store since 2026-11-22, tests/cluster/test_replica_keeper_change.py; one that lost it,
an older agent or a lost store, is made here by deleting those rows at each start.)
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ports
import pytest
from jobrig import until
from standin_agent import standin_agent
from standin_origin import OriginQueries

from laminar.components import MigrateAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.spec import JobSpec
from laminar.store import Store

KEY = secrets.token_bytes(32)
K = "n2-job-1"  # the source's (node 2's) job-1


class Zone:
    """Stand-in zone of node ``me``: every node of ``nodes`` is a live member at 127.0.0.<node>."""

    networked = True
    zone = 1

    def __init__(self, me: int, nodes: list[int]) -> None:
        self.node_id = me
        self.membership = SimpleNamespace(
            by_node={n: SimpleNamespace(zone=1, addr=f"127.0.0.{n}", owner="") for n in nodes}, suspects=set(),
            state={n: SimpleNamespace(last_seen=time.time(), last_summary=None) for n in nodes},
            roster_ips=lambda: frozenset(f"127.0.0.{n}" for n in nodes))
        self.keys = {1: KEY}
        self.s = {"listen": f"127.0.0.{me}", "handover_timeout_s": 5.0}


class Jobs(OriginQueries):
    """Stand-in job manager: the jobs this node runs."""

    def __init__(self, jobs: list[Any] | None = None) -> None:
        self.jobs = jobs or []

    def active(self) -> list[Any]:
        return [j for j in self.jobs if j.state == "running"]

    def list(self) -> list[Any]:
        return list(self.jobs)

    def get(self, job_id: str) -> Any:
        return next((j for j in self.jobs if j.id == job_id), None)


def free_port() -> int:
    return ports.free_port(socket.SOCK_STREAM, "127.0.0.2")


class Job(SimpleNamespace):
    """Stand-in job: what the migrate component reads of one."""

    @property
    def active(self) -> bool:
        return bool(self.state == "running")


def job_of(tmp: Path) -> Job:
    """The source's job-1: running, with a checkpoint directory the test writes checkpoints to."""
    return Job(id="job-1", num=1, state="running", gpus=[], owner_uid=0, owner_gid=0, ended=None, pid=None,
               exit_code=None, spec=JobSpec(["train"]), ckpt_dir=tmp / "job-1-ckpt")


@contextlib.asynccontextmanager
async def node(tmp: Path, me: int, nodes: list[int], port: int, jobs: Jobs | None = None,
               prestage: str = "always") -> AsyncIterator[ReclaimComponent]:
    """A started migrate component of node ``me`` (state in ``tmp/node<me>``); stopped after."""
    d = tmp / f"node{me}"
    d.mkdir(exist_ok=True)
    cfg = Config(validate({"agent": {"state_dir": str(d), "node": f"lm-t-gc{me}"},
                           "migrate": {"poll_s": 60.0, "periodic": False, "port": port, "prestage": prestage}}))
    store = Store(d / "state.db")
    with contextlib.suppress(sqlite3.OperationalError), store.tx() as db:  # a source that lost its keeper map
        db.execute("DELETE FROM migrate_keepers")
    agent = standin_agent(MigrateAgent, config=cfg, store=store, events=EventBus(store), jobs=jobs or Jobs(),
                            zone=Zone(me, nodes))
    comp = ReclaimComponent()
    try:
        await comp.start(agent)
        yield comp
    finally:
        await comp.stop()
        store.close()


def held(comp: ReclaimComponent, key: str = K) -> list[str]:
    d = comp.root / "checkpoints" / key  # type: ignore[operator]
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def state(comp: ReclaimComponent, key: str = K) -> str | None:
    row = comp.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    return None if row is None else str(row["state"])


async def prestage_round(src: ReclaimComponent) -> None:
    """One prestage round as the agent's watch runs it, after the scan of the jobs' checkpoint
    directories it reads (off the loop, every poll_s: laminar.runtime.ckpt_scan); the round
    itself never reads a job's directory."""
    assert src.ckpt is not None
    await src.ckpt.scan.refresh_all(src.agent.jobs.active())
    src.prestage.tick(time.time())


async def prestage(src: ReclaimComponent, job: Any, step: int) -> None:
    """The job writes checkpoint ``step``; the source's own prestage ships it and sends the keeper."""
    Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False, keep=10).save(
        f"weights-{step}".encode(), step=step)
    await prestage_round(src)
    assert await until(lambda: src.prestage.shipped.get(job.id) == f"ckpt-{step}", timeout=20), src.prestage.shipped


def check_now(comp: ReclaimComponent) -> None:
    """The old keeper's GC round, with keepers unchanged for 10 ms counted as worth a question."""
    comp.s["replica_keeper_check_s"] = 0.01
    comp.replicas.keeper_asked.clear()
    comp.replicas.tick(time.time(), force=True)


def answered(comp: ReclaimComponent) -> bool:
    """The old keeper asked its question and has its answer (or gave up on it)."""
    return bool(comp.replicas.keeper_asked) and not comp.replicas._keeper_checking


def run(coro: Any) -> Any:
    return asyncio.new_event_loop().run_until_complete(coro)


def test_a_lost_release_of_an_ended_job_ends_the_keeper_and_its_replicas_go(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2], port) as keeper:
            async with node(tmp_path, 2, [1, 2], port, Jobs([job])) as src:
                await prestage(src, job, 5)
                assert src.prestage.keeper == {"job-1": 1}
                assert await until(lambda: state(keeper) == "keeping" and held(keeper) == ["ckpt-5"])
            # the source agent restarts (its keeper map is gone); the job exits while it is down
            job.state = "exited"
            async with node(tmp_path, 2, [1, 2], port, Jobs([job])) as src:
                await prestage_round(src)  # knows no keeper: sends no release
                await asyncio.sleep(0.3)
                assert state(keeper) == "keeping" and held(keeper) == ["ckpt-5"]  # the leak before the rule
                await asyncio.sleep(0.05)
                check_now(keeper)
                assert await until(lambda: state(keeper) == "released"), state(keeper)
                assert await until(lambda: not (keeper.root / "checkpoints" / K).exists()), held(keeper)  # type: ignore[operator]
                assert keeper.counts["replica_keepers_ended"] == 1

    run(main())


def test_a_keeper_still_needed_is_not_dropped(tmp_path: Path) -> None:
    """Safety: the source's job runs and node 1 is (or may be) its keeper; the source is
    unreachable; the source knows no record of the job: each time the keeper and its replica stay."""
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2], port) as keeper:
            async with node(tmp_path, 2, [1, 2], port, Jobs([job])) as src:
                await prestage(src, job, 5)
                assert await until(lambda: state(keeper) == "keeping")
                await asyncio.sleep(0.05)
                check_now(keeper)  # running, node 1 is its keeper
                await until(lambda: answered(keeper), timeout=5)
                assert state(keeper) == "keeping" and held(keeper) == ["ckpt-5"]
            # restarted with prestage off (it ships no more checkpoints): its keeper is unknown to it
            async with node(tmp_path, 2, [1, 2], port, Jobs([job]), prestage="off") as src:
                await asyncio.sleep(0.1)
                assert src.prestage.keeper == {}
                check_now(keeper)
                assert await until(lambda: answered(keeper), timeout=5)
                await asyncio.sleep(0.1)
                assert state(keeper) == "keeping" and held(keeper) == ["ckpt-5"]
            # the source agent is down (unreachable), its job's state unknown: kept
            job.state = "exited"
            check_now(keeper)
            assert await until(lambda: answered(keeper), timeout=10)
            await asyncio.sleep(0.1)
            assert state(keeper) == "keeping" and held(keeper) == ["ckpt-5"]
            async with node(tmp_path, 2, [1, 2], port, Jobs([])) as src:  # no record of the job
                check_now(keeper)
                assert await until(lambda: answered(keeper), timeout=5)
                await asyncio.sleep(0.1)
                assert state(keeper) == "keeping" and held(keeper) == ["ckpt-5"]
            # a silent source (a suspect: it may have left without notice, the keeper may be the
            # job's only way back) and a dead one (its reclaim window ended: the take-over's) are never asked
            keeper.s["replica_keeper_check_s"] = 0.01
            keeper.agent.zone.membership.suspects.add(2)
            keeper.replicas.keeper_asked.clear()
            keeper.replicas.tick(time.time(), force=True)
            assert not keeper.replicas._keeper_checking and not keeper.replicas.keeper_asked
            keeper.agent.zone.membership.suspects.clear()
            came = keeper.agent.store.db.execute("SELECT updated FROM migrate_replicas").fetchone()["updated"]
            keeper.notices[2] = (came + 0.01, came - 60.0)  # its window ended after the keeper came
            keeper.replicas.tick(time.time(), force=True)
            assert not keeper.replicas._keeper_checking and not keeper.replicas.keeper_asked
            assert state(keeper) == "keeping"

    run(main())


def test_a_source_that_moved_its_keeper_to_another_keeper_ends_the_old_one(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2, 3], port) as old, node(tmp_path, 3, [1, 2, 3], port) as new:
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                src.agent.zone.membership.state[3].last_summary = SimpleNamespace(draining=True)  # node 1 first
                await prestage(src, job, 5)
                assert src.prestage.keeper == {"job-1": 1}
            async with node(tmp_path, 2, [1, 2, 3], port, Jobs([job])) as src:
                # restarted; node 1 now drains: the next checkpoint goes to node 3 (no release to node 1)
                src.agent.zone.membership.state[1].last_summary = SimpleNamespace(draining=True)
                await prestage(src, job, 10)
                assert src.prestage.keeper == {"job-1": 3}
                assert await until(lambda: state(new) == "keeping" and held(new) == ["ckpt-10"])
                assert state(old) == "keeping" and held(old) == ["ckpt-5"]
                await asyncio.sleep(0.05)
                check_now(old)
                check_now(new)
                assert await until(lambda: state(old) == "released" and held(old) == []), (state(old), held(old))
                assert await until(lambda: answered(new), timeout=5)
                await asyncio.sleep(0.1)
                assert state(new) == "keeping" and held(new) == ["ckpt-10"]  # the new keeper stays

    run(main())


def test_a_keeper_that_came_while_the_question_was_on_its_way_wins(tmp_path: Path) -> None:
    port = free_port()
    job = job_of(tmp_path)

    async def main() -> None:
        async with node(tmp_path, 1, [1, 2], port) as keeper:
            async with node(tmp_path, 2, [1, 2], port, Jobs([job])) as src:
                await prestage(src, job, 5)
                assert await until(lambda: state(keeper) == "keeping")
                asked = float(keeper.agent.store.db.execute(
                    "SELECT updated FROM migrate_replicas WHERE key=?", (K,)).fetchone()["updated"])
                await prestage(src, job, 10)  # a newer keeper arrives after the question was sent
                assert await until(lambda: held(keeper) == ["ckpt-10"])
                src.prestage.keeper.clear()
                job.state = "exited"  # the source now answers "not needed"
                assert await keeper.replicas.check_keeper(K, 2, asked) is False
                assert state(keeper) == "keeping" and held(keeper) == ["ckpt-10"]

    run(main())


@pytest.mark.parametrize(("st", "keeper", "busy", "needed"), [
    (None, None, False, True), ("running", 1, False, True), ("running", None, False, True),
    ("running", 3, False, False), ("running", 3, True, True), ("exited", 1, False, False),
    ("stopped", None, False, False), ("failed", 1, False, False), ("migrated", 1, False, False),
    ("reclaimed", 1, False, True), ("reclaimed", None, False, True), ("lost", None, False, True),
    ("requeued", 1, False, True), ("queued", None, False, True), ("exited", 1, True, True)])
def test_the_source_answer_policy(st: str | None, keeper: int | None, busy: bool, needed: bool) -> None:
    from laminar.migrate.reclaim import keeper_needed

    got, why = keeper_needed(st, keeper, 1, busy)
    assert got is needed and why
