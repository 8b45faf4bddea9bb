"""Zone key rotation without downtime (laminar.zone.keys, laminar.zone.wire,
laminar.migrate.transfer's handshake): the key file's roles, refused-whole bad files, real UDP
datagrams between nodes on different steps of a rotation, which key verified, the checkpoint
transfer's handshake across a rotation, and a reload that keeps the old keys when the file is
bad. No privileges: loopback sockets and files in the test's directory."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from pathlib import Path

import pytest
from test_loan_component import free_port
from xferrig import make_ckpt

from laminar.migrate.transfer import Receiver, TransferError, send_checkpoint, verified_checkpoint
from laminar.zone import wire
from laminar.zone.component import ZoneComponent
from laminar.zone.keys import ANY_ZONE, KeyFileError, ZoneKeys, fingerprint, load_keys, parse_keys

OLD, NEW, OTHER = (secrets.token_bytes(32) for _ in range(3))


def keyfile(tmp_path: Path, text: str, name: str = "zone.keys") -> Path:
    p = tmp_path / name
    p.write_text(text)
    os.chmod(p, 0o600)
    return p


# the rotation's steps, as one node's key file for zone 1
STEP0 = f"1 {OLD.hex()}\n"  # today's format
STEP1 = f"1 {OLD.hex()}\n1 {NEW.hex()} next\n"
STEP2 = f"1 {NEW.hex()} current\n1 {OLD.hex()} previous\n"
STEP3 = f"1 {NEW.hex()}\n"


# --------------------------------------------------------------------------- the file format


def test_a_file_in_todays_format_means_what_it_meant() -> None:
    k = parse_keys(f"# keys\n1 {OLD.hex()}\n\n* {OTHER.hex()}  # wildcard\n", "k")
    assert k.get(1) == OLD and type(k.get(1)) is bytes  # no rotation: plain bytes, as before
    assert k.get(9) == OTHER and k.zones() == [1]
    assert k.accepted(1) == (("current", OLD),) and k.others == {}


def test_roles_give_each_zone_its_current_key_first_then_the_others() -> None:
    k = parse_keys(f"1 {NEW.hex()} current\n1 {OLD.hex()} previous\n1 {OTHER.hex()} next\n* {OTHER.hex()}\n", "k")
    assert k.get(1) == NEW  # signs with the current key
    assert k.accepted(1) == (("current", NEW), ("next", OTHER), ("previous", OLD))
    assert k.get(1).accepted == (NEW, OTHER, OLD)  # type: ignore[union-attr]
    assert k.accepted(5) == (("current", OTHER),)  # a zone named on its own lines takes no wildcard key
    assert k.entry(1) == 1 and k.entry(5) == ANY_ZONE
    assert [d["role"] for d in k.describe() if d["zone"] == 1] == ["current", "next", "previous"]
    assert {d["fingerprint"] for d in k.describe()} == {fingerprint(x) for x in (NEW, OLD, OTHER)}
    assert all(NEW.hex()[:8] not in str(d) for d in k.describe())


@pytest.mark.parametrize(
    "text,match",
    [
        (f"1 {OLD.hex()}\n1 {NEW.hex()} nxt\n", r"k:2: expected a role \(current, next, previous\).*'nxt'"),
        (f"1 {OLD.hex()}\n1 {NEW.hex()} next\n1 {OTHER.hex()} next\n", "k:3: zone 1 has two next keys"),
        (f"1 {OLD.hex()}\n1 {NEW.hex()} current\n", "k:2: zone 1 given twice"),
        (f"1 {OLD.hex()}\n1 {OLD.hex()} previous\n", "k:2: zone 1: this previous key is listed already"),
        (f"2 {OLD.hex()}\n1 {NEW.hex()} next\n", "k:2: zone 1 has no current key.*lists only next"),
        (f"* {NEW.hex()} previous\n", r"k:1: zone \* has no current key"),
        (f"1 {OLD.hex()}\n1 {NEW.hex()[:40]} next\n", "k:2: key for zone 1 has 20 bytes"),
        (f"1 {OLD.hex()} next now\n", "k:1: expected '<zone id> <hex key> \\[current|next|previous\\]', got 4"),
    ],
    ids=lambda v: None if "k:" in v else "file",  # no random key in an id: the same in every worker
)
def test_a_bad_file_is_refused_whole_naming_the_line(text: str, match: str) -> None:
    with pytest.raises(KeyFileError, match=match):
        parse_keys(text, "k")


# --------------------------------------------------------------------------- real datagrams


class Node:
    """One node's encoder, decoder and UDP socket on loopback (node id ``nid``, zone 1)."""

    def __init__(self, nid: int, keys: ZoneKeys) -> None:
        self.nid = nid
        self.enc = wire.Encoder(nid, keys)
        self.dec = wire.Decoder(keys, {1: 1, 2: 1, 3: 1}, node=nid)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(2.0)
        self.addr = self.sock.getsockname()

    def use(self, keys: ZoneKeys) -> None:
        """What a reload does (Keyring.reload_keys)."""
        self.enc.keys = keys
        self.dec.keys = keys

    def send(self, to: Node, pid: int) -> None:
        import time

        self.sock.sendto(self.enc.encode(wire.Release(pid), zone=1, now=time.time(), to=to.nid), to.addr)

    def receive(self) -> wire.Message:
        import time

        data, _ = self.sock.recvfrom(2048)
        return self.dec.decode(data, time.time())

    def verified(self) -> dict[str, int]:
        return {str(r["role"]): int(r["verified"]) for r in self.dec.key_stats()}  # type: ignore[call-overload]


