"""The archive, the keeper of last resort (``migrate.archive_dir``; a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: :class:`Archive`, its ``archive``; in long
form: docs/migration.md, *The archive, the keeper of last resort* and *What the archive keeps, and
what goes*): stopped jobs' checkpoints no live peer can keep, running jobs' periodic checkpoints,
claims, the sweep, and the one thread that touches the archive.

:class:`Archive` is the part: it holds the archive's round (:meth:`Archive.tick`, :meth:`Archive.run_round`:
a look at the archive on its lane, then what it found), its health and status, and the looks at
it every piece shares (its root, a verified view, who runs a key); the rest is in one module per
responsibility, each an object the part holds:

- :mod:`laminar.migrate.archive_stopped` (``stopped``, :class:`StoppedCopies`): the copy of a
  stopped job's checkpoint and its keeper record, the copies a reclaim waits for and those
  published late (after a restart too);
- :mod:`laminar.migrate.archive_periodic` (``periodic``, :class:`PeriodicCopies`): running jobs'
  periodic checkpoints and their live records;
- :mod:`laminar.migrate.archive_claims` (``claims``, :class:`Claims`): claims of the copies of a
  dead node's jobs, their fetch into this node and the resume;
- :mod:`laminar.migrate.archive_gc` (``gc``, :class:`Sweep`): what the archive keeps and what goes;
- :mod:`laminar.migrate.archive_lane`: the one thread that touches the archive, and a wait for it
  with a deadline;
- :mod:`laminar.migrate.archive_view`, :mod:`laminar.migrate.archive_auth`,
  :mod:`laminar.migrate.archive_fs`: a verified look at the archive, its signatures, its file work.

**The archive, the keeper of last resort** (``archive_dir``: storage outside the pool that all
the zone's agents mount, as the shared storage Slurm jobs checkpoint to). Every other copy of a
job (its keeper's replicas, a keeper's) is on a node of the zone; when the whole pool is gone
they all are. With ``archive_dir`` set, a stopped job's checkpoint and keeper record
(``<archive>/<key>/ckpt-N/``, ``guard.json``) are written there, atomically, when no live peer
can hold them (a reclaim with no keeper; a reclaimed keeper with no peer to pass to) and by a
keeper as soon as it finds no room. The record's claim is the lock: a node renames ``guard.json``
to ``claimed-<node>.json`` before it starts or places the job (one node wins; then it notes the
claim there, signed), writes its ``running-<node>.json`` once the job started, or puts what it
took back when it found no room. Every agent with room tries the
unclaimed records (any agent, not only the keeper: the keeper may be gone); a keeper whose job
another node claimed and runs stands down. A claim older than ``ARCHIVE_CLAIM_STALE_S`` whose
node never ran the job is taken over (by the job's keeper, or by any agent with room that sees it
in the archive). So is the running record of a node that ran the job and is dead
(``orphan_after_s`` or its reclaim window, as for any take-over) before anything newer of the
job reached the archive (its new key holds no record): the checkpoint the job resumed from is
then its newest safe state (:meth:`Claims.dead_runs`).

**Who may write the archive** (:mod:`laminar.migrate.archive_auth`, :mod:`laminar.migrate.archive_fs`,
:mod:`laminar.migrate.archive_view`). Shared storage is not trusted. Every record is signed
(a zone MAC under a key derived from the zone key; with node keys, a node MAC for each roster
node), every field an agent acts on is in what is signed, and a job's records are its own
node's (a keeper publishes the keeper record the job's node signed for it when it handed the
keeper over). A claim is noted, signed, with what it took and when (its staleness); a running
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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar.migrate import archive_fs
from laminar.migrate.archive_auth import ArchiveAuth
from laminar.migrate.archive_claims import Claims
from laminar.migrate.archive_gc import Sweep
from laminar.migrate.archive_lane import ArchiveLane
from laminar.migrate.archive_periodic import PeriodicCopies
from laminar.migrate.archive_stopped import StoppedCopies
from laminar.migrate.archive_view import ARCHIVE_SCAN_MAX, LIVE_RECORD, Refusals, View
from laminar.migrate.constants import _SAFE_KEY
from laminar.migrate.errors import MigrateError

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.checkpoints import Checkpoints
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.migrate.evidence import Evidence
    from laminar.migrate.keepers import Keepers
    from laminar.migrate.mover import Mover
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.replicas import Replicas
    from laminar.migrate.takeover import Takeover

log = logging.getLogger("laminar.migrate")

# The archive counts as stalled (status ``archive.stalled_s``, one event) when the look at it in
# hand has made no progress (no byte read, no CPU time) for this many ``archive_gc_s`` (30 s by
# default): a round on healthy shared storage takes well under one; an NFS server's failover
# takes up to a minute or two, and it is only reported, never acted on.
ARCHIVE_STALL_SWEEPS = 3


class ArchiveHost(Protocol):
    """What :class:`Archive` uses of the component that holds it (ReclaimComponent and its parts)."""

    agent: MigrateAgent
    checkpoints: Checkpoints
    ckpt: CkptDriver | None
    counts: dict[str, int]
    evacuating: set[str]
    takeover: Takeover
    keepers: Keepers
    moves: dict[str, Any]
    mover: Mover
    evidence: Evidence
    notices: dict[int, tuple[float, float]]
    prestage: Prestage
    reclaim: dict[str, Any] | None
    replicas: Replicas
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _last_seen(self, node: int) -> float: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Archive:
    """The archive (see the module's doc): stopped jobs' checkpoints and keeper records, running
    jobs' periodic ones, claims, the sweep, the archive's health and status. A part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``archive``). ``host``: the component."""

    def __init__(self, host: ArchiveHost) -> None:
        self.host = host
        self.lane = ArchiveLane()  # every touch of archive_dir, off the loop, one at a time
        self.round_running = False  # an archive round is in flight (one at a time)
        self.rounds = 0  # archive rounds done
        self._stalled: float | None = None  # when the archive was found stalled (monotonic)
        self._error: str | None = None  # the last round's storage error, said once
        # files of the archive refused (counted once each by reason, the latest for the status)
        self.refusals = Refusals(host.counts)
        self._root_error: str | None = None  # why archive_dir is not used (its owner, its mode)
        # the root listings a round, a sweep and a .done expiry go on through (scan_page)
        self._archive_scan: tuple[str, int, Any] | None = None
        self._gc_scan: tuple[str, int, Any] | None = None
        self._done_scan: tuple[str, int, Any] | None = None
        # its pieces, one per responsibility (the module's doc)
        self.stopped = StoppedCopies(self)
        self.periodic = PeriodicCopies(self)
        self.claims = Claims(self)
        self.gc = Sweep(self)

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
        auth = ArchiveAuth.of(self.host.agent.zone)
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
        verified marker of its claimed job that ended or was superseded (:data:`laminar.migrate.archive_gc.ARCHIVE_DONE`).
        A file that does not verify says nothing (a stray ``x.json`` once stood a keeper down)."""
        v = self.view_or_none()
        if v is None:
            return False
        with v:
            return self.archived_in(v, key)

    @staticmethod
    def archived_in(v: View, key: str) -> bool:
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
        :meth:`PeriodicCopies.periodic_due`), and any archived job no node runs tried here
        (:meth:`Claims.claim_and_resume`): unclaimed keeper records, live records of jobs whose node and
        keeper are gone, stale claims, claims whose runner died (:meth:`Claims.dead_runs`); then the
        sweep (:meth:`Sweep.start_sweep`). Claims and the sweep wait while this node is being
        reclaimed, and stay off once it is (its window ended and the reclaim was not withdrawn): a
        job it claimed would sit queued on a node its owner took back, while its claim told every
        other node (the job's keeper too) that a node runs it."""
        try:
            root = self.root()
            if root is None:
                return
            reclaiming = self.host.reclaim is not None  # under reclaim, or reclaimed (withdrawn: None again)
            ended, periodic = await self.periodic.round_jobs(root, reclaiming)
            wall, mono = time.time(), time.monotonic()
            z = self.host.zone
            alive = {self.host.node_id} | {n for n in (list(z.membership.by_node) if z is not None else [])
                                           if self.host.takeover.source_dead(int(n), wall) is None}
            skip = set(self.host.takeover.taking) | {k for k, t in self.claims.next_try.items() if mono < t}
            look = await self.lane.call("archive round", self.look, root, list(ended), periodic,
                                        not reclaiming, frozenset(alive), frozenset(skip), wall)
            self.rounds += 1
            self._error = None
            self.periodic.found(look, ended)
            if not look["claims"] or self.host.reclaim is not None:
                return
            self.claims.start_claims(look, time.time())
            self.gc.start_sweep()
        except (OSError, ValueError, MigrateError) as e:  # the storage (gone, refusing; the root's owner or mode;
            # no zone keys): the next round looks again
            if str(e) != self._error:  # said once while it lasts, not every poll_s
                log.warning("migrate: archive round: %s", e)
            self._error = str(e)
        except Exception:
            log.exception("migrate: archive round failed")
        finally:
            self.round_running = False

    def look(self, root: Path, ended: list[str],
             periodic: list[tuple[str, str, str | None, tuple[Path | None] | None]], claims: bool,
             alive: frozenset[int], skip: frozenset[str], wall: float) -> dict[str, Any]:
        """The archive round's file work (on the lane; never on the loop): the periodic copies'
        share (:meth:`PeriodicCopies.look_in`: the live records of the ``ended`` jobs dropped, the
        newest checkpoint of each running job in ``periodic`` found: (job id, its checkpoint
        directory, its ``resume_from``, (the newest verified one) while the checkpoint driver's
        check of the job's listing holds, else None); with the driver's answer nothing is read
        here: the copy is checked as it is made), and, with ``claims`` and the archive a
        directory, the claims' (:meth:`Claims.look_in`: what may be claimed among the next
        ARCHIVE_SCAN_MAX entries of its root, by nodes not in ``alive``; keys in ``skip``, taken
        or waiting, are not read). Returns ``{"dropped", "drop_again", "ckpts", "claims",
        "keepers", "lives", "stale", "runs"}``."""
        out: dict[str, Any] = {"dropped": [], "ckpts": {}, "claims": False, "keepers": [], "lives": [], "stale": [],
                               "runs": [], "drop_again": []}
        try:  # (only what needs the archive's records opens it: a round with neither reads nothing of it)
            v: View | None = self.view(root, create=False) if ended or claims else None
        except FileNotFoundError:
            v = None
        try:
            self.periodic.look_in(v, ended, periodic, wall, out)
            if not claims or v is None:
                return out
            out["claims"] = True
            self.claims.look_in(v, alive, skip, wall, out)
            return out
        finally:
            if v is not None:
                v.close()

    def scan_keys(self, v: View, which: str = "_archive_scan") -> list[str]:
        """The names among the next ARCHIVE_SCAN_MAX entries of the archive's root that may be
        key directories (:meth:`scan_page`; ``which``: the round's pass or the sweep's). A link
        there is counted, never followed."""
        out: list[str] = []
        for e in self.scan_page(which, str(v.root), v.rootfd):
            if e.name.startswith(".") or not _SAFE_KEY.match(e.name):
                continue
            with contextlib.suppress(OSError):
                if e.is_symlink():
                    v.dir(e.name)  # counted (``link``), never followed
                elif e.is_dir(follow_symlinks=False):
                    out.append(e.name)
        return out

    def scan_page(self, which: str, path: str, dirfd: int) -> list[os.DirEntry[str]]:
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

    def placed_as(self, key: str) -> tuple[int, str] | None:
        """(node, job id) where this node placed the kept job ``key`` (the replica's job_id,
        ``node N/job-M``), or None."""
        row = self.host.agent.store.db.execute("SELECT job_id FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        try:
            node, job = str(row["job_id"]).removeprefix("node ").split("/", 1)
            return int(node), job
        except (TypeError, ValueError, IndexError):
            return None

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
        auth = ArchiveAuth.of(self.host.agent.zone)
        return {"dir": str(root), "stalled_s": None if quiet is None else round(quiet, 1), "busy": what,
                "queued": self.lane.queued, "rounds": self.rounds,
                "auth": None if auth is None else auth.mode, "error": self._root_error,
                "refused": list(self.refusals.samples)}
