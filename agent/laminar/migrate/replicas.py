"""Replicas held here: what goes, a keeper's check with its source, the operator's view and drop,
and a job's owner's view of a replica it resumes from: :class:`Replicas`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent` (its ``replicas``), built with the component
(what it uses of it: :class:`ReplicasHost`); the pure rules are in
:mod:`laminar.migrate.replica_policy`, tested without an agent.

**Replicas held here, and what goes.** Every checkpoint this node receives for another node's job
is committed as ``<root>/checkpoints/<key>/ckpt-<n>/`` (:class:`laminar.migrate.transfer.Receiver`).
When a checkpoint of a key commits here (verified), or a keeper names one held here, the key's
older ``ckpt-*`` go, except the one the key's ``migrate_replicas`` row names (the kept one)
and any a local job was or will be resumed from (its spec's ``resume_from`` points at it and it
has not ended, failed or was lost, or was requeued less than ``REPLICA_REQUEUE_HOLD_S`` ago).
When the key is released (control op ``release``), and every ``replica_gc_s`` (30 s) for each key whose row says the job
is done here (``released``, ``handed-over``, ``placed``, ``passed``, ``resumed``), every ``ckpt-*``
of the key goes but those a local job uses and those committed after the row last changed (for
``REPLICA_LATE_S``: a keeper naming them may still come), then the key's directory when it is
empty. The choice and a rename into ``<root>/replica-gc/`` run on the event loop, as the
endpoint's commits do (so no commit of the same key interleaves), the removal in a worker thread
(what a stopped agent left there goes at the next start); a key whose take-over runs is left for
later; links are removed as links, never followed; ``.tmp-*`` and ``incoming/`` (the endpoint's:
``Receiver.sweep``) and the archive (:meth:`Sweep.sweep`) are never touched.
Counted in the status as ``counts.replica_gc_ckpts``. A job of a user other than root resumes from
its owner's view of a replica (``<state_dir>/RESUME_DIR/<key>/ckpt-<n>/``, hard links;
:meth:`Replicas.resume_copy`), which counts as using the replica and goes once no local
job may need it and it is RESUME_KEEP_S old (:meth:`Replicas.resume_gc`).

A keeper whose ``release`` was lost (a source that crashed or restarted and forgot its keeper, a
partition) is checked with its source once its row has not changed for ``replica_keeper_check_s``
(control op ``needs``; :func:`keeper_needed` answers there): it ends (``released``, then as
above) only when the source says the job ended (exited, stopped, failed), moved (migrated), or
another node holds its keeper, and only if the row did not change while the question was on its
way. Everything else keeps it: the job runs and the asker is or may be its keeper, a prestage or
move is in flight, the source has no record of the job, no answer, a source that is silent or
dead (the take-over's), a ``waiting`` or take-over keeper (``counts.replica_keepers_ended``).
A keeper whose live source did not answer the last question (a one-way partition, an endpoint
that does not answer, an older agent) is *unconfirmed* (:func:`keeper_confirmation`; the
``migrate_keeper_checks`` table): kept, never removed for it, shown so by the operator's view
with how long since its source last spoke (its keeper message or an answer), and recorded once
as a ``keeper-unconfirmed`` event (``keeper-confirmed`` when it answers again; a new keeper
message confirms it too). A
key directory no row names (its keeper never came) goes once nothing in it changed for
``replica_orphan_s`` and no local job uses it. A done row whose directory is gone is deleted after
``replica_row_keep_s`` (``counts.replica_rows_pruned``).

**The operator's view, and drop.** ``GET /v1/migrate/replicas`` (``laminarctl replicas``) lists
every key held here or named by a row (``unclaimed``: a directory no keeper named): its state,
source node and job, owner, the checkpoints held (names, bytes), age since the last change,
the local jobs resumed from it, whether a transfer into it runs, and what the GC will do with it
and when, or why it keeps it (:func:`replica_gc_plan`, the same rule as above); ``?totals=1``
wraps the list as ``{"now", "replicas", "totals"}`` (keys, bytes held, the receive root's free
space). Every local user may list: a caller that is neither root, the control group nor the
job's owner sees states, sizes and the GC's plan but not which job it is
(:func:`~laminar.migrate.replica_policy.redact_replica`). ``POST /v1/migrate/replicas/{key}/drop`` ``{"force"?: bool}``
(privileged; ``laminarctl replicas drop KEY [--force]``) removes a key's replicas and rows
through the GC's safe path (:meth:`Replicas.drop`): refused while a transfer
into the key or its take-over runs, or a local job uses it, and for a ``keeping`` or
``waiting`` key without ``force``. A forced drop of such a key tells its source (control op
``dropped``, :meth:`Replicas.drop_and_tell`): the source forgets this node as the
job's keeper and prestages a running job's newest checkpoint to another peer at its next round
(the usual keeper choice without this node for ``REPLICA_DROP_AVOID_S``, unless no other peer can
take it; event phase ``keeper-dropped`` there). A source that cannot be reached is not told (the
drop stands; the answer's ``source_told`` is false, event phase ``replica-drop-untold``); a
stopped job held here, or a gone source's job, is then lost unless the archive holds it.
Counted as ``counts.replica_dropped``,
recorded as a ``migrate`` event (phase ``replica-dropped``, ``by`` the caller's uid).
A key whose checkpoint was committed and whose keeper has not come yet is ``unclaimed``, so a
drop without ``force`` removes it: the keeper that then comes names a checkpoint this node does
not hold, and is refused (:meth:`Control._check_kept_ckpt`; every keeper follows the
transfer of what it names): the source's prestage (or move) fails and it goes to another peer,
instead of counting on a keeper with nothing to resume the job from.

**The part.** :class:`Replicas` holds its own state: the replica lane and the last walk of the
replica root, the GC's schedule, the keepers being asked (``needs``), the sources heard, and whose
job each kept key is (:attr:`Replicas.owners`). The component's watch loop calls
:meth:`Replicas.recheck_keepers` before its keeper round and :meth:`Replicas.tick` (the GC round)
after it; its endpoint callbacks call :meth:`Replicas.gc` (a commit, a keeper, a release) and
:meth:`Replicas.forget_scan`, its control ops :meth:`Replicas.answer_needs` and
:meth:`Replicas.answer_superseded`, its API routes :meth:`Replicas.scan`, :meth:`Replicas.view`
and :meth:`Replicas.drop_and_tell`. The keeper and the archive resume through
:meth:`Replicas.resume_copy` and :meth:`Replicas.resume_install`; the fence stops a superseded copy
through :meth:`Replicas.stop_superseded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar.migrate import ledger
from laminar.migrate.constants import (
    _CKPT_NAME,
    _SAFE_KEY,
    REPLICA_LATE_S,
)
from laminar.migrate.errors import MigrateError, ReplicaRefused
from laminar.migrate.replica_policy import (
    REPLICA_DONE_STATES,
    REPLICA_KEEPER_STATES,
    _ckpt_step,
    keeper_confirmation,
    keeper_needed,
    replica_gc_plan,
    replica_victims,
)
from laminar.migrate.transfer import TransferError
from laminar.migrate.trees import Budget, _newest_mtime, _remove_tree
from laminar.offloop import Lane, LaneBusy
from laminar.policy import custody
from laminar.policy.endcause import RESUMED_BY_ITS_KEEPER, EndCause

if TYPE_CHECKING:
    from laminar.migrate.archive import Archive
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.takeover import Takeover
    from laminar.migrate.transfer import Receiver

log = logging.getLogger("laminar.migrate")

# Replicas this node holds for other nodes' jobs (``<root>/checkpoints/<key>/``) that are no longer
# needed are renamed into ``<root>/REPLICA_TRASH/`` on the event loop, then removed in a thread.
REPLICA_TRASH = "replica-gc"

# A source heard again after a silence this long (or first heard since this agent started) is asked
# at once about the keepers held here for it (:meth:`Replicas.recheck_keepers`).
KEEPER_RECHECK_GAP_S = 5.0

# A requeued job is placed again from its spec (resume_from included) for a while (zone/loan.py's
# requeue_for_s); a replica it names is kept as long after it was requeued.
REPLICA_REQUEUE_HOLD_S = 3600.0

# A job of a user other than root resumes from a replica here through ``<state_dir>/RESUME_DIR/<key>/
# ckpt-<n>/``: ``<key>/`` its owner's (0500; the state directory and RESUME_DIR are 0711), the
# checkpoint directory root's (0755) with hard links to the replica's files (root's, 0644), or
# copies of those only root may read. ``xfer/`` itself stays root's alone (0700).
RESUME_DIR = "resume"
# A resume copy no local job names goes once this old (the hand-over that made it may still be
# starting its job).
RESUME_KEEP_S = 600.0


# The replica root is walked off the event loop, one walk at a time (a lane of one thread), each
# of at most REPLICA_WALK_MAX entries (what a tree holds past it is not counted; a key not walked
# whole never looks old) and REPLICA_SCAN_TIMEOUT_S; GET /v1/migrate/replicas answers from a scan
# at most REPLICA_VIEW_MAX_AGE_S old (any number of requests: one walk).
REPLICA_WALK_MAX = 200_000
REPLICA_SCAN_TIMEOUT_S = 30.0
REPLICA_VIEW_MAX_AGE_S = 2.0
REPLICA_DROP_WALK_MAX = 10_000  # a drop's count of the bytes it removes, on the loop


def _tree_bytes(path: Path, budget: Budget | None = None) -> int:
    """The bytes of the regular files at and under ``path`` (apparent sizes), links not followed
    (a link counts as nothing); 0 when it cannot be read; what ``budget`` leaves (the walk stops
    when it is spent)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return 0
    total = 0
    for top, dirs, files in os.walk(path, followlinks=False):
        if budget is not None and not budget.take(1 + len(dirs) + len(files)):
            break
        for n in files:
            with contextlib.suppress(OSError):
                fst = os.lstat(os.path.join(top, n))
                if stat.S_ISREG(fst.st_mode):
                    total += fst.st_size
    return total


