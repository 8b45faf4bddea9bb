"""A free port for a test's agent or component to bind later, picked outside the kernel's
ephemeral range (``net.ipv4.ip_local_port_range``).

Binding port 0 and closing the socket hands out an ephemeral port, which the kernel may give
to any outgoing connection (another test's transfer, an agent's hand-over) before the test
binds it: an "Address already in use" that comes and goes. A port below the ephemeral range is
never handed out that way; it is checked free (bound once, then let go) for the family, host
and socket kind it is for, and never handed out twice in one process (a test that picks three
ports, then binds them, would otherwise get the same one twice now and then).
"""

from __future__ import annotations

import random
import socket

_rng = random.Random()
_given: set[int] = set()  # ports handed out in this process: never twice (a test may pick several)


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1", family: int | None = None) -> int:
    """A port free now on ``host`` for ``kind`` (SOCK_STREAM or SOCK_DGRAM), below the
    ephemeral range (else, where that range leaves no room, an ephemeral one)."""
    fam = family if family is not None else (socket.AF_INET6 if ":" in host else socket.AF_INET)
    lo, _hi = _ephemeral()
    first = 10000 if lo > 12000 else 1024
    for _ in range(200):
        port = _rng.randrange(first, lo) if lo - first > 1000 else 0
        if port in _given:
            continue
        with socket.socket(fam, kind) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            got = int(s.getsockname()[1])
        _given.add(got)
        return got
    raise OSError(f"no free port on {host} below {lo} after 200 tries")
