"""Moving the zone's and the transfer endpoint's sockets onto the roster address once it is
usable (ZoneComponent's look while it listens on ``::``): each keeps its port, and a move to an
address that cannot be bound leaves the socket where it was (the OSError raised) rather than
closed. And how an address's state is read (``usable``, ``tentative``, ``duplicate``,
``absent``). Loopback only; the real tentative address is tests/kernel/test_zone_tentative_roster.py."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ports import free_port
from standin_agent import standin_agent
from xferrig import KEY

from laminar.components import MigrateAgent
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import Receiver
from laminar.zone.membership import Membership
from laminar.zone.transport import HandoverServer, UdpEndpoint, address_state
from laminar.zone.wire import Decoder, Encoder

NOT_HERE = "fd00:0:1ab::7"  # an address no test host holds


def endpoint() -> UdpEndpoint:
    return UdpEndpoint(Membership(1, []), Encoder(1, {}), Decoder({}, lambda n: None), lambda m, a: None)


def handover_server() -> HandoverServer:
    async def never(msg: Any) -> Any:
        raise AssertionError("no hand-over expected")

    return HandoverServer(Encoder(1, {}), Decoder({}, lambda n: None), lambda n: None, never)


async def reads_there(ep: UdpEndpoint, host: str, port: int) -> None:
    """The endpoint reads what is sent to ``host:port`` (the datagram, undecodable, is dropped)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
        s.sendto(b"x", (host, port))
    for _ in range(100):
        if ep.received:
            break
        await asyncio.sleep(0.01)
    assert ep.received == 1


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
        ep = endpoint()
        ep.open(asyncio.get_running_loop(), "::", free_port(socket.SOCK_DGRAM, "::"))
        try:
            port = ep.sock.getsockname()[1]
            with pytest.raises(OSError):
                ep.rebind(NOT_HERE)
            assert ep.sock is not None and ep.sock.getsockname()[:2] == ("::", port)
            ep.rebind("::1")
            assert ep.sock.getsockname()[:2] == ("::1", port)
            await reads_there(ep, "::1", port)
        finally:
            ep.close()

    asyncio.run(run())


def test_the_handover_server_moves_keeping_its_port_and_stays_when_the_address_cannot_be_bound() -> None:
    async def run() -> None:
        srv = handover_server()
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


def squat(kind: int, port: int) -> socket.socket:
    """Another socket takes ``port`` on every address (both families), as one may in the moment
    a move has closed the old socket and not yet bound the new one."""
    s = socket.socket(socket.AF_INET6, kind)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    if kind == socket.SOCK_STREAM:
        s.listen()
    return s


def squat_after(obj: Any, name: str, kind: int, port: int) -> list[socket.socket]:
    """Wraps ``obj.<name>`` (what closes its socket, sync or async) so that right after its first
    call another socket takes ``port`` (:func:`squat`): the squatter, once there, is in the list
    returned."""
    real = getattr(obj, name)
    taken: list[socket.socket] = []

    def then() -> None:
        if not taken:
            taken.append(squat(kind, port))

    async def closed_async() -> None:
        await real()
        then()

    def closed() -> None:
        real()
        then()

    setattr(obj, name, closed_async if asyncio.iscoroutinefunction(real) else closed)
    return taken


async def taken_then_listens(srv: Any, host: str, port: int, squatter: list[socket.socket]) -> None:
    """``srv`` (a hand-over server or a receiver, on ``::`` at ``port``) moves onto ``host`` while
    the squatter takes the port in the gap: the OSError says nothing listens, and nothing does;
    once the squatter is gone, the next relisten listens on ``host:port`` and takes a connection."""
    with pytest.raises(OSError, match=r"nor on :: again .*not listening until it is tried again"):
        await srv.relisten(host)
    assert srv.server is None
    squatter[0].close()
    await srv.relisten(host)
    assert srv.server is not None
    assert [s.getsockname()[:2] for s in srv.server.sockets] == [(host, port)]
    _, w = await asyncio.open_connection(host, port)
    w.close()


