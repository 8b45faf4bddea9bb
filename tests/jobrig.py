"""A real JobManager over real cgroups for kernel tests, and an async wait.

``job_manager(tmp)`` starts a JobManager with its own cgroup root (``laminar-t-<hex>``) and
SQLite store in ``tmp``; on leaving it stops the manager, kills and removes the whole cgroup
tree (every job's processes with it) and closes the store, also when the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from laminar.airlock.cgroups import CgroupTree, detect
from laminar.events import EventBus
from laminar.runtime.jobs import JobManager
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
async def job_manager(tmp: Path) -> AsyncIterator[JobManager]:
    root = f"laminar-t-{secrets.token_hex(3)}"
    store = Store(tmp / "laminar.db")
    jobs = JobManager(store=store, state_dir=tmp, cgroup_root=root, events=EventBus(store), gpus_declared=[])
    try:
        await jobs.start(None)
        yield jobs
    finally:
        await jobs.stop()
        CgroupTree(detect(), root).purge()
        store.close()
