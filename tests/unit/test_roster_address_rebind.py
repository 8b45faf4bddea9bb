"""Moving the zone's and the transfer endpoint's sockets onto the roster address once it is
usable (ZoneComponent's look while it listens on ``::``): each keeps its port, and a move to an
address that cannot be bound leaves the socket where it was (the OSError raised) rather than
closed. And how an address's state is read (``usable``, ``tentative``, ``duplicate``,
``absent``). Loopback only; the real tentative address is tests/kernel/test_zone_tentative_roster.py."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from ports import free_port
from xferrig import KEY

from laminar.migrate.transfer import Receiver
from laminar.zone.membership import Membership
from laminar.zone.transport import HandoverServer, UdpEndpoint, address_state
from laminar.zone.wire import Decoder, Encoder

NOT_HERE = "fd00:0:1ab::7"  # an address no test host holds


def test_address_states(tmp_path: Path) -> None:
    assert address_state("127.0.0.1") == "usable"
    assert address_state("::1") == "usable"
    assert address_state(NOT_HERE) == "absent"
    assert address_state("192.0.2.77") == "absent"
    table = tmp_path / "if_inet6"
    table.write_text("fd00000001ab00000000000000000007 02 40 00 40 lmt0\n"
                     "fd00000001ab00000000000000000008 02 40 00 48 lmt0\n"
                     "fd00000001ab00000000000000000009 02 40 00 80 lmt0\n")
    assert address_state(NOT_HERE, str(table)) == "tentative"
    assert address_state("fd00:0:1ab::8", str(table)) == "duplicate"
    assert address_state("fd00:0:1ab::9", str(table)) == "absent"  # listed, not tentative: not bindable anyway
    assert address_state(NOT_HERE, str(tmp_path / "missing")) == "absent"


def test_the_udp_endpoint_moves_keeping_its_port_and_stays_when_the_address_cannot_be_bound() -> None:
    async def run() -> None:
        ep = UdpEndpoint(Membership(1, []), Encoder(1, {}), Decoder({}, lambda n: None), lambda m, a: None)
        ep.open(asyncio.get_running_loop(), "::", free_port(socket.SOCK_DGRAM, "::"))
        try:
            port = ep.sock.getsockname()[1]
            with pytest.raises(OSError):
                ep.rebind(NOT_HERE)
            assert ep.sock is not None and ep.sock.getsockname()[:2] == ("::", port)
            ep.rebind("::1")
            assert ep.sock.getsockname()[:2] == ("::1", port)
            with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
                s.sendto(b"x", ("::1", port))  # it reads there (the datagram is dropped as undecodable)
            for _ in range(100):
                if ep.received:
                    break
                await asyncio.sleep(0.01)
            assert ep.received == 1
        finally:
            ep.close()

    asyncio.run(run())


def test_the_handover_server_moves_keeping_its_port_and_stays_when_the_address_cannot_be_bound() -> None:
    async def run() -> None:
        async def never(msg):  # type: ignore[no-untyped-def]
            raise AssertionError("no hand-over expected")

        srv = HandoverServer(Encoder(1, {}), Decoder({}, lambda n: None), lambda n: None, never)
        await srv.start("::", free_port(socket.SOCK_STREAM, "::"))
        try:
            assert srv.server is not None
            port = srv.server.sockets[0].getsockname()[1]
            with pytest.raises(OSError):
                await srv.relisten(NOT_HERE)
            assert sorted(s.getsockname()[0] for s in srv.server.sockets) == ["0.0.0.0", "::"]
            await srv.relisten("::1")
            assert [s.getsockname()[:2] for s in srv.server.sockets] == [("::1", port)]
        finally:
            await srv.stop()

    asyncio.run(run())


def test_the_transfer_receiver_moves_keeping_its_port_and_stays_when_the_address_cannot_be_bound(tmp_path: Path) -> None:
    async def run() -> None:
        rcv = Receiver(tmp_path, KEY)
        port = await rcv.start("::1", free_port(socket.SOCK_STREAM, "::"))
        try:
            with pytest.raises(OSError):
                await rcv.relisten(NOT_HERE)
            assert rcv.server is not None
            assert [s.getsockname()[:2] for s in rcv.server.sockets] == [("::1", port)]
            await rcv.relisten("127.0.0.1")
            assert [s.getsockname()[:2] for s in rcv.server.sockets] == [("127.0.0.1", port)]
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
        finally:
            await rcv.stop()

    asyncio.run(run())
