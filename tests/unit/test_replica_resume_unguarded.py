"""A job of a user other than root handed over with ``resume_from`` naming a replica this node
received is started only from its owner's copy (``<state_dir>/resume/<key>/ckpt-<n>/``), never
from ``xfer/`` (root's alone: the job could not read it), and never from a checkpoint that does
not verify. The owner is the one the replica's guard named: every source guards before it hands
over. A hand-over that names a replica no guard here named the owner of (the guard never came,
or a placement naming another job's replica) is refused for a job of a user other than root:
given ``xfer/`` the job could not resume, and a copy made on the hand-over's word would give
whoever places a job naming the replica another user's checkpoint.

Real pieces: the migrate component on a real SQLite store, its real Receiver on loopback, real
jobkit checkpoints sent with the real ``send_checkpoint``, real authenticated ``guard`` control
messages, a real other user (tests/userrig.py) whose job, the real jobkit ``Checkpointer.resume()``
in the system's python, runs as that user with ``LAMINAR_RESUME_FROM`` set to what
``check_resume`` (the zone hand-over's call) gave. Stand-ins (from test_replica_gc): the zone
and the job manager.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_replica_gc import KEY, K, Source, started
from userrig import User, local_user, read_as

from laminar.migrate.transfer import send_control

REPO = Path(__file__).resolve().parents[2]
# the job: what a training loop does at start with jobkit (says the step and state it resumed)
JOB = ("import json, sys; sys.path.insert(0, sys.argv[1]); from laminar.jobkit import Checkpointer; "
       "ck = Checkpointer(job_id='j', ckpt_dir=sys.argv[2], install_signal=False); state = ck.resume(); "
       "print(json.dumps({'step': ck.resumed_step, 'state': state.decode() if state else None}))")


@pytest.fixture
def base() -> Iterator[Path]:
    """A state directory the job's user can traverse (pytest's tmp is root's alone), with jobkit
    under ``lib/`` where that user can read it (the checkout may be under a directory closed to
    other users: a fresh clone under a 0700 temporary directory)."""
    d = Path(tempfile.mkdtemp(prefix="lm-t-unguarded-", dir="/tmp"))
    try:
        os.chmod(d, 0o711)
        lib = d / "lib" / "laminar"
        lib.mkdir(parents=True)
        (lib / "__init__.py").write_text("")
        shutil.copy(REPO / "agent" / "laminar" / "jobkit.py", lib / "jobkit.py")
        for p in (d / "lib", lib):
            os.chmod(p, 0o755)
        for f in lib.iterdir():
            os.chmod(f, 0o644)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def resume_as(user: User, resume_from: str, ckpt_dir: Path) -> dict[str, object] | str:
    """The job, run as ``user`` with LAMINAR_RESUME_FROM=``resume_from`` (jobkit from the ``lib/``
    beside ``ckpt_dir``): what it resumed (its JSON line), or the last line of its error output."""
    r = subprocess.run(["/usr/bin/python3", "-c", JOB, str(ckpt_dir.parent / "lib"), str(ckpt_dir)],
                       env={"PATH": "/usr/bin:/bin", "LAMINAR_RESUME_FROM": resume_from},
                       user=user.uid, group=user.gid, extra_groups=list(user.groups), capture_output=True,
                       text=True, timeout=60, cwd="/")
    return json.loads(r.stdout) if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


async def guard(src: Source, ckpt: str, user: User) -> None:
    body = {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": ckpt,
            "request": {"spec": {"command": ["train"]}, "owner_uid": user.uid, "owner_gid": user.gid}}
    await send_control("127.0.0.1", src.comp.port, KEY, "guard", body, zone=1, node="2")


def test_a_hand_over_without_its_guard_is_refused_for_another_users_job_and_resumes_once_guarded(
        base: Path) -> None:
    with local_user("ungd") as user:
        async def main() -> None:
            agent, comp = await started(base)
            try:
                d = comp.root / "checkpoints" / K  # type: ignore[operator]
                replica = d / "ckpt-5"
                src = Source(base, comp, 2, K)
                await src.send(5)
                mine = base / "job-ckpts"
                mine.mkdir()
                os.chown(mine, user.uid, user.gid)
                # what the job would have been given before: the replica itself, which it cannot read
                assert read_as(user, replica / "MANIFEST.json") == "Permission denied"
                assert "Permission denied" in str(resume_as(user, str(replica), mine))

                # no guard came: refused for the user's job (and nothing copied for it)
                with pytest.raises(ValueError, match=f"no guard of {K} held here named its job's owner: "
                                                     f"a job of uid {user.uid} is not given it"):
                    await asyncio.to_thread(comp.check_resume, str(replica), user.uid)
                # the same, reached through a path that is not the replica's own spelling
                with pytest.raises(ValueError, match="is not given it"):
                    await asyncio.to_thread(comp.check_resume, f"{replica}/../ckpt-5", user.uid)
                assert not (base / "resume").exists()
                # root's job reads xfer/: the replica itself
                assert await asyncio.to_thread(comp.check_resume, str(replica), 0) == str(replica)

                # the guard names the user: the hand-over gives the job its copy, and it resumes
                await guard(src, "ckpt-5", user)
                got = await asyncio.to_thread(comp.check_resume, str(replica), user.uid)
                assert got == str(base / "resume" / K / "ckpt-5"), got
                kd = os.lstat(base / "resume" / K)
                assert (kd.st_uid, kd.st_gid, stat.S_IMODE(kd.st_mode)) == (user.uid, user.gid, 0o500)
                assert resume_as(user, got, mine) == {"step": 5, "state": "weights-5"}
            finally:
                await comp.stop()
                agent.store.db.close()

        asyncio.run(main())


def test_a_guarded_replica_that_no_longer_verifies_is_refused_and_nothing_is_copied(base: Path) -> None:
    with local_user("ungc") as user:
        async def main() -> None:
            agent, comp = await started(base)
            try:
                d = comp.root / "checkpoints" / K  # type: ignore[operator]
                src = Source(base, comp, 2, K)
                await src.send(6)
                await guard(src, "ckpt-6", user)
                f = next(p for p in (d / "ckpt-6").iterdir() if p.name.startswith("state"))
                os.chmod(f, 0o600)
                f.write_bytes(b"tampered-")  # after its commit: it no longer matches what was verified
                with pytest.raises(ValueError, match="not restorable"):
                    await asyncio.to_thread(comp.check_resume, str(d / "ckpt-6"), user.uid)
                assert not (base / "resume" / K / "ckpt-6").exists()
            finally:
                await comp.stop()
                agent.store.db.close()

        asyncio.run(main())
