"""Node keys (laminar.zone.keys.PairKeys): a zone member cannot sign as another, whatever
address it sends from.

The zone key proves that a zone member signed, not which one; the source-address check binds a
node id to its roster address but not against a host that can send from that address. With a
node key per node (its X25519 public key in the roster), every datagram and hand-over frame
between two nodes with keys is signed with their pair key, HMAC(zone key, label | DH | ids): a
third member holds the zone key but not the pair's DH secret. These tests run the derivation,
the decoder, the config checks and real ZoneComponents on loopback (real UDP and TCP sockets,
real key files). The forgeries here are sent with ``check_source = false``, to isolate the MAC
property from the address check (the cluster test tests/cluster/test_node_keys_cluster.py
sends one from the claimed sender's own address instead)."""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import secrets
import struct
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from test_zone_handover import SubmittingJobs
from test_zone_wrong_source import SUMMARY, _delivered, _port, forged, with_nodes

from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import HANDOVER_OK, ZoneComponent, demand_to_probe
from laminar.zone.keys import (
    KeyFileError,
    PairKeys,
    ZoneKeys,
    generate_node_key,
    load_node_key,
    parse_keys,
    public_key,
)
from laminar.zone.membership import MembershipError, members_from_config

# a hand-over names its job's owner (a missing one is refused: laminar.zone.authority); nobody
# has an account on every Debian host and needs no zone.root_from
NOBODY_IDS = {"owner_uid": 65534, "owner_gid": 65534}

ZK, NEW = secrets.token_bytes(32), secrets.token_bytes(32)
PRIV = {n: secrets.token_bytes(32) for n in (1, 2, 3)}
PUB = {n: public_key(k) for n, k in PRIV.items()}
REPO = Path(__file__).resolve().parents[2]


def pairs(n: int) -> PairKeys:
    return PairKeys(n, PRIV[n], PUB)


# --------------------------------------------------------------------------- derivation


def test_a_pair_key_is_the_same_from_both_ends_and_differs_per_pair_and_per_zone_key() -> None:
    p = {n: pairs(n) for n in PRIV}
    assert p[1].key(ZK, 2) == p[2].key(ZK, 1)
    assert p[1].key(ZK, 3) == p[3].key(ZK, 1) and p[2].key(ZK, 3) == p[3].key(ZK, 2)
    derived = {p[1].key(ZK, 2), p[1].key(ZK, 3), p[2].key(ZK, 3), p[1].key(NEW, 2), p[1].key(NEW, 3)}
    assert len(derived) == 5 and ZK not in derived and NEW not in derived
    # the documented derivation (docs/protocol.md, Node keys), from a DH computed independently
    dh = X25519PrivateKey.from_private_bytes(PRIV[2]).exchange(X25519PublicKey.from_public_bytes(PUB[1]))
    assert p[1].key(ZK, 2) == hmac.digest(ZK, b"laminar-pair-v1" + dh + struct.pack("!II", 1, 2), "sha256")
    # the zone key stays the root: the same node keys under another zone key give another key
    assert PairKeys(1, PRIV[1], PUB).key(NEW, 2) == p[2].key(NEW, 1) != p[2].key(ZK, 1)


# --------------------------------------------------------------------------- the decoder

KNOWN = {1: 1, 2: 1, 3: 1, 4: 1}  # node 4 has no pubkey in the roster


def test_a_receiver_takes_only_the_pair_mac_from_a_sender_with_a_node_key() -> None:
    keys = ZoneKeys({1: ZK}, "t")
    now = time.time()
    dec = wire.Decoder(keys, KNOWN, node=1, pairs=pairs(1))
    genuine = wire.Encoder(2, keys, seq0=1000, pairs=pairs(2))
    assert dec.decode(genuine.encode(wire.Release(1), 1, now, to=1), now).node == 2

    # node 3 holds the zone key: it signs as node 2 with it (far ahead in sequence), and with its
    # own pair key with node 1
    zone_mac = wire.Encoder(2, keys, seq0=10**12).encode(wire.Release(2), 1, now, to=1)
    own_pair = wire.Encoder(2, keys, seq0=10**12 + 5, pairs=pairs(3)).encode(wire.Release(3), 1, now, to=1)
    for data in (zone_mac, own_pair):
        with pytest.raises(wire.Dropped) as e:
            dec.decode(data, now)
        assert e.value.reason is wire.DropReason.BAD_MAC
    assert dec.stats()["bad_mac"] == 2 and dec.stats()["accepted"] == 1
    # the forgeries took no sequence number: node 2's next one (far below theirs) passes
    assert dec.decode(genuine.encode(wire.Release(4), 1, now, to=1), now).body == wire.Release(4)

    # without node keys (the decoder as before) the zone-key forgery is taken as node 2's
    old = wire.Decoder(keys, KNOWN, node=1)
    assert old.decode(zone_mac, now).node == 2


