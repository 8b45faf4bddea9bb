"""A second agent on the same control socket refuses to start instead of stealing the socket.

``ApiServer.start`` removed any socket at its path as "stale from a crashed agent" without
asking whether an agent still answered there. A second laminard started by hand on a node
whose systemd laminard runs (same default socket) unlinked the running agent's socket and
bound its own: from then on ``laminarctl`` (kill-switches included) reached the second agent,
and the first one, still enforcing and managing jobs, could not be reached by anyone. Now a
socket that accepts a connection is refused with a message; a dead one is still replaced.
Real Unix sockets.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from laminar.api import ApiServer, Authorizer, Request, Route, socket_in_use


def test_a_live_socket_is_not_taken_over_and_a_stale_one_is(tmp_path: Path) -> None:
    path = tmp_path / "laminard.sock"

    async def who(req: Request) -> dict[str, str]:
        return {"agent": "first"}

    async def main() -> None:
        first = ApiServer(path, Authorizer("laminar-test-no-such-group"))
        first.add([Route("GET", "/who", who)])
        await first.start()
        try:
            assert socket_in_use(path)
            second = ApiServer(path, Authorizer("laminar-test-no-such-group"))
            with pytest.raises(RuntimeError, match="another laminard"):
                await second.start()
            assert path.is_socket()
            # the first agent still answers on its socket
            r, w = await asyncio.open_unix_connection(str(path))
            w.write(b"GET /who HTTP/1.1\r\n\r\n")
            data = await r.read()
            w.close()
            assert b'"first"' in data
        finally:
            await first.stop()
        # a socket file nobody listens on (a crashed agent's) is replaced
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(path))
        stale.close()
        assert path.is_socket() and not socket_in_use(path)
        third = ApiServer(path, Authorizer("laminar-test-no-such-group"))
        await third.start()
        await third.stop()

    asyncio.run(main())
