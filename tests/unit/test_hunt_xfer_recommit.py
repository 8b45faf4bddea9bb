"""Transfer endpoint bug found by the hunt, reproduced over real loopback sockets with a real
:class:`laminar.migrate.transfer.Receiver` and real checkpoint files: a committed copy that no
longer verifies (bit rot, a file removed) was answered ``committed`` to every later send of the
same checkpoint, so the sender was told the destination held it while nothing restorable was
there, and the copy could never be repaired.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar import jobkit
from laminar.migrate import transfer
from laminar.migrate.transfer import (
    Receiver,
    TransferError,
    latest_verified,
    send_checkpoint,
    verified_checkpoint,
)
from laminar.migrate.transfer.committed import TRUST_UNCHANGED_S


def test_a_committed_copy_that_no_longer_verifies_is_received_again(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    root = tmp_path / "dst"

    async def body(rcv: Receiver, port: int) -> None:
        first = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)
        dst = Path(first.remote_path)
        assert verified_checkpoint(dst) == dst
        f = dst / "state.bin"
        data = bytearray(f.read_bytes())
        data[100] ^= 0xFF  # rots at rest on the destination
        f.write_bytes(bytes(data))
        with pytest.raises(TransferError):
            verified_checkpoint(dst)
        again = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)
        # "delivered" must mean restorable: the corrupt copy was replaced by a verified one
        assert again.sent_bytes == again.total_bytes
        assert verified_checkpoint(dst) == dst
        assert latest_verified(root, "j1") == dst
        assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()
        # a file of the copy gone (and its VERIFIED marker) is repaired the same way
        (dst / "state.bin").unlink()
        (dst / transfer.VERIFIED).unlink()
        await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, chunk_size=64 << 10)
        assert verified_checkpoint(dst) == dst
        # nothing set aside is left behind
        assert sorted(p.name for p in dst.parent.iterdir()) == ["ckpt-40"]

    asyncio.run(with_receiver(root, body))


def test_a_conflicting_verified_copy_is_still_refused(tmp_path: Path) -> None:
    a = make_ckpt(tmp_path / "a", 50_000)
    b = make_ckpt(tmp_path / "b", 50_000)  # same job and name, other bytes
    root = tmp_path / "dst"

    async def body(rcv: Receiver, port: int) -> None:
        first = await send_checkpoint("127.0.0.1", port, a, "j1", KEY)
        with pytest.raises(TransferError, match="other content") as e:
            await send_checkpoint("127.0.0.1", port, b, "j1", KEY)
        assert e.value.fatal
        dst = Path(first.remote_path)
        assert verified_checkpoint(dst) == dst
        assert (dst / "state.bin").read_bytes() == (a / "state.bin").read_bytes()

    asyncio.run(with_receiver(root, body))


def test_a_committed_file_replaced_by_a_link_or_pipe_is_not_verified(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 20_000)
    root = tmp_path / "dst"

    async def body(rcv: Receiver, port: int) -> Path:
        return Path((await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY)).remote_path)

    dst = asyncio.run(with_receiver(root, body))
    (dst / "state.bin").rename(tmp_path / "moved.bin")
    os.symlink(tmp_path / "moved.bin", dst / "state.bin")  # same bytes, through a link
    with pytest.raises(TransferError, match="changed since it was verified"):
        verified_checkpoint(dst)
    (dst / "state.bin").unlink()
    os.mkfifo(dst / "state.bin")
    with pytest.raises(TransferError, match="changed since it was verified"):
        verified_checkpoint(dst)
    assert latest_verified(root, "j1") is None


def test_a_fresh_commit_is_not_read_again_and_any_change_since_is_still_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The move's hand-over checks the copy seconds after the commit hashed it: it must not read
    the whole checkpoint again (downtime: a full SHA-256 pass, 1.1 s per GiB here). A rewrite
    of the same size with the old mtime put back (its ctime moves), or an old commit, is hashed."""
    ckpt = make_ckpt(tmp_path, 300_000)
    root = tmp_path / "dst"
    hashed: list[str] = []
    real = jobkit.file_sha256

    def counting(path: Path) -> str:
        hashed.append(Path(path).name)
        return real(path)

    async def body(rcv: Receiver, port: int) -> None:
        dst = Path((await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY)).remote_path)
        monkeypatch.setattr(jobkit, "file_sha256", counting)
        assert verified_checkpoint(dst) == dst
        assert hashed == []
        committed = json.loads((dst / transfer.TRANSFER_MANIFEST).read_text())["committed"]
        assert verified_checkpoint(dst, now=committed + TRUST_UNCHANGED_S + 1) == dst
        assert sorted(hashed) == ["MANIFEST.json", "state.bin"]
        f = dst / "state.bin"
        st = f.stat()
        data = bytearray(f.read_bytes())
        data[7] ^= 0x01
        f.write_bytes(bytes(data))
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only ctime tells
        with pytest.raises(TransferError, match="changed since it was verified"):
            verified_checkpoint(dst)

    asyncio.run(with_receiver(root, body))