class ReplicasHost(Protocol):
    """What :class:`Replicas` uses of the component that holds it (ReclaimComponent and its parts)."""

    _superseding: set[str]
    agent: Any
    archive: Archive
    counts: dict[str, int]
    evacuating: set[str]
    takeover: Takeover
    prestage: Prestage
    reclaim: dict[str, Any] | None
    receiver: Receiver | None
    root: Path | None
    s: dict[str, Any]

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _last_seen(self, node: int) -> float: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Replicas:
    """The replicas held here: their GC, the keepers' checks with their sources, the operator's view and
    drop, and the resume copies of a job's owner (see the module's doc): a part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``replicas``). ``host``: the component."""

    def __init__(self, host: ReplicasHost) -> None:
        self.host = host
        # walks of the replica root: one at a time, bounded; the last one's answer
        self._replica_lane = Lane("replica-scan", workers=1, timeout_s=REPLICA_SCAN_TIMEOUT_S)
        self._replica_scan: tuple[float, dict[str, Any]] | None = None
        self._replica_scan_fut: asyncio.Future[dict[str, Any]] | None = None
        self._unclaimed_task: asyncio.Task[Any] | None = None
        self._replica_gc_next = 0.0  # when the held replicas are looked at next (monotonic)
        self._keeper_asked: dict[str, float] = {}  # key -> when its source was last asked (monotonic)
        self._keeper_checking: set[str] = set()  # keys whose source is being asked now
        self._src_heard: dict[int, float] = {}  # kept sources: when last heard, as of the last recheck round
        self.owners: dict[str, tuple[int, int]] = {}  # key -> (uid, gid) of its job's owner (keepers held here)

    def forget_scan(self) -> None:
        """The replica root changed (a commit here): the next view walks it again."""
        self._replica_scan = None

    # -- replicas held here: what goes (the module docs, *Replicas held here*) -------------------

    def _replica_users(self, d: Path) -> set[str]:
        """Names of the checkpoints in ``d`` (a key's directory here) a local job was or will be
        resumed from and may still need (:meth:`_replica_user_jobs`)."""
        return set(self._replica_user_jobs(d))

    def _replica_user_jobs(self, d: Path) -> dict[str, list[str]]:
        """The checkpoints in ``d`` (a key's directory here) a local job was or will be resumed
        from and may still need, each with those jobs' ids: the agent gave it ``d/<name>`` as its
        ``resume_from`` and it has not ended (queued, starting, running, suspended), it failed or was
        lost (this may be the only copy of its state: an operator's call, as in the archive), or
        it was requeued less than REPLICA_REQUEUE_HOLD_S ago (placed again from that spec)."""
        out: dict[str, list[str]] = {}
        resume = self.resume_root() / d.name
        for jid, rf in self._users_of_resume_from():
            p = Path(os.path.normpath(rf))
            if p.parent == d or p.parent == resume:  # the replica, or its owner's view of it (RESUME_DIR)
                out.setdefault(p.name, []).append(jid)
        return out

    def _users_of_resume_from(self) -> list[tuple[str, str]]:
        """(id, resume_from) of the local jobs the agent gave a ``resume_from`` (a move's, a
        take-over's: the job manager's record, laminar.runtime.provenance; never one a user set,
        which pinned any replica against its GC) that may still need it: not ended (queued,
        starting, running, suspended), failed or lost (it may be the only copy of their state: an
        operator's call), or requeued less than REPLICA_REQUEUE_HOLD_S ago (placed again from
        that spec). One indexed query: no job's spec is decoded (GET /v1/migrate/replicas asks
        once per key, and any user may ask)."""
        jobs = getattr(self.host.agent, "jobs", None)
        if jobs is None:
            return []
        return list(jobs.table.resume_users(("queued", "starting", "running", "suspended", "failed", "lost"),
                                            time.time() - REPLICA_REQUEUE_HOLD_S))

    def gc(self, key: str, newest: str | None = None, unclaimed: bool = False) -> list[str]:
        """Takes away the checkpoints of ``key`` this node no longer needs (the rule is in the
        module docs, *Replicas held here*) and returns their names. ``newest``: a checkpoint of the
        key just committed (or named by a new keeper) here; the older ones go, except the one the
        key's ``migrate_replicas`` row names and any a local job uses. None: only when the row
        says the key is done here (REPLICA_DONE_STATES), everything but what a local job uses and
        what was committed after the row last changed (REPLICA_LATE_S) goes, then the directory
        if it is empty. ``unclaimed``: the key has no row (no keeper names it) and the caller
        found nothing in it changed for ``replica_orphan_s``; everything but what a local job
        uses goes (a key that has a row by now is left as the row says).

        Runs on the event loop, as the transfer endpoint's commits do, so the choice and the
        renames into ``<root>/REPLICA_TRASH/`` are atomic with respect to a commit of the same
        key (a commit renames its ``.tmp-*`` into place); the removal of the renamed trees (many
        GB, possibly) runs in a worker thread. Never touched: ``.tmp-*`` and anything not named
        ``ckpt-<n>`` (transfer/receive.py's ``Receiver.sweep`` owns temporaries and ``incoming/``), a key
        whose take-over (or archive claim) runs now, a key directory that is a link. Links are
        removed as links, never followed."""
        if self.host.root is None or key in self.host.takeover.taking or not _SAFE_KEY.fullmatch(key):
            return []
        d = self.host.root / "checkpoints" / key
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                return []
            have = os.listdir(d)
        except OSError:
            return []
        row = self.host.agent.store.db.execute("SELECT ckpt, state, updated FROM migrate_replicas WHERE key=?",
                                          (key,)).fetchone()
        keep = self._replica_users(d)
        if newest is not None:
            try:
                if not stat.S_ISDIR(os.lstat(d / newest).st_mode):
                    return []  # not held here: the older ones may be all there is
            except OSError:
                return []
            keep.add(newest)
            if row is not None:
                keep.add(str(row["ckpt"]))
        elif row is None:
            if not unclaimed:
                return []
        else:
            if row["state"] not in REPLICA_DONE_STATES:
                return []
            now = time.time()
            for n in have:
                with contextlib.suppress(OSError):
                    m = os.lstat(d / n).st_mtime
                    if m > float(row["updated"]) and now - m < REPLICA_LATE_S:
                        keep.add(n)  # committed after the release: a keeper naming it may follow
        victims = replica_victims(have, newest=newest, keep=keep)
        if not victims:
            if newest is None:
                with contextlib.suppress(OSError):
                    os.rmdir(d)  # only when empty (a commit in progress keeps its .tmp-* in it)
            return []
        trash = self.host.root / REPLICA_TRASH
        try:
            trash.mkdir(exist_ok=True)
            if not stat.S_ISDIR(os.lstat(trash).st_mode):
                raise OSError(f"{trash} is not a directory")
        except OSError as e:
            log.warning("migrate: replica GC of %s: %s", key, e)
            return []
        moved, gone = [], []
        for n in victims:
            t = trash / f"{key}.{n}.{time.monotonic_ns()}"
            try:
                os.rename(d / n, t)
            except OSError as e:
                log.info("migrate: replica GC: %s/%s stays: %s", key, n, e)
                continue
            moved.append(t)
            gone.append(n)
        if newest is None:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        self._replica_scan = None  # the replica view walks again
        self.host.counts["replica_gc_ckpts"] = self.host.counts.get("replica_gc_ckpts", 0) + len(gone)
        log.info("migrate: replicas of %s removed: %s (kept: %s)", key, ", ".join(gone),
                 ", ".join(sorted(set(have) & keep)) or "none")
        self._remove_later(moved)
        return gone

    def _remove_later(self, paths: list[Path]) -> None:
        """Removes ``paths`` (in the replica trash) in a worker thread; inline without a loop."""
        if not paths:
            return

        def remove() -> None:
            for p in paths:
                _remove_tree(p)

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            remove()
            return
        self.host._spawn(asyncio.to_thread(remove))

    def empty_trash(self) -> None:
        """Removes what a stopped agent left in the replica trash (blocking: called in a thread)."""
        assert self.host.root is not None
        with contextlib.suppress(OSError):
            for n in os.listdir(self.host.root / REPLICA_TRASH):
                _remove_tree(self.host.root / REPLICA_TRASH / n)

    def tick(self, now: float, force: bool = False) -> None:
        """The GC round, every ``replica_gc_s`` (``force``: now): each held key whose row says it is done here
        (released, handed over, placed or passed elsewhere, resumed here) loses what no local
        job uses (:meth:`gc`); keepers unchanged for ``replica_keeper_check_s`` are checked
        with their source (:meth:`_stale_keeper_round`); key directories no row names, unchanged
        for ``replica_orphan_s``, go (:meth:`_unclaimed_pass`); done rows whose directory is gone
        are deleted after ``replica_row_keep_s`` (:meth:`prune_rows`); old resume copies go
        (:meth:`resume_gc`). ``now``: the wall clock the ages are measured against."""
        if self.host.root is None or (not force and time.monotonic() < self._replica_gc_next):
            return
        self._replica_gc_next = time.monotonic() + float(self.host.s["replica_gc_s"])
        try:
            self._stale_keeper_round(now)
        except Exception:
            log.exception("migrate: checking stale keepers")
        if self._unclaimed_task is None or self._unclaimed_task.done():  # (one pass at a time)
            try:
                self._unclaimed_task = self.host._spawn(self._unclaimed_pass(now))
            except RuntimeError:  # no running loop (a caller without one): no walk of the trees
                pass
        try:
            self.prune_rows(now)
        except Exception:
            log.exception("migrate: pruning replica rows")
        try:
            self.resume_gc(now)
        except Exception:
            log.exception("migrate: removing resume copies")
        rows = self.host.agent.store.db.execute(
            f"SELECT key FROM migrate_replicas WHERE state IN ({','.join('?' * len(REPLICA_DONE_STATES))})",
            REPLICA_DONE_STATES).fetchall()
        for r in rows:
            key = str(r["key"])
            if (self.host.root / "checkpoints" / key).is_dir():
                try:
                    self.gc(key)
                except Exception:
                    log.exception("migrate: replica GC of %s", key)

    def _unclaimed_candidates(self) -> list[tuple[str, int]]:
        """Key directories under ``<root>/checkpoints/`` with no ``migrate_replicas`` row (their
        keeper never came: a lost message, a source that crashed between the transfer and the
        keeper, a crash of this agent between the commit and the row) and no take-over using
        them, with their directory's mtime (ns). Links and names that are not a transfer's key
        are left. One listing and one lstat per key (on the loop: the store is read here)."""
        assert self.host.root is not None
        base = self.host.root / "checkpoints"
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        db = self.host.agent.store.db
        out = []
        for n in names:
            if not _SAFE_KEY.fullmatch(n) or n in self.host.takeover.taking:
                continue
            with contextlib.suppress(OSError):
                st = os.lstat(base / n)
                if not stat.S_ISDIR(st.st_mode):
                    continue
                if db.execute("SELECT 1 FROM migrate_replicas WHERE key=?", (n,)).fetchone() is not None:
                    continue
                out.append((n, st.st_mtime_ns))
        return out

    async def _unclaimed_pass(self, now: float) -> None:
        """The unclaimed keys (:meth:`_unclaimed_candidates`) whose newest entry
        (:func:`_newest_mtime`) is older than ``replica_orphan_s`` go (:meth:`gc`). The
        trees are walked in the replica lane (one thread, REPLICA_WALK_MAX entries in all,
        REPLICA_SCAN_TIMEOUT_S), never on the loop; a key whose directory changed since the walk
        began, or that a keeper named meanwhile, is left for the next round."""
        assert self.host.root is not None
        base = self.host.root / "checkpoints"
        cands = self._unclaimed_candidates()
        if not cands:
            return

        def walk(paths: list[Path]) -> list[float]:
            budget = Budget(REPLICA_WALK_MAX)
            return [_newest_mtime(p, budget) for p in paths]

        try:
            newest = await self._replica_lane.run("replicas", walk, [base / n for n, _ in cands])
        except (TimeoutError, LaneBusy) as e:
            log.info("migrate: replica GC: the walk of unclaimed keys did not finish: %s", e)
            return
        age = float(self.host.s["replica_orphan_s"])
        db = self.host.agent.store.db
        for (key, mtime_ns), m in zip(cands, newest, strict=True):
            if now - m < age or key in self.host.takeover.taking:
                continue
            try:
                if os.lstat(base / key).st_mtime_ns != mtime_ns:
                    continue  # a commit since the walk began
            except OSError:
                continue
            if db.execute("SELECT 1 FROM migrate_replicas WHERE key=?", (key,)).fetchone() is not None:
                continue
            try:
                if self.gc(key, unclaimed=True):
                    self.host._emit(f"{key}: replicas no keeper named for {self.host.s['replica_orphan_s']:g} s removed",
                               persist=False, key=key, phase="replica-unclaimed")
            except Exception:
                log.exception("migrate: replica GC of %s", key)

    def prune_rows(self, now: float | None = None) -> list[str]:
        """Deletes the rows (and retry rows) of keys done here (REPLICA_DONE_STATES) that last
        changed more than ``replica_row_keep_s`` before ``now`` and whose directory is gone, so
        the table holds the live replicas and recent history only. Returns the keys deleted."""
        if self.host.root is None:
            return []
        now = time.time() if now is None else now
        cutoff = now - float(self.host.s["replica_row_keep_s"])
        db = self.host.agent.store.db
        rows = db.execute(f"SELECT key FROM migrate_replicas WHERE updated < ? AND state IN "
                          f"({','.join('?' * len(REPLICA_DONE_STATES))})", (cutoff, *REPLICA_DONE_STATES)).fetchall()
        gone = []
        for r in rows:
            key = str(r["key"])
            if key in self.host.takeover.taking:
                continue
            try:
                os.lstat(self.host.root / "checkpoints" / key)
                continue  # still held (a local job uses it, or it is being removed)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            gone.append(key)
        if gone:
            with self.host.agent.store.tx() as tx:
                for key in gone:
                    ledger.move(tx, key, custody.Event.GC, counts=self.host.counts, if_older=cutoff)  # done states only
                    ledger.forget_retry(tx, key, unless_replica=True)
                    ledger.forget_keeper(tx, key, unless_replica=True)
            self.host.counts["replica_rows_pruned"] = self.host.counts.get("replica_rows_pruned", 0) + len(gone)
        return gone

    def _stale_keeper_round(self, now: float) -> None:
        """Each keeper held here (state ``keeping``, not a take-over) unchanged for
        ``replica_keeper_check_s`` whose source is a live zone member not declared dead is checked
        with the source (control op ``needs``, at most once per that interval per key;
        :meth:`check_keeper`). A keeper of a dead source is the take-over's; one whose source is
        silent or unreachable stays (it may be the job's only way back); one whose live source
        does not answer is unconfirmed (:meth:`_keeper_unanswered`) and stays too."""
        check = float(self.host.s["replica_keeper_check_s"])
        z = self.host.zone
        if check <= 0 or z is None:
            return
        rows = self.host.agent.store.db.execute(
            "SELECT key, src_node, request, updated FROM migrate_replicas WHERE state='keeping' AND updated < ?",
            (now - check,)).fetchall()
        mono = time.monotonic()
        self._keeper_asked = {k: t for k, t in self._keeper_asked.items() if mono < t + check}  # the rest may ask again
        for row in rows:
            key = str(row["key"])
            if key in self.host.takeover.taking or key in self._keeper_checking or mono < self._keeper_asked.get(key, -math.inf) + check:
                continue
            try:
                req = json.loads(row["request"])
            except ValueError:
                continue
            src = int(row["src_node"])
            if not isinstance(req, dict) or req.get("take_over") or src == self.host.node_id:
                continue
            if src not in z.membership.by_node or src in z.membership.suspects:
                continue
            if self.host.takeover.source_dead(src, time.time(), req.get("window_end"), float(row["updated"])) is not None:
                continue
            self._keeper_asked[key] = mono
            self._keeper_checking.add(key)
            self.host._spawn(self.check_keeper(key, src, float(row["updated"])))

    def recheck_keepers(self, now: float) -> None:
        """A source heard again after a silence of KEEPER_RECHECK_GAP_S or more, or heard for the
        first time since this agent started, may have stopped a job this node keeps while this
        node could not hear it: its reclaim window ended while this agent was down (so it never
        learned the window), or it rebooted faster than ``orphan_after_s`` and found the job
        gone (``lost``). Each keeper held here for it (``keeping``, not a take-over) is checked
        at once (:meth:`check_keeper`), which takes the job over when the source says it was
        stopped for good (``stopped_for_good`` in its answer). Before, such a keeper waited for the source's
        next silence (bench/chaos.py --no-archive, seed 44: 76 s, from an older replica) or,
        the source staying up, for ever."""
        z = self.host.zone
        if z is None:
            return
        rows = self.host.agent.store.db.execute(
            "SELECT key, src_node, request, updated FROM migrate_replicas WHERE state='keeping'").fetchall()
        srcs = {int(r["src_node"]) for r in rows}
        back = set()
        for src in srcs:
            seen, prev = self.host._last_seen(src), self._src_heard.get(src)
            self._src_heard[src] = seen
            if seen >= 0 and (prev is None or prev < 0 or seen - prev >= KEEPER_RECHECK_GAP_S):
                back.add(src)
        for src in set(self._src_heard) - srcs:
            del self._src_heard[src]
        mono = time.monotonic()
        for row in rows:
            key, src = str(row["key"]), int(row["src_node"])
            if src not in back or key in self.host.takeover.taking or key in self._keeper_checking or src == self.host.node_id:
                continue
            if src not in z.membership.by_node or src in z.membership.suspects:
                continue
            try:
                req = json.loads(row["request"])
            except ValueError:
                continue
            if not isinstance(req, dict) or req.get("take_over"):
                continue
            self._keeper_asked[key] = mono
            self._keeper_checking.add(key)
            self.host._spawn(self.check_keeper(key, src, float(row["updated"])))

    def _stopped_there(self, key: str, src: int, seen: float, state: str) -> bool:
        """``src`` says its job ``key`` was stopped for good there (``state``; ``stopped_for_good``)
        and still needs this keeper: the keeper becomes a take-over (as a keeper's: its request's
        ``take_over``), which the next keeper round resumes, if the row did not change since
        ``seen``. Returns whether it did."""
        db = self.host.agent.store.db
        row = db.execute("SELECT request FROM migrate_replicas WHERE key=? AND state='keeping' AND updated=?",
                         (key, seen)).fetchone()
        try:
            req = json.loads(row["request"]) if row is not None else None
        except ValueError:
            req = None
        if not isinstance(req, dict) or req.get("take_over"):
            return False
        req["take_over"] = True
        req["stopped_there"] = state
        with self.host.agent.store.tx() as tx:
            if not ledger.set_request(tx, key, req, only_from=(custody.State.KEEPING,), if_updated=seen):
                return False
        self.host._emit(f"{key}: node {src} says the job was {state} there without moving, and this node keeps it: "
                   "resuming it", key=key, src_node=src, src_state=state, phase="stopped-there")
        return True

    async def check_keeper(self, key: str, src: int, seen: float) -> bool:
        """Asks ``src`` whether the keeper of ``key`` held here is still needed
        (:func:`keeper_needed` there). Only a clear "no" from the source ends it: the row becomes
        ``released`` (as if the source's ``release`` had come, dated when the question was sent,
        so what the source shipped after it stays for REPLICA_LATE_S), and only if it did not
        change since ``seen`` (a new keeper of the key meanwhile wins); then the released key's
        replicas go (:meth:`gc`). No answer, an error, an older agent that does not know
        the op: the keeper stays. Returns whether it ended."""
        try:
            asked = time.time()
            try:
                ans = await self.host._control(src, "needs", {"key": key})
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                log.info("migrate: asking node %d whether the keeper of %s is needed: %s (kept)", src, key, e)
                self._keeper_unanswered(key, src, asked, str(e) or type(e).__name__)
                return False
            if not isinstance(ans, dict) or ans.get("key") != key or not isinstance(ans.get("needed"), bool):
                self._keeper_unanswered(key, src, asked, f"an answer that is not one: {str(ans)[:200]}")
                return False
            self._keeper_answered(key, src, asked)
            if ans["needed"]:
                if ans.get("stopped_for_good") is True and key not in self.host.takeover.taking:
                    self._stopped_there(key, src, seen, str(ans.get("state")))
                return False
            if key in self.host.takeover.taking:
                return False
            with self.host.agent.store.tx() as db:
                ended = ledger.move(db, key, custody.Event.NOT_NEEDED, counts=self.host.counts,
                                    only_from=(custody.State.KEEPING,), if_updated=seen, updated=asked) is not None
            if not ended:
                return False
            self.host.counts["replica_keepers_ended"] = self.host.counts.get("replica_keepers_ended", 0) + 1
            self.host._emit(f"{key}: node {src} no longer needs this keeper ({ans.get('why', '')}); its replicas go",
                       key=key, src_node=src, phase="keeper-ended")
            try:
                self.gc(key)
            except Exception:
                log.exception("migrate: replica GC of %s", key)
            return True
        finally:
            self._keeper_checking.discard(key)

    def _keeper_unanswered(self, key: str, src: int, asked: float, error: str) -> None:
        """The ``needs`` question about ``key`` asked at ``asked`` got no answer from ``src``: one
        more unanswered question (migrate_keeper_checks). The first of a row makes the keeper
        unconfirmed (:func:`keeper_confirmation`): recorded once as a ``migrate`` event, phase
        ``keeper-unconfirmed``. The keeper and its replicas stay."""
        db = self.host.agent.store.db
        prev = db.execute("SELECT answered, unanswered FROM migrate_keeper_checks WHERE key=?", (key,)).fetchone()
        with self.host.agent.store.tx() as tx:
            ledger.keeper_unanswered(tx, key, asked, error)
        if prev is not None and int(prev["unanswered"]) > 0:
            return
        row = db.execute("SELECT updated FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        heard = max((float(t) for t in (None if row is None else row["updated"],
                                        None if prev is None else prev["answered"]) if t is not None), default=None)
        since = "" if heard is None else f"; last heard from it {max(0.0, time.time() - heard):.0f} s ago"
        self.host.counts["replica_keepers_unconfirmed"] = self.host.counts.get("replica_keepers_unconfirmed", 0) + 1
        self.host._emit(f"{key}: node {src} did not answer whether it still needs this keeper ({error}){since}; kept, "
                   "shown as unconfirmed by `laminarctl replicas` until it answers", key=key, src_node=src,
                   phase="keeper-unconfirmed", error=error, heard_at=heard)

    def _keeper_answered(self, key: str, src: int, at: float) -> None:
        """``src`` answered the ``needs`` question about ``key`` asked at ``at``: the keeper is
        confirmed again (a ``keeper-confirmed`` event when it was unconfirmed)."""
        db = self.host.agent.store.db
        prev = db.execute("SELECT unanswered FROM migrate_keeper_checks WHERE key=?", (key,)).fetchone()
        with self.host.agent.store.tx() as tx:
            ledger.keeper_answered(tx, key, at)
        if prev is not None and int(prev["unanswered"]) > 0:
            self.host._emit(f"{key}: node {src} answers again about this keeper (after {int(prev['unanswered'])} "
                       "unanswered questions)", key=key, src_node=src, phase="keeper-confirmed")

    def asked_about(self, node: str, key: str, op: str) -> tuple[int, str | None]:
        """(the asking node's id, the id of this node's job ``key`` names, or None when ``key`` is
        not a job of this node) for control op ``op``. Raises ValueError for a node that is not an id."""
        try:
            asker = int(node)
        except ValueError:
            raise ValueError(f"{op}: the asking node {node!r} is not a node id") from None
        prefix = f"n{self.host.node_id}-"
        return asker, key[len(prefix):] if key.startswith(prefix) else None

    def answer_superseded(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        """Control op ``superseded``: ``node`` took this node's job ``key`` over (it took this node
        for gone: a silence of ``orphan_after_s``, or a reclaim window that ended while it was cut
        off) and runs it as ``job`` since ``at`` (its wall clock, moved into this one's by the
        message's ``clock``). Sent once this node is heard from again
        (:meth:`Takeover.tick`), or carried by the answer to a ``release``.

        When this node's copy still runs and started before ``at`` (a partition, not a
        departure), it is stopped here, state ``migrated``, so the job runs once
        (:meth:`stop_superseded`); its other keeper, if any, is released. The asker's word is
        taken only from the job's keeper (its keeper, or an old keeper still owed a release); from
        another node the job stops only once the archive names it the runner of its claim of
        ``key`` (read on the archive's lane; answered ``checks``), and never without an archive.
        A job that started after ``at`` is another job under the same key (a node whose state was
        wiped numbers its jobs again) and is left alone.

        Answers ``{"key", "stopped": job id or None, "why"}``; for a copy that no longer runs
        here, also its ``state`` and ``exit_code`` (one that finished by itself makes the
        keeper's copy a rerun: the keeper stops it). Raises ValueError for a malformed body or a
        sender that speaks for another node."""
        key = str(body["key"])
        asker, jid = self.asked_about(node, key, "superseded")
        try:
            claimed, their, at = int(body["node"]), str(body["job"]), float(body["at"])
            shift = 0.0 if body.get("clock") is None else time.time() - float(body["clock"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"superseded: a body of key, node, job, at (seconds since the epoch) and clock "
                             f"is needed, not {body!r}") from None
        if not math.isfinite(at + shift):
            raise ValueError(f"superseded: at {at!r} is not a time")
        # a node speaks for itself, or the job's keeper (its keeper, or an old keeper still owed a
        # release) for the node it placed the job on when it had no room (replica state ``placed``)
        keeper = jid is not None and (self.host.prestage.keeper.get(jid) == asker or (asker, key) in self.host.prestage.releases)
        if claimed != asker and not keeper:
            raise ValueError(f"superseded: node {asker} cannot speak for node {claimed!r} (it does not keep {key})")
        at += shift
        jobs = getattr(self.host.agent, "jobs", None)
        job = jobs.get(jid) if jobs is not None and jid is not None else None
        if job is None or not job.active:
            # ``state``/``exit_code``: a copy that finished here by itself (exit 0) makes the keeper's a rerun
            return {"key": key, "stopped": None, "why": f"no copy of {key} runs on node {self.host.node_id}",
                    "state": None if job is None else str(job.state),
                    "exit_code": None if job is None else job.exit_code}
        if job.id in self.host._superseding:
            return {"key": key, "stopped": job.id, "why": f"{job.id} is being stopped"}
        if job.started is None or float(job.started) >= at:
            return {"key": key, "stopped": None, "why": f"{job.id} started after node {asker} took {key} over: "
                    "another job under the same key"}
        if job.id in self.host.evacuating:
            return {"key": key, "stopped": None, "why": f"{job.id} is being moved"}
        # the asker's word alone stops nothing: it keeps the job here (its keeper, or the old keeper
        # still owed a release), or the archive names it the runner of its claim (read on the lane)
        vouched = keeper
        if not vouched and self.host.archive.root() is None:
            return {"key": key, "stopped": None, "why": f"node {asker} neither keeps {key} nor claimed it from "
                    "an archive: nothing here says it runs it"}
        self.host._superseding.add(job.id)
        self.host._spawn(self.stop_superseded(job, claimed, their, key, vouched))
        if not vouched:
            return {"key": key, "stopped": None, "checks": job.id,
                    "why": f"{job.id} is stopped once the archive names node {asker} its runner"}
        return {"key": key, "stopped": job.id, "why": f"{job.id} stopped: node {claimed} runs it as {their}"}

    async def stop_superseded(self, job: Any, node: int, their: str, key: str, vouched: bool = True) -> None:
        """Stops ``job`` here (state ``migrated``: it runs on ``node`` as ``their``), with an event
        (phase ``superseded``); its keeper, when another node, is released. Not ``vouched`` (the
        asker is not its keeper): only when the archive names ``node`` the runner of its claim of
        ``key``. Never raises."""
        try:
            if not vouched:
                runner = await self.host.archive.lane.call(f"who runs {key}", self.host.archive.runner, key)
                if runner != str(node):
                    log.warning("migrate: node %d says it runs %s as %s, but it does not keep it and the archive "
                                "names %s its runner: %s runs on", node, key, their, runner, job.id)
                    return
            if not job.active:
                return
            self.host._emit(f"{job.id}: node {node} took it over as {their} while it heard nothing from this node "
                       "(a partition taken for a departure); both copies ran since: stopped here so that it runs once",
                       job=job.id, node=node, their_job=their, key=key, phase="superseded")
            # its keeper no longer keeps it: released, unless that keeper took this very key over (its
            # keeper row is its copy's now). ``key`` may be another's: a fenced copy this node resumed
            # stops for the claim of the key it came from (fence.py); its keeper keeps its own key
            own = f"n{self.host.node_id}-{job.id}"
            # a prestage of it in flight stands down: a keeper it sends after this would name a job
            # no longer run here, and nobody would release it (its node takes the job over when
            # this node next falls silent: a second copy beside the one that superseded this;
            # bench/chaos.py --no-archive, seed 43). One past its send withdraws that keeper
            self.host.prestage.supersede(job.id)
            keeper = self.host.prestage.forget_keeper(job.id)
            if keeper is not None and (keeper != node or key != own):
                self.host._spawn(self.host.prestage.release(keeper, own))
            await self.host.agent.jobs.stop(job.id, f"node {node} runs it as {their}: it took the job over while it heard "
                                       f"nothing from node {self.host.node_id} (a partition); stopped here so that it runs "
                                       "once", grace_s=0, state="migrated", cause=EndCause.SUPERSEDED)
        except Exception as e:  # gone meanwhile: nothing runs twice
            log.warning("migrate: stopping %s, which node %d runs as %s: %s", job.id, node, their, e)
        finally:
            self.host._superseding.discard(job.id)

    def answer_needs(self, node: str, key: str) -> dict[str, Any]:
        """This node's answer to ``node`` holding a keeper of ``key`` (control op ``needs``):
        ``{"key", "needed", "why", "state", "reclaim"}`` by :func:`keeper_needed` (``state``: the job's, None: no record;
        ``reclaim``: this node has a reclaim now). A key of another node, or a job
        this node has no record of, is needed (this node cannot tell)."""
        asker, jid = self.asked_about(node, key, "needs")
        if jid is None:
            return {"key": key, "needed": True, "why": f"{key} is not a job of node {self.host.node_id}"}
        jobs = getattr(self.host.agent, "jobs", None)
        job = jobs.get(jid) if jobs is not None else None
        if job is None and jobs is not None and hasattr(getattr(jobs, "table", None), "pruned") and jobs.table.pruned(jid):
            # ended long ago: its record was pruned (jobs.keep_ended_s / keep_ended); "no
            # record" alone would say needed, and the keeper would keep the replica for good and
            # resume a finished job when this node leaves
            return {"key": key, "needed": False, "state": "pruned",
                    "why": f"job {jid} ended on node {self.host.node_id} (its record was pruned)"}
        state = None if job is None else str(job.state)
        again = self.host.takeover.runs_here(key)
        if again is not None:
            # This node runs the job again itself (a job of its that it resumed from the archive
            # or a replica once it was given back): the job has a new key and its own keepers now,
            # and a keeper of the old key resuming it would run it twice (bench/chaos.py: a keeper
            # that found room resumed a job its source had claimed back from the archive).
            again_job = jobs.get(again) if jobs is not None else None
            return {"key": key, "needed": False, "state": None if again_job is None else str(again_job.state),
                    "runs_as": again, "why": f"node {self.host.node_id} runs {key} again, as {again}",
                    "reclaim": getattr(self.host, "reclaim", None) is not None}
        needed, why = keeper_needed(state, self.host.prestage.keeper.get(jid), asker,
                                   jid in self.host.evacuating or jid in self.host.prestage.prestaging)
        # ``reclaim``: whether this node has a reclaim now (a keeper that may have missed its
        # withdrawal learns from a false one that the window it holds no longer ends anything);
        # ``stopped_for_good``: the job stopped here without moving and its keeper is to resume it
        # (its window ended first; it was lost with its cgroup, a reboot), not one that may have
        # ended by itself while the agent was down, nor one Airlock killed), said only to the
        # node this one knows for its keeper (two keepers, an old one owed a release, never both).
        # Read from the job's end cause (it was read from its reason's words before);
        # ``end_cause`` goes with the answer, for the asker's events (it decides on
        # ``stopped_for_good``, as before: an older agent's answer has no cause).
        cause = getattr(job, "end_cause", None)
        stopped = needed and self.host.prestage.keeper.get(str(jid)) == asker and cause in RESUMED_BY_ITS_KEEPER
        return {"key": key, "needed": needed, "why": why, "state": state, "stopped_for_good": stopped,
                "end_cause": None if cause is None else str(cause),
                "reclaim": getattr(self.host, "reclaim", None) is not None}  # (getattr: a caller's stand-in may lack it)

    # -- replicas held here: the operator's view and drop (GET /v1/migrate/replicas) -------------

    def receiving(self, key: str) -> bool:
        """Whether the transfer endpoint receives (or commits) a checkpoint of ``key`` now."""
        return self.host.receiver is not None and self.host.receiver.receiving(key)

    async def scan(self, max_age_s: float = REPLICA_VIEW_MAX_AGE_S) -> dict[str, Any]:
        """:meth:`_scan_replicas`'s answer at most ``max_age_s`` old: taken in the replica lane
        (one thread, one walk at a time, REPLICA_SCAN_TIMEOUT_S) and shared by every caller in
        the meantime; a walk that does not finish answers the last one (``stale``) or an empty
        one (``error``). Each GET /v1/migrate/replicas (any local user) walked the whole replica
        root in a thread of the default executor before, with no limit on either."""
        got = self._replica_scan
        if got is not None and time.monotonic() - got[0] < max_age_s:
            return got[1]
        if self._replica_scan_fut is None or self._replica_scan_fut.done():
            self._replica_scan_fut = asyncio.ensure_future(self._replica_scan_once())
        return await asyncio.shield(self._replica_scan_fut)

    async def _replica_scan_once(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            scan = await self._replica_lane.run("replicas", self._scan_replicas)
        except (TimeoutError, LaneBusy) as e:
            if self._replica_scan is not None:
                return {**self._replica_scan[1], "stale": f"the last walk, {time.monotonic() - self._replica_scan[0]:.0f} s "
                        f"old: {e}"}
            return {"keys": {}, "incoming": {}, "free_bytes": None, "fs_bytes": None, "trash_bytes": 0,
                    "truncated": False, "error": str(e)}
        self._replica_scan = (t0, scan)
        return scan

    def _scan_replicas(self) -> dict[str, Any]:
        """What is under the receive root now (blocking: the replica lane runs it): per key
        directory under ``checkpoints/`` its ``ckpt-<n>`` (bytes, modification time), its other
        entries (a commit's ``.tmp-*``), all its bytes and its newest change; the partial
        transfers under ``incoming/``; the filesystem's free space; the replica trash's bytes.
        Links are reported as links, never followed. At most REPLICA_WALK_MAX entries are looked
        at in all (``truncated``: the sizes are then lower bounds, and the keys not walked whole
        never look old)."""
        assert self.host.root is not None
        budget = Budget(REPLICA_WALK_MAX)
        base = self.host.root / "checkpoints"
        keys: dict[str, dict[str, Any]] = {}
        try:
            names = sorted(os.listdir(base))
        except OSError:
            names = []
        for n in names:
            p = base / n
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                keys[n] = {"link": stat.S_ISLNK(st.st_mode), "ckpts": {}, "other": [], "bytes": 0,
                           "newest": st.st_mtime}
                continue
            ckpts: dict[str, tuple[int, float]] = {}
            other: list[str] = []
            total = 0
            try:
                entries = sorted(os.listdir(p))
            except OSError:
                entries = []
            for e in entries:
                try:
                    est = os.lstat(p / e)
                except OSError:
                    continue
                size = _tree_bytes(p / e, budget)
                total += size
                if _CKPT_NAME.fullmatch(e) and stat.S_ISDIR(est.st_mode):
                    ckpts[e] = (size, est.st_mtime)
                else:
                    other.append(e)
            keys[n] = {"link": False, "ckpts": ckpts, "other": other, "bytes": total, "newest": _newest_mtime(p, budget)}
        incoming: dict[str, list[str]] = {}
        with contextlib.suppress(OSError):
            for n in sorted(os.listdir(self.host.root / "incoming")):
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.lstat(self.host.root / "incoming" / n).st_mode):
                        incoming[n] = sorted(os.listdir(self.host.root / "incoming" / n))
        free = fs = None
        with contextlib.suppress(OSError):
            sv = os.statvfs(base)
            free, fs = sv.f_bavail * sv.f_frsize, sv.f_blocks * sv.f_frsize
        return {"keys": keys, "incoming": incoming, "free_bytes": free, "fs_bytes": fs,
                "trash_bytes": _tree_bytes(self.host.root / REPLICA_TRASH, budget), "truncated": budget.left < 0}

    def view(self, scan: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        """Every key this node holds replicas of or has a ``migrate_replicas`` row for, with what
        the GC will do with it (:func:`replica_gc_plan`), and the totals; ``scan`` is
        :meth:`_scan_replicas`'s (taken in a thread). Runs on the event loop (the store, the jobs).

        Per key: ``key``, ``state`` (the row's, ``unclaimed`` without a row), ``src_node``,
        ``src_job``, ``owner_uid``, ``ckpt`` (the kept checkpoint), ``job_id`` (what it was
        resumed or placed as), ``updated``, ``attempts``/``next_at``/``last_error`` (a waiting
        keeper's), ``checkpoints`` ([{name, bytes, mtime}], newest first), ``bytes``,
        ``temporaries``, ``incoming`` (partial transfers), ``link``, ``age_s`` (since the last
        change of the row or the directory), ``used_by`` (local jobs resumed from it),
        ``receiving``, ``gc`` (``removes``/``keeps``), ``gc_at``, ``gc_removes``, ``gc_why``,
        ``row_gc_at``, ``droppable`` (what ``drop`` without ``force`` would say: None when it
        would drop), ``unconfirmed`` (a keeper whose live source did not answer the last ``needs``
        question: :func:`keeper_confirmation`), ``source_heard_at``/``source_silent_s`` (when the
        source last spoke about a ``keeping`` keeper: its keeper message or an answer),
        ``needs_unanswered`` (questions in a row without an answer) and ``needs_error`` (the
        last one's, while unconfirmed)."""
        assert self.host.root is not None
        now = time.time() if now is None else now
        db = self.host.agent.store.db
        rows = {str(r["key"]): r for r in db.execute(
            "SELECT r.key, r.src_node, r.src_job, r.request, r.ckpt, r.state, r.job_id, r.updated, t.attempts, "
            "t.next_at, t.last_error, g.answered, g.unanswered, g.last_error AS needs_error FROM migrate_replicas r "
            "LEFT JOIN migrate_retry t ON t.key = r.key LEFT JOIN migrate_keeper_checks g ON g.key = r.key").fetchall()}
        held: dict[str, dict[str, Any]] = scan["keys"]
        next_round = now + max(0.0, self._replica_gc_next - time.monotonic())
        out = []
        for key in sorted(set(rows) | set(held)):
            row, sc = rows.get(key), held.get(key)
            d = self.host.root / "checkpoints" / key
            users = self._replica_user_jobs(d) if sc is not None and not sc["link"] else {}
            try:
                req = json.loads(row["request"]) if row is not None else {}
            except ValueError:
                req = {}
            req = req if isinstance(req, dict) else {}
            if row is not None:
                src_node: int | None = int(row["src_node"])
                src_job: str | None = str(row["src_job"])
            else:  # no keeper came: what the key's name says (n<node>-<job>)
                m = re.fullmatch(r"n([0-9]{1,10})-(.+)", key)
                src_node, src_job = (int(m.group(1)), m.group(2)) if m else (None, None)
            ckpts = sc["ckpts"] if sc is not None else {}
            updated = float(row["updated"]) if row is not None else None
            newest = sc["newest"] if sc is not None and not math.isinf(sc["newest"]) else None
            state = str(row["state"]) if row is not None else None
            plan = replica_gc_plan(
                state=state, held={n: t for n, (_, t) in ckpts.items()}, in_use=set(users), now=now, updated=updated,
                newest_mtime=newest, taking=key in self.host.takeover.taking, take_over=bool(req.get("take_over")),
                src_node=src_node, next_round=next_round,
                next_look=float(row["next_at"]) if row is not None and row["next_at"] is not None else None,
                orphan_s=float(self.host.s["replica_orphan_s"]), keeper_check_s=float(self.host.s["replica_keeper_check_s"]),
                row_keep_s=float(self.host.s["replica_row_keep_s"]))
            conf = keeper_confirmation(
                state=state, take_over=bool(req.get("take_over")), updated=updated,
                answered=None if row is None or row["answered"] is None else float(row["answered"]),
                unanswered=0 if row is None or row["unanswered"] is None else int(row["unanswered"]), now=now)
            why = plan["why"]
            if conf["unconfirmed"] and row is not None:
                n = int(row["unanswered"])
                why = (f"UNCONFIRMED: node {src_node} has not answered whether the job still needs this keeper "
                       f"({n} question{'' if n == 1 else 's'} in a row; last: {row['needs_error']}); last heard from it "
                       f"{conf['silent_s']:.0f} s ago; kept (it may be the job's only copy). " + why)
            changed = max(t for t in (updated, newest, -math.inf) if t is not None)
            item: dict[str, Any] = {
                "key": key, "state": state or "unclaimed", "src_node": src_node, "src_job": src_job,
                "owner_uid": req.get("owner_uid"), "ckpt": str(row["ckpt"]) if row is not None else None,
                "job_id": row["job_id"] if row is not None else None, "updated": updated,
                "attempts": row["attempts"] if row is not None else None,
                "next_at": row["next_at"] if row is not None else None,
                "last_error": row["last_error"] if row is not None else None,
                "checkpoints": [{"name": n, "bytes": b, "mtime": t}
                                for n, (b, t) in sorted(ckpts.items(), key=lambda kv: _ckpt_step(kv[0]), reverse=True)],
                "bytes": sc["bytes"] if sc is not None else 0,
                "temporaries": sc["other"] if sc is not None else [], "incoming": scan["incoming"].get(key, []),
                "link": bool(sc and sc["link"]), "held": sc is not None,
                "age_s": None if math.isinf(changed) else max(0.0, now - changed),
                "used_by": sorted({j for js in users.values() for j in js}), "receiving": self.receiving(key),
                "gc": "removes" if plan["removes"] else "keeps", "gc_at": plan["at"], "gc_removes": plan["removes"],
                "gc_why": why, "row_gc_at": plan["row_at"], "unconfirmed": conf["unconfirmed"],
                "source_heard_at": conf["heard_at"], "source_silent_s": conf["silent_s"],
                "needs_unanswered": int(row["unanswered"] or 0) if row is not None and conf["heard_at"] is not None
                else None,
                "needs_error": (row["needs_error"] or None) if row is not None and conf["unconfirmed"] else None}
            item["droppable"] = self._drop_refusal(key, state, src_node, src_job, users, force=False)
            out.append(item)
        out.sort(key=lambda r: (r["updated"] if r["updated"] is not None else math.inf, r["key"]))
        totals = {"keys": len(out), "bytes_held": sum(int(r["bytes"]) for r in out),
                  "checkpoints": sum(len(r["checkpoints"]) for r in out),
                  "root": str(self.host.root / "checkpoints"), "free_bytes": scan["free_bytes"], "fs_bytes": scan["fs_bytes"],
                  "free_for_offers": None, "trash_bytes": scan["trash_bytes"],
                  "by_state": {s: sum(1 for r in out if r["state"] == s) for s in sorted({r["state"] for r in out})},
                  "unconfirmed": sum(1 for r in out if r["unconfirmed"]),
                  # the walk of the replica root: cut at REPLICA_WALK_MAX entries, an older one, or none
                  "scan_truncated": bool(scan.get("truncated")), "scan_stale": scan.get("stale"),
                  "scan_error": scan.get("error")}
        if self.host.receiver is not None:
            with contextlib.suppress(OSError):
                totals["free_for_offers"] = self.host.receiver.free_for_offers()
        return {"now": now, "replicas": out, "totals": totals}

    def _drop_refusal(self, key: str, state: str | None, src_node: int | None, src_job: str | None,
                      users: dict[str, list[str]], force: bool) -> str | None:
        """Why :meth:`drop` refuses ``key`` now (None: it would drop it)."""
        if key in self.host.takeover.taking:
            return f"{key}: a take-over (or archive claim) of it runs now; try again once it ended"
        if self.receiving(key):
            return f"{key}: a checkpoint transfer into it is in progress; try again once it ended"
        if users:
            jobs = sorted({j for js in users.values() for j in js})
            return (f"{key}: local job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)} resume{'' if len(jobs) > 1 else 's'}"
                    f" from {', '.join(sorted(users))}; never dropped while a local job uses it, --force or not "
                    "(a job that failed or was lost may need it to be restarted: that is an operator's call)")
        if state in REPLICA_KEEPER_STATES and not force:
            src = f"node {src_node}" if src_node is not None else "its source node"
            what = (f"this node holds the keeper of job {src_job or '?'} of {src}" if state == "keeping" else
                    f"its source {src} is gone and this node waits for room to resume job {src_job or '?'}")
            return (f"{key} is {state}: {what}; these replicas may be the job's only way back. Drop it anyway with "
                    f"--force ({src} is told, if it can be reached, and prestages a running job to another keeper; "
                    "a stopped job held here, or a gone source's job, is then lost unless the archive holds it)")
        return None

    def drop(self, key: str, force: bool = False, by: str = "") -> dict[str, Any]:
        """Removes the replicas of ``key`` held here and its ``migrate_replicas`` (and retry) row,
        as an operator asks (``POST /v1/migrate/replicas/{key}/drop``, ``laminarctl replicas drop``).

        The same safe path as the GC: on the event loop (so no commit of the key interleaves),
        the key's directory is renamed into ``<root>/REPLICA_TRASH/`` (a link is moved as a link,
        never followed) and removed in a worker thread; then the rows go. Refused, with nothing
        changed: a key that is not a transfer key (ValueError), one this node neither holds nor
        has a row for (LookupError), and (ReplicaRefused) one whose take-over runs, one a transfer
        is being received into, one a local job resumes from (``force`` or not), a ``keeping`` or
        ``waiting`` key without ``force``. This tells the source nothing: the API's drop is
        :meth:`drop_and_tell` (see docs/operations.md). ``.tmp-*`` of a commit cannot be there (no transfer runs); partial
        transfers under ``incoming/`` are the endpoint's (:meth:`Receiver.sweep`) and the archive
        is never touched. Returns ``{"key", "state", "dropped": [ckpt names], "bytes", "forced"}``."""
        if not isinstance(key, str) or not _SAFE_KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a replica key: expected letters, digits, '_', '.' or '-', starting "
                             "with a letter or digit, at most 128 characters (see `laminarctl replicas`)")
        if self.host.root is None:
            raise LookupError(f"no replicas of {key!r} on this node: it has no transfer endpoint")
        row = self.host.agent.store.db.execute("SELECT src_node, src_job, state FROM migrate_replicas WHERE key=?",
                                          (key,)).fetchone()
        d = self.host.root / "checkpoints" / key
        try:
            st: os.stat_result | None = os.lstat(d)
        except FileNotFoundError:
            st = None
        if row is None and st is None:
            raise LookupError(f"no replicas of {key!r} on this node (see `laminarctl replicas`)")
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        users = self._replica_user_jobs(d) if is_dir else {}
        state = str(row["state"]) if row is not None else None
        refusal = self._drop_refusal(key, state, None if row is None else int(row["src_node"]),
                                     None if row is None else str(row["src_job"]), users, force)
        if refusal is not None:
            raise ReplicaRefused(refusal)
        names: list[str] = []
        nbytes = 0
        moved: Path | None = None
        if st is not None:
            if is_dir:
                with contextlib.suppress(OSError):
                    names = sorted((n for n in os.listdir(d) if _CKPT_NAME.fullmatch(n)), key=_ckpt_step, reverse=True)
                nbytes = _tree_bytes(d, Budget(REPLICA_DROP_WALK_MAX))  # on the loop: bounded (a lower bound past it)
            trash = self.host.root / REPLICA_TRASH
            try:
                trash.mkdir(exist_ok=True)
                if not stat.S_ISDIR(os.lstat(trash).st_mode):
                    raise OSError(f"{trash} is not a directory")
                moved = trash / f"{key}.drop.{time.monotonic_ns()}"
                os.rename(d, moved)
                self._replica_scan = None  # the replica view walks again
            except OSError as e:
                raise MigrateError(f"{key}: cannot move {d} into {trash}: {e}; nothing was removed") from None
        with self.host.agent.store.tx() as db:
            ledger.move(db, key, custody.Event.DROP, counts=self.host.counts)  # its retry row goes too
            ledger.forget_keeper(db, key)
        self._keeper_asked.pop(key, None)
        self.host.counts["replica_dropped"] = self.host.counts.get("replica_dropped", 0) + 1
        forced = force and state in REPLICA_KEEPER_STATES
        self.host._emit(f"{key}: replicas dropped by {by or 'an operator'} (state {state or 'unclaimed'}"
                   f"{', forced' if forced else ''}): {', '.join(names) or 'no checkpoint'}, {nbytes} bytes",
                   key=key, phase="replica-dropped", state=state or "unclaimed", forced=forced, by=by)
        if moved is not None:
            self._remove_later([moved])
        return {"key": key, "state": state or "unclaimed", "dropped": names, "bytes": nbytes, "forced": forced,
                "src_node": None if row is None else int(row["src_node"])}

    async def drop_and_tell(self, key: str, force: bool = False, by: str = "",
                                    timeout: float = 5.0) -> dict[str, Any]:
        """:meth:`drop`, then, for a forced drop of a ``keeping`` or ``waiting`` key, tells
        its source (control op ``dropped``, ``{"key"}``) so that it forgets this node as the job's
        keeper and prestages elsewhere (:meth:`Prestage.answer_dropped` there). The drop stands whatever the
        source says or whether it can be reached. Adds ``source_told`` (True: the source answered;
        False: it was not told; None: nothing to tell) and ``source_says`` (its answer's ``why``, or
        why it was not told) to :meth:`drop`'s answer. Raises what drop raises."""
        res = self.drop(key, force=force, by=by)
        res["source_told"], res["source_says"] = None, ""
        src = res.get("src_node")
        if not res["forced"] or src is None:
            return res
        try:
            if src == self.host.node_id:
                raise MigrateError(f"node {src} is this node")
            ans = await self.host._control(int(src), "dropped", {"key": key}, timeout=timeout)
            if not isinstance(ans, dict) or ans.get("key") != key:
                raise MigrateError(f"node {src} answered {ans!r}")
        except (MigrateError, TransferError, OSError, TimeoutError) as e:
            res["source_told"], res["source_says"] = False, f"node {src} was not told: {e}"
            self.host._emit(f"{key}: the forced drop was not told to node {src} ({e}): it may still count on this node "
                       "as the job's keeper", key=key, src_node=src, phase="replica-drop-untold")
            return res
        res["source_told"], res["source_says"] = True, str(ans.get("why", ""))
        return res

    # -- a job's owner's view of a replica it resumes from (ReclaimComponent.check_resume) --------

    def note_owner(self, key: str, request: Any) -> None:
        """Records whose job ``key`` is from its keeper's request (a dict, or its JSON)."""
        try:
            req = json.loads(request) if isinstance(request, str) else request
            self.owners[key] = (int(req.get("owner_uid", 0) or 0), int(req.get("owner_gid", 0) or 0))
        except (ValueError, TypeError, AttributeError):
            pass

    def resume_root(self) -> Path:
        return Path(self.host.agent.config.state_dir) / RESUME_DIR

    def resume_copy(self, path: Path, uid: int, gid: int) -> Path:
        """The checkpoint a job of ``uid`` resumes from when ``path`` is a replica under
        ``xfer/`` (root's alone): ``<state_dir>/RESUME_DIR/<key>/<ckpt>/`` (RESUME_DIR's layout),
        made anew in a directory only root can reach, then renamed into place (hard links where
        the files are root's and readable, copies otherwise and across filesystems); links and
        anything but regular files in ``path`` are refused. ``path`` itself for root's jobs (a
        checkpoint claimed from the archive is already fetched into RESUME_DIR for its owner:
        :meth:`Claims.fetch`).
        Blocking (callers run it in a thread). Raises OSError."""
        if uid == 0:
            return path
        key, name = path.parent.name, path.name
        if not _SAFE_KEY.fullmatch(key) or not _CKPT_NAME.fullmatch(name):
            raise OSError(f"{path} is not a replica's checkpoint (<key>/ckpt-<n>)")
        base = self.resume_base()
        tmp = base / f".tmp-{key}-{name}-{time.monotonic_ns()}"
        os.mkdir(tmp, 0o700)
        try:
            for f in os.listdir(path):
                src = path / f
                fst = os.lstat(src)
                if not stat.S_ISREG(fst.st_mode):
                    raise OSError(f"{src} is not a regular file")
                linked = False
                if fst.st_uid == 0 and fst.st_mode & 0o004 and not fst.st_mode & 0o022:
                    try:  # root's, readable, not writable: shared
                        os.link(src, tmp / f, follow_symlinks=False)
                        linked = True
                    except OSError:  # another filesystem (the archive's): copied
                        pass
                if not linked:  # a file only root may read (or anyone may write), or elsewhere: the owner's copy
                    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    try:
                        with os.fdopen(os.dup(fd), "rb") as fin, open(tmp / f, "xb") as fout:
                            shutil.copyfileobj(fin, fout, 4 << 20)
                    finally:
                        os.close(fd)
                    os.chmod(tmp / f, 0o644)
        except BaseException:
            _remove_tree(tmp)
            raise
        return self.resume_install(tmp, key, name, uid, gid)

    def resume_base(self) -> Path:
        """RESUME_DIR, made when missing: a directory of root's (0711). Raises OSError."""
        base = self.resume_root()
        base.mkdir(exist_ok=True)
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise OSError(f"{base} is not a directory of root's")
        os.chmod(base, 0o711)
        return base

    def resume_install(self, tmp: Path, key: str, name: str, uid: int, gid: int) -> Path:
        """Puts the checkpoint made in ``tmp`` (a directory only root can reach, in RESUME_DIR, of
        files mode 0644) in place as ``RESUME_DIR/<key>/<name>`` for the job of ``uid``/``gid``
        (``<key>/`` theirs, 0500: they cannot swap it for a link); an older one of the name is
        replaced. ``tmp`` is removed on a failure. Raises OSError."""
        try:
            os.chmod(tmp, 0o755)
            kd = self.resume_root() / key
            with contextlib.suppress(FileExistsError):
                os.mkdir(kd, 0o500)
            kst = os.lstat(kd)
            if not stat.S_ISDIR(kst.st_mode):
                raise OSError(f"{kd} is not a directory")
            os.chown(kd, uid, gid, follow_symlinks=False)
            os.chmod(kd, 0o500)  # an entry of root's base: its owner cannot swap it for a link
            dfd = os.open(kd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                with contextlib.suppress(FileNotFoundError):
                    old = os.lstat(name, dir_fd=dfd)
                    _remove_tree(kd / name) if stat.S_ISDIR(old.st_mode) else os.unlink(name, dir_fd=dfd)
                os.rename(tmp, name, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        except BaseException:
            _remove_tree(tmp)
            raise
        return kd / name

    def resume_gc(self, now: float | None = None) -> list[Path]:
        """Removes the resume copies (RESUME_DIR) no local job names any more (the rule of
        :meth:`_replica_user_jobs`) once older than RESUME_KEEP_S, a crashed copy's ``.tmp-*`` as
        old, and emptied ``<key>/`` directories. Renamed into the replica trash, removed in a
        thread. Returns what went."""
        if self.host.root is None:
            return []
        now = time.time() if now is None else now
        base = self.resume_root()
        try:
            keys = os.listdir(base)
        except OSError:
            return []
        used = {(k, n) for k, names in self._resume_users().items() for n in names}
        gone: list[Path] = []
        trash = self.host.root / REPLICA_TRASH
        trash.mkdir(exist_ok=True)

        def old(p: Path) -> bool:
            try:
                return now - os.lstat(p).st_mtime >= RESUME_KEEP_S
            except OSError:
                return False

        for k in keys:
            kd = base / k
            try:
                is_dir = stat.S_ISDIR(os.lstat(kd).st_mode)
            except OSError:
                continue
            victims: list[Path] = []
            if k.startswith(".tmp-") or not is_dir:
                victims = [kd] if old(kd) else []
            else:
                try:
                    names = os.listdir(kd)
                except OSError:
                    continue
                victims = [kd / n for n in names if (k, n) not in used and old(kd / n)]
                if not names and old(kd):
                    with contextlib.suppress(OSError):
                        os.rmdir(kd)
            for v in victims:
                dest = trash / f"resume-{v.parent.name}-{v.name}.{time.monotonic_ns()}"
                try:
                    os.rename(v, dest)
                except OSError:
                    continue
                gone.append(dest)
        self._remove_later(gone)
        return gone

    def _resume_users(self) -> dict[str, set[str]]:
        """key -> the names under ``RESUME_DIR/<key>/`` a local job may still resume from."""
        out: dict[str, set[str]] = {}
        base = self.resume_root()
        for _jid, rf in self._users_of_resume_from():
            p = Path(os.path.normpath(rf))
            if p.parent.parent == base:
                out.setdefault(p.parent.name, set()).add(p.name)
        return out
