"""The checkpoint-transfer endpoint believes a sender's node id only when the handshake proves it
and the connection comes from that node's roster address (transfer protocol v3).

The ``hello`` names the sender's node (and zone); control messages are answered as asked by that
node (``reclaim-withdrawn`` forgets its reclaim notice, ``needs`` and ``dropped`` answer about
its jobs). Before, no MAC covered the hello, so a relay without the key could change the node
id, and any keeper of the zone key could name any node from anywhere. Shown over real loopback
TCP, each node on its own address (127.0.0.<node>):

- a relay without the key that changes the hello's node on the way: refused at the sender
  (the challenge MAC covers the hello as the destination read it) and at the destination (the
  ``auth`` MAC covers the hello as the sender wrote it); nothing is carried out;
- a key holder claiming node 2 from node 3's address: refused (``wrong_source``), counted in
  ``Receiver.wrong_source``, ``STATS.wrong_source`` and the metric; its control message is not
  carried out; the real node 2, from its address, is;
- the same through a real migrate component (test_gc_keepers' ``node``: stand-in zone
  membership, real transfer endpoint): an impostor's ``reclaim-withdrawn`` leaves node 2's
  reclaim notice in place and is counted in the migrate status; node 2's own forgets it;
- a peer of the previous protocol version (the real v2 module, from git) gets an error naming
  both versions, in either role.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_xfer_crypto import Relay, old_transfer
from xferrig import KEY, make_ckpt

from laminar.migrate import transfer
from laminar.migrate.transfer import (
    STATS,
    Receiver,
    StatsCollector,
    TransferError,
    send_checkpoint,
    send_control,
)

ROSTER = {1: "127.0.0.1", 2: "127.0.0.2", 3: "127.0.0.3"}  # node -> its [[zone.nodes]] address


class Calls:
    """An ``on_control`` that records what it was asked, by which node."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    def __call__(self, node: str, op: str, body: Any) -> Any:
        self.seen.append((node, op, body))
        return {"ok": node}


async def _with(root: Path, body: Callable[[Receiver, int], Any], calls: Calls, check: bool = True) -> Any:
    """Runs ``body(receiver, port)`` with a Receiver on 127.0.0.1 (node 1) under ``root`` that
    binds node ids to ROSTER's addresses (``check``) and records control messages in ``calls``."""
    rcv = Receiver(root, KEY, on_control=calls, sources=ROSTER.get if check else None)
    port = await rcv.start("127.0.0.1", 0)
    try:
        return await body(rcv, port)
    finally:
        await rcv.stop()


def _as_node_2(i: int, frame: bytes) -> list[bytes]:
    """A relay's ``up`` action: the first client frame (the hello) says node 2."""
    if i == 0:
        hello = json.loads(frame)
        hello["node"] = "2"
        frame = json.dumps(hello, separators=(",", ":")).encode()
    return [frame]


@pytest.mark.parametrize("check", [True, False], ids=["source-checked", "source-unchecked"])
def test_a_hello_whose_node_a_relay_changed_is_refused(tmp_path: Path, check: bool) -> None:
    """Node 3 asks; a relay without the key, connecting on from node 2's address, makes the
    hello say node 2. Refused with the source check on or off: the MACs cover the hello."""
    calls = Calls()

    async def body(rcv: Receiver, port: int) -> None:
        relay = Relay(port, up=_as_node_2, via="127.0.0.2")
        rport = await relay.start()
        try:
            with pytest.raises(TransferError, match="hello was changed on the way") as e:
                await send_control("127.0.0.1", rport, KEY, "reclaim-withdrawn", {"ts": time.time()}, node="3",
                                   local_host="127.0.0.3")
            assert e.value.fatal
        finally:
            relay.close()
        assert calls.seen == [], "a hello changed on the way must carry nothing out"
        # the same relay, unchanged, carries node 2's own message: it was the change that was refused
        plain = Relay(port, via="127.0.0.2")
        pport = await plain.start()
        try:
            assert await send_control("127.0.0.1", pport, KEY, "needs", {"key": "n1-job-1"}, node="2",
                                      local_host="127.0.0.2") == {"ok": "2"}
        finally:
            plain.close()
        assert [c[:2] for c in calls.seen] == [("2", "needs")]
        assert rcv.wrong_source == 0

    asyncio.run(_with(tmp_path, body, calls, check))


def _frame(m: dict[str, Any]) -> bytes:
    raw = json.dumps(m).encode()
    return struct.pack(">I", len(raw)) + raw


def _read(s: socket.socket) -> dict[str, Any]:
    def exactly(n: int) -> bytes:
        b = b""
        while len(b) < n:
            got = s.recv(n - len(b))
            assert got, "connection closed"
            b += got
        return b

    return json.loads(exactly(struct.unpack(">I", exactly(4))[0]))  # type: ignore[no-any-return]


def test_an_auth_over_another_hello_than_the_destination_read_is_refused(tmp_path: Path) -> None:
    """What the destination sees when a relay changed the hello and the sender went on (the
    sender's ``auth`` MAC covers the hello it wrote, node 3; the destination read node 2)."""
    calls = Calls()

    def client(port: int) -> dict[str, Any]:
        with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0)) as s:
            nc = secrets.token_bytes(32)
            s.sendall(_frame({"t": "hello", "v": transfer.PROTOCOL_VERSION, "zone": 0, "node": "2", "nonce": nc.hex()}))
            ns = bytes.fromhex(str(_read(s)["nonce"]))
            written = transfer.hello_identity(transfer.PROTOCOL_VERSION, 0, "3")
            s.sendall(_frame({"t": "auth", "mac": transfer.mac(KEY, b"laminar-xfer-client", ns, nc, written)}))
            return _read(s)

    async def body(rcv: Receiver, port: int) -> None:
        ans = await asyncio.to_thread(client, port)
        assert ans["t"] == "error" and "client failed authentication" in ans["msg"], ans
        assert calls.seen == []

    asyncio.run(_with(tmp_path / "dst", body, calls))


