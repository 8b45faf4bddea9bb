"""A job of a user other than root handed over with ``resume_from`` naming a replica this node
received is started only from its owner's copy (``<state_dir>/resume/<key>/ckpt-<n>/``), never
from ``xfer/`` (root's alone: the job could not read it), and never from a checkpoint that does
not verify. The owner is the one the replica's keeper named: every source keeps before it hands
over. A hand-over that names a replica no keeper here named the owner of (the keeper never came,
or a placement naming another job's replica) is refused for a job of a user other than root:
given ``xfer/`` the job could not resume, and a copy made on the hand-over's word would give
whoever places a job naming the replica another user's checkpoint.

Real pieces: the migrate component on a real SQLite store, its real Receiver on loopback, real
jobkit checkpoints sent with the real ``send_checkpoint``, real authenticated ``keeper`` control
messages, a real other user (tests/userrig.py) whose job, the real jobkit ``Checkpointer.resume()``
in the system's python, runs as that user with ``LAMINAR_RESUME_FROM`` set to what
``check_resume`` (the zone hand-over's call) gave. Stand-ins (from test_replica_gc): the zone
and the job manager.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentproc import jobkit_base
from test_replica_gc import KEY, K, Source, started
from userrig import User, local_user, read_as

from laminar.jobkit import Checkpointer
from laminar.migrate.transfer import send_control

# the job: what a training loop does at start with jobkit (says the step and state it resumed)
JOB = ("import json, sys; sys.path.insert(0, sys.argv[1]); from laminar.jobkit import Checkpointer; "
       "ck = Checkpointer(job_id='j', ckpt_dir=sys.argv[2], install_signal=False); state = ck.resume(); "
       "print(json.dumps({'step': ck.resumed_step, 'state': state.decode() if state else None}))")


@pytest.fixture
def base() -> Iterator[Path]:
    """A state directory the job's user can traverse, with jobkit under ``lib/`` (agentproc.jobkit_base)."""
    with jobkit_base("lm-t-unkept-") as d:
        yield d


def resume_as(user: User, resume_from: str, ckpt_dir: Path) -> dict[str, object] | str:
    """The job, run as ``user`` with LAMINAR_RESUME_FROM=``resume_from`` (jobkit from the ``lib/``
    beside ``ckpt_dir``): what it resumed (its JSON line), or the last line of its error output."""
    r = subprocess.run(["/usr/bin/python3", "-c", JOB, str(ckpt_dir.parent / "lib"), str(ckpt_dir)],
                       env={"PATH": "/usr/bin:/bin", "LAMINAR_RESUME_FROM": resume_from},
                       user=user.uid, group=user.gid, extra_groups=list(user.groups), capture_output=True,
                       text=True, timeout=60, cwd="/")
    return json.loads(r.stdout) if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


async def keeper(src: Source, ckpt: str, user: User) -> None:
    body = {"key": K, "src_node": 2, "src_job": "job-1", "ckpt": ckpt,
            "request": {"spec": {"command": ["train"]}, "owner_uid": user.uid, "owner_gid": user.gid}}
    await send_control("127.0.0.1", src.comp.port, KEY, "keeper", body, zone=1, node="2")


