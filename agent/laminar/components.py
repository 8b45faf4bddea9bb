"""What each component may reach of the agent and of the other components.

A component is given the agent in ``start(agent)``. It sees the agent through the interface
declared for it here, never by a ``getattr`` on the agent: each ``*Agent`` Protocol
names the agent's attributes that one component reads, and the Protocols beside them name what
it calls on another component (``MigrateForZone``: what the zone and its loan layer call on the
migration layer). Everything is a read-only property, so the agent (:class:`laminar.agent.Agent`,
whose attributes carry their concrete types) conforms to all of them, and mypy checks that it
does (``_agent_conforms`` in ``laminar/agent.py``) and checks every cross-component call against
the Protocol the calling component holds.

The rule: a component reaches the agent only through its interface here, by plain attribute
access. An optional component (one an agent or a test can run without: the migration layer,
Airlock, netguard, the API, the job manager, the members of multi-node jobs; Airlock refuses
to start without the job manager) is
typed ``X | None`` and looked at as such; a core piece the agent always has (config, store, events) is not optional.
A test that builds a component with a fake agent gives the fake every attribute the interface
names (``None`` for an optional one it does not have).

The migration layer (``laminar/migrate/``) reaches the agent the same way, through
``MigrateAgent``: its component (``ReclaimComponent``) holds the agent, and each of its parts
reads it as ``host.agent``, typed ``MigrateAgent`` in the part's own host Protocol.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from laminar.api import ApiServer
    from laminar.config import Config
    from laminar.events import EventBus
    from laminar.migrate.ckpt_driver import CkptDriver
    from laminar.net.netguard import NetGuard
    from laminar.net.transfers import TransferRegistry
    from laminar.runtime.jobs import JobManager
    from laminar.runtime.record import Job
    from laminar.runtime.spec import JobSpec
    from laminar.store import Store
    from laminar.zone import wire
    from laminar.zone.component import ZoneComponent


# -- what one component calls on another ------------------------------------------------------


class JobIndex(Protocol):
    """The job manager as netguard and the transfer registry look jobs up in it."""

    def get(self, job_id: str) -> Job | None: ...

    def list(self, all_jobs: bool = True, ended_max: int | None = None) -> list[Job]: ...


class JobsById(Protocol):
    """The job manager as the pressure watch reads it: its jobs by id."""

    @property
    def jobs(self) -> dict[str, Job]: ...


class AirlockForNetGuard(Protocol):
    """What netguard's unload asks of Airlock: thaw what it holds, and take it back on failure."""

    def release_for_unload(self) -> list[str]: ...

    def resume_after_failed_unload(self) -> None: ...


class AirlockRungs(Protocol):
    """What a job's API answer shows of Airlock: each job's rung (rung, since, hops)."""

    @property
    def rungs(self) -> dict[str, tuple[str, float, int]]: ...


class MigrateForAirlock(Protocol):
    """What Airlock reads of the migration layer: the jobs it is moving now."""

    @property
    def evacuating(self) -> set[str]: ...


class TakeOvers(Protocol):
    """The migration layer's take-over part (``migrate.takeover``) as the zone's hand-overs ask it."""

    async def taken_over_as(self, key: str | None) -> str | None: ...


class Departures(Protocol):
    """The migration layer's evidence part (``migrate.evidence``) as the loan layer tells it of a
    return to the pool (an announced departure)."""

    def observe_departure(self, ts: float, announced: bool) -> None: ...


class MovesNow(Protocol):
    """The migration layer's mover (``migrate.mover``) as the loan layer asks it to move a lent job
    off a returned server."""

    async def move_now(self, job: Any, reason: str) -> Any: ...


class MigrateForZone(Protocol):
    """What the zone (its hand-overs and its loan layer) calls on the migration layer."""

    @property
    def takeover(self) -> TakeOvers: ...

    @property
    def evidence(self) -> Departures: ...

    @property
    def mover(self) -> MovesNow: ...

    @property
    def ckpt(self) -> CkptDriver | None: ...

    def check_resume(self, path: str, owner_uid: int = 0, owner_gid: int | None = None) -> str: ...


