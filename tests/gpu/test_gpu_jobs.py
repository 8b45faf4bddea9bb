"""Jobs on a real GPU through the real runtime (laminar.runtime.jobs.JobManager): real cgroups,
real processes running torch on CUDA, GPUs allocated from NVML's inventory; and the zone
advertising the NVML model. Skips where NVML finds no GPU, or where the runtime cannot run
(not root, no cgroup2 with a memory controller).

Each test owns a cgroup root ``laminar-t-gpu-<hex>`` and a fresh SQLite store, and removes its
cgroups and processes afterwards, also when it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpucheck import JOB, last_json, nvml_or_skip, runtime_or_skip, smi_gpus

from laminar.airlock.cgroups import CgroupTree, detect
from laminar.events import EventBus
from laminar.runtime import gpus
from laminar.runtime.jobs import JobManager
from laminar.runtime.spec import JobError, JobSpec
from laminar.store import Store

pytestmark = pytest.mark.gpu


class Rig:
    """A JobManager over a fresh store and its own cgroup root; `close()` removes everything."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = f"laminar-t-gpu-{secrets.token_hex(3)}"
        self.store = Store(tmp / "laminar.db")
        self.events = EventBus(self.store)
        self.seen: list[dict[str, Any]] = []
        self.events.subscribe(self.seen.append)
        self.jobs = JobManager(store=self.store, state_dir=tmp / "state", cgroup_root=self.root, events=self.events)

    async def close(self) -> None:
        try:
            await self.jobs.stop()
        finally:
            CgroupTree(detect(), self.root).purge()
            self.store.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    nvml_or_skip()
    runtime_or_skip()
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        asyncio.run(r.close())


def job_env() -> dict[str, str]:
    """What a user would pass with ``--env`` so the job's Python finds what this one finds (the
    runtime gives a job a clean environment: PATH, LANG and its own variables)."""
    return {k: os.environ[k] for k in ("PYTHONPATH", "LD_LIBRARY_PATH") if os.environ.get(k)}


