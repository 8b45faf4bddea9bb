"""Jobs handed to this node (:class:`Handovers`, a part of
:class:`laminar.zone.component.ZoneComponent`: its ``handovers``).

A submitter that took this node's offer hands its job over on TCP (or in process, for this
node's own placements): :meth:`Handovers.on_handover` binds the reservation (once per
placement id and sender: a repeat gets the same answer), checks the peer's authority
(:func:`laminar.zone.authority.peer_run_as`), sheds the GPUs elastic jobs were granted,
verifies a migrated job's checkpoint and starts the job through the job manager. A job started
for a placement is recorded in the store (``zone_placed``) so that a restart reattaches it
(:meth:`Handovers.reattach`) and a repeated hand-over answers the same job id;
:meth:`Handovers.tick` gives capacity back when placed jobs end.

The migration layer asks about placements bound here through :meth:`placement_pending`,
:meth:`forgo_placement` and :meth:`job_for_placement`, and its take-over of a migrated job is
answered here (:meth:`laminar.migrate.takeover.Takeover.taken_over_as`).

State: the hand-overs being answered (:attr:`Handovers.inflight`); the reservations are the
arbiter's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from laminar.policy import placement as pl
from laminar.userbounds import Busy
from laminar.zone import authority, wire
from laminar.zone.arbiter import (
    HANDOVER_ERROR,
    HANDOVER_NO_RESERVATION,
    HANDOVER_OK,
    HANDOVER_REJECTED,
    Arbiter,
    Placed,
)
from laminar.zone.authority import Policy, Refusals

if TYPE_CHECKING:
    from laminar.components import ZoneAgent
    from laminar.zone.loan import LoanManager

log = logging.getLogger("laminar.zone")


class HandoversHost(Protocol):
    """What :class:`Handovers` uses of the component that holds it (ZoneComponent)."""

    _jobs: Any
    agent: ZoneAgent | None
    arbiter: Arbiter
    authority: Refusals
    clock: Callable[[], float]
    counts: dict[str, int]
    gpu_index: list[int]
    loan: LoanManager
    node_id: int
    policy: Policy

    def _emit(self, message: str, **fields: Any) -> None: ...
    def refresh_inventory(self) -> None: ...


class Handovers:
    """The node side of hand-overs (see the module's doc): a part of
    :class:`laminar.zone.component.ZoneComponent` (its ``handovers``). ``host``: the component."""

    def __init__(self, host: HandoversHost) -> None:
        self.host = host
        # a hand-over being answered, by (sender, placement id): a repeat awaits its answer
        self.inflight: dict[tuple[int, int], asyncio.Future[wire.HandoverAck]] = {}

    def reattach(self, store: Any) -> None:
        """At start, from the store's ``zone_placed`` (the component made the table): the
        placements whose jobs still run are bound here again; the others' rows go."""
        # reattach placed jobs that still run: their capacity stays taken, a repeated hand-over
        # answers the same job id
        for pid, job_id, demand, alloc, sub, since in store.db.execute(
                "SELECT placement_id, job_id, demand, gpu_alloc, submitter, since FROM zone_placed").fetchall():
            job = self.host._jobs.get(job_id) if self.host._jobs is not None else None
            if job is None or not getattr(job, "live", getattr(job, "active", False)):
                with store.tx() as db:
                    db.execute("DELETE FROM zone_placed WHERE placement_id=?", (pid,))
                continue
            d = pl.Demand(**json.loads(demand))
            r = pl.Reservation(pid, d, tuple((int(i), float(f)) for i, f in json.loads(alloc)), math.inf, True)
            self.host.arbiter.placed[pid] = Placed(r, job_id, sub, since)
            if hasattr(getattr(self.host._jobs, "table", None), "backfill_origin"):
                # a job placed by an agent of an older release: its placement and GPU share were
                # only in its env; this table is the agent's own record of them (provenance)
                self.host._jobs.table.backfill_origin(job_id, placement_id=int(pid), gpu_share=self._share_of(r.gpu_alloc))

    def _work_slot(self, uid: int) -> Any:
        """One of `uid`'s worker-thread slots (laminar.api ``work``) while the block runs; Busy
        past its share. None held where the agent has no API (tests)."""
        api = self.host.agent.api if self.host.agent is not None else None
        work = api.work if api is not None else None
        return work.hold(uid) if work is not None else contextlib.nullcontext()


    def _store_placed(self, p: Placed) -> None:
        store = self.host.agent.store if self.host.agent is not None else None
        if store is None:
            return
        d = p.reservation.demand
        with store.tx() as db:
            db.execute("INSERT OR REPLACE INTO zone_placed VALUES (?, ?, ?, ?, ?, ?)", (
                p.reservation.placement_id, p.job_id,
                json.dumps({"gpus": d.gpus, "cpus": d.cpus, "memory_mb": d.memory_mb, "gpu_model": d.gpu_model,
                            "pool": d.pool}),
                json.dumps(p.reservation.gpu_alloc), p.submitter, p.since))

    def _unstore_placed(self, pid: int) -> None:
        store = self.host.agent.store if self.host.agent is not None else None
        if store is not None:
            with store.tx() as db:
                db.execute("DELETE FROM zone_placed WHERE placement_id=?", (pid,))

    async def _taken_over_as(self, pid: int, body: wire.Handover) -> str | None:
        """For a hand-over not bound here yet of a migrated job (its request's origin names the
        job's migration key, laminar.runtime.provenance; never its spec's env, which a user
        writes): the job this node's migration layer took that job over as, here, or is starting
        it as (waited for: :meth:`laminar.migrate.takeover.Takeover.taken_over_as`); else
        None, without suspending (so the bind that follows is in the same step as this look)."""
        from laminar.runtime.provenance import origin_of_request

        migrate = self.host.agent.migrate if self.host.agent is not None else None
        if pid in self.host.arbiter.placed or migrate is None:
            return None
        try:
            key = origin_of_request(json.loads(body.spec_json))[0]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # refused with its reason by the hand-over's own parse
        if key is None:
            return None
        got = await migrate.takeover.taken_over_as(key)
        return None if got is None else str(got)

    def placement_pending(self, pid: int) -> bool:
        """Whether placement ``pid``'s hand-over is bound on this node and not answered yet: its
        capacity taken, the job's start (checkpoint check, job manager) under way. False when it
        never came, was refused, or started its job (:meth:`job_for_placement` finds that one).
        The migration layer's take-over of a job a placement hands here waits while this holds."""
        p = self.host.arbiter.placed.get(pid)
        return p is not None and not p.job_id

    def forgo_placement(self, pid: int) -> None:
        """Drops the reservation this node holds for placement ``pid`` (an offer, committed or
        lapsed), so that its hand-over, should it still come, binds nothing here. A bound
        placement (:meth:`placement_pending`, or its job started) is left alone."""
        self.host.arbiter.held.pop(pid, None)
        self.host.arbiter.lapsed.pop(pid, None)

    def job_for_placement(self, pid: int) -> str | None:
        """The id of the job this node started for placement ``pid`` (in any state), by the
        placement id the job manager stored with it (an indexed column; never the job's env);
        None when there is none."""
        if self.host._jobs is None:
            return None
        return self.host._jobs.table.find_placement(pid)

    def _share_of(self, alloc: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
        """The fractional GPUs of a reservation's ``gpu_alloc``, by this node's GPU index."""
        return tuple((self.host.gpu_index[i], float(f)) for i, f in alloc
                     if f < 1.0 - pl.EPS and 0 <= i < len(self.host.gpu_index))

    def tick(self, now: float) -> None:
        """Give capacity back when placed jobs end (the component's job watcher calls this
        every second); then the node's inventory is read again."""
        if self.host._jobs is None:
            return
        for pid, p in list(self.host.arbiter.placed.items()):
            if not p.job_id:
                continue
            job = self.host._jobs.get(p.job_id)
            if job is None or not getattr(job, "live", getattr(job, "active", False)):
                self.host.arbiter.finish(pid)
                self._unstore_placed(pid)
        self.host.refresh_inventory()

    # -- a hand-over: bind, check, start -----------------------------------------------------------

    async def on_handover(self, sender: int, body: wire.Handover) -> wire.HandoverAck:
        """Start the handed-over job once per placement id; a repeat gets the same answer."""
        pid = body.placement_id
        fut = self.inflight.get((sender, pid))  # (another node's hand-over of that id is not this one's)
        if fut is not None:
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self.inflight[(sender, pid)] = fut
        try:
            ack = await self._handover(sender, body)
        except asyncio.CancelledError:
            self._unbind_unstarted(pid)
            fut.cancel()
            raise
        except Exception as e:
            log.exception("placement %x: hand-over failed", pid)
            ack = wire.HandoverAck(pid, HANDOVER_ERROR, f"hand-over failed: {e}")
        finally:
            self.inflight.pop((sender, pid), None)
        if ack.status != HANDOVER_OK:
            # no job runs for it here (the submitter places it elsewhere): a reservation bound
            # for it must not stay taken (the job watcher only frees entries with a job)
            self._unbind_unstarted(pid)
        fut.set_result(ack)
        return ack

    def _peer_run_as(self, req: Any, sender: int, spec: Any, demand: pl.Demand | None) -> authority.RunAs:
        """:func:`laminar.zone.authority.peer_run_as` for a hand-over's request ``req`` from
        ``sender``: its ``origin`` (a keeper placing a job it took over says the job's node;
        else the sender is the origin), this node's policy and ``[grants]``, the reservation's
        CPUs and memory (``spec`` is clamped to them). Counted and raised as Refused."""
        try:
            if not isinstance(req, dict):
                raise authority.Refused("bad_id", f"the hand-over from node {sender} is not an object")
            origin = req.get("origin_node", sender)  # (a node that left the roster may still be a job's origin)
            if isinstance(origin, bool) or not isinstance(origin, int) or not 1 <= origin <= 2**32 - 1:
                raise authority.Refused("key", f"the hand-over from node {sender} names origin_node {origin!r}, "
                                        "not a node id")
            jobs = self.host._jobs
            grants = getattr(jobs, "grants", None) if jobs is not None else None
            if grants is None and jobs is not None and hasattr(jobs, "checks"):
                from laminar.runtime.grants import Grants

                grants = Grants.from_config(None)
            run_as = authority.peer_run_as(
                req, policy=self.host.policy, origin=origin, sender=sender, grants=grants,
                job_class=str(getattr(spec, "job_class", "standard")), priority=int(getattr(spec, "priority", 0)),
                cpus=getattr(spec, "cpus", None), memory_mb=getattr(spec, "memory_mb", None),
                reserved=None if demand is None else (demand.cpus, demand.memory_mb))
        except authority.Refused as e:
            raise self.host.authority.note(e, sender) from None
        if run_as.clamped:
            spec.cpus, spec.memory_mb = run_as.cpus, run_as.memory_mb
            log.info("zone: the job from node %d asked for more than its reservation: %s", sender,
                     ", ".join(run_as.clamped))
        return run_as

    def _member_refusal(self, sender: int, member: Any) -> None:
        """ValueError unless a hand-over's member block comes from the job's origin (a node
        hands members over only for jobs it originates) and names this node for its index."""
        if not isinstance(member, dict):
            raise ValueError("member: expected an object (the member block)")
        origin, index, nodes = member.get("origin"), member.get("index"), member.get("nodes")
        if origin != sender:
            raise ValueError(f"member: the block names origin {str(origin)[:20]}, but node {sender} sent it: a node "
                             "hands over members only of jobs it originates")
        if (isinstance(index, bool) or not isinstance(index, int) or not isinstance(nodes, list)
                or not 0 <= index < len(nodes) or not isinstance(nodes[index], list | tuple) or not nodes[index]
                or nodes[index][0] != self.host.node_id):
            raise ValueError(f"member: member {str(index)[:20]} of the block is not node {self.host.node_id}")

    def _unbind_unstarted(self, pid: int) -> None:
        """Free the capacity bound for placement ``pid`` when no job was started for it."""
        p = self.host.arbiter.placed.get(pid)
        if p is not None and not p.job_id:
            self.host.arbiter.unbind(pid)

    async def _handover(self, sender: int, body: wire.Handover) -> wire.HandoverAck:
        pid = body.placement_id
        self.host.counts["handovers"] += 1
        other = self.host.arbiter.prober_of(pid)
        if other is not None and other != sender:  # another node's placement: its id is no key here
            self.host.arbiter.counts["not_prober"] += 1
            e = self.host.authority.note(authority.Refused(
                "placement", f"placement {pid:016x} is node {other}'s (it probed for it), not node {sender}'s: "
                "a hand-over binds only the reservation its own submitter probed for"), sender)
            self.host._emit(f"refused a hand-over from node {sender}: {e}", placement=f"{pid:016x}", submitter=sender,
                       reason=e.reason)
            return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION, str(e))
        runs = await self._taken_over_as(pid, body)
        if runs is not None:  # this node's own take-over of the job started it: the hand-over gets it
            self.forgo_placement(pid)
            return wire.HandoverAck(pid, HANDOVER_OK, runs)
        p = self.host.arbiter.bind(pid, self.host.clock(), sender)
        if p is None:
            # a repeat after this agent restarted: the job may have started before the crash
            done = self.job_for_placement(pid)
            if done is not None:
                return wire.HandoverAck(pid, HANDOVER_OK, done)
            if self.host.arbiter.inventory.draining:
                return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION,
                                        f"node {self.host.node_id} is being reclaimed by its owner: it takes no new job")
            return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION, "no live reservation for this placement (lease expired?)")
        if p.job_id:
            return wire.HandoverAck(pid, HANDOVER_OK, p.job_id)
        from laminar.runtime import provenance as pv
        from laminar.runtime.spec import JobError, JobSpec

        try:
            req = json.loads(body.spec_json)
            # the peer's word on its own agent's behalf (a move, a keeper's placement, a requeue);
            # a user's placement carries none. The job's env is its user's: names an agent of an
            # older release put there are dropped, never trusted (provenance.from_peer)
            migrated_from, requeued_from, resume_given = pv.origin_of_request(req)
            # a multi-node job's member: the block the origin put beside the spec's keys
            # (laminar.members), popped before the spec is read
            member = req["spec"].pop("member", None) if isinstance(req.get("spec"), dict) else None
            if member is not None:
                self._member_refusal(sender, member)
            counts = getattr(self.host._jobs, "provenance_counts", None)
            ours = pv.JobOrigin(migrated_from=migrated_from, requeued_from=requeued_from).env()
            spec_d = dict(pv.from_peer(req["spec"], counts, f"node {sender}'s hand-over", ours))
            whole = [self.host.gpu_index[i] for i, f in p.reservation.gpu_alloc if f >= 1.0 - pl.EPS and i < len(self.host.gpu_index)]
            spec_d["gpus"] = whole
            if member is not None:  # the member's own job runs on this node alone (laminar.members)
                for key in ("workers", "workers_min", "workers_max", "launcher"):
                    spec_d.pop(key, None)
            origin = pv.JobOrigin(migrated_from=migrated_from, placement_id=pid,
                                  gpu_share=self._share_of(p.reservation.gpu_alloc), requeued_from=requeued_from)
            if self.host.loan.is_loan(p.reservation.demand):
                if not self.host.loan.loanable:  # it turned busy since its offer: the job goes elsewhere
                    self.host.arbiter.unbind(pid)
                    return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION,
                                            f"node {self.host.node_id} serves its own pool now: no loans")
                spec_d["lent"] = True
                self.host.loan.counts["loans"] += 1
            spec = JobSpec.from_dict(spec_d)
        except (ValueError, KeyError, TypeError) as e:
            if self.host._jobs is not None and hasattr(self.host._jobs, "count_refusal"):
                self.host._jobs.count_refusal("handover", e)
            self.host.arbiter.unbind(pid)
            return wire.HandoverAck(pid, HANDOVER_REJECTED, f"job spec refused: {e}")
        try:  # the peer speaks only for what it owns: its uid, gid, class and resources (authority.py)
            run_as = self._peer_run_as(req, sender, spec, p.reservation.demand)
        except authority.Refused as e:
            self.host.arbiter.unbind(pid)
            self.host._emit(f"refused a hand-over from node {sender}: {e}", placement=f"{pid:016x}", submitter=sender,
                       reason=e.reason)
            return wire.HandoverAck(pid, HANDOVER_REJECTED, str(e))
        if self.host._jobs is None:
            self.host.arbiter.unbind(pid)
            return wire.HandoverAck(pid, HANDOVER_ERROR, "this node runs no job manager")
        if req.get("quota") is True:
            # a user's new job whose owner is at jobs.max_per_user here is refused before anything
            # is taken for it (elastic grants shed, a checkpoint hashed); submit checks again
            try:
                self.host._jobs.checks.quota(run_as.uid)
            except JobError as e:
                self.host.arbiter.unbind(pid)
                return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.host.node_id}: {e}")
        # GPUs granted to elastic jobs are taken back first (their extra workers scale in);
        # one granted to an elastic job frozen since the offer cannot be: the job goes elsewhere
        mine = {self.host.gpu_index[i] for i, _ in p.reservation.gpu_alloc if i < len(self.host.gpu_index)}
        frozen = sorted(mine & self.host.loan.frozen_grants())
        if frozen:
            self.host.arbiter.unbind(pid)
            self.host.refresh_inventory()
            return wire.HandoverAck(pid, HANDOVER_NO_RESERVATION, f"GPU(s) {frozen} on node {self.host.node_id} are granted "
                                    "to a frozen elastic job that cannot scale in until it thaws")
        self.host.loan.shed(mine, f"placement {pid:016x} from node {sender} takes the GPU")
        migrate = self.host.agent.migrate if self.host.agent is not None else None
        if spec.resume_from and migrate is not None:
            try:  # a migrated job: its checkpoint is verified here, right before LAMINAR_RESUME_FROM
                # (every file hashed, ~1 s per GiB: in a worker thread, never on the event loop),
                # one of the owner's worker-thread slots held meanwhile (api.work: a user placing
                # jobs whose checkpoints hash for hours must not take every worker thread)
                with self._work_slot(run_as.uid):
                    spec.resume_from = await asyncio.to_thread(migrate.check_resume, spec.resume_from,
                                                               run_as.uid, run_as.gid)
            except Busy as e:
                self.host.arbiter.unbind(pid)
                api = self.host.agent.api if self.host.agent is not None else None
                if api is not None:
                    api.refusals.count(e.reason)
                return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.host.node_id}: {e}")
            except ValueError as e:
                self.host.arbiter.unbind(pid)
                return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.host.node_id}: {e}")
            if resume_given:  # the sender's agent gave it (a move's, a keeper's replica), checked here as its owner
                origin = replace(origin, resume_given=spec.resume_from)
        members = self.host.agent.members if self.host.agent is not None else None
        try:
            if member is not None:
                if members is None:
                    raise JobError("this node runs no members component (multi-node jobs)")
                started = await members.start_member(member, spec, run_as.uid, run_as.gid)
                job = self.host._jobs.get(started)
                if job is None:
                    raise JobError(f"member job {started} did not start")
            else:
                job = await self.host._jobs.submit(spec, owner_uid=run_as.uid, owner_gid=run_as.gid,
                                              **({"quota": True} if req.get("quota") is True else {}), origin=origin)
        except JobError as e:
            # the spec was valid; what failed is this node's (a GPU taken by a local job meanwhile,
            # a command this node lacks): another node may start it
            self.host.arbiter.unbind(pid)
            return wire.HandoverAck(pid, HANDOVER_ERROR, f"job could not start on node {self.host.node_id}: {e}")
        except Exception as e:
            self.host.arbiter.unbind(pid)
            log.exception("placement %x: job start failed", pid)
            return wire.HandoverAck(pid, HANDOVER_ERROR, f"job start failed: {e}")
        p.job_id = job.id
        # the job runs: whatever fails from here on, the answer is its id (an error would have
        # the submitter place it elsewhere as well: two copies)
        try:
            self._store_placed(p)  # lost: after a restart its capacity counts as a local job's
            self.host._emit(f"placed job {job.id} from node {sender}", job=job.id, placement=f"{pid:016x}",
                       submitter=sender, gpu_alloc=[list(a) for a in p.reservation.gpu_alloc])
        except Exception:
            log.exception("placement %x: job %s started, but recording it failed", pid, job.id)
        return wire.HandoverAck(pid, HANDOVER_OK, job.id)
