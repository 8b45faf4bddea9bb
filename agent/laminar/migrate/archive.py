"""The archive, the guard of last resort (``migrate.archive_dir``; a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: :class:`Archive`, its ``archive``; in long
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
to ``claimed-<node>.json`` before it starts or places the job (one node wins; then it notes the
claim there, signed), writes its ``running-<node>.json`` once the job started, or puts what it
took back when it found no room. Every agent with room tries the
unclaimed records (any agent, not only the guard: the guard may be gone); a guard whose job
another node claimed and runs stands down. A claim older than ``ARCHIVE_CLAIM_STALE_S`` whose
node never ran the job is taken over (by the job's guard, or by any agent with room that sees it
in the archive). So is the running record of a node that ran the job and is dead
(``orphan_after_s`` or its reclaim window, as for any take-over) before anything newer of the
job reached the archive (its new key holds no record): the checkpoint the job resumed from is
then its newest safe state (:meth:`Archive.dead_runs`).

**Who may write the archive** (:mod:`laminar.migrate.archive_auth`, :mod:`laminar.migrate.archive_fs`,
:mod:`laminar.migrate.archive_view`). Shared storage is not trusted. Every record is signed
(a zone MAC under a key derived from the zone key; with node keys, a node MAC for each roster
node), every field an agent acts on is in what is signed, and a job's records are its own
node's (a guard publishes the guard record the job's node signed for it when it handed the
guard over). A claim is noted, signed, with what it took and when (its staleness); a running
record is a run record its node signs; ``.done`` markers are signed. What does not verify is
never claimed, renamed, removed or taken as evidence: it is counted by reason
(``counts.archive_unverified_<reason>``, the latest in ``archive.refused``) and left for the
operator. All file work goes through directory fds opened without following a link; records
are opened without waiting (a FIFO) and read under a size cap; a round and a sweep read at most
ARCHIVE_SCAN_MAX entries of the root (a listing held open from one to the next) and
ARCHIVE_DIR_MAX of a key's directory, and start at most ARCHIVE_CLAIMS_MAX claims. The root
must be a real directory of ``archive_uid`` (root) that neither group nor others may write,
else the archive is not used (``archive.error``). A claimed checkpoint is copied into this
node's state directory and checked against the manifest its record signed as it is copied:
the job, root's included, resumes from that copy, never from the shared storage.

**What the archive keeps, and what goes** (:meth:`Archive.sweep`, every
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
restarted from, when the agent gave it: :meth:`Archive.given_resume_from`) is copied to ``<archive>/<key>/ckpt-N/`` the same way (temporary name, verified
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
(:meth:`Archive._await_newer_copy`).

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
(:meth:`Archive.publish_until`): its move then fails as with no archive (the job's buddy
still guards it) and the copy it waited for is given up (:class:`ArchiveWait`): when the storage
answers, it publishes nothing; a reclaimed guard's copy of a job it passes on is the exception,
published late (it is the job's only way back, and every taker claims it through the archive).
So is the copy of a job with no holder and no buddy, and it survives an agent stop or crash
(``migrate_late_copies``; :meth:`Archive.restore_late_copies`): its "about to publish" is
committed before its record's rename, so a restart publishes it at most once.
"""

from __future__ import annotations

import asyncio
import collections
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
from typing import TYPE_CHECKING, Any, Protocol

from laminar import jobkit
from laminar.airlock.cgroups import set_frozen_async
from laminar.migrate import archive_fs, ckpt_driver
from laminar.migrate.archive_auth import (
    PRESIGNED,
    ArchiveAuth,
    Refused,
    canonical,
    manifest_digest,
    owner_body,
    owner_request,
)
from laminar.migrate.archive_view import _NODE_FILE, DONE_DIR, Refusals, Sealed, View
from laminar.migrate.constants import _SAFE_KEY, SOURCE_LIVE_STATES
from laminar.migrate.errors import MigrateError
from laminar.policy.endcause import LATE_COPY_TAKEN_UP, EndCause
from laminar.policy.prestage import unannounced_plausible
from laminar.runtime.ckpt_scan import scan_dir

if TYPE_CHECKING:
    from laminar.migrate.buddies import Prestage
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.guard import Guard
    from laminar.migrate.replicas import Replicas
    from laminar.policy.notice import NoticeOdds

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
# here, ``<archive>/.done/<key>``, naming who ran it (signed): without it a guard of that key
# that missed the claim (down, cut off) found nothing archived, published its older checkpoint
# again and another agent resumed the job a second time (bench/chaos.py). Kept
# ARCHIVE_DONE_KEEP_S by the time it signed.
ARCHIVE_DONE = DONE_DIR
# Kept at least as long as a claimable record is (archive_auth.RECORD_MAX_AGE_S, a day less): a
# copy of a claimed record planted again after its marker went is refused as expired.
ARCHIVE_DONE_KEEP_S = 30 * 86400.0
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
# A round (and a sweep) reads at most this many entries of the archive's root; the next one goes
# on from there (a pass over a larger archive takes several): a million planted directories cost
# each round this many, not a million.
ARCHIVE_SCAN_MAX = 2048
# Claims started per round; the rest wait for the next round (poll_s later).
ARCHIVE_CLAIMS_MAX = 4
# A checkpoint fetched from the archive leaves this much free on the state directory's disk.
ARCHIVE_FETCH_RESERVE = 256 << 20
# A claim no node runs yet is stale once this agent has seen it, unchanged, this long (its own
# clock: a file's mtime is anyone's to set).
CLAIMS_SEEN_KEEP = 4096
_KEY_NODE = re.compile(r"n(\d{1,10})-.+")


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
    (:meth:`Archive.publish_until`), shared with the lane's work on it. The loop gives it
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


def _newer_copy(dirfd: int, names: list[str], src: int, rec: dict[str, Any],
                wall: float) -> tuple[str, str, float] | None:
    """The copy of a newer checkpoint of the job that node ``src`` is making in its key
    directory (``dirfd``, whose entries are ``names``) while the job's live record ``rec`` (a
    verified body) names an older one: (the record's checkpoint, the newer one's name, the
    progress between them in seconds: when the copy began, its temporary's mtime, less the
    record's time), or None. A temporary older than ARCHIVE_TMP_STALE_S is a crashed writer's
    and does not count (nor does one that is not a directory)."""
    ts, have = float(rec["ts"]), str(rec["ckpt"])
    m_have = _CKPT_STEP.fullmatch(have)
    best: tuple[str, str, float] | None = None
    for n in names:
        m = _TMP_COPY.fullmatch(n)
        if m is None or int(m[2]) != src or m[1] == have:
            continue
        m_new = _CKPT_STEP.fullmatch(m[1])
        if m_have is not None and (m_new is None or int(m_new[1]) <= int(m_have[1])):
            continue  # not newer than the record's
        try:
            st = archive_fs.lstat_at(dirfd, n)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or wall - st.st_mtime > ARCHIVE_TMP_STALE_S:
            continue
        gain = min(max(st.st_mtime - ts, 0.0), ARCHIVE_TMP_STALE_S)
        if best is None or gain < best[2]:
            best = (have, m[1], gain)
    return best


