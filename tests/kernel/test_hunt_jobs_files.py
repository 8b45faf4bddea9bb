"""What a job leaves on the node once it has ended: real cgroups and processes, `JobManager` alone.

An elastic job is told its worker count through a file the agent names in its environment
(``LAMINAR_WORKERS_FILE``, state dir/elastic/<job>.json, written by the loaning component on a
scale). Nothing removed it when the job ended, so one file per elastic job piled up for good.
The job's cgroups (cgroup2, v1 memory and cpu on a hybrid host) must be gone too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from jobrig import job_manager, until

from laminar.runtime.spec import JobSpec

pytestmark = pytest.mark.kernel



def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in raw if e)


@pytest.mark.parametrize("how", ["stopped", "exits"])
def test_an_ended_job_leaves_no_workers_file_and_no_cgroup(tmp_path: Path, how: str) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            go = tmp_path / "lm-t-go"
            argv = ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.1; done"]
            job = await jobs.submit(JobSpec(argv, name="lm-t-elastic", memory_mb=64, cpus=0.5, elastic_min=1,
                                            elastic_max=2).validate())
            assert job.pid is not None
            assert await until(lambda: job.pid in job.cgroup.pids(), 20)
            dirs = job.cgroup.all_dirs()
            assert all(d.is_dir() for d in dirs)
            # what zone.loan does on a scale: write the count where the job's environment says (the
            # environment is applied by the start-up trampoline after the drop: wait for the exec)
            assert await until(lambda: "LAMINAR_WORKERS_FILE" in environ(job.pid), 20)
            workers = Path(environ(job.pid)["LAMINAR_WORKERS_FILE"])
            workers.parent.mkdir(parents=True, exist_ok=True)
            workers.write_text(json.dumps({"workers": 2, "gpus": [], "reason": "test"}))
            if how == "stopped":
                await jobs.stop(job.id, "test", grace_s=1)
            else:
                go.touch()
                await jobs.wait(job.id, 30)
            final = jobs.get(job.id)
            assert final is not None and final.state == ("stopped" if how == "stopped" else "exited"), final
            assert not workers.exists(), f"{workers} left behind"
            assert not [d for d in dirs if d.exists()], "cgroups left behind"

    asyncio.run(main())
