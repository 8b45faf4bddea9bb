"""The check of a checkpoint as its job's owner (``verify_as_owner``: a child process that drops
to the owner's uid and runs jobkit's check; what the zone's hand-over calls, through
``check_resume``, before a migrated job of a user other than root starts) on storage that stops
answering: the check is stopped and the checkpoint refused, naming the path, the uid and the
time waited, instead of holding its worker thread forever; a healthy checkpoint on the same
mount still verifies. A root job's checkpoint outside the transfer directory is checked the
same way (in a child, as root, bounded), with root's texts: no owner named.

The hanging storage is real: a FUSE mount (tests/fuserig.py) mirroring real checkpoints, its
server (``HangingServer``, fuserig's server told to leave the reads of one file unanswered, as a
dead NFS or FUSE server does) takes each READ of that file off /dev/fuse and never answers it.
The child reading it is then unkillable (D state: the kernel waits out a request already in user
space even after SIGKILL) until the server goes, which the test checks: nothing waited on it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from pathlib import Path

import fuserig
import pytest
from fuserig import READ, eio_mount

from laminar.jobkit import Checkpointer
from laminar.migrate import owner_check
from laminar.migrate.reclaim import ReclaimComponent

pytestmark = pytest.mark.kernel

NOBODY = 65534
HUNG = "hung/ckpt-5/state.bin"  # relative to the mount: the file whose reads are never answered


class HangingServer(fuserig._Server):
    """fuserig's FUSE server, except that a READ of :data:`HUNG` is taken and never answered."""

    def handle(self, op: int, nodeid: int, arg: bytes) -> bytes:
        if op == READ and self.files.get(fuserig.READ_IN.unpack_from(arg)[0], (-1, ""))[1] == HUNG:
            self.holding = True
            return b""
        return super().handle(op, nodeid, arg)

    def reply(self, unique: int, body: bytes = b"", err: int = 0) -> None:
        if getattr(self, "holding", False):
            self.holding = False
            return  # the reader waits for this answer for as long as the server lives
        super().reply(unique, body, err)


def checks_of(path: Path) -> list[int]:
    """The pids of the owner's checks (children of this process) reading ``path``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if str(path).encode() in argv and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                out.append(int(d.name))
    return out


def state_of(pid: int) -> str:
    return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() or ["?"])[0]


@pytest.mark.parametrize("owner", [NOBODY, 0], ids=["nobody", "root"])
def test_a_check_on_storage_that_stops_answering_is_stopped_naming_path_uid_and_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, owner: int) -> None:
    backing = tmp_path / "backing"
    for sub in ("ok", "hung"):
        Checkpointer(job_id=f"lm-t-verify-{sub}", ckpt_dir=backing / sub, install_signal=False).save(
            b"weights" * 4096, step=5)
    monkeypatch.setattr(fuserig, "_Server", HangingServer)  # the forked server is this one
    monkeypatch.setattr(owner_check, "VERIFY_STALL_S", 1.0)  # the bound on a check without progress
    check_resume = ReclaimComponent().check_resume  # the zone's hand-over's call (no transfer root here)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lm-t-verify")
    hung_pids: list[int] = []
    try:
        with eio_mount(backing) as fs:
            healthy = str(fs.path / "ok" / "ckpt-5")
            assert check_resume(healthy, owner, owner) == healthy  # verified
            path = fs.path / "hung" / "ckpt-5"
            check = pool.submit(check_resume, str(path), owner, owner)
            try:
                # (a bound for the suite only: the check itself ends after ~1 s without progress)
                err = check.exception(timeout=120)
            except concurrent.futures.TimeoutError:
                pytest.fail(f"the check of {path} waits on storage that does not answer (no bound)")
            assert isinstance(err, ValueError), repr(err)
            msg = str(err)
            assert str(path) in msg and "1 s" in msg and "storage does not answer" in msg, msg
            assert (f"uid {owner}" in msg) == (owner != 0), msg  # root's text names no owner
            # the child is still stuck in the read, unkillable: it was killed and not waited for
            hung_pids = checks_of(path)
            assert [state_of(p) for p in hung_pids] == ["D"], [(p, state_of(p)) for p in hung_pids]
        # the server gone, the read fails and the child ends (reaped below)
    finally:
        pool.shutdown(wait=True)
        for pid in hung_pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
