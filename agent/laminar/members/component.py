"""Multi-node jobs on the agent (:class:`MembersComponent`, the agent's ``members``).

A multi-node job (``workers`` > 1) has one id, ``job-<num>-n<origin>``, and one member per node:
a local job of that node's agent with the job's id. The node it was submitted on, its *origin*,
places the gang (``placer``: laminar.zone.gangplace), keeps the job's record and decides what
happens when a member ends (:func:`laminar.policy.members.on_member_end`). Every node that hosts
a member keeps the job's record too (:class:`laminar.members.table.MemberTable`, the only writer
of the store's two tables), re-read at start.

Two sides, one component (a node may be both, for one job), each a part built with the
component (it holds its own state and reaches the component through a Protocol its module
declares):

- *member side* (``member``: :class:`laminar.members.member.MemberSide`): :meth:`MembersComponent.start_member`
  (from the zone's hand-over: the member block the origin put beside the spec) starts the local
  job with the launch argv and env (laminar.members.launch); each tick compares the local job
  with the member's stored state and REPORTs a change to the origin, retried every tick until
  the origin answers; ORDERs from the record's origin (stop, freeze, thaw, checkpoint,
  killswitch_on/off, relaunch) are acted on; an order of an older generation is ignored.
- *origin side* (``origin``: :class:`laminar.members.origin.OriginSide`): :meth:`submit` records
  the job and places it; a REPORT (only from the node the record names for that index, only of
  the current generation) is stored and decided: a restart stops the live members and relaunches
  every member with the next generation (a lost member's node re-placed with k=1), an elastic job
  goes on resizing, or the job ends and its members are stopped. A member's node that the zone's
  liveness declares dead makes that member ``lost``. :meth:`stop` and :meth:`killswitch` order
  every member.

Messages (``messages``: :class:`laminar.members.messages.Messages`) are the zone's MEMBER_REQUEST /
MEMBER_ANSWER (op 1 report, 2 order, 3 view), sent like the loan layer's: retransmitted with the
same id, answers cached by (sender, id). Everything a message says was stored before it is sent,
and a report or order repeated (after a restart of either side) changes nothing the second time.

The component keeps the life cycle (start, stop, the tick loop, which ticks the member side then
the origin side), the public API the other components and the routes call (thin entry points to
the parts), the jobs' views and the ``[members]`` config section.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from laminar.policy import members as pm
from laminar.policy.members import MultiState
from laminar.runtime.spec import JobSpec
from laminar.tasks import cancel_until_done
from laminar.zone import wire

from .member import MemberSide
from .messages import Messages
from .origin import OriginSide
from .table import MemberTable, MultiRecord

if TYPE_CHECKING:
    from laminar.components import MembersAgent

log = logging.getLogger("laminar.members")


def config_fields() -> dict[str, Any]:
    """The ``[members]`` config section."""
    from laminar.config import Field, _range

    return {
        "max_jobs": Field(int, 256, "multi-node jobs this node keeps a record of (as origin or member); the oldest "
                          "ended go first", _range(1, 100_000)),
        "ckpt_root": Field(str, "", "storage every member of a job reaches (a shared filesystem): a member's "
                           "LAMINAR_CKPT_DIR is <ckpt_root>/<job id>, the same path on every node (empty: the "
                           "job's own checkpoint directory on each node)"),
        "max_restarts": Field(int, pm.MAX_RESTARTS, "restarts of a whole multi-node job before it ends failed",
                              _range(0, 100)),
        "tick_s": Field((int, float), 1.0, "how often local members are looked at and unanswered reports resent",
                        _range(0.05, 60)),
        "request_timeout_s": Field((int, float), 3.0, "how long a report or order waits for its answer (three sends)",
                                   _range(0.05, 60)),
    }


def _register() -> None:
    from laminar.config import register_section

    register_section("members", config_fields())


_register()


@dataclass(frozen=True)
class Member:
    """A member of a multi-node job hosted here, as the job manager, Airlock and netguard read it
    (laminar.components.MemberInfo)."""

    job: str
    index: int
    count: int
    origin: int
    rigid: bool


LaunchPlan = Callable[[dict[str, Any], JobSpec], tuple[list[str], dict[str, str]]]


def default_launch(block: dict[str, Any], spec: JobSpec) -> tuple[list[str], dict[str, str]]:
    """The member's argv and env (laminar.members.launch): its block checked in full, the
    interface that holds its own address read here. LaunchError (a ValueError) when refused."""
    from laminar.members import launch

    b = launch.MemberBlock.from_dict(block)
    plan = launch.launch(b, spec.command, launch.interface_of(b.own_addr))
    return list(plan.argv), dict(plan.env)


class MembersComponent:
    """The agent's ``members`` (see the module's doc): the member side (``member``), the origin
    side (``origin``) and their messages (``messages``) are its parts."""

    agent_attr = "members"
    status_key = "members"

    def __init__(self, launch_plan: LaunchPlan | None = None, clock: Callable[[], float] = time.time) -> None:
        self.agent: MembersAgent | None = None
        self.s: dict[str, Any] = {k: f.default for k, f in config_fields().items()}
        self.table = MemberTable(None)
        self.placer: Any = None  # laminar.zone.gangplace.GangPlacer, built at start from the zone
        self.launch_plan: LaunchPlan = launch_plan or default_launch
        self.clock = clock
        self.node = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[Any] | None = None
        self.counts: dict[str, int] = {"reports_sent": 0, "reports_taken": 0, "orders_sent": 0, "orders_taken": 0,
                                       "refused": 0, "restarts": 0, "lost": 0}
        # a request's sender: the node id itself when it speaks over the zone, this node's in process
        self.send: Callable[[int, wire.MemberRequest], None] | None = None
        self.messages = Messages(self)  # requests sent with retransmits, answers cached (messages.py)
        self.member = MemberSide(self)  # this node's members: start, reports, orders (member.py)
        self.origin = OriginSide(self)  # the jobs this node originates: placement, decisions (origin.py)

    # -- life cycle ----------------------------------------------------------------------------------

    async def start(self, agent: MembersAgent | None) -> None:
        self.agent = agent
        if agent is not None:
            self.s.update(agent.config.section("members") or {})
            zone = agent.zone
            self.node = zone.node_id if zone is not None else 1
            self.table = MemberTable(agent.store, int(self.s["max_jobs"]))
            if zone is not None and self.placer is None:
                self.placer = self._make_placer(zone)
        self.table.max_jobs = int(self.s["max_jobs"])
        for rec in self.table.load():
            idx = rec.index_of(self.node)
            if idx is not None and rec.state is not MultiState.ENDED and rec.origin != self.node:
                self.member.unreported.add(rec.job)  # told again: the origin ignores a repeat
            if rec.origin == self.node and rec.state is MultiState.RESTARTING:
                self._spawn(self.origin.relaunch(rec))  # the restart in flight when the agent stopped goes on
            elif rec.origin == self.node and rec.state is MultiState.PLACING:
                # the placement died with the agent: its members, if any started, are stopped
                self._spawn(self.origin.end(rec, "failed: the origin's agent restarted while placing the job"))
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    @staticmethod
    def _make_placer(zone: Any) -> Any:
        """The gang placer over the zone's own transport, membership and summaries, with the
        zone's placement settings (``[zone]``); the zone's late offers reach it too."""
        try:
            from laminar.zone import gangplace
        except ImportError:  # pragma: no cover - an installation without the gang placement
            return None
        s = zone.s
        placer = gangplace.GangPlacer(
            zone.submitter.t, zone.membership, zone.summaries.zone_fits, rng=zone.rng, lease_s=float(s["lease_s"]),
            hold_s=float(s["hold_s"]), probe_timeout_s=float(s["probe_timeout_s"]),
            handover_timeout_s=float(s["handover_timeout_s"]), max_rounds=int(s["queue_rounds"]), clock=zone.clock,
            unconfirmed_wait_s=float(s["unconfirmed_wait_s"]), zone_summary=zone.summaries.zone_summary)
        single = zone.router.on_late_offer

        def late(node: int, offer: Any) -> None:
            if single is not None:
                single(node, offer)
            placer.note_late_offer(node, offer)
        zone.router.on_late_offer = late
        return placer

    async def _shutdown(self) -> None:
        await cancel_until_done([t for t in (self._loop_task, *self._tasks) if t is not None])
        self._tasks.clear()
        self._loop_task = None

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("members: a task failed: %s", task.exception(), exc_info=task.exception())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(float(self.s["tick_s"]))
            try:
                self.tick(self.clock())
            except Exception:
                log.exception("members: tick failed")

    def _emit(self, message: str, **fields: Any) -> None:
        log.info("%s", message)
        if self.agent is not None:
            self.agent.events.emit("members", message, **fields)

    # -- the tick --------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Member side: each local member's job compared with its stored state (a change is
        stored and reported), unanswered reports resent. Origin side: members on nodes the
        zone's liveness declares dead are lost; a job resizing settles."""
        self.member.tick(now)
        self.origin.tick(now)

    # -- the public API: entry points to the parts ------------------------------------------------------

    async def submit(self, spec: JobSpec, owner_uid: int, owner_gid: int, *, spread_zones: bool = False) -> dict[str, Any]:
        """Submits a multi-node job from this node, its origin (:meth:`OriginSide.submit`)."""
        return await self.origin.submit(spec, owner_uid, owner_gid, spread_zones=spread_zones)

    async def start_member(self, block: Any, spec: JobSpec, owner_uid: int, owner_gid: int) -> str:
        """Starts this node's member of a multi-node job (:meth:`MemberSide.start_member`)."""
        return await self.member.start_member(block, spec, owner_uid, owner_gid)

    async def stop(self, job_id: str | None = None, by_uid: int = 0) -> dict[str, Any]:
        """Stops every member of ``job_id`` (this node its origin: :meth:`OriginSide.stop`); the
        job's view. With no ``job_id`` this is the component's stop (the agent's): its rounds
        end, the members run on (as JobManager.stop); answers {}."""
        if job_id is None:
            await self._shutdown()
            return {}
        return await self.origin.stop(job_id, by_uid=by_uid)  # (not a local job's stop: tests/unit/test_end_cause.py)

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]:
        """Cuts (``on``) or restores every member's traffic on its node (:meth:`OriginSide.killswitch`)."""
        return await self.origin.killswitch(job_id, on, by_uid)

    # -- what Airlock, netguard, the job manager and the zone ask --------------------------------------

    def member_of(self, job_id: str) -> Member | None:
        """The member of a multi-node job that the local job ``job_id`` is, or None (a job of this
        node alone, or one whose record is gone or ended). O(members)."""
        rec = self.table.get(job_id)
        if rec is None or rec.state is MultiState.ENDED:
            return None
        idx = rec.index_of(self.node)
        if idx is None:
            return None
        return Member(rec.job, idx, rec.workers, rec.origin, rec.workers_min == rec.workers_max)

    def on_airlock(self, job_id: str, action: str, work_lost_s: float | None) -> None:
        """Airlock acted on the local member ``job_id`` (:meth:`MemberSide.on_airlock`): its
        origin is told, from a task (never blocks, never raises)."""
        self.member.on_airlock(job_id, action, work_lost_s)

    def on_message(self, sender: int, body: wire.MemberRequest | wire.MemberAnswer) -> wire.MemberAnswer | None:
        """A member message from ``sender`` (:meth:`Messages.on_message`): a request's answer, or None."""
        return self.messages.on_message(sender, body)

    # -- views ---------------------------------------------------------------------------------------

    @staticmethod
    def _launcher(rec: MultiRecord) -> str:
        from laminar.members import launch

        return str(rec.spec.get("launcher") or launch.launcher_for(rec.spec.get("command") or []))

    def _view(self, rec: MultiRecord) -> dict[str, Any]:
        return {"id": rec.job, "state": str(rec.state), "end_reason": rec.end_reason, "origin": rec.origin,
                "workers": rec.workers, "workers_min": rec.workers_min, "workers_max": rec.workers_max,
                "launcher": self._launcher(rec), "generation": rec.generation, "restarts": rec.restarts,
                "last_ckpt": rec.last_ckpt, "last_ckpt_at": rec.last_ckpt_at, "owner_uid": rec.owner_uid,
                "members": [m.view() for m in rec.members], "placement": rec.extra.get("placement", {})}

    def views(self) -> list[dict[str, Any]]:
        """Every multi-node job this node originates or hosts a member of, oldest first."""
        return [self._view(r) for r in sorted(self.table.jobs.values(), key=lambda r: (r.created, r.job))]

    def view(self, job_id: str) -> dict[str, Any] | None:
        rec = self.table.get(job_id)
        return None if rec is None else self._view(rec)

    def status(self) -> dict[str, Any]:
        live = [r for r in self.table.jobs.values() if r.state is not MultiState.ENDED]
        return {"jobs": len(self.table.jobs), "live": len(live),
                "origin": sum(1 for r in live if r.origin == self.node),
                "unreported": len(self.member.unreported), **self.counts}
