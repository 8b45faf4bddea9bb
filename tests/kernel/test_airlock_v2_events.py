"""Airlock keeps watching a v2 ``memory.events.local`` after it changes (and a read, the one
way to tell a change from a removal, fails once its cgroup is removed).

kernfs reports every change of such a file (``kernfs_notify``) as POLLPRI|POLLERR, the same
mask as for a removed cgroup. Airlock took every POLLERR for a removed cgroup: on a pure-v2
host its ``memory.events`` source of the budget was dropped at the budget's first event
("reports an error (its cgroup is gone); no longer watched"), and Airlock never heard from it
again. Seen on a real v2 node (an H100 machine lent to the session, kernel 6.18); this VM's
memory controller is v1, so the test drives Airlock's real poller with a file of the same kind
that this host's cgroup2 has, ``cgroup.events`` (its ``populated`` counter moves when a process
enters and leaves), registered as a v2 events source of a class.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import select
import subprocess
from pathlib import Path

import pytest
from jobrig import until
from test_airlock_storm import storm_rig

from laminar.airlock.cgroups import detect
from laminar.airlock.manager import _events_of

# serial: its memory pressure is felt machine-wide (node PSI, MemAvailable); run alone (Makefile)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]


def test_a_changed_v2_events_file_is_still_watched_and_a_removed_one_is_dropped(tmp_path: Path) -> None:
    h = detect()
    d = h.unified / f"laminar-t-ev-{secrets.token_hex(3)}"
    d.mkdir()
    proc: subprocess.Popen[bytes] | None = None

    async def main() -> None:
        nonlocal proc
        async with storm_rig(tmp_path, budget_mb=256) as r:
            a = r.airlock
            assert a is not None and a._poller is not None
            fd = os.open(d / "cgroup.events", os.O_RDONLY)
            try:
                os.read(fd, 4096)  # read once: the kernel notifies changes after this read
                a._poller.add(fd, "v2events:lm-t-class")
                a._v2_counts[fd] = {"populated": 0, "frozen": 0}

                # the kernel's side: a change is POLLERR|POLLPRI, as a removal would be
                proc = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: (d / "cgroup.procs").write_text(
                    str(os.getpid())))
                probe = select.epoll()
                probe.register(fd, select.EPOLLPRI | select.EPOLLERR)
                ready = dict(probe.poll(5))
                probe.close()
                assert ready.get(fd, 0) & select.EPOLLERR and ready[fd] & select.EPOLLPRI, ready

                # Airlock's side: its loop read the change and kept the source
                assert await until(lambda: a._v2_counts.get(fd, {}).get("populated") == 1, 5), a._v2_counts.get(fd)
                assert a._poller.tags.get(fd) == "v2events:lm-t-class", "a changed events file was dropped"
                proc.kill()
                proc.wait()
                assert await until(lambda: a._v2_counts.get(fd, {}).get("populated") == 0, 5), a._v2_counts.get(fd)
                assert a._poller.tags.get(fd) == "v2events:lm-t-class"

                # removed: the read that tells a change from a removal fails (ENODEV), so a wake-up
                # of a removed cgroup's file drops the source
                d.rmdir()
                with pytest.raises(OSError):
                    _events_of(fd)
            finally:
                a._poller.remove(fd)
                os.close(fd)

    try:
        asyncio.run(main())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if d.exists():
            d.rmdir()
