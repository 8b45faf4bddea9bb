"""Calling pyroute2's synchronous API from the agent's event loop.

pyroute2 0.9's ``IPRoute`` runs its own asyncio loop in the calling thread, so it raises
"This event loop is already running" when used inside the agent's loop. ``call(fn, ...)`` runs
a synchronous netlink function in one dedicated worker thread when the caller is inside a
running loop (and directly otherwise). Netlink calls take well under a millisecond, so the
loop is blocked only that long, and ordering is kept because the worker is a single thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="laminar-netlink")


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs), in the netlink worker thread when called from a running event loop."""
    if not _in_running_loop():
        return fn(*args, **kwargs)
    return _worker.submit(fn, *args, **kwargs).result()
