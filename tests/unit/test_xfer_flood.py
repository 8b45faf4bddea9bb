"""What an authenticated zone member can make a transfer endpoint hold and parse, over real
loopback connections to a real :class:`laminar.migrate.transfer.Receiver` (node 1 at
127.0.0.1; the member is node 2 at 127.0.0.2, holding the zone key: a compromised member).

Before:
- every authenticated connection took a 9 MiB buffer (an 8 MiB receive buffer and a 1 MiB send
  buffer, zero-filled: resident), and a member could hold as many as it liked;
- after the handshake a header could be 16 MiB of any message, parsed on the event loop
  (16 MiB of numbers: ~0.5 s) and, for a control message, serialized again to check its MAC
  (~0.5 s more);
- a chunk's payload (up to 64 MiB) was read before the endpoint knew of any offer.
Now a member holds at most ``gate.MEMBER_AUTHENTICATED`` authenticated connections, each with
a small buffer that grows only for an accepted offer; control headers are at most 64 KiB (a
keeper's ~1 MiB: it carries a job spec), an offer's 16 MiB; JSON over 64 KiB is parsed only
under ``MAX_SEPARATORS``, two of a member's at a time; a chunk before an offer is refused unread.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import psutil
from xferrig import KEY

from laminar.migrate import transfer as T
from laminar.migrate.transfer import Manifest, Receiver, TransferError, receive
from laminar.migrate.transfer.channel import MAX_SEPARATORS, _canon, _recv
from laminar.migrate.transfer.manifest import MAX_FILES
from laminar.migrate.transfer.send import _client_handshake, _connect
from laminar.zone import gate as G
from laminar.zone.gate import Gate

ROSTER = {1: "127.0.0.1", 2: "127.0.0.2"}


class Calls:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def __call__(self, node: str, op: str, body: Any) -> Any:
        self.seen.append((node, op, body))
        return {"ok": op}


async def _with(root: Path, body: Any, calls: Calls | None = None) -> Any:
    rcv = Receiver(root, KEY, on_control=calls, sources=ROSTER.get, gate=Gate(lambda: set(ROSTER.values())))
    port = await rcv.start("127.0.0.1", 0)
    try:
        return await body(rcv, port)
    finally:
        await rcv.stop()


async def _member(port: int) -> tuple[Any, asyncio.StreamWriter, bytes]:
    """An authenticated connection of node 2, from its roster address."""
    r, w = await _connect("127.0.0.1", port, "127.0.0.2")
    ch, ns = await _client_handshake(r, w, KEY, 0, "2")
    return ch, w, ns


async def _answer(ch: Any, timeout: float) -> str:
    try:
        hdr, _ = await _recv(ch, timeout)
        return f"answered {hdr}"
    except TransferError as e:
        return str(e)
    except (TimeoutError, OSError, asyncio.IncompleteReadError) as e:
        return f"no answer ({type(e).__name__})"


def test_a_member_holds_at_most_its_share_of_authenticated_connections_each_small(tmp_path: Path) -> None:
    n = G.MEMBER_AUTHENTICATED + 16
    me = psutil.Process()

    async def body(rcv: Receiver, port: int) -> None:
        before = me.memory_info().rss
        held, refused = [], []
        try:
            for _ in range(n):
                ch, w, _ns = await _member(port)
                held.append(w)
                got = await _answer(ch, 0.15)
                if not got.startswith("no answer"):
                    refused.append(got)
            grew = (me.memory_info().rss - before) >> 20
            # both ends of 48 connections in this process: 9 MiB a connection a side before
            assert grew < 48, f"{grew} MiB more resident memory for {n} authenticated idle connections"
            assert len(refused) == n - G.MEMBER_AUTHENTICATED, refused[:3]
            assert all("try again later" in x for x in refused), refused[:3]
            st = rcv.stats()
            assert st["authenticated"] == G.MEMBER_AUTHENTICATED and st["member_busy"] == len(refused), st
        finally:
            for w in held:
                w.close()
        await asyncio.sleep(0.2)
        assert rcv.stats()["authenticated"] == 0

    asyncio.run(_with(tmp_path, body))


def _numbers(size: int) -> bytes:
    k = max(1, (size - 2) // 2)
    return b"[" + b"0," * (k - 1) + b"0]"


def test_huge_headers_from_a_member_are_refused_before_they_are_parsed(tmp_path: Path) -> None:
    calls = Calls()
    big = _numbers(15 << 20)

    async def body(rcv: Receiver, port: int) -> None:
        async def ctl(op: str, raw_body: bytes) -> str:
            ch, w, ns = await _member(port)
            try:
                mac = T.mac(KEY, b"laminar-ctl", ns, op.encode(), raw_body)  # right: the member holds the key
                await ch.send_encoded(b'{"t":"ctl","op":"' + op.encode() + b'","body":' + raw_body
                                      + b',"mac":"' + mac.encode() + b'"}')
                return await _answer(ch, 30)
            finally:
                w.close()

        for op in ("space", "keeper"):
            got = await ctl(op, big)
            assert "exceeds 65536" in got and '{"t":"ctl","op":"keeper",...: 1114112' in got, got
        # an offer of 15 MiB of numbers: read, counted, refused unparsed
        ch, w, ns = await _member(port)
        await ch.send_encoded(b'{"t":"offer","manifest":' + big + b',"mac":"00"}')
        got = await _answer(ch, 30)
        w.close()
        assert "refused unparsed" in got and str(MAX_SEPARATORS) in got, got
        # a chunk before any offer, announcing 64 MiB it never sends: answered at once
        ch, w, ns = await _member(port)
        await ch.send({"t": "chunk", "i": 0, "len": 64 << 20})
        got = await _answer(ch, 5)
        w.close()
        assert "chunk before an offer" in got, got
        assert calls.seen == []
        st = rcv.stats()  # counted by reason: `laminarctl status -o json`, migrate.transfer_gate
        assert (st["too_large"], st["too_dense"], st["chunk_before_offer"]) == (2, 1, 1), st
        # a keeper of ~900 KB (a job spec's size) is read and acted on
        spec = {"key": "n2-job-1", "request": {"spec": {"command": ["true"], "env": {"PAD": "x" * 900_000}}}}
        got = await ctl("keeper", _canon(spec))
        assert got.startswith("answered") and [c[:2] for c in calls.seen] == [("2", "keeper")], got
        # ... and so is one under the op's old spelling, from an older peer (one release)
        got = await ctl("guard", _canon(spec))  # old spelling
        assert got.startswith("answered") and [c[:2] for c in calls.seen][1:] == [("2", "guard")], got  # old spelling

    asyncio.run(_with(tmp_path, body, calls))


def test_large_headers_are_read_a_few_at_a_time(tmp_path: Path) -> None:
    """Two of one member's at once (LARGE_PER_MEMBER), the rest wait; another member is not held
    up by them; LARGE_TOTAL in all."""

    async def body(rcv: Receiver, port: int) -> None:
        order: list[str] = []

        async def turn(node: str, tag: str, hold: asyncio.Event) -> None:
            async with rcv._large_turn(node):
                order.append(tag)
                await hold.wait()

        hold = asyncio.Event()
        tasks = [asyncio.create_task(turn("2", f"2.{i}", hold)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert order == ["2.0", "2.1"]  # the third waits its turn
        other = asyncio.create_task(turn("3", "3.0", hold))
        await asyncio.sleep(0.05)
        assert order[-1] == "3.0"
        hold.set()
        await asyncio.gather(*tasks, other)
        assert order[3] == "2.2" and rcv._large == {}
        assert receive.LARGE_PER_MEMBER == 2 and receive.LARGE_TOTAL >= 2 * receive.LARGE_PER_MEMBER

    asyncio.run(_with(tmp_path, body))


def test_a_manifest_of_more_files_than_a_transfer_takes_is_refused() -> None:
    body = {"v": T.MANIFEST_VERSION, "job_id": "j1", "ckpt_id": "ckpt-1", "chunk_size": 1 << 20,
            "files": [[f"f{i}", 0, "0" * 64] for i in range(MAX_FILES + 1)], "chunks": []}
    try:
        Manifest.from_body(json.loads(json.dumps(body)))
    except TransferError as e:
        assert f"more than the {MAX_FILES}" in str(e)
    else:
        raise AssertionError("a manifest of too many files was taken")


def test_a_handshake_that_drips_is_cut_at_one_deadline(tmp_path: Path, monkeypatch: Any) -> None:
    """The whole handshake has one deadline, counted ``slow`` when missed. It was a deadline per
    read (10 s: a length, then its message, for the hello and the auth), so a peer that sent each
    piece just in time held its connection ~40 s. Here the deadline is 1 s and the peer sends
    the hello's length after 0.7 s and the hello 0.7 s later: cut before any challenge."""
    monkeypatch.setattr(receive, "HANDSHAKE_DEADLINE_S", 1.0)
    hello = json.dumps({"t": "hello", "v": T.PROTOCOL_VERSION, "zone": 0, "node": "2", "nonce": "ab" * 32}).encode()

    async def body(rcv: Receiver, port: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        try:
            for piece in (struct.pack(">I", len(hello)), hello):
                await asyncio.sleep(0.7)
                w.write(piece)
                await w.drain()
            got = await asyncio.wait_for(r.read(4096), 5)
        except ConnectionError:
            got = b""
        finally:
            w.close()
        assert b"challenge" not in got, "a hello sent piece by piece, each in its read's time, got its challenge"
        assert rcv.stats()["slow"] == 1 and rcv.stats()["reading"] == 0

    asyncio.run(_with(tmp_path, body))
