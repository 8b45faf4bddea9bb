"""What interrupted transfers leave on the destination (hunt bug), with a real Receiver, real
sockets over loopback and real files.

A transfer whose sender never came back (it died, or moved on to a newer checkpoint) kept its
partial file (``incoming/<job>/<ckpt>/data.partial``, everything received so far) forever, and
a destination that died while committing kept ``checkpoints/<job>/.tmp-<ckpt>`` (a whole copy)
forever unless the same checkpoint was committed again. A partial transfer must survive a
restart (that is how a transfer resumes) but not forever: one untouched for
``INCOMING_STALE_S`` is abandoned, and a commit's temporary is a crash's leftover once the
endpoint starts again.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from xferrig import KEY, make_ckpt

from laminar.migrate import transfer
from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint

STALE_S = getattr(transfer, "INCOMING_STALE_S", 24 * 3600.0)



async def _interrupted_send(root: Path, ckpt: Path) -> None:
    """Starts a slow send of ``ckpt`` and cuts it once part of it is persisted."""
    rcv = Receiver(root, KEY)
    port = await rcv.start("127.0.0.1", 0)
    got = asyncio.Event()

    def progress(p: transfer.Progress) -> None:
        if 0 < p.done_bytes < p.total_bytes:
            got.set()

    task = asyncio.create_task(send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=16 << 10,
                                               rate_bps=2e6, progress=progress))
    try:
        await asyncio.wait_for(got.wait(), 120)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.2)  # the receiver sees the connection close and persists
        await rcv.stop()


def _age(d: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [*d.rglob("*"), d]:
        os.utime(p, (t, t))


async def _restart(root: Path) -> Receiver:
    rcv = Receiver(root, KEY)
    await rcv.start("127.0.0.1", 0)
    return rcv


def test_an_abandoned_partial_transfer_goes_and_a_fresh_one_resumes(tmp_path: Path) -> None:
    root = tmp_path / "dst"
    old = make_ckpt(tmp_path, 600_000, step=40)
    new = make_ckpt(tmp_path, 600_000, step=50)

    async def run() -> None:
        await _interrupted_send(root, old)
        await _interrupted_send(root, new)
        part_old = root / "incoming/j1/ckpt-40"
        part_new = root / "incoming/j1/ckpt-50"
        assert (part_old / "data.partial").exists() and (part_new / "data.partial").exists()
        # the sender of ckpt-40 never comes back; ckpt-40's partial is untouched for a long time
        _age(part_old, STALE_S + 3600)
        rcv = await _restart(root)
        try:
            assert not part_old.exists(), "an abandoned partial transfer is kept forever"
            assert (part_new / "data.partial").exists()  # recent: kept, it resumes
            port = rcv.server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            res = await send_checkpoint("127.0.0.1", port, new, "j1", KEY, chunk_size=16 << 10)
            assert res.skipped_bytes > 0  # resumed, not from zero
            assert verified_checkpoint(res.remote_path)
            assert not part_new.exists()
        finally:
            await rcv.stop()

    asyncio.run(run())


def test_a_commit_temporary_left_by_a_crash_goes_at_start(tmp_path: Path) -> None:
    root = tmp_path / "dst"
    ck = make_ckpt(tmp_path, 100_000, step=40)

    async def run() -> None:
        rcv = await _restart(root)
        port = rcv.server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        res = await send_checkpoint("127.0.0.1", port, ck, "j1", KEY)
        await rcv.stop()
        # what a destination killed between writing and renaming a commit leaves (named as
        # Receiver._commit names it): a whole copy under a temporary name
        tmp = root / "checkpoints/j1/.tmp-ckpt-50"
        tmp.mkdir()
        (tmp / "state.bin").write_bytes(os.urandom(100_000))
        rcv = await _restart(root)
        try:
            assert not tmp.exists()
            assert verified_checkpoint(res.remote_path)  # committed checkpoints untouched
        finally:
            await rcv.stop()

    asyncio.run(run())
