"""The size a reclaim plans for a job that has not checkpointed yet (a real job in a real
cgroup under a real JobManager; the migrate component over a stand-in agent: config, store,
events, no zone).

Before, such a job was planned at 64 MiB whatever it held: the reclaim asked for a 1 GiB job's
checkpoint too late for its transfer (bench/move.py, 20 s of notice: the plan left 0.5 s for a
transfer the destination's check then put at 8.6 s), and the job was lost at the window's end.
Now it is planned at the memory its cgroup holds (less clean page cache), plus, for a GPU job, the
GPU memory NVML attributes to its processes, at least 64 MiB; once it has a checkpoint, that
checkpoint's size by its verified manifest (the checkpoint driver's check; never a stat of the
job's files).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from jobrig import job_manager, until
from standin_agent import standin_agent

from laminar import jobkit
from laminar.components import MigrateAgent
from laminar.config import Config, validate
from laminar.events import EventBus
from laminar.migrate.constants import DEFAULT_CKPT_BYTES
from laminar.migrate.reclaim import ReclaimComponent
from laminar.runtime.spec import JobSpec
from laminar.store import Store

MB = 1 << 20


def make_agent(tmp: Path) -> SimpleNamespace:
    """A stand-in agent for the migrate component: config, store, events; no zone."""
    cfg = Config(validate({"agent": {"state_dir": str(tmp), "node": "lm-t-plan"},
                           "migrate": {"poll_s": 60.0, "periodic": False}}))
    store = Store(tmp / "state.db")
    return standin_agent(MigrateAgent, config=cfg, store=store, events=EventBus(store), jobs=None, zone=None)

HOLD = """
import os, sys, time
state = bytearray(os.urandom(int(sys.argv[1]) << 20))  # the job's state, in its memory
print("ready", flush=True)
time.sleep(600)
"""


@contextlib.asynccontextmanager
async def planner(tmp: Path) -> AsyncIterator[tuple[Any, ReclaimComponent]]:
    """A real JobManager and the migrate component started over the stand-in agent."""
    async with job_manager(tmp / "jobs") as jobs:
        agent = make_agent(tmp)
        agent.jobs = jobs
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            yield jobs, comp
        finally:
            await comp.stop()
            agent.store.db.close()


async def holding(jobs: Any, tmp: Path, *mibs: int) -> list[Any]:
    """Real jobs holding ``mibs`` MiB of state each in their memory, once they all hold it."""
    out = [await jobs.submit(JobSpec([sys.executable, "-c", HOLD, str(m)], name=f"hold{i}").validate())
           for i, m in enumerate(mibs)]
    log = tmp / "jobs" / "logs"

    def ready(jid: str) -> bool:
        p = log / f"{jid}.log"
        return p.exists() and "ready" in p.read_text()

    assert await until(lambda: all(ready(j.id) for j in out), 60)
    return out


def test_a_job_without_a_checkpoint_is_planned_at_the_memory_it_holds(tmp_path: Path) -> None:
    async def main() -> None:
        async with planner(tmp_path) as (jobs, comp):
            big, small = await holding(jobs, tmp_path, 300, 1)
            assert comp.checkpoints.ckpt_bytes(big) >= 300 * MB  # what it holds, not 64 MiB
            assert comp.checkpoints.ckpt_bytes(small) == DEFAULT_CKPT_BYTES  # at least the default

            assert big.ckpt_dir is not None
            jobkit.Checkpointer(job_id=big.id, ckpt_dir=big.ckpt_dir, install_signal=False).save(
                b"x" * (3 * MB), step=1)
            assert comp.ckpt is not None
            await comp.ckpt.verify_new()  # the driver's round (every poll_s): its size is its verified manifest's
            size = comp.checkpoints.ckpt_bytes(big)
            assert 3 * MB <= size < 4 * MB  # its checkpoint's size, once it has one

            await jobs.stop(big.id, "test")
            assert await until(lambda: not big.active, 30)
            for p in jobkit.list_checkpoints(big.ckpt_dir):
                for f in p.iterdir():
                    f.unlink()
                p.rmdir()
            comp.ckpt.round()  # the driver's next round forgets the ended job
            assert comp.checkpoints.ckpt_bytes(big) == DEFAULT_CKPT_BYTES  # ended: no memory to go by

    asyncio.run(main())


def test_a_gpu_job_without_a_checkpoint_is_planned_with_the_gpu_memory_its_processes_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU job's state is mostly in GPU memory, which its cgroup does not count: planned at
    64 MiB (its cgroup holds a few), a job holding GBs on its GPU had its final checkpoint asked
    for too late for the transfer, as the 1 GiB CPU job above was. Now NVML's memory of the
    job's processes (those in its cgroup) is added. This machine has no GPU: NVML is the fake
    here (``gpus.nvml_process_memory``, which a GPU machine's tests check against the driver,
    tests/gpu/test_nvml_device.py); the job, its cgroup and its pids are real."""
    from laminar.runtime import gpus

    nvml_calls: list[int] = []

    async def main() -> None:
        async with planner(tmp_path) as (jobs, comp):
            gpu, cpu = await holding(jobs, tmp_path, 1, 1)
            gpu.gpus = [0]  # what its placement gave it (the fake GPU below)

            def fake_nvml() -> dict[int, int]:  # the fake GPU: 3 GiB for the GPU job's process
                nvml_calls.append(1)
                return {gpu.pid: 3 << 30, 999_999: 5 << 30}

            monkeypatch.setattr(gpus, "nvml_process_memory", fake_nvml)
            comp.checkpoints._gpu_mem_at = -math.inf  # (the watch's round at start looked: no GPU job then)
            await comp.checkpoints.tick(time.time())  # the watch's round: NVML read in a worker thread
            assert len(nvml_calls) == 1
            size = comp.checkpoints.ckpt_bytes(gpu)
            assert 3 << 30 <= size < (3 << 30) + 64 * MB, size  # its GPU memory, not another pid's
            assert comp.checkpoints.ckpt_bytes(cpu) == DEFAULT_CKPT_BYTES  # no GPU
            assert len(nvml_calls) == 1  # the plan reads the last round's figures, never NVML itself

            await comp.checkpoints.tick(time.time())
            assert len(nvml_calls) == 1  # not read again within GPU_MEM_EVERY_S
            comp.checkpoints._gpu_mem_at = -math.inf
            monkeypatch.setattr(gpus, "nvml_process_memory", lambda: {})  # NVML unreadable
            await comp.checkpoints.tick(time.time())
            assert comp.checkpoints.ckpt_bytes(gpu) == DEFAULT_CKPT_BYTES  # the cgroup's alone, as before

            assert gpu.ckpt_dir is not None  # once it has checkpointed, NVML is not read at all
            jobkit.Checkpointer(job_id=gpu.id, ckpt_dir=gpu.ckpt_dir, install_signal=False).save(b"w" * MB, step=1)
            assert comp.ckpt is not None
            await comp.ckpt.verify_new()  # the driver's round: the checkpoint listed and checked
            comp.checkpoints._gpu_mem_at = -math.inf
            monkeypatch.setattr(gpus, "nvml_process_memory", fake_nvml)
            await comp.checkpoints.tick(time.time())
            assert len(nvml_calls) == 1 and MB <= comp.checkpoints.ckpt_bytes(gpu) < 2 * MB

    asyncio.run(main())
