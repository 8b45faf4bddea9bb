"""A destination whose disk fills during a transfer tells the sender why (real: the receive
root is a 16 MiB tmpfs mounted for the test, a real Receiver and sender over loopback, and
another file fills the tmpfs while the checkpoint's chunks arrive).

The offer's room check passes (the checkpoint fits when it is offered); then another writer
takes the room. The destination's chunk writes fail with ENOSPC. It used to close the
connection without a word: the sender saw a lost connection and retried, and only the retry's
room check said "no room", without the reason. Now the destination answers with a no-room
refusal that names ENOSPC (NoRoomError at the sender, fatal: no retry of this destination),
releases its reservation, and keeps the chunks it had persisted, so a later offer resumes from
them once there is room.
"""

from __future__ import annotations

import asyncio
import errno
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from xferrig import KEY, make_ckpt

from laminar.migrate import transfer as T
from laminar.migrate.transfer import NoRoomError, Receiver, send_checkpoint, verified_checkpoint

pytestmark = pytest.mark.kernel

MB = 1 << 20
KB = 1 << 10


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / f"laminar-t-enospc-{secrets.token_hex(3)}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", f"laminar-t-enospc-{secrets.token_hex(3)}",
                    str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> int:
    """Writes ``path`` until its filesystem takes nothing more; the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        for block in (1 * MB, 64 * KB, 4 * KB):
            data = b"\xa5" * block
            while True:
                try:
                    k = f.write(data)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
                n += k or 0
                if not k or k < block:
                    break
    return n


def test_a_disk_filled_by_another_writer_mid_transfer_is_a_no_room_refusal_naming_enospc_and_a_resume_after(
        tmp_path: Path, small_fs: Path) -> None:
    ck = make_ckpt(tmp_path, 8 * MB)
    filler = small_fs / "someone-else.bin"
    before = T.STATS.offers_refused_no_room

    async def run() -> tuple[NoRoomError, int, list[str], int, str]:
        filled: list[int] = []

        def on_progress(p: T.Progress) -> None:  # the first ack: 8 chunks persisted; then the disk fills, once
            if p.done_bytes and not filled:
                filled.append(fill(filler))

        rcv = Receiver(small_fs, KEY, on_progress=on_progress)
        port = await rcv.start("127.0.0.1", 0)
        try:
            with pytest.raises(NoRoomError) as e:
                await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=256 * KB, retries=3,
                                      retry_delay_s=0.05)
            refused = rcv.refused_no_room
            assert not rcv._active  # the reservation went with the refused transfer
            assert rcv.free_for_offers() == 0
            held = (small_fs / "incoming" / "j1" / ck.name / "have.log").read_text().split()
            filler.unlink()  # room again: the next offer resumes from what was kept
            res = await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=256 * KB, retries=0)
            return e.value, refused, held, res.skipped_bytes, res.remote_path
        finally:
            await rcv.stop()

    err, refused, held, skipped, path = asyncio.run(run())
    assert "ENOSPC" in str(err) and "writing under" in str(err), str(err)
    assert err.fatal and err.need > err.avail
    assert refused == 1  # refused once, while writing: the sender did not come back to be refused again
    assert T.STATS.offers_refused_no_room - before == 1
    assert len(held) >= 8  # the first ack's chunks were persisted, and kept
    assert skipped >= len(held) * 256 * KB  # the resume did not send them again
    assert verified_checkpoint(path) and Path(path).is_relative_to(small_fs)
    assert (Path(path) / "state.bin").read_bytes() == (ck / "state.bin").read_bytes()