async def until(cond: Callable[[], Any], timeout: float, step: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    v = cond()
    while not v and time.monotonic() < end:
        await asyncio.sleep(step)
        v = cond()
    return v


def log_of(rig: Rig, job_id: str) -> str:
    job = rig.jobs.get(job_id)
    assert job is not None and job.log_path is not None
    try:
        return job.log_path.read_text()
    except FileNotFoundError:
        return ""


async def finish(rig: Rig, job_id: str) -> Any:
    """Lets the job exit (its "go" file) and returns its final record."""
    job = rig.jobs.get(job_id)
    assert job is not None and job.ckpt_dir is not None
    (job.ckpt_dir / "go").touch()
    done = await until(lambda: (j := rig.jobs.get(job_id)) is not None and not j.live, 120)
    assert done, f"job {job_id} did not exit; log:\n{log_of(rig, job_id)}"
    return rig.jobs.get(job_id)


def test_gpu_job_gets_its_gpus_and_a_second_is_refused(rig: Rig) -> None:
    async def go() -> None:
        await rig.jobs.start(None)
        inv = rig.jobs.inventory
        assert inv is not None and inv.source == "nvml"
        n = len(inv.gpus)
        spec = JobSpec(command=[sys.executable, "-c", JOB], name="gpu-all", gpus=n, env=job_env())
        first = await rig.jobs.submit(spec)
        assert first.state == "running" and first.gpus == inv.indices
        ready = await until(lambda: first.ckpt_dir is not None and (first.ckpt_dir / "ready").exists()
                            or not rig.jobs.get(first.id).live, 180)  # type: ignore[union-attr]
        view = last_json(log_of(rig, first.id))
        assert ready and view is not None, f"job {first.id} never got ready; log:\n{log_of(rig, first.id)}"
        # exactly its GPUs, by the environment the runtime set, and CUDA works on them
        assert view["cvd"], "the runtime set no CUDA_VISIBLE_DEVICES for a job with GPUs"
        assert view["count"] == n and sorted(view["uuids"]) == sorted(str(g.uuid) for g in inv.gpus)
        assert view["alloc_ok"] is True
        # the job's own process (sh exec'd it: the job's pid) holds the GPU memory, per NVML
        assert view["pid"] == first.pid
        mem = gpus.nvml_process_memory()
        assert first.pid is not None and mem.get(first.pid, 0) >= n * (512 << 20), f"NVML per-pid memory {mem}, job pid {first.pid}"
        assert first.pid in first.pids  # and that pid is in the job's cgroup
        # a second job on a node whose GPUs are all taken: refused at submit, never given one
        for want in (1, [inv.indices[0]]):
            with pytest.raises(JobError, match=r"only 0 free|in use by other jobs"):
                await rig.jobs.submit(JobSpec(command=[sys.executable, "-c", JOB], gpus=want, env=job_env()))
        assert [j.id for j in rig.jobs.active()] == [first.id]
        end = await finish(rig, first.id)
        assert end.state == "exited" and end.exit_code == 0, end.reason
        # the GPU is free again: the next job gets it
        again = await rig.jobs.submit(JobSpec(command=[sys.executable, "-c", JOB], gpus=1, env=job_env()))
        assert again.state == "running" and again.gpus == [inv.indices[0]]
        ok = await until(lambda: again.ckpt_dir is not None and (again.ckpt_dir / "ready").exists()
                         or not rig.jobs.get(again.id).live, 180)  # type: ignore[union-attr]
        view2 = last_json(log_of(rig, again.id))
        assert ok and view2 is not None and view2["count"] == 1 and view2["uuids"] == [inv.gpus[0].uuid], log_of(rig, again.id)
        end2 = await finish(rig, again.id)
        assert end2.state == "exited" and end2.exit_code == 0, end2.reason

    asyncio.run(go())


def test_runtime_status_and_events_name_the_real_gpus(rig: Rig) -> None:
    smi = smi_gpus()

    async def go() -> None:
        await rig.jobs.start(None)
        st = rig.jobs.status()["gpus"]
        assert st["source"] == "nvml"
        assert [(g["index"], g["name"], g["uuid"]) for g in st["gpus"]] == [(s.index, s.name, s.uuid) for s in smi]
        started = [e for e in rig.seen if e["kind"] == "job" and "GPUs: nvml" in e["message"]]
        assert started and started[0]["gpus"]["source"] == "nvml", f"no start-up event naming NVML's GPUs: {rig.seen}"

    asyncio.run(go())


def test_job_without_gpus_sees_none(rig: Rig) -> None:
    async def go() -> None:
        await rig.jobs.start(None)
        job = await rig.jobs.submit(JobSpec(command=[sys.executable, "-c", JOB], gpus=0, env=job_env()))
        ok = await until(lambda: job.ckpt_dir is not None and (job.ckpt_dir / "ready").exists()
                         or not rig.jobs.get(job.id).live, 180)  # type: ignore[union-attr]
        view = last_json(log_of(rig, job.id))
        end = await finish(rig, job.id) if rig.jobs.get(job.id).live else rig.jobs.get(job.id)  # type: ignore[union-attr]
        assert ok and view is not None and end is not None, log_of(rig, job.id)
        assert end.exit_code == 0
        assert view["count"] == 0, f"a job given no GPUs sees {view['count']}: {json.dumps(view)}"

    asyncio.run(go())


def test_zone_advertises_the_nvml_model(rig: Rig) -> None:
    smi = smi_gpus()
    from laminar.policy import placement as pl
    from laminar.zone.component import ZoneComponent

    async def go() -> None:
        await rig.jobs.start(None)
        comp = ZoneComponent(settings={"cpus": 4, "memory_mb": 4000}, jobs=rig.jobs)
        await comp.start(None)
        try:
            inv = comp.arbiter.inventory
            assert inv.gpu_model == smi[0].name and len(inv.gpu_free) == len(smi)
            assert pl.fits(inv, pl.Demand(gpus=1, cpus=1, memory_mb=100, gpu_model=smi[0].name)) is None
            assert pl.fits(inv, pl.Demand(gpus=1, cpus=1, memory_mb=100, gpu_model="no-such-gpu")) == pl.RefuseReason.GPU_MODEL
            # the short name a user types (the CLI's --gpu-model H100) matches NVML's full one
            short = next((w for w in smi[0].name.split() if any(c.isdigit() for c in w)), smi[0].name)
            assert pl.fits(inv, pl.Demand(gpus=1, cpus=1, memory_mb=100, gpu_model=short)) is None, short
        finally:
            await comp.stop()

    asyncio.run(go())
