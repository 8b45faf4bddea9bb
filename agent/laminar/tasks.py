"""A component's asyncio tasks: stopped for sure, and awaited unless an event comes first.

Python 3.11's ``asyncio.wait_for`` loses a cancellation that arrives as the future it waits on
completes: it returns that result, and the task goes on as if never cancelled (fixed in 3.12).
A component whose stop cancels its tasks once and then awaits them waits, after such a loss, for
whatever the task does next: a requeued job's placement retries for ``requeue_for_s`` (600 s;
seen as a 577 s unit test in CI), an interval loop for ever. :func:`cancel_until_done` cancels
again until every task has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

# How long a cancelled task is given to end before it is cancelled again.
RECANCEL_S = 0.5


async def cancel_until_done(tasks: Iterable[asyncio.Future[Any]], every_s: float = RECANCEL_S) -> None:
    """Cancels ``tasks`` and waits until each has ended, cancelling those still running again
    every ``every_s``. Their results and exceptions are read (none is logged as never
    retrieved); raises nothing of theirs."""
    every = list(tasks)
    pending = {t for t in every if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for t in every:
        if not t.cancelled():
            t.exception()


async def unless_set(cancel: asyncio.Event | None, aw: Any) -> Any:
    """``aw``'s result, or None once ``cancel`` is set first (``aw`` is then cancelled)."""
    task = asyncio.ensure_future(aw)
    if cancel is None:
        return await task
    stop = asyncio.ensure_future(cancel.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            await cancel_until_done([task])
    return task.result() if task.done() and not task.cancelled() else None


__all__ = ["RECANCEL_S", "cancel_until_done", "unless_set"]
