"""A transfer to a silent IPv6 destination says where it went in the form a config takes:
``[fd00::1]:7443``. It printed ``::1:7443`` (``host:port`` run together), which a reader cannot
split and a config does not take. Stand-in, named: the destination is a TCP listener on ::1
that accepts and never answers (test_prestage_silent_keeper.Silent); the handshake timeout is
shortened for the test."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from ports import free_port
from test_prestage_silent_keeper import Silent

from laminar.jobkit import Checkpointer
from laminar.migrate import transfer
from laminar.migrate.transfer import receive as xfer_receive
from laminar.migrate.transfer import send as xfer_send


def test_a_silent_ipv6_destination_is_named_with_brackets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xfer_send, "HANDSHAKE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(xfer_receive, "HANDSHAKE_TIMEOUT_S", 0.3)
    ckpt = Checkpointer(job_id="j", ckpt_dir=tmp_path / "ck", install_signal=False).save(b"weights", step=1)
    port = free_port(socket.SOCK_STREAM, "::1")

    async def main() -> str:
        async with Silent().listening(port, "::1"):
            with pytest.raises(transfer.PeerSilentError) as e:
                await transfer.send_checkpoint("::1", port, ckpt, "j", b"k" * 32, silent_retries=0, retries=0)
        return str(e.value)

    msg = asyncio.run(main())
    assert f"[::1]:{port} did not answer the handshake" in msg, msg