def test_a_key_holder_claiming_node_2_from_node_3s_address_is_refused_and_counted(tmp_path: Path) -> None:
    calls = Calls()
    before = STATS.wrong_source

    async def body(rcv: Receiver, port: int) -> None:
        for claimed, src in (("2", "127.0.0.3"), ("9", "127.0.0.3"), ("", "127.0.0.3"), ("02x", "127.0.0.2")):
            with pytest.raises(TransferError, match="wrong_source") as e:
                await send_control("127.0.0.1", port, KEY, "reclaim-withdrawn", {"ts": time.time()}, node=claimed,
                                   local_host=src)
            assert e.value.fatal
        assert "node 2's transfer connections come from 127.0.0.2" in str(
            await _refusal(port, "2", "127.0.0.3")), "the refusal names both addresses"
        assert calls.seen == [], "nothing a refused connection asked may be carried out"
        assert rcv.wrong_source == 5 and STATS.wrong_source - before == 5
        # a checkpoint from the impostor is refused too, at once (fatal: no retries)
        ckpt = make_ckpt(tmp_path, 10_000)
        with pytest.raises(TransferError, match="wrong_source"):
            await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, node="2", local_host="127.0.0.3", retries=3,
                                  retry_delay_s=0.05)
        assert rcv.committed == [] and rcv.wrong_source == 6
        # the real node 2, from its roster address: its message and its checkpoint are taken
        assert await send_control("127.0.0.1", port, KEY, "reclaim-withdrawn", {"ts": 1.0}, node="2",
                                  local_host="127.0.0.2") == {"ok": "2"}
        res = await send_checkpoint("127.0.0.1", port, ckpt, "j1", KEY, node="2", local_host="127.0.0.2")
        assert [c.peer_node for c in rcv.committed] == ["2"] and res.remote_path
        assert calls.seen == [("2", "reclaim-withdrawn", {"ts": 1.0})]
        assert rcv.wrong_source == 6

    asyncio.run(_with(tmp_path / "dst", body, calls))
    reg = CollectorRegistry()
    reg.register(StatsCollector())
    assert reg.get_sample_value("laminar_transfer_wrong_source_total") == STATS.wrong_source


async def _refusal(port: int, node: str, src: str) -> TransferError:
    try:
        await send_control("127.0.0.1", port, KEY, "space", {"bytes": 1}, node=node, local_host=src)
    except TransferError as e:
        return e
    raise AssertionError(f"node {node} from {src} was not refused")


def test_an_impostors_reclaim_withdrawn_changes_nothing_at_a_migrate_component(tmp_path: Path) -> None:
    """Node 1's real migrate component (zone roster: nodes 1, 2, 3 at 127.0.0.<node>) holds node
    2's reclaim notice. Node 3, a member with the zone key, says node 2 withdrew it: refused,
    counted in the migrate status, the notice stays. Node 2 says it: the notice goes."""
    from test_gc_keepers import KEY as ZONE_KEY
    from test_gc_keepers import free_port, node

    async def main() -> None:
        port = free_port()
        async with node(tmp_path, 1, [1, 2, 3], port) as a:
            a.agent.events.emit("zone", "node 2 reclaimed", node=2, deadline_ms=600_000)  # its zone notice
            assert 2 in a.notices
            with pytest.raises(TransferError, match="wrong_source"):
                await send_control("127.0.0.1", port, ZONE_KEY, "reclaim-withdrawn", {"ts": time.time()}, zone=1,
                                   node="2", local_host="127.0.0.3")
            assert 2 in a.notices, "an impostor must not make node 1 forget node 2's reclaim"
            assert a.status()["transfer_wrong_source"] == 1
            res = await send_control("127.0.0.1", port, ZONE_KEY, "reclaim-withdrawn", {"ts": time.time()}, zone=1,
                                     node="2", local_host="127.0.0.2")
            assert res["withdrawn"] == 2 and 2 not in a.notices
            assert a.status()["transfer_wrong_source"] == 1

    asyncio.run(main())


def _v2() -> ModuleType:
    return old_transfer("39865be", 2)  # protocol v2: a real old peer


def test_a_v2_peer_gets_an_error_naming_both_versions(tmp_path: Path) -> None:
    v2 = _v2()
    ckpt = make_ckpt(tmp_path, 50_000)

    async def run() -> None:
        new = Receiver(tmp_path / "new", KEY)
        old = v2.Receiver(tmp_path / "old", KEY)
        pn, po = await new.start("127.0.0.1", 0), await old.start("127.0.0.1", 0)
        try:
            with pytest.raises(v2.TransferError) as e1:  # an old source, a new destination
                await v2.send_checkpoint("127.0.0.1", pn, ckpt, "j1", KEY, retries=3, retry_delay_s=0.05)
            assert "source speaks transfer protocol v2, this agent v3" in str(e1.value) and e1.value.fatal
            with pytest.raises(TransferError) as e2:  # a new source, an old destination
                await send_checkpoint("127.0.0.1", po, ckpt, "j1", KEY, retries=3, retry_delay_s=0.05)
            assert "destination speaks transfer protocol v2, this agent v3" in str(e2.value) and e2.value.fatal
            assert "upgraded together" in str(e2.value)
            with pytest.raises(TransferError, match="destination speaks transfer protocol v2, this agent v3"):
                await send_control("127.0.0.1", po, KEY, "space", {"bytes": 1})
            assert new.committed == [] and old.committed == []
        finally:
            await new.stop()
            await old.stop()

    asyncio.run(run())
