"""A keeper whose release was lost stays while its job runs at the source and ends once the job
exited there: the source answers the ``needs`` question from its real job manager.

Real pieces: the source's JobManager over real cgroups (``jobrig.job_manager``) running a real
process that writes a real jobkit checkpoint; two migrate components (node 1, the keeper; node
2, the source) on their own SQLite stores, their transfer endpoints on 127.0.0.1 and 127.0.0.2
(one port, as in a zone); the source's own prestage (snapshot, transfer, ``keeper``); the
question and answer are authenticated control messages. The zone is a stand-in (``Zone``:
membership, addresses and keys, no sockets). The release is lost the way it happens: the source
agent restarts while its job runs without its keeper map (an older agent kept it in memory only;
a current one keeps it in its store, so the stand-in deletes those rows at each start), so when
the job exits nobody tells node 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jobrig import job_manager, until
from ports import free_port
from standin_agent import standin_agent
from standin_origin import OriginQueries

from laminar.components import MigrateAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.spec import JobSpec
from laminar.store import Store

pytestmark = pytest.mark.kernel

KEY = secrets.token_bytes(32)

# The job: writes checkpoint 7 (jobkit, as a training job does), then waits for its stop file.
JOB = """
import os, sys, time
from laminar.jobkit import Checkpointer
Checkpointer(install_signal=False).save(b"weights-7", step=7)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""


class Zone:
    """Stand-in zone of node ``me``: nodes 1 and 2, live, at 127.0.0.<node>."""

    networked = True
    zone = 1

    def __init__(self, me: int) -> None:
        self.node_id = me
        self.membership = SimpleNamespace(
            by_node={n: SimpleNamespace(zone=1, addr=f"127.0.0.{n}", owner="") for n in (1, 2)}, suspects=set(),
            state={n: SimpleNamespace(last_seen=time.time(), last_summary=None) for n in (1, 2)},
            roster_ips=lambda: frozenset(f"127.0.0.{n}" for n in (1, 2)))
        self.keys = {1: KEY}
        self.s = {"listen": f"127.0.0.{me}", "handover_timeout_s": 5.0}


class NoJobs(OriginQueries):
    """Stand-in job manager of node 1: it runs no job."""

    def active(self) -> list[Any]:
        return []

    def list(self) -> list[Any]:
        return []

    def get(self, job_id: str) -> None:
        return None


@contextlib.asynccontextmanager
async def node(tmp: Path, me: int, port: int, jobs: Any = None) -> AsyncIterator[ReclaimComponent]:
    d = tmp / f"node{me}"
    d.mkdir(exist_ok=True)
    cfg = Config(validate({"agent": {"state_dir": str(d), "node": f"lm-t-gck{me}"},
                           "migrate": {"poll_s": 60.0, "periodic": False, "port": port, "prestage": "always"}}))
    store = Store(d / "migrate.db")
    with contextlib.suppress(sqlite3.OperationalError), store.tx() as db:  # a source that lost its keeper map
        db.execute("DELETE FROM migrate_keepers")
    agent = standin_agent(MigrateAgent, config=cfg, store=store, events=EventBus(store), jobs=jobs, zone=Zone(me))
    comp = ReclaimComponent()
    try:
        await comp.start(agent)
        yield comp
    finally:
        await comp.stop()
        store.close()


def keeper_of(comp: ReclaimComponent, key: str) -> tuple[str | None, list[str]]:
    row = comp.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    d = comp.root / "checkpoints" / key  # type: ignore[operator]
    return (None if row is None else str(row["state"]), sorted(p.name for p in d.iterdir()) if d.exists() else [])


async def ask(keeper: ReclaimComponent) -> None:
    """Node 1's GC round with keepers unchanged for 10 ms worth a question; waits for the answer."""
    keeper.s["replica_keeper_check_s"] = 0.01
    keeper.replicas.keeper_asked.clear()
    await asyncio.sleep(0.05)
    keeper.replicas.tick(time.time(), force=True)
    assert await until(lambda: bool(keeper.replicas.keeper_asked) and not keeper.replicas._keeper_checking, timeout=10)


def test_the_keeper_of_a_running_job_stays_and_ends_when_the_job_exits(tmp_path: Path) -> None:
    port = free_port(socket.SOCK_STREAM, "127.0.0.2")
    stop = tmp_path / "stop"

    async def main() -> None:
        async with job_manager(tmp_path / "jm") as jm, node(tmp_path, 1, port, NoJobs()) as keeper:
            job = await jm.submit(JobSpec([sys.executable, "-c", JOB, str(stop)], name="lm-t-gc"))
            key = f"n2-{job.id}"
            assert job.ckpt_dir is not None
            assert await until(lambda: job.state == "running" and (job.ckpt_dir / "ckpt-7").is_dir(), timeout=30)
            async with node(tmp_path, 2, port, jm) as src:
                assert src.ckpt is not None  # (the round reads the scan of the job's checkpoint directory)
                await src.ckpt.scan.refresh_all(jm.active())
                src.prestage.tick(time.time())
                assert await until(lambda: src.prestage.shipped.get(job.id) == "ckpt-7", timeout=30), src.prestage.shipped
                assert await until(lambda: keeper_of(keeper, key) == ("keeping", ["ckpt-7"]))
                await ask(keeper)  # the job runs and node 1 is its keeper: the keeper stays
                assert job.state == "running"
                assert keeper_of(keeper, key) == ("keeping", ["ckpt-7"])
            # the source agent is down when its job exits by itself: nobody sends node 1 a release
            stop.touch()
            assert await until(lambda: job.state == "exited", timeout=30), job.state
            async with node(tmp_path, 2, port, jm) as src:  # back, with no keeper map
                src.prestage.tick(time.time())
                await asyncio.sleep(0.2)
                assert keeper_of(keeper, key) == ("keeping", ["ckpt-7"])  # the leak without the question
                await ask(keeper)
                assert await until(lambda: keeper_of(keeper, key) == ("released", [])), keeper_of(keeper, key)

    asyncio.new_event_loop().run_until_complete(main())
