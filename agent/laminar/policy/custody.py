"""Custody: the states a node's copy of another node's checkpoint (a *replica*, one row of
``migrate_replicas``) can be in, the events that move it, and the one table of legal moves.

The invariant everything in :mod:`laminar.migrate` serves: **at most one running copy of a
job, and at least one durable, verified checkpoint of it**. A node that holds a copy for a job
of another node *keeps* it; when the job's node is gone the keeper takes the job over (resumes
it here, places it on a peer, or waits for room); a keeper whose job no longer needs it is
released; a reclaimed node passes its keepers on or to the archive.

This module is the table, pure: :func:`step` says where an event takes a copy and what else
the agent does for it (:class:`Effect`), or raises :class:`IllegalTransition`.
:mod:`laminar.migrate.ledger` is the only writer of the store's ``state`` column and asks
:func:`step` before every write. The table was read off the writers as they were (issue 32,
stage 2): it contains every move they make, and nothing else. Some moves exist only because a
message can overtake a take-over in flight (a ``release`` that comes while the take-over
hashes its checkpoint leaves a ``released`` copy that the take-over then resumes, places or
fails); they are kept, as the agent makes them.

``python -m laminar.policy.custody --mermaid`` prints the state diagram that
``docs/migration.md`` carries (``tests/unit/test_custody.py`` checks they are equal).

>>> step(State.KEEPING, Event.RESUME)
(<State.RESUMED: 'resumed'>, (<Effect.FORGET_RETRY: 'forget-retry'>,))
>>> step(State.PLACED, Event.RESUME)
Traceback (most recent call last):
...
laminar.policy.custody.IllegalTransition: custody: event resume is not allowed in state placed
"""

from __future__ import annotations

import enum
import sys

from laminar.policy import machine


class State(enum.StrEnum):
    """A copy's custody state: the value is what ``migrate_replicas.state`` stores."""

    NEW = "new"
    """No row: no keeper named the key here, or its row was pruned or dropped (never stored)."""
    KEEPING = "keeping"
    """This node keeps the job of another node: it holds a verified checkpoint and takes the job
    over if that node goes (a running job's keeper, or a stopped job's ``take_over`` keeper)."""
    WAITING = "waiting"
    """The job's node is gone and no node had room for the job yet: looked at again later."""
    RESUMED = "resumed"
    """Taken over: the job runs here from this copy."""
    PLACED = "placed"
    """Taken over: the job was handed to another node, which runs it."""
    HANDED_OVER = "handed-over"
    """The take-over found the job running already (here by a hand-over, or elsewhere by the
    archive's claim): this keeper stood down."""
    PASSED = "passed"
    """This node was reclaimed: the copy and the keeper went on to another node."""
    RELEASED = "released"
    """The job no longer needs this keeper (its keeper released it, or its node said so)."""
    FAILED = "failed"
    """The take-over found no verified checkpoint here, or may not run the job on this node's
    word: kept for an operator."""
    ARCHIVED = "archived"
    """This node was reclaimed and no peer could hold the copy: it went to the archive; kept for
    an operator."""


class Event(enum.StrEnum):
    """What moves a copy, and who does it."""

    KEEPER = "keeper"
    """A ``keeper`` message (its keeper, a passing or placing keeper) names this node the key's keeper."""
    RELEASE = "release"
    """A ``release`` message from the node that handed the keeper here: only a live keeper (keeping, waiting) ends."""
    NOT_NEEDED = "not-needed"
    """The job's node answers this keeper's ``needs`` question: not needed."""
    SOURCE_ALIVE = "source-alive"
    """A waiting keeper's node, heard again, answers that the job lives there: keeping again."""
    WAIT = "wait"
    """A take-over found no room here nor on a peer: it looks again later."""
    RESUME = "resume"
    """A take-over (or a claim of the archived copy) started the job here."""
    PLACE = "place"
    """A take-over handed the job to another node (also once a restart or an operator settled an
    unanswered hand-over of it)."""
    HAND_OVER = "hand-over"
    """A take-over found the job already running (here, or elsewhere by the archive's claim)."""
    FAIL = "fail"
    """A take-over found no verified checkpoint, or the chain of authority refused the job."""
    PASS = "pass"
    """This node is reclaimed: the copy and the keeper went on to a peer."""
    ARCHIVE = "archive"
    """This node is reclaimed: the copy went to the archive."""
    GC = "gc"
    """A done key's row, unchanged for ``replica_row_keep_s`` and with no copy left, is pruned."""
    DROP = "drop"
    """An operator drops the key (``laminarctl replicas drop``)."""


class Effect(enum.StrEnum):
    """What the agent does besides writing the state."""

    UNCHANGED = "unchanged"
    """Nothing is written: the event does not apply to a copy in this state (the writer's SQL
    never matched such a row: an UPDATE of a row that is not there, or not in the states it
    names). Not a refusal."""
    FORGET_RETRY = "forget-retry"
    """The key's retry schedule (``migrate_retry``) goes, in the same transaction."""
    GC_OLDER = "gc-older"
    """The key's checkpoints older than the one the keeper names go."""
    GC_REPLICAS = "gc-replicas"
    """The key's checkpoints go (but one a local job resumes from)."""


