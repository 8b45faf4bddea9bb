"""Replica keys no keeper ever named go after ``replica_orphan_s`` (ReclaimComponent's replica GC
round), unless a local job uses them, a keeper names them, or they are younger.

Real pieces: the component on a real SQLite store, its real Receiver on loopback, real jobkit
checkpoints sent with the real ``send_checkpoint`` and real ``keeper``/``release`` control
messages (``Source`` from test_replica_gc). Stand-ins, named as such: the zone (``FakeZone``) and
the job manager (``Jobs``: the local jobs the GC asks about). A key's age is made the way time
makes it: its files' modification times are set back (``os.utime``, links not followed).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

from jobrig import until
from test_replica_gc import Source, names, started

from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec


def age(path: Path, secs: float) -> None:
    """Sets the modification time of ``path`` and everything under it ``secs`` back (links as links)."""
    t = time.time() - secs
    for top, dirs, files in os.walk(path, followlinks=False):
        for n in dirs + files:
            os.utime(os.path.join(top, n), (t, t), follow_symlinks=False)
    os.utime(path, (t, t), follow_symlinks=False)


def row(agent: SimpleNamespace, key: str) -> object:
    return agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()


def test_keys_no_keeper_named_go_after_the_orphan_age_unless_used_kept_or_young(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data").write_bytes(b"not the agent's")

    async def main() -> None:
        agent, comp = await started(tmp_path)
        comp.s["replica_keeper_check_s"] = 0  # the stale-keeper question is another test's
        try:
            base = comp.root / "checkpoints"  # type: ignore[operator]
            orphan = float(comp.s["replica_orphan_s"])
            assert orphan == 21600.0  # the documented default
            lost = Source(tmp_path, comp, 3, "n3-job-7")  # its keeper never came
            for step in (1, 2):
                await lost.send(step)
            young = Source(tmp_path, comp, 3, "n3-job-8")  # sent just now, its keeper may still come
            await young.send(1)
            used = Source(tmp_path, comp, 3, "n3-job-9")  # a local job was handed over resuming from it
            p = await used.send(4)
            agent.jobs.jobs.append(SimpleNamespace(id="job-2", state="running", ended=None,
                                                   spec=JobSpec(["train"], resume_from=str(p)), origin=JobOrigin(resume_given=str(p))))
            kept = Source(tmp_path, comp, 2, "n2-job-1")  # a keeper names it: never this rule's
            await kept.send(5)
            await kept.ctl("keeper", "ckpt-5")
            partial = Source(tmp_path, comp, 3, "n3-job-10")  # an old commit temporary is the endpoint's
            await partial.send(1)
            (base / "n3-job-10" / ".tmp-ckpt-2").mkdir()
            (base / "n9-job-1").symlink_to(outside, target_is_directory=True)
            for k in ("n3-job-7", "n3-job-9", "n2-job-1", "n3-job-10", "n9-job-1"):
                age(base / k, orphan + 60)
            age(outside, orphan + 60)

            comp.replicas.tick(time.time(), force=True)
            assert await until(lambda: not (base / "n3-job-7").exists()), names(base / "n3-job-7")
            assert await until(lambda: names(base / "n3-job-10") == [".tmp-ckpt-2"]), names(base / "n3-job-10")
            assert names(base / "n3-job-8") == ["ckpt-1"]
            assert names(base / "n3-job-9") == ["ckpt-4"]
            assert names(base / "n2-job-1") == ["ckpt-5"]
            assert (base / "n9-job-1").is_symlink() and names(outside) == ["data"]
            assert await until(lambda: names(comp.root / "replica-gc") == [])  # type: ignore[operator]
            assert comp.counts["replica_gc_ckpts"] == 3

            # the local job ended: its replica goes once old; the young key ages too
            agent.jobs.jobs[0].state = "exited"
            age(base / "n3-job-8", orphan + 60)
            age(base / "n3-job-9", orphan + 60)
            comp.replicas.tick(time.time(), force=True)
            assert await until(lambda: not (base / "n3-job-8").exists() and not (base / "n3-job-9").exists())
            # a keeper coming now for a removed key is a new keeper of a new checkpoint: nothing breaks
            await lost.send(3)
            await lost.ctl("keeper", "ckpt-3")
            assert names(base / "n3-job-7") == ["ckpt-3"] and row(agent, "n3-job-7") is not None
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())
