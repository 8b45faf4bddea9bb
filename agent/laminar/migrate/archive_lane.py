"""The one thread that touches the archive (:class:`ArchiveLane`), and a publish the loop waits for
only until a deadline (:class:`ArchiveWait`), both held or used by the part
:class:`laminar.migrate.archive.Archive`.

**When the archive hangs.** ``archive_dir`` is shared storage, and its server can stop
answering (an NFS or FUSE server gone: every stat, listing and open on the mount then waits,
often unkillably). The agent's loop never touches the archive: every look at it and every
write to it (the rounds, claims, publishes, periodic copies, the sweep, a claimed job's copy
for its owner) runs on one dedicated thread (:class:`ArchiveLane`), one piece at a time, and
a round is started only when the one before has ended. A hung archive so holds one thread;
the control socket, the kill switch, the zone, placements and Airlock go on, and what needs
the archive waits in order (nothing is lost or done twice). When the work in hand has made no
progress (no byte read, no CPU time) for ``archive.ARCHIVE_STALL_SWEEPS`` x ``archive_gc_s`` (30 s by
default), the status says so (``migrate.archive.stalled_s``, ``busy``: what waits) and a log
line and an event (``archive-stalled``) say it once; ``archive-answers`` when it answers again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any


def _progress(task: str) -> tuple[int, int] | None:
    """(bytes read, CPU clock ticks) so far of the process or thread whose /proc directory is
    ``task`` (``/proc/<pid>``, ``/proc/self/task/<tid>``): its ``io``'s rchar, -1 where that
    cannot be read, and its ``stat``'s utime + stime; None when /proc cannot tell. Never blocks
    on the task (one in D state answers too)."""
    try:
        with open(f"{task}/stat") as f:
            after_comm = f.read().rsplit(")", 1)[1].split()
        ticks = int(after_comm[11]) + int(after_comm[12])  # fields 14 and 15 (utime, stime)
    except (OSError, ValueError, IndexError):
        return None
    rchar = -1
    with contextlib.suppress(OSError, ValueError), open(f"{task}/io") as f:
        rchar = next((int(line.split()[1]) for line in f if line.startswith("rchar:")), -1)
    return rchar, ticks


class ArchiveLane:
    """The one thread that touches archive storage (``migrate.archive_dir``, shared storage
    such as an NFS mount, whose every stat, listing and open waits while its server does not
    answer, often unkillably). The agent's loop never touches the archive itself: it hands the
    lane each piece of work (:meth:`call`), which runs them one after the other, so a hung
    archive holds this one thread and nothing else (the agent's loop and the default executor
    go on), and what waits for the archive (claims, publishes, sweeps) waits, queued, in order.
    A daemon thread: a process stopping while it waits on a dead mount is not held by it."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[str, concurrent.futures.Future[Any], Callable[..., Any],
                                         tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._tid = 0
        self.busy: tuple[str, float] | None = None  # (what, since: monotonic) of the work in hand
        self._seen: tuple[tuple[str, float], tuple[int, int] | None, float] | None = None

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Runs ``fn(*args)`` on the lane after what was handed to it before; awaitable (its
        result or its exception). ``what``: how the status names it while it runs. Cancelling
        the awaitable before it runs drops it."""
        return asyncio.wrap_future(self.submit(what, fn, *args))

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """:meth:`call` for a caller that does not wait for it (its end is the lane's)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._q.put((what, fut, fn, args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="laminar-archive", daemon=True)
            self._thread.start()
        return fut

    def _serve(self) -> None:
        self._tid = threading.get_native_id()
        while (item := self._q.get()) is not None:
            what, fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            self.busy = (what, time.monotonic())
            try:
                res = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the caller's to handle
                fut.set_exception(e)
            else:
                fut.set_result(res)
            finally:
                self.busy = None

    @property
    def queued(self) -> int:
        """Pieces of work waiting behind the one in hand."""
        return self._q.qsize()

    def quiet_s(self, now: float) -> float | None:
        """Seconds the work in hand has gone without progress (no byte read, no CPU time of the
        lane's thread, as looked at by the calls of this method: call it every poll), or None
        when the lane is idle."""
        busy = self.busy
        if busy is None or not self._tid:
            self._seen = None
            return None
        progress = _progress(f"/proc/self/task/{self._tid}")
        if self._seen is None or self._seen[0] is not busy or self._seen[1] != progress:
            self._seen = (busy, progress, now)
        return now - self._seen[2]

    def close(self) -> None:
        """The lane's thread ends once the work in hand is done (at once when idle)."""
        if self._thread is not None:
            self._q.put(None)


class ArchiveGivenUp(Exception):
    """A publish in the archive whose waiter gave it up (:class:`ArchiveWait`): nothing published."""


class ArchiveWait:
    """One publish in the archive that the loop waits for only until a deadline
    (:meth:`StoppedCopies.publish_until`), shared with the lane's work on it. The loop gives it
    up when the deadline passes (:meth:`give_up`); the lane asks before each step that publishes
    (the copy's rename into place: :attr:`given_up`; the record's: :meth:`publish`). Whichever
    comes first wins, under a lock: a publish given up is never made (a hung archive that
    answers late publishes nothing the move, failed meanwhile, did not count on), and one whose
    record the lane began to put in place is not given up (the loop counts it as published)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "waiting"  # then "given up" (the loop) or "publishing" (the lane)

    def give_up(self) -> bool:
        """The loop's: True when the publish will never be made, False when the lane is putting
        its record in place (it is published, or about to be)."""
        with self._lock:
            if self._state == "publishing":
                return False
            self._state = "given up"
            return True

    def publish(self) -> bool:
        """The lane's, right before the record's rename: True when it may publish now (it can
        no longer be given up), False when it was given up."""
        with self._lock:
            if self._state == "given up":
                return False
            self._state = "publishing"
            return True

    @property
    def given_up(self) -> bool:
        with self._lock:
            return self._state == "given up"
