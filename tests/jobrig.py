"""A real JobManager over real cgroups for kernel tests, with Airlock if asked, and an async wait.

``job_manager(tmp)`` starts a JobManager with its own cgroup root (``laminar-t-<hex>``) and
SQLite store in ``tmp``; on leaving it stops the manager, kills and removes the whole cgroup
tree (every job's processes with it) and closes the store, also when the test fails.
``airlock_rig(tmp)`` does the same with an Airlock on the same store and event bus, and
``running(jobs, name, job_class)`` submits a sleeping job and waits for it to be in its cgroup.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from laminar.airlock.cgroups import CgroupTree, detect
from laminar.airlock.manager import Airlock
from laminar.events import EventBus
from laminar.runtime.jobs import JobManager
from laminar.runtime.record import Job
from laminar.runtime.spec import JobSpec
from laminar.store import Store


async def until(cond: Callable[[], object], timeout: float = 30.0, step: float = 0.05) -> bool:
    """True as soon as ``cond()`` is true, False after ``timeout`` seconds (looked at once more
    at the end)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(step)
    return bool(cond())


@contextlib.asynccontextmanager
async def job_manager(tmp: Path, members: Any = None) -> AsyncIterator[JobManager]:
    root = f"laminar-t-{secrets.token_hex(3)}"
    store = Store(tmp / "laminar.db")
    jobs = JobManager(store=store, state_dir=tmp, cgroup_root=root, events=EventBus(store), gpus_declared=[],
                      members=members)
    try:
        await jobs.start(None)
        yield jobs
    finally:
        await jobs.stop()
        CgroupTree(detect(), root).purge()
        store.close()


@contextlib.asynccontextmanager
async def airlock_rig(tmp: Path, members: Any = None) -> AsyncIterator[tuple[JobManager, Airlock, Store]]:
    """``members``: the members component both see (a stand-in: standin_agent.StandInMembers)."""
    root = f"laminar-t-{secrets.token_hex(3)}"
    store = Store(tmp / "laminar.db")
    bus = EventBus(store)
    jobs = JobManager(store=store, state_dir=tmp, cgroup_root=root, events=bus, gpus_declared=[], members=members)
    al = Airlock(jobs=jobs, store=store, events=bus, members=members)
    try:
        await jobs.start(None)
        await al.start(None)
        yield jobs, al, store
    finally:
        await al.stop()
        await jobs.stop()
        CgroupTree(detect(), root).purge()
        store.close()


async def running(jobs: JobManager, name: str, job_class: str = "transient") -> Job:
    """A ``sleep 600`` job of ``job_class``, once its process is in its cgroup."""
    job = await jobs.submit(JobSpec(["sleep", "600"], name=name, job_class=job_class).validate())
    await until(lambda: job.pid in job.cgroup.pids(), 10)
    return job
