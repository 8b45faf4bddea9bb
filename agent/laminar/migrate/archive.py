"""The archive, the guard of last resort (``migrate.archive_dir``; a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`, which inherits :class:`ArchiveMixin`; in long
form: docs/migration.md, *The archive, the guard of last resort* and *What the archive keeps, and
what goes*): stopped jobs' checkpoints no live peer can keep, running jobs' periodic checkpoints,
claims, the sweep, and the one thread that touches the archive (:class:`ArchiveLane`).

**The archive, the guard of last resort** (``archive_dir``: storage outside the pool that all
the zone's agents mount, as the shared storage Slurm jobs checkpoint to). Every other copy of a
job (its buddy's replicas, a holder's) is on a node of the zone; when the whole pool is gone
they all are. With ``archive_dir`` set, a stopped job's checkpoint and guard record
(``<archive>/<key>/ckpt-N/``, ``guard.json``) are written there, atomically, when no live peer
can hold them (a reclaim with no holder; a reclaimed guard with no peer to pass to) and by a
guard as soon as it finds no room. The record's claim is the lock: a node renames ``guard.json``
to ``claimed-<node>.json`` before it starts or places the job (one node wins), then to
``running-<node>.json``, or back when it found no room. Every agent with room tries the
unclaimed records (any agent, not only the guard: the guard may be gone); a guard whose job
another node claimed and runs stands down. A claim older than ``ARCHIVE_CLAIM_STALE_S`` whose
node never ran the job is taken over (by the job's guard, or by any agent with room that sees it
in the archive). So is the running record of a node that ran the job and is dead
(``orphan_after_s`` or its reclaim window, as for any take-over) before anything newer of the
job reached the archive (its new key holds no record): the checkpoint the job resumed from is
then its newest safe state (:meth:`ArchiveMixin._dead_runs`).

**What the archive keeps, and what goes** (:meth:`ArchiveMixin.archive_gc`, every
``archive_gc_s``, 10 s, by each agent). A claim that started its job leaves ``<archive>/<key>/`` behind
with ``running-<node>.json`` (the record, now naming where the job was resumed: its node and job
id) and the checkpoint it resumed from. That directory is removed once the job no longer needs
it: when the job it resumed **ended** where it runs (exited, or stopped by its user; the agent
running it removes it), or when the job's **newer state is safe** in the archive under its new
key (``n<node>-<job>``: a record whose checkpoint the job wrote itself after it resumed, verified
against its manifest; any agent removes it). Never removed: a directory with ``guard.json``,
``live.json`` or a ``claimed-*`` record (claimable, being claimed, or a claim whose node died,
which another agent takes over after ``ARCHIVE_CLAIM_STALE_S``); a running record whose job
failed to start, was lost, moved on or is still queued without a newer archived checkpoint; a
directory with a checkpoint and no record at all (a publish in progress, or a crash's only
copy: an operator's call). Temporary names (``.tmp-*`` partial copies, ``.guard-*``/
``.live-*``/``.running-*`` partial records and renamed-away ``.live-*.old`` ones) whose newest
file is older than ``ARCHIVE_TMP_STALE_S``, and directories with nothing in them for as long,
are a crashed writer's: whichever agent sees them removes them. Every removal is a rename into
``<archive>/.gc/`` first (one agent wins; a half-removed tree is never mistaken for a job), then
the tombstone's removal; symbolic links are never followed (one is removed as a link), and
nothing outside ``archive_dir`` is touched. The counts are in the component's status
(``counts``: ``archive_gc_dirs``, by why ``archive_gc_ended``/``_superseded``/``_empty``, and
``archive_gc_temporaries``).

**Periodic checkpoints in the archive.** While departures without notice are plausible (the
learned unannounced share is at least ``prestage_unannounced``, the rule that prestages), each
running job's newest committed checkpoint (before it wrote one: the verified checkpoint it was
restarted from, when the agent gave it: :meth:`ArchiveMixin._given_resume_from`) is copied to ``<archive>/<key>/ckpt-N/`` the same way (temporary name, verified
against its manifest, fsync'd, renamed) and the job's *live record* ``live.json`` (its node, its
buddy, its request) is pointed at it; older archived checkpoints of the job are then removed
(the newest complete one is kept), and when the job ends here (exited, stopped, failed, or moved
by a reclaim) the record and its checkpoints go. A live record is claimed like a guard record
(rename to ``claimed-<node>.json``), but only by the job's guard once its source is dead, or by
an agent with room that sees the job's node *and* its buddy dead (silent for
``orphan_after_s``, or their reclaim windows ended): a job whose node and buddy both leave
without notice rolls back only to its last archived periodic checkpoint. A stopped job's guard
record replaces its live record (taken by rename, so only one record is ever claimable), and a
node that finds its job's live record claimed does not publish another. A node whose window ended
counts as dead while its agent may still be copying the job's final checkpoint (late, the
archive hung): while it is heard from and its newer copy's temporary is in the key's directory,
the live record waits, unclaimed, at most as long as the progress that copy holds
(:meth:`ArchiveMixin._await_newer_copy`).

**When the archive hangs.** ``archive_dir`` is shared storage, and its server can stop
answering (an NFS or FUSE server gone: every stat, listing and open on the mount then waits,
often unkillably). The agent's loop never touches the archive: every look at it and every
write to it (the rounds, claims, publishes, periodic copies, the sweep, a claimed job's copy
for its owner) runs on one dedicated thread (:class:`ArchiveLane`), one piece at a time, and
a round is started only when the one before has ended. A hung archive so holds one thread;
the control socket, the kill switch, the zone, placements and Airlock go on, and what needs
the archive waits in order (nothing is lost or done twice). When the work in hand has made no
progress (no byte read, no CPU time) for ``ARCHIVE_STALL_SWEEPS`` x ``archive_gc_s`` (30 s by
default), the status says so (``migrate.archive.stalled_s``, ``busy``: what waits) and a log
line and an event (``archive-stalled``) say it once; ``archive-answers`` when it answers again.
A reclaim waits for the archive only until ``ARCHIVE_WAIT_MARGIN_S`` before its window ends
(:meth:`ArchiveMixin._archive_until`): its move then fails as with no archive (the job's buddy
still guards it) and the copy it waited for is given up (:class:`ArchiveWait`): when the storage
answers, it publishes nothing; a reclaimed guard's copy of a job it passes on is the exception,
published late (it is the job's only way back, and every taker claims it through the archive).
So is the copy of a job with no holder and no buddy, and it survives an agent stop or crash
(``migrate_late_copies``; :meth:`ArchiveMixin._restore_late_copies`): its "about to publish" is
committed before its record's rename, so a restart publishes it at most once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import re
import secrets
import shutil
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar import jobkit
from laminar.migrate.constants import _CKPT_NAME, _SAFE_KEY, SOURCE_LIVE_STATES
from laminar.migrate.errors import MigrateError
from laminar.migrate.trees import _newest_mtime, _remove_tree

if TYPE_CHECKING:
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.evidence import NoticeOdds
    from laminar.migrate.holder import RetrySchedule

log = logging.getLogger("laminar.migrate")

# A job in these states on the node a claim asks (``_still_runs``) ended there by itself, by its
# user, or moved elsewhere (its successor runs under its own key): not resumed again from the
# archive (the node's sweep removes the record: ended, or superseded). A job that failed there is
# (the archive keeps a failed job's state for that: ``_archive_gc_ended``).
ARCHIVE_ENDED_THERE = ("exited", "stopped", "migrated")
# An archive claim this old whose node never ran the job (it died trying) may be taken by another.
ARCHIVE_CLAIM_STALE_S = 600.0
# A running job's periodic checkpoint in the archive: its record (who runs it, its buddy).
LIVE_RECORD = "live.json"
# A temporary name in the archive (a partial copy or record) whose newest file is this old is a
# crashed writer's: any agent removes it. A copy in progress writes its files as it goes, so only
# a writer stalled this long loses its temporary (its rename then fails: nothing is published).
ARCHIVE_TMP_STALE_S = 3600.0
# How often each agent sweeps the archive (listing it on shared storage is not free): the default
# of ``[migrate] archive_gc_s``.
ARCHIVE_GC_S = 10.0
# Removals are renamed here first (one agent wins the rename), then removed.
ARCHIVE_TRASH = ".gc"
# A key whose claimed job ended or was superseded (the sweep removed its directory) leaves a marker
# here, ``<archive>/.done/<key>``, naming who ran it: without it a guard of that key that missed
# the claim (down, cut off) found nothing archived, published its older checkpoint again and
# another agent resumed the job a second time (bench/chaos.py). Kept ARCHIVE_DONE_KEEP_S.
ARCHIVE_DONE = ".done"
ARCHIVE_DONE_KEEP_S = 7 * 86400.0
ARCHIVE_DONE_EXPIRE_EVERY_S = 3600.0  # the markers are looked over for expiry this often, not at every sweep
# The archive counts as stalled (status ``archive.stalled_s``, one event) when the look at it in
# hand has made no progress (no byte read, no CPU time) for this many ``archive_gc_s`` (30 s by
# default): a round on healthy shared storage takes well under one; an NFS server's failover
# takes up to a minute or two, and it is only reported, never acted on.
ARCHIVE_STALL_SWEEPS = 3
# A reclaim waits for the archive's answer (the copy of a job no live peer can keep, a guard passed
# on) until this long before its window ends, and no longer: a hung archive then fails the move
# (its job thawed, its buddy still guarding it) and says so before the window's end stops what
# still runs, rather than the move being cut there in the middle, with nothing said.
ARCHIVE_WAIT_MARGIN_S = 1.0


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
    (:meth:`ArchiveMixin._archive_until`), shared with the lane's work on it. The loop gives it
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


_TMP_COPY = re.compile(r"\.tmp-(.+)-(\d+)-(\d+)")
_CKPT_STEP = re.compile(r"ckpt-(\d+)")


def _newer_copy(d: Path, src: int, rec: dict[str, Any], wall: float) -> tuple[str, str, float] | None:
    """The copy of a newer checkpoint of the job that node ``src`` is making in ``d`` (its key
    directory) while the job's live record ``rec`` names an older one: (the record's checkpoint,
    the newer one's name, the progress between them in seconds: when the copy began, its
    temporary's mtime, less the record's time), or None. A temporary older than
    ARCHIVE_TMP_STALE_S is a crashed writer's and does not count."""
    try:
        ts, have = float(rec["ts"]), str(rec["ckpt"])
    except (KeyError, TypeError, ValueError):
        return None
    m_have = _CKPT_STEP.fullmatch(have)
    best: tuple[str, str, float] | None = None
    for t in d.glob(".tmp-*"):
        m = _TMP_COPY.fullmatch(t.name)
        if m is None or int(m[2]) != src or m[1] == have:
            continue
        m_new = _CKPT_STEP.fullmatch(m[1])
        if m_have is not None and (m_new is None or int(m_new[1]) <= int(m_have[1])):
            continue  # not newer than the record's
        try:
            st = os.lstat(t)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or wall - st.st_mtime > ARCHIVE_TMP_STALE_S:
            continue
        gain = min(max(st.st_mtime - ts, 0.0), ARCHIVE_TMP_STALE_S)
        if best is None or gain < best[2]:
            best = (have, m[1], gain)
    return best