class MemberInfo(Protocol):
    """What a node's job manager, Airlock and netguard read of one member of a multi-node job
    hosted here (issue 33: the job's worker on this node, whose local job has the job's id)."""

    @property
    def job(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def count(self) -> int:
        """How many members the job has now (its workers)."""
        ...
    @property
    def origin(self) -> int:
        """The node id where the job was submitted (it keeps the record and decides)."""
        ...
    @property
    def rigid(self) -> bool:
        """True when the job has no elastic bounds (a member's end ends the job)."""
        ...


class MembersForJobs(Protocol):
    """The members component (``agent.members``, ``laminar/members/component.py``) as the job
    manager asks it whether a local job is a member of a multi-node job (its checkpoint signal
    then goes to every process of its cgroup that catches it, not to the main process)."""

    def member_of(self, job_id: str) -> MemberInfo | None:
        """The member of a multi-node job that the local job ``job_id`` is; None for a job of
        this node alone (or one the component does not know). Cheap: called on Airlock's tick."""
        ...


class MembersForAirlock(MembersForJobs, Protocol):
    """The members component as Airlock tells it what it did to a member (the component reaches
    the other members through the job's origin)."""

    def on_airlock(self, job_id: str, action: str, work_lost_s: float | None) -> None:
        """Airlock acted on the local member ``job_id``: ``action`` is ``"suspend"`` (frozen here:
        freeze every other member), ``"recover"`` (thawed here: thaw the others once no member
        is suspended) or ``"kill"`` (killed here with ``work_lost_s`` lost: a rigid job ends,
        an elastic one loses this member). Never blocks and never raises (called on Airlock's
        hot path: messages go out from a task of its own)."""
        ...


class MembersForNet(MembersForJobs, Protocol):
    """The members component as netguard's kill-switch reaches a multi-node job's other members."""

    def view(self, job_id: str) -> dict[str, Any] | None:
        """The job's view (design-33: id, state, members, ...), where this node originates the
        job or hosts a member of it; None otherwise."""
        ...

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]:
        """Cuts (``on``) or restores every member's traffic: ORDER killswitch_on/off to each
        member's agent (from the origin; a member node asks the origin), each of which calls
        ``netguard.set_job_switch``. Raises JobError when ``by_uid`` may not (not root, not the
        owner) or the job is unknown."""
        ...


class NetGuardSwitch(Protocol):
    """What the members component calls on netguard when the origin orders a member's
    traffic cut or restored (ORDER killswitch_on/off)."""

    def set_job_switch(self, job_id: str, on: bool) -> bool: ...


class MembersForApi(Protocol):
    """The members component (the agent's ``members``, ``laminar/members/component.py``) as the
    API routes of the zone, the job manager and netguard call it (``laminar/members/routes.py``):
    a multi-node job's placement, its views, its stop and its kill-switch."""

    async def submit(self, spec: Any, owner_uid: int, owner_gid: int, *,
                     spread_zones: bool = False) -> dict[str, Any]: ...

    def views(self) -> list[dict[str, Any]]: ...

    def view(self, job_id: str) -> dict[str, Any] | None: ...

    async def stop(self, job_id: str, by_uid: int) -> dict[str, Any]: ...

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]: ...


class MembersForJobsApi(MembersForJobs, MembersForApi, Protocol):
    """The members component as the job manager and its routes use it."""


class MembersForAgent(MembersForAirlock, MembersForNet, MembersForApi, Protocol):
    """All of the above: what the members component (``laminar.members.component.MembersComponent``,
    ``Agent.members``) offers the other components (mypy checks it through their interfaces)."""


class MembersForZone(MembersForApi, Protocol):
    """What the zone calls on the members component: what its placement route does
    (:class:`MembersForApi`), and what its message routing and its hand-overs do: a member
    message, and a hand-over's member block."""

    def on_message(self, sender: int, body: wire.MemberRequest | wire.MemberAnswer) -> wire.MemberAnswer | None: ...

    async def start_member(self, block: Any, spec: JobSpec, owner_uid: int, owner_gid: int) -> str: ...


class SchedulersForMigrate(Protocol):
    """The scheduler component (``agent.schedulers``, ``laminar/sched/component.py``) as an
    owner's reclaim (``migrate/evacuation.py``, ``migrate/withdraw.py``) carries it out through the
    schedulers this node works beside (design-34 §3)."""

    def handles(self, job: Job) -> bool:
        """Whether ``job`` was adopted from a scheduler enabled here (it is given back to it,
        not moved to another Laminar node)."""
        ...

    def start_drain(self, reason: str) -> None:
        """The reclaim begins: drain this node in every scheduler (in a task; never raises)."""
        ...

    async def undrain(self, reason: str) -> None:
        """The reclaim was withdrawn: the node takes work again (never raises)."""
        ...

    async def evacuate(self, job: Job, deadline_mono: float, cancel: asyncio.Event | None = None) -> dict[str, Any]:
        """Checkpoint ``job`` within the window and give it back to its scheduler (never raises)."""
        ...


# -- what each component reads of the agent ---------------------------------------------------


class AgentCore(Protocol):
    """What every component but the zone and the pressure watch reads of the agent: its
    configuration, its store and its event bus."""

    @property
    def config(self) -> Config: ...
    @property
    def store(self) -> Store: ...
    @property
    def events(self) -> EventBus: ...


