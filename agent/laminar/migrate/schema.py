"""The migrate component's tables in the agent's store (created by
:meth:`laminar.migrate.reclaim.ReclaimComponent.start`; :mod:`laminar.migrate.reclaim` re-exports them)."""

from __future__ import annotations

import sqlite3
from typing import Any

from laminar.migrate import ledger  # the only writer of a replica's state (upgrade_keepers)
from laminar.policy.custody import State

REPLICAS_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS migrate_replicas (
        key TEXT PRIMARY KEY,
        src_node INTEGER NOT NULL,
        src_job TEXT NOT NULL,
        request TEXT NOT NULL,
        ckpt TEXT NOT NULL,
        state TEXT NOT NULL,
        job_id TEXT,
        updated REAL NOT NULL)""",
    # A keeper whose source is dead but that found no room yet: when it looks again (survives a
    # restart of the keeper's agent).
    """CREATE TABLE IF NOT EXISTS migrate_retry (
        key TEXT PRIMARY KEY,
        attempts INTEGER NOT NULL,
        next_at REAL NOT NULL,
        why TEXT NOT NULL,
        last_error TEXT NOT NULL,
        updated REAL NOT NULL)""",
    # A keeper's questions to its source (control op ``needs``): when it was last asked, when it
    # last answered (wall clock), how many questions in a row went unanswered and the last error.
    # Each of this node's jobs' keeper (the node its keeper was handed to last), so that a restarted
    # agent still releases it when the job ends or its keeper goes elsewhere.
    """CREATE TABLE IF NOT EXISTS migrate_keepers (
        job_id TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        updated REAL NOT NULL)""",
    # A ``release`` this node owes ``node`` for ``key`` (:meth:`laminar.migrate.prestage.Prestage.release`), written
    # before its first try and deleted once ``node`` answered (or it was given up, RELEASE_GIVE_UP_S
    # after ``since``, or ``node`` keeps the job again): a restarted agent sends it again.
    """CREATE TABLE IF NOT EXISTS migrate_releases (
        node INTEGER NOT NULL,
        key TEXT NOT NULL,
        since REAL NOT NULL,
        last_error TEXT NOT NULL,
        PRIMARY KEY (node, key))""",
    """CREATE TABLE IF NOT EXISTS migrate_keeper_checks (
        key TEXT PRIMARY KEY,
        asked REAL NOT NULL,
        answered REAL,
        unanswered INTEGER NOT NULL,
        last_error TEXT NOT NULL)""",
    # Who handed this node the keeper of ``key`` last (``node``: the key's own node, or a node
    # that passed the keeper on or placed the taken-over job here): with the key's node, the only
    # one that may change or release the keeper, send its checkpoints or have its job run here as
    # root (laminar.zone.authority). No row: the keeper row's src_node handed it (an older agent's).
    """CREATE TABLE IF NOT EXISTS migrate_keeper_from (
        key TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        updated REAL NOT NULL)""",
    # A keeper's placement of the job it takes over whose hand-over to ``node`` (placement ``pid``,
    # ``request``) may have been sent and was not answered yet: a restart asks the node before
    # any other take-over of the key (:meth:`Takeover.restore_replica_handovers`).
    """CREATE TABLE IF NOT EXISTS migrate_replica_handovers (
        key TEXT PRIMARY KEY,
        node INTEGER NOT NULL,
        pid INTEGER NOT NULL,
        request TEXT NOT NULL,
        updated REAL NOT NULL)""",
]

RECLAIM_SCHEMA = [
    # This node's reclaim (one row): its window's end in wall-clock time, so that an agent
    # restarted inside the window restores it, and one started after it clears it.
    """CREATE TABLE IF NOT EXISTS migrate_reclaim (
        node INTEGER PRIMARY KEY,
        notice_s REAL NOT NULL,
        reason TEXT NOT NULL,
        announced REAL NOT NULL,
        deadline REAL NOT NULL)""",
    # A reclaimed job's copy to the archive that may go on past its window's wait (no keeper, no
    # keeper: the archive is its only keeper; StoppedCopies.publish_until with ``late_ok``), written
    # before the copy starts: ``late`` 1 once the job is stopped for it (its wait over),
    # ``publishing`` 1 (written on the archive's thread, committed) right before its record is
    # renamed into place. A restart takes up a late copy of a job still ``reclaimed`` whose record
    # was never put in place, and never publishes one twice (StoppedCopies.restore_late_copies).
    """CREATE TABLE IF NOT EXISTS migrate_late_copies (
        key TEXT PRIMARY KEY,
        job_id TEXT NOT NULL,
        ckpt TEXT NOT NULL,
        record TEXT NOT NULL,
        late INTEGER NOT NULL,
        publishing INTEGER NOT NULL,
        since REAL NOT NULL)""",
]

MOVES_SCHEMA = [
    # A move under way that a restart must settle, one per job (laminar.policy.moves: the phases,
    # the causes and the moves between them; laminar.migrate.ledger is its only writer), so that
    # nothing is done twice after a stop or crash: ``frozen`` (the move froze the job: a restart
    # thaws it, ``thaw`` 1; a reclaim's is moved again), ``handover`` (its hand-over to ``node``
    # under placement ``pid`` may have been sent: ``request`` is what was handed over; a restart
    # asks the node whether it runs the job, or, a reclaim's, stops the job here), ``placing`` (a
    # reclaim's queued job whose placement elsewhere was asked for and not settled), ``gone`` (an
    # operator settled that the node runs it: the stop here is finished by a restart). ``cause``:
    # ``reclaim`` (inside this node's reclaim window: its restore or cancel settles the record),
    # ``move_now`` (a loan return's), ``readdress`` (Airlock's), ``reclaim_cancelled`` (a
    # cancelled reclaim's hand-over): the others settled by Mover.restore.
    # ``reason``: a move without a window's (a reclaim's: '').
    # (Until issue 32, a reclaim's records were in migrate_reclaim_jobs and migrate_reclaim_handovers:
    # :func:`upgrade_moves` moves them here.)
    """CREATE TABLE IF NOT EXISTS migrate_moves (
        job_id TEXT PRIMARY KEY,
        cause TEXT NOT NULL,
        phase TEXT NOT NULL,
        reason TEXT NOT NULL,
        thaw INTEGER NOT NULL,
        node INTEGER,
        pid INTEGER,
        request TEXT,
        updated REAL NOT NULL)""",
]

# The causes of the rows of an older agent's migrate_moves (no ``cause`` column), by their reason:
# Mover.readdress's reason, the cancelled reclaim's (withdraw.py); else a loan return's.
_OLD_CAUSE = ("CASE WHEN reason = 'airlock re-address' THEN 'readdress' "
              "WHEN reason LIKE 'reclaim of node %, cancelled' THEN 'reclaim_cancelled' ELSE 'move_now' END")


def _tables(db: sqlite3.Connection) -> set[str]:
    return {str(r[0]) for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


# The tables and the replica state named for a keeper's old names until 2026-12-06 (issue 32:
# one word for one thing; a keeper was a buddy, a guard or a holder), old spelling -> new.
OLD_TABLES = {"migrate_buddies": "migrate_keepers",  # old spelling
              "migrate_guard_checks": "migrate_keeper_checks",  # old spelling
              "migrate_guard_from": "migrate_keeper_from"}  # old spelling
OLD_REPLICA_STATES = {"guarding": State.KEEPING}  # migrate_replicas.state, old spelling


def upgrade_keepers(db: sqlite3.Connection) -> dict[str, int]:
    """Renames an older agent's keeper tables and replica state (:data:`OLD_TABLES`,
    :data:`OLD_REPLICA_STATES`) inside the caller's transaction, after REPLICAS_SCHEMA (which
    made the new tables, empty): each old table's rows go into the new one (a key or job already
    there keeps the new row) and the old table goes. Returns the rows carried per new table and
    ``keeping`` (replica rows whose state was renamed); empty when there was nothing to upgrade."""
    have = _tables(db)
    out: dict[str, int] = {}
    for old, new in OLD_TABLES.items():
        if old not in have:
            continue
        if new in have:
            out[new] = db.execute(f"INSERT OR IGNORE INTO {new} SELECT * FROM {old}").rowcount
            db.execute(f"DROP TABLE {old}")
        else:
            db.execute(f"ALTER TABLE {old} RENAME TO {new}")
            out[new] = int(db.execute(f"SELECT COUNT(*) FROM {new}").fetchone()[0])
    if "migrate_replicas" in have:
        for old, state in OLD_REPLICA_STATES.items():
            n = ledger.rename_state(db, old, state)
            if n:
                out[state.value] = n
    return out


def upgrade_moves(db: sqlite3.Connection) -> dict[str, Any]:
    """Brings an older agent's move records into the one ``migrate_moves`` (inside the caller's
    transaction, after MOVES_SCHEMA: an upgrade cut short leaves the old tables as they were):
    its rows without a ``cause`` get the one their reason names, every row of
    ``migrate_reclaim_jobs`` becomes a ``reclaim`` row with its hand-over (node, placement id,
    request) from ``migrate_reclaim_handovers``, and the two old tables go. Returns what it did:
    ``moves`` and ``reclaim`` (rows carried over), ``superseded`` (job ids whose reclaim row gave
    way to their move's row: a cancelled reclaim's hand-over recorded again as a move without a
    window, which its restart settles; the old agent's restart settled both) and ``leftover``
    (hand-over rows of no reclaim row, which the older agent kept but never read: their record
    had gone); empty when there was nothing to upgrade."""
    have = _tables(db)
    out: dict[str, Any] = {}
    if "migrate_moves" in have and "cause" not in {r[1] for r in db.execute("PRAGMA table_info(migrate_moves)")}:
        db.execute("ALTER TABLE migrate_moves RENAME TO migrate_moves_old")
        db.execute(MOVES_SCHEMA[0])
        out["moves"] = db.execute(
            "INSERT INTO migrate_moves (job_id, cause, phase, reason, thaw, node, pid, request, updated) "
            f"SELECT job_id, {_OLD_CAUSE}, phase, reason, thaw, node, pid, request, updated FROM migrate_moves_old"
        ).rowcount
        db.execute("DROP TABLE migrate_moves_old")
    if "migrate_reclaim_jobs" in have:
        handovers = "migrate_reclaim_handovers" in have
        sent, join = (("h.pid, h.request", "LEFT JOIN migrate_reclaim_handovers h ON h.job_id = j.job_id")
                      if handovers else ("NULL, NULL", ""))
        out["superseded"] = [str(r[0]) for r in db.execute(
            "SELECT job_id FROM migrate_reclaim_jobs WHERE job_id IN (SELECT job_id FROM migrate_moves) ORDER BY job_id")]
        out["reclaim"] = db.execute(
            "INSERT INTO migrate_moves (job_id, cause, phase, reason, thaw, node, pid, request, updated) "
            f"SELECT j.job_id, 'reclaim', j.phase, '', j.phase = 'frozen', j.node, {sent}, j.updated "
            f"FROM migrate_reclaim_jobs j {join} WHERE j.job_id NOT IN (SELECT job_id FROM migrate_moves)").rowcount
        out["leftover"] = [] if not handovers else [str(r[0]) for r in db.execute(
            "SELECT job_id FROM migrate_reclaim_handovers WHERE job_id NOT IN (SELECT job_id FROM migrate_reclaim_jobs) "
            "ORDER BY job_id")]
        db.execute("DROP TABLE migrate_reclaim_jobs")
    if "migrate_reclaim_handovers" in have:
        out.setdefault("leftover", [str(r[0]) for r in db.execute(
            "SELECT job_id FROM migrate_reclaim_handovers ORDER BY job_id")])
        db.execute("DROP TABLE migrate_reclaim_handovers")
    return out
