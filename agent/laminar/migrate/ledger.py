"""The custody ledger: the only writer of ``migrate_replicas.state`` (issue 32, stage 2) and of
the row's version ``updated`` (:func:`set_request`: a request written with a new version), of
the other custody tables: ``migrate_moves`` (:func:`record_move`, the table of
:mod:`laminar.policy.moves`), ``migrate_releases``, ``migrate_keeper_checks``,
``migrate_keeper_from`` and ``migrate_replica_handovers`` (plain writers: those rows have no
states), and the only one that forgets a take-over's retry schedule (``migrate_retry``:
:func:`forget_retry`). ``tests/unit/test_custody.py`` fails on SQL elsewhere that writes any of them.

Every change of a replica's custody state goes through :func:`move`, which reads the key's row,
asks the pure table (:func:`laminar.policy.custody.step`) where the event takes it, and writes
that, with the table's store effects, in the caller's transaction. A move the table does not
allow is refused and nothing is written: with ``LAMINAR_STRICT_CUSTODY=1`` (the unit tests) it
raises :class:`~laminar.policy.custody.IllegalTransition`; otherwise one warning line names the
key, the state and the event, and ``counts["custody_refused"]`` (the migrate component's
``counts``) counts it; a move record's refusal (:func:`record_move`) is the same. ``tests/unit/test_custody.py``
fails when SQL elsewhere in the agent writes the column (an INSERT into, a DELETE from, or an
UPDATE of ``state`` in the table).

A writer's SQL conditions stay the writer's and are passed here: ``only_from`` (the states its
UPDATE named) and ``if_updated`` (the row's version it read): a row that does not match is
left as it is, as the UPDATE left it, and that is no refusal.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from laminar.policy import moves
from laminar.policy.custody import Effect, Event, IllegalTransition, State, step
from laminar.policy.moves import Cause, IllegalMove, Phase

log = logging.getLogger("laminar.migrate")

STRICT_ENV = "LAMINAR_STRICT_CUSTODY"
REFUSED_COUNT = "custody_refused"
# The columns a move may set besides the state (job_id: only when given, as COALESCE did).
_COLUMNS = frozenset({"ckpt", "request", "job_id"})
_INSERT = ("src_node", "src_job", "request", "ckpt")


def strict() -> bool:
    """Whether an illegal move raises (tests) rather than being logged and counted."""
    return os.environ.get(STRICT_ENV, "") == "1"


def _refused(err: ValueError, what: str, why: str, counts: dict[str, int] | None) -> None:
    """A move the table does not allow (``err``): raised in strict mode, else one warning line
    and ``counts[REFUSED_COUNT]``."""
    if strict():
        raise err
    log.warning("migrate: custody refused: %s: %s (not written)", what, why)
    if counts is not None:
        counts[REFUSED_COUNT] = counts.get(REFUSED_COUNT, 0) + 1


def state_of(db: sqlite3.Connection, key: str) -> State:
    """The custody state of ``key`` here (NEW: no row). A stored value that is not a state raises
    ValueError."""
    row = db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()
    return State.NEW if row is None else State(row[0])


def rename_state(db: sqlite3.Connection, old: str, new: State) -> int:
    """The store's upgrade (:func:`laminar.migrate.schema.upgrade_keepers`): rows whose state an
    older agent stored as ``old`` (a spelling before a rename, not a state) get ``new``, as they
    were: no move of custody. Returns how many."""
    if old in {s.value for s in State}:
        raise ValueError(f"rename_state: {old!r} is a state, not an old spelling of one")
    return db.execute("UPDATE migrate_replicas SET state=? WHERE state=?", (new.value, old)).rowcount


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
    except IllegalTransition as err:
        _refused(err, key, f"event {event.value} in state {state.value}", counts)
        return None
    if Effect.FORGET_RETRY in effects:
        forget_retry(db, key)
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


def set_request(db: sqlite3.Connection, key: str, request: Mapping[str, Any], *, only_from: Collection[State],
                if_updated: float, updated: float | None = None) -> bool:
    """Writes ``request`` (stored as JSON) into the row of ``key`` with a new version ``updated``
    (default: now), its state unchanged: only when the row is in ``only_from`` and unchanged since
    ``if_updated`` (the version its writer read), as with :func:`move`. No transition (a keeper
    that becomes a take-over: its request's ``take_over``). Returns whether the row was written."""
    now = time.time() if updated is None else updated
    states = [State(s).value for s in only_from]
    cur = db.execute(f"UPDATE migrate_replicas SET request=?, updated=? WHERE key=? AND updated=? AND state IN "
                     f"({','.join('?' * len(states))})", (json.dumps(request), now, key, if_updated, *states))
    return cur.rowcount == 1


def note_request(db: sqlite3.Connection, key: str, request: Mapping[str, Any]) -> None:
    """Writes ``request`` (stored as JSON) into the row of ``key``, its state and version
    unchanged: a note a later reader of the row needs (the placement a take-over fenced, a
    withdrawn reclaim's window gone), not a custody move."""
    db.execute("UPDATE migrate_replicas SET request=? WHERE key=?", (json.dumps(request), key))


def schedule_retry(db: sqlite3.Connection, key: str, attempts: int, next_at: float, why: str, error: str,
                   updated: float) -> None:
    """The retry schedule of ``key``'s take-over (``migrate_retry``): ``attempts`` so far, the
    next look at ``next_at``."""
    db.execute("INSERT INTO migrate_retry VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
               "attempts=excluded.attempts, next_at=excluded.next_at, last_error=excluded.last_error, "
               "updated=excluded.updated", (key, attempts, next_at, why, error, updated))


def forget_retry(db: sqlite3.Connection, key: str, unless_replica: bool = False) -> None:
    """The retry schedule of ``key``'s take-over goes (``migrate_retry``; Effect.FORGET_RETRY);
    ``unless_replica``: only when ``key`` has no ``migrate_replicas`` row (the row GC's)."""
    if unless_replica:
        db.execute("DELETE FROM migrate_retry WHERE key=? AND NOT EXISTS (SELECT 1 FROM migrate_replicas WHERE key=?)",
                   (key, key))
    else:
        db.execute("DELETE FROM migrate_retry WHERE key=?", (key,))


# -- move records (``migrate_moves``: laminar.policy.moves) -------------------------------------

WINDOWLESS = tuple(c for c in Cause if c not in moves.WINDOWED)
"""The causes of the moves without a window (settled by Mover.restore)."""

def move_phase(db: sqlite3.Connection, job_id: str, only: Collection[Cause] | None = None) -> Phase:
    """The phase of ``job_id``'s move record here (of the causes ``only``; NEW: none)."""
    row = db.execute("SELECT phase, cause FROM migrate_moves WHERE job_id=?", (job_id,)).fetchone()
    return Phase.NEW if row is None or (only is not None and Cause(row[1]) not in only) else Phase(row[0])


def record_move(db: sqlite3.Connection, job_id: str, event: moves.Event, *, cause: Cause | None = None,
                reason: str = "", thaw: bool = False, node: int | None = None, pid: int | None = None,
                request: Mapping[str, Any] | None = None, only: Collection[Cause] | None = None,
                counts: dict[str, int] | None = None, updated: float | None = None) -> Phase | None:
    """Applies ``event`` to the move record of ``job_id`` in ``db`` (a connection inside the
    caller's transaction), as :func:`laminar.policy.moves.step` says: the record is written
    afresh with ``cause``, ``reason``, ``thaw`` and the hand-over (``node``, ``pid``,
    ``request``, stored as JSON) (Effect.RECORD); or keeps the cause, reason and thaw of a record
    of the same ``cause`` (Effect.KEEP); or takes ``cause``, ``reason`` and ``thaw`` and keeps
    its hand-over (Effect.RECAUSE); or only its phase changes; or it is deleted (the phase NEW).
    ``only``: the causes of the records the event is for (a record of another is left as it is,
    and that is no refusal). Returns the phase written (NEW: deleted), or None when nothing was
    written (no record for the event, or refused: see the module)."""
    row = db.execute("SELECT phase, cause FROM migrate_moves WHERE job_id=?", (job_id,)).fetchone()
    if row is not None and only is not None and Cause(row[1]) not in only:
        return None
    phase = Phase.NEW if row is None else Phase(row[0])
    try:
        new, effects = moves.step(phase, event)
    except IllegalMove as err:
        _refused(err, job_id, f"move record event {event.value} in phase {phase.value}", counts)
        return None
    if moves.Effect.UNCHANGED in effects:
        return None
    now = time.time() if updated is None else updated
    sent = None if request is None else json.dumps(request)
    if new is Phase.NEW:
        db.execute("DELETE FROM migrate_moves WHERE job_id=? AND phase=?", (job_id, phase.value))
    elif moves.Effect.RECORD in effects or (moves.Effect.KEEP in effects and (row is None or row[1] != cause)):
        if cause is None:
            raise TypeError(f"ledger.record_move: {event.value} records a move of {job_id}: it needs its cause")
        db.execute("INSERT OR REPLACE INTO migrate_moves (job_id, cause, phase, reason, thaw, node, pid, request, "
                   "updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (job_id, Cause(cause).value, new.value, reason, int(thaw), node, pid, sent, now))
    elif moves.Effect.KEEP in effects:
        db.execute("UPDATE migrate_moves SET phase=?, node=?, pid=?, request=?, updated=? WHERE job_id=? AND phase=?",
                   (new.value, node, pid, sent, now, job_id, phase.value))
    elif moves.Effect.RECAUSE in effects:
        if cause is None:
            raise TypeError(f"ledger.record_move: {event.value} of {job_id} needs the record's new cause")
        db.execute("UPDATE migrate_moves SET cause=?, phase=?, reason=?, thaw=?, updated=? WHERE job_id=? AND phase=?",
                   (Cause(cause).value, new.value, reason, int(thaw), now, job_id, phase.value))
    else:
        db.execute("UPDATE migrate_moves SET phase=?, updated=? WHERE job_id=? AND phase=?",
                   (new.value, now, job_id, phase.value))
    return new


def drop_moves(db: sqlite3.Connection, job_ids: Iterable[str], only: Collection[Cause] | None = None,
               counts: dict[str, int] | None = None) -> int:
    """Event DONE for the move record of each of ``job_ids`` (of the causes ``only``). Returns
    how many went."""
    return sum(record_move(db, j, moves.Event.DONE, only=only, counts=counts) is Phase.NEW for j in job_ids)


def move_records(db: sqlite3.Connection, causes: Collection[Cause] | None = None) -> list[sqlite3.Row]:
    """The move records here (of ``causes``), by job id."""
    rows = db.execute("SELECT * FROM migrate_moves ORDER BY job_id").fetchall()
    return [r for r in rows if causes is None or Cause(r["cause"]) in causes]



# -- the keepers' other records ------------------------------------------------------------------
# These rows have no states to move between: what they hold is written here, with the SQL each
# writer had, so that this module stays the only writer of every custody table (issue 32).

def owe_release(db: sqlite3.Connection, node: int, key: str, since: float) -> None:
    """``node`` is to be told it no longer keeps ``key`` (``migrate_releases``; one owed
    already keeps its ``since`` and last error)."""
    db.execute("INSERT OR IGNORE INTO migrate_releases VALUES (?, ?, ?, '')", (node, key, since))


def release_failed(db: sqlite3.Connection, node: int, key: str, error: str) -> None:
    """The last try of the release owed ``node`` for ``key`` failed with ``error``."""
    db.execute("UPDATE migrate_releases SET last_error=? WHERE node=? AND key=?", (error, node, key))


def drop_release(db: sqlite3.Connection, node: int, key: str) -> None:
    """The release owed ``node`` for ``key`` is no longer owed (answered, given up, or void)."""
    db.execute("DELETE FROM migrate_releases WHERE node=? AND key=?", (node, key))


def keeper_heard(db: sqlite3.Connection, key: str) -> None:
    """The keeper's source spoke about ``key`` (a ``keeper`` message): its earlier silence no
    longer counts (``migrate_keeper_checks``)."""
    db.execute("UPDATE migrate_keeper_checks SET unanswered=0 WHERE key=?", (key,))


def keeper_unanswered(db: sqlite3.Connection, key: str, asked: float, error: str) -> None:
    """The ``needs`` question about ``key`` asked at ``asked`` went unanswered (``error``): one
    more in a row."""
    db.execute("INSERT INTO migrate_keeper_checks VALUES (?, ?, NULL, 1, ?) ON CONFLICT(key) DO UPDATE SET "
               "asked=excluded.asked, unanswered=unanswered + 1, last_error=excluded.last_error", (key, asked, error))


def keeper_answered(db: sqlite3.Connection, key: str, at: float) -> None:
    """The ``needs`` question about ``key`` asked at ``at`` was answered: none unanswered."""
    db.execute("INSERT INTO migrate_keeper_checks VALUES (?, ?, ?, 0, '') ON CONFLICT(key) DO UPDATE SET "
               "asked=excluded.asked, answered=excluded.answered, unanswered=0, last_error=''", (key, at, at))


def keeper_from(db: sqlite3.Connection, key: str, node: int, updated: float | None = None) -> None:
    """``node`` handed this node the keeper of ``key`` last (``migrate_keeper_from``)."""
    db.execute("INSERT INTO migrate_keeper_from VALUES (?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
               "node=excluded.node, updated=excluded.updated", (key, node, time.time() if updated is None else updated))


def forget_keeper(db: sqlite3.Connection, key: str, unless_replica: bool = False) -> None:
    """The questions about ``key``'s keeper and who handed it go (``migrate_keeper_checks``,
    ``migrate_keeper_from``); ``unless_replica``: only when ``key`` has no ``migrate_replicas``
    row (the row GC's: a keeper given again meanwhile keeps them)."""
    for table in ("migrate_keeper_checks", "migrate_keeper_from"):
        if unless_replica:
            db.execute(f"DELETE FROM {table} WHERE key=? AND NOT EXISTS (SELECT 1 FROM migrate_replicas WHERE key=?)",
                       (key, key))
        else:
            db.execute(f"DELETE FROM {table} WHERE key=?", (key,))


def record_replica_handover(db: sqlite3.Connection, key: str, node: int, pid: int, request: Mapping[str, Any],
                            updated: float | None = None) -> None:
    """A keeper's placement of the job of ``key`` it takes over is about to hand it to ``node``
    (placement ``pid``, ``request``): a restart asks ``node`` first (``migrate_replica_handovers``)."""
    db.execute("INSERT OR REPLACE INTO migrate_replica_handovers VALUES (?, ?, ?, ?, ?)",
               (key, node, pid, json.dumps(request), time.time() if updated is None else updated))


def drop_replica_handover(db: sqlite3.Connection, key: str) -> None:
    """The keeper's hand-over of ``key`` was answered (or settled): its record goes."""
    db.execute("DELETE FROM migrate_replica_handovers WHERE key=?", (key,))