class IllegalTransition(machine.Refused):
    """An event the table does not allow in a copy's state."""

    record = "custody"
    noun = "state"


S, E, F = State, Event, Effect
Outcome = tuple[State, tuple[Effect, ...]]

# States after which this node keeps a key's checkpoints only for a local job using them; the
# row GC prunes only these (laminar.migrate.replica_policy.REPLICA_DONE_STATES).
DONE = (S.RELEASED, S.HANDED_OVER, S.PLACED, S.PASSED, S.RESUMED)
# States an operator decides about (laminar.migrate.replica_policy.REPLICA_OPERATOR_STATES).
OPERATOR = (S.FAILED, S.ARCHIVED)
# A live keeper: what a take-over starts from, and what a release ends.
LIVE = (S.KEEPING, S.WAITING)
# What a take-over in flight can find when it writes its outcome: the live keeper it started
# from, or a copy a ``release`` (or ``keeper``) that overtook it made released (or keeping).
IN_TAKE_OVER = (S.KEEPING, S.WAITING, S.RELEASED)
STORED = tuple(s for s in S if s is not S.NEW)


def _table() -> machine.Table[State, Event, Effect]:
    """``put(states, event, new, *effects)``, ``new`` None: the state stays (and nothing is
    written when UNCHANGED is among the effects)."""
    b: machine.Builder[State, Event, Effect] = machine.Builder()
    put = b.put

    # a keeper message: an UPSERT that keeps a copy the take-over already acted on (resumed,
    # handed-over, placed) and makes any other one (or none) keeping; its older checkpoints go
    put([S.NEW, *(s for s in STORED if s not in (S.RESUMED, S.HANDED_OVER, S.PLACED))], E.KEEPER, S.KEEPING,
        F.GC_OLDER)
    put([S.RESUMED, S.HANDED_OVER, S.PLACED], E.KEEPER, None, F.GC_OLDER)
    # a release ends only a live keeper; the key's replicas are collected whatever the state
    put(LIVE, E.RELEASE, S.RELEASED, F.GC_REPLICAS)
    put([s for s in S if s not in LIVE], E.RELEASE, None, F.UNCHANGED, F.GC_REPLICAS)
    # the source's "not needed" (its writers name the state they read, and the row's version)
    put([S.KEEPING], E.NOT_NEEDED, S.RELEASED, F.GC_REPLICAS)
    put([S.WAITING], E.NOT_NEEDED, S.RELEASED, F.FORGET_RETRY, F.GC_REPLICAS)
    put([s for s in S if s not in LIVE], E.NOT_NEEDED, None, F.UNCHANGED)
    put([S.WAITING], E.SOURCE_ALIVE, S.KEEPING, F.FORGET_RETRY)
    put([s for s in S if s is not S.WAITING], E.SOURCE_ALIVE, None, F.UNCHANGED)
    # a take-over's outcomes (unconditional UPDATEs: of no row, nothing is written)
    put(IN_TAKE_OVER, E.WAIT, S.WAITING)
    put([S.NEW], E.WAIT, None, F.UNCHANGED)
    put([*IN_TAKE_OVER, S.NEW], E.RESUME, S.RESUMED, F.FORGET_RETRY)  # from no row: the archive's claim
    for event, new in ((E.PLACE, S.PLACED), (E.HAND_OVER, S.HANDED_OVER), (E.FAIL, S.FAILED),
                       (E.PASS, S.PASSED), (E.ARCHIVE, S.ARCHIVED)):
        put(IN_TAKE_OVER, event, new, F.FORGET_RETRY)
        put([S.NEW], event, None, F.UNCHANGED, F.FORGET_RETRY)
    # the row goes: the GC's only when done; an operator's from any state
    put(DONE, E.GC, S.NEW)
    put([s for s in S if s not in DONE], E.GC, None, F.UNCHANGED)
    put(STORED, E.DROP, S.NEW, F.FORGET_RETRY)
    put([S.NEW], E.DROP, None, F.UNCHANGED, F.FORGET_RETRY)
    return b.table


TRANSITIONS: machine.Table[State, Event, Effect] = _table()
"""(state, event) -> (new state, effects): every move the agent makes, and only those."""


def step(state: State | str | None, event: Event | str) -> Outcome:
    """Where ``event`` takes a copy in ``state`` (None or ``"new"``: no row) and what the agent
    does besides writing it. Raises IllegalTransition when the table does not allow it, and
    ValueError for a state or event that is not one."""
    return machine.step(TRANSITIONS, State.NEW if state is None else State(state), Event(event), IllegalTransition)


def writes(state: State | str | None, event: Event | str) -> bool:
    """Whether ``event`` writes the row of a copy in ``state`` (a legal move that is not UNCHANGED)."""
    try:
        return F.UNCHANGED not in step(state, event)[1]
    except IllegalTransition:
        return False


def mermaid() -> str:
    """The state diagram of the moves that write (``stateDiagram-v2``), one line per (from, to)
    with the events that make it, sorted: what ``docs/migration.md`` shows."""
    return machine.mermaid(TRANSITIONS, State, State.NEW, Effect.UNCHANGED)


if __name__ == "__main__":
    raise SystemExit(machine.main(sys.argv[1:], "laminar.policy.custody", mermaid))
