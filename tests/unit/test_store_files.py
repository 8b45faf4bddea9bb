"""The store's files are root's alone from the moment the store makes them.

The database (and SQLite's -wal and -shm beside it, which take its mode) holds every job's spec,
environment included. The store created it with the process umask (0644) and only the jobs
component made it 0600 when it started: before that, and for good in an agent without that
component, any local user could read it through the 0711 state directory.
"""

from __future__ import annotations

import stat
from pathlib import Path

from laminar.store import Store


def test_a_new_store_and_its_wal_are_0600_in_a_0711_directory(tmp_path: Path) -> None:
    db = tmp_path / "state" / "laminar.db"
    store = Store(db)
    try:
        store.add_event("job", "written", {"k": "v"})
        with store.tx() as tx:
            tx.execute("INSERT INTO meta(key, value) VALUES('lm-t', '1')")
        assert stat.S_IMODE(db.parent.stat().st_mode) == 0o711
        for f in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
            assert f.exists(), f
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))
    finally:
        store.close()
