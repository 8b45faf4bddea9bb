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


def rot(f: Path, at: int) -> None:
    """Flips byte ``at`` of ``f`` with no sign of a write (its mtime put back): bit rot, as the
    sender's identity checks see it."""
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


async def with_receiver(root: Path, body: Callable[[Receiver, int], Awaitable[T]], key: bytes = KEY) -> T:
    """Runs ``body(receiver, port)`` with a Receiver on 127.0.0.1 under ``root``; stops it after."""
    rcv = Receiver(root, key)
    port = await rcv.start("127.0.0.1", 0)
    try:
        return await body(rcv, port)
    finally:
        await rcv.stop()
