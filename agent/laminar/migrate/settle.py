"""An operator's settle of a hand-over its node did not answer (:class:`Settle`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: its ``settle``; in long form:
docs/migration.md, *Settling a hand-over whose destination is gone for good*).

No timeout ends the wait for a hand-over's answer (a thaw on a timeout could run the job twice
during a partition: :meth:`Takeover.handover` with ``confirm``), so a destination that
received the frame and then left for good would keep the job frozen here, or a keeper's key held,
forever. The operator who knows that node is gone decides: ``laminarctl migrations --pending``
(``GET /v1/migrate/handovers``: :meth:`Settle.pending_handovers`) lists the hand-overs not
answered, and ``laminarctl job settle ID --run-here`` or ``--gone``
(``POST /v1/migrations/{job}/settle``: :meth:`Settle.settle_handover`) says whether that
node runs the job.

:class:`Settle` is built with the component (what it uses of it: :class:`SettleHost`). It holds
no state of its own: the waits for an answer it settles (:attr:`Takeover.asking`) are the
keeper's hand-over's (:meth:`Takeover.handover`), the records are the store's. It has no
round either. Besides the two routes above, ``GET /v1/migrations`` shows each move through
:meth:`Settle.move_view`; the component's start calls :meth:`Settle.stop_settled` (a settle's
stop the restart cut) and the keeper :meth:`Settle.tell_release` (a placement its node refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from laminar.airlock.cgroups import set_frozen_async
from laminar.components import jobs_of
from laminar.migrate import ledger
from laminar.policy import custody, moves
from laminar.policy.endcause import EndCause

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.mover import Move, Mover
    from laminar.migrate.prestage import Prestage
    from laminar.migrate.takeover import Takeover

log = logging.getLogger("laminar.migrate")


class SettleHost(Protocol):
    """What :class:`Settle` uses of the component that holds it (ReclaimComponent and its parts)."""

    agent: MigrateAgent
    mover: Mover
    counts: dict[str, int]
    evacuating: set[str]
    takeover: Takeover
    moves: dict[str, Move]
    prestage: Prestage

    def _emit(self, message: str, **fields: Any) -> None: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    def job_key(self, job: Any) -> str: ...
    @property
    def zone(self) -> Any: ...


class Settle:
    """Hand-overs sent and not answered, and an operator's decision about one (see the module's
    doc): a part of :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``settle``). ``host``:
    the component."""

    def __init__(self, host: SettleHost) -> None:
        self.host = host

    def pending_handovers(self) -> list[dict[str, Any]]:
        """Hand-overs sent (or maybe sent) and not answered yet, that an operator may settle
        (:meth:`settle_handover`): a move's (``kind`` move, ``job`` its id) and a keeper's
        placement's (``kind`` placement, ``job`` the replica's key). ``state``: ``handing-over``
        (its first try is under way), ``unconfirmed`` (a try went unanswered: asked again
        until the node answers), ``unasked`` (the node cannot be asked: no zone, or it left the
        roster; it stays until an operator's settle or a start that can ask it). ``since``:
        the first unanswered try (wall clock), else when the hand-over was recorded."""
        db = self.host.agent.store.db
        rows = [("move", r) for r in db.execute("SELECT job_id AS ref, node, updated FROM migrate_moves "
                                                "WHERE phase='handover' AND node IS NOT NULL AND cause != 'reclaim'")]
        rows += [("placement", r) for r in db.execute("SELECT key AS ref, node, updated FROM migrate_replica_handovers")]
        seen = {str(r["ref"]) for _, r in rows}
        # a reclaim's move (its records are the reclaim's): while its wait runs
        rows += [("move", {"ref": jid, "node": a["node"], "updated": a["since"] or time.time()})
                 for jid, a in self.host.takeover.asking.items() if jid not in seen]
        out = []
        for kind, r in rows:
            a = self.host.takeover.asking.get(str(r["ref"]))
            state = "unasked" if a is None else "unconfirmed" if a["since"] else "handing-over"
            out.append({"job": str(r["ref"]), "kind": kind, "node": int(r["node"]), "state": state,
                        "since": (a["since"] if a is not None else None) or float(r["updated"]),
                        "error": "" if a is None else a["error"]})
        return sorted(out, key=lambda h: h["since"])

    def move_view(self, mv: Move) -> dict[str, Any]:
        """A move as GET /v1/migrations shows it: phase ``unconfirmed`` (with ``unconfirmed_since``,
        wall clock) while its hand-over goes unanswered."""
        d = mv.as_dict()
        a = self.host.takeover.asking.get(mv.job) if mv.phase == "handover" else None
        if a is not None and a["since"]:
            d["phase"], d["unconfirmed_since"] = "unconfirmed", a["since"]
        return d

    async def settle_handover(self, ref: str, decision: str, by: str = "") -> dict[str, Any]:
        """An operator's call on a hand-over its node never answered (the node left for good):
        the wait (:meth:`Takeover.handover`) or the record a restart would ask with ends by decision.
        ``ref``: a job id (``N`` for ``job-N``) with a move's pending hand-over, or the key of a
        keeper's placement. ``decision``: ``run-here`` (the node does not run it: the job is
        thawed here when its move froze it and runs on; a placement's keeper goes on; the node
        is no longer the job's keeper and is told to release its keeper, recorded with the
        decision and sent until it answers, also after a restart: :meth:`Prestage.release`) or
        ``gone`` (the node runs it: the job is stopped here, state ``migrated``; the replica is
        ``placed`` there). Written to the
        store before it is done, so a restart finishes it and never asks the node again.
        Returns {job, kind, node, decision, state}. Raises ValueError (decision) and
        LookupError (nothing pending for ``ref``)."""
        if decision not in ("run-here", "gone"):
            raise ValueError(f"decision {decision!r}: expected run-here or gone")
        db = self.host.agent.store.db
        for jid in dict.fromkeys([ref, f"job-{ref}" if ref.isdigit() else ref]):
            row = db.execute("SELECT * FROM migrate_moves WHERE job_id=? AND phase='handover' AND node IS NOT NULL "
                             "AND cause != 'reclaim'", (jid,)).fetchone()
            if row is not None:
                return await self._settle_move(jid, row, decision, by)
        row = db.execute("SELECT * FROM migrate_replica_handovers WHERE key=?", (ref,)).fetchone()
        if row is not None:
            return await self._settle_placement(ref, row, decision, by)
        mv = self.host.moves.get(ref) or (self.host.moves.get(f"job-{ref}") if ref.isdigit() else None)
        if mv is not None and mv.phase == "handover" and mv.job in self.host.takeover.asking:
            # a reclaim's move waiting on its answer (no migrate_moves row: the reclaim records
            # it); once its reclaim is cancelled, no window's end bounds that wait
            return await self._settle_reclaim_move(mv, decision, by)
        what = (f" (its move is in phase {mv.phase}: "
                + ("its hand-over is not sent yet)" if mv.phase == "handover"
                   else "nothing to settle)") if mv is not None else "")
        raise LookupError(f"{ref!r} has no pending hand-over on this node{what}; only a move or a keeper's placement "
                          "whose hand-over went unanswered is settled (see `laminarctl migrations --pending`)")

    async def _await_waiter(self, ref: str, decision: str, gone: Any) -> bool:
        """Hands ``decision`` to the wait for ``ref``'s answer (:meth:`Takeover.handover`),
        if one runs: True once ``gone()`` (what that wait leaves when it ends), False with no wait."""
        a = self.host.takeover.asking.get(ref)
        if a is None:
            return False
        a["settled"] = decision  # this wait's, this node's: never a later wait's (the node refused meanwhile)
        a["wake"].set()
        end = time.monotonic() + float(self.host.zone.s["handover_timeout_s"] if self.host.zone else 0.0) + 15.0
        while not gone() and self.host.takeover.asking.get(ref) in (None, a) and time.monotonic() < end:
            await asyncio.sleep(0.05)  # (another wait for ref: the node answered, the move tries another)
        a.pop("settled", None)  # answered meanwhile: the answer decided
        return True

    async def _settle_reclaim_move(self, mv: Move, decision: str, by: str) -> dict[str, Any]:
        """An operator's call on a reclaim's move waiting for its hand-over's answer: the
        decision goes to the wait (:meth:`Takeover.handover`), the move ends as for any
        answer (:meth:`Mover.move`: ``run-here`` thaws the job here, ``gone`` stops it
        here as ``migrated``; the reclaim's record of it goes). Not stored first: an agent stop in
        that moment leaves the reclaim's record, and the restart asks the node again."""
        jid = mv.job
        a = self.host.takeover.asking[jid]
        node, since = int(a["node"]), a["since"] or time.time()
        await self._await_waiter(jid, decision, lambda: jid not in self.host.takeover.asking)
        jobs_mgr = self.host.agent.jobs
        job = jobs_mgr.get(jid) if jobs_mgr is not None else None
        if decision == "run-here" and mv.phase == "failed" and job is not None and job.active:
            self._drop_keeper(jid, node)  # (Mover._move_to made node its keeper with the keeper it handed it)
            self.host.prestage.owe_release(node, mv.key)  # (the placement's Release went with the move's end)
            self.host._spawn(self.host.prestage.release(node, mv.key))
        state = None if job is None else job.state
        self.host._emit(f"{jid}: its reclaim move's hand-over to node {node}, unanswered since {time.ctime(since)}, "
                        f"settled by {by or 'an operator'}: " + (f"node {node} does not run it, it runs here"
                                                                 if decision == "run-here" else
                                                                 f"node {node} runs it, stopped here")
                        + f" (state {state})",
                        job=jid, node=node, decision=decision, phase="settled", by=by)
        return {"job": jid, "kind": "move", "node": node, "decision": decision, "state": state}

    def tell_release(self, node: int, pid: int, key: str) -> None:
        """``node`` releases the placement (best effort: its reservation also lapses by itself)
        and the keeper (:meth:`Prestage.release`: recorded here first, sent until ``node`` answers, also
        after a restart, and once ``node`` is in the zone's roster again if it left it)."""
        from laminar.zone import wire

        z = self.host.zone
        with contextlib.suppress(Exception):
            if z is not None and node in z.membership.by_node:
                z.submitter.t.send(node, wire.Release(pid))
        self.host.prestage.owe_release(node, key)  # before the task: a stop that cancels it unstarted loses nothing
        self.host._spawn(self.host.prestage.release(node, key))

    def _drop_keeper(self, job_id: str, node: int, db: Any = None) -> None:
        """``node`` is no longer ``job_id``'s keeper (an operator settled that it does not run the
        job it was handed with the keeper): its keeper is released, not kept as the job's."""
        if self.host.prestage.keeper.get(job_id) == node:
            self.host.prestage.keeper.pop(job_id, None)
            if db is not None:
                db.execute("DELETE FROM migrate_keepers WHERE job_id=? AND node=?", (job_id, node))
            else:
                self.host.prestage.forget_keeper(job_id)

    async def stop_settled(self, job: Any, node: int, how: str) -> None:
        """Stops ``job`` here (state ``migrated``) as an operator settled: ``node`` runs it."""
        with contextlib.suppress(Exception):
            await set_frozen_async(job.cgroup, False, 2.0)  # a frozen job is not killed by a signal until it thaws
        try:
            await jobs_of(self.host.agent).stop(job.id, f"migrated to node {node}: an operator settled its unanswered "
                                            f"hand-over as taken there ({how})", grace_s=1.0, state="migrated",
                                            cause=EndCause.MIGRATED)
        except Exception as e:
            log.warning("migrate: stopping %s, settled as run by node %d: %s", job.id, node, e)
        self.host.mover.drop_record(job.id)
        self.host.evacuating.discard(job.id)  # (held by Mover.restore: no reclaim's move of it meanwhile)

    async def _settle_move(self, jid: str, row: Any, decision: str, by: str) -> dict[str, Any]:
        node, pid, thaw = int(row["node"]), int(row["pid"]), bool(row["thaw"])
        since = (self.host.takeover.asking.get(jid) or {}).get("since") or float(row["updated"])
        jobs_mgr = self.host.agent.jobs
        job = jobs_mgr.get(jid) if jobs_mgr is not None else None
        key = self.host.job_key(job) if job is not None and job.active else None
        with self.host.agent.store.tx() as db:  # the decision first: a restart finishes it (Mover.restore)
            ledger.record_move(db, jid, moves.Event.RUN_HERE if decision == "run-here" else moves.Event.SETTLE_GONE,
                               only=ledger.WINDOWLESS, counts=self.host.counts)
            if decision == "run-here" and key is not None:
                # node drops the keeper Mover._move_to handed it (owed before anything else: sent after a restart too)
                self._drop_keeper(jid, node, db)
                self.host.prestage.owe_release(node, key, db)
        rec = lambda: ledger.move_phase(self.host.agent.store.db, jid, ledger.WINDOWLESS) is moves.Phase.NEW  # noqa: E731
        if not await self._await_waiter(jid, decision, rec):
            if job is None or not job.active:
                self.host.mover.drop_record(jid)
                self.host.evacuating.discard(jid)  # (held by Mover.settle_cut while node could not be asked)
            elif decision == "gone":
                await self.stop_settled(job, node, f"by {by or 'an operator'}")
            else:
                with contextlib.suppress(Exception):  # the move's hold ends (runtime/holds.py)
                    await self.host.mover.unhold_wait(job, thaw, 2.0)
                self.host.mover.drop_record(jid)
                self.host.evacuating.discard(jid)  # (held by Mover.settle_cut while node could not be asked)
        if key is not None and decision == "run-here":
            if job is not None and job.active:  # (not when node answered: it runs it)
                self.tell_release(node, pid, key)
            else:
                self.host.prestage.drop_release((node, key))
        mv = self.host.moves.get(jid)
        if mv is not None and mv.phase == "handover" and mv.dest == node:  # (not its hand-over to another node)
            mv.phase, mv.ended = ("failed" if decision == "run-here" else "done"), time.time()
            mv.error = f"settled by an operator: {decision}"
        state = None if job is None else job.state
        self.host._emit(f"{jid}: its hand-over to node {node}, unanswered since {time.ctime(since)}, settled by "
                        f"{by or 'an operator'}: " + (f"node {node} does not run it, it runs here"
                                                      + (" (thawed)" if thaw else "") if decision == "run-here"
                                                      else f"node {node} runs it, stopped here") + f" (state {state})",
                        job=jid, node=node, decision=decision, phase="settled", by=by)
        return {"job": jid, "kind": "move", "node": node, "decision": decision, "state": state}

    async def _settle_placement(self, key: str, row: Any, decision: str, by: str) -> dict[str, Any]:
        node, pid = int(row["node"]), int(row["pid"])
        if decision == "gone":  # the decision first: a restart never asks node again
            self.host.takeover.set_replica(key, custody.Event.PLACE, f"node {node}/(unconfirmed)")
        self.host.takeover.drop_replica_handover(key)
        rec = lambda: key not in self.host.takeover.asking  # noqa: E731
        if not await self._await_waiter(key, decision, rec):
            self.host.takeover.taking.discard(key)  # held since the restart (Takeover.restore_replica_handovers)
            if decision == "run-here":
                self.tell_release(node, pid, key)
        r = self.host.agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
        state = None if r is None else str(r["state"])
        self.host._emit(f"{key}: its placement's hand-over to node {node} settled by {by or 'an operator'}: "
                        + (f"node {node} does not run it, the keeper goes on" if decision == "run-here"
                           else f"node {node} runs it (placed)"), key=key, node=node, decision=decision,
                        phase="settled", by=by)
        return {"job": key, "kind": "placement", "node": node, "decision": decision, "state": state}
