"""The agent's durable state: one SQLite file under the state directory.

Each component owns its tables and declares them with :meth:`Store.ensure_schema`; the store
itself keeps only the agent-wide tables (``meta``, ``events``). SQLite runs in WAL mode with
``synchronous=FULL`` so that what a user gave the agent (a job, a policy) survives a crash or a
power cut once the call that stored it has returned.

The event log is written through a second connection with ``synchronous=NORMAL``: in WAL mode
that survives an agent crash (what matters for a log) without an fsync per event, so emitting
an event never puts a disk flush on a hot path such as a kill-switch request.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_CORE_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        fields TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS events_kind ON events(kind, id)",
]

# Events are a bounded log: the newest EVENTS_KEEP rows stay, older ones are trimmed in batches.
EVENTS_KEEP = 50_000


class Store:
    """SQLite store. ``store.db`` is the connection; wrap writes in ``with store.tx():``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # A state directory made here is 0711 (as systemd's StateDirectoryMode makes it): nobody
        # lists it, but a job run as its owner must pass through it to its checkpoint directory
        # and log (laminar.runtime.jobs). The database itself is 0600.
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
        # Root's alone from its first byte (it will hold every job's spec, env included); SQLite
        # gives its -wal and -shm files the database's mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA busy_timeout=5000")
        self._events_db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._events_db.row_factory = sqlite3.Row
        self._events_db.execute("PRAGMA synchronous=NORMAL")
        self._events_db.execute("PRAGMA busy_timeout=5000")
        self._lock = threading.RLock()
        self._schemas: set[str] = set()
        self.ensure_schema("core", _CORE_SCHEMA)
        self._event_writes = 0

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction: committed on success, rolled back on any exception."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def ensure_schema(self, component: str, statements: list[str]) -> None:
        """Runs a component's CREATE ... IF NOT EXISTS statements (once per process)."""
        if component in self._schemas:
            return
        with self.tx() as db:
            for stmt in statements:
                db.execute(stmt)
        self._schemas.add(component)

    def get_meta(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_meta(self, key: str, value: Any) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (key, json.dumps(value)))

    def del_meta(self, key: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM meta WHERE key=?", (key,))

    def add_event(self, kind: str, message: str, fields: dict[str, Any], ts: float | None = None) -> int:
        with self._lock:
            db = self._events_db
            cur = db.execute("INSERT INTO events(ts, kind, message, fields) VALUES(?, ?, ?, ?)",
                             (ts if ts is not None else time.time(), kind, message, json.dumps(fields, default=str)))
            self._event_writes += 1
            if self._event_writes % 1000 == 0:
                db.execute("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (EVENTS_KEEP,))
            return int(cur.lastrowid or 0)

    def events(self, since_id: int = 0, kind: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The newest `limit` events after `since_id`, oldest first."""
        return [decode_event(r) for r in self.event_rows(since_id, kind, limit)]

    def event_rows(self, since_id: int = 0, kind: str | None = None, limit: int = 100,
                   before_id: int | None = None) -> list[sqlite3.Row]:
        """The rows of `events` (not decoded: `decode_event`), the newest `limit` after `since_id`
        (and before `before_id`, when given: the page before one), oldest first."""
        q = "SELECT id, ts, kind, message, fields FROM events WHERE id > ?"
        args: list[Any] = [since_id]
        if before_id is not None:
            q += " AND id < ?"
            args.append(before_id)
        if kind:
            q += " AND kind = ?"
            args.append(kind)
        q += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        rows = self.db.execute(q, args).fetchall()
        rows.reverse()
        return rows

    def close(self) -> None:
        self._events_db.close()
        self.db.close()


def decode_event(r: sqlite3.Row) -> dict[str, Any]:
    """An `events` row as the API shows it."""
    return {"id": r["id"], "ts": r["ts"], "kind": r["kind"], "message": r["message"], **json.loads(r["fields"])}
