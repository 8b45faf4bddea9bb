"""Moving a listening TCP server to another address at the same port: the zone's hand-over
server and the checkpoint receiver follow the node's roster address once it is usable
(``laminar.zone.rebind.Rebind.follow``). The old socket must be closed before the new address
is bound (a specific address cannot be bound beside a wildcard listener on the same port
without SO_REUSEPORT, which would let any other root socket share the port), so for a moment
nothing listens, and another socket may take the port then."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol


class Listening(Protocol):
    """A server listening on TCP sockets: asyncio's, or :class:`laminar.zone.gate.GatedListener`."""

    @property
    def sockets(self) -> Sequence[Any]: ...


async def relisten(server: Listening | None, port: int | None, host: str,
                   bind: Callable[[str, int], Awaitable[object]], close: Callable[[], Awaitable[None]]) -> None:
    """Listen on ``host`` at the port ``server`` listens on (``bind(host, port)`` once
    ``close()`` closed it). When ``host`` cannot be bound, the old address is bound again and
    the OSError raised; when neither can be (the port was taken in between), nothing listens
    and an OSError says so: the next call (``server`` None, ``port`` the port it had) binds
    ``host`` at that port. ``::`` stands for a server on every address (two sockets)."""
    if server is None:
        if port is None:
            raise RuntimeError("relisten before the server was started")
        await bind(host, port)
        return
    assert server.sockets, "relisten of a closed server"
    name = server.sockets[0].getsockname()
    old = "::" if len(server.sockets) > 1 else str(name[0])  # '::' listens on two sockets
    await close()
    try:
        await bind(host, int(name[1]))
    except OSError as e:
        try:
            await bind(old, int(name[1]))
        except OSError as again:
            raise OSError(e.errno, f"cannot listen on {host} port {name[1]} ({e.strerror}), nor on {old} again "
                                   f"({again.strerror}): not listening until it is tried again") from e
        raise
