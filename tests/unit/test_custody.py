"""Custody (issue 32, stage 2): the pure table (laminar.policy.custody), the ledger that is the
only writer of ``migrate_replicas.state`` (laminar.migrate.ledger), and the diagram in
docs/migration.md drawn from the table."""

from __future__ import annotations

import ast
import json
import re
import sqlite3
from pathlib import Path

import pytest

import laminar
from laminar.migrate import ledger
from laminar.migrate.replica_policy import REPLICA_DONE_STATES, REPLICA_KEEPER_STATES, REPLICA_OPERATOR_STATES
from laminar.migrate.schema import REPLICAS_SCHEMA
from laminar.policy import custody
from laminar.policy.custody import Effect, Event, IllegalTransition, State, step
from laminar.zone.authority import BINDING_STATES

PKG = Path(laminar.__file__).parent
REPO = PKG.parents[1]
S, E = State, Event


def test_the_states_are_the_stored_strings_and_the_old_sets_are_the_tables() -> None:
    assert {s.value for s in S} - {"new"} == {"keeping", "waiting", "resumed", "placed", "handed-over", "passed",
                                              "released", "failed", "archived"}
    assert tuple(s.value for s in custody.DONE) == REPLICA_DONE_STATES
    assert tuple(s.value for s in custody.OPERATOR) == REPLICA_OPERATOR_STATES
    assert tuple(s.value for s in custody.LIVE) == REPLICA_KEEPER_STATES
    assert BINDING_STATES <= {s.value for s in custody.STORED}


def test_every_event_is_defined_in_every_state_it_can_meet_and_unknown_pairs_raise() -> None:
    # messages and the operator can come in any state: each has an outcome in every one
    for e in (E.KEEPER, E.RELEASE, E.NOT_NEEDED, E.SOURCE_ALIVE, E.GC, E.DROP):
        for s in S:
            step(s, e)
    # a take-over's outcomes only from what a take-over in flight can find (and no row: nothing written)
    for e in (E.WAIT, E.RESUME, E.PLACE, E.HAND_OVER, E.FAIL, E.PASS, E.ARCHIVE):
        for s in S:
            if s in custody.IN_TAKE_OVER or s is S.NEW:
                step(s, e)
            else:
                with pytest.raises(IllegalTransition, match=f"event {e.value} is not allowed in state {s.value}"):
                    step(s, e)
    with pytest.raises(ValueError):
        step("running", E.KEEPER)


def test_the_moves_the_writers_made() -> None:
    # the keeper UPSERT's CASE: a copy the take-over acted on keeps its state
    for s in (S.RESUMED, S.HANDED_OVER, S.PLACED):
        assert step(s, E.KEEPER) == (s, (Effect.GC_OLDER,))
    for s in (S.NEW, S.KEEPING, S.WAITING, S.RELEASED, S.PASSED, S.FAILED, S.ARCHIVED):
        assert step(s, E.KEEPER)[0] is S.KEEPING
    assert step(S.WAITING, E.RELEASE) == (S.RELEASED, (Effect.GC_REPLICAS,))
    assert step(S.RESUMED, E.RELEASE) == (S.RESUMED, (Effect.UNCHANGED, Effect.GC_REPLICAS))
    assert step(S.WAITING, E.SOURCE_ALIVE) == (S.KEEPING, (Effect.FORGET_RETRY,))
    assert step(S.NEW, E.RESUME) == (S.RESUMED, (Effect.FORGET_RETRY,))  # the archive's claim makes a row
    assert step(S.NEW, E.PLACE) == (S.NEW, (Effect.UNCHANGED, Effect.FORGET_RETRY))  # an UPDATE of no row
    assert step(S.FAILED, E.GC) == (S.FAILED, (Effect.UNCHANGED,))
    assert step(S.PASSED, E.GC) == (S.NEW, ())
    assert not custody.writes(S.PLACED, E.RESUME)


def _db() -> sqlite3.Connection:
    db = sqlite3.connect(":memory:")
    db.row_factory = sqlite3.Row
    for sql in REPLICAS_SCHEMA:
        db.execute(sql)
    return db


INSERT = {"src_node": 2, "src_job": "job-1", "request": "{}", "ckpt": "ckpt-1"}


