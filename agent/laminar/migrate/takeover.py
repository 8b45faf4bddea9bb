"""A keeper of another node's job: its source's death, the take-over, the placement elsewhere and
the hand-over (:class:`Takeover`, a part of :class:`laminar.migrate.reclaim.ReclaimComponent`: its
``keeping``; in long form: docs/migration.md, *When the source dies* and *No room anywhere:
storage keepers and the retrying keeper*).

A node keeps a job of another node once the job's source handed it the keeper (control op
``keeper``, after the transfer of the checkpoint it names: :mod:`laminar.migrate.prestage` on the
source). It resumes the job when the source is dead (its reclaim window ended, or it fell silent
after a notice for ``dead_after_s`` and does not answer ``needs``, or, with ``orphan_after_s``
set, it fell silent without one) or stopped the job and handed it over with ``take_over`` (a
storage keeper, a keeper passed on).

**The retrying keeper.** A keeper whose source is dead (or stopped the job, ``take_over``)
resumes the job from its newest verified replica: here when this node has room, else on the
best-ranked peer with room (:func:`laminar.policy.destination.rank` over the peers' zone
summaries, then the zone's probe/offer/commit, the transfer, the keeper handed over, the
hand-over with ``resume_from``: the same choice and mechanism as a move), else it looks again
after ``retry_base_s``, doubling up to ``retry_max_s`` (:class:`laminar.policy.keeper.RetrySchedule`;
replica state ``waiting``, the next look in the ``migrate_retry`` table, so a restarted agent
goes on where it stopped). A ``waiting`` keeper whose source was declared dead by a silence and
is heard from again asks it first (control op ``needs``, whose answer carries the job's state
there): a job that lives there makes it ``keeping`` again (event phase ``keeping-again``),
never a second copy. A keeper that is itself reclaimed passes every job it holds for a
stopped source (``waiting``, or ``take_over``) on to the best keeper among its live peers
(state ``passed``; :meth:`Keepers.pass_keepers`, in reclaim.py).

**The part.** :class:`Takeover` is built with the component (what it uses of it: :class:`TakeoverHost`)
and holds the keeper's state: the keys whose take-over runs now (:attr:`Takeover.taking`, which the
component's pass of its keepers, the archive, the replicas and the settle read too), the
hand-overs waiting for an answer (:attr:`Takeover.asking`, which :class:`laminar.migrate.settle.Settle`
settles), the looks for room (:attr:`Takeover.retry`), and the take-overs' own bookkeeping. The
component's watch loop calls :meth:`Takeover.tick` each round (after
:meth:`laminar.migrate.replicas.Replicas.recheck_keepers`, before
:meth:`laminar.migrate.replicas.Replicas.tick`). The other parts and the component ask it
:meth:`Takeover.source_dead`, :meth:`Takeover.missed_news`, :meth:`Takeover.runs_here`, and hand jobs over
through :meth:`Takeover.handover`; the zone asks :meth:`Takeover.taken_over_as`. It is named
``keeping`` because the mover's ``send_keeper`` sends a keeper to a keeper (the other side).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from laminar.components import jobs_of
from laminar.migrate import ledger
from laminar.migrate.constants import DEFAULT_REMAINING_S, HOLD_MIN_S, MIGRATED_ENV, SOURCE_LIVE_STATES
from laminar.migrate.errors import HandoverSettled, MigrateError
from laminar.migrate.transfer import TransferError, latest_verified, send_checkpoint
from laminar.policy import custody
from laminar.policy import destination as dst
from laminar.policy.endcause import EndCause
from laminar.policy.keeper import RetrySchedule
from laminar.runtime.provenance import request_origin
from laminar.zone import authority as au

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.control import Control
    from laminar.migrate.fence import Fence
    from laminar.migrate.mover import Mover
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.replicas import Replicas
    from laminar.migrate.settle import Settle
    from laminar.migrate.vouch import Vouch
    from laminar.migrate.withdraw import Withdraw

log = logging.getLogger("laminar.migrate")

# A hand-over sent and not answered is asked again at most this far apart (it doubles from 0.2 s).
HANDOVER_ASK_MAX_S = 5.0

# A keeper that took over a job (``resumed``) tells its source, once heard from after the take-over,
# that it runs the job now (control op ``superseded``): for this long after the take-over, again
# every SUPERSEDED_RETRY_S while the source does not answer, SUPERSEDED_TRIES times at most.
SUPERSEDED_TELL_S = 86400.0
SUPERSEDED_RETRY_S = 5.0
SUPERSEDED_TRIES = 30


def _stored_request(row: Any) -> dict[str, Any] | None:
    """A keeper row's stored request (``migrate_replicas.request``), None when it is not a JSON object."""
    try:
        req = json.loads(row["request"])
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return req if isinstance(req, dict) else None


