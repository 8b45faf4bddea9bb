"""A job cgroup that cannot be removed at teardown is remembered and removed once it can be.

Before: the teardown's rmdir retries (about 1 s per busy directory) ran on the agent's event
loop, and a cgroup still busy after them was only logged: it stayed on the node for good. Here
a job's child is also put in a v1 freezer cgroup of the test's own (``laminar-s7-…``) and frozen:
SIGKILL (``cgroup.kill``) is held for a frozen task until it is thawed, so the job's cgroups stay
populated and rmdir answers EBUSY. The teardown must run its removal off the loop, record the
leak (store, a ``job`` event, the metrics), and the sweep (or the next start) must remove the
cgroups once the test thaws the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobrig import until

from laminar.airlock import cgroups
from laminar.airlock.cgroups import CgroupTree, detect
from laminar.events import EventBus
from laminar.runtime.jobs import JobManager
from laminar.runtime.spec import JobSpec
from laminar.store import Store

pytestmark = pytest.mark.kernel

FREEZER = Path("/sys/fs/cgroup/freezer")


@contextlib.contextmanager
def freezer_cgroup() -> Iterator[Path]:
    """A v1 freezer cgroup of the test's own; thawed, emptied and removed afterwards."""
    if not (FREEZER / "cgroup.procs").exists():
        pytest.skip("no v1 freezer hierarchy at /sys/fs/cgroup/freezer")
    d = FREEZER / f"laminar-s7-{secrets.token_hex(3)}"
    d.mkdir()
    try:
        yield d
    finally:
        with contextlib.suppress(OSError):
            (d / "freezer.state").write_text("THAWED")
        with contextlib.suppress(OSError):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def sample(jobs: JobManager, name: str) -> float | None:
    return jobs.metrics.get_sample_value(name)


def events(store: Store, needle: str) -> list[str]:
    rows = store.db.execute("SELECT message FROM events WHERE kind = 'job' ORDER BY id").fetchall()
    return [r[0] for r in rows if needle in r[0]]


@pytest.mark.parametrize("how", ["sweep", "restart"])
def test_a_cgroup_that_cannot_be_removed_is_recorded_and_removed_once_it_can(
        tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = f"laminar-t-s7-{secrets.token_hex(3)}"
    store = Store(tmp_path / "laminar.db")
    bus = EventBus(store)
    rmdir_on_loop: list[bool] = []
    real_rmdir_retry = cgroups._rmdir_retry

    def watched(d: Path, tries: int = 50) -> None:
        rmdir_on_loop.append(threading.current_thread() is threading.main_thread())
        real_rmdir_retry(d, tries)

    async def main(freezer: Path) -> None:
        jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=bus, gpus_declared=[],
                          leak_sweep_s=0.3 if how == "sweep" else 3600)
        await jobs.start(None)
        try:
            child_file = tmp_path / "lm-s7-child"
            job = await jobs.submit(JobSpec(["sh", "-c", f"sleep 600 & echo $! > {child_file}; wait"],
                                            name="lm-s7-leak", memory_mb=64).validate())
            assert await until(lambda: child_file.exists() and child_file.read_text().strip(), 20)
            child = int(child_file.read_text())
            assert await until(lambda: child in job.cgroup.pids(), 20)
            (freezer / "cgroup.procs").write_text(str(child))
            (freezer / "freezer.state").write_text("FROZEN")
            assert await until(lambda: (freezer / "freezer.state").read_text().strip() == "FROZEN", 10)
            dirs = job.cgroup.all_dirs()

            monkeypatch.setattr(cgroups, "_rmdir_retry", watched)
            final = await jobs.stop(job.id, "lm-s7 leak test", grace_s=1)
            monkeypatch.setattr(cgroups, "_rmdir_retry", real_rmdir_retry)
            assert final is not None and final.state == "stopped" and final.ended is not None, final
            # the frozen child holds the cgroups: the removal failed (off the loop) and was recorded
            assert rmdir_on_loop and not any(rmdir_on_loop), "the teardown's rmdir ran on the event loop"
            assert job.cgroup.unified.is_dir()
            leaked = jobs.leaks.rows()
            assert [r["job_id"] for r in leaked] == [job.id], leaked
            assert "busy" in leaked[0]["error"], leaked
            assert sample(jobs, "laminar_jobs_leaked_cgroups") == 1
            assert sample(jobs, "laminar_jobs_cgroups_leaked_total") == 1
            assert events(store, f"job {job.id}: its cgroup could not be removed")
            assert jobs.status()["leaked_cgroups"][0]["job_id"] == job.id
            if how == "sweep":
                await jobs.leaks.sweep()  # a sweep while it is still frozen keeps it
                assert [r["job_id"] for r in jobs.leaks.rows()] == [job.id]
                assert jobs.leaks.rows()[0]["tries"] >= 2
                (freezer / "freezer.state").write_text("THAWED")  # the held SIGKILL is delivered now
                await removed(jobs, job.id, dirs)  # by the running manager's periodic sweep
        finally:
            await jobs.stop()
        if how == "restart":
            (freezer / "freezer.state").write_text("THAWED")
            # the next agent's start removes it (its periodic sweep would come only in an hour)
            jobs = JobManager(store=store, state_dir=tmp_path, cgroup_root=root, events=bus, gpus_declared=[],
                              leak_sweep_s=3600)
            await jobs.start(None)
            try:
                await removed(jobs, job.id, dirs)
            finally:
                await jobs.stop()

    async def removed(jobs: JobManager, job_id: str, dirs: list[Path]) -> None:
        assert await until(lambda: not jobs.leaks.rows(), 30), jobs.leaks.rows()
        assert [d for d in dirs if d.exists()] == [], "the leaked cgroups are still there"
        assert sample(jobs, "laminar_jobs_leaked_cgroups") == 0
        assert events(store, f"job {job_id}: leaked cgroup removed")

    try:
        with freezer_cgroup() as freezer:
            asyncio.run(main(freezer))
    finally:
        CgroupTree(detect(), root).purge()
        store.close()
