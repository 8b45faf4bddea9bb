"""The snapshot a move or prestage sends (``Mover._snapshot``) never follows the job's
links, and what a crash mid-send left under ``<root>/outgoing/`` is removed at start.

The agent is root; the job's checkpoint directory belongs to the job's user, who can swap a file
for a link after the checkpoint was verified. Real files: a jobkit checkpoint, a real FIFO, real
symbolic links; the checkpoint lives on another file system (/dev/shm, tmpfs) where hard links
fail and the snapshot falls back to copying, or beside the transfer root where they work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from standin_agent import standin_agent
from test_migrate_evidence import make_agent

from laminar.components import MigrateAgent
from laminar.jobkit import Checkpointer, CheckpointError, verify_checkpoint
from laminar.migrate.reclaim import ReclaimComponent


def component(root: Path) -> ReclaimComponent:
    c = ReclaimComponent()
    c.agent = standin_agent(MigrateAgent, zone=SimpleNamespace(node_id=1))
    c.root = root
    return c


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on another file system than the transfer root (hard links fail across)."""
    d = Path("/dev/shm") / f"lm-t-rgc-{secrets.token_hex(4)}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def ckpt_in(d: Path, data: bytes = b"weights-5") -> Path:
    return Checkpointer(job_id="j1", ckpt_dir=d / "ck", install_signal=False).save(data, step=5)


def left_in(root: Path) -> list[str]:
    out = root / "outgoing"
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []


def in_thread(fn: object, timeout: float) -> tuple[bool, BaseException | None, object]:
    """Runs ``fn()`` in a thread: (finished within ``timeout``, its exception, its result)."""
    res: list[object] = [None, None]

    def run() -> None:
        try:
            res[1] = fn()  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - handed to the test
            res[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), res[0], res[1]  # type: ignore[return-value]


def test_a_regular_checkpoint_is_copied_where_hard_links_fail(tmp_path: Path, shm: Path) -> None:
    c = component(tmp_path / "xfer")
    ck = ckpt_in(shm)
    snap = c.mover._snapshot(ck, "n1-job-1")
    assert snap == tmp_path / "xfer" / "outgoing" / "n1-job-1" / "ckpt-5"
    verify_checkpoint(snap)
    assert all(os.lstat(f).st_ino != os.lstat(ck / f.name).st_ino for f in snap.iterdir())  # copies, not links


def test_a_fifo_swapped_in_behind_a_link_is_refused_not_opened(tmp_path: Path, shm: Path) -> None:
    c = component(tmp_path / "xfer")
    ck = ckpt_in(shm)
    fifo = shm / "pipe"
    os.mkfifo(fifo)
    state = next(f for f in ck.iterdir() if f.name != "MANIFEST.json")
    state.unlink()
    state.symlink_to(fifo)  # the job's user, after the checkpoint was verified
    done, err, _ = in_thread(lambda: c.mover._snapshot(ck, "n1-job-1"), 20.0)
    try:
        assert done, "the snapshot opened the FIFO behind the link and blocks on it"
        assert isinstance(err, (CheckpointError, OSError)), err
        assert left_in(tmp_path / "xfer") in ([], ["n1-job-1"])  # no snapshot, no temporary
    finally:
        if not done:  # let the blocked reader go: a writer opens the FIFO and closes it (EOF)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def link_swapped_in(ck: Path, outside: Path) -> None:
    """The job's user swaps the checkpoint's state file for a link to ``outside``, a file with
    the same bytes (so the manifest check alone would let it through)."""
    state = next(f for f in ck.iterdir() if f.name != "MANIFEST.json")
    shutil.copy(state, outside)
    state.unlink()
    state.symlink_to(outside)


def test_a_link_to_a_file_with_the_same_bytes_is_refused_where_hard_links_work(tmp_path: Path) -> None:
    c = component(tmp_path / "xfer")
    ck = ckpt_in(tmp_path)
    link_swapped_in(ck, tmp_path / "not-the-jobs")
    with pytest.raises((CheckpointError, OSError)):
        c.mover._snapshot(ck, "n1-job-1")
    assert left_in(tmp_path / "xfer") in ([], ["n1-job-1"])
    assert (tmp_path / "not-the-jobs").read_bytes() == b"weights-5"  # untouched


def test_a_link_swapped_in_on_the_copy_path_is_refused(tmp_path: Path, shm: Path) -> None:
    c = component(tmp_path / "xfer")
    ck = ckpt_in(shm)
    link_swapped_in(ck, shm / "not-the-jobs")
    with pytest.raises((CheckpointError, OSError)):
        c.mover._snapshot(ck, "n1-job-1")
    assert left_in(tmp_path / "xfer") in ([], ["n1-job-1"])
    assert (shm / "not-the-jobs").read_bytes() == b"weights-5"  # untouched


def test_stale_outgoing_snapshots_are_removed_at_start_and_links_not_followed(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    out = tmp_path / "xfer" / "outgoing"
    ck = ckpt_in(tmp_path)
    (out / "n1-job-1").mkdir(parents=True)
    shutil.copytree(ck, out / "n1-job-1" / "ckpt-5")  # a crash mid-send left these
    shutil.copytree(ck, out / "n1-job-1" / ".tmp-ckpt-9-123")
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "data").write_bytes(b"not the agent's")
    (out / "n1-job-2").symlink_to(keep, target_is_directory=True)

    async def main() -> None:
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            assert left_in(tmp_path / "xfer") == []
        finally:
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())
    assert (keep / "data").read_bytes() == b"not the agent's"  # the link went, not what it points to
