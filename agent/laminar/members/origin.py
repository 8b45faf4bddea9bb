"""The origin side of multi-node jobs (:class:`OriginSide`, a part of
:class:`laminar.members.component.MembersComponent`: its ``origin``).

The node a multi-node job was submitted on, its *origin*, places the gang and decides. :meth:`OriginSide.submit`
(the component's ``submit``) records the job and places it through the zone's gang placer,
each member's hand-over built here (its member block beside the spec); a hand-over that failed
after some members started has them stopped (no partial gang runs). A REPORT
(:meth:`OriginSide.on_report`: only from the node the record names for that index, only of the
current generation) is stored and decided (:meth:`OriginSide.decide`,
:func:`laminar.policy.members.on_member_end`): a restart stops the live members and relaunches
every member with the next generation (a lost member's node re-placed with k=1), an elastic job
goes on resizing, or the job ends and its members are stopped. Each tick
(:meth:`OriginSide.tick`), a member's node that the zone's liveness declares dead makes that
member ``lost``, each member's node is sent the job's view every ``VIEW_EVERY_S`` (an unanswered
one counts as a miss), and a job resizing settles. :meth:`OriginSide.stop` and
:meth:`OriginSide.killswitch` (the component's) order every member; a member's node's Airlock
suspending, recovering or killing it has the other members frozen, thawed, or the kill decided.

:class:`OriginSide` is built with the component (what it uses of it: :class:`OriginHost`) and
holds the origin's state: the jobs whose restart or end is under way, the members Airlock
suspended, when each job's view was last sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from laminar.policy import members as pm
from laminar.policy.members import Action, MemberState, MultiState
from laminar.runtime.spec import JobError, JobSpec

from .messages import OP_ORDER, OP_VIEW, PATH_MAX, MemberError, _dumps, _int, _job_id
from .table import MemberRow, MemberTable, MultiRecord, TableFull

if TYPE_CHECKING:
    from laminar.components import MembersAgent

    from .member import MemberSide
    from .messages import Messages

log = logging.getLogger("laminar.members")

RESIZE_SETTLE_S = 10.0  # an elastic job resizing whose live members all run this long is running again
VIEW_EVERY_S = 10.0  # the origin sends each member's node the job's view this often (unanswered: a miss)


def endpoint_port(job: str, generation: int) -> int:
    """The rendezvous port member 0's node serves for ``job``'s ``generation``
    (laminar.members.launch's)."""
    from laminar.members import launch

    return launch.endpoint_port(job, generation)


class OriginHost(Protocol):
    """What :class:`OriginSide` uses of the component that holds it (MembersComponent and its parts)."""

    agent: MembersAgent | None
    counts: dict[str, int]
    member: MemberSide
    messages: Messages
    node: int
    placer: Any
    s: dict[str, Any]
    table: MemberTable

    def _emit(self, message: str, **fields: Any) -> None: ...
    @staticmethod
    def _launcher(rec: MultiRecord) -> str: ...
    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...
    def _view(self, rec: MultiRecord) -> dict[str, Any]: ...


class OriginSide:
    """The multi-node jobs this node originates (see the module's doc): a part of
    :class:`laminar.members.component.MembersComponent` (its ``origin``). ``host``: the component."""

    def __init__(self, host: OriginHost) -> None:
        self.host = host
        self._acting: set[str] = set()  # origin: jobs whose restart or end is under way
        self._suspended: dict[str, set[int]] = {}  # origin: job -> members whose node's Airlock suspended them
        self._viewed: dict[str, float] = {}  # origin: job -> when its members' nodes were last sent its view

    def tick(self, now: float) -> None:
        """Members on nodes the zone's liveness declares dead are lost, each member's node is
        sent the job's view, a job resizing settles."""
        for rec in list(self.host.table.jobs.values()):
            if rec.origin == self.host.node and rec.state not in (MultiState.ENDED, MultiState.PLACING):
                self._look_at_nodes(rec, now)

    async def stop(self, job_id: str, by_uid: int) -> dict[str, Any]:
        """Stops every member of ``job_id`` (this node its origin); the job's view. The caller
        authorized ``by_uid`` (the API route: the owner, root or the control group, as for a
        one-node job)."""
        rec = self._owned(job_id, None)
        if rec.state is not MultiState.ENDED:
            await self.end(rec, f"stopped by uid {by_uid}")
        else:
            await self._order_all(rec, "stop")
        return self.host._view(rec)

    def _addr_of(self, node: Any) -> tuple[int, str]:
        """A placed member's (node, address): the placer names nodes (ids, or (id, address)
        pairs); the address is the zone membership's."""
        if isinstance(node, list | tuple):
            return int(node[0]), str(node[1])
        zone = self.host.agent.zone if self.host.agent is not None else None
        m = zone.membership.by_node.get(int(node)) if zone is not None else None
        return int(node), (m.addr if m is not None else "")

    def _look_at_nodes(self, rec: MultiRecord, now: float) -> None:
        zone = self.host.agent.zone if self.host.agent is not None else None
        if zone is None or rec.job in self._acting:
            return
        for m in rec.members:
            if m.state in pm.LIVE and m.node != self.host.node and not zone.membership.alive(m.node, zone.clock()):
                self.host.counts["lost"] += 1
                self.host._emit(f"job {rec.job}: member {m.index}'s node {m.node} is dead (zone liveness): lost",
                           job=rec.job, member=m.index, node=m.node)
                self.host.table.set_member(rec, m.index, MemberState.LOST)
                self.decide(rec, m.index, MemberState.LOST)
                if rec.job in self._acting:
                    return
        if now - self._viewed.get(rec.job, -1e18) >= VIEW_EVERY_S:
            # the job's view to each member's node: it carries the last verified checkpoint, and
            # an unanswered one counts as a miss (zone liveness), so a node that left without
            # notice is found dead though nothing else is sent to it
            self._viewed[rec.job] = now
            for m in rec.members:
                if m.state in pm.LIVE and m.node != self.host.node:
                    self.host._spawn(self._send_view(rec, m.node))
        if (rec.state is MultiState.RESIZING and now - rec.updated >= RESIZE_SETTLE_S
                and all(m.state is MemberState.RUNNING for m in rec.members if m.state in pm.LIVE)):
            self.host.table.move(rec, pm.Event.ALL_RUNNING)

    async def _send_view(self, rec: MultiRecord, node: int) -> None:
        # the job's state and every member's, so each member's node knows them too
        payload: dict[str, Any] = {"job": rec.job, "generation": rec.generation, "state": str(rec.state),
                                   "members": pm.states_text([m.state for m in rec.members])}
        if rec.state is MultiState.ENDED and rec.end_reason:
            payload["end_reason"] = rec.end_reason[:200]
        if rec.last_ckpt:
            payload["last_ckpt"] = rec.last_ckpt
        try:
            await self.host.messages.request(node, OP_VIEW, payload)
        except MemberError as e:
            log.info("members: job %s: the view to node %d: %s", rec.job, node, e)

    def on_report(self, sender: int, req: dict[str, Any]) -> dict[str, Any]:
        job = _job_id(req.get("job"))
        rec = self.host.table.get(job)
        if rec is None or rec.origin != self.host.node:
            raise MemberError(f"job {job}: unknown here (this node is not its origin)")
        index = _int(req.get("index"), "index", 0, rec.workers - 1)
        if rec.members[index].node != sender:
            raise MemberError(f"job {job}: member {index} is node {rec.members[index].node}'s, not node {sender}'s")
        gen = _int(req.get("generation"), "generation", 0, 2**31)
        if gen < rec.generation:
            return {"ignored": f"generation {gen} is over (the job is at {rec.generation})", "state": str(rec.state)}
        if gen > rec.generation:
            raise MemberError(f"job {job}: generation {gen} is not the job's ({rec.generation})")
        state = MemberState(str(req.get("state")))
        code = req.get("code")
        code = None if code is None else _int(code, "code", -(2**31), 2**31)
        ckpt = req.get("ckpt")
        if ckpt is not None and index == 0:
            if not isinstance(ckpt, str) or not ckpt.startswith("/") or len(ckpt) > PATH_MAX:
                raise MemberError(f"ckpt {str(ckpt)[:40]!r}: expected an absolute path")
            mine = self.host.member.ckpt_dir(job)
            if mine is None or not ckpt.startswith(mine + "/"):
                raise MemberError(f"ckpt {ckpt[:80]!r}: not under the job's shared directory (members.ckpt_root)")
            if ckpt != rec.last_ckpt:
                self.host.table.set_job(rec, last_ckpt=ckpt, last_ckpt_at=time.time())
        self.host.counts["reports_taken"] += 1
        airlock = req.get("airlock")
        if airlock is not None and airlock not in ("suspend", "recover", "kill"):
            raise MemberError(f"airlock {str(airlock)[:20]!r}: expected suspend, recover or kill")
        lost = req.get("work_lost_s")
        work_lost = float(lost) if isinstance(lost, int | float) and not isinstance(lost, bool) and 0 <= lost < 1e9 else None
        if airlock == "kill":
            state = MemberState.FAILED
        changed = rec.state is not MultiState.ENDED and self.host.table.set_member(rec, index, state, code)
        if airlock is not None:
            self._on_airlock(rec, index, str(airlock), work_lost)
        elif changed:
            self.decide(rec, index, state)
        return {"state": str(rec.state), "generation": rec.generation, "end_reason": rec.end_reason}

    def _recheck(self, rec: MultiRecord) -> None:
        """The members' states as they stand, decided again (reports that came while the gang
        was being placed were stored, not decided)."""
        for m in rec.members:
            if m.state in pm.ENDED:
                self.decide(rec, m.index, m.state)
                return
        if rec.members:
            self.decide(rec, 0, rec.members[0].state)

    def decide(self, rec: MultiRecord, index: int, state: MemberState, airlock_kill: bool = False) -> None:
        """Member ``index`` of ``rec`` is in ``state`` now (stored): what the job does."""
        if rec.state in (MultiState.ENDED, MultiState.RESTARTING, MultiState.PLACING) or rec.job in self._acting:
            return  # (the ends a restart, a stop or an unplaced gang make are its own)
        if state in pm.LIVE:
            if all(m.state is MemberState.RUNNING for m in rec.members if m.state in pm.LIVE) \
                    and rec.state is MultiState.STARTING:
                self.host.table.move(rec, pm.Event.ALL_RUNNING)
            return
        d = pm.on_member_end(rec.policy_view(int(self.host.s["max_restarts"])), index, state, airlock_kill)
        self.host._emit(f"job {rec.job}: member {index} {state.value}: {d.action.value} ({d.reason})", job=rec.job,
                   member=index, state=str(state), action=str(d.action), reason=d.reason)
        if d.action is Action.CONTINUE:
            if d.shrink:
                self.host.table.move(rec, pm.Event.SHRINK)
        elif d.action is Action.RESTART:
            self.host.counts["restarts"] += 1
            self._acting.add(rec.job)
            # the next generation is stored before any order goes: a restart after a crash
            # relaunches this same generation (_relaunch at start)
            gen = rec.generation + 1
            self.host.table.set_job(rec, generation=gen, restarts=rec.restarts + 1,
                               endpoint=self._endpoint(rec, gen))
            self.host.table.move(rec, pm.Event.RESTART, d.reason)
            self.host._spawn(self._restart(rec))
        else:
            self._acting.add(rec.job)
            self.host._spawn(self.end(rec, d.reason))

    def _endpoint(self, rec: MultiRecord, gen: int) -> str:
        host = rec.members[0].addr if rec.members else ""
        return f"{host}:{endpoint_port(rec.job, gen)}"

    async def _order_all(self, rec: MultiRecord, do: str, only_live: bool = True, skip: int | None = None,
                         **extra: Any) -> dict[int, str]:
        """ORDER ``do`` to every member (only the live ones by default; not member ``skip``);
        what each answered (its error, when one)."""
        targets = [m for m in rec.members if (not only_live or m.state in pm.LIVE) and m.index != skip]

        async def one(m: MemberRow) -> tuple[int, str]:
            try:
                self.host.counts["orders_sent"] += 1
                got = await self.host.messages.request(m.node, OP_ORDER, {"job": rec.job, "generation": rec.generation, "do": do,
                                                            **extra})
                return m.index, str(got.get("done", "ok"))
            except MemberError as e:
                return m.index, f"error: {e}"
        return dict(await asyncio.gather(*(one(m) for m in targets)))

    async def end(self, rec: MultiRecord, reason: str) -> None:
        self._acting.add(rec.job)
        try:
            self.host.table.move(rec, pm.Event.END, reason)
            self.host._emit(f"job {rec.job} ended: {reason}", job=rec.job, reason=reason)
            await self._order_all(rec, "stop")
        finally:
            self._acting.discard(rec.job)

    async def _restart(self, rec: MultiRecord) -> None:
        try:
            await self._order_all(rec, "stop")
            await self.relaunch(rec)
        finally:
            self._acting.discard(rec.job)

    async def relaunch(self, rec: MultiRecord) -> None:
        """Every member relaunched with the job's (stored) generation: ORDER relaunch to the ones
        on live nodes, a lost member's node re-placed through the placer (k=1). Idempotent: a
        member already at that generation answers without acting."""
        self._acting.add(rec.job)
        try:
            zone = self.host.agent.zone if self.host.agent is not None else None
            moved: list[list[Any]] = []  # [index, node, address] of the members re-placed
            for m in rec.members:
                gone = m.state is MemberState.LOST or (
                    zone is not None and m.node != self.host.node and not zone.membership.alive(m.node, zone.clock()))
                if gone:
                    if await self._replace(rec, m.index):
                        moved.append([m.index, rec.members[m.index].node, rec.members[m.index].addr])
                    else:
                        await self.end(rec, f"failed: member {m.index}'s node {m.node} is gone and no node took "
                                        "its place")
                        return
            rec.endpoint = self._endpoint(rec, rec.generation)
            self.host.table.set_job(rec, endpoint=rec.endpoint)
            for m in rec.members:
                self.host.table.set_member(rec, m.index, MemberState.STARTING, None)
            # the members know the job's nodes: only those re-placed are named (a datagram holds
            # a few, not 64)
            answers = await self._order_all(rec, "relaunch", only_live=False, resume_from=rec.last_ckpt,
                                            endpoint=rec.endpoint, moved=moved)
            failed = {i: a for i, a in answers.items() if a.startswith("error")}
            if failed:
                await self.end(rec, f"failed: relaunch refused by member(s) {sorted(failed)}: "
                                f"{next(iter(failed.values()))}")
                return
            self.host.table.move(rec, pm.Event.RELAUNCHED)
            self.host._emit(f"job {rec.job} relaunched, generation {rec.generation}", job=rec.job, generation=rec.generation,
                       resume_from=rec.last_ckpt)
        finally:
            self._acting.discard(rec.job)

    async def _replace(self, rec: MultiRecord, index: int) -> bool:
        """A lost member's node re-placed (k=1) through the placer: the member's row names the
        new node. False when there is no placer or it placed nothing."""
        if self.host.placer is None:
            return False
        spec = JobSpec.from_dict(rec.spec)

        def build(nodes: list[Any]) -> list[bytes]:
            # a node that hosts another member of the job refuses the hand-over (start_member):
            # the placer goes on without it
            node, addr = self._addr_of(nodes[0])
            self.host.table.set_member(rec, index, MemberState.STARTING, None, node=int(node), addr=str(addr))
            rec.endpoint = self._endpoint(rec, rec.generation)
            return [self._handover_json(rec, spec, index)]

        try:
            res = await self.host.placer.place(self._demand(spec), 1, build, undo=self._undo(rec))
        except (MemberError, JobError, ValueError) as e:
            log.warning("members: job %s: member %d not re-placed: %s", rec.job, index, e)
            return False
        return getattr(res, "outcome", "") == "placed"

    def _demand(self, spec: JobSpec) -> Any:
        from laminar.policy import placement as pl

        gpus = spec.gpus if isinstance(spec.gpus, int) else len(spec.gpus)
        return pl.Demand(gpus=float(gpus), cpus=float(spec.cpus or 1.0), memory_mb=int(spec.memory_mb or 256))

    def _handover_json(self, rec: MultiRecord, spec: JobSpec, index: int) -> bytes:
        block = {"job": rec.job, "origin": rec.origin, "index": index, "count": rec.workers, "min": rec.workers_min,
                 "max": rec.workers_max, "nodes": [[m.node, m.addr] for m in rec.members], "endpoint": rec.endpoint,
                 "launcher": self.host._launcher(rec), "generation": rec.generation}
        spec_d = {**spec.as_dict(), "member": block}
        return _dumps({"spec": spec_d, "owner_uid": rec.owner_uid, "owner_gid": rec.owner_gid})

    def _undo(self, rec: MultiRecord) -> Callable[..., Awaitable[None]]:
        """What the placer calls when a gang's hand-over failed after some members started: they
        are stopped (ORDER stop), so that no partial gang runs."""
        async def undo(*_: Any) -> None:
            await self._order_all(rec, "stop")
        return undo

    async def submit(self, spec: JobSpec, owner_uid: int, owner_gid: int, *, spread_zones: bool = False) -> dict[str, Any]:
        """Submits a multi-node job (``spec.workers`` members, elastic bounds when given) from this
        node, its origin: records it, places the gang through the zone and answers its view.
        JobError when refused (bad bounds, no room for the record, no zone)."""
        workers, lo, hi = spec.workers, spec.workers_min, spec.workers_max
        if not isinstance(workers, int) or isinstance(workers, bool) or not 2 <= workers <= pm.WORKERS_MAX:
            raise JobError(f"workers {workers!r}: a multi-node job has 2..{pm.WORKERS_MAX} workers")
        lo, hi = (workers, workers) if lo is None and hi is None else (lo, hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= workers <= hi <= pm.WORKERS_MAX):
            raise JobError(f"workers {workers} with bounds {lo}:{hi}: expected 1 <= min <= workers <= max <= "
                           f"{pm.WORKERS_MAX}")
        spec.validate()
        if self.host.placer is None:
            raise JobError("this node places no multi-node job: it has no zone (or no gang placement)")
        jobs = self.host.agent.jobs if self.host.agent is not None else None
        if jobs is None:
            raise JobError("this node runs no job manager")
        job_id = jobs.reserve_multinode_id(self.host.node)
        spec_d = spec.as_dict()
        rec = MultiRecord(job=job_id, origin=self.host.node, spec=spec_d, owner_uid=owner_uid, owner_gid=owner_gid,
                          state=MultiState.PLACING, workers_min=lo, workers_max=hi,
                          members=[MemberRow(i, 0, "") for i in range(workers)])
        try:
            self.host.table.add(rec)
        except TableFull as e:
            raise JobError(str(e)) from None
        self._acting.add(job_id)

        def build(nodes: list[Any]) -> list[bytes]:
            if len(nodes) != workers:
                raise MemberError(f"the placement gave {len(nodes)} nodes for {workers} members")
            for i, (node, addr) in enumerate(map(self._addr_of, nodes)):
                self.host.table.set_member(rec, i, MemberState.STARTING, None, node=int(node), addr=str(addr))
            self.host.table.set_job(rec, endpoint=self._endpoint(rec, rec.generation))
            return [self._handover_json(rec, spec, i) for i in range(workers)]

        try:
            res = await self.host.placer.place(self._demand(spec), workers, build, undo=self._undo(rec),
                                          **({"spread_zones": True} if spread_zones else {}))
        except BaseException as e:
            await self.end(rec, f"not placed: {e}")
            raise
        finally:
            self._acting.discard(job_id)
        as_dict = getattr(res, "as_dict", None)
        rec.extra["placement"] = as_dict() if callable(as_dict) else {}
        if getattr(res, "outcome", "") == "placed":
            self.host.table.move(rec, pm.Event.PLACED)
            self.host._emit(f"job {job_id} placed on nodes {[m.node for m in rec.members]}", job=job_id,
                       nodes=[m.node for m in rec.members], by_uid=owner_uid)
            self._recheck(rec)
        else:
            await self.end(rec, f"not placed: {getattr(res, 'reason', '') or getattr(res, 'outcome', '?')}")
        return self.host._view(rec)

    def _owned(self, job_id: str, by_uid: int | None) -> MultiRecord:
        """The record of ``job_id``, which this node originates; ``by_uid`` (None: the caller
        authorized already) must be its owner or root."""
        rec = self.host.table.get(job_id)
        if rec is None:
            raise JobError(f"no multi-node job {job_id!r} here")
        if rec.origin != self.host.node:
            raise JobError(f"job {job_id}: its origin is node {rec.origin}; ask there")
        if by_uid is not None and by_uid not in (0, rec.owner_uid):
            raise JobError(f"job {job_id} is uid {rec.owner_uid}'s: only its owner or root may do that")
        return rec

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]:
        """Cuts (``on``) or restores every member's traffic on its node."""
        rec = self._owned(job_id, by_uid)
        answers = await self._order_all(rec, "killswitch_on" if on else "killswitch_off")
        return {**self.host._view(rec), "killswitch": {str(i): a for i, a in sorted(answers.items())}}

    def _on_airlock(self, rec: MultiRecord, index: int, action: str, work_lost: float | None) -> None:
        """The origin: member ``index``'s node's Airlock suspended, recovered or killed it."""
        suspended = self._suspended.setdefault(rec.job, set())
        self.host._emit(f"job {rec.job}: member {index}'s node {action}ed it (Airlock)"
                   + (f", {work_lost:g} s of work lost" if work_lost is not None else ""),
                   job=rec.job, member=index, airlock=action, work_lost_s=work_lost)
        if action == "suspend":
            suspended.add(index)
            self.host._spawn(self._order_others(rec, index, "freeze"))
        elif action == "recover":
            suspended.discard(index)
            if not suspended:
                self.host._spawn(self._order_others(rec, index, "thaw"))
        else:  # kill: decided as the member's end (its state, failed, came with it)
            suspended.discard(index)
            if work_lost is not None:
                rec.extra["work_lost_s"] = rec.extra.get("work_lost_s", 0.0) + work_lost
            if rec.state is not MultiState.ENDED and rec.job not in self._acting:
                self.decide(rec, index, MemberState.FAILED, airlock_kill=True)
            if not suspended:
                self.host._spawn(self._order_others(rec, index, "thaw"))

    async def _order_others(self, rec: MultiRecord, but: int, do: str) -> None:
        for i, answer in (await self._order_all(rec, do, skip=but)).items():
            if answer.startswith("error"):
                log.warning("members: job %s: %s of member %d: %s", rec.job, do, i, answer)
