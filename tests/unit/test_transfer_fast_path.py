"""The transfer's fast path reads records with ``recv_into`` into one buffer
(``transfer.channel._RecordBuffer``), taking the connection over from asyncio's StreamReader, whose
private state (``_buffer``, ``_eof``, ``_paused``) it reads. A Python whose StreamReader lost
one of them falls back to the slow path (``readexactly``: three copies per record) without a
word but this module's log. These tests fail loudly when the running Python no longer has what
the fast path takes over, so an upgrade that would silently slow every transfer down is caught
here; each transfer logs once, at INFO, which path it took. Real connections over loopback.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate.transfer import Receiver, send_checkpoint, verified_checkpoint
from laminar.migrate.transfer.channel import _RecordBuffer

KB = 1 << 10


def test_this_pythons_stream_reader_still_has_what_the_fast_path_takes_over() -> None:
    async def run() -> tuple[list[str], bool, bool]:
        accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
            asyncio.get_running_loop().create_future()

        async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            accepted.set_result((r, w))

        srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        sr, sw = await accepted
        try:
            missing = [f"{side}.{a} (want {t.__name__}, got {type(getattr(x, a, None)).__name__})"
                       for side, x in (("client", r), ("server", sr))
                       for a, t in (("_buffer", bytearray), ("_eof", bool), ("_paused", bool))
                       if not isinstance(getattr(x, a, None), t)]
            return missing, _RecordBuffer.usable(r, w), _RecordBuffer.usable(sr, sw)
        finally:
            for x in (w, sw):
                x.close()
            srv.close()
            await srv.wait_closed()

    missing, client, server = asyncio.run(run())
    assert not missing, (f"Python {sys.version.split()[0]}: asyncio.StreamReader no longer has {missing}; every "
                         "checkpoint transfer would take the slow path (transfer.channel._RecordBuffer): adapt it")
    assert client and server, "a plain loopback connection cannot be taken over: transfers take the slow path"


def test_each_transfer_logs_once_at_info_which_path_it_took_and_it_is_the_fast_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = make_ckpt(tmp_path, 300 * KB)

    async def body(rcv: Receiver, port: int) -> str:
        return (await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=0)).remote_path

    with caplog.at_level(logging.INFO, logger="laminar.transfer"):
        path = asyncio.run(with_receiver(tmp_path / "rcv", body))
    said = [r.getMessage() for r in caplog.records if "records read by the" in r.getMessage()]
    assert len(said) == 2, said  # the sender's, the destination's
    assert all("fast path" in m for m in said), said
    assert any(" to 127.0.0.1:" in m for m in said) and any(" from " in m for m in said), said
    assert verified_checkpoint(path)


def test_without_the_private_state_both_ends_take_the_slow_path_say_so_and_still_deliver(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Python without that state gets (the fast path is switched off here, as such a
    Python's would be): the same bytes delivered, and a log line that says which path."""
    ck = make_ckpt(tmp_path, 300 * KB)
    monkeypatch.setattr(_RecordBuffer, "usable", staticmethod(lambda r, w: False))

    async def body(rcv: Receiver, port: int) -> str:
        return (await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=64 * KB, retries=0)).remote_path

    with caplog.at_level(logging.INFO, logger="laminar.transfer"):
        path = asyncio.run(with_receiver(tmp_path / "rcv", body))
    said = [r.getMessage() for r in caplog.records if "records read by the" in r.getMessage()]
    assert len(said) == 2 and all("slow path" in m and "_buffer/_eof/_paused" in m for m in said), said
    assert (verified_checkpoint(path) / "state.bin").read_bytes() == (ck / "state.bin").read_bytes()
