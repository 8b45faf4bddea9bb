"""What a peer on the path (no zone key) could change after the handshake (hunt bugs), shown
with a real man-in-the-middle TCP proxy between a real sender and a real Receiver on loopback.

- A control message's MAC covered its body and the connection's nonce but not its ``op``: a
  proxy turned a ``guard`` (hand this node a job's guard) into a ``release`` of the same job,
  which the destination carried out as authenticated.
- The destination's ``committed`` answer carried no MAC: a proxy answered an offer with
  ``committed`` itself and the sender returned success although nothing was sent.
"""

from __future__ import annotations

import asyncio
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

Rewrite = Callable[[dict[str, Any]], dict[str, Any] | None]


async def _frame(r: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack(">I", await r.readexactly(4))[0]
    hdr = json.loads(await r.readexactly(n))
    payload = await r.readexactly(int(hdr["len"])) if hdr.get("t") == "chunk" else b""
    return hdr, payload


def _pack(hdr: dict[str, Any], payload: bytes = b"") -> bytes:
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    return struct.pack(">I", len(raw)) + raw + payload


async def _proxy(upstream: int, to_server: Rewrite) -> tuple[asyncio.AbstractServer, int]:
    """Forwards frames both ways; ``to_server`` may rewrite a client frame, or return None to
    answer the client itself (the answer is the frame it put in ``hdr['__answer']``)."""

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", upstream)

        async def down() -> None:
            while True:
                h, p = await _frame(sr)
                cw.write(_pack(h, p))
                await cw.drain()

        t = asyncio.create_task(down())
        try:
            while True:
                h, p = await _frame(cr)
                out = to_server(h)
                if out is None:
                    t.cancel()
                    cw.write(_pack(h["__answer"]))
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

    def swap(h: dict[str, Any]) -> dict[str, Any]:
        if h.get("t") == "ctl" and h.get("op") == "guard":
            h = {**h, "op": "release"}
        return h

    async def run() -> None:
        rcv = Receiver(tmp_path / "dst", KEY, on_control=on_control)
        port = await rcv.start("127.0.0.1", 0)
        srv, pport = await _proxy(port, swap)
        try:
            body = {"key": "n1-j7", "src_node": 1, "src_job": "j7", "request": {}, "ckpt": "ckpt-3"}
            with pytest.raises(TransferError, match="MAC"):
                await send_control("127.0.0.1", pport, KEY, "guard", body)
            assert seen == [], f"the destination carried out a changed control message: {seen}"
            # straight to the endpoint it is carried out as sent
            assert await send_control("127.0.0.1", port, KEY, "guard", body) == {"guard": "n1-j7"}
            assert seen == [("guard", body)]
        finally:
            srv.close()
            await rcv.stop()

    asyncio.run(run())


def test_a_committed_answer_cannot_be_forged_on_the_path(tmp_path: Path) -> None:
    ckpt = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "src", install_signal=False).save(
        os.urandom(50_000), step=4)

    def forge(h: dict[str, Any]) -> dict[str, Any] | None:
        if h.get("t") == "offer":
            h["__answer"] = {"t": "committed", "digest": "", "path": "/nowhere/ckpt-4"}
            return None
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