class JobsAgent(AgentCore, Protocol):
    """What the job manager (``runtime/jobs.py``, ``runtime/jobs_api.py``) reads of the agent."""

    @property
    def netguard(self) -> NetGuard | None: ...
    @property
    def metrics(self) -> CollectorRegistry | None: ...
    @property
    def api(self) -> ApiServer | None: ...
    @property
    def airlock(self) -> AirlockRungs | None: ...
    @property
    def members(self) -> MembersForJobsApi | None: ...


class AirlockAgent(AgentCore, Protocol):
    """What Airlock (``airlock/manager.py``) reads of the agent."""

    @property
    def jobs(self) -> JobManager | None: ...
    @property
    def migrate(self) -> MigrateForAirlock | None: ...
    @property
    def api(self) -> ApiServer | None: ...
    @property
    def members(self) -> MembersForAirlock | None: ...


class NetGuardAgent(AgentCore, Protocol):
    """What netguard (``net/netguard.py``) reads of the agent."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def airlock(self) -> AirlockForNetGuard | None: ...
    @property
    def jobs(self) -> JobIndex | None: ...
    @property
    def members(self) -> MembersForNet | None: ...

    def request_stop(self) -> None: ...


class TransfersAgent(AgentCore, Protocol):
    """What the transfer registry (``net/transfers.py``) reads of the agent."""

    @property
    def metrics(self) -> CollectorRegistry | None: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def netguard(self) -> NetGuard | None: ...
    @property
    def jobs(self) -> JobIndex | None: ...


class PressureAgent(Protocol):
    """What the pressure watch (``pressurewatch.py``) reads of the agent."""

    @property
    def config(self) -> Config: ...
    @property
    def events(self) -> EventBus: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def jobs(self) -> JobsById | None: ...


class ZoneAgent(Protocol):
    """What the zone (``zone/component.py`` and its parts: hand-overs, keyring, loan) reads of
    the agent. The store and the events are optional here: the zone's unit tests run it
    without them."""

    @property
    def config(self) -> Config: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def events(self) -> EventBus | None: ...
    @property
    def api(self) -> ApiServer | None: ...
    @property
    def jobs(self) -> JobManager | None: ...
    @property
    def migrate(self) -> MigrateForZone | None: ...
    @property
    def members(self) -> MembersForZone | None: ...
    @property
    def components_started(self) -> asyncio.Event:
        """Set once the agent has started every component: the migration layer starts after
        the zone, and a loan return the zone redoes at its start waits for it until then."""
        ...


class MigrateAgent(AgentCore, Protocol):
    """What the migration layer (``migrate/reclaim.py`` and its parts: control, evacuation,
    mover, keepers, checkpoints, evidence, the archive, take-over, ...) reads of the agent. The
    zone is optional: a one-node agent, or a test, runs the migration layer without one."""

    @property
    def metrics(self) -> CollectorRegistry | None: ...
    @property
    def api(self) -> ApiServer | None: ...
    @property
    def jobs(self) -> JobManager | None: ...
    @property
    def zone(self) -> ZoneComponent | None: ...
    @property
    def netguard(self) -> NetGuard | None: ...
    @property
    def transfers(self) -> TransferRegistry | None: ...
    @property
    def schedulers(self) -> SchedulersForMigrate | None: ...


class SchedAgent(AgentCore, Protocol):
    """What the scheduler component (``sched/component.py``: Slurm, Kubernetes) reads of the
    agent: the job manager (adopted jobs, their checkpoint signal and listings), optional."""

    @property
    def jobs(self) -> JobManager | None: ...


class MembersAgent(AgentCore, Protocol):
    """What the members component (``members/component.py``: multi-node jobs) reads of the
    agent: the job manager (its members' local jobs), the zone (messages, liveness, the gang
    placement) and netguard (a member's kill-switch); each optional."""

    @property
    def jobs(self) -> JobManager | None: ...
    @property
    def zone(self) -> ZoneComponent | None: ...
    @property
    def netguard(self) -> NetGuard | None: ...


def jobs_of(agent: MigrateAgent) -> JobManager:
    """The agent's job manager, where the migration layer acts on a job it knows runs here (stops
    a moved job, submits a taken-over one). Raises RuntimeError when the agent has none."""
    if agent.jobs is None:
        raise RuntimeError("migrate: the agent has no job manager")
    return agent.jobs


__all__ = ["AgentCore", "AirlockAgent", "AirlockForNetGuard", "AirlockRungs", "JobIndex", "JobsAgent", "JobsById",
           "Departures", "MemberInfo", "MembersAgent", "MembersForAgent", "MembersForAirlock", "MembersForApi",
           "MembersForJobs", "MembersForJobsApi", "MembersForNet", "MembersForZone", "MigrateAgent", "MigrateForAirlock",
           "MigrateForZone", "MovesNow", "NetGuardAgent", "NetGuardSwitch", "PressureAgent", "SchedAgent", "SchedulersForMigrate", "TakeOvers", "TransfersAgent",
           "ZoneAgent", "jobs_of"]
