"""A member's local job takes its multi-node job's id (JobManager.submit's ``job_id``), and the
origin reserves that id's number from its own job numbers (JobManager.reserve_multinode_id):
real jobs in real cgroups (tests/jobrig.py), as root."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from jobrig import job_manager, until

from laminar.runtime.checks import SubmitChecks
from laminar.runtime.spec import JobError, JobSpec, ResumeFromError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="real jobs in cgroups need root")


def test_given_ids_numbers_reserved_and_everything_that_reads_ids(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jm:
            a = await jm.submit(JobSpec(command=["sleep", "30"]))
            assert a.id == "job-1"
            mid = jm.reserve_multinode_id(3)
            assert mid == "job-2-n3"  # the next number of this node's sequence
            b = await jm.submit(JobSpec(command=["sleep", "30"]))
            assert b.id == "job-3"  # never the reserved one
            assert jm.reserve_multinode_id(3) == "job-4-n3"
            m = await jm.submit(JobSpec(command=["sleep", "30"]), job_id="job-9-n5")  # another origin's job
            assert m.id == "job-9-n5" and m.num == 5  # it takes this node's next number all the same
            assert m.ckpt_dir == tmp_path / "ckpt" / "job-9-n5"
            assert await until(lambda: m.state == "running")
            assert jm.get("job-9-n5") is m and jm.get("5") is m
            assert jm.table.pruned("job-9-n5") is False  # never read as a number
            for bad in ("job-10", "job-7-n", "../x", "job-7-n3/..", "job-1-n1-n1"):
                with pytest.raises(JobError, match="expected a multi-node job's id"):
                    await jm.submit(JobSpec(command=["true"]), job_id=bad)
            with pytest.raises(JobError, match="has it already"):
                await jm.submit(JobSpec(command=["true"]), job_id="job-9-n5")
            await jm.stop("job-9-n5", "test")
            with pytest.raises(JobError, match="has it already"):  # an ended one's id is not given again
                await jm.submit(JobSpec(command=["true"]), job_id="job-9-n5")
            listed = [j.id for j in jm.list()]
            assert listed == ["job-1", "job-3", "job-9-n5"]
            # a local user may resume from a checkpoint of their own member job
            (tmp_path / "ckpt" / "job-9-n5" / "ckpt-1").mkdir(parents=True, exist_ok=True)
            checks = SubmitChecks(jm)
            own = JobSpec(command=["true"], resume_from=str(tmp_path / "ckpt" / "job-9-n5" / "ckpt-1"))
            checks.resume_from(own, 0)
            jm.store.db.execute("UPDATE jobs SET owner_uid=1234 WHERE id='job-9-n5'")
            checks.resume_from(own, 1234)
            with pytest.raises(ResumeFromError, match="job-9-n5 is not a job of uid 4321"):
                checks.resume_from(own, 4321)
            for j in (a, b):
                await jm.stop(j.id, "test")

    asyncio.run(main())


def test_reserved_numbers_are_kept_in_the_store(tmp_path: Path) -> None:
    async def main() -> None:
        async with job_manager(tmp_path) as jm:
            assert jm.reserve_multinode_id(1) == "job-1-n1"
            with pytest.raises(JobError, match="node -1"):
                jm.reserve_multinode_id(-1)
            store = jm.store
            from laminar.runtime.prune import NUM_RESERVED_KEY

            assert store.get_meta(NUM_RESERVED_KEY) == 1
            j = await jm.submit(JobSpec(command=["true"]))
            assert j.id == "job-2"

    asyncio.run(main())