def test_the_udp_endpoint_whose_port_is_taken_mid_move_says_so_and_binds_on_the_next_try() -> None:
    async def run() -> None:
        ep = endpoint()
        port = free_port(socket.SOCK_DGRAM, "::")
        ep.open(asyncio.get_running_loop(), "::", port)
        close = ep.close
        squatter = squat_after(ep, "close", socket.SOCK_DGRAM, port)
        try:
            with pytest.raises(OSError, match=r"nor :: again .*no zone socket until it is tried again"):
                ep.rebind("::1")
            assert ep.sock is None  # before: an OSError from the fallback, and the next look crashed on None
            ep.send_to(1, ("::1", port), None)  # type: ignore[arg-type]  # dropped: no socket, no crash
            squatter[0].close()
            ep.rebind("::1")  # the zone's next look
            assert ep.sock is not None and ep.sock.getsockname()[:2] == ("::1", port)
            await reads_there(ep, "::1", port)
        finally:
            for s in squatter:
                s.close()
            close()

    asyncio.run(run())


def test_the_handover_server_whose_port_is_taken_mid_move_says_so_and_listens_on_the_next_try() -> None:
    async def run() -> None:
        srv = handover_server()
        port = free_port(socket.SOCK_STREAM, "::")
        await srv.start("::", port)
        stop = srv.stop
        squatter = squat_after(srv, "stop", socket.SOCK_STREAM, port)
        try:
            await taken_then_listens(srv, "::1", port, squatter)  # (the zone's next look binds it)
        finally:
            for s in squatter:
                s.close()
            await stop()

    asyncio.run(run())


def test_the_transfer_receiver_whose_port_is_taken_mid_move_says_so_and_listens_on_the_next_try(
        tmp_path: Path) -> None:
    async def run() -> None:
        rcv = Receiver(tmp_path, KEY)
        port = await rcv.start("::", free_port(socket.SOCK_STREAM, "::"))
        squatter = squat_after(rcv, "_close", socket.SOCK_STREAM, port)
        try:
            await taken_then_listens(rcv, "127.0.0.1", port, squatter)
        finally:
            for s in squatter:
                s.close()
            await rcv.stop()

    asyncio.run(run())


def test_transfers_follow_the_zone_onto_its_address_once_the_port_taken_mid_move_is_free_again(
        tmp_path: Path) -> None:
    """The zone moved onto its roster address; the checkpoint receiver's move there finds its port
    taken in the moment between: it is tried again every ``rebind.interval_s`` until it binds
    (before, the receiver stayed closed for good: no checkpoint could reach this node)."""
    async def run() -> None:
        rcv = Receiver(tmp_path, KEY)
        port = await rcv.start("::", free_port(socket.SOCK_STREAM, "::"))
        squatter = squat_after(rcv, "_close", socket.SOCK_STREAM, port)
        c = ReclaimComponent()
        c.receiver = rcv
        c.agent = standin_agent(MigrateAgent, zone=SimpleNamespace(networked=True, listen_host="127.0.0.1",
                                                       rebind=SimpleNamespace(interval_s=0.05)))
        try:
            await c._follow_zone_listen("127.0.0.1")
            assert rcv.server is None and c._tasks  # not listening; tried again
            await asyncio.sleep(0.2)
            assert rcv.server is None  # still taken
            squatter[0].close()
            for _ in range(100):
                if rcv.server is not None:
                    break
                await asyncio.sleep(0.02)
            assert rcv.server is not None
            assert [s.getsockname()[:2] for s in rcv.server.sockets] == [("127.0.0.1", port)]
            assert c._xfer_local == "127.0.0.1"
            await asyncio.sleep(0.1)
            assert not c._tasks  # done once bound
        finally:
            for t in list(c._tasks):
                t.cancel()
            for s in squatter:
                s.close()
            await rcv.stop()

    asyncio.run(run())