def test_a_sender_without_a_pubkey_keeps_the_zone_key_mac_both_ways() -> None:
    keys = ZoneKeys({1: ZK}, "t")
    now = time.time()
    dec1 = wire.Decoder(keys, KNOWN, node=1, pairs=pairs(1))
    four = wire.Encoder(4, keys, seq0=1)  # node 4: no node key, no pubkey in the roster
    assert dec1.decode(four.encode(wire.Heartbeat(9), 1, now, to=1), now).body == wire.Heartbeat(9)
    # node 1 (with a key) signs what goes to node 4 with the zone key, which node 4 checks
    dec4 = wire.Decoder(keys, KNOWN, node=4)
    one = wire.Encoder(1, keys, seq0=1, pairs=pairs(1))
    assert dec4.decode(one.encode(wire.Heartbeat(1), 1, now, to=4), now).node == 1
    # and a pair MAC to a receiver without node keys does not verify there
    with pytest.raises(wire.Dropped, match="bad_mac"):
        wire.Decoder(keys, KNOWN, node=1).decode(wire.Encoder(2, keys, seq0=5, pairs=pairs(2)).encode(
            wire.Heartbeat(2), 1, now, to=1), now)


def test_pair_macs_follow_a_zone_key_rotation_and_count_under_the_zone_key() -> None:
    """Node 2 has made NEW current (step 2 of a rotation), node 1 lists it as next (step 1):
    node 1 verifies node 2's pair MAC under NEW, counted as its next key; a reload of node 1's
    file takes effect for pair keys too."""
    step1 = parse_keys(f"1 {ZK.hex()}\n1 {NEW.hex()} next\n", "k1")
    step2 = parse_keys(f"1 {NEW.hex()}\n1 {ZK.hex()} previous\n", "k2")
    now = time.time()
    dec = wire.Decoder(step1, KNOWN, node=1, pairs=pairs(1))
    two = wire.Encoder(2, step2, seq0=1, pairs=pairs(2))
    assert dec.decode(two.encode(wire.Release(1), 1, now, to=1), now).node == 2
    assert [(k["role"], k["verified"]) for k in dec.key_stats()] == [("current", 0), ("next", 1)]
    dec.keys = parse_keys(f"1 {NEW.hex()}\n", "k3")  # node 1 removed ZK: node 2's pair MAC under NEW still passes
    assert dec.decode(two.encode(wire.Release(2), 1, now, to=1), now).node == 2
    old = wire.Encoder(2, step1, seq0=10, pairs=pairs(2))  # one still signing under ZK: refused now
    with pytest.raises(wire.Dropped, match="bad_mac"):
        dec.decode(old.encode(wire.Release(3), 1, now, to=1), now)


def test_a_roll_out_through_accept_send_require_drops_nothing_between_nodes_of_adjacent_modes() -> None:
    """The roll-out (docs/operations.md, Node keys): every node restarted with the pubkeys and
    ``node_keys = accept``, then all with ``send``, then all with ``require``. Two nodes one step
    apart (or one not restarted yet, whose roster lists no pubkeys) always take each other's
    datagrams; with ``require`` on both, pair MACs only. Before (``require`` alone), a node on the
    new roster and one not yet restarted dropped each other's traffic until both ran it."""
    keys = ZoneKeys({1: ZK}, "t")
    now = time.time()
    known = {1: 1, 2: 1}
    seq = iter(range(1, 10**6))

    def node(n: int, mode: str | None) -> tuple[wire.Encoder, wire.Decoder]:
        p = None if mode is None else PairKeys(n, PRIV[n], PUB, mode=mode)  # None: not restarted yet
        return (wire.Encoder(n, keys, seq0=next(seq) * 1000, pairs=p),
                wire.Decoder(keys, known, node=n, pairs=p))

    steps = [(None, "accept"), ("accept", "accept"), ("accept", "send"), ("send", "send"), ("send", "require"),
             ("require", "require")]
    for m1, m2 in steps:
        (e1, d1), (e2, d2) = node(1, m1), node(2, m2)
        assert d2.decode(e1.encode(wire.Heartbeat(1), 1, now, to=2), now).node == 1, (m1, m2)
        assert d1.decode(e2.encode(wire.Heartbeat(2), 1, now, to=1), now).node == 2, (m1, m2)
        assert d1.stats()["bad_mac"] == d2.stats()["bad_mac"] == 0
        assert [k["verified"] for k in d1.key_stats()] == [1]  # counted under the zone key, whichever verified
    # what each mode signs with: the zone key (accept) or the pair key (send, require)
    plain = wire.Decoder(keys, known, node=2)  # checks zone-key MACs only
    assert plain.decode(node(1, "accept")[0].encode(wire.Heartbeat(3), 1, now, to=2), now).node == 1
    for mode in ("send", "require"):
        with pytest.raises(wire.Dropped, match="bad_mac"):
            plain.decode(node(1, mode)[0].encode(wire.Heartbeat(4), 1, now, to=2), now)
    # a pair MAC verifies in every mode; a zone-key MAC from a peer with a pubkey only before require
    # (the transition's price: until then a member holding the zone key can still sign as another)
    zone_mac = wire.Encoder(2, keys, seq0=10**12).encode(wire.Release(5), 1, now, to=1)
    for mode in ("accept", "send"):
        assert node(1, mode)[1].decode(zone_mac, now).node == 2
    with pytest.raises(wire.Dropped, match="bad_mac"):
        node(1, "require")[1].decode(zone_mac, now)


