"""Who may hold the peer TCP ports before authenticating (:mod:`laminar.zone.gate`): the pure
decisions, then real sockets on loopback (an off-roster address is ``127.0.0.9``, a host of
its own as far as the roster is concerned; loopback answers every 127/8 address)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from ports import free_port

from laminar.zone import gate as G
from laminar.zone.gate import Gate, GatedListener, Slot, source_key

ROSTER = frozenset({"10.0.0.1", "10.0.0.2", "fd00::3"})


def test_an_address_off_the_roster_is_refused_and_counted_and_takes_no_slot() -> None:
    g = Gate(lambda: ROSTER)
    assert g.admit("10.0.0.9") is None and g.admit("fd00::9") is None
    st = g.stats()
    assert st["off_roster"] == 2 and st["reading"] == 0 and st["accepted"] == 0


def test_each_roster_address_has_its_own_share_and_all_share_a_total() -> None:
    g = Gate(lambda: ROSTER, per_source=3, roster_total=5)
    one = [g.admit("10.0.0.1") for _ in range(4)]
    assert all(isinstance(s, Slot) for s in one[:3]) and one[3] is None  # its share: 3
    two = [g.admit("10.0.0.2") for _ in range(3)]
    assert [s is not None for s in two] == [True, True, False]  # the total: 5
    assert g.stats()["source_busy"] == 1 and g.stats()["busy"] == 1
    assert g.admit("fd00::3") is None  # full for everyone now
    s = one[0]
    assert s is not None
    s.release()
    s.release()  # idempotent: gives back one slot, once
    assert g.stats()["reading"] == 4
    assert g.admit("fd00::3") is not None


def test_without_check_source_strangers_have_a_pool_of_their_own_and_cannot_starve_the_roster() -> None:
    g = Gate(lambda: ROSTER, check_source=False, per_source=2, roster_total=4, stranger_total=3)
    strangers = [g.admit(f"192.0.2.{i}") for i in range(10)]
    assert sum(s is not None for s in strangers) == 3 and g.stats()["busy"] == 7
    assert all(g.admit(a) is not None for a in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "fd00::3"))
    assert g.stats()["off_roster"] == 0


def test_an_ipv6_stranger_is_counted_by_its_64() -> None:
    """A host holds a /64 as easily as one address: its per-source share is the /64's."""
    assert source_key("2001:db8:1:2::5") == source_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert source_key("2001:db8:1:3::5") != source_key("2001:db8:1:2::5")
    assert source_key("192.0.2.7") == "192.0.2.7"
    g = Gate(lambda: ROSTER, check_source=False, per_source=2)
    got = [g.admit(f"2001:db8:1:2::{i:x}") for i in range(1, 6)]
    assert sum(s is not None for s in got) == 2 and g.stats()["source_busy"] == 3


def test_authenticated_connections_are_capped_per_member_and_in_all() -> None:
    g = Gate(lambda: ROSTER, member_authenticated=2, authenticated_total=3)
    a = [g.authenticate(2) for _ in range(3)]
    assert [s is not None for s in a] == [True, True, False]
    assert g.authenticate(3) is not None and g.authenticate(4) is None
    st = g.stats()
    assert st["member_busy"] == 1 and st["authenticated_busy"] == 1 and st["authenticated"] == 3


def test_without_a_roster_every_address_is_a_stranger() -> None:
    g = Gate()  # a transfer endpoint outside an agent
    assert g.admit("10.0.0.9") is not None and g.stats()["off_roster"] == 0


# -- real sockets ------------------------------------------------------------------------------


async def _listen(g: Gate, host: str | None = "127.0.0.1", port: int = 0) -> tuple[GatedListener, int, list[str]]:
    seen: list[str] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, ip: str, slot: Slot) -> None:
        seen.append(ip)
        w.write(b"hi")
        await w.drain()
        await r.read(1)  # held until the peer closes
        w.close()

    lst = GatedListener(g, serve, "test port")
    port = await lst.start(host, port)
    return lst, port, seen


async def _connect(port: int, src: str, dst: str = "127.0.0.1") -> bytes:
    """What a connection from ``src`` gets: the server's greeting, or b'' when it was reset."""
    try:
        r, w = await asyncio.open_connection(dst, port, local_addr=(src, 0))
    except ConnectionError:
        return b""
    try:
        return await asyncio.wait_for(r.read(2), 5)
    except ConnectionError:
        return b""
    finally:
        w.close()


def test_a_listener_resets_an_off_roster_peer_at_accept_and_serves_the_roster() -> None:
    async def main() -> None:
        g = Gate(lambda: {"127.0.0.1", "127.0.0.2"})
        lst, port, seen = await _listen(g)
        try:
            assert await _connect(port, "127.0.0.9") == b""
            assert await _connect(port, "127.0.0.2") == b"hi"
            assert seen == ["127.0.0.2"] and g.stats()["off_roster"] == 1
            # many at once from off the roster: none is served, none is held
            got = await asyncio.gather(*(_connect(port, "127.0.0.9") for _ in range(200)))
            assert set(got) == {b""} and g.stats()["off_roster"] == 201 and g.stats()["reading"] == 0
            assert len(lst.tasks) == 0
        finally:
            lst.close()

    asyncio.run(main())


def test_a_dual_stack_listener_takes_an_ipv4_peer_as_its_roster_address() -> None:
    """On '::' (two sockets, IPv4 and IPv6, as asyncio's servers) an IPv4 peer is its IPv4
    address; an IPv6 peer on the roster is admitted by its canonical spelling."""
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6: the agent's dual-stack listener cannot be checked")

    async def main() -> None:
        g = Gate(lambda: {"127.0.0.2", "::1"})
        lst, port, seen = await _listen(g, None, free_port(socket.SOCK_STREAM, "::"))
        try:
            assert sorted(s.family for s in lst.sockets) == sorted([socket.AF_INET, socket.AF_INET6])
            assert await _connect(port, "127.0.0.2") == b"hi"
            assert await _connect(port, "::1", "::1") == b"hi"
            assert await _connect(port, "127.0.0.9") == b""
            assert seen == ["127.0.0.2", "::1"]
        finally:
            lst.close()

    asyncio.run(main())


def test_a_source_past_its_share_is_reset_while_another_source_is_served(tmp_path: Path) -> None:
    async def main() -> None:
        g = Gate(lambda: {"127.0.0.2", "127.0.0.3"})
        lst, port, seen = await _listen(g)
        held = []
        try:
            for _ in range(G.PER_SOURCE + 5):
                try:
                    held.append(await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0)))
                except ConnectionError:
                    pass
            await asyncio.sleep(0.2)
            st = g.stats()
            assert st["reading"] == G.PER_SOURCE and st["source_busy"] == 5, st
            assert await _connect(port, "127.0.0.3") == b"hi"
        finally:
            for _, w in held:
                w.close()
            lst.close()

    asyncio.run(main())
