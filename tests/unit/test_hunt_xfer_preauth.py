"""Transfer endpoint bugs found by the hunt, reproduced over real loopback sockets with a real
:class:`laminar.migrate.transfer.Receiver`:

- a peer that had not authenticated could make the endpoint read and parse a 16 MiB header
  (per connection), and hold as many connections in the handshake as it liked;
- malformed handshake fields (a nonce that is not a string, a zone that is not a number) ended
  the connection with an unhandled exception instead of a clear error.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
from xferrig import KEY, make_ckpt, with_receiver

from laminar.migrate import transfer
from laminar.migrate.transfer import (
    Receiver,
    send_checkpoint,
    verified_checkpoint,
)


async def _raw(port: int, frames: list[bytes]) -> dict[str, object]:
    """Sends raw frames before any authentication and returns the endpoint's answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        for f in frames:
            w.write(f)
        await w.drain()
        n = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 30))[0]
        return json.loads(await asyncio.wait_for(r.readexactly(n), 30))  # type: ignore[no-any-return]
    finally:
        w.close()


def _frame(hdr: object) -> bytes:
    raw = json.dumps(hdr).encode()
    return struct.pack(">I", len(raw)) + raw


def test_an_unauthenticated_peer_cannot_make_the_endpoint_read_a_large_header(tmp_path: Path) -> None:
    async def body(rcv: Receiver, port: int) -> None:
        big = 8 << 20  # announced before any authentication; the old limit was 16 MiB
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            w.write(struct.pack(">I", big))
            await w.drain()
            # the endpoint answers at once, without waiting for (and buffering) the 8 MiB
            n = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 30))[0]
            ans = json.loads(await asyncio.wait_for(r.readexactly(n), 30))
        finally:
            w.close()
        assert ans["t"] == "error" and "before authentication" in ans["msg"], ans
        # a normal send still works afterwards
        ckpt = make_ckpt(tmp_path, 10_000)
        res = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY)
        assert verified_checkpoint(res.remote_path)

    asyncio.run(with_receiver(tmp_path / "dst", body))


@pytest.mark.parametrize("hello", [
    {"t": "hello", "v": transfer.PROTOCOL_VERSION, "zone": 0, "node": "x", "nonce": 12345},
    {"t": "hello", "v": transfer.PROTOCOL_VERSION, "zone": [1], "node": "x", "nonce": "00" * 32},
    {"t": "hello", "v": transfer.PROTOCOL_VERSION, "zone": 0, "node": "x"},
])
def test_a_malformed_hello_gets_a_clear_error(tmp_path: Path, hello: dict[str, object]) -> None:
    async def body(rcv: Receiver, port: int) -> None:
        ans = await _raw(port, [_frame(hello)])
        assert ans["t"] == "error" and "hello" in str(ans["msg"]), ans

    asyncio.run(with_receiver(tmp_path / "dst", body))


def test_connections_still_authenticating_are_capped_per_address(tmp_path: Path) -> None:
    """Past its address's share (laminar.zone.gate.PER_SOURCE) a connection is reset at accept,
    unread, and counted (``source_busy``); the address authenticates again once they are gone."""
    from laminar.zone import gate

    cap = gate.PER_SOURCE
    n = cap + 24

    async def body(rcv: Receiver, port: int) -> None:
        conns = []
        for _ in range(n):
            try:
                conns.append(await asyncio.open_connection("127.0.0.1", port))
            except ConnectionError:
                pass  # reset at accept before connect() returned
        await asyncio.sleep(0.2)

        async def answer(r: asyncio.StreamReader) -> str:
            try:
                await asyncio.wait_for(r.readexactly(4), 60)
                return "answered"
            except (asyncio.IncompleteReadError, ConnectionError):
                return "closed"  # reset at accept, or held until the handshake's deadline

        try:
            st = rcv.stats()
            assert st["source_busy"] >= n - cap and st["reading"] <= cap, st
            answers = await asyncio.gather(*(answer(r) for r, _ in conns))
        finally:
            for _, w in conns:
                w.close()
        assert "answered" not in answers  # none was read: nothing was sent
        # the address can authenticate again once those are gone
        ckpt = make_ckpt(tmp_path, 10_000)
        res = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY)
        assert verified_checkpoint(res.remote_path)
        assert rcv.stats()["slow"] == cap  # the ones admitted were cut at the handshake's deadline

    asyncio.run(with_receiver(tmp_path / "dst", body))
