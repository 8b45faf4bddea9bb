"""Done replica rows whose directory is gone are deleted after ``replica_row_keep_s``
(ReclaimComponent's replica GC round), so ``migrate_replicas`` holds the live replicas and recent
history only; rows of keys still held, kept or waiting stay.

Real pieces: the component on a real SQLite store, its real Receiver on loopback, real jobkit
checkpoints sent with the real ``send_checkpoint`` and real ``keeper``/``release`` control
messages (``Source`` from test_replica_gc). Stand-ins, named as such: the zone (``FakeZone``) and
the job manager (``Jobs``: the local jobs the GC asks about). Ages are measured against the
round's ``now`` (the retention is a day).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from jobrig import until
from test_replica_gc import Source, names, started

from laminar.policy import custody
from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec


def row(agent: SimpleNamespace, key: str) -> object:
    return agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()


def test_done_rows_whose_directory_is_gone_are_deleted_after_the_retention(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        comp.s["replica_keeper_check_s"] = 0
        try:
            keep = float(comp.s["replica_row_keep_s"])
            assert keep == 86400.0  # the documented default
            base = comp.root / "checkpoints"  # type: ignore[operator]
            gone = Source(tmp_path, comp, 2, "n2-job-1")  # released: its replicas go, then its row
            await gone.send(5)
            await gone.ctl("keeper", "ckpt-5")
            used = Source(tmp_path, comp, 3, "n3-job-2")  # handed over: a local job runs from it
            p = await used.send(6)
            await used.ctl("keeper", "ckpt-6")
            agent.jobs.jobs.append(SimpleNamespace(id="job-4", state="running", ended=None,
                                                   spec=JobSpec(["train"], resume_from=str(p)), origin=JobOrigin(resume_given=str(p))))
            comp.takeover.set_replica("n3-job-2", custody.Event.HAND_OVER, "job-4")
            live = Source(tmp_path, comp, 3, "n3-job-3")  # still kept
            await live.send(1)
            await live.ctl("keeper", "ckpt-1")
            (base / "n3-job-3" / "ckpt-1").rename(tmp_path / "moved-away")  # even with its directory gone
            (base / "n3-job-3").rmdir()
            await gone.ctl("release")
            assert await until(lambda: not (base / "n2-job-1").exists())
            with agent.store.tx() as db:  # the release came while it waited for room: its retry row too
                db.execute("INSERT INTO migrate_retry VALUES ('n2-job-1', 1, 0, 'w', 'e', 0)")

            comp.replicas.tick(time.time(), force=True)  # within the retention: the row stays
            assert row(agent, "n2-job-1") is not None
            comp.replicas.tick(time.time() + keep + 60, force=True)
            assert row(agent, "n2-job-1") is None
            assert agent.store.db.execute("SELECT 1 FROM migrate_retry WHERE key='n2-job-1'").fetchone() is None
            assert row(agent, "n3-job-2")["state"] == "handed-over"  # type: ignore[index]
            assert row(agent, "n3-job-3")["state"] == "keeping"  # type: ignore[index]
            assert names(base / "n3-job-2") == ["ckpt-6"]
            assert comp.counts["replica_rows_pruned"] == 1
            # once its job ended, the handed-over key's replica goes, then (after the retention) its row
            agent.jobs.jobs[0].state = "exited"
            comp.replicas.tick(time.time(), force=True)
            assert await until(lambda: not (base / "n3-job-2").exists())
            comp.replicas.tick(time.time() + keep + 60, force=True)
            assert row(agent, "n3-job-2") is None
            n = agent.store.db.execute("SELECT count(*) AS n FROM migrate_replicas").fetchone()["n"]
            assert n == 1  # only the live keeper is left
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())
