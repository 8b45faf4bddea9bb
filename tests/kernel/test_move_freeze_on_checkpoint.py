"""A move freezes its job as soon as the final checkpoint is there, before the check that reads
it whole: real processes in real cgroups.

Steps a job takes after its final checkpoint are thrown away when it moves. The move froze the
job only after the agent had checked that checkpoint (every byte hashed: about 0.9 s per GiB
here, seconds for a large model), so the job trained on, for nothing, on the cores the check
needed; a 1 GiB job between two real agents lost 46 steps of 20 ms (bench/move.py). Now the
job is frozen when the checkpoint appears. A final checkpoint that then fails its check ends
the wait at once (a frozen job saves no other): the last verified checkpoint is moved, and a
move that fails thaws the job as before.

The job manager, the cgroups and the job's process are real; the job's "save" is the test's
(jobkit's Checkpointer into the job's checkpoint directory, when the agent asks); the zone is
the lone stand-in of test_replica_gc_move_freeze, so the move fails with "no destination fits"
after its checkpoint is chosen and the job frozen.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from jobrig import job_manager, until
from test_replica_gc_move_freeze import component, sleeper_with_checkpoint

from laminar.jobkit import Checkpointer
from laminar.migrate import checkpoints as C

pytestmark = pytest.mark.kernel


def saves_when_asked(jobs: Any, job: Any, data: bytes, step: int) -> list[str]:
    """The job's checkpoint handler, played by the test: a new checkpoint when the agent asks;
    returns the list of the asks (job ids)."""
    asks: list[str] = []

    def request(j: Any) -> bool:
        asks.append(j.id)
        Checkpointer(job_id=j.id, ckpt_dir=j.ckpt_dir, install_signal=False).save(data, step=step)
        return True

    jobs.request_checkpoint = request
    return asks


def test_the_job_is_frozen_while_its_final_checkpoint_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bool]] = []
    real = C.build_manifest

    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            job = await sleeper_with_checkpoint(jobs, "lm-t-mfz-run")

            def checked(p: Path, *a: Any, **kw: Any) -> Any:
                seen.append((p.name, bool(job.cgroup.frozen())))
                return real(p, *a, **kw)

            monkeypatch.setattr(C, "build_manifest", checked)
            asks = saves_when_asked(jobs, job, b"weights at step 9", 9)
            c = component(jobs)
            mv = await asyncio.wait_for(c.mover.move_now(job, "test: freeze before the check"), 120)
            assert mv.phase == "failed" and "no destination fits" in mv.error, mv
            assert asks == [job.id]  # one final checkpoint asked for, once
            assert mv.ckpt == "ckpt-9"  # the final checkpoint was the one chosen
            assert await until(lambda: not job.cgroup.frozen(), 10), "the failed move left the job frozen"

    asyncio.run(main())
    assert seen == [("ckpt-9", True)], f"the check ran on a job not yet frozen: {seen}"


def test_a_final_checkpoint_that_fails_its_check_ends_the_wait_and_the_last_one_is_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    async def main() -> None:
        async with job_manager(tmp_path) as jobs:
            job = await sleeper_with_checkpoint(jobs, "lm-t-mfz-bad")  # ckpt-5, verified

            def request(j: Any) -> bool:
                bad = Checkpointer(job_id=j.id, ckpt_dir=j.ckpt_dir, install_signal=False).save(b"x" * 4096, step=9)
                (bad / "state.bin").write_bytes(b"y" * 4096)  # fails its manifest's SHA-256
                return True

            jobs.request_checkpoint = request
            c = component(jobs)
            c.s["ckpt_wait_s"] = 3600.0  # a frozen job saves no other: this is never waited out
            c._emit = lambda msg, **kw: events.append(msg)  # type: ignore[method-assign]
            frozen_during: list[bool] = []
            real_rank = c.mover.rank_for

            def rank(*a: Any, **kw: Any) -> Any:
                frozen_during.append(bool(job.cgroup.frozen()))
                return real_rank(*a, **kw)

            c.mover.rank_for = rank  # type: ignore[method-assign]
            mv = await asyncio.wait_for(c.mover.move_now(job, "test: a bad final checkpoint"), 120)
            assert mv.phase == "failed" and "no destination fits" in mv.error, mv
            assert mv.ckpt == "ckpt-5", mv  # the last verified one, not the corrupt final one
            assert frozen_during == [True]
            assert await until(lambda: not job.cgroup.frozen(), 10), "the failed move left the job frozen"

    asyncio.run(main())
    assert any("failed its check; moving the last one" in e for e in events), events
