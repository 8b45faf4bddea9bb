"""The store's upgrade of an older agent's keeper tables (laminar.migrate.schema.upgrade_keepers):
until 2026-12-06 a keeper was named buddy, guard or holder (old spelling), and so were its tables and the replica
state of a key kept here (schema.OLD_TABLES, schema.OLD_REPLICA_STATES). Every row survives, in one
transaction; an upgrade cut short leaves the old tables as they were; a second start does nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar.migrate import ledger
from laminar.migrate.schema import OLD_REPLICA_STATES, OLD_TABLES, REPLICAS_SCHEMA, upgrade_keepers
from laminar.runtime.prune import KEEP_REFERENCED
from laminar.store import Store

NEW_TO_OLD = {new: old for old, new in OLD_TABLES.items()}
OLD_KEEPING = next(old for old, new in OLD_REPLICA_STATES.items() if new.value == "keeping")


def old_schema() -> list[str]:
    """REPLICAS_SCHEMA as the older agent wrote it: the same columns under the old names."""
    out = []
    for sql in REPLICAS_SCHEMA:
        for new, old in NEW_TO_OLD.items():
            sql = sql.replace(f"EXISTS {new} (", f"EXISTS {old} (")
        out.append(sql)
    return out


KEEPERS = [("job-1", 2, 10.0), ("job-2", 3, 11.0)]
CHECKS = [("n2-job-1", 5.0, 6.0, 0, ""), ("n3-job-4", 7.0, None, 2, "timed out")]
FROM = [("n2-job-1", 4, 8.0)]
REPLICAS = [("n2-job-1", 2, "job-1", "{}", "ckpt-5", OLD_KEEPING, None, 1.0),
            ("n3-job-4", 3, "job-4", "{}", "ckpt-7", "waiting", None, 2.0),
            ("n3-job-5", 3, "job-5", "{}", "ckpt-8", "released", None, 3.0)]


def older_store(path: Path) -> Store:
    store = Store(path)
    with store.tx() as db:
        for sql in old_schema():
            db.execute(sql)
        db.executemany(f"INSERT INTO {NEW_TO_OLD['migrate_keepers']} VALUES (?, ?, ?)", KEEPERS)
        db.executemany(f"INSERT INTO {NEW_TO_OLD['migrate_keeper_checks']} VALUES (?, ?, ?, ?, ?)", CHECKS)
        db.executemany(f"INSERT INTO {NEW_TO_OLD['migrate_keeper_from']} VALUES (?, ?, ?)", FROM)
        db.executemany("INSERT INTO migrate_replicas VALUES (?, ?, ?, ?, ?, ?, ?, ?)", REPLICAS)
    return store


def tables(store: Store) -> set[str]:
    return {str(r[0]) for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def test_the_old_tables_and_states_survive_the_upgrade_under_the_new_names(tmp_path: Path) -> None:
    store = older_store(tmp_path / "state.db")
    assert set(OLD_TABLES) <= tables(store)
    # what ReclaimComponent.start does: the new (empty) tables first, then the upgrade
    store.ensure_schema("migrate", REPLICAS_SCHEMA)
    with store.tx() as db:
        got = upgrade_keepers(db)
    assert got == {"migrate_keepers": 2, "migrate_keeper_checks": 2, "migrate_keeper_from": 1, "keeping": 1}
    assert not set(OLD_TABLES) & tables(store) and set(OLD_TABLES.values()) <= tables(store)
    assert [tuple(r) for r in store.db.execute("SELECT * FROM migrate_keepers ORDER BY job_id")] == KEEPERS
    assert [tuple(r) for r in store.db.execute("SELECT * FROM migrate_keeper_checks ORDER BY key")] == CHECKS
    assert [tuple(r) for r in store.db.execute("SELECT * FROM migrate_keeper_from")] == FROM
    assert [tuple(r) for r in store.db.execute("SELECT key, state FROM migrate_replicas ORDER BY key")] == [
        ("n2-job-1", "keeping"), ("n3-job-4", "waiting"), ("n3-job-5", "released")]
    # the ledger's writers work on them
    with store.tx() as db:
        ledger.forget_keeper(db, "n2-job-1")
    assert store.db.execute("SELECT COUNT(*) FROM migrate_keeper_from").fetchone()[0] == 0
    with store.tx() as db:  # once is enough: a later start finds nothing to do
        assert upgrade_keepers(db) == {}
    store.close()


def test_a_row_the_new_table_already_has_is_kept_and_the_rest_carried(tmp_path: Path) -> None:
    store = older_store(tmp_path / "state.db")
    store.ensure_schema("migrate", REPLICAS_SCHEMA)
    with store.tx() as db:
        db.execute("INSERT INTO migrate_keepers VALUES ('job-1', 7, 20.0)")  # written by the new agent
    with store.tx() as db:
        got = upgrade_keepers(db)
    assert got["migrate_keepers"] == 1
    assert [tuple(r) for r in store.db.execute("SELECT * FROM migrate_keepers ORDER BY job_id")] == [
        ("job-1", 7, 20.0), ("job-2", 3, 11.0)]
    store.close()


def test_an_upgrade_cut_short_leaves_the_old_tables(tmp_path: Path) -> None:
    store = older_store(tmp_path / "state.db")
    with pytest.raises(RuntimeError), store.tx() as db:
        upgrade_keepers(db)
        raise RuntimeError("the agent stops here")
    assert set(OLD_TABLES) <= tables(store) and not set(OLD_TABLES.values()) & tables(store)
    assert store.db.execute(f"SELECT COUNT(*) FROM {NEW_TO_OLD['migrate_keepers']}").fetchone()[0] == len(KEEPERS)
    assert store.db.execute("SELECT state FROM migrate_replicas WHERE key='n2-job-1'").fetchone()[0] == OLD_KEEPING
    store.close()


def test_a_state_is_not_renamed_as_an_old_spelling(tmp_path: Path) -> None:
    store = older_store(tmp_path / "state.db")
    with pytest.raises(ValueError, match="is a state"), store.tx() as db:
        ledger.rename_state(db, "waiting", OLD_REPLICA_STATES[OLD_KEEPING])
    store.close()


def test_the_prune_spares_a_job_the_old_table_names_until_the_upgrade() -> None:
    assert (NEW_TO_OLD["migrate_keepers"], "job_id") in KEEP_REFERENCED
    assert ("migrate_keepers", "job_id") in KEEP_REFERENCED
