"""This node's reclaim: the evacuation within a notice window (:class:`Evacuation`, a part of
:class:`laminar.migrate.reclaim.ReclaimComponent`: its ``evacuation``).

:meth:`Evacuation.announce` takes an owner's notice (``laminarctl reclaim``, ``POST /v1/reclaim``),
or forwards it to another node's agent; :meth:`Evacuation.start` stores the window and begins it:
the queue held, the node drained in the zone and in the schedulers it works beside
(:mod:`laminar.sched`), the kill-switch armed for the window's end, the
plan of :func:`laminar.policy.ckpt_schedule.notice_schedule` run one move per job
(:meth:`laminar.migrate.mover.Mover.move`; a job adopted from a scheduler is checkpointed and given
back to it instead: :meth:`laminar.sched.component.SchedulerComponent.evacuate`), the keepers this node holds passed on
(:meth:`laminar.migrate.keepers.Keepers.pass_keepers`), and at the window's end whatever still
runs stopped (state ``reclaimed``). :meth:`Evacuation.cancel` withdraws it
(:meth:`laminar.migrate.withdraw.Withdraw.cancel_reclaim`). The reclaim's own move records
(``migrate_moves``, cause ``reclaim``: :meth:`Evacuation.note_move`, :meth:`Evacuation.forget_move`,
:meth:`Evacuation.move_phases`) say what a restart must not do twice.

The reclaim is stored with its window's end in wall-clock time (table ``migrate_reclaim``) and by
the boot's clock (:func:`drain.window_left`: a step of the wall clock does not move it): an
agent restarted inside the window restores it (queue hold, draining, kill-switch, the evacuation
of what has not moved; nothing that must not run twice runs twice: :meth:`Evacuation._begin`),
and one started after the window ended clears it (the owner gave the node back), with an event.


The state it shares with the other parts stays on the component: ``reclaim`` (this node's
reclaim in progress), ``notices`` (the peers'), ``evacuating`` and ``moves``. It keeps the
prestage rule's fit of every job's final checkpoint in a notice window
(:meth:`Evacuation.fits_window`, by :func:`laminar.policy.ckpt_schedule.notice_fit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

from laminar.components import jobs_of
from laminar.migrate import drain, ledger
from laminar.migrate.constants import WINDOW_ENDED
from laminar.migrate.errors import MigrateError
from laminar.migrate.transfer import TransferError
from laminar.policy import ckpt_schedule as cs
from laminar.policy import moves as mp
from laminar.policy.endcause import EndCause
from laminar.runtime.holds import Hold, Holds

if TYPE_CHECKING:
    from laminar.components import MigrateAgent
    from laminar.migrate.archive import Archive
    from laminar.migrate.checkpoints import Checkpoints
    from laminar.migrate.evidence import Evidence
    from laminar.migrate.fence import Fence
    from laminar.migrate.keepers import Keepers
    from laminar.migrate.mover import Move, Mover
    from laminar.migrate.withdraw import Withdraw

log = logging.getLogger("laminar.migrate")

# A job writes its checkpoint at its next step boundary: plan for this much until one has been seen.
DEFAULT_CKPT_PAUSE_S = 2.0

# The prestage rule's fit of all jobs' final checkpoints in a notice window is computed at most
# this often (a prestage round is every poll_s; the sizes it reads change at commits only).
PRESTAGE_FIT_S = 0.25


def parse_duration(v: Any) -> float:
    """60, 60.0, "60", "60s", "2m", "1h" -> seconds. Raises ValueError naming the value (cut:
    laminar.inputs.brief); text longer than NUMBER_TEXT_MAX and integers past a float (10**400:
    an OverflowError, a 500 before) included."""
    from laminar.inputs import NUMBER_TEXT_MAX, brief

    bad = f"duration {brief(v)}: expected seconds or a number with s, m or h (60s, 2m)"
    if isinstance(v, bool):
        raise ValueError(bad)
    if isinstance(v, int | float):
        try:
            secs = float(v)
        except OverflowError:
            raise ValueError(f"duration {brief(v)}: must be > 0 and finite") from None
    else:
        t = str(v).strip().lower()
        if len(t) > NUMBER_TEXT_MAX or not t.isascii():
            raise ValueError(bad)
        mult = {"s": 1.0, "m": 60.0, "h": 3600.0}.get(t[-1:], None)
        num = t[:-1] if mult else t
        try:
            secs = float(num) * (mult or 1.0)
        except ValueError:
            raise ValueError(bad) from None
    if not math.isfinite(secs) or secs <= 0:
        raise ValueError(f"duration {brief(v)}: must be > 0")
    return secs


class EvacuationHost(Protocol):
    """What :class:`Evacuation` uses of the component that holds it (ReclaimComponent and its parts)."""

    _archive_keeps: set[str]
    _drain_task: asyncio.Task[Any] | None
    agent: MigrateAgent
    archive: Archive
    evidence: Evidence
    checkpoints: Checkpoints
    ckpt_latency: dict[str, float]
    counts: dict[str, int]
    evacuating: set[str]
    fence: Fence
    keepers: Keepers
    mover: Mover
    moves: dict[str, Move]
    notices: dict[int, tuple[float, float]]
    reclaim: dict[str, Any] | None
    s: dict[str, Any]
    withdraw: Withdraw

    async def _control(self, node: int, op: str, body: Any, timeout: float = 5.0) -> Any: ...
    def _emit(self, message: str, **fields: Any) -> None: ...
    def _holds(self) -> Holds: ...
    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...
    @property
    def node_id(self) -> int: ...


class Evacuation:
    """This node's reclaim, its window and its plan (see the module's doc): a part of
    :class:`laminar.migrate.reclaim.ReclaimComponent` (its ``evacuation``). ``host``: the component."""

    def __init__(self, host: EvacuationHost) -> None:
        self.host = host
        # the prestage rule's fit of every job's final checkpoint in a notice window, computed
        # once per round for all jobs (fits_window): (when, job id -> fits)
        self._fit: tuple[float, dict[str, bool]] = (-math.inf, {})

    def fits_window(self, job: Any, w: float) -> bool:
        """Whether ``job``'s final checkpoint fits a notice window of ``w`` (the prestage rule's fit)."""
        # The reclaim moves every job of the node through one uplink in one window
        # (notice_schedule): a job whose final checkpoint fits the window alone may not fit
        # beside its neighbours, so fit is judged over all of them, as the evacuation plans.
        # Once per round for all of them (PRESTAGE_FIT_S), from the sizes known (no file read):
        # judged per job, a round was quadratic in the jobs of the node.
        at, fits = self._fit
        if time.monotonic() - at > PRESTAGE_FIT_S or job.id not in fits:
            jobs_mgr = self.host.agent.jobs
            others = [j for j in (jobs_mgr.active() if jobs_mgr is not None else []) if j.id != job.id]
            link = float(self.host.s["path_mbit"]) * 1e6 / 8
            cands = [cs.CkptJob(j.id, float(self.host.checkpoints.ckpt_bytes(j))) for j in (job, *others)]
            fits = cs.notice_fit(cands, link, w, float(self.host.s["notice_margin"]))
            self._fit = (time.monotonic(), fits)
        return fits[job.id]

    async def announce(self, notice_s: float, node: int | None = None, reason: str = "") -> dict[str, Any]:
        """A reclaim of ``node`` (None or this node: here) with ``notice_s`` of notice. Another
        node's reclaim is forwarded to its agent (authenticated control message). Raises
        MigrateError for a node outside the zone or one that cannot be reached."""
        notice_s = parse_duration(notice_s)
        reason = reason or "reclaim announced"
        if node is not None and node != self.host.node_id:
            try:
                res = await self.host._control(node, "reclaim", {"notice_s": notice_s, "reason": reason, "ts": time.time()})
            except (OSError, TimeoutError, TransferError) as e:
                raise MigrateError(f"reclaim of node {node}: its agent did not take the notice: {e}") from None
            return {"forwarded_to": node, **(res or {})}
        return self.start(notice_s, reason)

    async def cancel(self, node: int | None = None, reason: str = "") -> dict[str, Any]:
        """Cancels the reclaim of ``node`` (None or this node: here, :meth:`Withdraw.cancel_reclaim`);
        another node's cancel is forwarded to its agent (control op ``reclaim-cancel``) as the
        reclaim itself is. Raises LookupError when that node has no reclaim, MigrateError for a
        node outside the zone, one that cannot be reached, or a cancel already running."""
        if node is None or node == self.host.node_id:
            return await self.host.withdraw.cancel_reclaim(reason)
        try:
            res = await self.host._control(node, "reclaim-cancel", {"reason": reason, "ts": time.time()}, timeout=30.0)
        except (OSError, TimeoutError, TransferError) as e:
            raise MigrateError(f"reclaim cancel of node {node}: its agent did not take it: {e}") from None
        if isinstance(res, dict) and "refused" in res:
            raise (LookupError if res.get("not_found") else MigrateError)(str(res["refused"]))
        return {"forwarded_to": node, **(res or {})}

    def start(self, notice_s: float, reason: str) -> dict[str, Any]:
        """Plans and starts the evacuation of this node (idempotent while one runs: the earlier
        window stays, a shorter one replaces it). Stored (``migrate_reclaim``) so that an agent
        restarted inside the window restores it (:meth:`restore`)."""
        now = time.time()
        end = now + notice_s
        if self.host.reclaim is not None and not self.host.reclaim["task"].done():
            if end >= self.host.reclaim["deadline"]:
                return self.status()
            self.host.reclaim["task"].cancel()
        elif not self.host.withdraw.cancelling:  # a new reclaim: what an earlier one did to jobs is history
            # (not while a cancel runs: its placement in flight is this reclaim's to remember), but
            # a move still finishing (a cancelled reclaim's) keeps its record: a restart settles it
            with self.host.agent.store.tx() as db:
                ledger.drop_moves(db, [j for j in self.move_phases() if j not in self.host.evacuating], only=mp.WINDOWED,
                                  counts=self.host.counts)
        with self.host.agent.store.tx() as db:
            db.execute("DELETE FROM migrate_reclaim")
            db.execute("INSERT INTO migrate_reclaim VALUES (?, ?, ?, ?, ?)", (self.host.node_id, notice_s, reason, now, end))
        drain.note_window(self.host.agent.store, now, notice_s)  # the end by the boot's clock: a wall-clock step moves it not
        self.host.agent.store.del_meta(drain.CANCEL_META)  # a cancel under way is superseded: a restart restores this one
        self.host.evidence.observe_departure(now, announced=True)
        self._begin(notice_s, reason, now, end, restored=False)
        return self.status()

    def restore(self) -> None:
        """At start: a stored reclaim whose window is still open is restored (the queue hold,
        draining in the zone, the kill-switch armed for the window's end, the evacuation of what
        has not moved; :meth:`_begin`); one whose window ended is cleared (the owner took
        the node and gave it back: it is a node again), with a ``migrate`` event saying so."""
        db = self.host.agent.store.db
        row = db.execute("SELECT * FROM migrate_reclaim").fetchone()
        marker = self.host.agent.store.get_meta(drain.CANCEL_META)
        if marker is not None or row is None:
            # a cancel the agent's restart interrupted: what it left is settled as it would have
            with self.host.agent.store.tx() as tx:
                tx.execute("DELETE FROM migrate_reclaim")
            phases = self.move_phases()
            if marker is not None or phases:
                self.host._spawn(self.host.withdraw.settle_cancelled(phases, marker if isinstance(marker, dict) else None))
            return
        now = time.time()
        # what is left by the boot's clock (a step of the wall clock since does not count), or
        # after a reboot by the wall clock, never more than the notice
        left = drain.window_left(self.host.agent.store, float(row["notice_s"]), float(row["announced"]),
                                 float(row["deadline"]))
        end = now + left
        if abs(end - float(row["deadline"])) < 1.0:
            end = float(row["deadline"])  # the clocks agree: the end as stored (and as the keepers were told)
        if left <= 0:
            with self.host.agent.store.tx() as tx:
                tx.execute("DELETE FROM migrate_reclaim")
                ledger.drop_moves(tx, self.move_phases(), only=mp.WINDOWED, counts=self.host.counts)
            jobs_mgr = self.host.agent.jobs
            if jobs_mgr is not None and getattr(jobs_mgr, "held", None) == drain.hold_reason(int(row["node"])):
                jobs_mgr.hold_queue(None)  # the window ended between the job manager's start and this one
            cut = self._cut_at_window_end(float(row["announced"]))
            for j in cut:  # what the window's end does: the agent was down then (its keeper resumes it)
                self.host._spawn(self._stop_cut(j))
            self.host._emit(f"reclaim of node {row['node']} cleared: its window ended {-left:.1f} s before this "
                       "agent started (the owner gave the node back); it takes jobs again"
                       + (f"; stopped as reclaimed, their traffic cut at the window's end: {', '.join(j.id for j in cut)}"
                          if cut else ""), phase="reclaim-cleared", notice_s=float(row["notice_s"]), window_end=end,
                       reason=str(row["reason"]), stopped=[j.id for j in cut])
            # the peers forget its notice
            self.host._spawn(self.host.withdraw.retell_withdrawn(None, 0.0, at_once=True, marker=False))
            if self.host.agent.schedulers is not None:  # and the schedulers place work here again
                self.host._spawn(self.host.agent.schedulers.undrain("the reclaim's window ended while the agent was down"))
            return
        self._begin(float(row["notice_s"]), str(row["reason"]), float(row["announced"]), end, restored=True)

    def _begin(self, notice_s: float, reason: str, announced: float, end: float, restored: bool) -> None:
        """Carries out this node's reclaim whose window ends at ``end`` (wall clock): holds the
        queue, drains the node in the zone (peers told of what is left of the window), arms the
        kill-switch of every active job for the window's end, plans and runs the evacuation and
        the placement of queued jobs elsewhere. ``restored``: the agent restarted inside the
        window: what must not run twice does not (the hazard's departure is not counted again; a
        job whose hand-over was sent is stopped here, not moved again; one its move froze is
        thawed and moved again; a queued job whose placement was not settled stays queued)."""
        left = max(0.0, end - time.time())
        jobs_mgr = self.host.agent.jobs
        active = list(jobs_mgr.active()) if jobs_mgr is not None else []
        if jobs_mgr is not None and hasattr(jobs_mgr, "hold_queue"):
            # the room the moves free must not start queued jobs on a node about to go (drain.py)
            jobs_mgr.hold_queue(drain.hold_reason(self.host.node_id))
        z = self.host.agent.zone
        told = 0
        if z is not None:
            with contextlib.suppress(Exception):
                told = z.reclaim_notice(left, reason)
        sch = self.host.agent.schedulers
        if sch is not None:  # nothing new placed here by the schedulers this node works beside (laminar.sched)
            sch.start_drain(reason)
        deadline_ns = time.monotonic_ns() + int(left * 1e9)
        armed = []
        ng = self.host.agent.netguard
        for j in active:
            if ng is not None:
                try:
                    ng.arm_job(j.cgroup_id, deadline_ns)
                    armed.append(j.id)
                except Exception as e:
                    log.warning("migrate: arming the kill-switch of %s failed: %s", j.id, e)
        phases = self.move_phases() if restored else {}
        handed = [j for j in active if phases.get(j.id, ("", None))[0] == "handover"]
        # a job whose archived record was being published when the agent stopped is stopped, not
        # moved again (StoppedCopies.restore_late_copies): the archive resumes it
        active = [j for j in active if j not in handed and j.id not in self.host.archive.stopped.late_stopping]
        for j in active:
            if phases.get(j.id, ("", None))[0] == "frozen":  # its move froze it: it checkpoints again
                with contextlib.suppress(Exception):
                    self.host._holds().reattach(j, Hold.MOVE)
                    self.host._holds().release(j, Hold.MOVE, timeout=0)  # asked; not waited for (on the loop)
        for j in handed:
            self.host._spawn(self.host.withdraw.stop_handed(j, phases[j.id][1]))
        placing = [jid for jid, (ph, _) in phases.items() if ph == "placing"
                   and jobs_mgr is not None and getattr(jobs_mgr.get(jid), "state", None) == "queued"]
        link = float(self.host.s["path_mbit"]) * 1e6 / 8
        # A job adopted from a scheduler is given back to it (laminar.sched: its checkpoint stays
        # in its shared checkpoint directory), never sent over the uplink: not in the plan.
        moved = [j for j in active if sch is None or not sch.handles(j)]
        # A job's checkpoint is not instant: it is written at its next step boundary. The pause
        # planned for is what this job took last time (else DEFAULT_CKPT_PAUSE_S).
        plan = cs.notice_schedule([cs.CkptJob(j.id, float(self.host.checkpoints.ckpt_bytes(j)),
                                              pause_s=self.host.ckpt_latency.get(j.id, DEFAULT_CKPT_PAUSE_S))
                                   for j in moved], link, left, float(self.host.s["notice_margin"]))
        steps = {st.job_id: st for st in plan}
        now_mono = time.monotonic()
        self.host.reclaim = {"notice_s": notice_s, "reason": reason, "announced": announced, "deadline": end,
                        "deadline_mono": now_mono + left, "planned_mono": now_mono, "peers_told": told,
                        "armed": armed, "plan": [st.__dict__ for st in plan], "cancel": asyncio.Event()}
        if restored:
            self.host.reclaim["restored"] = time.time()
            self.host.reclaim["handed_over"] = [j.id for j in handed]
        self.host.reclaim["task"] = self.host._spawn(self._execute(active, steps))
        if self.host._drain_task is None or self.host._drain_task.done():  # one drain; it follows a shorter window
            self.host._drain_task = self.host._spawn(drain.place_queued_elsewhere(
                self.host, lambda: float(self.host.reclaim["deadline_mono"]) if self.host.reclaim else 0.0, skip=placing))
        for jid in placing:
            self.host._emit(f"queued job {jid} stays queued on reclaimed node {self.host.node_id}, held: its placement "
                       "elsewhere was asked for before the agent restarted and may have run there", job=jid,
                       outcome="unsettled")
        if restored:
            self.host._emit(f"reclaim of node {self.host.node_id} restored after an agent restart: {left:.1f} s of its window "
                       f"left; queue held, kill-switch armed for {len(armed)} jobs, {len(active)} jobs to move"
                       + (f", {len(handed)} handed over before the restart stopped here" if handed else ""),
                       phase="reclaim-restored", left_s=round(left, 3), jobs=[j.id for j in active],
                       handed_over=[j.id for j in handed], peers_told=told, plan=self.host.reclaim["plan"])
            return
        self.host._emit(f"reclaim of node {self.host.node_id} announced: {notice_s:g} s of notice ({reason}); "
                   f"{len(active)} jobs to move, kill-switch armed for the window's end",
                   notice_s=notice_s, jobs=[j.id for j in active], peers_told=told, plan=self.host.reclaim["plan"])

    def _cut_at_window_end(self, announced: float) -> list[Any]:
        """The running jobs of a reclaim whose window ended while no agent ran: those the
        reclaim armed (running when it was announced, wall clock ``announced``) whose armed
        deadline has passed, so the data plane cuts their traffic (the pinned maps outlived the
        agent); nobody stopped them at the window's end."""
        from laminar.bpf import abi
        from laminar.net.killswitch import cut_by_deadline

        jobs_mgr = self.host.agent.jobs
        ng = self.host.agent.netguard
        if jobs_mgr is None or ng is None:
            return []
        out = []
        for j in jobs_mgr.active():
            if j.started is not None and j.started > announced:
                continue  # started after the notice: the reclaim did not arm it
            try:
                e = ng.job_entry(j.cgroup_id)
            except Exception:
                continue
            if e is not None and cut_by_deadline(e.flags, e.kill_at_ns, abi.LM_JOB_ARMED):
                out.append(j)
        return out

    async def _stop_cut(self, job: Any) -> None:
        try:
            await jobs_of(self.host.agent).stop(job.id, f"node {self.host.node_id} reclaimed: {WINDOW_ENDED} while the agent "
                                       "was down, before the job moved (its traffic was cut then)", grace_s=0,
                                       state="reclaimed", cause=EndCause.WINDOW_ENDED)
        except Exception as e:
            log.warning("migrate: stopping %s, cut at the window's end while the agent was down: %s", job.id, e)

    def move_phases(self) -> dict[str, tuple[str, int | None]]:
        """The reclaim's move records (``migrate_moves``, cause ``reclaim``): job id -> (phase, node)."""
        return {str(r["job_id"]): (str(r["phase"]), None if r["node"] is None else int(r["node"]))
                for r in ledger.move_records(self.host.agent.store.db, mp.WINDOWED)}

    def note_move(self, job_id: str, event: mp.Event, node: int | None = None, pid: int | None = None,
                   request: dict[str, Any] | None = None) -> None:
        """Records what the reclaim did to ``job_id`` that a restart must not do twice
        (``migrate_moves``, cause ``reclaim``): ``freeze`` (its move froze it), ``hand-over``
        (with the node, its placement id and the request), ``place``."""
        with self.host.agent.store.tx() as db:
            ledger.record_move(db, job_id, event, cause=mp.Cause.RECLAIM, thaw=event is mp.Event.FREEZE, node=node,
                               pid=pid, request=request, counts=self.host.counts)

    def forget_move(self, job_id: str) -> None:
        """The reclaim's record of ``job_id``'s move goes."""
        with self.host.agent.store.tx() as db:
            ledger.drop_moves(db, [job_id], only=mp.WINDOWED, counts=self.host.counts)

    def status(self) -> dict[str, Any]:
        r = self.host.reclaim
        out: dict[str, Any] = {"node": self.host.node_id, "reclaim": None,
                               "notices": {str(n): {"window_end": e, "received": rcv} for n, (e, rcv) in self.host.notices.items()}}
        if r is not None:
            out["reclaim"] = {k: v for k, v in r.items() if k not in ("task", "cancel")} | {
                "left_s": round(max(0.0, r["deadline"] - time.time()), 3), "done": r["task"].done()}
        return out

    async def _execute(self, jobs: list[Any], steps: dict[str, cs.NoticeStep]) -> None:
        """The evacuation, then, at the window's end, the stop of what still runs. Withdrawn
        (``cancel`` set, :meth:`Withdraw.cancel_reclaim`): no move begins any more, a move already begun
        finishes (never cut: its job must not stay frozen or end up nowhere) and nothing is
        stopped at the window's end."""
        assert self.host.reclaim is not None
        t0 = self.host.reclaim["planned_mono"]
        deadline = self.host.reclaim["deadline_mono"]
        cancel: asyncio.Event = self.host.reclaim["cancel"]

        async def one(job: Any) -> None:
            st = steps.get(job.id)
            if st is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), max(0.0, t0 + st.signal_at_s - time.monotonic()))
            while job.id in self.host.evacuating and not cancel.is_set():
                # a move begun before this reclaim (a withdrawn reclaim's, finishing; Airlock's,
                # a loan's) runs on: never two moves of one job (two hand-overs: two copies)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), 0.2)
            while job.id in self.host.fence.fenced_jobs and job.active and not cancel.is_set():
                # fenced (this node heard none of its zone; fence.py): the zone may have taken it
                # over, and a move now would start a second lineage of it. Its settling stops it
                # (taken over) or thaws it (moved then); unsettled at the window's end, it is
                # stopped there as the rest (its keeper resumes it)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), 0.2)
            if cancel.is_set():
                return  # withdrawn before this job's move began
            if not job.active:
                return  # the earlier move took it away (or it ended, or its fence settled it as taken)
            sch = self.host.agent.schedulers
            if sch is not None and sch.handles(job):
                # adopted from a scheduler: checkpointed and given back to it (requeued), which
                # runs it again elsewhere from that checkpoint (laminar.sched.component). Being
                # moved away meanwhile: Airlock neither freezes it in its checkpoint nor kills it,
                # no archive or prestage of it begins (as a move's job)
                self.host.evacuating.add(job.id)
                try:
                    await sch.evacuate(job, deadline, cancel)
                finally:
                    self.host.evacuating.discard(job.id)
                return
            prev = self.host.moves.get(job.id)
            if prev is not None and job.id in self.host._archive_keeps:
                await self.host.keepers.stop_archived(job, prev)  # an earlier plan's move, cut while it stopped the job
                return
            await self.host.mover.move(job, f"reclaim of node {self.host.node_id}", deadline, final=st is None or st.final,
                             transfer_deadline=None if st is None else t0 + st.deadline_s)

        work = asyncio.ensure_future(asyncio.gather(*(one(j) for j in jobs), self.host.keepers.pass_keepers(deadline, cancel),
                                                    return_exceptions=True))
        # cut with its moves still unwinding, a gather ends with a CancelledError that the cut
        # (which re-raises its own) never reads: read here, or asyncio logs it as never retrieved
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait({work}, timeout=max(0.0, deadline - time.monotonic()))
            if not cancel.is_set():
                if not work.done():  # the window ended: what is still moving is cut
                    work.cancel()
                    await asyncio.wait({work})  # (a cancel of this task itself still propagates)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cancel.wait(), max(0.0, deadline - time.monotonic()))
            if cancel.is_set():
                await asyncio.wait({work})  # moves begun before the withdrawal finish (or fail and thaw their job)
                return
        except asyncio.CancelledError:  # a shorter window replaced this one, or the agent stops
            work.cancel()
            raise
        jobs_mgr = jobs_of(self.host.agent)
        for j in list(jobs_mgr.active()):
            if cancel.is_set():
                return  # withdrawn while the window's end stopped jobs: the rest run on
            try:
                await jobs_mgr.stop(j.id, f"node {self.host.node_id} reclaimed: {WINDOW_ENDED} before the job moved",
                                    grace_s=0, state="reclaimed", cause=EndCause.WINDOW_ENDED)
            except Exception as e:
                log.debug("migrate: stopping %s at the window's end: %s", j.id, e)
        self.host._emit(f"reclaim of node {self.host.node_id}: window ended", moved=self.host.counts["moved"])
