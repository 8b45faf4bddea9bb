"""Move records (issue 32): the pure table (laminar.policy.moves), the ledger that is the only
writer of ``migrate_moves`` (laminar.migrate.ledger), the store's upgrade of an older agent's two
move tables into it (laminar.migrate.schema.upgrade_moves), and the diagram in docs/migration.md
drawn from the table."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

import laminar
from laminar.migrate import drain, ledger
from laminar.migrate.schema import MOVES_SCHEMA, RECLAIM_SCHEMA, upgrade_moves
from laminar.policy import moves
from laminar.policy.moves import Cause, Effect, Event, IllegalMove, Phase, step
from laminar.store import Store

REPO = Path(laminar.__file__).parents[2]
P, E = Phase, Event


def test_the_phases_and_causes_are_the_stored_strings() -> None:
    assert {p.value for p in moves.STORED} == {"frozen", "handover", "placing", "gone"}
    assert {c.value for c in Cause} == {"reclaim", "move_now", "readdress", "reclaim_cancelled"}
    assert set(ledger.WINDOWLESS) | set(moves.WINDOWED) == set(Cause)


def test_the_moves_the_writers_made_and_only_those() -> None:
    assert step(P.NEW, E.FREEZE) == (P.FROZEN, (Effect.RECORD,))
    assert step(P.HANDOVER, E.FREEZE)[0] is P.FROZEN  # a reclaim's move again, after a shorter window cut it
    assert step(P.FROZEN, E.HAND_OVER) == (P.HANDOVER, (Effect.KEEP,))
    assert step(P.HANDOVER, E.HAND_OVER)[0] is P.HANDOVER  # the next node, after one failed
    assert step(P.NEW, E.PLACE) == (P.PLACING, (Effect.RECORD,))
    assert step(P.HANDOVER, E.CANCEL) == (P.HANDOVER, (Effect.RECAUSE,))
    assert step(P.HANDOVER, E.RUN_HERE) == (P.FROZEN, ())
    assert step(P.HANDOVER, E.SETTLE_GONE) == (P.GONE, ())
    for p in moves.STORED:
        assert step(p, E.DONE) == (P.NEW, ())
    assert step(P.NEW, E.DONE) == (P.NEW, (Effect.UNCHANGED,))
    for p, e in [(P.GONE, E.FREEZE), (P.GONE, E.HAND_OVER), (P.PLACING, E.HAND_OVER), (P.FROZEN, E.PLACE),
                 (P.FROZEN, E.CANCEL), (P.NEW, E.RUN_HERE), (P.FROZEN, E.SETTLE_GONE)]:
        with pytest.raises(IllegalMove, match=f"event {e.value} is not allowed in phase {p.value}"):
            step(p, e)
    with pytest.raises(ValueError):
        step("moving", E.FREEZE)


def _db() -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    for sql in MOVES_SCHEMA:
        db.execute(sql)
    return db


def _row(db: sqlite3.Connection, job_id: str) -> dict[str, object] | None:
    r = db.execute("SELECT * FROM migrate_moves WHERE job_id=?", (job_id,)).fetchone()
    return None if r is None else dict(r)


def test_the_ledger_writes_what_step_says_and_refuses_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    db = _db()
    # a move without a window: recorded before the freeze, its hand-over keeps reason and thaw
    assert ledger.record_move(db, "job-1", E.FREEZE, cause=Cause.READDRESS, reason="airlock re-address", thaw=True,
                              updated=1.0) is P.FROZEN
    assert ledger.record_move(db, "job-1", E.HAND_OVER, cause=Cause.READDRESS, node=7, pid=3, request={"a": 1},
                              updated=2.0) is P.HANDOVER
    assert _row(db, "job-1") == {"job_id": "job-1", "cause": "readdress", "phase": "handover",
                                 "reason": "airlock re-address", "thaw": 1, "node": 7, "pid": 3,
                                 "request": json.dumps({"a": 1}), "updated": 2.0}
    # an operator's settle; the record is not the reclaim's, so the reclaim's drop leaves it
    assert ledger.record_move(db, "job-1", E.RUN_HERE, only=ledger.WINDOWLESS) is P.FROZEN
    assert ledger.drop_moves(db, ["job-1"], only=moves.WINDOWED) == 0
    assert ledger.move_phase(db, "job-1") is P.FROZEN
    assert ledger.move_phase(db, "job-1", moves.WINDOWED) is P.NEW
    # a reclaim's: placing, then the cancel of a hand-over makes it a move without a window
    assert ledger.record_move(db, "job-2", E.PLACE, cause=Cause.RECLAIM) is P.PLACING
    assert ledger.record_move(db, "job-3", E.HAND_OVER, cause=Cause.RECLAIM, node=4, pid=9, request={}) is P.HANDOVER
    assert ledger.record_move(db, "job-3", E.CANCEL, cause=Cause.RECLAIM_CANCELLED, reason="cancelled", thaw=True,
                              only=moves.WINDOWED) is P.HANDOVER
    r = _row(db, "job-3")
    assert r is not None and (r["cause"], r["node"], r["pid"], r["request"], r["thaw"]) == ("reclaim_cancelled", 4, 9,
                                                                                            "{}", 1)
    assert [x["job_id"] for x in ledger.move_records(db, moves.WINDOWED)] == ["job-2"]
    assert [x["job_id"] for x in ledger.move_records(db, ledger.WINDOWLESS)] == ["job-1", "job-3"]
    # strict (the unit tests): an illegal move raises; else it is logged, counted, not written
    with pytest.raises(IllegalMove):
        ledger.record_move(db, "job-2", E.HAND_OVER, cause=Cause.RECLAIM, node=1, pid=1, request={})
    monkeypatch.setenv(ledger.STRICT_ENV, "0")
    counts: dict[str, int] = {}
    assert ledger.record_move(db, "job-2", E.HAND_OVER, cause=Cause.RECLAIM, node=1, pid=1, request={},
                              counts=counts) is None
    assert counts == {ledger.REFUSED_COUNT: 1}
    assert ledger.move_phase(db, "job-2") is P.PLACING  # not written
    assert ledger.drop_moves(db, ["job-2", "job-9"]) == 1  # no record of job-9: nothing written, no refusal
    assert counts == {ledger.REFUSED_COUNT: 1}


# The two move tables of an agent before issue 32 (migrate_moves had no cause), as it created them.
OLD_SCHEMA = [
    """CREATE TABLE migrate_reclaim_jobs (job_id TEXT PRIMARY KEY, phase TEXT NOT NULL, node INTEGER,
        updated REAL NOT NULL)""",
    """CREATE TABLE migrate_reclaim_handovers (job_id TEXT PRIMARY KEY, node INTEGER NOT NULL, pid INTEGER NOT NULL,
        request TEXT NOT NULL, updated REAL NOT NULL)""",
    """CREATE TABLE migrate_moves (job_id TEXT PRIMARY KEY, phase TEXT NOT NULL, reason TEXT NOT NULL,
        thaw INTEGER NOT NULL, node INTEGER, pid INTEGER, request TEXT, updated REAL NOT NULL)""",
]
OLD_MOVES = [("job-1", "frozen", "node 3 returned to pool p (plan 2)", 1, None, None, None, 10.0),
             ("job-2", "handover", "airlock re-address", 0, 7, 31, '{"spec": 2}', 11.0),
             ("job-3", "gone", "reclaim of node 3, cancelled", 1, 8, 32, '{"spec": 3}', 12.0),
             ("job-9", "handover", "reclaim of node 3, cancelled", 1, 6, 39, '{"spec": 9}', 19.0)]
OLD_RECLAIM = [("job-4", "frozen", None, 13.0), ("job-5", "handover", 7, 14.0), ("job-6", "placing", None, 15.0),
               ("job-7", "handover", 9, 16.0),  # an older agent's: no hand-over row
               ("job-9", "handover", 6, 18.0)]  # its cancel recorded it again as a move (job-9 above)
OLD_HANDOVERS = [("job-5", 7, 35, '{"spec": 5}', 14.5), ("job-9", 6, 39, '{"spec": 9}', 18.5),
                 ("job-8", 5, 38, '{"spec": 8}', 17.0)]  # left by a record already gone


def test_the_store_upgrade_keeps_every_move_record_in_one_table(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    with store.tx() as db:  # what the agent before the upgrade left
        for sql in OLD_SCHEMA + RECLAIM_SCHEMA:
            db.execute(sql)
        db.execute("INSERT INTO migrate_reclaim VALUES (3, 30, 'owner', 1.0, 31.0)")
        db.executemany("INSERT INTO migrate_moves VALUES (?, ?, ?, ?, ?, ?, ?, ?)", OLD_MOVES)
        db.executemany("INSERT INTO migrate_reclaim_jobs VALUES (?, ?, ?, ?)", OLD_RECLAIM)
        db.executemany("INSERT INTO migrate_reclaim_handovers VALUES (?, ?, ?, ?, ?)", OLD_HANDOVERS)
    # the job manager starts before the migrate component: it reads the old shape
    assert drain._unsettled_placing(store.db) is not None
    # what ReclaimComponent.start does
    store.ensure_schema("migrate-moves", MOVES_SCHEMA)
    with store.tx() as db:
        got = upgrade_moves(db)
    assert got == {"moves": 4, "reclaim": 4, "superseded": ["job-9"], "leftover": ["job-8"]}
    tables = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "migrate_reclaim_jobs" not in tables and "migrate_reclaim_handovers" not in tables
    assert "migrate_moves_old" not in tables and "migrate_reclaim" in tables
    rows = {r["job_id"]: tuple(r) for r in store.db.execute("SELECT * FROM migrate_moves")}
    assert rows == {
        "job-1": ("job-1", "move_now", "frozen", "node 3 returned to pool p (plan 2)", 1, None, None, None, 10.0),
        "job-2": ("job-2", "readdress", "handover", "airlock re-address", 0, 7, 31, '{"spec": 2}', 11.0),
        "job-3": ("job-3", "reclaim_cancelled", "gone", "reclaim of node 3, cancelled", 1, 8, 32, '{"spec": 3}', 12.0),
        "job-9": ("job-9", "reclaim_cancelled", "handover", "reclaim of node 3, cancelled", 1, 6, 39, '{"spec": 9}',
                  19.0),
        "job-4": ("job-4", "reclaim", "frozen", "", 1, None, None, None, 13.0),
        "job-5": ("job-5", "reclaim", "handover", "", 0, 7, 35, '{"spec": 5}', 14.0),
        "job-6": ("job-6", "reclaim", "placing", "", 0, None, None, None, 15.0),
        "job-7": ("job-7", "reclaim", "handover", "", 0, 9, None, None, 16.0),
    }
    # every row of both old tables is there (job-9's reclaim row: as the move it became)
    assert {r[0] for r in OLD_MOVES} | {r[0] for r in OLD_RECLAIM} == set(rows)
    assert drain._unsettled_placing(store.db) is not None
    # and the ledger reads them
    assert [r["job_id"] for r in ledger.move_records(store.db, moves.WINDOWED)] == ["job-4", "job-5", "job-6", "job-7"]
    with store.tx() as db:  # once is enough: a later start finds nothing to do
        assert upgrade_moves(db) == {}
    store.close()


def test_an_upgrade_cut_short_leaves_the_old_tables(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    with store.tx() as db:
        for sql in OLD_SCHEMA:
            db.execute(sql)
        db.executemany("INSERT INTO migrate_moves VALUES (?, ?, ?, ?, ?, ?, ?, ?)", OLD_MOVES)
        db.executemany("INSERT INTO migrate_reclaim_jobs VALUES (?, ?, ?, ?)", OLD_RECLAIM)
    with pytest.raises(RuntimeError), store.tx() as db:
        upgrade_moves(db)
        raise RuntimeError("the agent stops here")
    assert store.db.execute("SELECT COUNT(*) FROM migrate_reclaim_jobs").fetchone()[0] == len(OLD_RECLAIM)
    assert "cause" not in {r[1] for r in store.db.execute("PRAGMA table_info(migrate_moves)")}
    assert store.db.execute("SELECT COUNT(*) FROM migrate_moves").fetchone()[0] == len(OLD_MOVES)
    store.close()


def test_the_diagram_in_the_docs_is_the_table() -> None:
    doc = (REPO / "docs" / "migration.md").read_text()
    got = re.findall(r"```mermaid\n(stateDiagram-v2\n.*?)```", doc, re.S)
    assert moves.mermaid() in got, "regenerate it: python -m laminar.policy.moves --mermaid"


def test_the_ledgers_writers_of_the_keepers_other_records() -> None:
    from laminar.migrate.schema import REPLICAS_SCHEMA

    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    for sql in REPLICAS_SCHEMA:
        db.execute(sql)
    ledger.owe_release(db, 3, "n1-job-1", 10.0)
    ledger.release_failed(db, 3, "n1-job-1", "refused")
    ledger.owe_release(db, 3, "n1-job-1", 20.0)  # owed already: its since and error stay
    assert [tuple(r) for r in db.execute("SELECT * FROM migrate_releases")] == [(3, "n1-job-1", 10.0, "refused")]
    ledger.drop_release(db, 3, "n1-job-1")
    assert db.execute("SELECT COUNT(*) FROM migrate_releases").fetchone()[0] == 0
    ledger.keeper_unanswered(db, "n2-job-1", 5.0, "timeout")
    ledger.keeper_unanswered(db, "n2-job-1", 6.0, "refused")
    assert tuple(db.execute("SELECT * FROM migrate_keeper_checks").fetchone()) == ("n2-job-1", 6.0, None, 2, "refused")
    ledger.keeper_heard(db, "n2-job-1")
    assert db.execute("SELECT unanswered FROM migrate_keeper_checks").fetchone()[0] == 0
    ledger.keeper_answered(db, "n2-job-1", 7.0)
    assert tuple(db.execute("SELECT * FROM migrate_keeper_checks").fetchone()) == ("n2-job-1", 7.0, 7.0, 0, "")
    ledger.keeper_from(db, "n2-job-1", 4, updated=8.0)
    ledger.keeper_from(db, "n2-job-1", 5, updated=9.0)
    assert tuple(db.execute("SELECT * FROM migrate_keeper_from").fetchone()) == ("n2-job-1", 5, 9.0)
    db.execute("INSERT INTO migrate_replicas VALUES ('n2-job-1', 2, 'job-1', '{}', 'c', 'keeping', NULL, 1.0)")
    ledger.forget_keeper(db, "n2-job-1", unless_replica=True)  # its keeper is there: kept
    assert db.execute("SELECT COUNT(*) FROM migrate_keeper_from").fetchone()[0] == 1
    ledger.forget_keeper(db, "n2-job-1")
    assert db.execute("SELECT COUNT(*) FROM migrate_keeper_from").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM migrate_keeper_checks").fetchone()[0] == 0
    ledger.record_replica_handover(db, "n2-job-1", 6, 41, {"spec": {}}, updated=3.0)
    assert tuple(db.execute("SELECT * FROM migrate_replica_handovers").fetchone()) == ("n2-job-1", 6, 41,
                                                                                      '{"spec": {}}', 3.0)
    ledger.drop_replica_handover(db, "n2-job-1")
    assert db.execute("SELECT COUNT(*) FROM migrate_replica_handovers").fetchone()[0] == 0