def test_an_unknown_node_keys_mode_is_refused_naming_the_value(tmp_path: Path) -> None:
    import laminar.zone.component  # noqa: F401  (registers [zone])
    from laminar.config import ConfigError, load

    p = tmp_path / "laminard.toml"
    p.write_text('[zone]\nnode_keys = "optional"\n')
    with pytest.raises(ConfigError, match=r"zone\.node_keys.*optional.*accept, send, require"):
        load(p)
    p.write_text('[zone]\nnode_keys = "accept"\n')
    assert load(p).section("zone")["node_keys"] == "accept"
    with pytest.raises(ValueError, match="zone.node_keys = 'optional': expected one of accept, send, require"):
        PairKeys(1, PRIV[1], PUB, mode="optional")


# --------------------------------------------------------------------------- config


def row(n: int, **kw: object) -> dict[str, object]:
    return {"id": n, "zone": 1, "addr": f"10.0.0.{n}", **kw}


@pytest.mark.parametrize("value", ["ab" * 31, "zz" * 32, "ab" * 33, 12, PUB[1].hex() + " ", ""],
                         ids=["short", "not-hex", "long", "int", "trailing-space", "empty"])
def test_a_malformed_roster_pubkey_is_refused_naming_the_node_and_value(value: object) -> None:
    with pytest.raises(MembershipError) as e:
        members_from_config([row(1), row(2, pubkey=value)], 7440, 7441)
    assert f"zone.nodes[1] (node 2): pubkey {value!r} is not a node public key: expected 64 hex digits" in str(e.value)


def test_one_pubkey_for_two_nodes_is_refused() -> None:
    with pytest.raises(MembershipError, match=r"zone.nodes\[2\] \(node 3\): pubkey '[0-9a-f]{64}' is node 1's too"):
        members_from_config([row(1, pubkey=PUB[1].hex()), row(2), row(3, pubkey=PUB[1].hex())], 7440, 7441)
    m = members_from_config([row(1, pubkey=PUB[1].hex().upper()), row(2)], 7440, 7441)
    assert m[0].pubkey == PUB[1] and m[1].pubkey == b""


def start_error(tmp_path: Path, node_key: Path, own_pub: bytes) -> str:
    """Start a ZoneComponent as node 1 of a roster giving it ``own_pub``; the start's error."""
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {ZK.hex()}\n")
    os.chmod(keys, 0o600)
    nodes = [row(1, addr="127.0.0.1:1", pubkey=own_pub.hex()), row(2, addr="127.0.0.2:1", pubkey=PUB[2].hex())]
    comp = ZoneComponent(settings={"node_id": 1, "nodes": nodes, "keys_file": str(keys), "node_key_file": str(node_key),
                                   "port": _port("127.0.0.1", 2), "handover_port": _port("127.0.0.1", 1)},
                         gpus=1, loan={"elastic_interval_s": 0})

    async def go() -> str:
        try:
            await comp.start(None)
        except (KeyFileError, RuntimeError) as e:
            return str(e)
        finally:
            await comp.stop()
        raise AssertionError("the start went through")

    return asyncio.run(go())


