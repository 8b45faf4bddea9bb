"""The faster transfer path keeps its guarantees: real transfers over loopback.

- The receiver hashes each chunk once, at ``done``, from its disk: a chunk that arrives with
  the wrong bytes (the sender read it wrong after its own check) is still caught there, asked
  for again and the checkpoint commits byte-identical.
- ``send_checkpoint`` without a manifest builds it in a worker thread: hashing a checkpoint
  of many GB on the agent's event loop stopped its probes and kill-switches for seconds
  (the reclaim component sends without a manifest).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar import jobkit
from laminar.migrate import transfer
from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint
from laminar.migrate.transfer.send import _Source


def test_a_chunk_that_arrives_wrong_is_caught_at_done_and_sent_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 700_000)
    real = _Source.load
    spoiled: list[int] = []

    def load(self: Any, i: int, buf: bytearray) -> memoryview:
        view = real(self, i, buf)
        if i == 3 and not spoiled:  # once: the bytes change after the sender's check
            spoiled.append(i)
            view[10] ^= 0xFF
        return view

    monkeypatch.setattr(_Source, "load", load)

    async def body(rcv: Receiver, port: int) -> Any:
        return await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10, retries=0)

    res = asyncio.run(with_receiver(tmp_path / "dst", body))
    assert spoiled == [3]
    assert res.sent_bytes == res.total_bytes + (64 << 10)  # chunk 3 went twice, in the same connection
    assert res.attempts == 1
    dst = verified_checkpoint(res.remote_path)
    for f in ckpt.iterdir():
        assert (dst / f.name).read_bytes() == f.read_bytes()


def test_send_checkpoint_hashes_its_source_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    on_loop: list[bool] = []  # the sender's hashing of its source: on the loop's thread?
    real = jobkit.file_sha256

    def spy(p: Any) -> Any:
        if Path(p).is_relative_to(ckpt):
            on_loop.append(threading.current_thread() is threading.main_thread())
        return real(p)

    monkeypatch.setattr(jobkit, "file_sha256", spy)

    async def body(rcv: Receiver, port: int) -> Any:
        return await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)

    res = asyncio.run(with_receiver(tmp_path / "dst", body))
    assert on_loop and not any(on_loop)
    assert verified_checkpoint(res.remote_path)


def test_the_destination_s_error_reaches_a_sender_still_streaming(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination refuses a chunk early while the sender still has megabytes in flight:
    closing with those unread sent a reset, and the sender saw "connection reset" instead of
    the reason. It half-closes and reads on until the sender hangs up."""
    ckpt = make_ckpt(tmp_path, 12 << 20)
    real = _Source.load

    def load(self: Any, i: int, buf: bytearray) -> memoryview:
        view = real(self, i, buf)
        return view[:-1] if i == 2 else view  # a chunk one byte short: it does not fit the manifest

    monkeypatch.setattr(_Source, "load", load)

    async def body(rcv: Receiver, port: int) -> None:
        with pytest.raises(transfer.TransferError, match="does not fit the manifest"):
            await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10, retries=0)
        assert rcv.committed == []

    for _ in range(5):  # without the linger about one in three lost the reason
        asyncio.run(with_receiver(tmp_path / "dst", body))