def test_the_rotation_node_by_node_never_drops_a_datagram_between_any_two_nodes() -> None:
    """Three nodes step through the rotation one at a time (each step is one node's reload);
    after every single reload every node sends to every other over real UDP, and every
    datagram is accepted. The counters show which key verified: at the end only the new one."""
    steps = [parse_keys(t, f"step{i}") for i, t in enumerate((STEP0, STEP1, STEP2, STEP3))]
    nodes = [Node(n, steps[0]) for n in (1, 2, 3)]
    try:
        pid = 0
        for step in steps[1:]:
            for node in nodes:
                node.use(step)
                for a in nodes:
                    for b in nodes:
                        if a is not b:
                            pid += 1
                            a.send(b, pid)
                            msg = b.receive()  # raises Dropped (bad_mac) if b cannot verify a's key
                            assert msg.body == wire.Release(pid) and msg.node == a.nid
        for node in nodes:
            assert node.dec.stats()["bad_mac"] == 0
            assert node.dec.stats()["accepted"] == 3 * 3 * 2  # 3 steps x 3 reloads x 2 senders
        # the old key verified datagrams on the way (as next/previous) and the new one as next
        # then current; after step 3 each node lists only the new key, with its count carried
        # over from its earlier roles
        before = {n.nid: n.verified()["current"] for n in nodes}
        for a in nodes:
            for b in nodes:
                if a is not b:
                    pid += 1
                    a.send(b, pid)
                    b.receive()
        for n in nodes:
            assert set(n.verified()) == {"current"} and n.verified()["current"] == before[n.nid] + 2
    finally:
        for n in nodes:
            n.sock.close()


def test_the_current_key_is_tried_first_and_a_fallback_is_counted_with_when() -> None:
    a, b = wire.Encoder(1, parse_keys(STEP2, "a")), wire.Decoder(parse_keys(STEP1, "b"), {1: 1}, node=2)
    b.decode(a.encode(wire.Heartbeat(1), zone=1, now=100.0, to=2), now=100.0)
    rows = {r["role"]: r for r in b.key_stats()}
    assert rows["next"]["verified"] == 1 and rows["next"]["last_verified"] == 100.0
    assert rows["current"]["verified"] == 0 and rows["current"]["last_verified"] is None
    # a key outside the zone's list is still refused
    c = wire.Encoder(1, parse_keys(f"1 {OTHER.hex()}\n", "c"))  # node 1 (a member), another key
    with pytest.raises(wire.Dropped, match="bad_mac"):
        b.decode(c.encode(wire.Heartbeat(1), zone=1, now=100.0, to=2), now=100.0)


def test_a_node_that_skipped_step_one_is_dropped_as_bad_mac() -> None:
    """Why step 1 must be done everywhere before step 2: a node still on the old key alone
    drops what a node on step 2 signs with the new one."""
    a, b = wire.Encoder(1, parse_keys(STEP2, "a")), wire.Decoder(parse_keys(STEP0, "b"), {1: 1}, node=2)
    with pytest.raises(wire.Dropped, match="bad_mac"):
        b.decode(a.encode(wire.Heartbeat(1), zone=1, now=100.0, to=2), now=100.0)


# --------------------------------------------------------------------------- the transfer handshake


@pytest.mark.parametrize("src_step,dst_step", [(STEP1, STEP2), (STEP2, STEP1), (STEP2, STEP3), (STEP3, STEP2),
                                               (STEP0, STEP1), (STEP1, STEP0)],
                         ids=["1-2", "2-1", "2-3", "3-2", "0-1", "1-0"])
