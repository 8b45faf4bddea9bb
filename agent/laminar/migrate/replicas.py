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
:meth:`ResumeCopies.copy`), which counts as using the replica and goes once no local
job may need it and it is RESUME_KEEP_S old (:meth:`ResumeCopies.gc`).

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
through the GC's safe path (:meth:`ReplicaOperator.drop`): refused while a transfer
into the key or its take-over runs, or a local job uses it, and for a ``keeping`` or
``waiting`` key without ``force``. A forced drop of such a key tells its source (control op
``dropped``, :meth:`ReplicaOperator.drop_and_tell`): the source forgets this node as the
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
:meth:`ReplicaOperator.forget_scan`, its control ops :meth:`Replicas.answer_needs` and
:meth:`Replicas.answer_superseded`, its API routes :meth:`ReplicaOperator.scan`, :meth:`ReplicaOperator.view`
and :meth:`ReplicaOperator.drop_and_tell`. The keeper and the archive resume through
:meth:`ResumeCopies.copy` and :meth:`Replicas.resume_install`; the fence stops a superseded copy
through :meth:`Replicas.stop_superseded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar.components import jobs_of
from laminar.migrate import ledger
from laminar.migrate.constants import (
    _SAFE_KEY,
    REPLICA_LATE_S,
    REPLICA_SCAN_TIMEOUT_S,
    REPLICA_TRASH,
    REPLICA_WALK_MAX,
)
from laminar.migrate.errors import MigrateError
from laminar.migrate.replica_operator import ReplicaOperator
from laminar.migrate.replica_policy import (
    REPLICA_DONE_STATES,
    keeper_needed,
    replica_victims,
)
from laminar.migrate.replica_resume import ResumeCopies
from laminar.migrate.transfer import TransferError
from laminar.migrate.trees import Budget, _newest_mtime, _remove_tree
from laminar.offloop import Lane, LaneBusy
from laminar.policy import custody
from laminar.policy.endcause import RESUMED_BY_ITS_KEEPER, EndCause

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.takeover import Takeover
    from laminar.migrate.transfer import Receiver

log = logging.getLogger("laminar.migrate")

# A source heard again after a silence this long (or first heard since this agent started) is asked
# at once about the keepers held here for it (:meth:`Replicas.recheck_keepers`).
KEEPER_RECHECK_GAP_S = 5.0

# A requeued job is placed again from its spec (resume_from included) for a while (zone/loan.py's
# requeue_for_s); a replica it names is kept as long after it was requeued.
REPLICA_REQUEUE_HOLD_S = 3600.0


class ReplicasHost(Protocol):
    """What :class:`Replicas` uses of the component that holds it (ReclaimComponent and its parts)."""

    _superseding: set[str]
    agent: MigrateAgent
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
    """The replicas held here: their GC, the keepers' checks with their sources, and the source's
    answers; its pieces the operator's view and drop (``operator``: replica_operator.py) and the
    resume copies of a job's owner (``resumes``: replica_resume.py) (see the module's doc): a part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``replicas``). ``host``: the component."""

    def __init__(self, host: ReplicasHost) -> None:
        self.host = host
        self._unclaimed_task: asyncio.Task[Any] | None = None
        self.gc_next = 0.0  # when the held replicas are looked at next (monotonic)
        self.keeper_asked: dict[str, float] = {}  # key -> when its source was last asked (monotonic)
        self._keeper_checking: set[str] = set()  # keys whose source is being asked now
        self._src_heard: dict[int, float] = {}  # kept sources: when last heard, as of the last recheck round
        # walks of the replica root (the GC's, the operator's view): one at a time, bounded
        self.lane = Lane("replica-scan", workers=1, timeout_s=REPLICA_SCAN_TIMEOUT_S)
        self.operator = ReplicaOperator(self)  # the operator's view and drop (replica_operator.py)
        self.resumes = ResumeCopies(self)  # a job's owner's copies it resumes from (replica_resume.py)

    # -- replicas held here: what goes (the module docs, *Replicas held here*) -------------------

    def _replica_users(self, d: Path) -> set[str]:
        """Names of the checkpoints in ``d`` (a key's directory here) a local job was or will be
        resumed from and may still need (:meth:`user_jobs`)."""
        return set(self.user_jobs(d))

    def user_jobs(self, d: Path) -> dict[str, list[str]]:
        """The checkpoints in ``d`` (a key's directory here) a local job was or will be resumed
        from and may still need, each with those jobs' ids: the agent gave it ``d/<name>`` as its
        ``resume_from`` and it has not ended (queued, starting, running, suspended), it failed or was
        lost (this may be the only copy of its state: an operator's call, as in the archive), or
        it was requeued less than REPLICA_REQUEUE_HOLD_S ago (placed again from that spec)."""
        out: dict[str, list[str]] = {}
        resume = self.resumes.root() / d.name
        for jid, rf in self.users_of_resume_from():
            p = Path(os.path.normpath(rf))
            if p.parent == d or p.parent == resume:  # the replica, or its owner's view of it (RESUME_DIR)
                out.setdefault(p.name, []).append(jid)
        return out

    def users_of_resume_from(self) -> list[tuple[str, str]]:
        """(id, resume_from) of the local jobs the agent gave a ``resume_from`` (a move's, a
        take-over's: the job manager's record, laminar.runtime.provenance; never one a user set,
        which pinned any replica against its GC) that may still need it: not ended (queued,
        starting, running, suspended), failed or lost (it may be the only copy of their state: an
        operator's call), or requeued less than REPLICA_REQUEUE_HOLD_S ago (placed again from
        that spec). One indexed query: no job's spec is decoded (GET /v1/migrate/replicas asks
        once per key, and any user may ask)."""
        jobs = self.host.agent.jobs
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
        self.operator.forget_scan()  # the replica view walks again
        self.host.counts["replica_gc_ckpts"] = self.host.counts.get("replica_gc_ckpts", 0) + len(gone)
        log.info("migrate: replicas of %s removed: %s (kept: %s)", key, ", ".join(gone),
                 ", ".join(sorted(set(have) & keep)) or "none")
        self.remove_later(moved)
        return gone

    def remove_later(self, paths: list[Path]) -> None:
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
        (:meth:`ResumeCopies.gc`). ``now``: the wall clock the ages are measured against."""
        if self.host.root is None or (not force and time.monotonic() < self.gc_next):
            return
        self.gc_next = time.monotonic() + float(self.host.s["replica_gc_s"])
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
            self.resumes.gc(now)
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
            newest = await self.lane.run("replicas", walk, [base / n for n, _ in cands])
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
        self.keeper_asked = {k: t for k, t in self.keeper_asked.items() if mono < t + check}  # the rest may ask again
        for row in rows:
            key = str(row["key"])
            if key in self.host.takeover.taking or key in self._keeper_checking or mono < self.keeper_asked.get(key, -math.inf) + check:
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
            self.keeper_asked[key] = mono
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
            self.keeper_asked[key] = mono
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
        jobs = self.host.agent.jobs
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
            await jobs_of(self.host.agent).stop(job.id, f"node {node} runs it as {their}: it took the job over while it heard "
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
        jobs = self.host.agent.jobs
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
