"""The agent's look at a job's checkpoint directory: bounded, off the event loop, never through a link.

A job's checkpoint directory (``state_dir/ckpt/<job>``, ``LAMINAR_CKPT_DIR``) is written by the
job, as its owner: it may hold hundreds of thousands of entries, links to anywhere (a hung
mount, ``/etc/shadow``), FIFOs, or a mount of its own. Every component that wants to know a
job's checkpoints (Airlock's work at risk, the checkpoint driver, the prestage rule, a move)
reads what :class:`CkptScanner` found, never the directory itself:

* a scan runs in a thread of its own :class:`laminar.offloop.Lane` (``SCAN_WORKERS`` threads,
  one scan per owner at a time), with a ``SCAN_TIMEOUT_S`` limit: past it the job's listing is
  *unknown* this round (the last one found stays in the cache) and its owner's next scans are
  refused while the stuck one has not returned;
* the directory is opened ``O_NOFOLLOW | O_DIRECTORY`` and read with ``os.scandir``; an entry
  is a checkpoint when its name is ``ckpt-<n>`` and its directory entry says directory
  (``is_dir(follow_symlinks=False)``: no ``stat`` of any entry, so nothing behind an entry is
  ever reached, a link or a mount point alike);
* at most ``SCAN_MAX_ENTRIES`` entries are read (``truncated`` says so); of the checkpoints
  among them the ``SCAN_KEEP`` with the highest numbers are kept;
* a directory whose ``(st_dev, st_ino, st_mtime_ns)`` did not change since the last scan is not
  read again (one ``fstat``), unless that change was too recent to trust (``RACY_S``: a
  file system's timestamps are coarse, so a second change within the same tick would not show).

The listing says nothing of a checkpoint's contents or size: those come from its check
against its manifest (laminar.migrate.ckpt_driver), never from a ``stat`` of the job's files.
Airlock's ``work_at_risk_s`` takes the directory's modification time (every checkpoint jobkit
commits is renamed into it): ``Job.ckpt_seen``, set here.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from laminar.offloop import Lane, LaneBusy

log = logging.getLogger("laminar.jobs")

# Entries of one checkpoint directory read per scan: jobkit keeps 2 checkpoints and their
# temporaries; 4096 is three orders of magnitude above that and reads in about 3 ms.
SCAN_MAX_ENTRIES = 4096
# The highest-numbered checkpoints a listing keeps: verification tries a few newest ones
# (migrate.verify_tries), a keep of 8 leaves room for those whose check failed.
SCAN_KEEP = 8
# A scan that takes longer waits on storage (a hung mount under the directory): its job is
# unknown this round, and its owner's next scans wait until that thread returns.
SCAN_TIMEOUT_S = 2.0
SCAN_WORKERS = 2
# A directory changed less than this before it was read may change again within the same
# timestamp tick (ext4's is a jiffy, some file systems' a second) without its mtime moving.
RACY_S = 1.0
_CKPT = re.compile(r"ckpt-(\d{1,30})")


@dataclass(frozen=True)
class Listing:
    """What one scan of a checkpoint directory found."""

    path: Path
    key: tuple[int, int, int]  # the directory's (st_dev, st_ino, st_mtime_ns)
    mtime: float  # the directory's modification time (wall clock)
    ckpts: tuple[tuple[str, int], ...]  # (name, inode) of the highest-numbered ckpt-<n>, oldest first
    entries: int  # entries read
    truncated: bool  # more entries than SCAN_MAX_ENTRIES: only the first ones were read
    racy: bool  # changed too recently to be trusted unchanged next time (RACY_S)
    at: float  # when it was taken or found unchanged (monotonic)

    def paths(self) -> list[Path]:
        """The checkpoints' paths, oldest first (what ``jobkit.list_checkpoints`` answered)."""
        return [self.path / n for n, _ in self.ckpts]

    def ident(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """Which checkpoints these are (names and directories: a checkpoint saved again at the
        same step is a new directory under the same name), comparable between scans."""
        return tuple((n, (self.key[0], ino)) for n, ino in self.ckpts)

    def ident_of(self, name: str) -> tuple[int, int] | None:
        for n, ino in self.ckpts:
            if n == name:
                return (self.key[0], ino)
        return None


def scan_dir(path: str | os.PathLike[str], prev: Listing | None = None, max_entries: int = SCAN_MAX_ENTRIES,
             keep: int = SCAN_KEEP) -> Listing | None:
    """The :class:`Listing` of the checkpoint directory ``path`` (blocking; see the module
    docstring), ``prev`` again (its time renewed) when the directory did not change since it,
    None when there is no directory there (a link is none)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            return None
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        now = time.monotonic()
        if prev is not None and prev.key == key and not prev.racy and prev.path == p:
            return replace(prev, at=now)
        wall = time.time()
        top: list[tuple[int, str, int]] = []  # a min-heap of (step, name, inode): the highest `keep`
        n = 0
        truncated = False
        with os.scandir(fd) as it:  # scandir(fd) reads a duplicate: fd is still closed below
            for e in it:
                if n >= max_entries:
                    truncated = True
                    break
                n += 1
                m = _CKPT.fullmatch(e.name)
                if m is None:
                    continue
                try:
                    if not e.is_dir(follow_symlinks=False):  # the entry's type: nothing behind it is reached
                        continue
                except OSError:
                    continue
                item = (int(m.group(1)), e.name, e.inode())
                if len(top) < keep:
                    heapq.heappush(top, item)
                elif item > top[0]:
                    heapq.heapreplace(top, item)
        return Listing(p, key, st.st_mtime, tuple((name, ino) for _, name, ino in sorted(top)), n, truncated,
                       racy=wall - st.st_mtime < RACY_S, at=now)
    finally:
        os.close(fd)


def _scan_many(items: list[tuple[str, Path, Listing | None]], max_entries: int) -> dict[str, Listing | None]:
    """One owner's jobs' listings, one after the other (one thread for them all)."""
    return {jid: scan_dir(path, prev, max_entries) for jid, path, prev in items}


class CkptScanner:
    """The cache of jobs' checkpoint listings and the bounded off-loop scans that fill it.

    :meth:`refresh` (one job) and :meth:`refresh_all` (every job given, one thread per owner)
    scan; :meth:`cached` answers without scanning (what Airlock and the planning rules read);
    :meth:`scan_now` scans inline for a caller without an event loop (tests, tools)."""

    def __init__(self, max_entries: int = SCAN_MAX_ENTRIES, timeout_s: float = SCAN_TIMEOUT_S,
                 workers: int = SCAN_WORKERS) -> None:
        self.max_entries = max_entries
        self.lane = Lane("ckpt-scan", workers=workers, timeout_s=timeout_s)
        self._cache: dict[str, Listing] = {}
        self._inflight: dict[str, asyncio.Future[Listing | None]] = {}
        self.counts = {"scans": 0, "unknown": 0, "truncated": 0}

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "cached": len(self._cache), "max_entries": self.max_entries,
                "lane": self.lane.stats()}

    def cached(self, job_id: str) -> Listing | None:
        return self._cache.get(job_id)

    def forget(self, job_id: str) -> None:
        self._cache.pop(job_id, None)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Drops the listings of jobs not in ``job_ids`` (ended)."""
        live = set(job_ids)
        for jid in [j for j in self._cache if j not in live]:
            del self._cache[jid]

    def _store(self, job: Any, got: Listing | None) -> None:
        prev = self._cache.get(job.id)
        if got is None:
            self._cache.pop(job.id, None)
        else:
            if prev is None or prev.key != got.key or prev.racy:  # read, not found unchanged
                self.counts["scans"] += 1
                self.counts["truncated"] += got.truncated
            self._cache[job.id] = got
        with contextlib.suppress(AttributeError):  # (a caller's stand-in job may not take it)
            job.ckpt_seen = got.mtime if got is not None and got.entries else None

    def scan_now(self, job: Any) -> Listing | None:
        """``job``'s listing scanned here and now (blocking: for a caller without an event loop)."""
        if not getattr(job, "ckpt_dir", None):
            return None
        got = scan_dir(job.ckpt_dir, self._cache.get(job.id), self.max_entries)
        self._store(job, got)
        return got

    async def refresh(self, job: Any, max_age_s: float = 0.0) -> Listing | None:
        """``job``'s listing now: the cached one when taken less than ``max_age_s`` ago, else a
        scan in the lane (one per job at a time: a second caller awaits the first's). None when
        there is no directory, or when the scan did not finish in time (unknown this round)."""
        if not getattr(job, "ckpt_dir", None):
            return None
        c = self._cache.get(job.id)
        if c is not None and time.monotonic() - c.at < max_age_s:
            return c
        flying = self._inflight.get(job.id)
        if flying is not None:
            return await asyncio.shield(flying)
        fut: asyncio.Future[Listing | None] = asyncio.get_running_loop().create_future()
        self._inflight[job.id] = fut
        got: Listing | None = None
        try:
            try:
                got = await self.lane.run(getattr(job, "owner_uid", 0), scan_dir, Path(job.ckpt_dir), c,
                                          self.max_entries)
                self._store(job, got)
            except (TimeoutError, LaneBusy):
                self.counts["unknown"] += 1
                got = None
            except OSError:
                got = None
        finally:
            del self._inflight[job.id]
            fut.set_result(got)
        return got

    async def follow(self, active: Callable[[], Iterable[Any]], every_s: float) -> None:
        """Every ``every_s``: the listing of every job ``active()`` returns (the job manager's
        active jobs, ``jobs.CKPT_SCAN_EVERY_S``), off the loop, one thread per owner; the
        listings of jobs no longer returned are dropped. Never returns; a failed round is logged."""
        while True:
            try:
                jobs = list(active())
                self.keep_only(j.id for j in jobs)
                await self.refresh_all(jobs, max_age_s=every_s / 2)
            except Exception:
                log.exception("jobs: looking at checkpoint directories")
            await asyncio.sleep(every_s)

    async def refresh_all(self, jobs: Iterable[Any], max_age_s: float = 0.0) -> None:
        """Every job's listing of ``jobs`` (those taken less than ``max_age_s`` ago kept): one
        thread per owner scans that owner's jobs one after the other, owners side by side; an
        owner whose scan does not finish in time has its jobs unknown this round."""
        now = time.monotonic()
        by_owner: dict[Any, list[Any]] = {}
        for j in jobs:
            if not getattr(j, "ckpt_dir", None) or j.id in self._inflight:
                continue
            c = self._cache.get(j.id)
            if c is not None and now - c.at < max_age_s:
                continue
            by_owner.setdefault(getattr(j, "owner_uid", 0), []).append(j)

        async def one(owner: Any, js: list[Any]) -> None:
            items = [(j.id, Path(j.ckpt_dir), self._cache.get(j.id)) for j in js]
            try:
                got = await self.lane.run(owner, _scan_many, items, self.max_entries)
            except (TimeoutError, LaneBusy, OSError):
                self.counts["unknown"] += len(js)
                return
            for j in js:
                self._store(j, got.get(j.id))

        if by_owner:
            await asyncio.gather(*(one(o, js) for o, js in by_owner.items()))
