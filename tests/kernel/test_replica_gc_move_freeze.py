"""A failed move thaws only what the move itself froze: real processes in real cgroups.

A move (``Mover.move``: the reclaim's, the loan return's, Airlock's re-address) freezes
the job after its checkpoint and thaws it again when the move fails. A job Airlock had already
suspended (frozen under memory pressure) must stay frozen: the move did not freeze it, so a failed
move does not undo Airlock's decision. The job manager, the cgroups and the job's process are real;
the zone is a stand-in with no peer (``LoneZone``: membership only), so the move fails right after
the freeze with "no destination fits", which is the failure path under test.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from jobrig import job_manager, until
from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import CONFIG_FIELDS, MOVES_SCHEMA, ReclaimComponent
from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel


class LoneZone:
    """The membership view the move reads: this node (1) and no peer."""

    networked = True
    node_id = 1
    zone = 1

    def __init__(self) -> None:
        self.membership = SimpleNamespace(by_node={1: SimpleNamespace(zone=1, addr="127.0.0.1", owner="")},
                                          suspects=set(),
                                          state={1: SimpleNamespace(last_seen=time.time(), last_summary=None)})
        self.keys: dict[int, bytes] = {}
        self.s = {"listen": "127.0.0.1"}


def component(jobs: object) -> ReclaimComponent:
    c = ReclaimComponent()
    store = jobs.store  # type: ignore[attr-defined]
    store.ensure_schema("migrate-moves", MOVES_SCHEMA)  # a move records itself before its freeze
    c.agent = standin_agent(MigrateAgent, jobs=jobs, zone=LoneZone(), store=store, events=SimpleNamespace(emit=lambda *a, **kw: None))
    c.s = {k: f.default for k, f in CONFIG_FIELDS.items()}
    return c


async def sleeper_with_checkpoint(jobs: object, name: str) -> object:
    job = await jobs.submit(JobSpec(["sleep", "600"], name=name).validate())  # type: ignore[attr-defined]
    assert job.pid and job.ckpt_dir is not None
    Checkpointer(job_id=job.id, ckpt_dir=job.ckpt_dir, install_signal=False).save(b"weights", step=5)
    return job


def test_a_failed_move_leaves_a_job_airlock_suspended_frozen(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            job = await sleeper_with_checkpoint(jobs, "lm-t-rgc-susp")
            assert job.cgroup.freeze(timeout=5.0)  # what Airlock's suspend does under memory pressure
            mv = await component(jobs).mover.move_now(job, "test: airlock re-address")
            assert mv.phase == "failed" and "no destination fits" in mv.error, mv
            assert job.cgroup.frozen(), "the failed move thawed a job it had not frozen"

    asyncio.run(main())


def test_a_failed_move_thaws_the_job_it_froze(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            job = await sleeper_with_checkpoint(jobs, "lm-t-rgc-run")
            assert not job.cgroup.frozen()
            mv = await component(jobs).mover.move_now(job, "test: move with nowhere to go")
            assert mv.phase == "failed" and "no destination fits" in mv.error, mv
            assert await until(lambda: not job.cgroup.frozen(), 10), "the failed move left the job frozen"
            assert job.state == "running"

    asyncio.run(main())
