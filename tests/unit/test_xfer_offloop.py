"""The receiving agent hashes a checkpoint in a worker thread, not on its event loop: a real
transfer over loopback, with jobkit's verification watched for the thread it runs on."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar import jobkit
from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint


def test_the_commit_and_the_recheck_of_a_committed_copy_hash_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    calls: list[bool] = []  # True: on the event loop's (main) thread
    real = jobkit.verify_checkpoint

    def spy(p: Any) -> Any:
        calls.append(threading.current_thread() is threading.main_thread())
        return real(p)

    monkeypatch.setattr(jobkit, "verify_checkpoint", spy)

    async def body(rcv: Receiver, port: int) -> None:
        first = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)
        assert verified_checkpoint(first.remote_path)
        n = len(calls)
        again = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)  # already committed
        assert again.remote_path == first.remote_path and len(calls) > n

    calls.clear()
    asyncio.run(with_receiver(tmp_path / "dst", body))
    # the sender's own checks may run anywhere; the receiver's commit and re-check ran in threads
    assert any(not on_main for on_main in calls)
    monkeypatch.setattr(jobkit, "verify_checkpoint", real)
