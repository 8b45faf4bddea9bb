"""A transition table, pure: the machinery that :mod:`laminar.policy.custody` (a copy's custody)
and :mod:`laminar.policy.moves` (a move record) share. Each of them declares its own enums (the
states, the events, the effects) and its own table; this module builds the table, steps it,
refuses what it lacks, and draws it.

A table maps ``(state, event)`` to ``(new state, effects)``. One effect of each machine says
that the event writes nothing (*unchanged*: the event does not apply to a record in that state,
which is no refusal); one state says that there is no record (*start*, drawn ``[*]``).

>>> import enum
>>> class S(enum.StrEnum):
...     NEW = "new"
...     ON = "on"
>>> class E(enum.StrEnum):
...     PRESS = "press"
>>> class F(enum.StrEnum):
...     UNCHANGED = "unchanged"
>>> b: Builder[S, E, F] = Builder()
>>> b.put([S.NEW], E.PRESS, S.ON)
>>> step(b.table, S.NEW, E.PRESS, Refused)
(<S.ON: 'on'>, ())
>>> step(b.table, S.ON, E.PRESS, Refused)
Traceback (most recent call last):
...
laminar.policy.machine.Refused: record: event press is not allowed in state on
>>> print(mermaid(b.table, S, S.NEW, F.UNCHANGED), end="")
stateDiagram-v2
    [*] --> on: press
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

St = TypeVar("St", bound=enum.Enum)
Ev = TypeVar("Ev", bound=enum.Enum)
Ef = TypeVar("Ef", bound=enum.Enum)

Table = dict[tuple[St, Ev], tuple[St, tuple[Ef, ...]]]
"""(state, event) -> (new state, effects)."""


class Refused(ValueError):
    """An event the table does not allow in a state. A machine subclasses it to name its record
    (``record``) and what it calls a state (``noun``) in the message."""

    record = "record"
    noun = "state"

    def __init__(self, state: enum.Enum, event: enum.Enum) -> None:
        super().__init__(f"{self.record}: event {event.value} is not allowed in {self.noun} {state.value}")
        self.state = state
        self.event = event


class Builder(Generic[St, Ev, Ef]):
    """Builds a table one rule at a time; a (state, event) put twice is a mistake in the table."""

    def __init__(self) -> None:
        self.table: Table[St, Ev, Ef] = {}

    def put(self, states: Iterable[St], event: Ev, new: St | None, *effects: Ef) -> None:
        """``event`` takes each of ``states`` to ``new`` (None: the state stays) with ``effects``."""
        for s in states:
            assert (s, event) not in self.table, (s, event)
            self.table[(s, event)] = (s if new is None else new, tuple(effects))


def step(table: Table[St, Ev, Ef], state: St, event: Ev, refused: type[Refused]) -> tuple[St, tuple[Ef, ...]]:
    """Where ``event`` takes a record in ``state``, and the effects: raises ``refused(state,
    event)`` when the table does not allow it."""
    got = table.get((state, event))
    if got is None:
        raise refused(state, event)
    return got


def mermaid(table: Table[St, Ev, Ef], states: Iterable[St], start: St, unchanged: Ef) -> str:
    """The state diagram of the moves that write (``stateDiagram-v2``): one line per (from, to)
    with the events that make it, sorted by the order of ``states`` (``start`` drawn ``[*]``)."""
    edges: dict[tuple[St, St], list[str]] = {}
    for (s, e), (new, effects) in table.items():
        if unchanged in effects:
            continue
        edges.setdefault((s, new), []).append(str(e.value))
    order = {s: i for i, s in enumerate(states)}

    def node(s: St) -> str:
        return "[*]" if s is start else str(s.value).replace("-", "_")

    lines = ["stateDiagram-v2"]
    for (a, b) in sorted(edges, key=lambda ab: (order[ab[0]], order[ab[1]])):
        lines.append(f"    {node(a)} --> {node(b)}: {', '.join(sorted(edges[(a, b)]))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str], module: str, draw: Callable[[], str]) -> int:
    """``python -m <module> --mermaid``: prints ``draw()``; anything else: the usage, 2."""
    if argv == ["--mermaid"]:
        sys.stdout.write(draw())
        return 0
    sys.stderr.write(f"usage: python -m {module} --mermaid\n")
    return 2