class ArchiveHost(Protocol):
    """What :class:`Archive` uses of the component that holds it (ReclaimComponent and its parts)."""

    agent: Any
    ckpt: CkptDriver | None
    counts: dict[str, int]
    evacuating: set[str]
    guarding: Guard
    moves: dict[str, Any]
    notice_odds: NoticeOdds
    notices: dict[int, tuple[float, float]]
    prestage: Prestage
    reclaim: dict[str, Any] | None
    replicas: Replicas
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _driver_checked(self, job: Any) -> tuple[Path | None] | None: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _last_seen(self, node: int) -> float: ...
    def _late_copy_settled(self, mv: Any, error: BaseException | None) -> None: ...
    def _request(self, job: Any, take_over: bool) -> dict[str, Any]: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Archive:
    """The archive (see the module's doc): stopped jobs' checkpoints and guard records, running
    jobs' periodic ones, claims, the sweep, the archive's health and status. A part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``archive``). ``host``: the component."""

    def __init__(self, host: ArchiveHost) -> None:
        self.host = host
        self.next_try: dict[str, float] = {}  # archived key -> when this node tries it again (monotonic)
        self._tries: dict[str, int] = {}
        # archived key -> the job a node dead by its window answered runs there (said once: still_runs)
        self.runs_told: dict[str, str] = {}
        self._claimed_from: dict[str, str] = {}  # archived key -> the record this node's claim took (unclaim)
        self.live: dict[str, str] = {}  # job id -> newest periodic checkpoint in the archive (live.json)
        self.live_buddy: dict[str, int | None] = {}  # job id -> the buddy its live.json names
        self._archiving: set[str] = set()
        self.late_stopping: set[str] = set()  # jobs a restart stops: their record was being archived
        # archived keys whose live record waits, not claimed, for its node's newer copy: since (monotonic)
        self.live_waits: dict[str, float] = {}
        self._gc_next = 0.0  # when this agent sweeps the archive next (monotonic)
        self._gc_running = False
        self._done_expired: float | None = None  # when the sweep last expired <archive>/.done markers (wall)
        self.lane = ArchiveLane()  # every touch of archive_dir, off the loop, one at a time
        self.round_running = False  # an archive round is in flight (one at a time)
        self.rounds = 0  # archive rounds done
        self._stalled: float | None = None  # when the archive was found stalled (monotonic)
        self._error: str | None = None  # the last round's storage error, said once
        self.gc_unverified: set[tuple[str, str]] = set()  # (key, ckpt) that failed verification: not re-hashed
        # files of the archive refused (counted once each by reason, the latest for the status)
        self.refusals = Refusals(host.counts)
        self._root_error: str | None = None  # why archive_dir is not used (its owner, its mode)
        # (key, claim file, inode, ctime) -> when this agent first saw that claim (monotonic): its staleness
        self.claims_seen: collections.OrderedDict[tuple[Any, ...], float] = collections.OrderedDict()
        # the root listings a round, a sweep and a .done expiry go on through (_scan_page)
        self._archive_scan: tuple[str, int, Any] | None = None
        self._gc_scan: tuple[str, int, Any] | None = None
        self._done_scan: tuple[str, int, Any] | None = None

    def root(self) -> Path | None:
        a = str(self.host.s.get("archive_dir") or "")
        return Path(a) if a else None

    def view(self, root: Path | None = None, create: bool = True) -> View:
        """A look at the archive (:class:`laminar.migrate.archive_view.View`; blocking: on the
        lane). ``create``: the archive's root is made when missing (else FileNotFoundError).
        Raises :class:`laminar.migrate.archive_fs.RootError` (an OSError, said in the status)
        when ``archive_dir`` may not be used, MigrateError when this node holds no zone key."""
        root = root if root is not None else self.root()
        assert root is not None
        auth = ArchiveAuth.of(getattr(self.host.agent, "zone", None))
        if auth is None:
            raise MigrateError("archive records are signed with the zone's keys, and this node holds none")
        try:
            v = View(root, int(self.host.s.get("archive_uid", 0) or 0), auth, self.refusals, time.time(), create)
        except archive_fs.RootError as e:
            self._root_error = str(e)
            raise
        self._root_error = None
        return v

    def view_or_none(self, create: bool = False) -> View | None:
        """:meth:`view` of the configured archive, or None when there is none (not
        configured, or its root does not exist yet)."""
        root = self.root()
        if root is None:
            return None
        try:
            return self.view(root, create)
        except FileNotFoundError:
            return None

    def archived(self, key: str) -> bool:
        """The archive holds a verified record of ``key`` (claimable, claimed or run), or the
        verified marker of its claimed job that ended or was superseded (:data:`ARCHIVE_DONE`).
        A file that does not verify says nothing (a stray ``x.json`` once stood a guard down)."""
        v = self.view_or_none()
        if v is None:
            return False
        with v:
            return self._archived_in(v, key)

    @staticmethod
    def _archived_in(v: View, key: str) -> bool:
        return (bool(v.claims(key)) or v.done(key) is not None
                or any(v.claimable(key, n) is not None for n in ("guard.json", LIVE_RECORD)))

    def done(self, root: Path, key: str) -> str | None:
        """Who ran ``key``'s claimed job, by its verified marker in ``<archive>/.done`` (written
        by the sweep that removed the key's directory), or None when there is none."""
        try:
            with self.view(root, create=False) as v:
                return self._done_runner(v, key)
        except FileNotFoundError:
            return None

    @staticmethod
    def _done_runner(v: View, key: str) -> str | None:
        d = v.done(key)
        if d is None:
            return None
        return f"node {d.body['runner']}" if d.body["why"] == "ended there" else str(d.body["runner"])

    def runner(self, key: str) -> str | None:
        """Who runs an archived job (it claimed it and started it: its verified running record,
        never a file's name alone), or ran it (its marker), or None."""
        v = self.view_or_none()
        if v is None:
            return None
        with v:
            return self.runner_in(v, key)

    @classmethod
    def runner_in(cls, v: View, key: str) -> str | None:
        runs = sorted(int(s.body["writer"]) for s in v.runs(key))
        return str(runs[0]) if runs else cls._done_runner(v, key)

    def publish(self, key: str, ckpt: Path, record: dict[str, Any], wait: ArchiveWait | None = None,
                 mark: Callable[[], None] | None = None) -> Path:
        """Copies the verified checkpoint ``ckpt`` of ``key`` into the archive and (unless a node
        claimed or runs it) writes its guard record ``guard.json``, both atomically (a temporary
        name, fsync, rename): the archived checkpoint's path. The record is signed by this node
        for its own job; for another node's (a guard's publish) it is the one that node signed
        and handed the guard with (``record["request"][PRESIGNED]``), for this very checkpoint,
        or nothing is published (OSError). Raises OSError/CheckpointError. ``wait``: its
        waiter's deadline (:class:`ArchiveWait`); once given up, nothing more is published (its
        temporaries are removed) and ArchiveGivenUp is raised. ``mark``: called (here, on the
        lane) right before the record is put in place, once it will be: a late copy's durable
        "about to publish" (:meth:`late_mark`)."""
        root = self.root()
        assert root is not None
        with self.view(root) as v:
            d = self._key_dir_made(v, key)
            signed = self._presigned(v, key, record)
            if signed is not None and signed["body"]["ckpt"] != ckpt.name:
                raise OSError(f"{key}: the record node {record['src_node']} signed names {signed['body']['ckpt']}, "
                              f"this guard holds {ckpt.name}: not archived")
            digest, nbytes, files = self.publish_copy(ckpt, d, wait, None if signed is None else
                                                       str(signed["body"]["manifest_sha256"]),
                                                       int(record["request"]["owner_uid"]))
            v.forget(key)
            taken = bool(v.claims(key))
            tmpj = f".guard-{self.host.node_id}-{time.monotonic_ns()}.tmp"
            if not taken:
                data = canonical(signed) if signed is not None else v.auth.seal(
                    owner_body("guard", record, ckpt.name, digest, nbytes, files, time.time()))
                archive_fs.write_new(d, tmpj, data)
            if wait is not None and not wait.publish():
                # the move that wanted it went on without it (a copy already renamed into place stays: a
                # record of another node may name it; with no record of its own it is an operator's call)
                with contextlib.suppress(OSError):
                    os.unlink(tmpj, dir_fd=d)
                log.info("migrate: archive %s answered after the wait for %s's copy ended: no record published", root,
                         key)
                raise ArchiveGivenUp(f"archive of {key} given up by its waiter")
            if not taken and mark is not None:
                mark()
            old_live = f".live-{self.host.node_id}-{time.monotonic_ns()}.old"
            if not taken and LIVE_RECORD in v.names(key):
                # the job's periodic record becomes its guard record: taken by rename (atomic), so a
                # node that claimed it meanwhile keeps it and no second claimable record appears
                try:
                    os.rename(LIVE_RECORD, old_live, src_dir_fd=d, dst_dir_fd=d)
                except OSError:
                    taken = True
            if not taken:
                os.rename(tmpj, "guard.json", src_dir_fd=d, dst_dir_fd=d)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(tmpj, dir_fd=d)
            with contextlib.suppress(OSError):
                os.unlink(old_live, dir_fd=d)
        return root / key / ckpt.name

    def _key_dir_made(self, v: View, key: str) -> int:
        """The fd of ``<archive>/<key>``, made 0700 when missing (root's alone: its records carry
        the job's request, env values included, and its checkpoints are a user's); OSError when
        it is a link, not a directory or another owner's (counted: never written through)."""
        if not _SAFE_KEY.match(key):
            raise OSError(f"archive: {key!r} is not a job key")
        try:
            d = v.dir(key, create=True)
        except Refused as e:
            raise OSError(f"archive {v.root}: {key}: {e}; nothing written there") from None
        assert d is not None
        return d

    def _presigned(self, v: View, key: str, record: dict[str, Any]) -> dict[str, Any] | None:
        """The envelope this node publishes for another node's job (as its guard): the guard
        record that job's node signed and handed the guard with (:data:`PRESIGNED` in the
        request), once it verifies here; None for this node's own job (it signs it itself).
        OSError when there is none or it does not verify: only a job's node speaks for its job."""
        src = int(record["src_node"])
        if src == self.host.node_id:
            return None
        env = (record.get("request") or {}).get(PRESIGNED)
        if not isinstance(env, dict):
            raise OSError(f"{key}: node {src} handed its guard no signed record to publish (an agent from before "
                          "archive authentication): not archived; this guard keeps the job")
        try:
            v.auth.open_obj(env, name="guard.json", dir_key=key)
        except Refused as e:
            raise OSError(f"{key}: the record node {src} signed for its guard is refused here ({e}): not archived") \
                from None
        return env

    async def publish_until(self, what: str, key: str, ckpt: Path, record: dict[str, Any], until: float,
                             late_ok: bool = False,
                             settled: Callable[[BaseException | None], None] | None = None,
                             mark: Callable[[], None] | None = None, wait: ArchiveWait | None = None) -> Path:
        """:meth:`publish` on the lane, waited for until ``until`` (monotonic) and no longer: a
        reclaim's copy, which must be made within its window while the archive may hang. The
        archived path; OSError/CheckpointError as :meth:`publish`. Raises MigrateError naming
        the archive and the time waited when it has not answered by then (or the wait's task is
        cancelled: the window's end). The work may still be in hand on the lane then, waiting on
        the storage, or queued behind what is: it is given up (:class:`ArchiveWait`; dropped
        from the queue, and a late answer publishes nothing), so what the caller does instead
        stays true; except with ``late_ok`` (a late copy is still wanted, and whoever resumes the
        job claims it there first), when it goes on and says so once it is done (and calls
        ``settled`` on the event loop: with None once the copy is there, with the error when the
        storage refused it). A copy whose record the lane was putting in place when the time ran
        out counts as archived. ``mark``: as :meth:`publish`'s. ``wait``: with ``late_ok``, the
        caller's :class:`ArchiveWait`, given up only if this wait is cancelled (the caller's job
        is thawed and runs on: a copy published later would be a second one); its state says
        whether it was."""
        root = self.root()
        assert root is not None
        if not late_ok:
            wait = ArchiveWait()
        t0 = time.monotonic()
        fut = self.lane.call(what, self.publish, key, ckpt, record, wait, mark)
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, until - t0))
        except asyncio.CancelledError:
            if wait is not None and wait.give_up():
                fut.cancel()  # dropped while queued; in hand, it publishes nothing
            fut.add_done_callback(self._late(what, late_ok, settled))
            raise
        if done:
            return Path(fut.result())
        waited = time.monotonic() - t0
        if late_ok:  # it goes on
            fut.add_done_callback(self._late(what, late_ok, settled))
        elif wait is not None and not wait.give_up():
            log.info("migrate: %s: the record was being put in place in archive %s when %.1f s were up: counted as "
                     "archived", what, root, waited)
            fut.add_done_callback(self._late(what, late_ok, settled))
            return root / key / ckpt.name
        else:
            fut.cancel()
        raise MigrateError(f"archive {root} did not answer in {waited:.1f} s ({what})")

    def _late(self, what: str, late_ok: bool, settled: Callable[[BaseException | None], None] | None = None
                      ) -> Callable[[asyncio.Future[Any]], None]:
        """The end of a publish :meth:`publish_until` stopped waiting for: said (with ``late_ok``,
        its late copy, with an event, after ``settled(None)``; its failure after
        ``settled(error)``), its error taken."""
        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                return
            e = fut.exception()
            if late_ok and settled is not None and not isinstance(e, ArchiveGivenUp):
                settled(e)
            if e is None and late_ok:
                self.host._emit(f"{what}: the archive answered late; the copy is there now", phase="archived-late")
            elif e is not None and not isinstance(e, ArchiveGivenUp):
                log.info("migrate: %s, after its wait ended: %s", what, e)
        return done

    # -- a late copy, across a restart (migrate_late_copies) ---------------------------------------

    def late_row_add(self, key: str, job_id: str, ckpt: Path, record: dict[str, Any]) -> None:
        """Before a copy that may go on past its window's wait starts: what a restart needs to
        take it up (:meth:`restore_late_copies`)."""
        with self.host.agent.store.tx() as db:
            db.execute("INSERT OR REPLACE INTO migrate_late_copies VALUES (?, ?, ?, ?, 0, 0, ?)",
                       (key, job_id, str(ckpt), json.dumps(record), time.time()))

    def late_row_late(self, key: str) -> None:
        """The copy goes on past its window's wait, and its job is stopped for it."""
        with self.host.agent.store.tx() as db:
            db.execute("UPDATE migrate_late_copies SET late=1 WHERE key=?", (key,))

    def late_row_drop(self, key: str) -> None:
        with self.host.agent.store.tx() as db:
            db.execute("DELETE FROM migrate_late_copies WHERE key=?", (key,))

    def late_mark(self, key: str) -> None:
        """On the lane, right before the copy's record is put in place: ``publishing``, committed
        (synchronous=FULL) before the rename, so a restart that reads 0 knows the record never
        was (at most once: it may publish it). Through a connection of its own, not the loop's:
        its transaction is this one write's alone."""
        db = sqlite3.connect(str(self.host.agent.store.path), isolation_level=None, timeout=30.0)
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.execute("UPDATE migrate_late_copies SET publishing=1 WHERE key=?", (key,))
        finally:
            db.close()

    def restore_late_copies(self) -> None:
        """At start: a late copy the agent's stop or crash cut (``migrate_late_copies``) is taken
        up again when its job is still ``reclaimed`` here and stopped for good by the reclaim
        (its end cause in :data:`~laminar.policy.endcause.LATE_COPY_TAKEN_UP`; its checkpoint is
        only in its ckpt directory): published if its record never was; a record ``publishing`` when
        the agent stopped is looked for in the archive and never written twice
        (:meth:`_late_again`). A job still running here whose record was ``publishing`` (the
        agent stopped between the publish and the job's stop) is stopped now, as it would have
        been, and left out of the restored reclaim's moves (``_late_stopping``): the archive is
        its way back, so it runs once. Any other row (a job the agent stopped before it stopped:
        the restored reclaim moves it again) is dropped, with an event when its record may be in
        the archive (another agent may resume the job too)."""
        jobs_mgr = getattr(self.host.agent, "jobs", None)
        rows = self.host.agent.store.db.execute("SELECT * FROM migrate_late_copies").fetchall()
        for r in rows:
            key, job_id, publishing = str(r["key"]), str(r["job_id"]), bool(r["publishing"])
            job = jobs_mgr.get(job_id) if jobs_mgr is not None else None
            state = getattr(job, "state", None)
            active = state in ("running", "suspended")
            for_copy = state == "reclaimed" and getattr(job, "end_cause", None) in LATE_COPY_TAKEN_UP
            try:
                record = json.loads(r["record"])
            except ValueError:
                record = None
            if (self.root() is None or not isinstance(record, dict)
                    or not ((for_copy and (r["late"] or publishing)) or (active and publishing))):
                self.late_row_drop(key)
                if publishing and not for_copy:
                    # its record may be in the archive, claimable, while the job is here too
                    self.host._emit(f"{job_id}: its copy to the archive (key {key}) was being published when the agent "
                               f"stopped, and the job is {state or 'gone'} here: if the archive holds its record, "
                               "another agent may resume it as well; check `laminarctl migrations`", job=job_id,
                               key=key, phase="archive-uncertain")
                else:
                    log.info("migrate: a copy of %s to the archive cut by the agent's stop is not taken up: the job "
                             "is %s here%s", job_id, state or "gone",
                             "" if isinstance(record, dict) else " (its stored record is not a JSON object)")
                continue
            if active:
                self.late_stopping.add(job_id)
                self.host._spawn(self._late_stop_then_copy(job, key, Path(r["ckpt"]), record))
            else:
                self.host._spawn(self._late_copy_again(key, job_id, Path(r["ckpt"]), record, publishing))

    async def _late_stop_then_copy(self, job: Any, key: str, ckpt: Path, record: dict[str, Any]) -> None:
        """A job whose archived record was being published when the agent stopped, before the
        job did: stopped here (``reclaimed``) as it would have been, then its copy is seen to."""
        try:
            with contextlib.suppress(Exception):
                await set_frozen_async(job.cgroup, False, 2.0)  # a frozen job is not killed by a signal until it thaws
            try:
                await self.host.agent.jobs.stop(job.id, f"node {self.host.node_id} reclaimed: {ckpt.name} was being published "
                                           "in the archive when the agent stopped; the first agent with room resumes "
                                           "the job from there", grace_s=0, state="reclaimed",
                                           cause=EndCause.ARCHIVED)
            except Exception as e:
                log.warning("migrate: stopping %s, archived before the restart: %s", job.id, e)
            await self._late_copy_again(key, job.id, ckpt, record, True)
        finally:
            self.late_stopping.discard(job.id)

    async def _late_copy_again(self, key: str, job_id: str, ckpt: Path, record: dict[str, Any],
                               publishing: bool) -> None:
        """A late copy taken up after a restart: on the lane (waited for as long as the archive
        takes: it is the job's only way back), its move shown (``archiving``, then ``archived``
        or ``failed``) and said with events."""
        from laminar.migrate.reclaim import Move

        mv = Move(job_id, key, "a late archive copy taken up after the agent's restart", phase="archiving",
                  ckpt=ckpt.name, ended=time.time())
        self.host.moves[job_id] = mv
        self.host.counts["archive_late_resumed"] = self.host.counts.get("archive_late_resumed", 0) + 1
        self.host._emit(f"{job_id}: its copy of {ckpt.name} to the archive was cut by the agent's stop; taken up again",
                   job=job_id, ckpt=ckpt.name, phase="archiving")
        try:
            res = await self.lane.call(f"archiving {job_id} again", self._late_again, key, ckpt, record, publishing)
        except (OSError, jobkit.CheckpointError, MigrateError) as e:
            self.late_row_drop(key)
            self.host._late_copy_settled(mv, e)
            return
        self.late_row_drop(key)
        self.host._late_copy_settled(mv, None)
        if res == "gone":
            self.host._emit(f"{job_id}: its record was being put in the archive when the agent stopped, and nothing "
                       f"of it is there now (claimed and run to its end elsewhere, or removed): not published "
                       f"again (the job would run twice); {ckpt.name} stays in its ckpt directory here",
                       job=job_id, key=key, phase="archived")
        else:
            self.host._emit(f"{job_id}: {ckpt.name} is in the archive ({res} after the agent's restart); the first "
                       "agent with room resumes it", job=job_id, ckpt=ckpt.name, phase="archived-late")

    def _late_again(self, key: str, ckpt: Path, record: dict[str, Any], publishing: bool) -> str:
        """On the lane: a late copy after a restart. With ``publishing`` its record may already be
        in place: a verified record of the key there (``guard.json``, a claim, a runner) is it
        ("published"); a temporary record of this node's (``.guard-<node>-*.tmp``, removed by
        the rename only) says the rename never happened (published now); neither says it was
        published and has since gone (claimed, run to its end elsewhere and removed, or the
        temporary removed as stale): "gone", nothing published. Otherwise the copy is made
        ("published now"). Raises OSError/CheckpointError/MigrateError."""
        root = self.root()
        if root is None:
            raise MigrateError("migrate.archive_dir is not set any more")
        if publishing:
            with self.view(root) as v:
                if v.read(key, "guard.json") is not None or v.claims(key):
                    return "published"
                if not any(n.startswith(f".guard-{self.host.node_id}-") and n.endswith(".tmp") for n in v.names(key)):
                    return "gone"
        jobkit.verify_checkpoint(ckpt)
        self.publish(key, ckpt, record, None, mark=lambda: self.late_mark(key))
        return "published now"

    # -- periodic checkpoints in the archive (live.json) -----------------------------------------

    def periodic_due(self) -> bool:
        """The prestaging rule's unannounced branch: periodic checkpoints go to the archive too
        while departures without notice are plausible (a job whose node and buddy both leave
        without notice then rolls back only to its last periodic checkpoint)."""
        return (self.root() is not None
                and unannounced_plausible(self.host.notice_odds.unannounced_frac, float(self.host.s["prestage_unannounced"])))

    def publish_copy(self, ckpt: Path, d: int, wait: ArchiveWait | None = None, expect: str | None = None,
                      owner_uid: int | None = None) -> tuple[str, int, int]:
        """Copies the checkpoint ``ckpt`` (a local directory) into the key directory ``d`` as
        ``ckpt.name``: (its manifest's SHA-256, bytes, files). Only the files its manifest lists
        are read, through an fd of ``ckpt`` opened without following a link, each opened without
        following a link or waiting, hashed as it is copied and compared with the manifest;
        under a temporary name, fsync'd, renamed into place (a complete copy of this very
        manifest already there is kept; an incomplete leftover of the name is replaced). A job's
        own checkpoint (outside the agent's state directory) must be owned by ``owner_uid``: a
        job cannot make root copy another user's files into its record. ``expect``: the manifest
        digest a presigned record names (another is refused). Raises OSError/CheckpointError (a
        failed copy is removed, never published); ArchiveGivenUp once its ``wait`` was given up."""
        try:
            src = os.open(ckpt, archive_fs.O_DIR)
        except OSError as e:
            raise jobkit.CheckpointError(f"checkpoint {ckpt}: not a directory ({e.strerror or e})") from None
        try:
            if owner_uid and not self._in_state_dir(ckpt) and os.fstat(src).st_uid != owner_uid:
                raise jobkit.CheckpointError(f"checkpoint {ckpt} is owned by uid {os.fstat(src).st_uid}, not by the "
                                             f"job's owner (uid {owner_uid}): not archived")
            try:
                raw = archive_fs.read_small(src, jobkit.MANIFEST, jobkit.MAX_MANIFEST_BYTES)
                m = archive_fs.parse_manifest(raw, str(ckpt))
            except FileNotFoundError:
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: no {jobkit.MANIFEST}") from None
            except Refused as e:
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: {e}") from None
            digest = manifest_digest(raw)
            if expect is not None and digest != expect:
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: its manifest is not the one its job's node signed")
            facts = (digest, sum(int(f["size"]) for f in m["files"]), len(m["files"]))
            try:
                have = archive_fs.open_dir(d, ckpt.name)
            except (OSError, Refused):
                have = None
            if have is not None:
                try:
                    same = manifest_digest(archive_fs.read_small(have, jobkit.MANIFEST, jobkit.MAX_MANIFEST_BYTES)) \
                        == digest
                except (OSError, Refused):
                    same = False
                finally:
                    os.close(have)
                if same:
                    return facts
            tmp = f".tmp-{ckpt.name}-{self.host.node_id}-{time.monotonic_ns()}"
            os.mkdir(tmp, 0o700, dir_fd=d)
            try:
                tfd = archive_fs.open_dir(d, tmp)
                try:
                    archive_fs.copy_checkpoint(src, tfd, raw, str(ckpt))
                finally:
                    os.close(tfd)
                if wait is not None and wait.given_up:
                    raise ArchiveGivenUp(f"copy of {ckpt.name} given up by its waiter")
                archive_fs.remove_tree(d, ckpt.name)  # an incomplete leftover of that name
                os.rename(tmp, ckpt.name, src_dir_fd=d, dst_dir_fd=d)
            except Refused as e:
                archive_fs.remove_tree(d, tmp)
                raise jobkit.CheckpointError(f"checkpoint {ckpt}: {e}") from None
            except BaseException:
                archive_fs.remove_tree(d, tmp)
                raise
            return facts
        finally:
            os.close(src)

    def _in_state_dir(self, p: Path) -> bool:
        state = getattr(getattr(self.host.agent, "config", None), "state_dir", None)
        return state is not None and Path(os.path.normpath(str(state))) in Path(os.path.normpath(str(p))).parents

    def publish_live(self, key: str, ckpt: Path, record: dict[str, Any]) -> Path | None:
        """Copies the committed periodic checkpoint ``ckpt`` of the running job ``key`` into the
        archive (the same layout and checks as :meth:`publish`), then points the job's live
        record (``live.json``, signed by this node: who runs it, its buddy, its request) at it and
        removes the older archived checkpoints: the newest complete one is kept. A stopped job's
        record (``guard.json``, a claim, a running record, a ``.done`` marker: verified ones) is
        never touched: then nothing is written and None is returned. Blocking file I/O (the
        lane). Raises OSError/CheckpointError (a corrupt copy is removed, never published)."""
        root = self.root()
        assert root is not None
        with self.view(root) as v:
            d = self._key_dir_made(v, key)

            def stopped() -> bool:
                # (a ``.done`` marker: the key was claimed, run elsewhere and swept; this copy runs on
                # only because a partition kept it from hearing so: a new live record would be
                # claimed a second time. bench/chaos.py --long-partitions)
                v.forget(key)
                return v.read(key, "guard.json") is not None or bool(v.claims(key)) or v.done(key) is not None

            if stopped():
                return None
            digest, nbytes, files = self.publish_copy(ckpt, d, None, None, int(record["request"]["owner_uid"]))
            tmpj = f".live-{self.host.node_id}-{time.monotonic_ns()}.tmp"
            archive_fs.replace(d, LIVE_RECORD, v.auth.seal(
                owner_body("live", record, ckpt.name, digest, nbytes, files, time.time())), tmpj)
            if stopped():
                # a node claimed the previous live record meanwhile (it thinks this node is dead):
                # that claim is the lock; this record must not be a second one
                with contextlib.suppress(OSError):
                    os.unlink(LIVE_RECORD, dir_fd=d)
                return None
            for old in v.names(key):
                if _CKPT_STEP.fullmatch(old) and old != ckpt.name and not stopped():
                    archive_fs.remove_tree(d, old)
        return root / key / ckpt.name

    def _own_live_records(self, root: Path) -> dict[str, str]:
        """{job id: checkpoint} of the verified live records in the archive of this node's jobs
        (at start: at most 16 x ARCHIVE_SCAN_MAX entries of the root are looked at; blocking:
        the lane)."""
        out: dict[str, str] = {}
        prefix = f"n{self.host.node_id}-"
        with contextlib.suppress(OSError, MigrateError), self.view(root, create=False) as v:
            for key in archive_fs.names(v.rootfd, 16 * ARCHIVE_SCAN_MAX)[0]:
                if key.startswith(prefix) and (s := v.read(key, LIVE_RECORD)) is not None:
                    out[key[len(prefix):]] = str(s.body["ckpt"])
        return out

    @staticmethod
    def _live_held(v: View, key: str) -> bool:
        """The key's directory holds its live record, or a claim of it that no node runs yet."""
        v.forget(key)
        claims = v.claims(key)
        return (v.read(key, LIVE_RECORD) is not None
                or (any(c.name.startswith("claimed-") for c in claims) and not any(c.name.startswith("running-")
                                                                                 for c in claims)))

    def drop_live(self, key: str) -> bool:
        """The job ended here (by itself, stopped, failed, or moved by a reclaim): its live record
        and archived periodic checkpoints go. The record (this node's own, verified) is taken by
        rename first, so a node that claimed it meanwhile keeps it (and its checkpoint). True
        when removed."""
        v = self.view_or_none()
        if v is None:
            return False
        with v:
            return self._drop_live_in(v, key)

    def _drop_live_in(self, v: View, key: str) -> bool:
        d = v.dir(key)
        if d is None or v.read(key, LIVE_RECORD) is None:
            return False
        old = f".live-{self.host.node_id}-{time.monotonic_ns()}.old"
        try:
            os.rename(LIVE_RECORD, old, src_dir_fd=d, dst_dir_fd=d)
        except OSError:
            return False
        v.forget(key)
        if v.read(key, "guard.json") is not None or v.claims(key):
            with contextlib.suppress(OSError):
                os.unlink(old, dir_fd=d)
            return False
        return self._tombstone_in(v, None, key)

    def tick(self, now: float) -> None:
        """Each poll of the watch loop (``now``: wall clock, unused: the health check reads the
        monotonic clock): the archive's health (:meth:`_health`), then its
        next round (:meth:`run_round`) unless one is still in flight: one at a time, so on
        a hung archive one round waits on the lane and none piles up behind it."""
        if self.root() is None:
            return
        self._health()
        if not self.round_running:
            self.round_running = True
            self.host._spawn(self.run_round())

    def _stall(self, now: float) -> tuple[float | None, str | None]:
        """(seconds without progress, what waits) of the archive work in hand when that is at
        least ARCHIVE_STALL_SWEEPS x ``archive_gc_s`` (the archive is stalled), else (None, what
        runs now or None)."""
        quiet = self.lane.quiet_s(now)
        busy = self.lane.busy
        what = busy[0] if busy is not None else None
        if quiet is not None and quiet >= ARCHIVE_STALL_SWEEPS * float(self.host.s["archive_gc_s"]):
            return quiet, what
        return None, what

    def _health(self) -> None:
        """Says once (a log line and an event, ``archive-stalled``) when the archive stopped
        answering (:meth:`_stall`), and once (``archive-answers``) when it answers again."""
        now = time.monotonic()
        quiet, what = self._stall(now)
        if quiet is not None and self._stalled is None:
            self._stalled = now - quiet
            msg = (f"archive: {self.root()} does not answer: {what} has made no progress for {quiet:.1f} s "
                   "(its storage hangs?); archive work (claims, publishes, sweeps) waits for it, the rest of the "
                   "agent goes on")
            log.warning("migrate: %s", msg)
            self.host._emit(msg, phase="archive-stalled", waiting=what, stalled_s=round(quiet, 1))
        elif quiet is None and self._stalled is not None:
            msg = f"archive: {self.root()} answers again after {now - self._stalled:.1f} s"
            self._stalled = None
            log.info("migrate: %s", msg)
            self.host._emit(msg, phase="archive-answers")

    async def run_round(self) -> None:
        """One round of the archive's work: the look at it (:meth:`look`, on the lane),
        then, here on the loop, what it found: ended jobs' live records gone, running jobs'
        newer periodic checkpoints copied (the prestaging rule's unannounced branch,
        :meth:`periodic_due`), and any archived job no node runs tried here
        (:meth:`claim_and_resume`): unclaimed guard records, live records of jobs whose node and
        buddy are gone, stale claims, claims whose runner died (:meth:`dead_runs`); then the
        sweep (:meth:`start_sweep`). Claims and the sweep wait while this node is being
        reclaimed, and stay off once it is (its window ended and the reclaim was not withdrawn): a
        job it claimed would sit queued on a node its owner took back, while its claim told every
        other node (the job's buddy's guard too) that a node runs it."""
        try:
            root = self.root()
            if root is None:
                return
            reclaiming = self.host.reclaim is not None  # under reclaim, or reclaimed (withdrawn: None again)
            if not self.rounds:
                # the first round since the start: this node's live records in the archive (what it
                # archived before a restart; archived_live is kept in memory only). Before, a job
                # that ended after a restart left its live record, and a node that took this one
                # for gone later resumed the ended lineage from it (bench/chaos.py
                # --fence-after-s, seed 29)
                mine = await self.lane.call("own live records", self._own_live_records, root)
                for jid, ck in mine.items():
                    self.live.setdefault(jid, ck)
            ended: dict[str, str] = {}
            for jid in list(self.live):
                job = self.host.agent.jobs.get(jid)
                if job is None or (not job.active and job.state in ("exited", "stopped", "failed", "migrated")):
                    if jid not in self._archiving:
                        self.live.pop(jid, None)
                        self.live_buddy.pop(jid, None)
                        ended[jid] = job.state if job else "gone"
            periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]] = []
            if self.periodic_due() and not reclaiming:
                # each job's newest verified checkpoint as the checkpoint driver's check of its
                # listing found it: nothing is read for it here. Before, the look hashed every
                # running job's newest checkpoint whole at every round (poll_s), copied or not.
                # A listing the running driver has not checked yet waits for its check.
                driving = self.host.ckpt is not None and self.host.ckpt.threaded
                for j in list(self.host.agent.jobs.active()):
                    if j.id in self.host.evacuating or j.id in self._archiving or not j.ckpt_dir:
                        continue
                    known = self.host._driver_checked(j)
                    if known is None and driving:
                        continue
                    periodic.append((j.id, str(j.ckpt_dir), self.given_resume_from(j, root), known))
            wall, mono = time.time(), time.monotonic()
            z = self.host.zone
            alive = {self.host.node_id} | {n for n in (list(z.membership.by_node) if z is not None else [])
                                      if self.host.guarding.source_dead(int(n), wall) is None}
            skip = set(self.host.guarding.taking) | {k for k, t in self.next_try.items() if mono < t}
            look = await self.lane.call("archive round", self.look, root, list(ended), periodic,
                                         not reclaiming, frozenset(alive), frozenset(skip), wall)
            self.rounds += 1
            self._error = None
            for jid in look["dropped"]:
                self.host._emit(f"{jid}: ended ({ended[jid]}); its archived periodic checkpoints removed", persist=False,
                           job=jid, phase="archive-dropped")
            for jid in look.get("drop_again", []):  # (looked at again next round, as long as it is held)
                self.live.setdefault(jid, "")
            for jid, ckpt in look["ckpts"].items():
                job = self.host.agent.jobs.get(jid)
                if (job is None or not job.active or jid in self.host.evacuating or jid in self._archiving
                        or (self.live.get(jid) == ckpt.name
                            and self.live_buddy.get(jid) == self.host.prestage.buddy.get(jid))):
                    # (published again when its buddy changed: a record naming no buddy, or the old
                    # one, let a claimer resume the job while its buddy resumed it too)
                    continue
                self._archiving.add(jid)
                self.host._spawn(self.copy_periodic(job, ckpt))
            if not look["claims"] or self.host.reclaim is not None:
                return
            self.start_claims(look, time.time())
            self.start_sweep()
        except (OSError, ValueError, MigrateError) as e:  # the storage (gone, refusing; the root's owner or mode;
            # no zone keys): the next round looks again
            if str(e) != self._error:  # said once while it lasts, not every poll_s
                log.warning("migrate: archive round: %s", e)
            self._error = str(e)
        except Exception:
            log.exception("migrate: archive round failed")
        finally:
            self.round_running = False

    def given_resume_from(self, job: Any, root: Path) -> str | None:
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
        state = Path(os.path.normpath(str(self.host.agent.config.state_dir)))
        return str(rf) if state in p.parents else None

    def look(self, root: Path, ended: list[str],
                      periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]], claims: bool,
                      alive: frozenset[int], skip: frozenset[str], wall: float) -> dict[str, Any]:
        """The archive round's file work (on the lane; never on the loop): drops the live records
        of the ``ended`` jobs (:meth:`drop_live`), finds the newest checkpoint of each running job
        in ``periodic`` ((job id, its checkpoint directory, its ``resume_from``, (the newest
        verified one) while the checkpoint driver's check of the job's listing holds, else None):
        the newest it committed, or before it wrote one, the verified checkpoint it was restarted
        from; with the driver's answer nothing is read here: the copy is checked as it is made),
        and, with ``claims`` and the archive a directory, lists what may be claimed among the
        next ARCHIVE_SCAN_MAX entries of its root (:meth:`_scan_keys`; verified records only:
        :class:`laminar.migrate.archive_view.View`): guard records, live records of nodes not in
        ``alive`` ((key, src, buddy, newer): ``newer`` from :func:`_newer_copy`), stale claims
        (:meth:`_stale_claim`) and claims whose runner is not in ``alive`` and may be dead
        (:meth:`_running_records`). Keys in ``skip`` (taken or waiting) are not read. Returns
        ``{"dropped", "ckpts", "claims", "guards", "lives", "stale", "runs"}``."""
        out: dict[str, Any] = {"dropped": [], "ckpts": {}, "claims": False, "guards": [], "lives": [], "stale": [],
                               "runs": [], "drop_again": []}
        try:  # (only what needs the archive's records opens it: a round with neither reads nothing of it)
            v: View | None = self.view(root, create=False) if ended or claims else None
        except FileNotFoundError:
            v = None
        try:
            for jid in ended:
                key = f"n{self.host.node_id}-{jid}"
                if v is None:
                    break
                if self._drop_live_in(v, key):
                    out["dropped"].append(jid)
                    # the lineage ended here: a guard of this key that missed the release (this node
                    # was cut off from it when the job ended) finds the marker and stands down
                    # (_claim_archived). Before, the buddy took the ended job over after
                    # orphan_after_s and ran its last steps, and its end, a second time
                    # (bench/chaos.py --fence-after-s, seed 31)
                    self.mark_done_in(v, key, self.host.node_id, "ended there", wall)
                elif self._live_held(v, key):
                    # claimed by a node that has not run it (yet): it gives the record back if it finds
                    # no room, and then the ended job's record would be claimable again (a lineage that
                    # ended, resumed: bench/chaos.py --fence-after-s, seed 29). Dropped again next round.
                    out["drop_again"].append(jid)
            for jid, ckpt_dir, rf, known in periodic:
                # no driver has checked it: the agent's own bounded check (its tries, bytes and time)
                if known is not None:
                    ckpt = known[0]
                else:
                    listing = scan_dir(ckpt_dir)
                    ckpt = ckpt_driver.check_newest(listing.paths() if listing else [], self.host.s)[0]
                if ckpt is None and rf:
                    # restarted from a checkpoint (a move, a guard, the archive) and none written
                    # since: the one it resumed from is its newest, archived at once under its new key
                    ckpt = Path(rf) if (Path(rf) / jobkit.MANIFEST).exists() else None
                if ckpt is not None:
                    out["ckpts"][jid] = ckpt
            if not claims or v is None:
                return out
            out["claims"] = True
            orphan_s = float(self.host.s.get("orphan_after_s") or 0)
            for key in self._scan_keys(v):
                if key in skip:
                    continue
                names = v.names(key)
                if "guard.json" in names and v.claimable(key, "guard.json") is not None:
                    out["guards"].append(key)
                    continue
                m = _KEY_NODE.fullmatch(key)
                if LIVE_RECORD in names and m is not None and int(m[1]) not in alive:
                    # (its node runs it: not claimable, nor its directory looked into for a newer copy)
                    s = v.claimable(key, LIVE_RECORD)
                    if s is not None:
                        b = s.body
                        # only silent, and written lately (its signed time, not the file's): its node is
                        # alive whatever the zone hears of it (a partition: it still reaches the
                        # archive). bench/chaos.py --long-partitions: a partitioned node's new live
                        # record was claimed a second after it was written. (A node dead by its
                        # window's end is asked first: _from_archive's ``ask``.)
                        if self._window_ended(int(b["src_node"]), wall) or wall - float(b["ts"]) >= orphan_s:
                            d = v.dir(key)
                            out["lives"].append((key, int(b["src_node"]), b.get("buddy"),
                                                 _newer_copy(d, names, int(b["src_node"]), b, wall)
                                                 if d is not None else None))
                if any(n.startswith("claimed-") for n in names):
                    stale = self._stale_claim(v, key)
                    if stale is not None:
                        out["stale"].append(stale[:2])
                if any(n.startswith("running-") for n in names):
                    out["runs"] += self._running_records(v, key, lambda n: n in alive)
            return out
        finally:
            if v is not None:
                v.close()

    def _scan_keys(self, v: View, which: str = "_archive_scan") -> list[str]:
        """The names among the next ARCHIVE_SCAN_MAX entries of the archive's root that may be
        key directories (:meth:`_scan_page`; ``which``: the round's pass or the sweep's). A link
        there is counted, never followed."""
        out: list[str] = []
        for e in self._scan_page(which, str(v.root), v.rootfd):
            if e.name.startswith(".") or not _SAFE_KEY.match(e.name):
                continue
            with contextlib.suppress(OSError):
                if e.is_symlink():
                    v.dir(e.name)  # counted (``link``), never followed
                elif e.is_dir(follow_symlinks=False):
                    out.append(e.name)
        return out

    def _scan_page(self, which: str, path: str, dirfd: int) -> list[os.DirEntry[str]]:
        """The next ARCHIVE_SCAN_MAX entries of the directory ``dirfd`` (``path``). A pass goes on
        from one call to the next through a listing held open between them (``which`` names
        it), and a new one starts once it ended: each call reads at most that many entries,
        however many there are."""
        scan = getattr(self, which, None)
        if scan is not None and scan[0] != path:
            self._scan_end(which)
            scan = None
        if scan is None:
            fd = os.open(".", archive_fs.O_DIR, dir_fd=dirfd)
            try:
                scan = (path, fd, os.scandir(fd))
            except BaseException:
                os.close(fd)
                raise
            setattr(self, which, scan)
        out: list[os.DirEntry[str]] = []
        try:
            for e in scan[2]:
                out.append(e)
                if len(out) >= ARCHIVE_SCAN_MAX:
                    return out
        except OSError:
            pass
        self._scan_end(which)  # this pass ended: the next call starts another
        return out

    def _scan_end(self, which: str) -> None:
        scan = getattr(self, which, None)
        setattr(self, which, None)
        if scan is not None:
            with contextlib.suppress(OSError):
                scan[2].close()
            with contextlib.suppress(OSError):
                os.close(scan[1])

    async def copy_periodic(self, job: Any, ckpt: Path) -> None:
        key = self.host.job_key(job)
        buddy = self.host.prestage.buddy.get(job.id)
        rf = getattr(job.spec, "resume_from", None)
        record = {"key": key, "src_node": self.host.node_id, "src_job": job.id, "buddy": buddy,
                  "request": self.host._request(job, False), "periodic": True,
                  # the checkpoint it resumed from, not one it wrote: what it resumed from stays (archive_gc)
                  "resumed_copy": bool(rf) and Path(str(rf)) == ckpt}
        try:
            path = await self.lane.call(f"periodic copy of {job.id}", self.publish_live, key, ckpt, record)
            if path is not None:
                self.live[job.id] = ckpt.name
                self.live_buddy[job.id] = buddy
                self.host.counts["archived_periodic"] = self.host.counts.get("archived_periodic", 0) + 1
                self.host._emit(f"{job.id}: periodic {ckpt.name} archived (node and buddy leaving without notice would "
                           "roll it back only to here)", persist=False, job=job.id, ckpt=ckpt.name,
                           phase="archived-periodic")
        except (OSError, jobkit.CheckpointError) as e:  # removed by the job's keep meanwhile, a full archive
            log.info("migrate: archiving periodic %s of %s failed: %s", ckpt.name, job.id, e)
        finally:
            self._archiving.discard(job.id)

    def claim(self, key: str, live: bool = False, dead_runner: int | None = None) -> bool:
        """Takes the archive's claim on ``key`` (rename guard.json -> claimed-<node>.json: one
        node wins). Only a record that verifies is taken (:meth:`_claim_in`). A claim this agent
        has seen unchanged for ARCHIVE_CLAIM_STALE_S whose node never ran the job (it died
        trying) is taken over the same way. ``live``: a running job's periodic record
        (``live.json``) may be claimed too (its node is dead, and its buddy is this node or dead
        as well). ``dead_runner``: the running record of that node, which ran the job from here
        and died before anything newer of it was archived (:meth:`dead_runs`). False when
        another node holds it or there is none."""
        v = self.view_or_none()
        if v is None:
            return False
        with v:
            return self._claim_in(v, key, live, dead_runner)

    def _claim_in(self, v: View, key: str, live: bool = False, dead_runner: int | None = None) -> bool:
        d = v.dir(key)
        if d is None:
            return False
        mine = f"claimed-{self.host.node_id}.json"
        srcs = [n for n in ["guard.json"] + ([LIVE_RECORD] if live else []) if v.claimable(key, n) is not None]
        if dead_runner is not None and dead_runner != self.host.node_id:
            n = f"running-{dead_runner}.json"
            if n in v.names(key) and v.read(key, n) is not None:
                srcs.append(n)
        if (stale := self._stale_claim(v, key)) is not None:
            srcs.append(stale[2])
        for src in srcs:
            s = v.read(key, src)
            if s is None or self.refusals.known(("payload", key, s.owner["nonce"])):
                continue  # (its checkpoint did not match what it signed: not claimed again)
            try:
                os.rename(src, mine, src_dir_fd=d, dst_dir_fd=d)
            except OSError:
                continue
            v.forget(key)
            got = v.read(key, mine)
            if got is None:  # swapped between the look and the rename: given back as it was
                with contextlib.suppress(OSError):
                    os.rename(mine, src, src_dir_fd=d, dst_dir_fd=d)
                v.forget(key)
                continue
            taken, frm = got.taken
            if src.startswith("claimed-"):
                self._claimed_from.pop(key, None)
            else:
                self._claimed_from[key] = src  # what _unclaim gives it back as
            # noted, signed: what was taken, from where, when (its staleness; without the note, a
            # crash right after the rename, the claim is stale by this agent's own clock alone)
            with contextlib.suppress(OSError):
                archive_fs.replace(d, mine, v.auth.seal({"kind": "claim", "key": key, "taken": taken, "from": frm,
                                                         "ts": time.time()}),
                                   f".claim-{self.host.node_id}-{time.monotonic_ns()}.tmp")
                v.forget(key)
            return True
        return False

    def unclaim(self, key: str) -> None:
        """Gives this node's claim on ``key`` back (it found no room, or the record's checkpoint
        did not verify) as the record it took (:meth:`claim` notes which): a dead runner's
        ``running-<node>.json``, a running job's live record (claimable again only while its node
        and buddy are gone), a stopped job's ``guard.json``. As a guard record, a live one would be
        claimed by any agent with room at once, and a node thought dead that was only slow would
        then run the job twice. A stale claim taken over goes back as its signed record says
        (its kind; a claim that does not verify is left as it is). Blocking file I/O (on the lane)."""
        took = self._claimed_from.pop(key, None)
        v = self.view_or_none()
        if v is None:
            return
        with v:
            self._unclaim_in(v, key, took)

    def _unclaim_in(self, v: View, key: str, took: str | None) -> None:
        d = v.dir(key)
        mine = f"claimed-{self.host.node_id}.json"
        if d is None:
            return
        s = v.read(key, mine)
        if s is not None and s.body["kind"] == "claim":  # noted: what it took goes back, as it was, where it was
            taken, frm = s.taken
            with contextlib.suppress(OSError):
                archive_fs.replace(d, frm, canonical(taken), f".unclaim-{self.host.node_id}-{time.monotonic_ns()}.tmp")
                os.unlink(mine, dir_fd=d)
            v.forget(key)
            return
        if took is None:
            if s is None:
                return  # (one that does not verify is left as it is)
            took = s.taken[1]
        with contextlib.suppress(OSError):
            os.rename(mine, took, src_dir_fd=d, dst_dir_fd=d)
        v.forget(key)

    def claim_done(self, key: str, who: str, runs: tuple[int, str] | None = None) -> None:
        """The claimed job runs (here or where this node placed it): this node's claim becomes
        ``running-<node>.json``, a run record it signs holding the record it claimed (no node
        claims it again) and ``resumed``: (node, job id) of the job resumed from it, so any agent
        can tell when the job's newer state is in the archive and this directory may go
        (:meth:`sweep`)."""
        self._claimed_from.pop(key, None)
        v = self.view_or_none()
        if v is None:
            return
        with v:
            d = v.dir(key)
            mine = f"claimed-{self.host.node_id}.json"
            s = v.read(key, mine) if d is not None else None
            if d is None or s is None:
                log.warning("migrate: archive: %s/%s is gone or does not verify: no running record written", key, mine)
                return
            body = {"kind": "run", "key": key, "record": s.owner_env, "ts": time.time(),
                    "resumed": {"node": int(runs[0]), "job": str(runs[1])} if runs is not None and runs[1] else None}
            try:
                archive_fs.replace(d, f"running-{self.host.node_id}.json", v.auth.seal(body),
                                   f".running-{self.host.node_id}-{time.monotonic_ns()}.tmp")
            except OSError as e:  # the claim stays as it was: kept, never removed
                log.info("migrate: noting where archived %s runs failed: %s", key, e)
                return
            with contextlib.suppress(OSError):
                os.unlink(mine, dir_fd=d)

    def start_claims(self, look: dict[str, Any], wall: float) -> None:
        """Any agent with room resumes an archived job no node runs: the claimable records the
        round's look found (:meth:`look`) are tried here (``_from_archive``), at most
        ARCHIVE_CLAIMS_MAX a round (the rest the next round)."""
        now = time.monotonic()
        started = 0

        def free(key: str) -> bool:
            return started < ARCHIVE_CLAIMS_MAX and key not in self.host.guarding.taking and now >= self.next_try.get(key, 0.0)

        for key in look["guards"]:
            if not free(key) or self.guarded_here(key):
                continue  # this node guards it: its own take-over goes through the claim
            self.host.guarding.taking.add(key)
            started += 1
            self.host._spawn(self.claim_and_resume(key))
        waited = {}
        for key, src, buddy, newer in look["lives"]:
            if not free(key) or self._run_elsewhere(src, buddy, wall):
                continue  # its node runs it, or its buddy lives and resumes it from its replica
            if self.guarded_here(key):
                continue  # this node guards it: its own take-over goes through the claim
            if newer is not None and self._await_newer_copy(key, src, newer, wall, now):
                waited[key] = self.live_waits[key]
                continue
            self.host.guarding.taking.add(key)
            started += 1
            self.host._spawn(self.claim_and_resume(key, live=True, ask=(src, key) if self._window_ended(src, wall) else None))
        self.live_waits = waited  # a wait ends with its record (claimed, replaced by the newer one, gone)
        for key, rec in look["stale"][:ARCHIVE_SCAN_MAX]:
            # its node claimed it and died before the job ran: claimable again (_claim takes it over)
            if not free(key):
                continue
            if rec["kind"] == "live":  # claimed from a live record: only while its node and buddy are still gone
                if self._run_elsewhere(int(rec["src_node"]), rec.get("buddy"), wall):
                    continue
            if self.guarded_here(key):
                continue  # this node guards it: its own take-over goes through the claim
            self.host.guarding.taking.add(key)
            started += 1
            self.host._spawn(self.claim_and_resume(key))
        for key, node, (runs_on, job) in look["runs"]:
            if not free(key) or self.host.guarding.source_dead(node, wall) is None or self.guarded_here(key):
                continue
            self.host.guarding.taking.add(key)
            started += 1
            # the node it placed the job on (another, alive or not: that one is asked) or itself
            # (asked when its window ended: it may be back), whether the job runs there
            ask = (runs_on, f"n{runs_on}-{job}") if runs_on != node or self._window_ended(node, wall) else None
            self.host._spawn(self.claim_and_resume(key, dead_runner=node, ask=ask))

    def _window_ended(self, node: int, wall: float) -> bool:
        """Whether ``node``'s reclaim window (the zone's notice) has ended. Such a node counts as
        dead, yet its agent may have come back after the window (restarted, its reclaim cleared:
        the owner gave the node back) and run what it claimed or started since: its archived
        records are asked about first (:meth:`claim_and_resume`'s ``ask``). A claim of a node
        that is only silent is not (it does not answer)."""
        notice = self.host.notices.get(node)
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
        seen = self.host._last_seen(src)
        if seen < 0 or wall - seen >= float(self.host.s["dead_after_s"]):
            return False
        first = self.live_waits.setdefault(key, now)
        if now - first >= newer[2]:
            self.host._emit(f"{key}: waited {now - first:.1f} s for node {src}'s copy of {newer[1]} into the archive "
                       f"(the progress it holds over {newer[0]}); resumed from {newer[0]}", persist=False,
                       key=key, ckpt=newer[0], phase="archive-live-waited")
            return False
        if now == first:
            self.host._emit(f"{key}: its archived {newer[0]} is not claimed yet: node {src}, heard from past its "
                       f"reclaim window, is copying {newer[1]} into the archive (waits up to {newer[2]:.1f} s, "
                       "the progress it holds)", persist=False, key=key, ckpt=newer[0], phase="archive-live-wait")
        return True

    def guarded_here(self, key: str) -> bool:
        """This node guards (or waits to resume) the job ``key``."""
        row = self.host.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        return row is not None and row["state"] in ("guarding", "waiting")

    def _run_elsewhere(self, src: int, buddy: Any, wall: float) -> bool:
        """A running job's archived record is not this node's to claim: this node runs it, its
        node ``src`` is alive, or its ``buddy`` (another node) is and resumes it from its replica."""
        if src == self.host.node_id or self.host.guarding.source_dead(src, wall) is None:
            return True
        return buddy is not None and int(buddy) != self.host.node_id and self.host.guarding.source_dead(int(buddy), wall) is None

    def dead_runs(self, root: Path, now: float) -> list[tuple[str, int]]:
        """(key, node) of each job claimed from the archive whose runner ``node`` (another node)
        is dead (:meth:`Guard.source_dead`) before anything newer of the job reached the archive: its
        successor ``n<node>-<job>`` (the record's ``resumed``) holds no verified record. The
        claimed checkpoint is then the job's newest safe state, and any agent may claim it
        again. With a successor record, the job is recovered through it (its live record), never
        twice; a record without ``resumed`` names no successor and is left. Blocking file I/O
        (the first ARCHIVE_SCAN_MAX entries of the root); the round reads the files on the lane
        (:meth:`_running_records`) and asks :meth:`Guard.source_dead` on the loop."""
        out = []
        with self.view(root, create=False) as v:
            for key in archive_fs.names(v.rootfd, ARCHIVE_SCAN_MAX)[0]:
                if not key.startswith("."):
                    out += [(k, n) for k, n, _ in self._running_records(v, key, lambda n: self.host.guarding.source_dead(n, now) is None)]
        return out

    def _running_records(self, v: View, key: str, alive: Callable[[int], bool]
                         ) -> list[tuple[str, int, tuple[int, str]]]:
        """(key, node, (node, job) of the job resumed from it: its successor) of each verified
        running record in the key's directory of another node, not ``alive``, whose successor
        holds no verified record (the file part of :meth:`dead_runs`)."""
        out = []
        for s in v.runs(key):
            node, res = int(s.body["writer"]), s.body.get("resumed")
            if node == self.host.node_id or alive(node) or res is None:
                continue
            succ = f"n{res['node']}-{res['job']}"
            if succ != key and any((n in ("guard.json", LIVE_RECORD) or _NODE_FILE.fullmatch(n))
                                   and v.read(succ, n) is not None for n in v.names(succ)):
                continue
            out.append((key, node, (int(res["node"]), str(res["job"]))))
        return out

    def stale_claims(self, root: Path, now: float) -> list[tuple[str, dict[str, Any]]]:
        """(key, claimed record's body) of each claim in the archive (among the first
        ARCHIVE_SCAN_MAX entries of its root) that this agent has seen unchanged for
        ARCHIVE_CLAIM_STALE_S and whose job no node runs (another node's: this node's own
        claims are its take-overs in flight)."""
        out = []
        with self.view(root, create=False) as v:
            for key in archive_fs.names(v.rootfd, ARCHIVE_SCAN_MAX)[0]:
                st = self._stale_claim(v, key) if not key.startswith(".") else None
                if st is not None:
                    out.append((st[0], st[1]))
        return out

    def _stale_claim(self, v: View, key: str) -> tuple[str, dict[str, Any], str] | None:
        """(key, the claimed record's body, the claim's file name) of a verified claim of another
        node in the key's directory that no node runs and that is older than
        ARCHIVE_CLAIM_STALE_S (:meth:`claim_age`), or None."""
        claims = v.claims(key)
        if any(c.name.startswith("running-") for c in claims):
            return None
        for c in claims:
            if c.node == self.host.node_id or not c.name.startswith("claimed-"):
                continue
            if self.claim_age(v, key, c) > ARCHIVE_CLAIM_STALE_S:
                return key, c.owner, c.name
        return None

    def claim_age(self, v: View, key: str, c: Sealed) -> float:
        """How old the claim ``c`` is: by its signed note (``ts``), or, a claim its node never
        noted (it crashed right after the rename), by how long this agent has seen it as it is
        now (:meth:`_claim_seen_for`); so is another node's note under this claim's name (a
        takeover not noted yet). Never the file's mtime, which anyone who can write the share
        sets at will."""
        if c.body["kind"] == "claim" and c.body["writer"] == c.node:
            return time.time() - float(c.body["ts"])
        return self._claim_seen_for(v, key, c)

    def _claim_seen_for(self, v: View, key: str, c: Sealed) -> float:
        """Seconds since this agent first saw the claim ``c`` as it is now (the same file: inode
        and ctime, which a rename or rewrite changes; 0 the first time)."""
        try:
            st = archive_fs.lstat_at(v.dir(key) or v.rootfd, c.name)
        except OSError:
            return 0.0
        ident = (key, c.name, st.st_ino, st.st_ctime_ns)
        now = time.monotonic()
        first = self.claims_seen.setdefault(ident, now)
        self.claims_seen.move_to_end(ident)
        while len(self.claims_seen) > CLAIMS_SEEN_KEEP:
            self.claims_seen.popitem(last=False)
        return now - first

    # -- removing what the archive no longer needs (archive_gc) -----------------------------------

    def placed_as(self, key: str) -> tuple[int, str] | None:
        """(node, job id) where this node placed the guarded job ``key`` (the replica's job_id,
        ``node N/job-M``), or None."""
        row = self.host.agent.store.db.execute("SELECT job_id FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        try:
            node, job = str(row["job_id"]).removeprefix("node ").split("/", 1)
            return int(node), job
        except (TypeError, ValueError, IndexError):
            return None

    def start_sweep(self) -> None:
        """Every ``archive_gc_s``: the archive sweep (:meth:`sweep`) in a thread, one at a time."""
        if self._gc_running or time.monotonic() < self._gc_next:
            return
        self._gc_next = time.monotonic() + float(self.host.s["archive_gc_s"])
        self._gc_running = True
        self.host._spawn(self._gc_task(self._gc_ended()))

    def _gc_ended(self) -> dict[str, set[str]]:
        """Archive key -> ids of this node's jobs resumed from it (their origin, as the job
        manager stored it: laminar.runtime.provenance; never a job's env, which its user writes)
        that ended by themselves (exited) or were stopped by their user: they need nothing from
        it any more. A job that failed to start, was lost, moved or reclaimed is not here: its
        state may still be needed from the archive. One indexed query, no spec decoded."""
        jobs = getattr(self.host.agent, "jobs", None)
        return jobs.ended_origins(("exited", "stopped")) if jobs is not None else {}

    async def _gc_task(self, ended: dict[str, set[str]]) -> None:
        try:
            res = await self.lane.call("archive sweep", self.sweep, ended)
            for key, why in res["removed"].items():
                self.host._emit(f"archive: {key} removed ({why})", persist=False, key=key, phase="archive-removed", why=why)
        except Exception:  # a bug or the storage: the next sweep tries again
            log.exception("migrate: archive sweep")
        finally:
            self._gc_running = False

    def sweep(self, ended: dict[str, set[str]] | None = None, now: float | None = None,
                   tmp_stale_s: float = ARCHIVE_TMP_STALE_S) -> dict[str, Any]:
        """One sweep of the archive (the rule is in the module's docs, *What the archive keeps, and
        what goes*) over the next ARCHIVE_SCAN_MAX entries of its root (:meth:`_scan_keys`: a
        larger archive takes several sweeps). Per ``<archive>/<key>/`` (a real directory of the
        archive's owner: links and files at the top are not this agent's and are left alone):

        * temporary names (``.``-prefixed) whose newest file is older than ``tmp_stale_s`` go;
        * a directory whose only record is a verified ``running-<node>.json`` goes when the job
          resumed from it ended here (``ended``: key -> this node's job ids that exited or were
          stopped by their user, and the record names one of them, or, a record without
          ``resumed``, this node ran it) or when the record's ``resumed`` job holds a newer
          checkpoint it wrote itself under its own key, verified against the manifest its record
          signed (:meth:`_holds_safe_copy_in`);
        * a directory with nothing left in it for ``tmp_stale_s`` goes;
        * tombstones in ``<archive>/.gc`` older than ``tmp_stale_s`` (a crash mid-removal) go.

        Everything else stays (a directory holding a record that does not verify is an
        operator's call). Each removal is a rename into ``.gc`` (the agent whose rename wins
        removes it; a loser skips it) and then the tombstone's removal without following links.
        Blocking file I/O (the lane). Never raises for the storage (what cannot be read is
        kept). Returns ``{"removed": {key: why}, "temporaries": n, "tombstones": n}`` and adds
        them to ``counts`` (``archive_gc_dirs`` and one count per why, ``archive_gc_temporaries``)."""
        out: dict[str, Any] = {"removed": {}, "temporaries": 0, "tombstones": 0}
        now = time.time() if now is None else now
        try:
            v = self.view_or_none()
        except (OSError, MigrateError):
            return out
        if v is None:
            return out
        with v:
            for key in self._scan_keys(v, "_gc_scan"):
                d = v.dir(key)
                if d is None:
                    continue
                names = v.names(key)
                for n in names:
                    if n.startswith(".") and now - archive_fs.newest_mtime(d, n) > tmp_stale_s \
                            and self._tombstone_in(v, key, n):
                        out["temporaries"] += 1
                why, runner = self._gc_verdict_in(v, key, names, (ended or {}).get(key, set()), now, tmp_stale_s)
                if why in ("ended", "superseded") and runner is not None:
                    self.mark_done_in(v, key, runner, why, now)  # before the directory goes
                if why is not None and self._tombstone_in(v, None, key):
                    out["removed"][key] = why
            if self._done_expired is None or now - self._done_expired >= ARCHIVE_DONE_EXPIRE_EVERY_S:
                self._done_expired = now  # (listing them at every sweep grows with the claims on shared storage)
                self._expire_done(v, now, tmp_stale_s)
            trash = v.dir(ARCHIVE_TRASH)
            if trash is not None:
                with contextlib.suppress(OSError):
                    for t in archive_fs.names(trash, ARCHIVE_SCAN_MAX)[0]:
                        try:
                            born = int(t.rsplit(".", 1)[-1]) / 1e9
                        except ValueError:
                            born = archive_fs.newest_mtime(trash, t)
                        if now - born > tmp_stale_s:
                            archive_fs.remove_tree(trash, t)
                            out["tombstones"] += 1
        self.host.counts["archive_gc_dirs"] = self.host.counts.get("archive_gc_dirs", 0) + len(out["removed"])
        for why in out["removed"].values():  # archive_gc_ended, archive_gc_superseded, archive_gc_empty
            self.host.counts[f"archive_gc_{why}"] = self.host.counts.get(f"archive_gc_{why}", 0) + 1
        self.host.counts["archive_gc_temporaries"] = (self.host.counts.get("archive_gc_temporaries", 0) + out["temporaries"]
                                                 + out["tombstones"])
        return out

    def _expire_done(self, v: View, now: float, tmp_stale_s: float) -> None:
        """The next ARCHIVE_SCAN_MAX entries of ``<archive>/.done``: a verified marker whose signed
        time is older than ARCHIVE_DONE_KEEP_S goes, as does a crashed write's temporary;
        anything else stays (a marker that does not verify is never removed: an operator's call)."""
        d = v.dir(ARCHIVE_DONE)
        if d is None:
            return
        with contextlib.suppress(OSError):
            for e in self._scan_page("_done_scan", str(v.root / ARCHIVE_DONE), d):
                t = e.name
                if t.startswith("."):
                    if now - archive_fs.newest_mtime(d, t) > tmp_stale_s:
                        with contextlib.suppress(OSError):
                            os.unlink(t, dir_fd=d)
                    continue
                s = v.done(t)
                if s is not None and now - float(s.body["at"]) > ARCHIVE_DONE_KEEP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(t, dir_fd=d)

    def mark_done_in(self, v: View, key: str, runner: int, why: str, now: float) -> None:
        """``<archive>/.done/<key>``, signed by this node: the claimed job of ``key`` ran on node
        ``runner`` and ended (``why``: "ended there" on its own node, "ended", "superseded").
        Written whole under a temporary name of this write's own, then renamed (two sweepers
        marking one key at once each rename a whole record); never raises."""
        if not _SAFE_KEY.match(key):
            return
        try:
            d = v.dir(ARCHIVE_DONE, create=True)
            assert d is not None
            archive_fs.replace(d, key, v.auth.seal({"kind": "done", "key": key, "runner": int(runner), "why": why,
                                                    "at": now}),
                               f".{key}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        except (OSError, Refused) as e:
            log.warning("migrate: archive: cannot mark %s done: %s", key, e)

    def _gc_verdict_in(self, v: View, key: str, names: list[str], ended: set[str], now: float,
                       tmp_stale_s: float) -> tuple[str | None, int | None]:
        """Why the key's directory may go now ("ended", "superseded", "empty") and the node that
        ran its job (named by its marker), or (None, None): it stays. ``names``: its entries;
        ``ended``: this node's job ids resumed from it that ended. Only a verified running record
        decides; a directory with any other record (verified or not) stays."""
        recs = [n for n in names if n.endswith(".json") and not n.startswith(".")]
        if any(n in ("guard.json", LIVE_RECORD) or n.startswith("claimed-") for n in recs):
            return None, None  # claimable, being claimed, or a claim whose node died (taken over when stale)
        if not any(n.startswith("running-") for n in recs):
            v.forget(key)
            if v.names(key) or now - archive_fs.newest_mtime(v.rootfd, key) <= tmp_stale_s:
                return None, None  # a checkpoint without a record: a publish in progress or a crash's only copy
            return "empty", None
        runs = sorted(v.runs(key), key=lambda s: s.name)
        if not runs:
            return None, None
        runner, res = int(runs[0].body["writer"]), runs[0].body.get("resumed")
        if res is not None:
            node, job = int(res["node"]), str(res["job"])
            if node == self.host.node_id and job in ended:
                return "ended", runner
            succ = f"n{node}-{job}"
            if succ != key and not job.startswith(".") and self._holds_safe_copy_in(v, succ):
                return "superseded", runner
            return None, None
        if runner == self.host.node_id and ended:
            return "ended", runner  # a record without ``resumed``: this node claimed it and ran it here
        return None, None

    def _holds_safe_copy_in(self, v: View, key: str) -> bool:
        """``<archive>/<key>/`` has a verified record (live, guard, claimed or running) naming a
        checkpoint the job wrote itself (not the copy of what it resumed from,
        ``resumed_copy``) whose manifest is the one the record signed and whose files match it
        (hashed in place). A checkpoint that failed is not hashed again."""
        if v.dir(key) is None:
            return False
        for n in v.names(key):
            if not (n in (LIVE_RECORD, "guard.json") or _NODE_FILE.fullmatch(n)):
                continue
            s = v.read(key, n)
            if s is None or s.owner.get("resumed_copy"):
                continue
            b = s.owner
            if (key, str(b["ckpt"])) in self.gc_unverified:
                continue
            try:
                self._check_payload(v, key, b)
            except (OSError, Refused) as e:
                log.info("migrate: archived %s/%s is no safe copy: %s", key, b["ckpt"], e)
                self.gc_unverified.add((key, str(b["ckpt"])))
                continue
            return True
        return False

    @staticmethod
    def _check_payload(v: View, key: str, b: dict[str, Any], dst_fd: int | None = None) -> None:
        """The checkpoint the verified record body ``b`` names in the key's directory, checked
        against what the record signed (its manifest's SHA-256, then every file against that
        manifest: a payload rewritten with a consistent manifest of its own is refused) and,
        with ``dst_fd``, copied there as it is checked. Raises :class:`Refused` (``bad_ckpt``: not
        a real directory; ``manifest_mismatch``) or OSError."""
        d = v.dir(key)
        if d is None:
            raise FileNotFoundError(f"{v.root}/{key}")
        where = f"{key}/{b['ckpt']}"
        try:
            ck = archive_fs.open_dir(d, str(b["ckpt"]))
        except Refused as e:
            raise Refused("bad_ckpt", f"{where}: {e.detail}") from None
        except FileNotFoundError:
            raise Refused("bad_ckpt", f"{where} is missing") from None
        try:
            try:
                raw = archive_fs.read_small(ck, jobkit.MANIFEST, jobkit.MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                raise Refused("manifest_mismatch", f"{where}: no {jobkit.MANIFEST}") from None
            except Refused as e:
                raise Refused("manifest_mismatch", f"{where}: {jobkit.MANIFEST}: {e.detail}") from None
            if manifest_digest(raw) != b["manifest_sha256"]:
                raise Refused("manifest_mismatch", f"{where}: its {jobkit.MANIFEST} is not the one its record signed")
            archive_fs.copy_checkpoint(ck, dst_fd, raw, where, 0o644)
        finally:
            os.close(ck)

    def fetch(self, v: View, key: str, b: dict[str, Any]) -> Path:
        """The checkpoint the verified record body ``b`` names, copied out of the archive into
        this node's state directory (``<state>/resume/<key>/<ckpt>/``, the owner's view of a
        checkpoint: :meth:`Replicas.resume_install`) and checked against what the record signed as it is
        copied (:meth:`_check_payload`): every job resumed from the archive, root's included,
        reads this local copy, never the shared storage (which anyone who can write it could
        change between the check and the job's read). Raises :class:`Refused` (``bad_ckpt``,
        ``manifest_mismatch``, ``too_big_ckpt``: it does not fit, leaving ARCHIVE_FETCH_RESERVE
        free) or OSError."""
        req = b["request"]
        base = self.host.replicas.resume_base()
        st = os.statvfs(base)
        free = st.f_bavail * st.f_frsize
        if free < int(b["bytes"]) + ARCHIVE_FETCH_RESERVE:
            raise Refused("too_big_ckpt", f"{key}/{b['ckpt']}: {b['bytes']} bytes, {free} free in {base}")
        tmp = base / f".tmp-{key}-{b['ckpt']}-{time.monotonic_ns()}"
        os.mkdir(tmp, 0o700)
        try:
            tfd = os.open(tmp, archive_fs.O_DIR)
            try:
                self._check_payload(v, key, b, tfd)
            finally:
                os.close(tfd)
            return self.host.replicas.resume_install(tmp, key, str(b["ckpt"]), int(req["owner_uid"]), int(req["owner_gid"]))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def tombstone(self, root: Path, path: Path) -> bool:
        """Removes ``path`` (an entry of the archive ``root`` or of one of its job directories)
        (:meth:`_tombstone_in`). Raises ValueError for a path outside the archive."""
        if path.parent != root and path.parent.parent != root:
            raise ValueError(f"{path} is not an entry of the archive {root} or of one of its job directories")
        with self.view(root, create=False) as v:
            return self._tombstone_in(v, None if path.parent == root else path.parent.name, path.name)

    def _tombstone_in(self, v: View, key: str | None, name: str) -> bool:
        """Removes the entry ``name`` of the archive's root (``key`` None) or of the key's
        directory: renamed into ``<root>/.gc`` first (atomic: of two agents one wins; through
        directory fds, never a path a link could redirect), then removed without following
        links. True when this agent's rename won. A ``.gc`` that is not a real directory of the
        archive's owner (a link: counted) stops every removal."""
        try:
            trash = v.dir(ARCHIVE_TRASH, create=True)
        except (OSError, Refused):
            return False
        src = v.rootfd if key is None else v.dir(key)
        if trash is None or src is None:
            return False
        t = f"{name}.{self.host.node_id}.{time.time_ns()}"
        try:
            os.rename(name, t, src_dir_fd=src, dst_dir_fd=trash)
        except OSError:
            return False  # gone meanwhile (another agent won), or not ours to move
        v.forget(name if key is None else key)
        archive_fs.remove_tree(trash, t)
        return True

    def archived_newer(self, key: str, path: Path) -> Path | None:
        """The checkpoint this node's claim on ``key`` names in the archive when its step is above
        ``path``'s and it is what the claimed record signed: copied out into this node's state
        directory for the job's owner (:meth:`fetch`), else None. A guard's replica may be older
        than what reached the archive since (the job's final checkpoint, sent to a holder that
        archived it and died): a take-over from the replica would lose the work in between.
        Blocking (copies and hashes)."""
        try:
            v = self.view_or_none()
        except (OSError, MigrateError):
            return None
        if v is None:
            return None
        with v:
            s = v.read(key, f"claimed-{self.host.node_id}.json")
            if s is None:
                return None
            b = s.owner
            try:
                if int(str(b["ckpt"]).removeprefix("ckpt-")) <= int(path.name.removeprefix("ckpt-")):
                    return None
                return self.fetch(v, key, b)
            except Refused as e:
                self._payload_refused(key, b, e)
            except (OSError, ValueError) as e:
                log.info("migrate: archived %s/%s could not be fetched: %s", key, b["ckpt"], e)
        return None

    def _payload_refused(self, key: str, b: dict[str, Any], e: Refused) -> None:
        """Counts a checkpoint that does not match its verified record; one that is not what its
        record signed is not claimed again (until its record changes)."""
        known = e.reason in ("bad_ckpt", "manifest_mismatch")
        self.refusals.note(f"{key}/{b['ckpt']}", e, ("payload", key, b["nonce"]) if known else None)

    def _claim_and_read(self, key: str, live: bool, dead_runner: int | None) -> tuple[dict[str, Any], Path] | None:
        """Takes the archive's claim on ``key`` (:meth:`_claim_in`), reads the claimed record
        (verified) and fetches its checkpoint for the job's owner (:meth:`fetch`): (the job's
        record body, the local checkpoint), or None when another node holds the claim. Raises
        OSError (the claim given back): the checkpoint is not what the record signed (counted),
        does not fit, or the storage failed. Blocking file I/O (on the lane)."""
        v = self.view_or_none()
        if v is None:
            return None
        with v:
            if not self._claim_in(v, key, live=live, dead_runner=dead_runner):
                return None
            try:
                s = v.read(key, f"claimed-{self.host.node_id}.json")
                if s is None:
                    raise OSError(f"archive: {key}: the claimed record is gone or does not verify")
                b = s.owner
                try:
                    path = self.fetch(v, key, b)
                except Refused as e:
                    self._payload_refused(key, b, e)
                    raise OSError(f"archive: {key}: {e}") from None
            except BaseException:
                self._unclaim_in(v, key, self._claimed_from.pop(key, None))
                raise
            return dict(b), path

    def claim_archived(self, key: str) -> tuple[bool, str | None, bool]:
        """A guard's take-over of ``key`` meets the archive (blocking, on the lane): (whether it
        is archived, who runs it when a node claimed and started it, whether this node took the
        claim, live records included: :meth:`claim`). Only verified records count: a file
        planted there stands no guard down."""
        v = self.view_or_none()
        if v is None:
            return False, None, False
        with v:
            if not self._archived_in(v, key):
                return False, None, False
            other = self.runner_in(v, key)
            if other is not None:
                return True, other, False
            return True, None, self._claim_in(v, key, live=True)

    def publish_unless_archived(self, key: str, ckpt: Path, record: dict[str, Any]) -> Path | None:
        """:meth:`publish` unless the archive holds a record of ``key`` already (blocking)."""
        return None if self.archived(key) else self.publish(key, ckpt, record)

    async def claim_and_resume(self, key: str, live: bool = False, dead_runner: int | None = None,
                            ask: tuple[int, str] | None = None) -> None:
        """Claims the archived job ``key`` (its guard record; ``live``: its live record too;
        ``dead_runner``: that node's running record) and resumes it here from the local copy of
        its checkpoint (:meth:`_claim_and_read`); given back when it cannot start here. ``ask``:
        (node, key) of the job that may still run there, asked first (:meth:`still_runs`)."""
        root = self.root()
        assert root is not None
        try:
            if self.host.guarding.runs_here(key) is not None:
                return
            if ask is not None and ask[0] != self.host.node_id and await self.still_runs(key, *ask):
                return
            got = await self.lane.call(f"claim of {key}", self._claim_and_read, key, live, dead_runner)
            if got is None:
                return
            rec, path = got
            done = False
            try:
                row = {"key": key, "src_node": int(rec["src_node"]), "src_job": str(rec["src_job"])}
                why = (f"node {rec['src_node']} and its buddy are gone; claimed its periodic checkpoint from the "
                       "archive" if rec["kind"] == "live" else "claimed from the archive")
                if dead_runner is not None:
                    why = f"node {dead_runner}, which ran it from the archive, is gone; claimed again from the archive"
                # (what its node signed of the request, nothing else: a placement named there would
                # drop this node's reservation of it, an LM_PLACEMENT_ID answer a hand-over with it)
                err = await self.host.guarding.resume_here(row, owner_request(rec["request"]), path, why)
                if err is None:
                    self.lane.submit(f"claim of {key} done", self.claim_done, key, f"node {self.host.node_id}",
                                      (self.host.node_id, self.host.guarding.runs_here(key) or ""))
                    done = True
                else:
                    n = self._tries.get(key, 0)
                    self._tries[key] = n + 1
                    self.next_try[key] = time.monotonic() + self.host.guarding.retry.delay(n)
            finally:
                if not done:  # given back in order on the lane (a hung archive waits for it; nothing waits here)
                    self.lane.submit(f"claim of {key} given back", self.unclaim, key)
        except (OSError, ValueError, KeyError, TypeError, MigrateError, jobkit.CheckpointError) as e:
            log.warning("migrate: archived job %s cannot be resumed here: %s", key, e)
            self.next_try[key] = time.monotonic() + float(self.host.s["retry_max_s"])
        finally:
            self.host.guarding.taking.discard(key)

    async def still_runs(self, key: str, node: int, job_key: str) -> bool:
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
            ans = await self.host._control(node, "needs", {"key": job_key}, timeout=float(self.host.s["dead_after_s"]) + 2.0)
        except Exception as e:  # gone: no answer (a refused connection, a timeout, an error)
            log.info("migrate: node %d did not answer whether %s lives there (before claiming %s): %s",
                     node, job_key, key, e)
            self.runs_told.pop(key, None)
            return False
        state = ans.get("state") if isinstance(ans, dict) and ans.get("key") == job_key else None
        if state not in SOURCE_LIVE_STATES and state not in ARCHIVE_ENDED_THERE:
            self.runs_told.pop(key, None)
            return False
        again = float(self.host.s["dead_after_s"]) if state in SOURCE_LIVE_STATES else ARCHIVE_CLAIM_STALE_S
        self.next_try[key] = time.monotonic() + again
        if self.runs_told.get(key) != job_key:
            self.runs_told[key] = job_key
            what = f"runs there ({state})" if state in SOURCE_LIVE_STATES else f"ended there ({state})"
            self.host._emit(f"{key}: node {node} counts as dead (its reclaim window ended, or it placed the job elsewhere) "
                       f"but answers that {job_key} {what}: not claimed from the archive here", persist=False,
                       key=key, node=node, job_key=job_key, state=state, phase="archive-runs-there")
        return True

    def status(self) -> dict[str, Any] | None:
        """The archive's part of the status (None without ``archive_dir``): ``stalled_s``, the
        seconds its work in hand has made no progress once that is ARCHIVE_STALL_SWEEPS x
        ``archive_gc_s`` or more (its storage does not answer; else None), ``busy`` (that work),
        ``queued`` (work waiting behind it), ``rounds`` (rounds done), ``auth`` (what its records
        are signed with: ``node`` with a node key, else ``zone``; None without zone keys),
        ``error`` (why ``archive_dir`` is not used: its owner or mode) and ``refused`` (the
        latest files refused, with why: counted in ``counts.archive_unverified_<reason>``)."""
        root = self.root()
        if root is None:
            return None
        quiet, what = self._stall(time.monotonic())
        auth = ArchiveAuth.of(getattr(self.host.agent, "zone", None))
        return {"dir": str(root), "stalled_s": None if quiet is None else round(quiet, 1), "busy": what,
                "queued": self.lane.queued, "rounds": self.rounds,
                "auth": None if auth is None else auth.mode, "error": self._root_error,
                "refused": list(self.refusals.samples)}
