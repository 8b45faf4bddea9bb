"""The custody ledger: the only writer of ``migrate_replicas.state`` (issue 32, stage 2).

Every change of a replica's custody state goes through :func:`move`, which reads the key's row,
asks the pure table (:func:`laminar.policy.custody.step`) where the event takes it, and writes
that, with the table's store effects, in the caller's transaction. A move the table does not
allow is refused and nothing is written: with ``LAMINAR_STRICT_CUSTODY=1`` (the unit tests) it
raises :class:`~laminar.policy.custody.IllegalTransition`; otherwise one warning line names the
key, the state and the event, and ``counts["custody_refused"]`` (the migrate component's
``counts``) counts it. ``tests/unit/test_custody.py`` fails when SQL elsewhere in the agent
writes the column (an INSERT into, a DELETE from, or an UPDATE of ``state`` in the table).

A writer's SQL conditions stay the writer's and are passed here: ``only_from`` (the states its
UPDATE named) and ``if_updated`` (the row's version it read): a row that does not match is
left as it is, as the UPDATE left it, and that is no refusal.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Collection, Mapping
from typing import Any

from laminar.policy.custody import Effect, Event, IllegalTransition, State, step

log = logging.getLogger("laminar.migrate")

STRICT_ENV = "LAMINAR_STRICT_CUSTODY"
REFUSED_COUNT = "custody_refused"
# The columns a move may set besides the state (job_id: only when given, as COALESCE did).
_COLUMNS = frozenset({"ckpt", "request", "job_id"})
_INSERT = ("src_node", "src_job", "request", "ckpt")


def strict() -> bool:
    """Whether an illegal move raises (tests) rather than being logged and counted."""
    return os.environ.get(STRICT_ENV, "") == "1"


def state_of(db: sqlite3.Connection, key: str) -> State:
    """The custody state of ``key`` here (NEW: no row). A stored value that is not a state raises
    ValueError."""
    row = db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    return State.NEW if row is None else State(row[0])


def move(db: sqlite3.Connection, key: str, event: Event, *, counts: dict[str, int] | None = None,
         only_from: Collection[State] | None = None, if_updated: float | None = None,
         if_older: float | None = None, updated: float | None = None,
         insert: Mapping[str, Any] | None = None, **columns: Any) -> State | None:
    """Applies ``event`` to the custody of ``key`` in ``db`` (a connection inside the caller's
    transaction): the state :func:`~laminar.policy.custody.step` gives is written with
    ``updated`` (default: now) and ``columns`` (``ckpt``, ``request``, ``job_id``; a None
    ``job_id`` keeps the stored one), or the row is deleted when the new state is NEW, or it is
    inserted from ``insert`` (``src_node``, ``src_job``, ``request``, ``ckpt``; ``job_id``
    optional) when there was none; Effect.FORGET_RETRY deletes the key's ``migrate_retry`` row.

    Returns the state written (NEW: the row deleted), or None when nothing was written: the row
    is not in ``only_from``, its ``updated`` is not ``if_updated``, or not older than
    ``if_older``; the table says the event changes nothing in its state (Effect.UNCHANGED; its
    other effects are still done); or the move was refused (see the module)."""
    row = db.execute("SELECT state, updated FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    state = State.NEW if row is None else State(row[0])
    if only_from is not None and state not in only_from:
        return None
    if if_updated is not None and (row is None or float(row[1]) != float(if_updated)):
        return None
    if if_older is not None and (row is None or not float(row[1]) < float(if_older)):
        return None
    try:
        new, effects = step(state, event)
    except IllegalTransition:
        if strict():
            raise
        log.warning("migrate: custody refused: %s: event %s in state %s (not written)", key, event.value, state.value)
        if counts is not None:
            counts[REFUSED_COUNT] = counts.get(REFUSED_COUNT, 0) + 1
        return None
    if Effect.FORGET_RETRY in effects:
        db.execute("DELETE FROM migrate_retry WHERE key=?", (key,))
    if Effect.UNCHANGED in effects:
        return None
    bad = set(columns) - _COLUMNS
    if bad:
        raise TypeError(f"ledger.move: not a column a move sets: {sorted(bad)}")
    now = time.time() if updated is None else updated
    if new is State.NEW:
        db.execute("DELETE FROM migrate_replicas WHERE key=? AND state=?", (key, state.value))
    elif row is None:
        if insert is None or any(k not in insert for k in _INSERT):
            raise TypeError(f"ledger.move: {event.value} makes a row for {key}: insert needs {', '.join(_INSERT)}")
        db.execute("INSERT INTO migrate_replicas (key, src_node, src_job, request, ckpt, state, job_id, updated) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (key, insert["src_node"], insert["src_job"], insert["request"], insert["ckpt"], new.value,
                    insert.get("job_id", columns.get("job_id")), now))
    else:
        sets = {k: v for k, v in columns.items() if not (k == "job_id" and v is None)}
        names = "".join(f", {k}=?" for k in sets)
        db.execute(f"UPDATE migrate_replicas SET state=?{names}, updated=? WHERE key=? AND state=?",
                   (new.value, *sets.values(), now, key, state.value))
    return new
