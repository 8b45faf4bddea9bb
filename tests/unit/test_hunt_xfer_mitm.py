"""What a peer on the path (no zone key) could change after the handshake (hunt bugs), shown
with a real man-in-the-middle TCP proxy between a real sender and a real Receiver on loopback.

- A control message's MAC covered its body and the connection's nonce but not its ``op``: a
  proxy turned a ``keeper`` (hand this node a job's keeper) into a ``release`` of the same job,
  which the destination carried out as authenticated.
- The destination's ``committed`` answer carried no MAC: a proxy answered an offer with
  ``committed`` itself and the sender returned success although nothing was sent.

Since protocol v2 everything after the handshake travels in AES-GCM records, so the proxy can
no longer find the op or the offer in the clear: it changes the record that carries them (the
first record from the client), or answers it with a ``committed`` of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import secrets
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from laminar import jobkit
from laminar.migrate.transfer import Receiver, TransferError, send_checkpoint, send_control

KEY = secrets.token_bytes(32)

Rewrite = Callable[[int, bytes], bytes | dict[str, Any]]
FIRST_RECORD = 2  # the client's frames: hello, auth, then records


async def _frame(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """A handshake message or a record: both are a 4-byte length and that many bytes."""
    n = struct.unpack(">I", await r.readexactly(4))[0]
    return await r.readexactly(n), b""


def _pack(hdr: dict[str, Any] | bytes, payload: bytes = b"") -> bytes:
    raw = hdr if isinstance(hdr, bytes) else json.dumps(hdr, separators=(",", ":")).encode()
    return struct.pack(">I", len(raw)) + raw + payload


async def _proxy(upstream: int, to_server: Rewrite) -> tuple[asyncio.AbstractServer, int]:
    """Forwards frames both ways; ``to_server(index, frame)`` may rewrite the client's frame
    number ``index``, or return a dict: the proxy answers the client with it in the clear."""

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", upstream)

        async def down() -> None:
            while True:
                h, p = await _frame(sr)
                cw.write(_pack(h, p))
                await cw.drain()

        t = asyncio.create_task(down())
        try:
            for index in itertools.count():
                h, p = await _frame(cr)
                out = to_server(index, h)
                if isinstance(out, dict):
                    t.cancel()
                    cw.write(_pack(out))
                    await cw.drain()
                    return
                sw.write(_pack(out, p))
                await sw.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            t.cancel()
            sw.close()
            cw.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, int(srv.sockets[0].getsockname()[1])


def test_a_control_messages_op_cannot_be_changed_on_the_path(tmp_path: Path) -> None:
    seen: list[tuple[str, Any]] = []

    def on_control(node: str, op: str, body: Any) -> Any:
        seen.append((op, body))
        return {op: body.get("key")}

    def swap(index: int, h: bytes) -> bytes:
        if index == FIRST_RECORD:  # the ctl: flip a bit where "keeper" may be
            h = h[:20] + bytes([h[20] ^ 1]) + h[21:]
        return h

    async def run() -> None:
        rcv = Receiver(tmp_path / "dst", KEY, on_control=on_control)
        port = await rcv.start("127.0.0.1", 0)
        srv, pport = await _proxy(port, swap)
        try:
            body = {"key": "n1-j7", "src_node": 1, "src_job": "j7", "request": {}, "ckpt": "ckpt-3"}
            with pytest.raises(TransferError, match="failed authentication"):
                await send_control("127.0.0.1", pport, KEY, "keeper", body)
            assert seen == [], f"the destination carried out a changed control message: {seen}"
            # straight to the endpoint it is carried out as sent
            assert await send_control("127.0.0.1", port, KEY, "keeper", body) == {"keeper": "n1-j7"}
            assert seen == [("keeper", body)]
        finally:
            srv.close()
            await rcv.stop()

    asyncio.run(run())


def test_a_committed_answer_cannot_be_forged_on_the_path(tmp_path: Path) -> None:
    ckpt = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "src", install_signal=False).save(
        os.urandom(50_000), step=4)

    def forge(index: int, h: bytes) -> bytes | dict[str, Any]:
        if index == FIRST_RECORD:  # the offer
            return {"t": "committed", "digest": "", "path": "/nowhere/ckpt-4"}
        return h

    async def run() -> None:
        rcv = Receiver(tmp_path / "dst", KEY)
        port = await rcv.start("127.0.0.1", 0)
        srv, pport = await _proxy(port, forge)
        try:
            with pytest.raises(TransferError):
                res = await send_checkpoint("127.0.0.1", pport, ckpt, "j1", KEY, retries=1, retry_delay_s=0.1)
                raise AssertionError(f"the sender believed a forged commit: {res}")
            assert rcv.committed == []
        finally:
            srv.close()
            await rcv.stop()

    asyncio.run(run())
