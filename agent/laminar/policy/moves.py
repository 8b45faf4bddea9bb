"""Move records: the phases a job's move can leave behind in the store (one row of
``migrate_moves``), what moves a record from one to the next, and the one table of legal moves.

A move freezes a job, hands it over to another node and stops it here. What of that must not be
done twice after the agent stops or crashes is recorded before it is done: a restart thaws a
job its move froze, asks the destination of a hand-over that may have been sent whether it runs
the job, and never places twice a queued job whose placement elsewhere was asked for. Which
restart settles a record depends on its :class:`Cause`: a reclaim's (inside this node's
reclaim window) is settled by the reclaim's restore or its cancel, the others (no window) by
the restore of the moves (``Mover.restore``).

This module is the table, pure: :func:`step` says which phase an event takes a record to, or
raises :class:`IllegalMove`. :mod:`laminar.migrate.ledger` is the only writer of
``migrate_moves`` and asks :func:`step` before every write (issue 32). The table was read off
the writers as they were: it contains every move they make, and nothing else.

``python -m laminar.policy.moves --mermaid`` prints the diagram that ``docs/migration.md``
carries (``tests/unit/test_moves.py`` checks they are equal).

>>> step(Phase.FROZEN, Event.HAND_OVER)
(<Phase.HANDOVER: 'handover'>, (<Effect.KEEP: 'keep'>,))
>>> step(Phase.GONE, Event.FREEZE)
Traceback (most recent call last):
...
laminar.policy.moves.IllegalMove: move record: event freeze is not allowed in phase gone
"""

from __future__ import annotations

import enum
import sys

from laminar.policy import machine


class Cause(enum.StrEnum):
    """Why the job moves: the value is what ``migrate_moves.cause`` stores."""

    RECLAIM = "reclaim"
    """This node's reclaim, inside its window (``Evacuation._execute``, the drain of the
    queue): settled by the reclaim's restore or cancel."""
    MOVE_NOW = "move_now"
    """A loan return's move (``Mover.move_now``): no window."""
    READDRESS = "readdress"
    """Airlock's re-address rung (``Mover.readdress``): no window."""
    RECLAIM_CANCELLED = "reclaim_cancelled"
    """A reclaim's hand-over whose reclaim was cancelled while the agent was down: settled as a
    move without a window (no window's end bounds the wait for its destination's answer)."""


WINDOWED = (Cause.RECLAIM,)
"""The causes whose records the reclaim settles (the rest: ``Mover.restore``)."""


class Phase(enum.StrEnum):
    """Where a job's move is, as its record says: the value is what ``migrate_moves.phase`` stores."""

    NEW = "new"
    """No record (never stored)."""
    FROZEN = "frozen"
    """The move froze the job, or is about to (no window: recorded before the freeze, so a
    restart thaws it; a reclaim's: recorded once frozen, so a restart thaws it and moves it again)."""
    HANDOVER = "handover"
    """Its hand-over to ``node`` (placement ``pid``, ``request``) may have been sent: a restart asks
    that node, or (a reclaim's) stops the job here, never moving it twice."""
    PLACING = "placing"
    """A reclaim's queued job whose placement elsewhere was asked for and not settled: a restart
    leaves it queued (it may run there), never placing it twice."""
    GONE = "gone"
    """An operator settled the unanswered hand-over as taken by its node: the job is stopped
    here (a restart finishes that stop)."""


class Event(enum.StrEnum):
    """What moves a record, and who does it."""

    FREEZE = "freeze"
    """A move freezes the job (a reclaim's move again, after a shorter window cut the last one)."""
    HAND_OVER = "hand-over"
    """A move is about to send its hand-over (again, to the next node, after one failed)."""
    PLACE = "place"
    """A reclaim's drain asks for the placement of a queued job elsewhere."""
    CANCEL = "cancel"
    """A restart settles a cancelled reclaim: its hand-over becomes a move without a window."""
    RUN_HERE = "run-here"
    """An operator settles the unanswered hand-over: the node does not run the job."""
    SETTLE_GONE = "gone"
    """An operator settles the unanswered hand-over: the node runs the job."""
    DONE = "done"
    """The record goes: the move ended (done, failed, settled), its job ended, or its reclaim's
    records are history."""


class Effect(enum.StrEnum):
    """What the ledger does besides writing the phase."""

    UNCHANGED = "unchanged"
    """Nothing is written: the event meets no record (a DELETE of a row that is not there)."""
    RECORD = "record"
    """The record is written afresh: its cause, reason and thaw are the event's."""
    KEEP = "keep"
    """The record's cause, reason and thaw stay (when there is one of the same cause)."""
    RECAUSE = "recause"
    """The record's cause, reason and thaw are the event's; its hand-over stays."""


class IllegalMove(machine.Refused):
    """An event the table does not allow in a record's phase."""

    record = "move record"
    noun = "phase"


P, E, F = Phase, Event, Effect
Outcome = tuple[Phase, tuple[Effect, ...]]
STORED = tuple(p for p in P if p is not P.NEW)


def _table() -> machine.Table[Phase, Event, Effect]:
    b: machine.Builder[Phase, Event, Effect] = machine.Builder()
    put = b.put

    # a freeze records the move afresh; a reclaim's move of a job again (a shorter window cut the
    # last one, maybe during its hand-over) finds its record, and so may a move of a job that a
    # reclaim's drain placed once (a record the reclaim left, as its SQL replaced any row)
    put([P.NEW, P.FROZEN, P.HANDOVER, P.PLACING], E.FREEZE, P.FROZEN, F.RECORD)
    # a hand-over: after the freeze, of a job found frozen already (no record), or to the next
    # node after one failed
    put([P.NEW, P.FROZEN, P.HANDOVER], E.HAND_OVER, P.HANDOVER, F.KEEP)
    put([P.NEW], E.PLACE, P.PLACING, F.RECORD)
    put([P.HANDOVER], E.CANCEL, P.HANDOVER, F.RECAUSE)
    put([P.HANDOVER], E.RUN_HERE, P.FROZEN)
    put([P.HANDOVER], E.SETTLE_GONE, P.GONE)
    put(STORED, E.DONE, P.NEW)
    put([P.NEW], E.DONE, None, F.UNCHANGED)
    return b.table


TRANSITIONS: machine.Table[Phase, Event, Effect] = _table()
"""(phase, event) -> (new phase, effects): every move the agent makes, and only those."""


def step(phase: Phase | str | None, event: Event | str) -> Outcome:
    """Where ``event`` takes a record in ``phase`` (None or ``"new"``: no record) and what the
    ledger does besides writing it. Raises IllegalMove when the table does not allow it, and
    ValueError for a phase or event that is not one."""
    return machine.step(TRANSITIONS, Phase.NEW if phase is None else Phase(phase), Event(event), IllegalMove)


def mermaid() -> str:
    """The diagram of the moves that write (``stateDiagram-v2``), one line per (from, to) with
    the events that make it, sorted: what ``docs/migration.md`` shows."""
    return machine.mermaid(TRANSITIONS, Phase, Phase.NEW, Effect.UNCHANGED)


if __name__ == "__main__":
    raise SystemExit(machine.main(sys.argv[1:], "laminar.policy.moves", mermaid))