def test_a_node_key_that_is_not_the_rosters_stops_the_start_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    mine = generate_node_key(path)
    err = start_error(tmp_path, path, PUB[1])
    assert f"lists node 1's pubkey as {PUB[1].hex()}, but {path} is the private key of pubkey {mine.hex()}" in err, err
    assert load_node_key(path) and public_key(load_node_key(path)) == mine


def test_an_unsafe_missing_or_malformed_node_key_file_stops_the_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    assert f"node key: {path} does not exist; create it with 'laminarctl zone keys node-gen" in start_error(
        tmp_path, path, PUB[1])
    pub = generate_node_key(path)
    os.chmod(path, 0o640)
    assert f"node key: {path} has mode 0640; it must be readable by its owner only (chmod 600 {path})" in start_error(
        tmp_path, path, pub)
    os.chmod(path, 0o600)
    path.write_text("# a key\nnot hex at all\n")
    assert f"node key: {path}: the key is not 64 hex digits" in start_error(tmp_path, path, pub)


def test_node_gen_writes_a_0600_key_and_prints_its_roster_line_and_never_replaces_one(tmp_path: Path) -> None:
    out = tmp_path / "node.key"
    ctl = [str(REPO / ".venv" / "bin" / "laminarctl"), "zone", "keys", "node-gen", "--out", str(out)]
    r = subprocess.run(ctl, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert os.stat(out).st_mode & 0o777 == 0o600
    pub = public_key(load_node_key(out)).hex()
    assert f'pubkey = "{pub}"' in r.stdout.splitlines()
    again = subprocess.run(ctl, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "exists already" in again.stderr and public_key(load_node_key(out)).hex() == pub
    js = subprocess.run([*ctl[:-1], str(tmp_path / "n2.key"), "-o", "json"], capture_output=True, text=True, timeout=60)
    assert json.loads(js.stdout)["pubkey"] == public_key(load_node_key(tmp_path / "n2.key")).hex()


# --------------------------------------------------------------------------- real components

HOSTS = {1: "127.0.0.1", 2: "127.0.0.2", 3: "127.0.0.3"}


@pytest.mark.parametrize("node_keys", [False, True], ids=["zone-key-only", "node-keys"])
def test_a_member_signing_as_another_is_believed_only_without_node_keys(tmp_path: Path, node_keys: bool) -> None:
    """Node 3 signs a summary as node 2 with the zone key (and once with its own node key) and
    sends it to node 1; check_source is off. Without node keys node 1 believes it (the hole);
    with them it drops both as bad_mac and keeps nothing, and node 2's own summary is taken."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        dst = (n1.membership.by_node[1].addr, n1.membership.by_node[1].port)
        before = n1.endpoint.received
        n3.endpoint.sock.sendto(forged(n3, 2, 1, SUMMARY), dst)
        n3.endpoint.sock.sendto(wire.Encoder(2, n3.keys, seq0=10**18, pairs=n3.pairs).encode(
            SUMMARY, 1, n3.wall(), to=1), dst)
        await _delivered(n1, before, 2)
        kept = n1.membership.state[2].last_summary
        if not node_keys:
            assert kept is not None and kept.memory_mb == 77_777 and n1.decoder.drops["bad_mac"] == 0
            return
        assert kept is None or kept.memory_mb != 77_777, "a summary signed as node 2 by node 3 was kept"
        assert n1.decoder.drops["bad_mac"] == 2 and n1.stats()["drops"]["bad_mac"] == 2
        before = n1.endpoint.received
        n2.endpoint.send_to(1, dst, SUMMARY, to=1)
        await _delivered(n1, before)
        kept = n1.membership.state[2].last_summary
        assert kept is not None and kept.memory_mb == 77_777 and n1.decoder.drops["bad_mac"] == 2
        assert n1.keyring.node_key_info() == {"file": str(tmp_path / "node1.key"), "pubkey": n1.pairs.public.hex(),  # type: ignore[union-attr]
                                      "mode": "require", "pair_peers": [2, 3]}

    asyncio.run(with_nodes(tmp_path, HOSTS, body, node_keys=HOSTS if node_keys else (), check_source=False))


def test_a_hand_over_signed_as_node_2_by_node_3_is_refused_and_node_2s_goes_through(tmp_path: Path) -> None:
    """With node keys and check_source off, node 3 hands node 1 a job in node 2's name over TCP
    (zone key MAC): refused unanswered as bad_mac, nothing started. Node 2's own hand-over, pair
    MAC both ways (its frame, node 1's ack), starts the job."""
    tables = {n: SubmittingJobs(tmp_path / f"state{n}") for n in (1, 2, 3)}
    spec = json.dumps({"spec": {"command": ["sleep", "1"], "name": "in-2s-name"}, **NOBODY_IDS}).encode()

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        pid = 0x2B0C
        assert isinstance(n1.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 30.0)), wire.Offer)
        me = n1.membership.by_node[1]
        reader, writer = await asyncio.open_connection(me.addr, me.handover_port, local_addr=("127.0.0.2", 0))
        try:
            writer.write(wire.frame(forged(n3, 2, 1, wire.Handover(pid, spec), max_size=wire.MAX_FRAME)))
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(65536), 5.0)
        finally:
            writer.close()
        assert answer == b"" and not tables[1].jobs and n1.counts["handovers"] == 0
        assert n1.tcp_decoder is not None and n1.stats()["handover_drops"]["bad_mac"] == 1

        ack = await n2.submitter.t.handover(1, 0, wire.Handover(pid, spec), 5.0)
        assert ack.status == HANDOVER_OK, ack
        assert n1.counts["handovers"] == 1 and len(tables[1].jobs) == 1
        assert n1.tcp_decoder.drops["bad_mac"] == 1 and n2.tcp_decoder is not None and n2.tcp_decoder.accepted == 1

    asyncio.run(with_nodes(tmp_path, HOSTS, body, jobs=tables.get, node_keys=HOSTS, check_source=False))


