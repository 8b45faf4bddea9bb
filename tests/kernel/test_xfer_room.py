"""The receiver checks its free disk before it accepts an offer (real: the receive root is a
16 MiB tmpfs mounted for the test, a real Receiver and senders over loopback).

A checkpoint larger than the free space is refused at once with the bytes needed and available
(NoRoomError, fatal: the sender does not retry this destination, the caller moves to its next
candidate); one that fits commits; a transfer in progress keeps its bytes reserved, so a second
offer that would fit alone is refused while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobrig import until
from xferrig import KEY, make_ckpt

from laminar.migrate.transfer import STATS, NoRoomError, Receiver, send_checkpoint, verified_checkpoint

pytestmark = pytest.mark.kernel

MB = 1 << 20


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / f"lm-t-h1fs-{secrets.token_hex(3)}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "lm-t-h1xfer", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_an_offer_larger_than_the_free_space_is_refused_naming_the_bytes_and_one_that_fits_commits(
        tmp_path: Path, tiny_fs: Path) -> None:
    big = make_ckpt(tmp_path / "big", 20 * MB)
    small = make_ckpt(tmp_path / "small", 6 * MB)
    before = STATS.offers_refused_no_room

    async def run() -> tuple[NoRoomError, str, int]:
        rcv = Receiver(tiny_fs, KEY)
        port = await rcv.start("127.0.0.1", 0)
        try:
            st = os.statvfs(tiny_fs)
            margin = int(st.f_blocks * st.f_frsize * 0.05)
            assert 0 < rcv.free_for_offers() <= st.f_bavail * st.f_frsize - margin
            with pytest.raises(NoRoomError) as e:
                await send_checkpoint("127.0.0.1", port, big, "j1", KEY, retries=5, retry_delay_s=0.05)
            refused = rcv.refused_no_room
            res = await send_checkpoint("127.0.0.1", port, small, "j2", KEY, retries=0)
            return e.value, res.remote_path, refused
        finally:
            await rcv.stop()

    err, path, refused = asyncio.run(run())
    st = os.statvfs(tiny_fs)
    assert refused == 1  # refused once: fatal, the sender did not try this destination again
    assert STATS.offers_refused_no_room - before == 1
    assert err.fatal and err.need > 20 * MB and err.avail <= st.f_blocks * st.f_frsize
    assert f"needs {err.need} bytes" in str(err) and f"{err.avail} bytes available" in str(err)
    assert not (tiny_fs / "incoming" / "j1").exists()  # nothing was set up for it
    assert verified_checkpoint(path) and Path(path).is_relative_to(tiny_fs)


def test_a_transfer_in_progress_keeps_its_bytes_reserved(tmp_path: Path, tiny_fs: Path) -> None:
    first = make_ckpt(tmp_path / "a", 6 * MB)
    second = make_ckpt(tmp_path / "b", 7 * MB)

    async def run() -> tuple[NoRoomError, str]:
        rcv = Receiver(tiny_fs, KEY)
        port = await rcv.start("127.0.0.1", 0)
        # paced to ~4 s: the first transfer is still in progress when the second is offered
        slow = asyncio.create_task(send_checkpoint("127.0.0.1", port, first, "ja", KEY, chunk_size=256 << 10,
                                                   rate_bps=12e6, retries=0))
        try:
            idle = rcv.free_for_offers()
            assert await until(lambda: bool(rcv._active), timeout=20)
            assert rcv.free_for_offers() < idle  # what the first one lacks is not free for offers
            with pytest.raises(NoRoomError) as e:  # 7 + 4 (commit block) + 0.8 (margin) fits alone in 16
                await send_checkpoint("127.0.0.1", port, second, "jb", KEY, retries=0)
            res = await slow  # the first is not disturbed by the refusal
            return e.value, res.remote_path
        finally:
            slow.cancel()
            with contextlib.suppress(BaseException):
                await slow
            await rcv.stop()

    err, path = asyncio.run(run())
    held = re.search(r"transfers in progress (\d+)", str(err))
    assert held and 0 < int(held.group(1)) <= 6 * MB  # what the first one still lacked was counted
    assert verified_checkpoint(path)
