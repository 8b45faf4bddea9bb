"""The zone wire format and key loading (laminar.zone.wire, laminar.zone.keys): no privileges."""

from __future__ import annotations

import os
import struct

import pytest

from laminar.zone import wire
from laminar.zone.keys import KeyFileError, ZoneKeys, load_keys, parse_keys
from laminar.zone.wire import Decoder, Dropped, DropReason, Encoder

KEY1 = bytes(range(32))
KEY2 = bytes(range(1, 33))
KEYS = ZoneKeys({1: KEY1, 2: KEY2}, "test")
NODES = {10: 1, 11: 1, 20: 2}

BODIES = [
    wire.Probe(2**63, 150, 4000, 16_000, 2000, "H100", "campus"),
    wire.Probe(5, 100, 1000, 1024, 100, "", "training", (2**64 - 1, 3, 7, 9, 11, 13, 15, 17)),
    wire.Offer(7, 1500, ((0, 100), (3, 50))),
    wire.Offer(7, 1500, ((1, 25),), (-250_000, 7750)),  # with the packing mode's fragmentation score
    wire.Offer(7, 1500, (), (2**31 - 1, 2**32 - 1)),
    wire.Refuse(7, 3),
    wire.Commit(7, 30_000),
    wire.CommitAck(7, 0, 7443),
    wire.Release(7),
    wire.Summary((100, 50, 0), 31_500, 120_000, False, "H100", ""),
    wire.ZoneSummaryMsg(2, 100_000, (100_000, 3, 2, 1, 0, 0, 0), 6_400_000_000, 10**12, ("A100", "H100")),
    wire.ZoneSummaryMsg(2, 1000, (1000, 3, 2, 1, 0, 0, 0), 64_000, 10**9, ("H100",),
                        ((), (), (), (), (7, 2**32 - 1), tuple(range(32)), ())),
    wire.ReclaimNotice(99, 30_000, "owner returns"),
    wire.Heartbeat(12),
    wire.HandoverAck(7, 0, "job-abc"),
    wire.MemberRequest(2**64 - 1, 1, b'{"job":"job-7-n3","index":1,"generation":0,"state":"running"}'),
    wire.MemberRequest(9, 2),
    wire.MemberAnswer(9, 0, b'{"ok":true}'),
    wire.MemberAnswer(9, 1, b'{"error":"unknown job job-7-n3"}'),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_round_trip_every_type(body):
    enc = Encoder(10, KEYS, seq0=100)
    dec = Decoder(KEYS, NODES)
    data = enc.encode(body, zone=1, now=5000.0, flags=wire.FLAG_REPLY_WANTED)
    assert len(data) <= wire.MAX_DATAGRAM
    m = dec.decode(data, now=5000.2)
    assert m.body == body
    assert (m.node, m.zone, m.seq, m.flags, m.ts_ms) == (10, 1, 101, 1, 5_000_000)
    assert m.type is wire.TYPE_OF[type(body)]


def test_handover_frame_round_trip():
    enc = Encoder(10, KEYS, seq0=1)
    dec = Decoder(KEYS, NODES, max_size=wire.MAX_FRAME)
    spec = b'{"name": "train", "argv": ["python", "x.py"]}' * 100
    data = enc.encode(wire.Handover(5, spec), zone=1, now=1.0, max_size=wire.MAX_FRAME)
    framed = wire.frame(data)
    assert wire.frame_length(framed[:4]) == len(data)
    assert dec.decode(framed[4:], now=1.0).body == wire.Handover(5, spec)
    with pytest.raises(ValueError, match="exceeds 1200"):
        enc.encode(wire.Handover(5, spec), zone=1, now=1.0)


def test_a_handover_of_a_spec_at_its_cap_fits_a_frame():
    """A job spec at the agent's cap (runtime.spec.SPEC_BYTES_MAX of user text, every byte one JSON
    escapes to six) with the agent's own entries, in a hand-over request: more than the 16 bits of
    the header's body length (the submitter failed with struct.error), within MAX_FRAME; the
    length's bits 16-23 travel in the header's fifth byte and the receiver takes it whole."""
    import json

    from laminar.runtime.spec import SPEC_BYTES_MAX, JobSpec

    value = "\x01" * (SPEC_BYTES_MAX // 2 - 8)
    spec = JobSpec.from_dict({"command": ["/bin/true"], "env": {"A": value, "B": value[:-200]}})
    req = json.dumps({"spec": spec.as_dict(), "owner_uid": 1000, "owner_gid": 1000,
                      "origin": {"migrated_from": "n1-job-" + "9" * 18}, "origin_node": 1}).encode()
    assert 0xFFFF < len(req) < wire.MAX_FRAME - wire.HEADER_SIZE - wire.MAC_SIZE
    enc = Encoder(10, KEYS, seq0=1)
    data = enc.encode(wire.Handover(5, req), zone=1, now=1.0, max_size=wire.MAX_FRAME)
    assert data[5] == len(req) >> 16 > 0
    dec = Decoder(KEYS, NODES, max_size=wire.MAX_FRAME)
    dec.precheck(data[:wire.HEADER_SIZE], len(data))  # read on: the header says this frame's size
    assert dec.decode(data, now=1.0).body == wire.Handover(5, req)
    tampered = data[:5] + bytes([data[5] + 1]) + data[6:]
    with pytest.raises(Dropped) as e:
        dec.precheck(tampered[:wire.HEADER_SIZE], len(tampered))
    assert e.value.reason is DropReason.BAD_LENGTH


def drop_reason(dec, data, now=5000.0):
    with pytest.raises(Dropped) as e:
        dec.decode(data, now)
    return e.value.reason


def test_drops_are_counted_by_reason():
    enc = Encoder(10, KEYS, seq0=1)
    dec = Decoder(KEYS, NODES)
    good = enc.encode(wire.Release(1), zone=1, now=5000.0)
    assert drop_reason(dec, good[:20]) is DropReason.TRUNCATED
    assert drop_reason(dec, good[:-1]) is DropReason.TRUNCATED
    assert drop_reason(dec, good + b"x") is DropReason.BAD_LENGTH
    assert drop_reason(dec, b"XX" + good[2:]) is DropReason.BAD_MAGIC
    assert drop_reason(dec, good[:2] + b"\x09" + good[3:]) is DropReason.BAD_VERSION
    assert drop_reason(dec, b"\0" * 1300) is DropReason.TOO_LARGE
    forged = bytearray(good)
    forged[-1] ^= 1
    assert drop_reason(dec, bytes(forged)) is DropReason.BAD_MAC
    tampered = bytearray(good)
    tampered[wire.HEADER_SIZE] ^= 0xFF  # body changed, mac kept
    assert drop_reason(dec, bytes(tampered)) is DropReason.BAD_MAC
    other_key = Encoder(10, ZoneKeys({1: b"k" * 32}, "evil"), seq0=1).encode(wire.Release(1), zone=1, now=5000.0)
    assert drop_reason(dec, other_key) is DropReason.BAD_MAC
    zone3 = Encoder(10, ZoneKeys({3: KEY1}, "z3"), seq0=1).encode(wire.Release(1), zone=3, now=5000.0)
    assert drop_reason(dec, zone3) is DropReason.UNKNOWN_ZONE
    stranger = Encoder(99, KEYS, seq0=1).encode(wire.Release(1), zone=1, now=5000.0)
    assert drop_reason(dec, stranger) is DropReason.UNKNOWN_NODE
    old = enc.encode(wire.Release(1), zone=1, now=4900.0)
    assert drop_reason(dec, old) is DropReason.STALE
    assert dec.decode(good, 5000.0).body == wire.Release(1)
    assert drop_reason(dec, good) is DropReason.REPLAY
    s = dec.stats()
    assert s["truncated"] == 2 and s["bad_mac"] == 3 and s["replay"] == 1 and s["accepted"] == 1
    assert s["stale"] == 1 and s["unknown_node"] == 1 and s["too_large"] == 1 and s["unknown_zone"] == 1


def test_only_accepted_zones_keys_are_honoured():
    dec = Decoder(KEYS, NODES, accept_zones={1})
    data = Encoder(20, KEYS, seq0=1).encode(wire.Heartbeat(), zone=2, now=1.0)
    assert drop_reason(dec, data, 1.0) is DropReason.UNKNOWN_ZONE
    assert Decoder(KEYS, NODES, accept_zones={2}).decode(data, 1.0).node == 20


def test_unknown_type_and_malformed_body_are_dropped_even_when_signed():
    dec = Decoder(KEYS, NODES)

    def signed(mtype: int, body: bytes, seq: int) -> bytes:
        head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, mtype, 0, 0, 1, 10, 1000, seq, len(body))
        return head + body + wire._mac(KEY1, head + body)

    assert drop_reason(dec, signed(200, b"", 1), 1.0) is DropReason.BAD_TYPE
    assert drop_reason(dec, signed(wire.MsgType.RELEASE, b"\0" * 3, 2), 1.0) is DropReason.MALFORMED
    assert drop_reason(dec, signed(wire.MsgType.RELEASE, b"\0" * 9, 3), 1.0) is DropReason.MALFORMED
    bad_utf8 = struct.pack("!QHIII", 1, 1, 1, 1, 1) + b"\x02\xff\xfe\x00"
    assert drop_reason(dec, signed(wire.MsgType.PROBE, bad_utf8, 4), 1.0) is DropReason.MALFORMED
    # a malformed datagram does not consume its sequence number
    ok = signed(wire.MsgType.RELEASE, b"\0" * 8, 2)
    assert dec.decode(ok, 1.0).body == wire.Release(0)
    assert dec.stats()["malformed"] == 3


def test_sequence_window_accepts_reordering_and_refuses_old():
    enc = Encoder(10, KEYS, seq0=0)
    dec = Decoder(KEYS, NODES)
    msgs = [enc.encode(wire.Heartbeat(), zone=1, now=1.0) for _ in range(wire.SEQ_WINDOW + 10)]
    dec.decode(msgs[5], 1.0)
    dec.decode(msgs[3], 1.0)  # late but inside the window
    assert drop_reason(dec, msgs[3], 1.0) is DropReason.REPLAY
    dec.decode(msgs[-1], 1.0)
    assert drop_reason(dec, msgs[4], 1.0) is DropReason.REPLAY  # fell behind the window
    dec.decode(msgs[-2], 1.0)


def test_encoder_refuses_zone_without_key_and_out_of_range_values():
    enc = Encoder(10, KEYS)
    with pytest.raises(ValueError, match="no key for zone 7"):
        enc.encode(wire.Heartbeat(), zone=7, now=0.0)
    with pytest.raises((ValueError, struct.error)):
        enc.encode(wire.Probe(-1, 0, 0, 0, 0), zone=1, now=0.0)
    with pytest.raises(ValueError, match="at most 255"):
        enc.encode(wire.ReclaimNotice(1, 1, "x" * 300), zone=1, now=0.0)


# --------------------------------------------------------------------------- keys

HEX = "ab" * 32


def write(tmp_path, text, mode=0o600):
    p = tmp_path / "zone.keys"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_load_keys_good_file(tmp_path):
    p = write(tmp_path, f"# keys\n1 {HEX}\n\n* {'cd' * 40}  # wildcard\n")
    k = load_keys(p, need_zones=[1, 5])
    assert k.get(1) == bytes.fromhex(HEX)
    assert k.get(5) == bytes.fromhex("cd" * 40)
    assert k.zones() == [1]


def test_load_keys_refuses_readable_by_others(tmp_path):
    p = write(tmp_path, f"1 {HEX}\n", mode=0o640)
    with pytest.raises(KeyFileError, match="mode 0640.*chmod 600"):
        load_keys(p)


def test_load_keys_missing_file_and_missing_zone(tmp_path):
    with pytest.raises(KeyFileError, match="does not exist"):
        load_keys(tmp_path / "nope")
    p = write(tmp_path, f"1 {HEX}\n")
    with pytest.raises(KeyFileError, match="no key for zone 2"):
        load_keys(p, need_zones=[1, 2])


@pytest.mark.parametrize(
    "text,match",
    [
        ("1 abcd\n", "has 2 bytes, at least 32"),
        ("x " + HEX, "zone id 'x'"),
        ("1 " + "zz" * 32, "not hex"),
        (f"1 {HEX}\n1 {HEX}\n", "given twice"),
        ("# nothing\n", "holds no key"),
        (f"1 {HEX} extra", "expected"),
        (f"70000 {HEX}", "out of range"),
    ],
)
def test_parse_keys_errors_name_the_problem(text, match):
    with pytest.raises(KeyFileError, match=match):
        parse_keys(text, "k")


def test_probe_fast_path_accepts_exactly_what_the_general_path_accepts() -> None:
    """The probe fast path (no _Reader) must agree with the general decoder on every body:
    the same Probe for a good one, None (general path drops it) for a bad one."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    def general(buf: bytes) -> wire.Body | None:
        r = wire._Reader(buf)
        try:
            pid, g, c, m, lease = r.take(wire._PROBE)
            if g > 6400:
                return None
            model, pool = r.text(), r.text()
            releases: tuple[int, ...] = ()
            if r.pos < len(buf):
                (k,) = r.take(wire._U8)
                if not 0 < k <= wire.MAX_PROBE_RELEASES:
                    return None
                releases = tuple(r.take(wire._U64)[0] for _ in range(k))
            body = wire.Probe(pid, g, c, m, lease, model, pool, releases)
            r.done()
        except Dropped:
            return None
        return body

    good = wire.encode_body(wire.Probe(7, 50, 1000, 2048, 2000, "H100", "train"))
    with_releases = wire.encode_body(wire.Probe(7, 50, 1000, 2048, 2000, "H100", "train", (1, 2**63)))

    @settings(max_examples=600, deadline=None)
    @given(st.one_of(st.binary(max_size=60),
                     st.builds(lambda i, b: good[:i] + b, st.integers(0, len(good)), st.binary(max_size=20)),
                     st.builds(lambda i, b: with_releases[:i] + b, st.integers(0, len(with_releases)),
                               st.binary(max_size=10))))
    def check(buf: bytes) -> None:
        assert wire._decode_probe_fast(buf) == general(buf)

    check()
    assert wire.decode_body(wire.MsgType.PROBE, good) == wire.Probe(7, 50, 1000, 2048, 2000, "H100", "train")
    assert wire.decode_body(wire.MsgType.PROBE, with_releases).releases == (1, 2**63)
    for bad in (good + b"\0", good + bytes([wire.MAX_PROBE_RELEASES + 1]) + b"\0" * 8 * (wire.MAX_PROBE_RELEASES + 1),
                with_releases[:-1]):
        with pytest.raises(Dropped):
            wire.decode_body(wire.MsgType.PROBE, bad)
    with pytest.raises(ValueError, match="releases"):
        wire.encode_body(wire.Probe(7, 50, 1000, 2048, 2000, releases=tuple(range(1, 10))))
    assert wire.decode_body(wire.MsgType.RELEASE, struct.pack("!Q", 9)) == wire.Release(9)
    with pytest.raises(Dropped):
        wire.decode_body(wire.MsgType.RELEASE, struct.pack("!Q", 9) + b"x")


def test_zone_summary_hints_are_optional_and_bounded():
    enc = Encoder(10, KEYS, seq0=1)
    dec = Decoder(KEYS, NODES)
    plain = wire.ZoneSummaryMsg(1, 10, (10, 0, 0, 0, 0, 0, 0), 1000, 2000, ("H100",))
    body = wire.encode_body(plain)
    # a zone summary without the hints field (as agents before it send it) decodes, with none
    assert dec.decode(enc.encode(plain, zone=1, now=1.0), now=1.0).body.hints == ()
    # hints for more shapes, or more nodes per shape, than the bounds: malformed, counted
    for seq, tail in enumerate((bytes([wire.MAX_HINT_SHAPES + 1]), bytes([1, wire.MAX_HINTS_PER_SHAPE + 1])
                                + b"\0" * 4 * (wire.MAX_HINTS_PER_SHAPE + 1), bytes([1, 2, 0, 0, 0, 1])), start=100):
        head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.MsgType.ZONE_SUMMARY, 0, 0, 1, 10, 1000, seq,
                                len(body + tail))
        data = head + body + tail + wire._mac(KEY1, head + body + tail)
        assert drop_reason(dec, data, now=1.0) is DropReason.MALFORMED
    assert dec.stats()["malformed"] == 3
    with pytest.raises(ValueError, match="hints"):
        enc.encode(wire.ZoneSummaryMsg(1, 10, (10,), 1, 1, (), ((1,) * 33,)), zone=1, now=1.0)


def test_offer_fragmentation_score_is_optional_and_exact():
    """An offer without the score encodes as before (old decoders read it); with it, 8 more
    bytes; a truncated score is malformed, not silently dropped to None."""
    plain = wire.encode_body(wire.Offer(7, 100, ((0, 50),)))
    scored = wire.encode_body(wire.Offer(7, 100, ((0, 50),), (-1, 500)))
    assert scored[: len(plain)] == plain and len(scored) == len(plain) + 8
    assert wire.decode_body(wire.MsgType.OFFER, plain) == wire.Offer(7, 100, ((0, 50),))
    assert wire.decode_body(wire.MsgType.OFFER, scored).frag == (-1, 500)
    with pytest.raises(Dropped):
        wire.decode_body(wire.MsgType.OFFER, scored[:-3])


def test_member_messages_take_their_types_and_a_payload_at_the_datagram_limit():
    """MEMBER_REQUEST (15) and MEMBER_ANSWER (16), the loan messages' layout: a payload filling
    the datagram fits, one byte more is refused by the encoder."""
    assert (wire.MsgType.MEMBER_REQUEST, wire.MsgType.MEMBER_ANSWER) == (15, 16)
    room = wire.MAX_DATAGRAM - wire.HEADER_SIZE - wire.MAC_SIZE - 9
    enc = Encoder(10, KEYS, seq0=100)
    body = wire.MemberRequest(3, 2, b"x" * room)
    assert Decoder(KEYS, NODES).decode(enc.encode(body, zone=1, now=5000.0), now=5000.0).body == body
    with pytest.raises(ValueError):
        enc.encode(wire.MemberAnswer(3, 0, b"x" * (room + 1)), zone=1, now=5000.0)
