"""A pruned job's log and checkpoint directory go with its record (laminar.runtime.jobs
``Pruner._remove_files``, in a thread of its own): never following a link, and never the
directory a job that has not ended resumes from."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

from laminar.runtime.jobs import JobManager
from laminar.runtime.prune import remove_job_files


def _job_files(state: Path, job_id: str) -> None:
    (state / "logs").mkdir(parents=True, exist_ok=True)
    (state / "logs" / f"{job_id}.log").write_text("log")
    d = state / "ckpt" / job_id / "ckpt-1"
    d.mkdir(parents=True)
    (d / "state.bin").write_bytes(b"x" * 100)


def test_removed_without_following_links(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _job_files(state, "job-1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the job's")
    os.symlink(outside, state / "ckpt" / "job-1" / "link")  # the owner's link out of its directory
    remove_job_files(state, "job-1")
    assert not (state / "logs" / "job-1.log").exists() and not (state / "ckpt" / "job-1").exists()
    assert (outside / "keep.txt").read_text() == "not the job's"
    remove_job_files(state, "../etc")  # not a job id: nothing
    remove_job_files(state, "job-9")  # gone already: nothing, no error


def test_a_live_jobs_resume_directory_is_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for i in (1, 2, 3):
        _job_files(state, f"job-{i}")
    jm = JobManager(store=object(), state_dir=state)
    jm.jobs["job-7"] = SimpleNamespace(spec=SimpleNamespace(resume_from=str(state / "ckpt" / "job-2" / "ckpt-1")))
    jm.pruner._remove_files(["job-1", "job-2", "job-3"])
    deadline = time.monotonic() + 10
    while (state / "ckpt" / "job-3").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (state / "ckpt" / "job-1").exists() and not (state / "ckpt" / "job-3").exists()
    assert (state / "ckpt" / "job-2" / "ckpt-1" / "state.bin").exists() and (state / "logs" / "job-2.log").exists()