class TakeoverHost(Protocol):
    """What :class:`Takeover` uses of the component that holds it (ReclaimComponent and its parts)."""

    _started: float
    _xfer_local: str | None
    agent: MigrateAgent
    archive: Archive
    control: Control
    mover: Mover
    counts: dict[str, int]
    fence: Fence
    notices: dict[int, tuple[float, float]]
    prestage: Prestage
    reclaim: dict[str, Any] | None
    replicas: Replicas
    root: Path | None
    s: dict[str, Any]
    settle: Settle
    vouch: Vouch
    withdraw: Withdraw

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _last_seen(self, node: int) -> float: ...
    def _peer(self, node: int) -> tuple[str, int, bytes, int]: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Takeover:
    """A keeper's watch of its sources, its take-over of a dead source's job, and hand-overs (see
    the module's doc): a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its
    ``keeping``). ``host``: the component."""

    def __init__(self, host: TakeoverHost) -> None:
        self.host = host
        self.taking: set[str] = set()  # keys whose take-over runs now (the component passing a keeper on too)
        self.retry = RetrySchedule()  # the looks for room (from the config at the component's start)
        # keys whose take-over is starting its job here now (past its last look for a hand-over,
        # the job manager's start under way): the job's id once stored, None when refused
        self._starting: dict[str, asyncio.Future[str | None]] = {}
        # keys whose take-over here dropped the reservation of the placement that handed their
        # keeper here (fence_placement): this node's keeper has the job, that hand-over is answered so
        self._fenced: dict[str, int] = {}
        # keys taken over here whose source was (being) told that this node runs them (_superseded_round):
        # (when to tell it again, monotonic; tries)
        self._superseded_next: dict[str, tuple[float, int]] = {}
        self._cut_at_end: dict[int, float] = {}  # node -> the window's end this node heard nobody after
        self._alive_asked: dict[str, float] = {}  # key -> when a source silent in its window last said its job lives
        # key -> its row's ``updated`` when a source that may have withdrawn its reclaim (the keeper
        # may have missed its news) answered that its job lives there without saying whether it has
        # a reclaim (an older agent): not asked again while the zone hears from it (tick)
        self._reclaim_unknown: dict[str, float] = {}
        # job id (a placement's: its key) -> its confirmed hand-over waiting for its node's answer:
        # node, since (wall, the first unanswered try; None before), error, wake (an operator's settle)
        self.asking: dict[str, dict[str, Any]] = {}

    def _superseded_round(self, now: float) -> None:
        """A keeper that took a job over (state ``resumed``, within SUPERSEDED_TELL_S) and runs it
        here (:meth:`runs_here`) tells its source once the source is heard from after the
        take-over (:meth:`_tell_superseded`). The source was taken for gone after a silence
        (``orphan_after_s``; or a reclaim window that ended while it was cut off): when the
        silence was a partition, its copy of the job never stopped, and two copies run from the
        take-over on. Before, nothing reconciled them once the partition healed: both ran to
        their ends. A source that crashed and came back has no copy running and stops nothing."""
        rows = self.host.agent.store.db.execute(
            "SELECT key, src_node, state, updated FROM migrate_replicas WHERE state IN ('resumed', 'placed') "
            "AND updated > ?", (now - SUPERSEDED_TELL_S,)).fetchall()
        mono = time.monotonic()
        for row in rows:
            key, src, at = str(row["key"]), int(row["src_node"]), float(row["updated"])
            due, tries = self._superseded_next.get(key, (-math.inf, 0))
            if mono < due or tries >= SUPERSEDED_TRIES or src == self.host.node_id:
                continue
            if self.host._last_seen(src) <= at:
                continue  # not heard from since the take-over: still gone, or still cut off
            runs: str | None
            if row["state"] == "placed":  # taken over and placed on another node (no room here)
                placed = self.host.archive.placed_as(key)
                runner, runs = placed if placed is not None else (self.host.node_id, None)
            else:
                runner, runs = self.host.node_id, self.runs_here(key)
            if runs is None:
                continue
            self._superseded_next[key] = (math.inf, tries + 1)  # one at a time
            self.host._spawn(self._tell_superseded(key, src, runs, at, runner))

    async def _tell_superseded(self, key: str, src: int, runs: str, at: float, runner: int | None = None) -> None:
        """Tells ``src`` that this node took its job ``key`` over at ``at`` (this node's wall
        clock) and that ``runner`` (this node, or the node it placed the job on) runs it as
        ``runs`` (control op ``superseded``); the source stops its copy if one runs there that
        started before (:meth:`Replicas.answer_superseded`). Told once when answered; else
        again after SUPERSEDED_RETRY_S. Never raises."""
        tries = self._superseded_next.get(key, (math.inf, 1))[1]
        runner = self.host.node_id if runner is None else runner
        try:
            ans = await self.host._control(src, "superseded", {"key": key, "node": runner, "job": runs, "at": at})
        except (MigrateError, TransferError, OSError, TimeoutError) as e:
            self._superseded_next[key] = (time.monotonic() + SUPERSEDED_RETRY_S, tries)
            (log.warning if tries >= SUPERSEDED_TRIES else log.info)(
                "migrate: telling node %d that %s runs here as %s failed (try %d of %d): %s",
                src, key, runs, tries, SUPERSEDED_TRIES, e)
            return
        ans = ans if isinstance(ans, dict) and ans.get("key") == key else {}
        if ans.get("checks") and not ans.get("stopped") and tries < SUPERSEDED_TRIES:
            # the source stops its copy only once the archive names this node the runner of its
            # claim, and the archive may not say so yet (it read none while this node's claim was
            # being published, and its copy ran on: two copies for good): asked again
            self._superseded_next[key] = (time.monotonic() + SUPERSEDED_RETRY_S, tries)
            return
        self._superseded_next[key] = (math.inf, SUPERSEDED_TRIES)  # told
        stopped = ans.get("stopped")
        if ans.get("state") == "exited" and ans.get("exit_code") == 0 and runner == self.host.node_id:
            await self._stop_rerun(key, src, runs)
        elif stopped:
            self.host._emit(f"{key}: node {src} ran its copy on after this node took the job over (a partition "
                       f"taken for its departure); told that {runs} runs it on node {runner}, it stopped {stopped}: "
                       "the job runs once again", key=key, src_node=src, job=runs, stopped=str(stopped),
                       phase="superseded-there")

    async def _stop_rerun(self, key: str, src: int, runs: str) -> None:
        """The source finished ``key`` itself (exit 0): this node took it over while it could not
        hear the source (which finished it during the partition, or had finished it and could not
        release this keeper), so ``runs`` here is a rerun of a finished job. Stopped (state
        ``stopped``, event phase ``superseded-done-there``). Never raises."""
        job = jobs_of(self.host.agent).get(runs)
        if job is None or not job.active:
            return
        self.host._emit(f"{key}: node {src} finished it itself (exit 0) while this node, cut off from it, ran it again as "
                   f"{runs}: {runs} is stopped", key=key, src_node=src, job=runs, phase="superseded-done-there")
        try:
            await jobs_of(self.host.agent).stop(runs, f"node {src} finished {key} itself (exit 0) while this node, cut off "
                                       "from it, ran it again: a rerun of a finished job", grace_s=0, state="stopped",
                                       cause=EndCause.FINISHED_ELSEWHERE)
        except Exception as e:  # ended meanwhile
            log.warning("migrate: stopping %s, a rerun of %s that node %d finished: %s", runs, key, src, e)

    def source_dead(self, src: int, now: float, window_end: float | None = None,
                     since: float | None = None) -> str | None:
        """Why the source of a replica counts as dead, or None while it may be alive.
        ``window_end``: the end of the source's reclaim window as its keeper message said;
        ``since``: when that message came (this node's clock; :meth:`notice`)."""
        end = self._window_end(src, window_end, since)
        if end is not None and now >= end:
            # (with fencing: only once another member was heard after that end; this node may be
            # the one cut off, and have missed the reclaim's withdrawal or the job's move)
            if self.host.fence.unheard_since(src, end):
                heard = self.host.fence.heard_last(but=src)  # (not None: unheard_since found others)
                if now - max(heard if heard is not None else -1.0, self.host._started) >= float(self.host.s["dead_after_s"]):
                    # cut off, not merely between two summaries: once heard again, the keeper asks
                    # src first (missed_news)
                    self._cut_at_end[src] = end
                return None
            return f"node {src}'s reclaim window ended"
        if self.host.fence.isolated(now):
            return None  # this node hears nobody: it is the one cut off (fence_after_s, fence.py)
        # Silent since it was last heard, or since this agent started when not heard since: this
        # agent cannot vouch for a silence it was not there to hear. Before, a peer not heard
        # yet counted as silent forever, so a restarted agent took every peer for gone until its
        # first datagram came, and with ``orphan_after_s`` set its first keeper and archive rounds
        # resumed jobs that still ran there (found by bench/chaos.py).
        silent = now - max(self.host._last_seen(src), self.host._started)
        notice = self.notice(src, window_end, since)
        dead_after = float(self.host.s["dead_after_s"])
        if notice is not None and silent >= dead_after and now - notice[1] >= dead_after:
            # (with fencing: only while others were heard meanwhile; a node that hears nobody
            # either may be the one cut off, and this silence is shorter than fence_after_s)
            if self.host.fence.cannot_tell(src, now, dead_after) or self.host.vouch.heard_elsewhere(src, now, dead_after):
                return None  # (others heard it lately, or none answered: this node may be the one cut off)
            return f"node {src} went silent {silent:.1f} s after announcing its reclaim"
        orphan = float(self.host.s["orphan_after_s"])
        if orphan > 0 and silent >= orphan:
            if self.host.fence.cannot_tell(src, now, orphan) or self.host.vouch.heard_elsewhere(src, now):
                return None  # (another member heard it lately: a partial partition; vouch.py)
            return f"node {src} silent for {silent:.1f} s"
        return None

    async def tick(self, now: float) -> None:
        """Starts the take-over of each kept job that is due: its source is dead (or stopped
        the job and asked for it, ``take_over``), or it waits for room and its next look is due
        (``migrate_retry``, kept across restarts). Then tells the sources heard from again after
        a take-over that their job runs here now (:meth:`_superseded_round`)."""
        db = self.host.agent.store.db
        rows = db.execute("SELECT * FROM migrate_replicas WHERE state IN ('keeping', 'waiting')").fetchall()
        try:
            self._superseded_round(now)
        except Exception:  # a bug here must not stop the take-overs below
            log.exception("migrate: telling sources that their jobs run here")
        for row in rows:
            key = row["key"]
            if key in self.taking:
                continue
            if row["state"] == "waiting":
                r = db.execute("SELECT next_at, why FROM migrate_retry WHERE key=?", (key,)).fetchone()
                if r is not None and now < float(r["next_at"]):
                    continue
                why = str(r["why"]) if r is not None else "waiting for room"
                if self._source_back(row, now):  # ask it before reviving a job that may run there again
                    self.taking.add(key)
                    self.host._spawn(self.take_over_unless_back(row, why))
                    continue
            else:
                try:
                    req = json.loads(row["request"])
                except ValueError:
                    req = {}
                if now < float(req.get("not_before") or 0.0):
                    continue  # a keeper handed over with a job being handed over: not before that ends
                came = float(row["updated"])  # the keeper message's arrival (or this keeper's last change)
                why_d = self.source_dead(int(row["src_node"]), now, req.get("window_end"), came)
                if why_d is None and req.get("take_over"):
                    why_d = (f"node {row['src_node']} says the job was {req['stopped_there']} there without moving"
                             if req.get("stopped_there") else
                             f"node {row['src_node']} stopped the job and left its checkpoint here")
                if why_d is None:
                    continue
                if not req.get("take_over") and self._window_open(int(row["src_node"]), now, req.get("window_end"),
                                                                   came):
                    # Silent in the zone while its window is open: a source still evacuating (loaded,
                    # its summaries lost) would run the job twice with this take-over: ask it first.
                    if time.monotonic() - self._alive_asked.get(key, -math.inf) < float(self.host.s["dead_after_s"]):
                        continue
                    self.taking.add(key)
                    self.host._spawn(self.take_over_unless_alive(row, why_d))
                    continue
                if not req.get("take_over") and self.missed_news(row, req, now):
                    # its window ended, but this agent may have missed its withdrawal: ask first
                    if time.monotonic() - self._alive_asked.get(key, -math.inf) < float(self.host.s["dead_after_s"]):
                        continue
                    if self._reclaim_unknown.get(key) == float(row["updated"]) and \
                            now - self.host._last_seen(int(row["src_node"])) < float(self.host.s["dead_after_s"]):
                        continue  # an older source said its job lives there; asked again once it falls silent
                    self.taking.add(key)
                    self.host._spawn(self.take_over_unless_alive(row, why_d, missed=True))
                    continue
                why = why_d
            self.taking.add(key)
            self.host._spawn(self._take_over(row, why))

    def notice(self, src: int, window_end: float | None = None,
                since: float | None = None) -> tuple[float, float] | None:
        """``src``'s reclaim notice (window end, received; this node's wall clock) as it bears on
        a keeper whose message came at ``since`` (this node's clock) carrying ``window_end``: None
        when there is none, or when its window had ended before that message came and the message
        carried no window of its own. The source had no reclaim when it sent it: it came back
        after that window (its agent restarted after the window's end and cleared the reclaim:
        the owner gave the node back), and a job it keeps since is not dead with the old window
        (before, its keeper took such a job over at once and it ran twice). A source that is
        still reclaimed says its window in every keeper message it sends."""
        notice = self.host.notices.get(src)
        if notice is None or since is None or window_end is not None or notice[0] > since:
            return notice
        return None

    def _window_end(self, src: int, window_end: float | None, since: float | None = None) -> float | None:
        """The end (wall clock) of ``src``'s reclaim window: the earlier of ``window_end`` (what
        its keeper message said) and its zone notice's (:meth:`notice`, with ``since``); None
        when neither is known."""
        notice = self.notice(src, window_end, since)
        ends = [float(e) for e in (window_end, notice[0] if notice is not None else None) if e is not None]
        return min(ends) if ends else None

    def _window_open(self, src: int, now: float, window_end: float | None, since: float | None = None) -> bool:
        """Whether ``src``'s reclaim window (its keeper message's or its notice's) has not ended."""
        end = self._window_end(src, window_end, since)
        return end is not None and now < end

    def missed_news(self, row: Any, req: dict[str, Any], now: float) -> bool:
        """Whether the keeper ``row`` (its ``request`` ``req``), whose source's reclaim window
        ended, may have missed the source's news before that end (its withdrawal, control op
        ``reclaim-withdrawn``, sent again only until the window's end): this agent started after
        the keeper message that told it the window's end (it was down for part of the window; a
        window known only from the zone's notice was heard by this agent since it started), or it
        heard nothing from the source (zone membership) in the zone's ``peer_timeout_s`` (at least
        ``dead_after_s``) before the end; with fencing, unless it heard the source in the last
        ``dead_after_s`` before the end and heard others all along. A keeper up the whole window
        that heard from its source takes over at once (with fencing, once it heard another member
        after the end: :meth:`Fence.unheard_since`)."""
        src = int(row["src_node"])
        end = self._window_end(src, req.get("window_end"), float(row["updated"]))
        if end is None or now < end:
            return False
        if req.get("window_end") is not None and self.host._started > float(row["updated"]):
            return True
        if float(self.host.s.get("fence_after_s") or 0.0) > 0:
            # (with fencing) this node may have been cut off before the end (it hears another
            # member after it before taking over: :meth:`Fence.unheard_since`), so it asks first unless
            # it heard the source in the last ``dead_after_s`` before the end: it heard nobody at
            # the end (a keeper round saw it), or the source's last word came earlier, or the
            # source is heard after its end (its agent is there to answer). Asking costs a round
            # trip (or the question's timeout), a missed withdrawal or move a second copy
            # (bench/chaos.py, seed 29; the first heal heard another member before the source)
            seen = self.host._last_seen(src)
            return self._cut_at_end.get(src) == end or not end - float(self.host.s["dead_after_s"]) <= seen < end
        z = self.host.zone
        quiet = float(getattr(z, "s", {}).get("peer_timeout_s", 0.0) or 0.0) if z is not None else 0.0
        return self.host._last_seen(src) < end - max(quiet, float(self.host.s["dead_after_s"]))

    @contextlib.contextmanager
    def taking_over(self, key: str) -> Iterator[None]:
        """Around a take-over of ``key`` that asks its source first
        (:meth:`take_over_unless_alive`, :meth:`take_over_unless_back`): an exception in it is
        logged, never raised, and the key's take-over ends (``taking``) however it ends."""
        try:
            yield
        except Exception:
            log.exception("migrate: take-over of %s", key)
        finally:
            self.taking.discard(key)

    async def take_over_unless_alive(self, row: Any, why: str, missed: bool = False) -> None:
        """A source silent in the zone during its reclaim window is asked (control op ``needs``)
        before its job is taken over: one that answers that the job lives there keeps it (it is
        evacuating it: a take-over here would run it twice; asked again after ``dead_after_s``);
        no answer (gone, its agent dead) or any other answer goes on with the take-over. Never
        raises. ``missed``: the window ended and this agent may have missed the source's news
        (:meth:`missed_news`): a job that lives there on a node with no reclaim (``reclaim``
        false in the answer) means the reclaim was withdrawn: the source's window is forgotten
        (:meth:`Withdraw.withdrawn_notice`) and the keeper keeps on; an answer without ``reclaim`` (an
        older agent) keeps the keeper and the window, once, and :meth:`tick` asks again
        only once the zone stops hearing from the source (``dead_after_s``) or a new keeper
        message came; a clear "not needed" ends the keeper (as :meth:`Replicas.check_keeper`: its release
        may have been missed too)."""
        key, src = str(row["key"]), int(row["src_node"])
        with self.taking_over(key):
            try:
                ans = await self.host._control(src, "needs", {"key": key}, timeout=float(self.host.s["dead_after_s"]) + 2.0)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                log.info("migrate: node %d did not answer whether %s lives there (before its take-over: %s): %s",
                         src, key, why, e)
                ans = None
                if missed:
                    why = f"{why} (asked first, this agent may have missed its news: no answer, {e or type(e).__name__})"
            if missed and isinstance(ans, dict) and ans.get("key") == key and ans.get("needed") is False:
                with self.host.agent.store.tx() as db:
                    ended = ledger.move(db, key, custody.Event.NOT_NEEDED, counts=self.host.counts,
                                        only_from=(custody.State.KEEPING,), if_updated=row["updated"])
                if ended is not None:
                    self.host.counts["replica_keepers_ended"] = self.host.counts.get("replica_keepers_ended", 0) + 1
                    self.host._emit(f"{key}: node {src}'s reclaim window ended while this agent may have missed its news; "
                               f"it no longer needs this keeper ({ans.get('why', '')}); its replicas go", key=key,
                               src_node=src, phase="keeper-ended", src_state=ans.get("state"))
                    self.taking.discard(key)  # the GC leaves a key whose take-over runs
                    with contextlib.suppress(Exception):
                        self.host.replicas.gc(key)
                return
            if isinstance(ans, dict) and ans.get("key") == key and ans.get("state") in SOURCE_LIVE_STATES:
                withdrawn = missed and ans.get("reclaim") is False
                first = key not in self._alive_asked
                self._alive_asked[key] = time.monotonic()
                if withdrawn:
                    self.host.withdraw.withdrawn_notice(src)  # its window no longer ends anything here
                if missed and "reclaim" not in ans:
                    # an older agent (its answer has no ``reclaim``): whether it withdrew the reclaim
                    # is unknown, so its window is kept, but its job lives there: not taken over,
                    # and not asked again every dead_after_s while the zone hears from it (else
                    # forever: a question, a log line and an event each time); asked again once
                    # it falls silent (gone: no answer, the take-over) or sends a new keeper
                    told = self._reclaim_unknown.get(key) == float(row["updated"])
                    self._reclaim_unknown[key] = float(row["updated"])
                    if not told:
                        self.host._emit(f"{key}: node {src} answers after its reclaim window ended (this agent may have "
                                   "missed its news) that its job runs there, without saying whether it still has "
                                   "a reclaim (an older agent); keeping on, not taken over here, and not asked "
                                   f"again while the zone hears from node {src}", key=key, src_node=src,
                                   phase="source-alive", src_state=ans.get("state"), withdrawn=None)
                    return
                if first or withdrawn:
                    self.host._emit(f"{key}: node {src} " + (
                        "answers after its reclaim window ended (this agent may have missed its news): its job runs "
                        "there and it has no reclaim (withdrawn); keeping on, not taken over here" if withdrawn else
                        "is silent in the zone during its reclaim window but answers: its job lives there (being "
                        "moved); not taken over here"), key=key, src_node=src, phase="source-alive",
                        src_state=ans.get("state"), withdrawn=withdrawn)
                return
            await self.take_over_once(row, key, why)

    def _source_back(self, row: Any, now: float) -> bool:
        """Whether the source of a ``waiting`` keeper that was declared dead is heard from again: a
        zone member, not a suspect, heard from at least once by this agent, no longer dead by
        :meth:`source_dead` (a silence that ended; a reclaim window that ended stays dead). A
        keeper handed over with a stopped job (``take_over``) asks whenever its source is heard
        from after the keeper came: the job ran nowhere then, but its node, given back, may have
        resumed it itself since (from the archive), and only the source can say so (the archive's
        running record of it is gone once the resumed job's own copy is archived)."""
        req = _stored_request(row)
        if req is None:
            return False
        src = int(row["src_node"])
        z = self.host.zone
        if z is None or src == self.host.node_id or src not in z.membership.by_node or src in z.membership.suspects:
            return False
        if self.host._last_seen(src) < 0:
            return False  # never heard from since this agent started: no evidence it is back
        if req.get("take_over"):
            return self.host._last_seen(src) > float(row["updated"])
        return self.source_dead(src, now, req.get("window_end")) is None

    async def take_over_unless_back(self, row: Any, why: str) -> None:
        """A ``waiting`` keeper whose source is heard from again (:meth:`_source_back`; a silence
        taken for a death, a partition that healed) asks it (control op ``needs``) before the
        take-over's next look: a job that lives there (SOURCE_LIVE_STATES) makes the keeper
        ``keeping`` again (reviving it here or elsewhere would run it twice); a clear "not needed"
        releases it (as :meth:`Replicas.check_keeper`); anything else (no answer, an older agent that sends
        no state, a job lost or reclaimed there) goes on with the take-over. A ``take_over`` keeper
        (its source stopped the job) is released only when the source runs the job again itself
        (``runs_as`` in the answer); any other answer goes on with the take-over. Never raises."""
        key = str(row["key"])
        src = int(row["src_node"])
        with self.taking_over(key):
            try:
                ans = await self.host._control(src, "needs", {"key": key})
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                log.info("migrate: node %d is heard from again but did not answer about %s: %s", src, key, e)
                ans = None
            take_over = bool((_stored_request(row) or {}).get("take_over"))
            if take_over and not (isinstance(ans, dict) and ans.get("runs_as")):
                ans = None  # the job stopped there: only its source running it again ends this keeper
            if isinstance(ans, dict) and ans.get("key") == key:
                state = ans.get("state")
                if ans.get("needed") is False or state in SOURCE_LIVE_STATES:
                    new = "released" if ans.get("needed") is False else "keeping"
                    event = custody.Event.NOT_NEEDED if new == "released" else custody.Event.SOURCE_ALIVE
                    with self.host.agent.store.tx() as db:  # (its retry row goes with it: the table's FORGET_RETRY)
                        moved = ledger.move(db, key, event, counts=self.host.counts, only_from=(custody.State.WAITING,),
                                            if_updated=row["updated"])
                    if moved is not None:
                        self.host._emit(f"{key}: node {src} is back ({ans.get('why', '')}); "
                                   + ("its job lives there: keeping it again, not resumed here" if new == "keeping"
                                      else "it no longer needs this keeper; its replicas go"),
                                   key=key, src_node=src, phase="keeping-again" if new == "keeping" else "keeper-ended",
                                   src_state=state)
                        if new == "released":
                            self.taking.discard(key)  # the GC leaves a key whose take-over runs
                            try:
                                self.host.replicas.gc(key)
                            except Exception:
                                log.exception("migrate: replica GC of %s", key)
                    return
            await self.take_over_once(row, key, why)

    # -- authority: who handed the keeper, and what its job may run as here (laminar.zone.authority)

    def keeper_sender(self, key: str, src: int) -> int:
        """The node that handed this node the keeper of ``key`` (``migrate_keeper_from``; else its
        source ``src``: an older agent's row, or a claim from the archive)."""
        store = self.host.agent.store
        got = None if store is None else store.db.execute("SELECT node FROM migrate_keeper_from WHERE key=?",
                                                          (key,)).fetchone()
        return int(got["node"]) if got is not None else int(src)

    def chain_refusal(self, row: Any, req: dict[str, Any]) -> au.Refused | None:
        """Why the kept job ``row`` (its request ``req``) may run nowhere on this node's word:
        its ids out of range, or a root job whose origin (the key's node, which must be the row's
        source) or whose keeper's sender is not trusted with root here (``zone.root_from``). Such a
        job is neither resumed here nor placed, passed on or archived: a relay must not launder
        it. Counted."""
        key, src = str(row["key"]), int(row["src_node"])
        sender = self.keeper_sender(key, src)
        owner = au.key_owner(key)
        e: au.Refused | None
        if owner is not None and owner != src:
            e = au.Refused("key", f"{key} is node {owner}'s job, but its keeper names node {src} its source")
        else:
            policy = getattr(self.host.agent.zone, "policy", None)
            e = au.chain_refusal(req, policy=policy if isinstance(policy, au.Policy) else au.Policy(self.host.node_id),
                                 origin=src, sender=sender)
        return None if e is None else self.host.control.refusals().note(e, sender)

    def _run_as_here(self, row: Any, req: dict[str, Any]) -> au.RunAs:
        """:func:`laminar.zone.authority.peer_run_as` for a kept job resumed here (a take-over,
        a claim from the archive): origin the row's source, sender the node that handed the
        keeper, this node's policy and ``[grants]``. Raises Refused (counted)."""
        key, src = str(row["key"]), int(row["src_node"])
        sender = self.keeper_sender(key, src)
        got = req.get("spec")
        spec: dict[str, Any] = got if isinstance(got, dict) else {}
        jobs = self.host.agent.jobs
        grants = getattr(jobs, "grants", None)
        if grants is None and hasattr(jobs, "checks"):
            from laminar.runtime.grants import Grants

            grants = Grants.from_config(None)
        from laminar.runtime.spec import PRIORITY_DEFAULT

        policy = getattr(self.host.agent.zone, "policy", None)
        prio = spec.get("priority", PRIORITY_DEFAULT)
        try:
            owner = au.key_owner(key)
            if owner is not None and owner != src:
                raise au.Refused("key", f"{key} is node {owner}'s job, but its keeper names node {src} its source")
            return au.peer_run_as(req, policy=policy if isinstance(policy, au.Policy) else au.Policy(self.host.node_id),
                                  origin=src, sender=sender, grants=grants,
                                  job_class=str(spec.get("class", spec.get("job_class", "standard"))),
                                  priority=prio if isinstance(prio, int) else PRIORITY_DEFAULT)
        except au.Refused as e:
            raise self.host.control.refusals().note(e, sender) from None

    def set_replica(self, key: str, event: custody.Event, job_id: str | None = None,
                     insert: dict[str, Any] | None = None) -> None:
        """A take-over's outcome for ``key`` (ledger.move: its retry row goes too; ``job_id`` None
        keeps the stored one; ``insert``: the row made when there is none, else nothing is)."""
        with self.host.agent.store.tx() as db:
            ledger.move(db, key, event, counts=self.host.counts, job_id=job_id, insert=insert)

    def runs_here(self, key: str) -> str | None:
        """The job this node started for the migration key ``key`` (a move's hand-over, a
        take-over, an archive claim), in any state but failed: by the origin the job manager
        stored with it (an indexed column), never by a job's env, which its user writes
        (laminar.runtime.provenance; before, one job of any user carrying the key in its env made
        this node skip the key's take-over and its source drop the keeper)."""
        return jobs_of(self.host.agent).table.find_origin(key)

    async def taken_over_as(self, key: str | None) -> str | None:
        """The id of the job a take-over on this node started, or is starting, for the migrated
        job ``key`` a hand-over's request names (its origin's ``migrated_from``); None when it
        names none or no such job runs or starts here. Waits while such a start is under
        way (until the job manager stored the job or refused it). The zone asks this before it
        binds a hand-over of that job (:meth:`laminar.zone.handovers.Handovers.on_handover`),
        and answers the hand-over with the job: never a second copy here, nor one elsewhere (a
        refused hand-over is placed on another node). Does not suspend when none is starting."""
        if not key or self.host.agent.jobs is None:
            return None
        starting = self._starting.get(str(key))
        if starting is not None:
            return await asyncio.shield(starting) or self.runs_here(str(key)) or self._custody(str(key))
        return self.runs_here(str(key)) or self._custody(str(key))

    def _custody(self, key: str) -> str | None:
        """What this node's keeper of ``key`` did with the job when its take-over dropped the
        reservation of the placement handing the job here (:meth:`fence_placement`) and did not
        resume it here (the start failed: it looks for room here or elsewhere, or placed it on
        another node): the hand-over of that placement is answered with it, so its placer takes
        the job as placed and its keeper stands down. A refusal would let both keepers go on (the
        placer's placing or resuming it, this one's too): two copies. None when no take-over
        here fenced it, or this keeper ended (released, failed)."""
        row = self.host.agent.store.db.execute("SELECT state, job_id, request FROM migrate_replicas WHERE key=?",
                                          (key,)).fetchone()
        if row is None or str(row["state"]) not in ("keeping", "waiting", "placed", "resumed"):
            return None
        if key not in self._fenced:
            try:  # fenced before this agent's restart: the mark is in the keeper's request
                fenced = json.loads(row["request"]).get("fenced") is not None
            except (ValueError, TypeError, AttributeError):
                fenced = False
            if not fenced:
                return None
        where = f" as {row['job_id']}" if row["state"] in ("placed", "resumed") and row["job_id"] else ""
        return f"(taken over by node {self.host.node_id}'s keeper: {row['state']}{where})"

    def placement_here(self, request: Any) -> str:
        """Why a keeper handed here by a placement (its request's ``placement``: the placement id
        whose hand-over brings the job to this node, :meth:`place_on`) must not take the job over
        now: that hand-over is bound here and not answered yet (the job's checkpoint verified, its
        start under way). '' when none is (none came, or it ended: a job it started is found by
        :meth:`runs_here`)."""
        try:
            pid = json.loads(request).get("placement") if isinstance(request, str) else None
        except (ValueError, AttributeError):
            return ""
        handovers: Any = getattr(self.host.agent.zone, "handovers", None)
        if pid is None or not hasattr(handovers, "placement_pending"):
            return ""
        return (f"placement {int(pid):016x} is being handed over to this node" if handovers.placement_pending(int(pid))
                else "")

    def fence_placement(self, req: dict[str, Any], key: str = "") -> int | None:
        """A take-over here of a job that a placement (``req["placement"]``) was to hand over to
        this node: that placement's reservation is dropped, so its hand-over, should it still
        come, binds nothing here; the placement id returned is stored with the job this take-over
        starts (its origin), so that hand-over is answered with that job (the zone's
        ``handovers.job_for_placement``) and its placer takes the job as placed here. Never two copies here."""
        pid = req.get("placement")
        handovers: Any = getattr(self.host.agent.zone, "handovers", None)
        if pid is None or not hasattr(handovers, "forgo_placement"):
            return None
        handovers.forgo_placement(int(pid))
        if key:  # a hand-over of it, should it still come, is answered with this keeper's custody (_custody)
            self._fenced[key] = int(pid)
            # kept in the keeper's request too: a restart of this agent before that hand-over
            # comes must still answer it with the custody (else it is refused, and its placer
            # goes on with the job beside this keeper: two copies)
            with self.host.agent.store.tx() as db:
                row = db.execute("SELECT request FROM migrate_replicas WHERE key=?", (key,)).fetchone()
                try:
                    stored = json.loads(row["request"]) if row is not None else None
                except (ValueError, TypeError):
                    stored = None
                if isinstance(stored, dict):
                    stored["fenced"] = int(pid)
                    ledger.note_request(db, key, stored)
        return int(pid)

    @staticmethod
    def _need_of(req: dict[str, Any]) -> tuple[Any, dst.Resources]:
        """(zone Demand, Resources) of a kept job's request (spec, gpus)."""
        from laminar.policy.placement import Demand

        spec = req.get("spec") or {}
        gpus = int(req.get("gpus", 0) or 0)
        cpus = float(spec.get("cpus") or 1.0)
        mem = int(spec.get("memory_mb") or 256)
        return Demand(gpus=float(gpus), cpus=cpus, memory_mb=mem), dst.Resources(gpus, mem << 20, cpus)

    async def _take_over(self, row: Any, why: str) -> None:
        """Resume a kept job from its newest verified replica: here when this node has room,
        else on the best-ranked peer with room (reserve, send, keeper, hand over: the same choice
        and mechanism as a move), else look again later (:class:`RetrySchedule`; state
        ``waiting``). Never raises."""
        key = row["key"]
        try:
            await self.take_over_once(row, key, why)
        finally:
            self.taking.discard(key)

    async def take_over_once(self, row: Any, key: str, why: str) -> None:
        try:
            request = row["request"]
            assert self.host.root is not None
            # a replica received long ago is hashed whole (seconds for many GB): not on the loop,
            # and before the checks below, so nothing changes between them and the claim
            # only a copy the key's node or the keeper's sender sent (another member may push any key)
            senders = au.checkpoint_senders(key, self.keeper_sender(key, int(row["src_node"])), int(row["src_node"]))
            path = await asyncio.to_thread(latest_verified, self.host.root, key, senders)
            pending = self.placement_here(request)
            if pending:  # its hand-over to this node is under way: it starts the job, not this take-over
                log.info("migrate: %s: %s; its take-over waits for it", key, pending)
                return
            here = self.runs_here(key)
            if here is not None:
                self.set_replica(key, custody.Event.HAND_OVER, here)
                return
            if path is None:
                self.set_replica(key, custody.Event.FAIL)
                self.host._emit(f"{key}: {why}, but no verified checkpoint of it is held here; cannot resume it",
                           key=key, phase="failed")
                return
            req = json.loads(row["request"])
            refused = self.chain_refusal(row, req)
            if refused is not None:  # nowhere on this node's word: not here, not placed, not archived
                self.set_replica(key, custody.Event.FAIL)
                self.host._emit(f"{key}: {why}, but it is not resumed: {refused}", key=key, phase="failed",
                           reason=refused.reason)
                return
            archived, other, claimed = (await self.host.archive.lane.call(f"claim of {key}", self.host.archive.claims.claim_archived, key)
                                        if self.host.archive.root() is not None else (False, None, False))
            if archived:  # the archive's claim is the lock: one node runs the job
                if other is not None:
                    self.set_replica(key, custody.Event.HAND_OVER, other)
                    own = other == f"node {row['src_node']}"  # its own node's marker: the job ended there
                    self.host._emit(f"{key}: " + (f"{other} ran it to its end (the archive's marker; its release was "
                                             "missed)" if own else f"{other} runs it (claimed from the archive)")
                               + "; this keeper stands down", key=key, phase="handed-over")
                    return
                if not claimed:
                    self.wait_for_room(key, why, "another node is trying the archived copy", path)
                    return
                newer = await self.host.archive.lane.call(f"checking {key}'s archived checkpoint", self.host.archive.claims.archived_newer, key, path)
                if newer is not None:  # the archive has the job's later state (a keeper's final checkpoint)
                    self.host._emit(f"{key}: the archive holds {newer.name}, newer than this keeper's {path.name}: resumed "
                               "from it", key=key, phase="take-over", ckpt=newer.name)
                    path = newer
            try:
                if self.host.reclaim is not None:  # its window ended too: the owner took the node back
                    local_err: str | None = ("this node is being reclaimed" if not self.host.reclaim["task"].done()
                                             else "this node is reclaimed")
                else:
                    local_err = await self.resume_here(row, req, path, why)
                if local_err is not None and self.placement_here(row["request"]):
                    return  # a hand-over of it to this node came meanwhile: it starts the job, none elsewhere
                if local_err is None:
                    if claimed:
                        self.host.archive.lane.submit(f"claim of {key} done", self.host.archive.claims.claim_done, key, f"node {self.host.node_id}",
                                          (self.host.node_id, self.runs_here(key) or ""))
                        claimed = False
                    return
                placed, remote_err = await self.place_elsewhere(row, req, path, why)
                if placed:
                    if claimed:
                        self.host.archive.lane.submit(f"claim of {key} done", self.host.archive.claims.claim_done, key,
                                          f"placed by node {self.host.node_id}", self.host.archive.placed_as(key))
                        claimed = False
                    return
            finally:
                if claimed:
                    self.host.archive.lane.submit(f"claim of {key} given back", self.host.archive.claims.unclaim, key)
            if self.host.archive.root() is not None:
                with contextlib.suppress(Exception):  # a copy that outlives this node (and the zone)
                    await self.host.archive.lane.call(f"archiving {key}", self.host.archive.stopped.publish_unless_archived, key, path, {
                        "key": key, "src_node": int(row["src_node"]), "src_job": row["src_job"],
                        "request": {**req, "take_over": True}})
            self.wait_for_room(key, why, f"here: {local_err}; elsewhere: {remote_err}", path)
        except Exception as e:  # a bug or a store error: look again later rather than give up
            log.exception("migrate: take-over of %s", key)
            with contextlib.suppress(Exception):
                self.wait_for_room(key, why, repr(e), None)

    async def resume_here(self, row: Any, req: dict[str, Any], path: Path, why: str) -> str | None:
        """Starts the job here from ``path``; None when it started (or is queued by this
        node's admission), else why not (no free GPU, a command this node lacks)."""
        from laminar.runtime import provenance as pv
        from laminar.runtime.spec import JobError, JobSpec

        key = row["key"]
        # the spec a peer (or the archive) stored: names an agent of an older release put into its
        # env are dropped, never trusted (provenance.from_peer); what this take-over knows is its origin
        spec_d = dict(pv.from_peer(req["spec"], getattr(self.host.agent.jobs, "provenance_counts", None),
                                   f"the kept request of {key}", {"LM_MIGRATED_FROM": key}))
        try:  # as whom it runs here, checked before anything is copied for that owner (authority.py)
            run_as = self._run_as_here(row, req)
        except au.Refused as e:
            self.host._emit(f"{key}: not resumed here: {e}", key=key, phase="refused", reason=e.reason)
            return str(e)
        try:  # a job of another user than root cannot reach xfer/: it resumes from its own view of it
            if path.parent.parent != self.host.replicas.resumes.root():  # (one fetched from the archive is that view already)
                path = await asyncio.to_thread(self.host.replicas.resumes.copy, path, run_as.uid, run_as.gid)
        except OSError as e:
            return f"cannot give the job's owner its checkpoint: {e}"
        spec_d["resume_from"] = str(path)
        spec_d["gpus"] = int(req.get("gpus", 0))
        if self.placement_here(json.dumps(req)):
            return "a hand-over of the job to this node is under way"  # it came while the copy was made
        # from here until the job is stored, a hand-over of it to this node waits for this start
        # and is answered with its job (taken_over_as): no await between that check and this
        starting: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._starting[key] = starting
        try:
            origin = pv.JobOrigin(migrated_from=key, placement_id=self.fence_placement(req, key),
                                  resume_given=str(path))
            try:
                job = await jobs_of(self.host.agent).submit(JobSpec.from_dict(spec_d), owner_uid=run_as.uid,
                                                   owner_gid=run_as.gid, origin=origin)
            except (JobError, Exception) as e:  # the spec was valid at the source; this node lacks room or something
                if hasattr(self.host.agent.jobs, "count_refusal"):
                    jobs_of(self.host.agent).count_refusal("takeover", e)
                return str(e)
            starting.set_result(str(job.id))
        finally:
            if self._starting.get(key) is starting:
                del self._starting[key]
            if not starting.done():
                starting.set_result(None)
        # claimed from the archive: no keeper row here, one is made for it, so its source, heard
        # from again, is told that this node runs the job now (_superseded_round)
        self.set_replica(key, custody.Event.RESUME, job.id,
                          insert={"src_node": int(row["src_node"]), "src_job": str(row["src_job"]),
                                  "request": json.dumps(req), "ckpt": path.name})
        self.host.counts["resumed"] += 1
        self.host._emit(f"{key}: {why}; resumed here as {job.id} from {path.name} (the newest verified replica)",
                   key=key, job=job.id, ckpt=path.name, src_node=int(row["src_node"]), src_job=row["src_job"],
                   phase="resumed")
        return None

    async def place_elsewhere(self, row: Any, req: dict[str, Any], path: Path, why: str) -> tuple[bool, str]:
        """Places the kept job on the best-ranked peer with room: reserve it through the
        zone, send the checkpoint, hand that peer the keeper (not before the hand-over's
        timeout, so it does not start a second copy), hand the job over with ``resume_from``.
        Returns (placed, why not)."""
        key = row["key"]
        z = self.host.zone
        if z is None:
            return False, "this node is in a one-node zone"
        demand, need = self._need_of(req)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        mreq = dst.MoveRequest(key, need, float(size), DEFAULT_REMAINING_S, None, str(self.host.node_id), str(z.zone),
                               str(z.zone))
        ranked = dst.rank(mreq, [c for c in self.host.mover.candidates(need) if int(c.node) != int(row["src_node"])],
                          margin=float(self.host.s["notice_margin"]))
        feasible = [r for r in ranked if r.feasible]
        if not feasible:
            return False, ("no peer has room: " + "; ".join(f"node {r.candidate.node}: {', '.join(r.reasons[:1])}"
                                                            for r in ranked[:4])) if ranked else "no live peer"
        errors = []
        for r in feasible:
            node = int(r.candidate.node)
            try:
                dest_job = await self.place_on(row, req, path, node, demand)
            except (MigrateError, TransferError, OSError, TimeoutError) as e:
                errors.append(f"node {node}: {e}")
                continue
            self.set_replica(key, custody.Event.PLACE, f"node {node}/{dest_job}")
            self.drop_replica_handover(key)
            self.host.counts["placed"] += 1
            self.host._emit(f"{key}: {why}; placed on node {node} as {dest_job}, resuming from {path.name}", key=key,
                       node=node, dest_job=dest_job, ckpt=path.name, src_node=int(row["src_node"]),
                       src_job=row["src_job"], phase="placed")
            return True, ""
        return False, "; ".join(errors)

    async def place_on(self, row: Any, req: dict[str, Any], path: Path, node: int, demand: Any) -> str:
        """Reserve ``node``, send ``path``, give it the keeper, hand the job over: its job id there.
        Raises MigrateError/TransferError/OSError/TimeoutError (the reservation released)."""
        from laminar.zone import wire

        key = row["key"]
        z = self.host.zone
        pid = await self.host.mover.reserve(node, demand, HOLD_MIN_S)
        kept = False
        try:
            addr, port, zkey, zone = self.host._peer(node)
            res = await send_checkpoint(addr, port, path, key, zkey, zone=zone, node=str(self.host.node_id),
                                        chunk_size=int(self.host.s["chunk_kb"]) << 10, local_host=self.host._xfer_local,
                                        rate_bps=float(self.host.s["rate_mbit"]) * 1e6 or None)
            grace = float(z.s["handover_timeout_s"]) + 5.0
            await self.host._control(node, "keeper", {"key": key, "src_node": int(row["src_node"]), "src_job": row["src_job"],
                                                "ckpt": path.name,
                                                "request": {**req, "take_over": True, "not_before": time.time() + grace,
                                                            "placement": pid}})
            kept = True
            spec = dict(req["spec"])
            spec["resume_from"] = res.remote_path
            # the key in the env too, for an agent of an older release (it reads it there; this
            # release reads the request's origin and drops it: laminar.runtime.provenance)
            spec["env"] = {**(spec.get("env") or {}), MIGRATED_ENV: key}
            # confirm: once it may have arrived, no answer is no refusal (node may start the job: a
            # placement elsewhere or a resume here would run it twice); node is asked until it says
            # the job's node is its origin: the destination asks whether it (and this node) may
            # hand it root jobs, not this node alone (laminar.zone.authority)
            hreq = {"spec": spec, "owner_uid": req.get("owner_uid"), "owner_gid": req.get("owner_gid"),
                    "origin": request_origin(migrated_from=key, resume_given=True),
                    "origin_node": int(row["src_node"])}
            with self.host.agent.store.tx() as db:  # a stop that cuts the wait: the restart asks node first
                ledger.record_replica_handover(db, key, node, pid, hreq)
            try:
                return await self.handover(node, pid, hreq, confirm=True, job_id=key, frozen=False)
            except Exception:  # answered (no job runs there for it), or never sent: the take-over goes on
                self.drop_replica_handover(key)
                raise
        except BaseException:
            z.submitter.t.send(node, wire.Release(pid))
            if kept:
                await self.host.prestage.release(node, key)
            raise

    def drop_replica_handover(self, key: str) -> None:
        with self.host.agent.store.tx() as db:
            ledger.drop_replica_handover(db, key)

    def restore_replica_handovers(self) -> None:
        """At start: a keeper's placement of a job it took over whose hand-over the agent's stop
        or crash cut (``migrate_replica_handovers``) is settled before any other take-over of
        its key (the key is held as taken meanwhile): the node is asked with the same hand-over
        (:meth:`_settle_replica_handover`). Before, the keeper took the job over again (here or
        on another node) while that node may have started it: two copies."""
        for r in self.host.agent.store.db.execute("SELECT * FROM migrate_replica_handovers").fetchall():
            key = str(r["key"])
            self.taking.add(key)
            self.host._spawn(self._settle_replica_handover(key, int(r["node"]), int(r["pid"]), json.loads(r["request"])))

    async def _settle_replica_handover(self, key: str, node: int, pid: int, req: dict[str, Any]) -> None:
        """Asks ``node`` (:meth:`handover`, confirmed) whether it runs the job a cut placement
        handed it. It does: the replica is ``placed`` there. It does not: the keeper goes on as
        it was (its next take-over looks for room again). Either way a ``migrate`` event says
        so and the record goes. A node that cannot be asked (no zone, gone from the roster)
        keeps the key held here until a start that can ask it."""
        held = True
        try:
            try:
                dest_job = await self.handover(node, pid, req, confirm=True, sent=True, job_id=key, frozen=False)
            except MigrateError as e:
                self.drop_replica_handover(key)
                held = False
                # as place_on's refusal: node drops the placement and the take-over keeper it gave
                # it (else node resumes the job at that keeper's not_before while the keeper here goes on)
                self.host.settle.tell_release(node, pid, key)
                self.host._emit(f"{key}: its placement on node {node} was cut by the agent's stop during the hand-over; "
                           f"node {node} did not start it ({e}); the keeper goes on", key=key, node=node,
                           phase="placement-cut", error=str(e))
                return
            self.set_replica(key, custody.Event.PLACE, f"node {node}/{dest_job}")
            self.drop_replica_handover(key)
            held = False
            self.host.counts["placed"] += 1
            self.host._emit(f"{key}: its placement on node {node} was cut by the agent's stop during the hand-over; "
                       f"node {node} runs it as {dest_job}", key=key, node=node, dest_job=dest_job, phase="placed")
        except (KeyError, AttributeError) as e:
            self.host._emit(f"{key}: its placement on node {node} was cut by the agent's stop during the hand-over and "
                       f"node {node} cannot be asked ({e!r}); not taken over again until a start that can ask it",
                       key=key, node=node, phase="unconfirmed")
        finally:
            if not held:
                self.taking.discard(key)

    async def handover(self, node: int, pid: int, req: dict[str, Any], confirm: bool = False, sent: bool = False,
                        job_id: str = "", frozen: bool = True) -> str:
        """Hands a job request over to ``node`` under its reservation ``pid``: the job's id there.
        Raises MigrateError when it does not start the job.

        ``confirm`` (a move's: its job is frozen here): once the frame may have reached ``node``
        (``sent``: it may have before this call, as for a restart's :meth:`Mover.settle_cut`),
        no answer is never taken for a refusal (the node may run the job: a thaw here or a
        hand-over elsewhere would run it twice). The same hand-over is sent again, at most
        HANDOVER_ASK_MAX_S apart, until ``node`` answers: it is idempotent by placement id there,
        also across that agent's restart (the answer names the job it started for it, or says
        none runs for it). The job stays frozen meanwhile, with a ``migrate`` event (phase
        ``unconfirmed``) naming the node; the wait ends with the answer or a cancel. A keeper's
        placement of a replica (:meth:`place_on`, ``job_id`` its key, ``frozen`` False: no copy
        runs here) confirms too: meanwhile it is resumed nowhere else."""
        from laminar.zone import wire
        from laminar.zone.component import HANDOVER_OK
        from laminar.zone.transport import HandoverError

        z = self.host.zone
        m = z.membership.by_node[node]
        delay, told = 0.2, False
        asking: dict[str, Any] = {"node": node, "since": None, "error": "", "wake": asyncio.Event()}
        if confirm and job_id:
            self.asking[job_id] = asking
        try:
            while True:
                try:
                    ack = await z.submitter.t.handover(node, m.handover_port,
                                                       wire.Handover(pid, json.dumps(req).encode()),
                                                       float(z.s["handover_timeout_s"]))
                    break
                except HandoverError as e:
                    sent = sent or e.delivered
                    if not (confirm and sent):
                        raise MigrateError(f"hand-over to node {node} failed: {e}") from None
                    asking["since"] = asking["since"] or time.time()
                    asking["error"] = str(e)
                    told = self._unconfirmed_once(job_id, node, frozen, told, e)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asking["wake"].wait(), delay)
                    decided = asking.pop("settled", None)
                    if decided == "run-here":
                        raise HandoverSettled(f"an operator settled its hand-over to node {node}: node {node} "
                                              "does not run the job (laminarctl job settle --run-here)") from None
                    if decided == "gone":
                        return f"(unconfirmed: an operator settled that node {node} runs it)"
                    delay = min(2 * delay, HANDOVER_ASK_MAX_S)
        finally:
            if self.asking.get(job_id) is asking:
                del self.asking[job_id]
        if told:
            self.host._emit(f"{job_id}: node {node} answered its hand-over: "
                       + ("it runs the job" if ack.status == HANDOVER_OK else f"it did not start it ({ack.text})"),
                       job=job_id, node=node, phase="confirmed", started=ack.status == HANDOVER_OK)
        if ack.status != HANDOVER_OK:
            raise MigrateError(f"node {node} did not start the job: {ack.text}")
        return str(ack.text)

    def _unconfirmed_once(self, job_id: str, node: int, frozen: bool, told: bool, e: Exception) -> bool:
        """The ``unconfirmed`` event of a hand-over not answered, once per wait: True."""
        if not told:
            self.host._emit(f"{job_id}: its hand-over to node {node} may have arrived and was not answered ({e}); "
                       + ("the job stays frozen here" if frozen else "the job is placed nowhere else")
                       + f" and node {node} is asked again until it says whether it "
                       f"runs the job (never two copies; an operator who knows node {node} is gone for good: "
                       f"`laminarctl job settle {job_id} --run-here|--gone`)", job=job_id, node=node,
                       phase="unconfirmed", error=str(e))
        return True

    def wait_for_room(self, key: str, why: str, error: str, path: Path | None) -> None:
        """No room anywhere yet: state ``waiting`` and the next look per the retry schedule."""
        db = self.host.agent.store.db
        r = db.execute("SELECT attempts FROM migrate_retry WHERE key=?", (key,)).fetchone()
        attempts = 0 if r is None else int(r["attempts"])
        delay = self.retry.delay(attempts)
        now = time.time()
        with self.host.agent.store.tx() as tx:
            ledger.schedule_retry(tx, key, attempts + 1, now + delay, why, error, now)
            ledger.move(tx, key, custody.Event.WAIT, counts=self.host.counts, updated=now)
        self.host.counts["retries"] += 1
        self.host._emit(f"{key}: no room for it yet ({error}); holding {path.name if path else 'its checkpoint'}, "
                   f"looking again in {delay:g} s", persist=attempts == 0, key=key, phase="waiting",
                   attempts=attempts + 1, next_in_s=delay)
