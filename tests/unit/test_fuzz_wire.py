"""Fuzzing the zone datagram decoder (hypothesis): arbitrary bytes and mutated valid datagrams
never make it raise anything but Dropped, and whatever it accepts re-encodes to an equal body."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laminar.zone import wire
from laminar.zone.keys import ZoneKeys
from laminar.zone.wire import Decoder, Dropped, Encoder

KEYS = ZoneKeys({1: bytes(range(32))}, "fuzz")
NODES = {10: 1, 11: 1}
NOW = 1_700_000_000.0

u8 = st.integers(0, 255)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
txt = st.text(max_size=20).filter(lambda s: len(s.encode()) <= 255)
share = st.integers(0, 100)

# a shared shape mix (the summaries' optional trailer): none, or 1..16 distinct packing shapes
mix_shape = st.one_of(
    st.tuples(u32, st.just(0), st.just(0)),
    st.tuples(u32, st.integers(1, 1000), st.just(1)),
    st.tuples(u32, st.just(1000), st.integers(2, 255)),
)
shared_mix = st.one_of(
    st.just(((), 0)),
    st.tuples(st.dictionaries(mix_shape, st.integers(0, 4000), min_size=1, max_size=wire.MAX_MIX_SHAPES).map(
        lambda d: tuple((c, g, n, p) for (c, g, n), p in d.items())), st.integers(1, 2**32 - 1)),
)

bodies = st.one_of(
    st.builds(wire.Probe, u64, st.integers(0, 6400), u32, u32, u32, txt, txt,
              st.lists(u64, max_size=wire.MAX_PROBE_RELEASES).map(tuple)),
    st.builds(wire.Offer, u64, u32, st.lists(st.tuples(u8, share), max_size=8).map(tuple),
              st.one_of(st.none(), st.tuples(st.integers(-2**31, 2**31 - 1), u32))),
    st.builds(wire.Refuse, u64, u8),
    st.builds(wire.Commit, u64, u32),
    st.builds(wire.CommitAck, u64, u8, u16),
    st.builds(wire.Release, u64),
    st.builds(lambda s, m: wire.Summary(*s, *m), st.tuples(st.lists(share, max_size=16).map(tuple), u32, u32,
                                                           st.booleans(), txt, txt), shared_mix),
    st.builds(lambda z, m: wire.ZoneSummaryMsg(*z, *m), st.tuples(
        u16, u32, st.lists(u32, max_size=8).map(tuple), u64, u64, st.lists(txt, max_size=4).map(tuple),
        st.lists(st.lists(u32, max_size=6).map(tuple), max_size=7).map(tuple),
        st.lists(st.lists(st.tuples(u16, u16, u16), max_size=wire.MAX_HOST_BUCKETS).map(tuple),
                 max_size=7).map(tuple)), shared_mix),
    st.builds(wire.ReclaimNotice, u64, u32, txt),
    st.builds(wire.Heartbeat, u32),
    st.builds(wire.HandoverAck, u64, u8, txt),
)


def decode_or_drop(dec: Decoder, data: bytes) -> wire.Message | None:
    try:
        return dec.decode(data, NOW)
    except Dropped:
        return None


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=1400))
def test_arbitrary_bytes_only_ever_drop(data):
    dec = Decoder(KEYS, NODES)
    assert decode_or_drop(dec, data) is None  # nothing unsigned gets through
    assert sum(dec.drops.values()) == 1


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, pos=st.integers(0, 2000), byte=u8, cut=st.integers(0, 2000), mode=st.sampled_from(["flip", "cut", "insert", "none"]))
def test_mutated_valid_datagrams_only_ever_drop(body, pos, byte, cut, mode):
    dec = Decoder(KEYS, NODES)
    data = Encoder(10, KEYS, seq0=5).encode(body, zone=1, now=NOW)
    if mode == "flip":
        b = bytearray(data)
        b[pos % len(b)] ^= byte or 1
        data = bytes(b)
    elif mode == "cut":
        data = data[: cut % len(data)]
    elif mode == "insert":
        p = pos % (len(data) + 1)
        data = data[:p] + bytes([byte]) + data[p:]
    m = decode_or_drop(dec, data)
    if mode == "none":
        assert m is not None and m.body == body
    else:
        assert m is None  # every mutation breaks the MAC, the length or the framing


@settings(max_examples=2000, deadline=None)
@given(mtype=st.sampled_from(list(wire.MsgType)), body=st.binary(max_size=300))
def test_signed_garbage_bodies_only_ever_drop(mtype, body):
    """Even an authenticated peer sending nonsense bodies cannot make the decoder raise."""
    dec = Decoder(KEYS, NODES, max_size=wire.MAX_FRAME)
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, mtype, 0, 0, 1, 11, int(NOW * 1000), 1, len(body))
    data = head + body + wire._mac(KEYS.get(1) or b"", head + body)
    m = decode_or_drop(dec, data)
    if m is not None:
        assert wire.encode_body(m.body) == body
