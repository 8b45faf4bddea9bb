"""A stand-in agent for tests that start one component without the real agent (laminar.agent).

A component sees the agent through the interface ``laminar.components`` declares for it (a
Protocol such as ``ZoneAgent``); a stand-in must give every attribute that interface names.
:func:`standin_agent` does: the ones a test gives, ``None`` for the rest (the optional
components and core pieces the test does without), and ``components_started`` already set (every
component of the stand-in has started: nothing is waited for)."""

from __future__ import annotations

import asyncio
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
