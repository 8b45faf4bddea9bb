"""The control socket's directory keeps its mode when the agent did not create it.

``ApiServer.start`` made the socket's parent directory 0755 whatever it was: an agent whose
``agent.socket`` sits directly in a shared directory (``/tmp/laminard.sock`` while trying
things out, ``/var/run/…``) turned ``/tmp`` (1777: anyone may create files, sticky) into 0755,
so no user but root could create a file in /tmp any more, and the sticky bit was gone. The mode
is now set only on a directory the agent creates. Real directories and a real socket.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from laminar.api import ApiServer, Authorizer


def _start_stop(sock: Path) -> None:
    async def main() -> None:
        srv = ApiServer(sock, Authorizer("laminar-test-no-such-group"))
        await srv.start()
        await srv.stop()

    asyncio.run(main())


def test_a_shared_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    _start_stop(shared / "laminard.sock")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777, oct(shared.stat().st_mode)


def test_a_directory_it_creates_is_reachable_by_everyone(tmp_path: Path) -> None:
    old = os.umask(0o077)  # a strict umask: the agent must still make the directory reachable
    try:
        _start_stop(tmp_path / "run-laminar" / "laminard.sock")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "run-laminar").stat().st_mode) == 0o755
