"""Blocking work on paths a job or a user controls, off the event loop, bounded in threads and time.

A job's checkpoint directory, a replica tree, a file a manifest names: each ``stat``,
``readdir`` or ``read`` there may wait as long as the storage behind it wants (a hung FUSE or
NFS mount the job's owner set up; a trickling server), and a hashed file may be as large as
its manifest says. None of that may run on the agent's event loop (the kill-switch, Airlock,
heartbeats and the API share it), nor in the default executor: its threads are few, shared
by every component, and joined when the agent exits (one thread stuck on a dead mount kept
the agent from ever stopping).

A :class:`Lane` runs such work in threads of its own:

* at most ``workers`` pieces of work run at once; a caller waits for a free worker, but never
  past its own timeout;
* at most ``per_owner`` run at once for one *owner* (a uid): one user's jobs queue behind each
  other, never in front of another user's;
* each piece has a wall-time limit. When it passes, the caller gets :class:`TimeoutError` and
  its worker is freed for others; the thread itself cannot be interrupted in the kernel, so it
  is *stuck* until the storage answers: it keeps its owner's place (``per_owner``), so an
  owner holds at most ``per_owner`` threads however often its work is asked for, and new work
  of that owner is refused at once (:class:`LaneBusy`) while one is stuck;
* the threads are daemon threads: a thread stuck on a dead mount never holds the agent's exit.

Every outcome is counted (:meth:`Lane.stats`: ``done``, ``failed``, ``timeouts``, ``busy``,
``running``, ``stuck``) for ``laminarctl status -o json``.

Usage::

    lane = Lane("ckpt-scan", workers=2, timeout_s=2.0)
    try:
        listing = await lane.run(job.owner_uid, scan, path)
    except (TimeoutError, LaneBusy):
        listing = None                           # unknown this round
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class LaneBusy(Exception):
    """The owner's earlier work on this lane is stuck (past its timeout, its thread still in the
    kernel): nothing more of that owner's is started until it returns."""


class Lane:
    """See the module docstring. Use it from one event loop at a time."""

    def __init__(self, name: str, workers: int = 2, timeout_s: float = 2.0, per_owner: int = 1) -> None:
        if workers < 1 or per_owner < 1 or not timeout_s > 0:
            raise ValueError(f"lane {name}: workers {workers} and per_owner {per_owner} must be >= 1, "
                             f"timeout_s {timeout_s} > 0")
        self.name = name
        self.workers = workers
        self.per_owner = per_owner
        self.timeout_s = float(timeout_s)
        self._active = 0  # running, not past their timeout: what holds a worker
        self._live: dict[Hashable, int] = {}  # per owner: threads not finished (running or stuck)
        self._stuck: dict[Hashable, int] = {}  # per owner: threads past their timeout, not finished
        self._waiters: list[asyncio.Future[None]] = []
        self.counts = {"done": 0, "failed": 0, "timeouts": 0, "busy": 0}
        self.slowest_s = 0.0  # the longest piece of work that finished (a figure for the status)

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "running": self._active, "stuck": sum(self._stuck.values()),
                "stuck_owners": len(self._stuck), "workers": self.workers, "timeout_s": self.timeout_s,
                "slowest_s": round(self.slowest_s, 3)}

    def stuck(self, owner: Hashable) -> bool:
        """Whether ``owner`` has work past its timeout whose thread has not returned."""
        return self._stuck.get(owner, 0) > 0

    def _changed(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def run(self, owner: Hashable, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """``fn(*args)`` in a thread of the lane; its result or its exception. Raises
        :class:`TimeoutError` when it has not finished within ``timeout_s`` (default: the
        lane's) counted from this call (the wait for a worker included), :class:`LaneBusy`
        when ``owner`` has stuck work. Cancelling the caller leaves the thread to finish on its
        own (counted as stuck until it does)."""
        loop = asyncio.get_running_loop()
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + limit
        while True:
            if self.stuck(owner):
                self.counts["busy"] += 1
                raise LaneBusy(f"{self.name}: earlier work of {owner} is still stuck past its "
                               f"{limit:g} s limit (storage that does not answer)")
            if self._active < self.workers and self._live.get(owner, 0) < self.per_owner:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self.counts["timeouts"] += 1
                raise TimeoutError(f"{self.name}: no worker free for {owner} within {limit:g} s")
            w = loop.create_future()
            self._waiters.append(w)
            try:
                await asyncio.wait_for(w, left)
            except TimeoutError:
                pass
        fut: asyncio.Future[T] = loop.create_future()
        self._active += 1
        self._live[owner] = self._live.get(owner, 0) + 1
        state = {"abandoned": False}
        t0 = time.monotonic()

        def finish(ok: bool, value: Any) -> None:  # on the loop, when the thread returns
            self._live[owner] -= 1
            if not self._live[owner]:
                del self._live[owner]
            if state["abandoned"]:
                self._stuck[owner] -= 1
                if not self._stuck[owner]:
                    del self._stuck[owner]
            else:
                self._active -= 1
                self.slowest_s = max(self.slowest_s, time.monotonic() - t0)
                self.counts["done" if ok else "failed"] += 1
            self._changed()
            if not state["abandoned"] and not fut.done():  # (an abandoned one's caller is gone)
                (fut.set_result if ok else fut.set_exception)(value)

        def work() -> None:
            try:
                res: Any = fn(*args)
                ok = True
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                res, ok = e, False
            try:
                loop.call_soon_threadsafe(finish, ok, res)
            except RuntimeError:  # the loop is closed (the agent stopped meanwhile): nobody waits
                pass

        threading.Thread(target=work, name=f"laminar-{self.name}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))
        except (TimeoutError, asyncio.CancelledError) as e:
            if not fut.done():
                state["abandoned"] = True
                self._active -= 1
                self._stuck[owner] = self._stuck.get(owner, 0) + 1
                self._changed()
                if isinstance(e, TimeoutError):
                    self.counts["timeouts"] += 1
                    raise TimeoutError(f"{self.name}: work of {owner} took more than {limit:g} s") from None
                raise
            if isinstance(e, asyncio.CancelledError):
                raise
            return fut.result()
