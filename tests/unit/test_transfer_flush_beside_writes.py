"""The destination flushes a batch of chunks to disk beside the writes of the next batch.

Every PERSIST_EVERY chunks the destination makes the batch durable (fdatasync, then the
have.log lines that say it holds them) before it counts them as held: the acknowledgement the
sender relies on for a resume after a crash. That flush ran on the thread that writes the
chunks, so every flush stopped the writes, and the receive behind them, for the disk's latency:
a 1 GiB move between two agents on this VM's disk went at 215 MiB/s. The flush now has a thread
of its own. What must still hold: a chunk counts as held only once its batch is flushed, and
only the chunks of the flushed batch do.

Real files (a jobkit checkpoint, the destination's partial file and have.log on this disk); the
flush is the real fdatasync, held back by the test until it lets it go.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import make_ckpt

from laminar.migrate import transfer as T
from laminar.migrate.transfer.incoming import PERSIST_EVERY, _Incoming

KB = 1 << 10
CHUNK = 64 * KB


def test_the_next_batch_is_written_while_a_flush_is_held_and_counts_only_once_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = make_ckpt(tmp_path, 3 * PERSIST_EVERY * CHUNK)
    m = T.build_manifest(ck, "j1", CHUNK)
    src = b"".join((ck / name).read_bytes() for name, _, _ in m.files)
    entered, release = threading.Event(), threading.Event()
    real = os.fdatasync

    def held(fd: int) -> None:
        entered.set()
        assert release.wait(30), "never released"
        real(fd)

    monkeypatch.setattr(os, "fdatasync", held)
    d = tmp_path / "incoming"

    async def body() -> tuple[int, list[str], int, list[str]]:
        inc = _Incoming(d, m)
        try:
            def put(i: int) -> None:
                inc.write(i, src[i * CHUNK:(i + 1) * CHUNK])

            first = range(PERSIST_EVERY)
            for i in first:
                put(i)
            inc.store()  # the first batch: its flush is held
            assert await asyncio.to_thread(entered.wait, 30), "the flush never started"
            for i in range(PERSIST_EVERY, 2 * PERSIST_EVERY):
                put(i)
            # the next batch's writes finish while the flush is held (before: queued behind it)
            await asyncio.wait_for(asyncio.gather(*(f for _, f in inc.writing)), 20)
            while_held = (inc.held_bytes(), (d / "have.log").read_text().split())
            release.set()
            await inc.settle()
            return (*while_held, inc.held_bytes(), (d / "have.log").read_text().split())
        finally:
            release.set()
            inc.close()

    held_then, log_then, held_now, log_now = asyncio.run(body())
    assert held_then == 0 and log_then == []  # nothing counted before its flush
    assert held_now == PERSIST_EVERY * CHUNK  # the flushed batch, not the one written beside it
    assert sorted(map(int, log_now)) == list(range(PERSIST_EVERY))
    with open(d / "data.partial", "rb") as f:  # both batches are on disk where they belong
        assert f.read(2 * PERSIST_EVERY * CHUNK) == src[:2 * PERSIST_EVERY * CHUNK]


def test_a_transfer_with_held_flushes_still_commits_the_source_bytes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end over loopback with every flush slowed: the destination commits exactly the
    source's checkpoint (the flushes and the writes beside them do not mix up chunks)."""
    from xferrig import KEY, with_receiver

    ck = make_ckpt(tmp_path, 5 * PERSIST_EVERY * CHUNK + 1234)
    real = os.fdatasync

    def slow(fd: int) -> None:
        threading.Event().wait(0.02)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)

    async def body(rcv: Any, port: int) -> T.SendResult:
        return await T.send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=CHUNK, retries=0)

    res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    got = T.verified_checkpoint(res.remote_path)
    for f in ck.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name
