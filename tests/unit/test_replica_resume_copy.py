"""A job of a user other than root resumes from a replica through its own view of it
(``<state_dir>/resume/<key>/ckpt-<n>/``), since ``xfer/`` is root's alone: what the hand-over's
``check_resume`` and a keeper's take-over here give the job, what the replica GC keeps for it,
and when the view itself goes.

Real pieces: the migrate component on a real SQLite store, its real Receiver on loopback, real
jobkit checkpoints sent with the real ``send_checkpoint``, real authenticated ``keeper`` and
``release`` control messages. Stand-ins (from test_replica_gc): the zone and the job manager.
tests/cluster/test_replica_resume_owner.py runs the whole path between two real agents, with a
job of a real other uid.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

from jobrig import until
from test_replica_gc import KEY, K, Source, names, started

from laminar.migrate.constants import RESUME_KEEP_S
from laminar.migrate.transfer import send_control
from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec

UID = 65534


async def keeper(src: Source, ckpt: str, owner: int) -> None:
    body = {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": ckpt,
            "request": {"spec": {"command": ["train"]}, "owner_uid": owner, "owner_gid": owner}}
    await send_control("127.0.0.1", src.comp.port, KEY, "keeper", body, zone=1, node="2")


def test_another_users_job_resumes_from_its_own_view_which_goes_once_no_job_needs_it(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        try:
            d = comp.root / "checkpoints" / K  # type: ignore[operator]
            src = Source(tmp_path, comp, 2, K)
            await src.send(5)
            await keeper(src, "ckpt-5", UID)
            # one file of the replica only root may read: copied for the owner, never made readable
            secret = next(p for p in (d / "ckpt-5").iterdir() if p.name != "MANIFEST.json" and p.is_file())
            os.chmod(secret, 0o600)

            got = Path(await asyncio.to_thread(comp.check_resume, str(d / "ckpt-5")))
            assert got == tmp_path / "resume" / K / "ckpt-5", got
            kd = os.lstat(got.parent)
            assert (kd.st_uid, kd.st_gid, stat.S_IMODE(kd.st_mode)) == (UID, UID, 0o500)
            assert stat.S_IMODE(os.lstat(tmp_path / "resume").st_mode) == 0o711
            assert stat.S_IMODE(os.lstat(comp.root).st_mode) == 0o700  # type: ignore[arg-type]  # xfer/ stays root's
            assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in (d / "ckpt-5").iterdir())
            for f in got.iterdir():
                st, orig = os.lstat(f), os.lstat(d / "ckpt-5" / f.name)
                assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644 and f.read_bytes() == (d / "ckpt-5" / f.name).read_bytes()
                assert (st.st_ino == orig.st_ino) == (f.name != secret.name), f  # linked, but the secret copied
            assert stat.S_IMODE(os.lstat(secret).st_mode) == 0o600
            # root's own job: the replica itself
            await keeper(src, "ckpt-5", 0)
            assert await asyncio.to_thread(comp.check_resume, str(d / "ckpt-5")) == str(d / "ckpt-5")
            await keeper(src, "ckpt-5", UID)

            # a local job resumes from the view: the replica is kept for it after the release
            job = SimpleNamespace(id="job-4", state="running", ended=None, spec=JobSpec(["train"], resume_from=str(got)), origin=JobOrigin(resume_given=str(got)))
            agent.jobs.jobs.append(job)
            await src.ctl("release")
            comp.replicas.tick(time.time(), force=True)
            await asyncio.sleep(0.3)
            assert names(d) == ["ckpt-5"]
            later = time.time() + RESUME_KEEP_S + 1
            assert comp.replicas.resumes.gc(later) == [] and got.is_dir()  # used: kept however old

            # the job ended: the replica goes at the next round, the view once RESUME_KEEP_S passed
            job.state = "exited"
            comp.replicas.tick(time.time(), force=True)
            assert await until(lambda: not d.exists()), names(d)
            assert comp.replicas.resumes.gc(time.time()) == [] and got.is_dir()  # too new (a hand-over may be starting it)
            assert len(comp.replicas.resumes.gc(later)) == 1 and not got.exists()
            assert comp.replicas.resumes.gc(later) == [] and not got.parent.exists()  # the emptied <key>/ goes too
            assert await until(lambda: names(comp.root / "replica-gc") == [])  # type: ignore[operator]
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())


def test_a_checkpoint_on_another_filesystem_is_copied_for_its_owner(tmp_path: Path) -> None:
    """An archived checkpoint (``archive_dir``: shared storage, another filesystem than the state
    directory; here a directory on /dev/shm, a tmpfs) cannot be hard-linked: it is copied."""
    import shutil
    import tempfile

    from laminar.jobkit import Checkpointer, verify_checkpoint

    other = Path(tempfile.mkdtemp(prefix="lm-t-archive-", dir="/dev/shm"))
    try:
        assert os.stat(other).st_dev != os.stat(tmp_path).st_dev
        ck = Checkpointer(job_id=K, ckpt_dir=other / K, install_signal=False).save(b"weights-9", step=9)

        async def main() -> None:
            agent, comp = await started(tmp_path)
            try:
                got = await asyncio.to_thread(comp.replicas.resumes.copy, ck, UID, UID)
                assert got == tmp_path / "resume" / K / "ckpt-9"
                verify_checkpoint(got)
                for f in got.iterdir():
                    st = os.lstat(f)
                    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644 and st.st_dev != os.stat(ck).st_dev
                kd = os.lstat(got.parent)
                assert (kd.st_uid, stat.S_IMODE(kd.st_mode)) == (UID, 0o500)
            finally:
                await comp.stop()
                agent.store.db.close()

        asyncio.new_event_loop().run_until_complete(main())
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_a_replica_is_only_for_a_job_of_its_owner(tmp_path: Path) -> None:
    """A placement from another user that names this replica as its resume_from is refused: it
    made the agent copy the replica's checkpoint for its owner (disk the other user does not
    pay for) and start a job that could not read it."""
    import pytest

    async def main() -> None:
        agent, comp = await started(tmp_path)
        try:
            d = comp.root / "checkpoints" / K  # type: ignore[operator]
            src = Source(tmp_path, comp, 2, K)
            await src.send(5)
            await keeper(src, "ckpt-5", UID)
            with pytest.raises(ValueError, match=f"replica of a job of uid {UID}: a job of uid 1234"):
                await asyncio.to_thread(comp.check_resume, str(d / "ckpt-5"), 1234)
            assert not (tmp_path / "resume" / K).exists()  # nothing copied for the refused placement
            got = await asyncio.to_thread(comp.check_resume, str(d / "ckpt-5"), UID)
            assert got == str(tmp_path / "resume" / K / "ckpt-5")
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.run(main())
