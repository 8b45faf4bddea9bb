"""A reclaim's wait for the archive (``StoppedCopies.publish_until``) on archive storage that
hangs in the middle of the copy: the wait ends at its deadline with an error naming the archive
and the time waited, while the copy still waits on the storage in the archive's thread. When the
storage answers, a copy given up (a reclaim's own, :class:`ArchiveWait`) runs to its end and
publishes nothing, not even its temporaries; a reclaimed keeper's copy (``late_ok``) is published
late, and said with an event (``archived-late``).

The hung storage is real: a writable FUSE mount (tests/fuserig.py) whose server stops itself at
the copy's temporary directory (:meth:`fuserig.EioMount.hang_at`), then let go.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from archiverig import record, zone_of
from fuserig import eio_mount
from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer
from laminar.migrate.errors import MigrateError
from laminar.migrate.reclaim import ReclaimComponent

pytestmark = pytest.mark.kernel

WAIT_S = 60.0  # a bound for the suite only


async def until(cond: Any, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("late_ok", [False, True], ids=["given-up", "late-ok"])
def test_a_wait_for_a_hung_archive_ends_and_its_late_copy_publishes_only_where_wanted(
        tmp_path: Path, late_ok: bool) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    ckpt = Checkpointer(job_id="lm-t-given-up", ckpt_dir=tmp_path / "ck", install_signal=False).save(
        b"weights" * 4096, step=7)
    events: list[tuple[str, dict[str, Any]]] = []
    key = "n1-lm-t-job"
    with eio_mount(backing, writable=True) as fs:
        c = ReclaimComponent()  # node 1's archive work, no agent around it
        c.agent = standin_agent(MigrateAgent, zone=zone_of(1))  # (it holds the zone's key: its records are signed)
        c.s = {"archive_dir": str(fs.path)}
        c._emit = lambda message, **fields: events.append((message, fields))  # type: ignore[method-assign]

        async def run() -> str:
            fs.hang_at(".tmp-")
            with pytest.raises(MigrateError) as err:
                await c.archive.stopped.publish_until(f"archiving {key}", key, ckpt, record(key), time.monotonic() + 0.5,
                                       late_ok=late_ok)
            assert fs.hung_at  # the copy began and waits on the storage, in the archive's thread
            assert c.archive.lane.busy is not None and c.archive.lane.busy[0] == f"archiving {key}"
            fs.heal()
            await until(lambda: c.archive.lane.busy is None and c.archive.lane.queued == 0, "the copy in hand to end")
            if late_ok:
                await until(lambda: events, "the late copy's event")
            return str(err.value)

        try:
            msg = asyncio.run(run())
        finally:
            fs.heal()
            c.archive.lane.close()
    assert msg.startswith(f"archive {fs.path} did not answer in ") and f"(archiving {key})" in msg, msg
    left = sorted(p.name for p in (backing / key).iterdir())
    if late_ok:
        assert left == ["ckpt-7", "guard.json"], left
        assert [f.get("phase") for _, f in events] == ["archived-late"], events
    else:
        assert left == [], left  # no record, no copy, no temporary
        assert events == []