def _read_record(path: Path) -> dict[str, Any] | None:
    """An archive record (a regular file holding a JSON object; never through a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


class ArchiveMixin:
    """The archive: stopped jobs' checkpoints and guard records, running jobs' periodic ones,
    claims, the sweep, the archive's health and status."""

    if TYPE_CHECKING:
        # what this mixin uses of ReclaimComponent (its __init__ and its other parts)
        _archive_error: str | None
        _done_expired: float | None
        _archive_next: dict[str, float]
        _archive_rounds: int
        _archive_runs_told: dict[str, str]
        _archive_stalled: float | None
        _archive_tries: dict[str, int]
        _claimed_from: dict[str, str]
        _archiving: set[str]
        _gc_next: float
        _gc_running: bool
        _gc_unverified: set[tuple[str, str]]
        _lane: ArchiveLane
        ckpt: CkptDriver | None
        _late_stopping: set[str]
        _live_waits: dict[str, float]
        _round_running: bool
        _taking: set[str]
        agent: Any
        archived_live: dict[str, str]
        buddy: dict[str, int]
        counts: dict[str, int]
        evacuating: set[str]
        moves: dict[str, Any]
        notice_odds: NoticeOdds
        notices: dict[int, tuple[float, float]]
        reclaim: dict[str, Any] | None
        retry: RetrySchedule
        s: dict[str, Any]

        async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
        def _driver_checked(self, job: Any) -> tuple[Path | None] | None: ...
        def _emit(self, message: str, **fields: Any) -> None: ...
        def _last_seen(self, node: int) -> float: ...
        def _late_copy_settled(self, mv: Any, error: BaseException | None) -> None: ...
        def _request(self, job: Any, take_over: bool) -> dict[str, Any]: ...
        async def _resume_here(self, row: Any, req: dict[str, Any], path: Path, why: str) -> str | None: ...
        def _runs_here(self, key: str) -> str | None: ...
        def _source_dead(self, src: int, now: float, window_end: float | None = None,
                         since: float | None = None) -> str | None: ...
        def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
        def job_key(self, job: Any) -> str: ...
        @property
        def node_id(self) -> int: ...
        @property
        def zone(self) -> Any: ...

    def _archive_root(self) -> Path | None:
        a = str(self.s.get("archive_dir") or "")
        return Path(a) if a else None

    @staticmethod
    def _archive_key_dir(root: Path, key: str) -> Path:
        """``root/key``, made if missing, root's alone (0700): its records carry the job's request
        (env values included) and its checkpoints are a user's; the archive is shared storage that
        other users on the zone's nodes may reach."""
        d = root / key
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        return d

    def _archived(self, key: str) -> bool:
        """The archive holds a record of ``key``, or the marker of its claimed job that ended or
        was superseded (:data:`ARCHIVE_DONE`)."""
        root = self._archive_root()
        return root is not None and (((root / key).is_dir() and any((root / key).glob("*.json")))
                                     or self._archive_done(root, key) is not None)

    @staticmethod
    def _archive_done(root: Path, key: str) -> str | None:
        """Who ran ``key``'s claimed job, by its marker in ``<archive>/.done`` (written by the
        sweep that removed the key's directory), or None when there is none."""
        if not _SAFE_KEY.match(key):
            return None
        try:
            rec = json.loads((root / ARCHIVE_DONE / key).read_text())
        except (OSError, ValueError):
            return None
        return str(rec.get("runner") or "another node") if isinstance(rec, dict) else "another node"

    def _archive_runner(self, key: str) -> str | None:
        """Who runs an archived job (it claimed it and started it), or ran it (its marker), or None."""
        root = self._archive_root()
        for f in sorted((root / key).glob("running-*.json")) if root is not None else []:
            return f.name.removeprefix("running-").removesuffix(".json")
        return self._archive_done(root, key) if root is not None else None

    def _archive(self, key: str, ckpt: Path, record: dict[str, Any], wait: ArchiveWait | None = None,
                 mark: Callable[[], None] | None = None) -> Path:
        """Copies the verified checkpoint ``ckpt`` of ``key`` into the archive and (unless a node
        claimed or runs it) writes its guard record ``guard.json``, both atomically (a temporary
        name, fsync, rename): the archived checkpoint's path. Raises OSError/CheckpointError.
        ``wait``: its waiter's deadline (:class:`ArchiveWait`); once given up, nothing more is
        published (its temporaries are removed) and ArchiveGivenUp is raised. ``mark``: called
        (here, on the lane) right before the record is put in place, once it will be: a late
        copy's durable "about to publish" (:meth:`_late_mark`)."""
        root = self._archive_root()
        assert root is not None
        d = self._archive_key_dir(root, key)
        dst_dir = self._publish_copy(ckpt, d, wait)
        taken = any(d.glob("claimed-*.json")) or any(d.glob("running-*.json"))
        tmpj = d / f".guard-{self.node_id}-{time.monotonic_ns()}.tmp"
        if not taken:
            with open(tmpj, "w") as fh:
                json.dump({**record, "ckpt": ckpt.name, "archived_by": self.node_id, "ts": time.time()}, fh)
                fh.flush()
                os.fsync(fh.fileno())
        if wait is not None and not wait.publish():
            # the move that wanted it went on without it (a copy already renamed into place stays: a
            # record of another node may name it; with no record of its own it is an operator's call)
            with contextlib.suppress(OSError):
                tmpj.unlink()
            log.info("migrate: archive %s answered after the wait for %s's copy ended: no record published", root, key)
            raise ArchiveGivenUp(f"archive of {key} given up by its waiter")
        if not taken and mark is not None:
            mark()
        old_live = d / f".live-{self.node_id}-{time.monotonic_ns()}.old"
        if not taken and (d / LIVE_RECORD).exists():
            # the job's periodic record becomes its guard record: taken by rename (atomic), so a
            # node that claimed it meanwhile keeps it and no second claimable record appears
            try:
                os.rename(d / LIVE_RECORD, old_live)
            except OSError:
                taken = True
        if not taken:
            os.rename(tmpj, d / "guard.json")
        else:
            with contextlib.suppress(OSError):
                tmpj.unlink()
        with contextlib.suppress(OSError):
            old_live.unlink()
        return dst_dir

    async def _archive_until(self, what: str, key: str, ckpt: Path, record: dict[str, Any], until: float,
                             late_ok: bool = False,
                             settled: Callable[[BaseException | None], None] | None = None,
                             mark: Callable[[], None] | None = None, wait: ArchiveWait | None = None) -> Path:
        """:meth:`_archive` on the lane, waited for until ``until`` (monotonic) and no longer: a
        reclaim's copy, which must be made within its window while the archive may hang. The
        archived path; OSError/CheckpointError as :meth:`_archive`. Raises MigrateError naming
        the archive and the time waited when it has not answered by then (or the wait's task is
        cancelled: the window's end). The work may still be in hand on the lane then, waiting on
        the storage, or queued behind what is: it is given up (:class:`ArchiveWait`; dropped
        from the queue, and a late answer publishes nothing), so what the caller does instead
        stays true; except with ``late_ok`` (a late copy is still wanted, and whoever resumes the
        job claims it there first), when it goes on and says so once it is done (and calls
        ``settled`` on the event loop: with None once the copy is there, with the error when the
        storage refused it). A copy whose record the lane was putting in place when the time ran
        out counts as archived. ``mark``: as :meth:`_archive`'s. ``wait``: with ``late_ok``, the
        caller's :class:`ArchiveWait`, given up only if this wait is cancelled (the caller's job
        is thawed and runs on: a copy published later would be a second one); its state says
        whether it was."""
        root = self._archive_root()
        assert root is not None
        if not late_ok:
            wait = ArchiveWait()
        t0 = time.monotonic()
        fut = self._lane.call(what, self._archive, key, ckpt, record, wait, mark)
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, until - t0))
        except asyncio.CancelledError:
            if wait is not None and wait.give_up():
                fut.cancel()  # dropped while queued; in hand, it publishes nothing
            fut.add_done_callback(self._archive_late(what, late_ok, settled))
            raise
        if done:
            return Path(fut.result())
        waited = time.monotonic() - t0
        if late_ok:  # it goes on
            fut.add_done_callback(self._archive_late(what, late_ok, settled))
        elif wait is not None and not wait.give_up():
            log.info("migrate: %s: the record was being put in place in archive %s when %.1f s were up: counted as "
                     "archived", what, root, waited)
            fut.add_done_callback(self._archive_late(what, late_ok, settled))
            return root / key / ckpt.name
        else:
            fut.cancel()
        raise MigrateError(f"archive {root} did not answer in {waited:.1f} s ({what})")

    def _archive_late(self, what: str, late_ok: bool, settled: Callable[[BaseException | None], None] | None = None
                      ) -> Callable[[asyncio.Future[Any]], None]:
        """The end of a publish :meth:`_archive_until` stopped waiting for: said (with ``late_ok``,
        its late copy, with an event, after ``settled(None)``; its failure after
        ``settled(error)``), its error taken."""
        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                return
            e = fut.exception()
            if late_ok and settled is not None and not isinstance(e, ArchiveGivenUp):
                settled(e)
            if e is None and late_ok:
                self._emit(f"{what}: the archive answered late; the copy is there now", phase="archived-late")
            elif e is not None and not isinstance(e, ArchiveGivenUp):
                log.info("migrate: %s, after its wait ended: %s", what, e)
        return done

    # -- a late copy, across a restart (migrate_late_copies) ---------------------------------------

    def _late_row_add(self, key: str, job_id: str, ckpt: Path, record: dict[str, Any]) -> None:
        """Before a copy that may go on past its window's wait starts: what a restart needs to
        take it up (:meth:`_restore_late_copies`)."""
        with self.agent.store.tx() as db:
            db.execute("INSERT OR REPLACE INTO migrate_late_copies VALUES (?, ?, ?, ?, 0, 0, ?)",
                       (key, job_id, str(ckpt), json.dumps(record), time.time()))

    def _late_row_late(self, key: str) -> None:
        """The copy goes on past its window's wait, and its job is stopped for it."""
        with self.agent.store.tx() as db:
            db.execute("UPDATE migrate_late_copies SET late=1 WHERE key=?", (key,))

    def _late_row_drop(self, key: str) -> None:
        with self.agent.store.tx() as db:
            db.execute("DELETE FROM migrate_late_copies WHERE key=?", (key,))

    def _late_mark(self, key: str) -> None:
        """On the lane, right before the copy's record is put in place: ``publishing``, committed
        (synchronous=FULL) before the rename, so a restart that reads 0 knows the record never
        was (at most once: it may publish it). Through a connection of its own, not the loop's:
        its transaction is this one write's alone."""
        db = sqlite3.connect(str(self.agent.store.path), isolation_level=None, timeout=30.0)
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.execute("UPDATE migrate_late_copies SET publishing=1 WHERE key=?", (key,))
        finally:
            db.close()

    def _restore_late_copies(self) -> None:
        """At start: a late copy the agent's stop or crash cut (``migrate_late_copies``) is taken
        up again when its job is still ``reclaimed`` here (stopped for it; its checkpoint is only
        in its ckpt directory): published if its record never was; a record ``publishing`` when
        the agent stopped is looked for in the archive and never written twice
        (:meth:`_late_again`). A job still running here whose record was ``publishing`` (the
        agent stopped between the publish and the job's stop) is stopped now, as it would have
        been, and left out of the restored reclaim's moves (``_late_stopping``): the archive is
        its way back, so it runs once. Any other row (a job the agent stopped before it stopped:
        the restored reclaim moves it again) is dropped, with an event when its record may be in
        the archive (another agent may resume the job too)."""
        jobs_mgr = getattr(self.agent, "jobs", None)
        rows = self.agent.store.db.execute("SELECT * FROM migrate_late_copies").fetchall()
        for r in rows:
            key, job_id, publishing = str(r["key"]), str(r["job_id"]), bool(r["publishing"])
            job = jobs_mgr.get(job_id) if jobs_mgr is not None else None
            state = getattr(job, "state", None)
            active = state in ("running", "suspended")
            try:
                record = json.loads(r["record"])
            except ValueError:
                record = None
            if (self._archive_root() is None or not isinstance(record, dict)
                    or not ((state == "reclaimed" and (r["late"] or publishing)) or (active and publishing))):
                self._late_row_drop(key)
                if publishing and state != "reclaimed":
                    # its record may be in the archive, claimable, while the job is here too
                    self._emit(f"{job_id}: its copy to the archive (key {key}) was being published when the agent "
                               f"stopped, and the job is {state or 'gone'} here: if the archive holds its record, "
                               "another agent may resume it as well; check `laminarctl migrations`", job=job_id,
                               key=key, phase="archive-uncertain")
                else:
                    log.info("migrate: a copy of %s to the archive cut by the agent's stop is not taken up: the job "
                             "is %s here%s", job_id, state or "gone",
                             "" if isinstance(record, dict) else " (its stored record is not a JSON object)")
                continue
            if active:
                self._late_stopping.add(job_id)
                self._spawn(self._late_stop_then_copy(job, key, Path(r["ckpt"]), record))
            else:
                self._spawn(self._late_copy_again(key, job_id, Path(r["ckpt"]), record, publishing))

    async def _late_stop_then_copy(self, job: Any, key: str, ckpt: Path, record: dict[str, Any]) -> None:
        """A job whose archived record was being published when the agent stopped, before the
        job did: stopped here (``reclaimed``) as it would have been, then its copy is seen to."""
        try:
            with contextlib.suppress(Exception):
                job.cgroup.thaw(timeout=2.0)  # a frozen job is not killed by a signal until it thaws
            try:
                await self.agent.jobs.stop(job.id, f"node {self.node_id} reclaimed: {ckpt.name} was being published "
                                           "in the archive when the agent stopped; the first agent with room resumes "
                                           "the job from there", grace_s=0, state="reclaimed")
            except Exception as e:
                log.warning("migrate: stopping %s, archived before the restart: %s", job.id, e)
            await self._late_copy_again(key, job.id, ckpt, record, True)
        finally:
            self._late_stopping.discard(job.id)

    async def _late_copy_again(self, key: str, job_id: str, ckpt: Path, record: dict[str, Any],
                               publishing: bool) -> None:
        """A late copy taken up after a restart: on the lane (waited for as long as the archive
        takes: it is the job's only way back), its move shown (``archiving``, then ``archived``
        or ``failed``) and said with events."""
        from laminar.migrate.reclaim import Move

        mv = Move(job_id, key, "a late archive copy taken up after the agent's restart", phase="archiving",
                  ckpt=ckpt.name, ended=time.time())
        self.moves[job_id] = mv
        self.counts["archive_late_resumed"] = self.counts.get("archive_late_resumed", 0) + 1
        self._emit(f"{job_id}: its copy of {ckpt.name} to the archive was cut by the agent's stop; taken up again",
                   job=job_id, ckpt=ckpt.name, phase="archiving")
        try:
            res = await self._lane.call(f"archiving {job_id} again", self._late_again, key, ckpt, record, publishing)
        except (OSError, jobkit.CheckpointError, MigrateError) as e:
            self._late_row_drop(key)
            self._late_copy_settled(mv, e)
            return
        self._late_row_drop(key)
        self._late_copy_settled(mv, None)
        if res == "gone":
            self._emit(f"{job_id}: its record was being put in the archive when the agent stopped, and nothing "
                       f"of it is there now (claimed and run to its end elsewhere, or removed): not published "
                       f"again (the job would run twice); {ckpt.name} stays in its ckpt directory here",
                       job=job_id, key=key, phase="archived")
        else:
            self._emit(f"{job_id}: {ckpt.name} is in the archive ({res} after the agent's restart); the first "
                       "agent with room resumes it", job=job_id, ckpt=ckpt.name, phase="archived-late")

    def _late_again(self, key: str, ckpt: Path, record: dict[str, Any], publishing: bool) -> str:
        """On the lane: a late copy after a restart. With ``publishing`` its record may already be
        in place: a record of the key there (``guard.json``, a claim, a runner) is it
        ("published"); a temporary record of this node's (``.guard-<node>-*.tmp``, removed by
        the rename only) says the rename never happened (published now); neither says it was
        published and has since gone (claimed, run to its end elsewhere and removed, or the
        temporary removed as stale): "gone", nothing published. Otherwise the copy is made
        ("published now"). Raises OSError/CheckpointError/MigrateError."""
        root = self._archive_root()
        if root is None:
            raise MigrateError("migrate.archive_dir is not set any more")
        d = root / key
        if publishing:
            if (d / "guard.json").exists() or any(d.glob("claimed-*.json")) or any(d.glob("running-*.json")):
                return "published"
            if not any(d.glob(f".guard-{self.node_id}-*.tmp")):
                return "gone"
        jobkit.verify_checkpoint(ckpt)
        self._archive(key, ckpt, record, None, mark=lambda: self._late_mark(key))
        return "published now"

    # -- periodic checkpoints in the archive (live.json) -----------------------------------------

    def _archive_periodic_due(self) -> bool:
        """The prestaging rule's unannounced branch: periodic checkpoints go to the archive too
        while departures without notice are plausible (a job whose node and buddy both leave
        without notice then rolls back only to its last periodic checkpoint)."""
        return (self._archive_root() is not None
                and self.notice_odds.unannounced_frac >= float(self.s["prestage_unannounced"]))

    def _publish_copy(self, ckpt: Path, d: Path, wait: ArchiveWait | None = None) -> Path:
        """``d/<ckpt.name>``: the verified checkpoint ``ckpt`` copied there under a temporary
        name, checked against its manifest, fsync'd and renamed into place (kept as it is when
        a complete copy of that name is already there; an incomplete leftover is replaced).
        Raises OSError/CheckpointError; a failed copy is removed, never published; so is one
        whose ``wait`` was given up (ArchiveGivenUp)."""
        dst_dir = d / ckpt.name
        if dst_dir.is_dir() and (dst_dir / jobkit.MANIFEST).exists():
            return dst_dir
        tmp = d / f".tmp-{ckpt.name}-{self.node_id}-{time.monotonic_ns()}"
        try:
            shutil.copytree(ckpt, tmp)
            jobkit.verify_checkpoint(tmp)
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if wait is not None and wait.given_up:
                raise ArchiveGivenUp(f"copy of {ckpt.name} into {d} given up by its waiter")
            shutil.rmtree(dst_dir, ignore_errors=True)  # an incomplete leftover of that name
            os.rename(tmp, dst_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dst_dir

    def archive_live(self, key: str, ckpt: Path, record: dict[str, Any]) -> Path | None:
        """Copies the committed periodic checkpoint ``ckpt`` of the running job ``key`` into the
        archive (a temporary name, verified against its manifest, fsync'd, renamed: the same
        layout and checks as :meth:`_archive`), then points the job's live record
        (``live.json``: who runs it, its buddy, its request) at it and removes the older archived
        checkpoints: the newest complete one is kept. A stopped job's record (``guard.json``,
        ``claimed-*``, ``running-*``) is never touched: then nothing is written and None is
        returned. Blocking file I/O (callers run it in a thread). Raises OSError/CheckpointError
        (a corrupt copy is removed, never published)."""
        root = self._archive_root()
        assert root is not None
        d = self._archive_key_dir(root, key)

        def stopped() -> bool:
            # (a ``.done`` marker: the key was claimed, run elsewhere and swept; this copy runs on
            # only because a partition kept it from hearing so: a new live record would be
            # claimed a second time. bench/chaos.py --long-partitions)
            return ((d / "guard.json").exists() or any(d.glob("claimed-*.json"))
                    or any(d.glob("running-*.json")) or self._archive_done(root, key) is not None)

        if stopped():
            return None
        dst_dir = self._publish_copy(ckpt, d)
        tmpj = d / f".live-{self.node_id}-{time.monotonic_ns()}.tmp"
        with open(tmpj, "w") as out:
            json.dump({**record, "ckpt": ckpt.name, "archived_by": self.node_id, "ts": time.time()}, out)
            out.flush()
            os.fsync(out.fileno())
        os.rename(tmpj, d / LIVE_RECORD)
        if stopped():
            # a node claimed the previous live record meanwhile (it thinks this node is dead):
            # that claim is the lock; this record must not be a second one
            with contextlib.suppress(OSError):
                (d / LIVE_RECORD).unlink()
            return None
        for old in d.glob("ckpt-*"):
            if old.name != ckpt.name and not stopped():
                shutil.rmtree(old, ignore_errors=True)
        return dst_dir

    def _own_live_records(self, root: Path) -> dict[str, str]:
        """{job id: checkpoint} of the live records in the archive that name this node the job's
        node (blocking: the lane)."""
        out: dict[str, str] = {}
        prefix = f"n{self.node_id}-"
        with contextlib.suppress(OSError):
            for g in root.glob(f"{prefix}*/{LIVE_RECORD}"):
                try:
                    rec = json.loads(g.read_text())
                    if int(rec["src_node"]) == self.node_id:
                        out[g.parent.name[len(prefix):]] = str(rec.get("ckpt") or "")
                except (OSError, ValueError, KeyError, TypeError):
                    continue
        return out

    @staticmethod
    def _live_held(d: Path) -> bool:
        """``d`` (a key's directory) holds its live record, or a claim of it that no node runs yet."""
        try:
            return (d / LIVE_RECORD).exists() or (any(d.glob("claimed-*.json")) and not any(d.glob("running-*.json")))
        except OSError:
            return False

    def drop_live(self, key: str) -> bool:
        """The job ended here (by itself, stopped, failed, or moved by a reclaim): its live record
        and archived periodic checkpoints go. The record is taken by rename first, so a node that
        claimed it meanwhile keeps it (and its checkpoint). True when removed."""
        root = self._archive_root()
        if root is None:
            return False
        d = root / key
        old = d / f".live-{self.node_id}-{time.monotonic_ns()}.old"
        try:
            os.rename(d / LIVE_RECORD, old)
        except OSError:
            return False
        if any(d.glob("guard.json")) or any(d.glob("claimed-*.json")) or any(d.glob("running-*.json")):
            with contextlib.suppress(OSError):
                old.unlink()
            return False
        return self._tombstone(root, d)

    def _archive_watch(self) -> None:
        """Each poll of the watch loop: the archive's health (:meth:`_archive_health`), then its
        next round (:meth:`_archive_round`) unless one is still in flight: one at a time, so on
        a hung archive one round waits on the lane and none piles up behind it."""
        if self._archive_root() is None:
            return
        self._archive_health()
        if not self._round_running:
            self._round_running = True
            self._spawn(self._archive_round())

    def _archive_stall(self, now: float) -> tuple[float | None, str | None]:
        """(seconds without progress, what waits) of the archive work in hand when that is at
        least ARCHIVE_STALL_SWEEPS x ``archive_gc_s`` (the archive is stalled), else (None, what
        runs now or None)."""
        quiet = self._lane.quiet_s(now)
        busy = self._lane.busy
        what = busy[0] if busy is not None else None
        if quiet is not None and quiet >= ARCHIVE_STALL_SWEEPS * float(self.s["archive_gc_s"]):
            return quiet, what
        return None, what

    def _archive_health(self) -> None:
        """Says once (a log line and an event, ``archive-stalled``) when the archive stopped
        answering (:meth:`_archive_stall`), and once (``archive-answers``) when it answers again."""
        now = time.monotonic()
        quiet, what = self._archive_stall(now)
        if quiet is not None and self._archive_stalled is None:
            self._archive_stalled = now - quiet
            msg = (f"archive: {self._archive_root()} does not answer: {what} has made no progress for {quiet:.1f} s "
                   "(its storage hangs?); archive work (claims, publishes, sweeps) waits for it, the rest of the "
                   "agent goes on")
            log.warning("migrate: %s", msg)
            self._emit(msg, phase="archive-stalled", waiting=what, stalled_s=round(quiet, 1))
        elif quiet is None and self._archive_stalled is not None:
            msg = f"archive: {self._archive_root()} answers again after {now - self._archive_stalled:.1f} s"
            self._archive_stalled = None
            log.info("migrate: %s", msg)
            self._emit(msg, phase="archive-answers")

    async def _archive_round(self) -> None:
        """One round of the archive's work: the look at it (:meth:`_archive_look`, on the lane),
        then, here on the loop, what it found: ended jobs' live records gone, running jobs'
        newer periodic checkpoints copied (the prestaging rule's unannounced branch,
        :meth:`_archive_periodic_due`), and any archived job no node runs tried here
        (:meth:`_from_archive`): unclaimed guard records, live records of jobs whose node and
        buddy are gone, stale claims, claims whose runner died (:meth:`_dead_runs`); then the
        sweep (:meth:`_archive_gc_round`). Claims and the sweep wait while this node is being
        reclaimed, and stay off once it is (its window ended and the reclaim was not withdrawn): a
        job it claimed would sit queued on a node its owner took back, while its claim told every
        other node (the job's buddy's guard too) that a node runs it."""
        try:
            root = self._archive_root()
            if root is None:
                return
            reclaiming = self.reclaim is not None  # under reclaim, or reclaimed (withdrawn: None again)
            if not self._archive_rounds:
                # the first round since the start: this node's live records in the archive (what it
                # archived before a restart; archived_live is kept in memory only). Before, a job
                # that ended after a restart left its live record, and a node that took this one
                # for gone later resumed the ended lineage from it (bench/chaos.py
                # --fence-after-s, seed 29)
                mine = await self._lane.call("own live records", self._own_live_records, root)
                for jid, ck in mine.items():
                    self.archived_live.setdefault(jid, ck)
            ended: dict[str, str] = {}
            for jid in list(self.archived_live):
                job = self.agent.jobs.get(jid)
                if job is None or (not job.active and job.state in ("exited", "stopped", "failed", "migrated")):
                    if jid not in self._archiving:
                        self.archived_live.pop(jid, None)
                        ended[jid] = job.state if job else "gone"
            periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]] = []
            if self._archive_periodic_due() and not reclaiming:
                # each job's newest verified checkpoint as the checkpoint driver's check of its
                # listing found it: nothing is read for it here. Before, the look hashed every
                # running job's newest checkpoint whole at every round (poll_s), copied or not.
                # A listing the running driver has not checked yet waits for its check.
                driving = self.ckpt is not None and self.ckpt.threaded
                for j in list(self.agent.jobs.active()):
                    if j.id in self.evacuating or j.id in self._archiving or not j.ckpt_dir:
                        continue
                    known = self._driver_checked(j)
                    if known is None and driving:
                        continue
                    periodic.append((j.id, str(j.ckpt_dir), self._given_resume_from(j, root), known))
            wall, mono = time.time(), time.monotonic()
            z = self.zone
            alive = {self.node_id} | {n for n in (list(z.membership.by_node) if z is not None else [])
                                      if self._source_dead(int(n), wall) is None}
            skip = set(self._taking) | {k for k, t in self._archive_next.items() if mono < t}
            look = await self._lane.call("archive round", self._archive_look, root, list(ended), periodic,
                                         not reclaiming, frozenset(alive), frozenset(skip), wall)
            self._archive_rounds += 1
            self._archive_error = None
            for jid in look["dropped"]:
                self._emit(f"{jid}: ended ({ended[jid]}); its archived periodic checkpoints removed", persist=False,
                           job=jid, phase="archive-dropped")
            for jid in look.get("drop_again", []):  # (looked at again next round, as long as it is held)
                self.archived_live.setdefault(jid, "")
            for jid, ckpt in look["ckpts"].items():
                job = self.agent.jobs.get(jid)
                if (job is None or not job.active or jid in self.evacuating or jid in self._archiving
                        or self.archived_live.get(jid) == ckpt.name):
                    continue
                self._archiving.add(jid)
                self._spawn(self._archive_periodic(job, ckpt))
            if not look["claims"] or self.reclaim is not None:
                return
            self._archive_claims(look, time.time())
            self._archive_gc_round()
        except (OSError, ValueError) as e:  # the storage (gone, refusing): the next round looks again
            if str(e) != self._archive_error:  # said once while it lasts, not every poll_s
                log.warning("migrate: archive round: %s", e)
            self._archive_error = str(e)
        except Exception:
            log.exception("migrate: archive round failed")
        finally:
            self._round_running = False

    def _given_resume_from(self, job: Any, root: Path) -> str | None:
        """The job's ``resume_from`` when the agent gave it (recorded so by the job manager:
        laminar.runtime.provenance; a path in its state directory: a replica, its owner's copy, a
        requeued job's own checkpoint; or in the archive), else None. One its user set is never
        taken for the agent's: root copied such a path (another user's checkpoint) into the
        archive as the job's state. The round's look (on the lane) stats it, and copies it when
        the job has written nothing since: a path of the job's user's own, on storage of theirs
        that may hang, would hold the archive's one thread (and every claim and publish behind
        it) for as long. Never touches the path."""
        rf = getattr(getattr(job, "origin", None), "resume_given", None)
        if not rf:
            return None
        p = Path(os.path.normpath(str(rf)))
        state = Path(os.path.normpath(str(self.agent.config.state_dir)))
        return str(rf) if state in p.parents or Path(os.path.normpath(root)) in p.parents else None

    def _archive_look(self, root: Path, ended: list[str],
                      periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]], claims: bool,
                      alive: frozenset[int], skip: frozenset[str], wall: float) -> dict[str, Any]:
        """The archive round's file work (on the lane; never on the loop): drops the live records
        of the ``ended`` jobs (:meth:`drop_live`), finds the newest checkpoint of each running job
        in ``periodic`` ((job id, its checkpoint directory, its ``resume_from``, (the newest
        verified one) while the checkpoint driver's check of the job's listing holds, else None):
        the newest it committed, or before it wrote one, the verified checkpoint it was restarted
        from; with the driver's answer nothing is read here: the copy is checked as it is made),
        and,
        with ``claims`` and the archive a directory, lists what may be claimed: guard records,
        live records of nodes not in ``alive`` ((key, src, buddy, newer): ``newer`` from
        :func:`_newer_copy`), stale claims (:meth:`_stale_claims`) and claims whose
        runner is not in ``alive`` and may be dead (:meth:`_running_records`). Keys in ``skip``
        (taken or waiting) are not read. Returns ``{"dropped", "ckpts", "claims", "guards",
        "lives", "stale", "runs"}``."""
        out: dict[str, Any] = {"dropped": [], "ckpts": {}, "claims": False, "guards": [], "lives": [], "stale": [],
                               "runs": [], "drop_again": []}
        for jid in ended:
            key = f"n{self.node_id}-{jid}"
            if self.drop_live(key):
                out["dropped"].append(jid)
                # the lineage ended here: a guard of this key that missed the release (this node
                # was cut off from it when the job ended) finds the marker and stands down
                # (_claim_archived). Before, the buddy took the ended job over after
                # orphan_after_s and ran its last steps, and its end, a second time
                # (bench/chaos.py --fence-after-s, seed 31)
                self._mark_done(root, key, f"node {self.node_id}", "ended there", wall)
            elif self._live_held(root / key):
                # claimed by a node that has not run it (yet): it gives the record back if it finds
                # no room, and then the ended job's record would be claimable again (a lineage that
                # ended, resumed: bench/chaos.py --fence-after-s, seed 29). Dropped again next round.
                out["drop_again"].append(jid)
        for jid, ckpt_dir, rf, known in periodic:
            ckpt = known[0] if known is not None else jobkit.latest_checkpoint(ckpt_dir)
            if ckpt is None and rf:
                # restarted from a checkpoint (a move, a guard, the archive) and none written
                # since: the one it resumed from is its newest, archived at once under its new key
                ckpt = Path(rf) if (Path(rf) / jobkit.MANIFEST).exists() else None
            if ckpt is not None:
                out["ckpts"][jid] = ckpt
        if not claims or not root.is_dir():
            return out
        out["claims"] = True
        out["guards"] = [g.parent.name for g in root.glob("*/guard.json") if g.parent.name not in skip]
        for g in root.glob(f"*/{LIVE_RECORD}"):
            if g.parent.name in skip:
                continue
            try:
                rec = json.loads(g.read_text())
                src = int(rec["src_node"])
                if src in alive:
                    continue  # its node runs it: not claimable (nor its directory listed for a newer copy)
                if not self._window_ended(src, wall) and wall - os.stat(g).st_mtime < float(self.s.get("orphan_after_s") or 0):
                    # only silent, and written lately: its node is alive whatever the zone hears of it
                    # (a partition: it still reaches the archive). bench/chaos.py --long-partitions: a
                    # partitioned node's new live record was claimed a second after it was written.
                    # (A node dead by its window's end is asked first: _from_archive's ``ask``.)
                    continue
                out["lives"].append((g.parent.name, src, rec.get("buddy"), _newer_copy(g.parent, src, rec, wall)))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # claimed meanwhile, or not ours to read
        out["stale"] = [(k, rec) for k, rec in self._stale_claims(root, wall) if k not in skip]
        out["runs"] = [(k, n, j) for k, n, j in self._running_records(root, lambda n: n in alive) if k not in skip]
        return out

    async def _archive_periodic(self, job: Any, ckpt: Path) -> None:
        key = self.job_key(job)
        buddy = self.buddy.get(job.id)
        rf = getattr(job.spec, "resume_from", None)
        record = {"key": key, "src_node": self.node_id, "src_job": job.id, "buddy": buddy,
                  "request": self._request(job, False), "periodic": True,
                  # the checkpoint it resumed from, not one it wrote: what it resumed from stays (archive_gc)
                  "resumed_copy": bool(rf) and Path(str(rf)) == ckpt}
        try:
            path = await self._lane.call(f"periodic copy of {job.id}", self.archive_live, key, ckpt, record)
            if path is not None:
                self.archived_live[job.id] = ckpt.name
                self.counts["archived_periodic"] = self.counts.get("archived_periodic", 0) + 1
                self._emit(f"{job.id}: periodic {ckpt.name} archived (node and buddy leaving without notice would "
                           "roll it back only to here)", persist=False, job=job.id, ckpt=ckpt.name,
                           phase="archived-periodic")
        except (OSError, jobkit.CheckpointError) as e:  # removed by the job's keep meanwhile, a full archive
            log.info("migrate: archiving periodic %s of %s failed: %s", ckpt.name, job.id, e)
        finally:
            self._archiving.discard(job.id)

    def _claim(self, key: str, live: bool = False, dead_runner: int | None = None) -> bool:
        """Takes the archive's claim on ``key`` (rename guard.json -> claimed-<node>.json: one
        node wins; the claim's time is its mtime). A claim older than ARCHIVE_CLAIM_STALE_S
        whose node never ran the job (it died trying) is taken over the same way. ``live``: a
        running job's periodic record (``live.json``) may be claimed too (its node is dead, and
        its buddy is this node or dead as well). ``dead_runner``: the running record of that node,
        which ran the job from here and died before anything newer of it was archived
        (:meth:`_dead_runs`). False when another node holds it or there is none."""
        root = self._archive_root()
        if root is None:
            return False
        d = root / key
        mine = d / f"claimed-{self.node_id}.json"
        srcs = [d / "guard.json"] + ([d / LIVE_RECORD] if live else [])
        if dead_runner is not None and dead_runner != self.node_id:
            srcs.append(d / f"running-{dead_runner}.json")
        with contextlib.suppress(OSError):
            srcs += [f for f in d.glob("claimed-*.json")
                     if f != mine and time.time() - f.stat().st_mtime > ARCHIVE_CLAIM_STALE_S]
        for src in srcs:
            try:
                os.rename(src, mine)
            except OSError:
                continue
            with contextlib.suppress(OSError):
                os.utime(mine)
            if src.name.startswith("claimed-"):
                self._claimed_from.pop(key, None)
            else:
                self._claimed_from[key] = src.name  # what _unclaim gives it back as
            return True
        return False

    def _unclaim(self, key: str) -> None:
        """Gives this node's claim on ``key`` back (it found no room, or the record's checkpoint
        did not verify) as the record it took (:meth:`_claim` notes which): a dead runner's
        ``running-<node>.json``, a running job's live record (claimable again only while its node
        and buddy are gone), a stopped job's ``guard.json``. As a guard record, a live one would be
        claimed by any agent with room at once, and a node thought dead that was only slow would
        then run the job twice. A stale claim taken over goes back as its record says (``periodic``:
        a live record, else ``guard.json``). Blocking file I/O (on the lane)."""
        root = self._archive_root()
        took = self._claimed_from.pop(key, None)
        if root is None:
            return
        mine = root / key / f"claimed-{self.node_id}.json"
        if took is None:
            took = "guard.json"
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if json.loads(mine.read_text()).get("periodic"):
                    took = LIVE_RECORD
        with contextlib.suppress(OSError):
            os.rename(mine, root / key / took)

    def _claim_done(self, key: str, who: str, runs: tuple[int, str] | None = None) -> None:
        """The claimed job runs (here or where this node placed it): the claim becomes
        ``running-<node>.json`` (no node claims it again). ``runs``: (node, job id) of the job
        resumed from it, written into the record (``resumed``), so any agent can tell when the
        job's newer state is in the archive and this directory may go (:meth:`archive_gc`)."""
        root = self._archive_root()
        self._claimed_from.pop(key, None)
        if root is None:
            return
        d = root / key
        mine = d / f"running-{self.node_id}.json"
        try:
            os.rename(d / f"claimed-{self.node_id}.json", mine)
        except OSError:
            return
        if runs is None or not runs[1]:
            return
        tmp = d / f".running-{self.node_id}-{time.monotonic_ns()}.tmp"
        try:
            rec = json.loads(mine.read_text())
            rec["resumed"] = {"node": int(runs[0]), "job": str(runs[1]), "ts": time.time()}
            with open(tmp, "w") as out:
                json.dump(rec, out)
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, mine)  # only this node writes its running record
        except (OSError, ValueError, TypeError) as e:  # the record stays as it was: kept, never removed
            log.info("migrate: noting where archived %s runs failed: %s", key, e)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _archive_claims(self, look: dict[str, Any], wall: float) -> None:
        """Any agent with room resumes an archived job no node runs: every claimable record the
        round's look found (:meth:`_archive_look`) is tried here (``_from_archive``)."""
        now = time.monotonic()

        def free(key: str) -> bool:
            return key not in self._taking and now >= self._archive_next.get(key, 0.0)

        for key in look["guards"]:
            if not free(key) or self._guarded_here(key):
                continue  # this node guards it: its own take-over goes through the claim
            self._taking.add(key)
            self._spawn(self._from_archive(key))
        waited = {}
        for key, src, buddy, newer in look["lives"]:
            if not free(key) or self._run_elsewhere(src, buddy, wall):
                continue  # its node runs it, or its buddy lives and resumes it from its replica
            if self._guarded_here(key):
                continue  # this node guards it: its own take-over goes through the claim
            if newer is not None and self._await_newer_copy(key, src, newer, wall, now):
                waited[key] = self._live_waits[key]
                continue
            self._taking.add(key)
            self._spawn(self._from_archive(key, live=True, ask=(src, key) if self._window_ended(src, wall) else None))
        self._live_waits = waited  # a wait ends with its record (claimed, replaced by the newer one, gone)
        for key, rec in look["stale"]:
            # its node claimed it and died before the job ran: claimable again (_claim takes it over)
            if not free(key):
                continue
            if rec.get("periodic"):  # claimed from a live record: only while its node and buddy are still gone
                try:
                    src, buddy = int(rec["src_node"]), rec.get("buddy")
                except (KeyError, TypeError, ValueError):
                    continue
                if self._run_elsewhere(src, buddy, wall):
                    continue
            if self._guarded_here(key):
                continue  # this node guards it: its own take-over goes through the claim
            self._taking.add(key)
            self._spawn(self._from_archive(key))
        for key, node, (runs_on, job) in look["runs"]:
            if not free(key) or self._source_dead(node, wall) is None or self._guarded_here(key):
                continue
            self._taking.add(key)
            # the node it placed the job on (another, alive or not: that one is asked) or itself
            # (asked when its window ended: it may be back), whether the job runs there
            ask = (runs_on, f"n{runs_on}-{job}") if runs_on != node or self._window_ended(node, wall) else None
            self._spawn(self._from_archive(key, dead_runner=node, ask=ask))

    def _window_ended(self, node: int, wall: float) -> bool:
        """Whether ``node``'s reclaim window (the zone's notice) has ended. Such a node counts as
        dead, yet its agent may have come back after the window (restarted, its reclaim cleared:
        the owner gave the node back) and run what it claimed or started since: its archived
        records are asked about first (:meth:`_from_archive`'s ``ask``). A claim of a node
        that is only silent is not (it does not answer)."""
        notice = self.notices.get(node)
        return notice is not None and wall >= notice[0]

    def _await_newer_copy(self, key: str, src: int, newer: tuple[str, str, float], wall: float, now: float) -> bool:
        """Whether the live record of ``key`` waits (is not claimed yet) for the newer checkpoint
        its node ``src`` is copying into the archive (``newer``: the record's checkpoint, the newer
        one's name, the progress between them in seconds; :func:`_newer_copy`). A node whose
        reclaim window ended counts as dead, yet its agent may still be there, making the late
        copy of the job's final checkpoint (the archive hung past the window's wait): claiming the
        older record then would resume the job from there and throw away the newer one (its
        record is never published once the live record is claimed). So while ``src`` is heard from
        (within ``dead_after_s``), the claim waits, at most as long as the progress it would save
        (the rent-or-buy break-even: the wait never costs more than that progress); a silent
        ``src`` is not waited for."""
        seen = self._last_seen(src)
        if seen < 0 or wall - seen >= float(self.s["dead_after_s"]):
            return False
        first = self._live_waits.setdefault(key, now)
        if now - first >= newer[2]:
            self._emit(f"{key}: waited {now - first:.1f} s for node {src}'s copy of {newer[1]} into the archive "
                       f"(the progress it holds over {newer[0]}); resumed from {newer[0]}", persist=False,
                       key=key, ckpt=newer[0], phase="archive-live-waited")
            return False
        if now == first:
            self._emit(f"{key}: its archived {newer[0]} is not claimed yet: node {src}, heard from past its "
                       f"reclaim window, is copying {newer[1]} into the archive (waits up to {newer[2]:.1f} s, "
                       "the progress it holds)", persist=False, key=key, ckpt=newer[0], phase="archive-live-wait")
        return True

    def _guarded_here(self, key: str) -> bool:
        """This node guards (or waits to resume) the job ``key``."""
        row = self.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        return row is not None and row["state"] in ("guarding", "waiting")

    def _run_elsewhere(self, src: int, buddy: Any, wall: float) -> bool:
        """A running job's archived record is not this node's to claim: this node runs it, its
        node ``src`` is alive, or its ``buddy`` (another node) is and resumes it from its replica."""
        if src == self.node_id or self._source_dead(src, wall) is None:
            return True
        return buddy is not None and int(buddy) != self.node_id and self._source_dead(int(buddy), wall) is None

    def _dead_runs(self, root: Path, now: float) -> list[tuple[str, int]]:
        """(key, node) of each job claimed from the archive whose runner ``node`` (another node)
        is dead (:meth:`_source_dead`) before anything newer of the job reached the archive: its
        successor ``n<node>-<job>`` (the record's ``resumed``) holds no record. The claimed
        checkpoint is then the job's newest safe state, and any agent may claim it again. With
        a successor record, the job is recovered through it (its live record), never twice; a
        record without ``resumed`` (written before it existed) names no successor and is left.
        Blocking file I/O; the round reads the files on the lane (:meth:`_running_records`) and
        asks :meth:`_source_dead` on the loop."""
        return [(k, n) for k, n, _ in self._running_records(root, lambda n: self._source_dead(n, now) is None)]

    def _running_records(self, root: Path, alive: Callable[[int], bool]) -> list[tuple[str, int, tuple[int, str]]]:
        """(key, node, (node, job) of the job resumed from it: its successor) of each running
        record in the archive of another node, not ``alive``, whose successor holds no record (the
        file part of :meth:`_dead_runs`)."""
        out = []
        for f in sorted(root.glob("*/running-*.json")):
            if f.parent.name.startswith("."):
                continue
            try:
                node = int(f.name.removeprefix("running-").removesuffix(".json"))
            except ValueError:
                continue
            if node == self.node_id or alive(node):
                continue
            rec = _read_record(f)
            res = rec.get("resumed") if rec is not None else None
            if not isinstance(res, dict) or "/" in str(res.get("job", "/")):
                continue
            try:
                succ = os.listdir(root / f"n{res.get('node')}-{res.get('job')}")
            except FileNotFoundError:
                succ = []
            except OSError:
                continue
            if any(n.endswith(".json") and not n.startswith(".") for n in succ):
                continue
            try:
                out.append((f.parent.name, node, (int(res["node"]), str(res["job"]))))
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def _stale_claims(self, root: Path, now: float) -> list[tuple[str, dict[str, Any]]]:
        """(key, record) of each claim in the archive older than ARCHIVE_CLAIM_STALE_S whose job no
        node runs (another node's: this node's own claims are its take-overs in flight)."""
        out = []
        for f in sorted(root.glob("*/claimed-*.json")):
            if f.name == f"claimed-{self.node_id}.json" or f.parent.name.startswith("."):
                continue
            try:
                if now - os.lstat(f).st_mtime <= ARCHIVE_CLAIM_STALE_S or any(f.parent.glob("running-*.json")):
                    continue
            except OSError:
                continue
            rec = _read_record(f)
            if rec is not None:
                out.append((f.parent.name, rec))
        return out

    # -- removing what the archive no longer needs (archive_gc) -----------------------------------

    def _placed_as(self, key: str) -> tuple[int, str] | None:
        """(node, job id) where this node placed the guarded job ``key`` (the replica's job_id,
        ``node N/job-M``), or None."""
        row = self.agent.store.db.execute("SELECT job_id FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        try:
            node, job = str(row["job_id"]).removeprefix("node ").split("/", 1)
            return int(node), job
        except (TypeError, ValueError, IndexError):
            return None

    def _archive_gc_round(self) -> None:
        """Every ``archive_gc_s``: the archive sweep (:meth:`archive_gc`) in a thread, one at a time."""
        if self._gc_running or time.monotonic() < self._gc_next:
            return
        self._gc_next = time.monotonic() + float(self.s["archive_gc_s"])
        self._gc_running = True
        self._spawn(self._archive_gc_task(self._archive_gc_ended()))

    def _archive_gc_ended(self) -> dict[str, set[str]]:
        """Archive key -> ids of this node's jobs resumed from it (their origin, as the job
        manager stored it: laminar.runtime.provenance; never a job's env, which its user writes)
        that ended by themselves (exited) or were stopped by their user: they need nothing from
        it any more. A job that failed to start, was lost, moved or reclaimed is not here: its
        state may still be needed from the archive. One indexed query, no spec decoded."""
        jobs = getattr(self.agent, "jobs", None)
        return jobs.ended_origins(("exited", "stopped")) if jobs is not None else {}

    async def _archive_gc_task(self, ended: dict[str, set[str]]) -> None:
        try:
            res = await self._lane.call("archive sweep", self.archive_gc, ended)
            for key, why in res["removed"].items():
                self._emit(f"archive: {key} removed ({why})", persist=False, key=key, phase="archive-removed", why=why)
        except Exception:  # a bug or the storage: the next sweep tries again
            log.exception("migrate: archive sweep")
        finally:
            self._gc_running = False

    def archive_gc(self, ended: dict[str, set[str]] | None = None, now: float | None = None,
                   tmp_stale_s: float = ARCHIVE_TMP_STALE_S) -> dict[str, Any]:
        """One sweep of the archive (the rule is in the module's docs, *What the archive keeps, and
        what goes*). Per ``<archive>/<key>/`` (a real directory: links and files at the top are
        not this agent's and are left alone):

        * temporary names (``.``-prefixed) whose newest file is older than ``tmp_stale_s`` go;
        * a directory whose only record is ``running-<node>.json`` goes when the job resumed from
          it ended here (``ended``: key -> this node's job ids that exited or were stopped by
          their user, and the record names one of them, or, a record from before ``resumed``
          was written, this node ran it) or when the record's ``resumed`` job holds a newer
          verified checkpoint it wrote itself under its own key (:meth:`_holds_safe_copy`);
        * a directory with nothing left in it for ``tmp_stale_s`` goes;
        * tombstones in ``<archive>/.gc`` older than ``tmp_stale_s`` (a crash mid-removal) go.

        Everything else stays. Each removal is a rename into ``.gc`` (the agent whose rename wins
        removes it; a loser skips it) and then the tombstone's removal without following links.
        Blocking file I/O (the agent runs it in a thread). Never raises for the storage (what
        cannot be read is kept). Returns ``{"removed": {key: why}, "temporaries": n,
        "tombstones": n}`` and adds them to ``counts`` (``archive_gc_dirs`` and one count per
        why, ``archive_gc_temporaries``)."""
        out: dict[str, Any] = {"removed": {}, "temporaries": 0, "tombstones": 0}
        root = self._archive_root()
        if root is None:
            return out
        now = time.time() if now is None else now
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            return out
        for e in entries:
            if e.name.startswith(".") or not e.is_dir(follow_symlinks=False):
                continue
            d = Path(e.path)
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for n in names:
                if n.startswith(".") and now - _newest_mtime(d / n) > tmp_stale_s and self._tombstone(root, d / n):
                    out["temporaries"] += 1
            why = self._gc_verdict(root, d, names, (ended or {}).get(e.name, set()), now, tmp_stale_s)
            runner = next((n.removeprefix("running-").removesuffix(".json") for n in names
                           if n.startswith("running-") and n.endswith(".json")), None)
            if why in ("ended", "superseded") and runner is not None:
                self._mark_done(root, e.name, runner, why, now)  # before the directory goes
            if why is not None and self._tombstone(root, d):
                out["removed"][e.name] = why
        if self._done_expired is None or now - self._done_expired >= ARCHIVE_DONE_EXPIRE_EVERY_S:
            self._done_expired = now  # (listing them at every sweep grows with the claims on shared storage)
            done = root / ARCHIVE_DONE
            try:
                for t in sorted(os.listdir(done)) if stat.S_ISDIR(os.lstat(done).st_mode) else []:
                    with contextlib.suppress(OSError):
                        if now - os.lstat(done / t).st_mtime > ARCHIVE_DONE_KEEP_S:
                            os.unlink(done / t)
            except OSError:
                pass
        trash = root / ARCHIVE_TRASH
        try:
            if stat.S_ISDIR(os.lstat(trash).st_mode):
                for t in sorted(os.listdir(trash)):
                    try:
                        born = int(t.rsplit(".", 1)[-1]) / 1e9
                    except ValueError:
                        born = _newest_mtime(trash / t)
                    if now - born > tmp_stale_s:
                        _remove_tree(trash / t)
                        out["tombstones"] += 1
        except OSError:
            pass
        self.counts["archive_gc_dirs"] = self.counts.get("archive_gc_dirs", 0) + len(out["removed"])
        for why in out["removed"].values():  # archive_gc_ended, archive_gc_superseded, archive_gc_empty
            self.counts[f"archive_gc_{why}"] = self.counts.get(f"archive_gc_{why}", 0) + 1
        self.counts["archive_gc_temporaries"] = (self.counts.get("archive_gc_temporaries", 0) + out["temporaries"]
                                                 + out["tombstones"])
        return out

    @staticmethod
    def _mark_done(root: Path, key: str, runner: str, why: str, now: float) -> None:
        """``<archive>/.done/<key>``: the claimed job of ``key`` ran on ``runner`` and ended or was
        superseded (written whole under a temporary name, then renamed; never raises). The
        temporary name is this write's own: two sweepers marking one key at once (agents on
        other nodes, whose pids may be equal, or two in one process) each rename a whole record
        (before, both wrote ``.<key>.<pid>.tmp``: one renamed a file the other was writing into,
        and the marker was left with two records in it, which reads as no marker)."""
        if not _SAFE_KEY.match(key):
            return
        d = root / ARCHIVE_DONE
        tmp = d / f".{key}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            tmp.write_text(json.dumps({"key": key, "runner": runner, "why": why, "at": now}))
            os.replace(tmp, d / key)
        except OSError as e:
            log.warning("migrate: archive: cannot mark %s done: %s", key, e)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _gc_verdict(self, root: Path, d: Path, names: list[str], ended: set[str], now: float,
                    tmp_stale_s: float) -> str | None:
        """Why the archive directory ``d`` may go now ("ended", "superseded", "empty"), or None:
        it stays. ``names``: its entries; ``ended``: this node's job ids resumed from it that
        ended."""
        recs = [n for n in names if n.endswith(".json") and not n.startswith(".")]
        if "guard.json" in recs or LIVE_RECORD in recs or any(n.startswith("claimed-") for n in recs):
            return None  # claimable, being claimed, or a claim whose node died (taken over when stale)
        running = [n for n in recs if n.startswith("running-")]
        if not running:
            try:
                if os.listdir(d) or now - _newest_mtime(d) <= tmp_stale_s:
                    return None  # a checkpoint without a record: a publish in progress or a crash's only copy
            except OSError:
                return None
            return "empty"
        runner = running[0].removeprefix("running-").removesuffix(".json")
        rec = _read_record(d / running[0])
        if rec is None:
            return None
        res = rec.get("resumed")
        if isinstance(res, dict):
            try:
                node, job = int(res["node"]), str(res["job"])
            except (KeyError, TypeError, ValueError):
                return None
            if node == self.node_id and job in ended:
                return "ended"
            succ = f"n{node}-{job}"
            if succ != d.name and "/" not in job and not job.startswith(".") and self._holds_safe_copy(root, succ):
                return "superseded"
            return None
        if runner == str(self.node_id) and ended:
            return "ended"  # a record from before ``resumed``: this node claimed it and ran it here
        return None

    def _holds_safe_copy(self, root: Path, key: str) -> bool:
        """``<archive>/<key>/`` (a real directory) has a record (live, guard, claimed or running)
        naming a checkpoint the job wrote itself (not the copy of what it resumed from,
        ``resumed_copy``) that is a real directory of regular files and passes
        :func:`laminar.jobkit.verify_checkpoint`. A checkpoint that failed is not hashed again."""
        d = root / key
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                return False
            names = sorted(os.listdir(d))
        except OSError:
            return False
        for n in names:
            if not (n in (LIVE_RECORD, "guard.json") or (n.startswith(("claimed-", "running-")) and n.endswith(".json"))):
                continue
            rec = _read_record(d / n)
            ck = None if rec is None else rec.get("ckpt")
            if rec is None or rec.get("resumed_copy") or not isinstance(ck, str) or not _CKPT_NAME.match(ck):
                continue
            if (key, ck) in self._gc_unverified:
                continue
            p = d / ck
            try:
                if not stat.S_ISDIR(os.lstat(p).st_mode) or any(not stat.S_ISREG(os.lstat(f).st_mode)
                                                                for f in p.iterdir()):
                    raise jobkit.CheckpointError(f"{p}: not a directory of regular files")
                jobkit.verify_checkpoint(p)
            except (OSError, jobkit.CheckpointError) as e:
                log.info("migrate: archived %s/%s is no safe copy: %s", key, ck, e)
                self._gc_unverified.add((key, ck))
                continue
            return True
        return False

    def _tombstone(self, root: Path, path: Path) -> bool:
        """Removes ``path`` (an entry of the archive ``root`` or of one of its job directories):
        renamed into ``<root>/.gc`` first (atomic: of two agents one wins), then removed without
        following links. True when this agent's rename won. Raises ValueError for a path outside
        the archive."""
        if path.parent != root and path.parent.parent != root:
            raise ValueError(f"{path} is not an entry of the archive {root} or of one of its job directories")
        trash = root / ARCHIVE_TRASH
        t = trash / f"{path.name}.{self.node_id}.{time.time_ns()}"
        try:
            trash.mkdir(exist_ok=True)
            if not stat.S_ISDIR(os.lstat(trash).st_mode):
                log.warning("migrate: %s is not a directory; the archive sweep removes nothing", trash)
                return False
            os.rename(path, t)
        except OSError:
            return False  # gone meanwhile (another agent won), or not ours to move
        _remove_tree(t)
        return True

    def _archived_newer(self, key: str, path: Path) -> Path | None:
        """The checkpoint this node's claim on ``key`` names in the archive when its step is above
        ``path``'s and it verifies, else None. A guard's replica may be older than what reached the
        archive since (the job's final checkpoint, sent to a holder that archived it and died): a
        take-over from the replica would lose the work in between. Blocking (hashes)."""
        root = self._archive_root()
        if root is None:
            return None
        try:
            rec = json.loads((root / key / f"claimed-{self.node_id}.json").read_text())
            cand = root / key / str(rec["ckpt"])
            if int(cand.name.removeprefix("ckpt-")) <= int(path.name.removeprefix("ckpt-")):
                return None
            jobkit.verify_checkpoint(cand)
        except (OSError, ValueError, KeyError, TypeError, jobkit.CheckpointError):
            return None
        return cand

    def _claim_and_read(self, key: str, live: bool, dead_runner: int | None) -> dict[str, Any] | None:
        """Takes the archive's claim on ``key`` (:meth:`_claim`) and reads the claimed record,
        whose checkpoint must verify: the record, or None when another node holds the claim.
        Raises OSError/ValueError/KeyError/TypeError/CheckpointError, the claim given back.
        Blocking file I/O (on the lane)."""
        root = self._archive_root()
        assert root is not None
        if not self._claim(key, live=live, dead_runner=dead_runner):
            return None
        try:
            rec = json.loads((root / key / f"claimed-{self.node_id}.json").read_text())
            jobkit.verify_checkpoint(root / key / str(rec["ckpt"]))
        except BaseException:
            self._unclaim(key)
            raise
        return dict(rec)

    def _claim_archived(self, key: str) -> tuple[bool, str | None, bool]:
        """A guard's take-over of ``key`` meets the archive (blocking, on the lane): (whether it
        is archived, who runs it when a node claimed and started it, whether this node took the
        claim, live records included: :meth:`_claim`)."""
        if not self._archived(key):
            return False, None, False
        other = self._archive_runner(key)
        if other is not None:
            return True, other, False
        return True, None, self._claim(key, live=True)

    def _archive_unless_archived(self, key: str, ckpt: Path, record: dict[str, Any]) -> Path | None:
        """:meth:`_archive` unless the archive holds a record of ``key`` already (blocking)."""
        return None if self._archived(key) else self._archive(key, ckpt, record)

    async def _from_archive(self, key: str, live: bool = False, dead_runner: int | None = None,
                            ask: tuple[int, str] | None = None) -> None:
        """Claims the archived job ``key`` (its guard record; ``live``: its live record too;
        ``dead_runner``: that node's running record) and resumes it here; given back when it
        cannot start here. ``ask``: (node, key) of the job that may still run there, asked first
        (:meth:`_still_runs`)."""
        root = self._archive_root()
        assert root is not None
        try:
            if self._runs_here(key) is not None:
                return
            if ask is not None and ask[0] != self.node_id and await self._still_runs(key, *ask):
                return
            rec = await self._lane.call(f"claim of {key}", self._claim_and_read, key, live, dead_runner)
            if rec is None:
                return
            done = False
            try:
                path = root / key / str(rec["ckpt"])
                row = {"key": key, "src_node": int(rec["src_node"]), "src_job": str(rec["src_job"])}
                why = (f"node {rec['src_node']} and its buddy are gone; claimed its periodic checkpoint from the "
                       "archive" if rec.get("periodic") else "claimed from the archive")
                if dead_runner is not None:
                    why = f"node {dead_runner}, which ran it from the archive, is gone; claimed again from the archive"
                err = await self._resume_here(row, dict(rec["request"]), path, why)
                if err is None:
                    self._lane.submit(f"claim of {key} done", self._claim_done, key, f"node {self.node_id}",
                                      (self.node_id, self._runs_here(key) or ""))
                    done = True
                else:
                    n = self._archive_tries.get(key, 0)
                    self._archive_tries[key] = n + 1
                    self._archive_next[key] = time.monotonic() + self.retry.delay(n)
            finally:
                if not done:  # given back in order on the lane (a hung archive waits for it; nothing waits here)
                    self._lane.submit(f"claim of {key} given back", self._unclaim, key)
        except (OSError, ValueError, KeyError, TypeError, jobkit.CheckpointError) as e:
            log.warning("migrate: archived job %s cannot be resumed here: %s", key, e)
            self._archive_next[key] = time.monotonic() + float(self.s["retry_max_s"])
        finally:
            self._taking.discard(key)

    async def _still_runs(self, key: str, node: int, job_key: str) -> bool:
        """Whether ``node`` answers (control op ``needs``) that its job ``job_key`` lives there
        (SOURCE_LIVE_STATES) or ended there (ARCHIVE_ENDED_THERE: exited, stopped by its user,
        moved elsewhere): the archived job ``key`` is not claimed here then, and is looked at
        again after ``dead_after_s`` (ended: after ARCHIVE_CLAIM_STALE_S; its record goes with
        that node's sweep). A node dead by its reclaim window's end may be back (its agent
        restarted after the window and cleared the reclaim) and run the job it claimed from the
        archive, or its own job whose periodic record this is; before, that job was claimed and
        resumed here too (two copies), or resumed again after it had ended. No answer, a job
        stopped by the window's end (``reclaimed``) or one that failed there goes on with the
        claim."""
        try:
            ans = await self._control(node, "needs", {"key": job_key}, timeout=float(self.s["dead_after_s"]) + 2.0)
        except Exception as e:  # gone: no answer (a refused connection, a timeout, an error)
            log.info("migrate: node %d did not answer whether %s lives there (before claiming %s): %s",
                     node, job_key, key, e)
            self._archive_runs_told.pop(key, None)
            return False
        state = ans.get("state") if isinstance(ans, dict) and ans.get("key") == job_key else None
        if state not in SOURCE_LIVE_STATES and state not in ARCHIVE_ENDED_THERE:
            self._archive_runs_told.pop(key, None)
            return False
        again = float(self.s["dead_after_s"]) if state in SOURCE_LIVE_STATES else ARCHIVE_CLAIM_STALE_S
        self._archive_next[key] = time.monotonic() + again
        if self._archive_runs_told.get(key) != job_key:
            self._archive_runs_told[key] = job_key
            what = f"runs there ({state})" if state in SOURCE_LIVE_STATES else f"ended there ({state})"
            self._emit(f"{key}: node {node} counts as dead (its reclaim window ended, or it placed the job elsewhere) "
                       f"but answers that {job_key} {what}: not claimed from the archive here", persist=False,
                       key=key, node=node, job_key=job_key, state=state, phase="archive-runs-there")
        return True

    def _archive_status(self) -> dict[str, Any] | None:
        """The archive's part of the status (None without ``archive_dir``): ``stalled_s``, the
        seconds its work in hand has made no progress once that is ARCHIVE_STALL_SWEEPS x
        ``archive_gc_s`` or more (its storage does not answer; else None), ``busy`` (that work),
        ``queued`` (work waiting behind it) and ``rounds`` (rounds done)."""
        root = self._archive_root()
        if root is None:
            return None
        quiet, what = self._archive_stall(time.monotonic())
        return {"dir": str(root), "stalled_s": None if quiet is None else round(quiet, 1), "busy": what,
                "queued": self._lane.queued, "rounds": self._archive_rounds}