def test_a_zone_with_a_node_still_without_a_key_keeps_talking_to_it(tmp_path: Path) -> None:
    """Mixed roll-out: nodes 1 and 2 have keys and pubkeys, node 3 not yet. Node 3 and node 1
    talk with the zone key both ways; node 2's traffic to node 1 is pair-signed, and node 3
    still cannot sign as node 2 (bad_mac). Node 3 reads no node key file (it has none)."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2, n3 = comps[1], comps[2], comps[3]
        assert n3.pairs is None and not (tmp_path / "node3.key").exists()
        assert n1.pairs is not None and n1.pairs.covers(2) and not n1.pairs.covers(3)
        dst1 = (n1.membership.by_node[1].addr, n1.membership.by_node[1].port)
        dst3 = (n3.membership.by_node[3].addr, n3.membership.by_node[3].port)
        before1, before3 = n1.endpoint.received, n3.endpoint.received
        n3.endpoint.send_to(1, dst1, SUMMARY, to=1)
        n2.endpoint.send_to(1, dst1, wire.Heartbeat(5), to=1)
        n1.endpoint.send_to(1, dst3, wire.Heartbeat(6), to=3)
        await _delivered(n1, before1, 2)
        await _delivered(n3, before3, 1)
        # (the summary rounds at start are real traffic too: every datagram counts, none is refused)
        assert n1.decoder.drops["bad_mac"] == 0 and n3.decoder.drops["bad_mac"] == 0
        assert n1.membership.state[3].last_summary is not None
        assert n1.membership.state[2].rx >= 1 and n3.membership.state[1].rx >= 1
        before1 = n1.endpoint.received
        n3.endpoint.sock.sendto(forged(n3, 2, 1, wire.Release(0x77)), dst1)
        await _delivered(n1, before1)
        assert n1.decoder.drops["bad_mac"] == 1

    asyncio.run(with_nodes(tmp_path, HOSTS, body, node_keys=(1, 2), check_source=False))


def test_real_components_in_accept_mode_take_a_zone_key_mac_from_a_peer_with_a_pubkey(tmp_path: Path) -> None:
    """``[zone] node_keys = "accept"`` on real components: the mode reaches the decoders and the
    keys' status, and a datagram signed with the zone key in node 2's name (what node 2 sends
    before its restart onto the new roster) is taken, where ``require`` drops it (above)."""

    async def body(comps: dict[int, ZoneComponent]) -> None:
        n1, n2 = comps[1], comps[2]
        assert n1.keyring.node_key_info()["mode"] == "accept"  # type: ignore[index]
        dst1 = (n1.membership.by_node[1].addr, n1.membership.by_node[1].port)
        before = n1.endpoint.received
        n2.endpoint.sock.sendto(forged(n2, 2, 1, SUMMARY), dst1)
        await _delivered(n1, before)
        assert n1.decoder.drops["bad_mac"] == 0
        kept = n1.membership.state[2].last_summary
        assert kept is not None and kept.memory_mb == 77_777

    asyncio.run(with_nodes(tmp_path, {1: "127.0.0.1", 2: "127.0.0.2"}, body, node_keys=(1, 2), check_source=False,
                           zone_settings={"node_keys": "accept"}))