def test_a_checkpoint_moves_between_nodes_on_neighbouring_steps(tmp_path: Path, src_step: str, dst_step: str) -> None:
    """Real Receiver and sender on loopback; the destination's key lookup is its ZoneKeys.get
    (as the reclaim component's), the source signs with its current key."""
    ck = make_ckpt(tmp_path, 200_000)
    dst = parse_keys(dst_step, "dst")
    src_key = parse_keys(src_step, "src").get(1)
    assert src_key is not None

    async def go() -> None:
        rcv = Receiver(tmp_path / "dst", dst.get)
        port = await rcv.start("127.0.0.1", 0)
        try:
            res = await send_checkpoint("127.0.0.1", port, ck, "j1", src_key, zone=1, node="1", chunk_size=64 << 10)
            assert verified_checkpoint(res.remote_path) is not None
        finally:
            await rcv.stop()

    asyncio.run(go())


def test_a_source_whose_key_the_destination_does_not_list_is_refused(tmp_path: Path) -> None:
    ck = make_ckpt(tmp_path, 10_000)
    dst = parse_keys(STEP2, "dst")

    async def go() -> None:
        rcv = Receiver(tmp_path / "dst", dst.get)
        port = await rcv.start("127.0.0.1", 0)
        try:
            with pytest.raises(TransferError, match="failed authentication"):
                await send_checkpoint("127.0.0.1", port, ck, "j1", OTHER, zone=1, node="1", retries=0)
        finally:
            await rcv.stop()

    asyncio.run(go())


# --------------------------------------------------------------------------- reload in the component


def test_reload_takes_a_good_file_and_refuses_a_bad_one_whole(tmp_path: Path) -> None:
    """A real ZoneComponent on loopback: a reload switches its encoder and both decoders; a
    bad file (a good first line, a bad second one) changes nothing."""
    keys = keyfile(tmp_path, STEP0)
    port = free_port(socket.SOCK_DGRAM)
    nodes = [{"id": 1, "zone": 1, "addr": f"127.0.0.1:{port}"},
             {"id": 2, "zone": 1, "addr": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"}]
    settings = {"node_id": 1, "nodes": nodes, "keys_file": str(keys), "listen": "127.0.0.1", "port": port, "handover_port": free_port(socket.SOCK_STREAM),
                "cpus": 4, "memory_mb": 4000}
    comp = ZoneComponent(settings=settings, gpus=1, loan={"elastic_interval_s": 0})

    async def go() -> None:
        await comp.start(None)
        try:
            assert comp.encoder is not None and comp.decoder is not None and comp.tcp_decoder is not None
            keyfile(tmp_path, STEP1)
            res = comp.keyring.reload_keys()
            assert [(k["role"], k["fingerprint"]) for k in res["keys"]] == [("current", fingerprint(OLD)),
                                                                            ("next", fingerprint(NEW))]
            assert comp.decoder.keys is comp.tcp_decoder.keys is comp.encoder.keys is comp.keys
            peer = wire.Encoder(2, parse_keys(STEP2, "peer"))
            import time

            comp.decoder.decode(peer.encode(wire.Heartbeat(1), zone=1, now=time.time(), to=1), time.time())
            keyfile(tmp_path, f"1 {NEW.hex()}\n1 {OLD.hex()} previus\n")
            with pytest.raises(KeyFileError, match=r"zone.keys:2: expected a role"):
                comp.keyring.reload_keys()
            assert comp.keys.accepted(1) == (("current", OLD), ("next", NEW))  # unchanged
            keyfile(tmp_path, f"2 {NEW.hex()}\n")  # no key for this node's zone
            with pytest.raises(KeyFileError, match="no key for zone 1"):
                comp.keyring.reload_keys()
            os.chmod(keys, 0o644)
            with pytest.raises(KeyFileError, match="mode 0644"):
                comp.keyring.reload_keys()
            assert comp.keys.get(1) == OLD
            rows = {r["role"]: r["verified"] for r in comp.keyring.key_stats()}
            assert rows == {"current": 0, "next": 1}
        finally:
            await comp.stop()

    asyncio.run(go())


def test_load_keys_reads_roles_from_a_file(tmp_path: Path) -> None:
    p = keyfile(tmp_path, STEP2)
    k = load_keys(p, need_zones=[1])
    assert k.get(1) == NEW and k.accepted(1)[1] == ("previous", OLD)