def test_the_ledger_writes_what_step_says_and_refuses_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    db = _db()
    assert ledger.move(db, "n2-job-1", E.KEEPER, insert=INSERT, ckpt="ckpt-1", request="{}", updated=5.0) is S.KEEPING
    db.execute("INSERT INTO migrate_retry VALUES ('n2-job-1', 1, 0, 'why', '', 0)")
    assert ledger.move(db, "n2-job-1", E.WAIT, updated=6.0) is S.WAITING
    # a writer's own conditions: a row of another state or version is left as it is, no refusal
    assert ledger.move(db, "n2-job-1", E.NOT_NEEDED, only_from=(S.KEEPING,)) is None
    assert ledger.move(db, "n2-job-1", E.NOT_NEEDED, if_updated=5.0) is None
    assert ledger.move(db, "n2-job-1", E.RESUME, job_id="job-9") is S.RESUMED
    row = db.execute("SELECT state, job_id FROM migrate_replicas").fetchone()
    assert (row["state"], row["job_id"]) == ("resumed", "job-9")
    assert db.execute("SELECT COUNT(*) FROM migrate_retry").fetchone()[0] == 0  # FORGET_RETRY
    assert ledger.move(db, "n2-job-1", E.KEEPER, insert=INSERT, ckpt="ckpt-2", request="{}") is S.RESUMED
    assert db.execute("SELECT ckpt FROM migrate_replicas").fetchone()[0] == "ckpt-2"
    assert ledger.move(db, "n2-job-1", E.RELEASE) is None  # not a live keeper: unchanged
    with pytest.raises(IllegalTransition):  # strict (tests/conftest.py: unit tests)
        ledger.move(db, "n2-job-1", E.PLACE)
    monkeypatch.setenv(ledger.STRICT_ENV, "0")
    counts: dict[str, int] = {}
    assert ledger.move(db, "n2-job-1", E.PLACE, counts=counts) is None
    assert counts == {"custody_refused": 1}
    assert ledger.state_of(db, "n2-job-1") is S.RESUMED  # not written
    assert ledger.move(db, "n2-job-1", E.GC, if_older=0.0) is None  # not old enough
    assert ledger.move(db, "n2-job-1", E.GC, if_older=1e18) is S.NEW
    assert ledger.state_of(db, "n2-job-1") is S.NEW
    assert ledger.move(db, "n2-job-1", E.FAIL) is None  # no row: nothing written


def test_the_ledger_writes_a_keepers_request_with_a_new_version_and_forgets_a_retry() -> None:
    """What ReclaimComponent's replicas part wrote itself before: a keeper that becomes a
    take-over (``_stopped_there``: its request, a new version) and the row GC's forgetting of
    a retry schedule (``prune_rows``)."""
    db = _db()
    assert ledger.move(db, "n2-job-1", E.KEEPER, insert=INSERT, ckpt="ckpt-1", request="{}", updated=5.0) is S.KEEPING
    req = {"take_over": True, "stopped_there": "stopped"}
    # the writer's conditions: another version, or another state, is left as it is
    assert not ledger.set_request(db, "n2-job-1", req, only_from=(S.KEEPING,), if_updated=4.0)
    assert not ledger.set_request(db, "n2-job-1", req, only_from=(S.WAITING,), if_updated=5.0)
    assert db.execute("SELECT request, updated FROM migrate_replicas").fetchone()[:] == ("{}", 5.0)
    assert ledger.set_request(db, "n2-job-1", req, only_from=(S.KEEPING,), if_updated=5.0, updated=7.0)
    row = db.execute("SELECT state, request, updated FROM migrate_replicas").fetchone()
    assert (row["state"], json.loads(row["request"]), row["updated"]) == ("keeping", req, 7.0)
    assert not ledger.set_request(db, "n2-job-1", req, only_from=(S.KEEPING,), if_updated=5.0)  # read before
    db.execute("INSERT INTO migrate_retry VALUES ('n2-job-1', 1, 0, 'why', '', 0)")
    db.execute("INSERT INTO migrate_retry VALUES ('n2-job-2', 1, 0, 'why', '', 0)")
    ledger.forget_retry(db, "n2-job-1", unless_replica=True)  # its row is there: kept
    ledger.forget_retry(db, "n2-job-2", unless_replica=True)
    assert [r[0] for r in db.execute("SELECT key FROM migrate_retry")] == ["n2-job-1"]
    ledger.forget_retry(db, "n2-job-1")
    assert db.execute("SELECT COUNT(*) FROM migrate_retry").fetchone()[0] == 0


def test_the_ledger_notes_in_a_request_and_schedules_a_retry() -> None:
    """A take-over's note of the placement it fenced, a withdrawn window's end dropped
    (``note_request``: state and version as they were), and its retry schedule."""
    db = _db()
    assert ledger.move(db, "n2-job-1", E.KEEPER, insert=INSERT, ckpt="ckpt-1", request="{}", updated=5.0) is S.KEEPING
    ledger.note_request(db, "n2-job-1", {"fenced": 41})
    row = db.execute("SELECT state, request, updated FROM migrate_replicas").fetchone()
    assert (row["state"], json.loads(row["request"]), row["updated"]) == ("keeping", {"fenced": 41}, 5.0)
    ledger.schedule_retry(db, "n2-job-1", 1, 30.0, "no room", "zone full", 6.0)
    ledger.schedule_retry(db, "n2-job-1", 2, 90.0, "no room", "still full", 7.0)
    assert db.execute("SELECT key, attempts, next_at, last_error, updated FROM migrate_retry").fetchall()[0][:] == (
        "n2-job-1", 2, 90.0, "still full", 7.0)


