"""The receiving agent hashes a checkpoint in a worker thread, not on its event loop: a real
transfer over loopback, with jobkit's file hashing watched for the thread it runs on."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar import jobkit
from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint
from laminar.migrate.transfer import committed as xfer_committed


def test_the_commit_and_the_recheck_of_a_committed_copy_hash_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    dst = tmp_path / "dst"
    calls: list[tuple[Path, bool]] = []  # (what was hashed, on the event loop's thread?)
    real = jobkit.file_sha256

    def spy(p: Any) -> Any:
        calls.append((Path(p), threading.current_thread() is threading.main_thread()))
        return real(p)

    monkeypatch.setattr(jobkit, "file_sha256", spy)
    # a copy committed seconds ago is trusted unhashed (TRUST_UNCHANGED_S): this test wants the
    # recheck to hash, to see where it does
    monkeypatch.setattr(xfer_committed, "TRUST_UNCHANGED_S", 0.0)

    def receivers() -> list[bool]:  # the receiver's hashing: of files under its root
        got = [on_loop for p, on_loop in calls if p.is_relative_to(dst)]
        calls.clear()
        return got

    async def body(rcv: Receiver, port: int) -> tuple[Path, list[bool], list[bool]]:
        first = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)
        committed = receivers()
        again = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)  # already committed
        assert again.remote_path == first.remote_path
        return Path(first.remote_path), committed, receivers()

    path, committed, rechecked = asyncio.run(with_receiver(dst, body))
    assert committed and not any(committed)  # the commit re-verified it, in a thread
    assert rechecked and not any(rechecked)  # the committed copy was checked again, in a thread
    assert verified_checkpoint(path)
