"""What the checkpoint-transfer tests share: a zone key, a real jobkit checkpoint, and a real
Receiver on loopback for the length of a test body."""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from laminar import jobkit
from laminar.migrate.transfer import Receiver

KEY = secrets.token_bytes(32)
T = TypeVar("T")


def make_ckpt(tmp: Path, size: int, step: int = 40) -> Path:
    """A committed jobkit checkpoint of ``size`` random bytes under ``tmp/src``."""
    ck = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp / "src", install_signal=False)
    return ck.save(os.urandom(size), step=step)


async def with_receiver(root: Path, body: Callable[[Receiver, int], Awaitable[T]], key: bytes = KEY) -> T:
    """Runs ``body(receiver, port)`` with a Receiver on 127.0.0.1 under ``root``; stops it after."""
    rcv = Receiver(root, key)
    port = await rcv.start("127.0.0.1", 0)
    try:
        return await body(rcv, port)
    finally:
        await rcv.stop()
