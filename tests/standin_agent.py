"""A stand-in agent for tests that start one component without the real agent (laminar.agent).

A component sees the agent through the interface ``laminar.components`` declares for it (a
Protocol such as ``ZoneAgent``); a stand-in must give every attribute that interface names.
:func:`standin_agent` does: the ones a test gives, ``None`` for the rest (the optional
components and core pieces the test does without), and ``components_started`` already set (every
component of the stand-in has started: nothing is waited for)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


def interface_names(interface: type) -> list[str]:
    """The attributes and methods an interface Protocol of laminar.components names."""
    return sorted({n for cls in interface.__mro__ if cls is not object for n, v in vars(cls).items()
                   if not n.startswith("_") and (isinstance(v, property) or callable(v))})


def standin_agent(interface: type, **given: Any) -> SimpleNamespace:
    """A stand-in agent with every name of ``interface``: ``given``, else None (an already set
    Event for ``components_started``). A name the interface does not have is refused: a stand-in
    gives what a component may reach, nothing more."""
    names = interface_names(interface)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{interface.__name__} names no {', '.join(unknown)} (it names {', '.join(names)})")
    out: dict[str, Any] = dict.fromkeys(names)
    if "components_started" in out:
        started = asyncio.Event()
        started.set()
        out["components_started"] = started
    out.update(given)
    return SimpleNamespace(**out)


class NoTakeOvers:
    """The take-over part of a stand-in migration layer: it took no job over."""

    async def taken_over_as(self, key: str | None) -> str | None:
        return None


class Departures:
    """The evidence part of a stand-in migration layer: the departures it is told of."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, bool]] = []

    def observe_departure(self, ts: float, announced: bool) -> None:
        self.seen.append((ts, announced))


class NoMoves:
    """The mover of a stand-in migration layer: it moves no job (a test that needs a move uses
    the real one)."""

    async def move_now(self, job: Any, reason: str) -> Any:
        raise NotImplementedError("a stand-in migration layer moves no job")


class StandInMigrate:
    """A stand-in migration layer as the zone sees it (``laminar.components.MigrateForZone``):
    the checkpoint driver it is given (``ckpt``), no take-overs, the departures it is told of
    (``departures``: (ts, announced)); it checks no checkpoint (``check_resume`` answers the
    path) and moves no job (``mover.move_now`` raises)."""

    def __init__(self, ckpt: Any = None) -> None:
        self.ckpt = ckpt
        self.takeover = NoTakeOvers()
        self.evidence = Departures()
        self.mover = NoMoves()

    @property
    def departures(self) -> list[tuple[float, bool]]:
        return self.evidence.seen

    def check_resume(self, path: str, owner_uid: int = 0, owner_gid: int | None = None) -> str:
        return path


@dataclass(frozen=True)
class StandInMember:
    """One member of a multi-node job as a stand-in members component hosts it
    (``laminar.components.MemberInfo``)."""

    job: str
    index: int
    count: int
    origin: int = 1
    rigid: bool = True


class StandInMembers:
    """A stand-in members component (``agent.members``; ``laminar.components.MembersForAgent``),
    for the node-local halves of issue 33 built before the real one (``laminar/members/``): the
    members it is told this node hosts (``hosted``: job id -> StandInMember), the multi-node
    jobs it knows without a member here (``originated``: job ids), what Airlock told it
    (``airlock``: (job, action, work lost)) and the kill-switch fan-outs asked of it
    (``switched``: (job, on, by_uid)). A fan-out calls ``set_job_switch(job, on)`` on each of
    ``peers`` (the netguards of the other members' nodes, as their agents would on the origin's
    ORDER) and answers what they said; ``refuse`` makes it raise that instead."""

    def __init__(self, *hosted: StandInMember, originated: tuple[str, ...] = (), peers: tuple[Any, ...] = ()) -> None:
        self.hosted = {m.job: m for m in hosted}
        self.originated = set(originated)
        self.peers = list(peers)
        self.airlock: list[tuple[str, str, float | None]] = []
        self.switched: list[tuple[str, bool, int]] = []
        self.refuse: Exception | None = None

    def member_of(self, job_id: str) -> StandInMember | None:
        return self.hosted.get(job_id)

    def on_airlock(self, job_id: str, action: str, work_lost_s: float | None) -> None:
        self.airlock.append((job_id, action, work_lost_s))

    def view(self, job_id: str) -> dict[str, Any] | None:
        if job_id not in self.hosted and job_id not in self.originated:
            return None
        return {"id": job_id, "state": "running"}

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]:
        self.switched.append((job_id, on, by_uid))
        if self.refuse is not None:
            raise self.refuse
        return {"job": job_id, "on": on, "members": [p.set_job_switch(job_id, on) for p in self.peers]}