def test_a_hand_over_without_its_keeper_is_refused_for_another_users_job_and_resumes_once_kept(
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

                # no keeper came: refused for the user's job (and nothing copied for it)
                with pytest.raises(ValueError, match=f"no keeper of {K} held here named its job's owner: "
                                                     f"a job of uid {user.uid} is not given it"):
                    await asyncio.to_thread(comp.check_resume, str(replica), user.uid)
                # the same, reached through a path that is not the replica's own spelling
                with pytest.raises(ValueError, match="is not given it"):
                    await asyncio.to_thread(comp.check_resume, f"{replica}/../ckpt-5", user.uid)
                assert not (base / "resume").exists()
                # root's job reads xfer/: the replica itself
                assert await asyncio.to_thread(comp.check_resume, str(replica), 0) == str(replica)

                # the keeper names the user: the hand-over gives the job its copy, and it resumes
                await keeper(src, "ckpt-5", user)
                got = await asyncio.to_thread(comp.check_resume, str(replica), user.uid)
                assert got == str(base / "resume" / K / "ckpt-5"), got
                kd = os.lstat(base / "resume" / K)
                assert (kd.st_uid, kd.st_gid, stat.S_IMODE(kd.st_mode)) == (user.uid, user.gid, 0o500)
                assert resume_as(user, got, mine) == {"step": 5, "state": "weights-5"}
            finally:
                await comp.stop()
                agent.store.db.close()

        asyncio.run(main())


def test_a_kept_replica_that_no_longer_verifies_is_refused_and_nothing_is_copied(base: Path) -> None:
    with local_user("ungc") as user:
        async def main() -> None:
            agent, comp = await started(base)
            try:
                d = comp.root / "checkpoints" / K  # type: ignore[operator]
                src = Source(base, comp, 2, K)
                await src.send(6)
                await keeper(src, "ckpt-6", user)
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


def test_a_path_outside_xfer_is_checked_as_the_jobs_owner_and_a_refusal_tells_no_more_than_they_could_see(
        base: Path) -> None:
    """A non-root job's ``resume_from`` outside ``xfer/`` is verified with its owner's own
    permissions (uid, primary gid, the user's groups): a checkpoint in a directory closed to the
    owner is refused the same way whether it is valid, corrupt or absent, naming the path and the
    uid, so a placement is no oracle for what lies where the user cannot look. What the owner
    can read is verified as before (its errors are what the owner would see), a directory open
    to one of the user's supplementary groups is readable, and root's jobs are unchanged."""
    with local_user("orcl", extra_group=True) as user:
        async def main() -> None:
            agent, comp = await started(base)
            try:
                def ckpt(d: Path, step: int, corrupt: bool = False) -> Path:
                    p = Checkpointer(job_id="j", ckpt_dir=d, install_signal=False).save(b"weights-%d" % step,
                                                                                         step=step)
                    if corrupt:
                        (p / "state.bin").write_bytes(b"WEIGHTS-%d" % step)  # same size, other bytes
                    return p

                closed = base / "closed"  # root's alone: the user cannot look inside
                closed.mkdir(mode=0o700)
                valid, corrupt = ckpt(closed, 4), ckpt(closed, 5, corrupt=True)
                absent = closed / "ckpt-6"
                assert read_as(user, valid / "MANIFEST.json") == "Permission denied"
                said = []
                for p in (valid, corrupt, absent):
                    with pytest.raises(ValueError) as e:
                        await asyncio.to_thread(comp.check_resume, str(p), user.uid)
                    said.append(str(e.value).replace(str(p), "<path>"))
                    assert str(p) in str(e.value) and f"uid {user.uid}" in str(e.value), e.value
                    assert "Permission denied" in str(e.value), e.value
                assert said[0] == said[1] == said[2], said  # valid, corrupt and absent look alike
                # root's job: verified as root, as before
                assert await asyncio.to_thread(comp.check_resume, str(valid), 0) == str(valid)
                with pytest.raises(ValueError, match="not restorable: .*does not match its SHA-256"):
                    await asyncio.to_thread(comp.check_resume, str(corrupt), 0)

                # the user's own directory: verified as the user, errors as the user would see them
                own = base / "own"
                own.mkdir(mode=0o700)
                os.chown(own, user.uid, user.gid)
                mine, bad = ckpt(own, 7), ckpt(own, 8, corrupt=True)
                for p in (own, *own.rglob("*")):
                    os.chown(p, user.uid, user.gid)
                assert await asyncio.to_thread(comp.check_resume, str(mine), user.uid) == str(mine)
                with pytest.raises(ValueError, match="not restorable: .*does not match its SHA-256"):
                    await asyncio.to_thread(comp.check_resume, str(bad), user.uid)
                with pytest.raises(ValueError, match="no such directory"):
                    await asyncio.to_thread(comp.check_resume, str(own / "ckpt-9"), user.uid)

                # open to the user's supplementary group only: readable by the job, accepted
                team = base / "team"
                team.mkdir()
                shared = ckpt(team, 3)
                for p in (team, *team.rglob("*")):
                    os.chown(p, 0, user.groups[1])
                    os.chmod(p, 0o750 if p.is_dir() else 0o640)
                assert await asyncio.to_thread(comp.check_resume, str(shared), user.uid) == str(shared)
            finally:
                await comp.stop()
                agent.store.db.close()

        asyncio.run(main())