# SQL that writes migrate_replicas: any INSERT into it, DELETE from it or UPDATE of it (its state,
# its version ``updated`` that the ledger's ``if_updated`` compares, or only its request).
_WRITES = (re.compile(r"\bINSERT\b[^;]*?\bINTO\s+migrate_replicas\b", re.I | re.S),
           re.compile(r"\bDELETE\s+FROM\s+migrate_replicas\b", re.I),
           re.compile(r"\bUPDATE\s+migrate_replicas\s+SET\b", re.I))
# Writers left outside the ledger, each with why: none.
ALLOWED: dict[str, str] = {}
# The other custody tables, written whole by the ledger (laminar.migrate.ledger's move records,
# releases owed, keeper questions, who handed a keeper, a keeper's hand-overs): any INSERT into,
# DELETE from or UPDATE of them.
LEDGER_TABLES = ("migrate_moves", "migrate_releases", "migrate_keeper_checks", "migrate_keeper_from",
                 "migrate_replica_handovers")
_TABLES = "(?:" + "|".join(LEDGER_TABLES) + r")\b"
_TABLE_WRITES = (re.compile(r"\bINSERT\b[^;]*?\bINTO\s+" + _TABLES, re.I | re.S),
                 re.compile(r"\bDELETE\s+FROM\s+" + _TABLES, re.I),
                 re.compile(r"\bUPDATE\s+" + _TABLES + r"\s+SET\b", re.I),
                 # a take-over's retry schedule: scheduled (ledger.schedule_retry) and forgotten
                 # (Effect.FORGET_RETRY, ledger.forget_retry) by the ledger only
                 re.compile(r"\bDELETE\s+FROM\s+migrate_retry\b", re.I),
                 re.compile(r"\bINSERT\b[^;]*?\bINTO\s+migrate_retry\b", re.I | re.S))
# ... and where they may be written elsewhere, each with why.
TABLE_ALLOWED = {"laminar/migrate/schema.py": "upgrade_moves copies an older agent's move records into "
                                              "migrate_moves at start, as they were (no move of any record)"}


def _text(node: ast.AST) -> str | None:
    """A string literal's text, an f-string's with ``{}`` for its values, and a ``+`` of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, t) for n in ast.walk(tree) if isinstance(n, ast.expr) and (t := _text(n)) is not None]


def test_the_ledger_is_the_only_writer_of_a_replicas_state() -> None:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG.parent))
        if rel == "laminar/migrate/ledger.py":
            continue
        for line, text in _strings(ast.parse(path.read_text(), str(path))):
            if any(p.search(text) for p in _WRITES) and rel not in ALLOWED:
                found.append(f"{rel}:{line}: {text[:80]!r}")
    assert found == [], "SQL writing migrate_replicas' state outside laminar/migrate/ledger.py:\n" + "\n".join(found)
    # and the check sees what it looks for
    src = ast.parse((PKG / "migrate" / "ledger.py").read_text())
    # (rename_state's too: the store's upgrade of an old spelling of a state)
    assert len({line for line, t in _strings(src) if any(p.search(t) for p in _WRITES)}) == 6
    assert _WRITES[2].search("UPDATE migrate_replicas SET request=?, updated=? WHERE key=?")  # a new version
    assert _WRITES[2].search("UPDATE migrate_replicas SET request=? WHERE key=?")  # a note only
    assert not _WRITES[2].search("UPDATE migrate_replicas_old SET request=?")  # a name that only begins so


def test_the_ledger_is_the_only_writer_of_the_other_custody_tables() -> None:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG.parent))
        if rel == "laminar/migrate/ledger.py" or rel in TABLE_ALLOWED:
            continue
        for line, text in _strings(ast.parse(path.read_text(), str(path))):
            if any(p.search(text) for p in _TABLE_WRITES):
                found.append(f"{rel}:{line}: {text[:80]!r}")
    assert found == [], ("SQL writing " + ", ".join(LEDGER_TABLES) + " outside laminar/migrate/ledger.py:\n"
                         + "\n".join(found))
    # and the check sees what it looks for: each table's writers in the ledger, the upgrade's copy
    src = (PKG / "migrate" / "ledger.py").read_text()
    hits = [t for _, t in _strings(ast.parse(src)) if any(p.search(t) for p in _TABLE_WRITES)]
    for table in (*LEDGER_TABLES, "migrate_retry"):
        assert any(table in t for t in hits) or f'"{table}"' in src, table
    assert len(hits) >= 12, hits
    schema = ast.parse((PKG / "migrate" / "schema.py").read_text())
    assert any(p.search(t) for _, t in _strings(schema) for p in _TABLE_WRITES)
    assert not _TABLE_WRITES[2].search("UPDATE migrate_moves_old SET x=1")  # a name that only begins so


def test_the_diagram_in_the_docs_is_the_tables() -> None:
    doc = (REPO / "docs" / "migration.md").read_text()
    got = re.search(r"```mermaid\n(stateDiagram-v2\n.*?)```", doc, re.S)
    assert got is not None, "docs/migration.md has no custody state diagram"
    assert got.group(1) == custody.mermaid(), "regenerate it: python -m laminar.policy.custody --mermaid"
