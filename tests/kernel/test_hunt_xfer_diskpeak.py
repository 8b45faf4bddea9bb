"""A destination with room for a checkpoint once must be able to commit it (hunt bug).

The commit copied the verified partial file into the checkpoint's files before removing it,
so it needed twice the checkpoint's size on disk. A storage keeper is chosen for free disk of
one checkpoint plus its reserve (``keeper.choose_keeper``, the ``space`` control message), so
a keeper with less than twice the size received every byte and then failed the commit with
ENOSPC, on every attempt. Real: the destination's root is a size-limited tmpfs mounted for the
test, a real Receiver and sender over loopback.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminar import jobkit
from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint

pytestmark = pytest.mark.kernel

MB = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / f"lm-t-fs-{secrets.token_hex(3)}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "lm-t-xfer", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_checkpoint_commits_with_room_for_one_copy(tmp_path: Path, small_fs: Path) -> None:
    size = 10 * MB  # 16 MiB of room: one copy fits, two do not
    ck = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "src", install_signal=False).save(os.urandom(size), step=3)
    key = secrets.token_bytes(32)

    async def run() -> str:
        rcv = Receiver(small_fs, key)
        port = await rcv.start("127.0.0.1", 0)
        try:
            res = await send_checkpoint("127.0.0.1", port, ck, "j1", key, chunk_size=MB, retries=1, retry_delay_s=0.1)
            return res.remote_path
        finally:
            await rcv.stop()

    dst = Path(asyncio.run(run()))
    assert verified_checkpoint(dst) == dst
    assert (dst / "state.bin").read_bytes() == (ck / "state.bin").read_bytes()
    assert not (small_fs / "incoming" / "j1").exists()
