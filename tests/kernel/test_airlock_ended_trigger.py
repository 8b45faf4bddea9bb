"""A job that ends is not a pressure signal: its PSI trigger does not fire once its cgroup is gone.

Airlock keeps a PSI trigger open on each job's ``memory.pressure`` and closes it at its next
sync (once a second). When a job ended and its cgroup was removed, the kernel reports the
trigger's file as POLLERR|POLLPRI (kernfs: the node is gone) for as long as it stays open, and
level-triggered epoll repeats that on every loop round: Airlock took each for a memory stall,
so for up to a second after any job ended the node was at pressure HIGH (the ladder suspended
the lowest-value running job for it) and the agent's loop spun. Now an errored job trigger is
closed at once and not counted. Real cgroups, processes and PSI triggers.
"""

from __future__ import annotations

import asyncio
import select
from pathlib import Path

import pytest
from jobrig import airlock_rig, running

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]


def test_the_trigger_of_an_ended_job_is_not_a_stall(tmp_path: Path) -> None:
    async def main() -> None:
        async with airlock_rig(tmp_path) as (jobs, al, _):
            job = await running(jobs, "lm-t-ends")
            al.sync_job_triggers()
            trig = al._job_triggers.get(job.id)
            if trig is None:
                pytest.skip("no PSI trigger on the job's memory.pressure on this host")
            fd = trig.fileno()
            # Airlock's poller is read by hand below (not by the loop), so each step can be seen.
            assert al._poller is not None
            asyncio.get_running_loop().remove_reader(al._poller.fileno())
            try:
                await jobs.stop(job.id, "ended", grace_s=1)
                assert not job.cgroup.exists()
                # What the kernel says about the open trigger of a removed cgroup (the premise).
                assert any(f == fd for f, _ in al._poller.ready()), "the removed cgroup's trigger is not ready"
                probe = select.epoll()
                probe.register(fd, select.EPOLLPRI | select.EPOLLERR)
                mask = dict(probe.poll(0)).get(fd, 0)
                probe.close()
                assert mask & select.EPOLLERR, mask
                # Airlock reads it: with nothing else ready, no stall may be recorded, and it is dropped.
                others = [t for f, t in al._poller.ready() if f != fd]
                al.last_stall = float("-inf")
                al._on_poller()
                if not others:
                    assert al.last_stall == float("-inf"), "an ended job's trigger was taken for a memory stall"
                assert all(f != fd for f, _ in al._poller.ready()), "the ended job's trigger still fires"
                assert job.id not in al._job_triggers
            finally:  # stop() removes the reader it added
                asyncio.get_running_loop().add_reader(al._poller.fileno(), al._on_poller)

    asyncio.run(main())
