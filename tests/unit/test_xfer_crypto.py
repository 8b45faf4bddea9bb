"""Checkpoint bytes are encrypted between agents (transfer protocol v2), shown over real
loopback sockets with a real sender, a real Receiver, and a relay in between that records every
byte on the wire and can change, replay or drop a frame (a handshake message or a record: both
are a 4-byte length and that many bytes).

- the wire carries no 64-byte window of the checkpoint, and the transfer still commits;
- a flipped ciphertext bit, a replayed or a dropped record ends the transfer, is counted, and
  nothing is committed; a control message changed on the way is not carried out;
- a transfer cut mid-way resumes over a new connection;
- a peer of the previous version (the real v1 module, from git) gets an error naming both
  versions, in either role.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from xferrig import KEY, make_ckpt

from laminar.migrate import transfer
from laminar.migrate.transfer import (
    STATS,
    Receiver,
    StatsCollector,
    TransferError,
    latest_verified,
    offer_room,
    send_checkpoint,
    send_control,
    verified_checkpoint,
)
from laminar.migrate.transfer.incoming import MARGIN_CAP

MB = 1 << 20
FIRST_RECORD = 2  # each side's frames: two handshake messages (hello/auth, challenge/ok), then records
Action = Callable[[int, bytes], list[bytes]]  # (frame index, frame) -> the frames to pass on instead


def _keep(_i: int, f: bytes) -> list[bytes]:
    return [f]


class Relay:
    """A TCP relay on loopback in front of ``upstream`` (connecting on from the address ``via``):
    records both directions' bytes in ``wire`` and passes each frame through ``up`` (client to
    server) or ``down`` on the first connection (later connections pass unchanged);
    ``cut_after``: closes the first connection after that many client frames. It holds no key."""

    def __init__(self, upstream: int, up: Action = _keep, down: Action = _keep, cut_after: int | None = None,
                 via: str = "127.0.0.1") -> None:
        self.upstream, self.up, self.down, self.cut_after, self.via = upstream, up, down, cut_after, via
        self.wire = bytearray()
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, act: Action, limit: int | None) -> None:
        for i in itertools.count():
            if limit is not None and i >= limit:
                return
            n = await r.readexactly(4)
            f = await r.readexactly(struct.unpack(">I", n)[0])
            for out in act(i, f):
                raw = struct.pack(">I", len(out)) + out
                self.wire += raw
                w.write(raw)
            await w.drain()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        first = self.connections == 0
        self.connections += 1
        sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream, local_addr=(self.via, 0))
        up = self._pump(cr, sw, self.up if first else _keep, self.cut_after if first else None)
        down = self._pump(sr, cw, self.down if first else _keep, None)
        tasks = [asyncio.ensure_future(up), asyncio.ensure_future(down)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # closed or cut: either is the end
            sw.close()
            cw.close()


def leak_at(plain: bytes, wire: bytes, window: int = 64) -> int | None:
    """The offset in ``wire`` of a piece of ``plain`` long enough to be part of every
    ``window``-byte window of it (an aligned half-window block), or None: a 64-byte window of
    ``plain`` found anywhere in ``wire`` always contains one."""
    half = window // 2
    blocks = {plain[k:k + half] for k in range(0, len(plain) - half + 1, half)}
    for j in range(len(wire) - half + 1):
        if wire[j:j + half] in blocks:
            return j
    return None


async def _with(root: Path, body: Callable[[Receiver, int], Any], **kw: Any) -> Any:
    """Runs ``body(receiver, port)`` with a Receiver(root, KEY, **kw) on 127.0.0.1."""
    rcv = Receiver(root, KEY, **kw)
    port = await rcv.start("127.0.0.1", 0)
    try:
        return await body(rcv, port)
    finally:
        await rcv.stop()


def test_the_wire_carries_no_window_of_the_checkpoint_and_it_still_commits(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 4 * MB + 12345)
    plain = b"".join(f.read_bytes() for f in sorted(ckpt.iterdir()))
    assert leak_at(plain, b"xx" + plain[70_007:70_071] + b"yy") is not None  # it finds any 64-byte window

    async def body(rcv: Receiver, port: int) -> tuple[Any, Relay]:
        relay = Relay(port)
        rport = await relay.start()
        try:
            # 1.5 MiB chunks: each chunk's bytes span two records (RECORD_MAX is 1 MiB)
            res = await send_checkpoint("127.0.0.1", rport, ckpt, "j1", KEY, chunk_size=3 * MB // 2, retries=0)
        finally:
            relay.close()
        return res, relay

    res, relay = asyncio.run(_with(tmp_path / "dst", body))
    wire = bytes(relay.wire)
    assert len(wire) > len(plain)  # it all went through the relay
    assert leak_at(plain, wire) is None
    m = transfer.build_manifest(ckpt, "j1", 3 * MB // 2)
    assert m.digest.encode() not in wire and m.chunks[0].encode() not in wire  # nor the manifest
    dst = verified_checkpoint(res.remote_path)
    for f in ckpt.iterdir():
        assert (dst / f.name).read_bytes() == f.read_bytes()


def _flip(at: int) -> Action:
    def act(i: int, f: bytes) -> list[bytes]:
        return [f[:10] + bytes([f[10] ^ 0x01]) + f[11:]] if i == at else [f]
    return act


def _replay(at: int) -> Action:
    def act(i: int, f: bytes) -> list[bytes]:
        return [f, f] if i == at else [f]
    return act


def _drop(at: int) -> Action:
    def act(i: int, f: bytes) -> list[bytes]:
        return [] if i == at else [f]
    return act


def _swap(at: int) -> Action:
    held: list[bytes] = []

    def act(i: int, f: bytes) -> list[bytes]:
        if i == at:
            held.append(f)
            return []
        if i == at + 1:
            return [f, *held]
        return [f]
    return act


@pytest.mark.parametrize("how", ["flip", "replay", "drop", "reorder"])
def test_a_changed_replayed_dropped_or_reordered_record_fails_the_transfer_counted_and_uncommitted(
        tmp_path: Path, how: str) -> None:
    ckpt = make_ckpt(tmp_path, MB)
    at = FIRST_RECORD + 7  # a record among the chunks (each chunk: its header's record, its bytes' record)
    act = {"flip": _flip, "replay": _replay, "drop": _drop, "reorder": _swap}[how](at)
    before = STATS.records_rejected

    async def body(rcv: Receiver, port: int) -> int:
        relay = Relay(port, up=act)
        rport = await relay.start()
        try:
            with pytest.raises(TransferError, match="failed authentication"):
                await send_checkpoint("127.0.0.1", rport, ckpt, "j1", KEY, chunk_size=64 << 10, retries=0)
        finally:
            relay.close()
        assert rcv.committed == []
        return rcv.records_rejected

    root = tmp_path / "dst"
    reg = CollectorRegistry()
    reg.register(StatsCollector())
    metric = reg.get_sample_value("laminar_transfer_records_rejected_total")
    assert asyncio.run(_with(root, body)) == 1
    assert STATS.records_rejected - before == 1
    assert reg.get_sample_value("laminar_transfer_records_rejected_total") == (metric or 0) + 1
    assert latest_verified(root, "j1") is None
    assert list((root / "checkpoints").iterdir()) == []


def test_a_changed_answer_fails_the_sender_counted(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, 300_000)
    before = STATS.records_rejected

    async def body(rcv: Receiver, port: int) -> int:
        relay = Relay(port, down=_flip(FIRST_RECORD))  # the destination's 'have'
        rport = await relay.start()
        try:
            with pytest.raises(TransferError, match="failed authentication"):
                await send_checkpoint("127.0.0.1", rport, ckpt, "j1", KEY, chunk_size=64 << 10, retries=0)
        finally:
            relay.close()
        assert rcv.committed == []
        return rcv.records_rejected

    assert asyncio.run(_with(tmp_path / "dst", body)) == 0  # the sender rejected it, not the receiver
    assert STATS.records_rejected - before == 1


def test_a_control_message_changed_on_the_way_is_not_carried_out(tmp_path: Path) -> None:
    seen: list[tuple[str, Any]] = []

    def on_control(node: str, op: str, body: Any) -> Any:
        seen.append((op, body))
        return {"ok": True}

    async def body(rcv: Receiver, port: int) -> int:
        relay = Relay(port, up=_flip(FIRST_RECORD))
        rport = await relay.start()
        try:
            with pytest.raises(TransferError, match="failed authentication"):
                await send_control("127.0.0.1", rport, KEY, "release", {"key": "n1-j7"})
        finally:
            relay.close()
        assert await send_control("127.0.0.1", port, KEY, "release", {"key": "n1-j7"}) == {"ok": True}
        return rcv.records_rejected

    assert asyncio.run(_with(tmp_path / "dst", body, on_control=on_control)) == 1
    assert seen == [("release", {"key": "n1-j7"})]  # only the one that came through unchanged


@pytest.mark.parametrize("how", ["cut", "flip"])
def test_a_transfer_broken_mid_way_resumes_over_a_new_connection(tmp_path: Path, how: str) -> None:
    ckpt = make_ckpt(tmp_path, MB)
    mid = FIRST_RECORD + 1 + 2 * 30  # the offer, then 30 chunks of 16 KiB (header and bytes each)

    async def body(rcv: Receiver, port: int) -> tuple[Any, int]:
        relay = Relay(port, cut_after=mid) if how == "cut" else Relay(port, up=_flip(mid))
        rport = await relay.start()
        try:
            res = await send_checkpoint("127.0.0.1", rport, ckpt, "j1", KEY, chunk_size=16 << 10, retries=3,
                                        retry_delay_s=0.05)
        finally:
            relay.close()
        return res, relay.connections

    res, conns = asyncio.run(_with(tmp_path / "dst", body))
    assert conns == 2 and res.attempts == 2
    assert 0 < res.skipped_bytes < res.total_bytes  # the second connection sent only what was missing
    dst = verified_checkpoint(res.remote_path)
    assert (dst / "state.bin").read_bytes() == (ckpt / "state.bin").read_bytes()


def old_transfer(rev: str, version: int) -> ModuleType:
    """The transfer module of protocol ``version`` as of git ``rev``, loaded from git: a real old
    peer (the test is skipped where the checkout lacks that history)."""
    repo = Path(__file__).resolve().parents[2]
    try:
        src = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:agent/laminar/migrate/transfer.py"],
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"protocol v{version} source not in this checkout's history: {e}")
    name = f"laminar_transfer_v{version}_{rev}"
    if name in sys.modules:
        return sys.modules[name]
    path = repo / ".git" / f"lm-transfer-v{version}-{rev}.py"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)  # noqa: S102  (the project's own old source)
    assert mod.PROTOCOL_VERSION == version
    return mod


def _v1() -> ModuleType:
    return old_transfer("f720e74", 1)


def test_an_old_version_peer_gets_an_error_naming_both_versions(tmp_path: Path) -> None:
    v1 = _v1()
    ckpt = make_ckpt(tmp_path, 200_000)

    async def run() -> None:
        new = Receiver(tmp_path / "new", KEY)
        old = v1.Receiver(tmp_path / "old", KEY)
        pn, po = await new.start("127.0.0.1", 0), await old.start("127.0.0.1", 0)
        try:
            with pytest.raises(v1.TransferError) as e1:  # an old source, a new destination
                await v1.send_checkpoint("127.0.0.1", pn, ckpt, "j1", KEY, retries=3, retry_delay_s=0.05)
            assert "v1" in str(e1.value) and f"v{transfer.PROTOCOL_VERSION}" in str(e1.value) \
                and "upgraded together" in str(e1.value)
            assert e1.value.fatal  # the old sender did not retry
            with pytest.raises(TransferError) as e2:  # a new source, an old destination
                await send_checkpoint("127.0.0.1", po, ckpt, "j1", KEY, retries=3, retry_delay_s=0.05)
            assert f"destination speaks transfer protocol v1, this agent v{transfer.PROTOCOL_VERSION}" in str(e2.value) \
                and e2.value.fatal
            with pytest.raises(TransferError, match=f"protocol v1, this agent v{transfer.PROTOCOL_VERSION}"):
                await send_control("127.0.0.1", po, KEY, "space", {"bytes": 1})
            assert new.committed == [] and old.committed == []
        finally:
            await new.stop()
            await old.stop()

    asyncio.run(run())


def test_offer_room_policy() -> None:
    fs = 100 * MB
    r = offer_room(10 * MB, 0, 0, fs, 20 * MB)
    assert (r.own, r.reserved, r.margin) == (14 * MB, 0, 5 * MB) and r.fits  # + one 4 MiB commit block, 5%
    assert not offer_room(10 * MB, 0, 2 * MB, fs, 20 * MB).fits  # transfers in progress count
    assert offer_room(10 * MB, 6 * MB, 2 * MB, fs, 20 * MB).fits  # a resumed transfer needs only the rest
    assert offer_room(MB, 0, 0, 1 << 50, 3 * MB, margin_bytes=0).own == 2 * MB  # a small one: its size again
    assert offer_room(MB, 0, 0, 1 << 50, 0).margin == MARGIN_CAP  # 5% of a huge disk is capped
    with pytest.raises(ValueError, match="reserved=-1"):
        offer_room(MB, 0, -1, fs, fs)
    with pytest.raises(ValueError, match="margin_bytes"):
        Receiver("/nonexistent", KEY, margin_bytes=-5)


def test_the_manifest_format_is_unchanged_so_copies_committed_before_v2_still_verify(tmp_path: Path) -> None:
    v1 = _v1()
    ckpt = make_ckpt(tmp_path, 100_000)

    async def run() -> str:
        old = v1.Receiver(tmp_path / "dst", KEY)
        port = await old.start("127.0.0.1", 0)
        try:
            return str((await v1.send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY)).remote_path)
        finally:
            await old.stop()

    path = asyncio.run(run())  # committed by a v1 agent
    assert verified_checkpoint(path) == Path(path)  # an upgraded agent still resumes from it
    assert os.path.exists(Path(path) / "VERIFIED")
