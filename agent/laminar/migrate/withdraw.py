"""A reclaim withdrawn: the cancel of this node's reclaim, what a restart settles of a cancel it
cut, and a peer's withdrawal heard here (:class:`Withdraw`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: its ``withdraw``).

**A reclaim withdrawn.** An owner may withdraw the notice (a spot rebalance recommendation that
passed, changed plans) or give the node back after the window::

    laminarctl reclaim cancel [--node 4]
    POST /v1/reclaim/cancel {"node"?: 4, "reason"?: "..."}          (privileged; 404: no reclaim)

:meth:`Withdraw.cancel_reclaim` removes the stored reclaim first (a restart restores
nothing), then stops what has not happened: no move begins any more and nothing is stopped at
the window's end; the kill-switch deadlines the reclaim armed are cleared (a cut the job has for
another reason stays); the node takes placements again; the placement of queued jobs elsewhere
stops after the one it is asking for, and the queue hold is released (queued jobs start here).
What already happened stays: a job handed over runs where it went, a queued job placed again
elsewhere stays there. A move already begun (its checkpoint signal sent) is never cut: it
finishes (the job runs on its destination) or fails (the job is thawed and runs on here), so a
job is never left frozen or nowhere. A queued job whose placement elsewhere is unsettled is
stopped here so it never runs twice. Peers are told (control op ``reclaim-withdrawn``): they
forget the notice and the window's end their keepers of this node's jobs carry (else they would
declare this node dead at that end and resume, a second time, jobs that run on here). A peer
not reached is told again every WITHDRAWN_RETRY_S: until its window's end without limit, then
CLEARED_TELL_TRIES times (also after a cancel after the window); a restart meanwhile goes on. A keeper
that may have missed that (its agent started after the keeper message that told it the window's
end, or it heard nothing from this node for the zone's ``peer_timeout_s`` before the window's
end: :meth:`Takeover.missed_news`)
asks this node (control op ``needs``) before it takes over at the window's end: a job that runs
here with no reclaim (``reclaim`` false in the answer) keeps it keeping and the window is forgotten;
an older agent's answer without ``reclaim`` keeps it keeping and the window kept, and this node
is asked again only once it falls silent in the zone (or after a new keeper message).
A new notice that comes while a cancel runs is a new reclaim: the cancel undoes none of it
(its queue hold, its placements of queued jobs, its notice to the peers; ``superseded`` in the
answer), and its evacuation begins no second move of a job whose move is under way.

:class:`Withdraw` is built with the component (what it uses of it: :class:`WithdrawHost`) and
holds whether a cancel runs now (:attr:`Withdraw.cancelling`, which the component's start of a
new reclaim reads). It has no round of its own. The component's start calls
:meth:`Withdraw.settle_cancelled` (a cancel the restart cut) and :meth:`Withdraw.retell_withdrawn`
(a reclaim cleared: its window ended while no agent ran), and a reclaim restored inside its window
:meth:`Withdraw.stop_handed` (a job whose hand-over was sent before the restart);
``POST /v1/reclaim/cancel`` and the control op ``reclaim-cancel`` reach
:meth:`Withdraw.cancel_reclaim` through :meth:`Evacuation.cancel`; the control op
``reclaim-withdrawn`` and the keeper call :meth:`Withdraw.withdrawn_notice`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from laminar.airlock.cgroups import set_frozen_async
from laminar.components import jobs_of
from laminar.migrate import drain, ledger
from laminar.migrate.errors import MigrateError
from laminar.policy import moves
from laminar.policy.endcause import EndCause
from laminar.runtime.holds import Hold, Holds

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.evacuation import Evacuation
    from laminar.migrate.mover import Mover

log = logging.getLogger("laminar.migrate")

WITHDRAWN_RETRY_S = 2.0  # a peer not reached when a reclaim was cancelled is told again this often
CLEARED_TELL_TRIES = 30  # after the window (a cancel then, or a reclaim cleared at start): tries at most


class WithdrawHost(Protocol):
    """What :class:`Withdraw` uses of the component that holds it (ReclaimComponent and its parts)."""

    _drain_task: asyncio.Task[Any] | None
    agent: MigrateAgent
    evacuation: Evacuation
    mover: Mover
    counts: dict[str, int]
    evacuating: set[str]
    notices: dict[int, tuple[float, float]]
    reclaim: dict[str, Any] | None

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _holds(self) -> Holds: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    @property
    def node_id(self) -> int: ...
    @property
    def zone(self) -> Any: ...


class Withdraw:
    """The cancel of this node's reclaim (and its settling after a restart), and peers told of it
    (see the module's doc): a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its
    ``withdraw``). ``host``: the component."""

    def __init__(self, host: WithdrawHost) -> None:
        self.host = host
        self.cancelling = False  # a cancel of this node's reclaim runs now

    async def settle_cancelled(self, phases: dict[str, tuple[str, int | None]],
                               marker: dict[str, Any] | None) -> None:
        """At start, after a cancel the agent's restart interrupted (``marker``: store meta
        :data:`drain.CANCEL_META`, written at the cancel's first step and removed at its last; or
        no stored reclaim but records of what one did to jobs, ``migrate_moves`` cause ``reclaim``). Settled
        as the cancel would have: a job whose hand-over was sent is settled by asking its
        destination with the same hand-over (:meth:`Mover.settle_cut`, recorded in
        ``migrate_moves`` meanwhile, its cause ``reclaim_cancelled``): stopped here (``migrated``) if it runs the job there,
        thawed here if it has no job for it (the reclaim is withdrawn: no keeper resumes it at the
        window's end); a record of an older agent without the hand-over (no
        placement id and request in its record) is stopped here as before. One a move froze is thawed, a
        queued job whose placement elsewhere was unsettled is stopped here (it may run there: never
        twice); the records go, the queue hold taken at start (:data:`drain.SETTLING_HOLD`) is
        released and the peers are told the reclaim is withdrawn (again until its window's end):
        else their keepers of the jobs that run on here would resume them at the window's end."""
        jobs_mgr = self.host.agent.jobs
        unsettled = []
        for jid, (ph, node) in sorted(phases.items()):
            job = jobs_mgr.get(jid) if jobs_mgr is not None else None
            if job is None:
                continue
            sent = self.host.agent.store.db.execute("SELECT node, pid, request FROM migrate_moves WHERE job_id=? AND "
                                                    "cause='reclaim' AND pid IS NOT NULL AND request IS NOT NULL",
                                                    (jid,)).fetchone()
            if ph == "handover" and job.active and sent is not None:
                why = f"reclaim of node {self.host.node_id}, cancelled"
                req = json.loads(sent["request"])
                with self.host.agent.store.tx() as db:  # a restart meanwhile asks again (Mover.restore)
                    ledger.record_move(db, jid, moves.Event.CANCEL, cause=moves.Cause.RECLAIM_CANCELLED, reason=why,
                                       thaw=True, only=moves.WINDOWED, counts=self.host.counts)
                self.host.evacuating.add(jid)  # Airlock leaves it frozen (AirlockManager.moving)
                self.host._spawn(self.host.mover.settle_cut(job, int(sent["node"]), int(sent["pid"]), req, why, True))
            elif ph == "handover" and job.active:
                await self.stop_handed(job, node)
            elif ph == "frozen" and job.active:
                with contextlib.suppress(Exception):  # its move froze it: the move's hold ends
                    self.host._holds().reattach(job, Hold.MOVE)
                    await self.host.mover.unhold_wait(job, True, 2.0)
            elif ph == "placing" and job.state == "queued":
                assert jobs_mgr is not None
                unsettled.append(jid)
                try:
                    await jobs_mgr.stop(jid, f"the reclaim of node {self.host.node_id} was cancelled "
                                        "(the agent restarted "
                                        "during the cancel) while the job's placement on another node was unsettled: "
                                        "it may run there (see `laminarctl placements` and the migrate events); not "
                                        "started here so it never runs twice", state="stopped",
                                        cause=EndCause.PLACEMENT_UNSETTLED)
                except Exception as e:
                    log.warning("migrate: stopping %s, its placement unsettled at a cancel: %s", jid, e)
        with self.host.agent.store.tx() as db:  # these only: a reclaim announced meanwhile records its own
            ledger.drop_moves(db, phases, only=moves.WINDOWED, counts=self.host.counts)
        if jobs_mgr is not None and getattr(jobs_mgr, "held", None) == drain.SETTLING_HOLD:
            jobs_mgr.hold_queue(None)
        if marker is not None and self.host.reclaim is None:  # (a reclaim announced meanwhile: its notice stands)
            _, missed = await self._tell_withdrawn()
            end = float(marker.get("window_end") or 0.0)
            if missed:
                self.host._spawn(self.retell_withdrawn(missed, end))  # the marker goes when they are told
            else:
                self.host.agent.store.del_meta(drain.CANCEL_META)
        self.host._emit(f"reclaim of node {self.host.node_id}: "
                        "what its cancel left when the agent restarted is settled"
                        + (f"; queued jobs stopped here (placement elsewhere unsettled): {', '.join(unsettled)}"
                           if unsettled else ""), phase="reclaim-cancel-settled", unsettled=unsettled,
                        jobs=sorted(phases))

    async def stop_handed(self, job: Any, node: int | None) -> None:
        """A job whose hand-over to ``node`` was sent before the agent restarted (it may run
        there now) is stopped here, never moved again. State ``reclaimed``: its keeper (``node``)
        keeps it and resumes it when this node's window ends unless it already runs there."""
        with contextlib.suppress(Exception):
            await set_frozen_async(job.cgroup, False, 2.0)  # a frozen job is not killed by a signal until it thaws
        try:
            await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed: "
                                            f"the job was handed over to node {node} "
                                            f"before the agent restarted (node {node} runs it, "
                                            "or keeps it and resumes it "
                                            "when this node's window ends)", grace_s=0, state="reclaimed",
                                            cause=EndCause.HANDED_OVER)
        except Exception as e:
            log.warning("migrate: stopping %s, handed over before the restart: %s", job.id, e)
        self.host._emit(f"{job.id}: handed over to node {node} before the agent restarted; "
                        "stopped here, not moved again",
                        job=job.id, node=node, phase="handed-over")

    async def cancel_reclaim(self, reason: str = "") -> dict[str, Any]:
        """Withdraws this node's reclaim, inside its window or after it (see the module's doc:
        "A reclaim withdrawn"). Returns what it did: ``in_window``, ``disarmed`` (jobs whose
        armed deadline was cleared), ``undrained``, ``released`` (the queue hold), ``finishing``
        (moves begun before, left to finish), ``unsettled`` (queued jobs stopped here: their
        placement elsewhere may have run), ``peers_told``/``peers_missed``. Raises LookupError
        when this node has no reclaim; MigrateError while one cancel is running."""
        db = self.host.agent.store.db
        r = self.host.reclaim
        row = db.execute("SELECT * FROM migrate_reclaim").fetchone()
        if r is None and row is None:
            raise LookupError(f"node {self.host.node_id} has no reclaim to cancel (see `laminarctl reclaim status`)")
        if self.cancelling:
            raise MigrateError(f"the reclaim of node {self.host.node_id} is being cancelled already")
        self.cancelling = True
        try:
            return await self._cancel(r, row, reason or "reclaim cancelled")
        finally:
            self.cancelling = False

    async def _cancel(self, r: dict[str, Any] | None, row: Any, reason: str) -> dict[str, Any]:
        now = time.time()
        end = float(r["deadline"] if r is not None else row["deadline"])
        in_window = now < end
        # a restart from here on settles what this cancel leaves (settle_cancelled), restores nothing
        self.host.agent.store.set_meta(drain.CANCEL_META, {"node": self.host.node_id, "window_end": end})
        with self.host.agent.store.tx() as db:  # first: a restart from here on restores nothing
            db.execute("DELETE FROM migrate_reclaim")
        self.host.reclaim = None  # status shows none; the drain's placement loop ends after its current one
        if r is not None:
            r["cancel"].set()  # no move begins any more, nothing is stopped at the window's end
        finishing = sorted(self.host.evacuating)
        jobs_mgr = self.host.agent.jobs
        disarmed: list[str] = []
        ng = self.host.agent.netguard
        armed = set(r["armed"]) if r is not None else set()
        for j in list(jobs_mgr.active()) if jobs_mgr is not None else []:
            if ng is None or j.id not in armed:
                continue
            try:
                if drain.disarm(ng, j.cgroup_id):
                    disarmed.append(j.id)
            except Exception as e:
                log.warning("migrate: clearing the armed deadline of %s failed: %s", j.id, e)
        z = self.host.agent.zone
        undrained = drain.undrain(z) if z is not None else False
        drain_task = self.host._drain_task
        while drain_task is not None and not drain_task.done() and self.host.reclaim is None:
            # it ends after the placement it asks for (never cut); a reclaim announced meanwhile
            # takes it over (it follows that reclaim's window): not waited for then
            await asyncio.wait({drain_task}, timeout=0.2)
        # A new reclaim announced while this cancel waited is that reclaim's now: its queue hold,
        # its records and its notice to the peers are not undone here.
        superseded = self.host.reclaim is not None
        # the drain stopped: a ``placing`` row left is an unsettled placement (unconfirmed, or
        # asked for before a restart); the rows go only now
        unsettled = [] if superseded else [
            jid for jid, (ph, _) in sorted(self.host.evacuation.move_phases().items()) if ph == "placing"
            and jobs_mgr is not None and getattr(jobs_mgr.get(jid), "state", None) == "queued"]
        if not superseded:  # a move left to finish keeps its record: a restart that cuts it settles it
            done = [jid for jid in self.host.evacuation.move_phases() if jid not in self.host.evacuating]
            with self.host.agent.store.tx() as db:
                ledger.drop_moves(db, done, only=moves.WINDOWED, counts=self.host.counts)
        for jid in unsettled:
            assert jobs_mgr is not None
            with contextlib.suppress(Exception):
                await jobs_mgr.stop(jid, f"the reclaim of node {self.host.node_id} "
                                    "was cancelled while the job's placement "
                                    "on another node was unsettled: it may run there (see `laminarctl zone placements` and "
                                    "the migrate events); not started here so it never runs twice", state="stopped",
                                    cause=EndCause.PLACEMENT_UNSETTLED)
        superseded = self.host.reclaim is not None
        released = not superseded and drain.release_hold(jobs_mgr, self.host.node_id)
        sch = self.host.agent.schedulers
        if not superseded and sch is not None:  # the schedulers place work here again (never raises)
            await sch.undrain(reason)
        told, missed = ([], []) if superseded else await self._tell_withdrawn()
        if self.host.reclaim is not None and not superseded:  # announced while the peers were told: tell its notice again
            superseded = True
            with contextlib.suppress(Exception):
                z.reclaim_notice(max(0.0, self.host.reclaim["deadline"] - time.time()), self.host.reclaim["reason"])
        if missed and not superseded:  # a peer not told may resume this node's jobs twice (before its window's
            # end, and after it while it counts this node gone by its ended notice: bench/chaos.py)
            # the marker stays until they are told (or the tries run out): a restart tells them again
            self.host.agent.store.set_meta(drain.CANCEL_META, {"node": self.host.node_id, "window_end": end,
                                                               "missed": missed})
            self.host._spawn(self.retell_withdrawn(missed, end))
        else:
            self.host.agent.store.del_meta(drain.CANCEL_META)  # done: nothing is left for a restart to settle
        out = {"node": self.host.node_id, "cancelled": True, "in_window": in_window, "window_end": end,
               "disarmed": disarmed, "undrained": undrained, "released": released, "finishing": finishing,
               "unsettled": unsettled, "peers_told": told, "peers_missed": missed, "superseded": superseded}
        what = (f"{len(disarmed)} kill-switch deadlines cleared, "
                + (f"{len(finishing)} moves begun left to finish, " if finishing else "")
                + (f"{len(unsettled)} queued jobs with an unsettled placement elsewhere stopped here, " if unsettled else "")
                + "queue released, the node takes placements again" if in_window else
                "the node takes jobs and placements again")
        if superseded:
            what = "a new reclaim announced meanwhile holds the queue and drains the node"
        self.host._emit(f"reclaim of node {self.host.node_id} cancelled "
                        f"{'inside its window' if in_window else 'after its window'} "
                        f"({reason}): {what}; {len(told)} peers told" + (f", {len(missed)} not reached" if missed else ""),
                        phase="reclaim-cancelled", **{k: v for k, v in out.items() if k not in ("node", "cancelled")})
        return out

    async def retell_withdrawn(self, peers: list[int] | None, end: float, *, at_once: bool = False,
                               marker: bool = True) -> None:
        """Tells ``peers`` (None: every other member of the zone) that this node's reclaim is
        withdrawn, again every WITHDRAWN_RETRY_S until each was told: without end inside the
        window (wall clock ``end``), CLEARED_TELL_TRIES times more after it. ``at_once``: the
        first try is now, not after a wait. ``marker``: the cancel's marker
        (:data:`drain.CANCEL_META`) goes at the end (every peer told or the tries ran out). A new
        reclaim of this node stops it (its notice is what the peers must hear now).

        After a cancel, with the peers not reached (before, it stopped at the window's end, and a
        cancel after the window told a peer not reached never: that peer kept the ended notice
        and counted this node gone). And at the agent's start, when the stored reclaim was cleared
        (its window ended while no agent ran: the owner gave the node back), with every peer,
        ``at_once``, no marker: before, they kept its notice and counted the node dead by its
        ended window; one that could not reach it when it asked before claiming its running job's
        archived copy (a partition) claimed it and ran the job a second time (bench/chaos.py)."""
        left = peers
        after = 0
        wait = not at_once
        while left is None or left:
            if time.time() >= end:
                after += 1
                if after > CLEARED_TELL_TRIES:
                    log.warning("migrate: nodes %s never heard that the reclaim of node %d was withdrawn",
                                "all" if left is None else left, self.host.node_id)
                    break
            if wait:
                await asyncio.sleep(WITHDRAWN_RETRY_S)
            wait = True
            if self.host.reclaim is not None:
                return  # a new reclaim: its notice is what the peers must hear now
            if self.host.zone is None:  # a one-node zone: nobody to tell
                break
            _, left = await self._tell_withdrawn(left)
        if marker:
            self.host.agent.store.del_meta(drain.CANCEL_META)

    async def _tell_withdrawn(self, peers: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Tells ``peers`` (None: every other member of the zone) that this node's reclaim is
        withdrawn (op ``reclaim-withdrawn``). Returns (told, not reached)."""
        z = self.host.zone
        if z is None:
            return [], []
        if peers is None:
            peers = sorted(n for n in z.membership.by_node if n != self.host.node_id)

        async def one(n: int) -> bool:
            try:
                await self.host._control(n, "reclaim-withdrawn", {"ts": time.time()}, timeout=3.0)
                return True
            except Exception as e:
                log.warning("migrate: telling node %d that the reclaim is withdrawn failed: %s", n, e)
                return False

        res = await asyncio.gather(*(one(n) for n in peers))
        return [n for n, ok in zip(peers, res, strict=True) if ok], [n for n, ok in zip(peers, res, strict=True) if not ok]

    def withdrawn_notice(self, node: int) -> list[str]:
        """A peer's reclaim was withdrawn: its notice is forgotten (it is a candidate for moves
        again) and so is the window's end carried by the keepers held here of its jobs (they no
        longer declare it dead then). Returns the keys of those keepers."""
        self.host.notices.pop(node, None)
        keys = []
        with self.host.agent.store.tx() as db:
            for row in db.execute("SELECT key, request FROM migrate_replicas WHERE src_node=? "
                                  "AND state IN ('keeping', 'waiting')", (node,)).fetchall():
                try:
                    req = json.loads(row["request"])
                except ValueError:
                    continue
                if isinstance(req, dict) and "window_end" in req:
                    req.pop("window_end")
                    ledger.note_request(db, str(row["key"]), req)
                    keys.append(str(row["key"]))
        self.host._emit(f"node {node} withdrew its reclaim: it is a candidate for moves again"
                        + (f"; {len(keys)} keeps here no longer end with its window" if keys else ""),
                        node=node, phase="reclaim-withdrawn", keepers=keys)
        return keys
