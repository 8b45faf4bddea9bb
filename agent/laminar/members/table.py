"""The store's record of multi-node jobs (:class:`MemberTable`, the only writer of
``multinode_jobs`` and ``multinode_members``).

The origin of a job and every node that hosts one of its members keep the job's row and its
members' rows (one row per member index: its node, address, state and exit code). The table
holds them in memory too (:attr:`MemberTable.jobs`), read back from the store at start
(:meth:`MemberTable.load`): the component reads records here and changes them only through
the writers below, each one transaction, so what a message says was stored before it is sent.

A job's state moves only as :mod:`laminar.policy.members`' table allows (:meth:`MemberTable.move`
refuses anything else); at most ``max_jobs`` jobs are kept: a new one first makes room by
dropping the oldest ended ones, and is refused when every row is a live job.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from laminar.policy import members as pm
from laminar.policy.members import MemberState, MultiState
from laminar.store import Store

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS multinode_jobs (
        job TEXT PRIMARY KEY,
        origin INTEGER NOT NULL,
        spec TEXT NOT NULL,
        owner_uid INTEGER NOT NULL,
        owner_gid INTEGER NOT NULL,
        state TEXT NOT NULL,
        end_reason TEXT NOT NULL DEFAULT '',
        generation INTEGER NOT NULL DEFAULT 0,
        workers_min INTEGER NOT NULL,
        workers_max INTEGER NOT NULL,
        endpoint TEXT NOT NULL DEFAULT '',
        last_ckpt TEXT,
        last_ckpt_at REAL,
        restarts INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        updated REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS multinode_members (
        job TEXT NOT NULL,
        idx INTEGER NOT NULL,
        node INTEGER NOT NULL,
        addr TEXT NOT NULL,
        state TEXT NOT NULL,
        code INTEGER,
        updated REAL NOT NULL,
        PRIMARY KEY(job, idx))""",
]


class TableFull(ValueError):
    """No room for one more multi-node job: ``max_jobs`` live ones are kept already."""


@dataclass
class MemberRow:
    index: int
    node: int
    addr: str
    state: MemberState = MemberState.STARTING
    code: int | None = None
    updated: float = 0.0

    def view(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "addr": self.addr, "state": str(self.state), "code": self.code}


@dataclass
class MultiRecord:
    """One multi-node job as this node knows it (``spec``: the JobSpec dict; ``extra``: what the
    origin keeps beside it in memory, the placement's result)."""

    job: str
    origin: int
    spec: dict[str, Any]
    owner_uid: int
    owner_gid: int
    state: MultiState
    workers_min: int
    workers_max: int
    members: list[MemberRow]
    end_reason: str = ""
    generation: int = 0
    endpoint: str = ""
    last_ckpt: str | None = None
    last_ckpt_at: float | None = None
    restarts: int = 0
    created: float = 0.0
    updated: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def workers(self) -> int:
        return len(self.members)

    def index_of(self, node: int) -> int | None:
        """The index of this job's member on ``node`` (one member per node), None if none."""
        for m in self.members:
            if m.node == node:
                return m.index
        return None

    def policy_view(self, max_restarts: int = pm.MAX_RESTARTS) -> pm.JobView:
        return pm.JobView(self.workers, self.workers_min, self.workers_max, tuple(m.state for m in self.members),
                          self.restarts, max_restarts)


class MemberTable:
    """The only writer of the two tables (see the module's doc). ``max_jobs``: the most records
    kept."""

    def __init__(self, store: Store | None, max_jobs: int = 256) -> None:
        self.store = store
        self.max_jobs = max_jobs
        self.jobs: dict[str, MultiRecord] = {}
        if store is not None:
            store.ensure_schema("members", SCHEMA)

    # -- reading ---------------------------------------------------------------------------------

    def load(self) -> list[MultiRecord]:
        """Reads every record back from the store (at start); returns them."""
        self.jobs.clear()
        if self.store is None:
            return []
        db = self.store.db
        members: dict[str, list[MemberRow]] = {}
        for r in db.execute("SELECT job, idx, node, addr, state, code, updated FROM multinode_members ORDER BY job, idx"):
            members.setdefault(r["job"], []).append(
                MemberRow(int(r["idx"]), int(r["node"]), str(r["addr"]), MemberState(r["state"]), r["code"],
                          float(r["updated"])))
        for r in db.execute("SELECT * FROM multinode_jobs"):
            self.jobs[r["job"]] = MultiRecord(
                job=r["job"], origin=int(r["origin"]), spec=json.loads(r["spec"]), owner_uid=int(r["owner_uid"]),
                owner_gid=int(r["owner_gid"]), state=MultiState(r["state"]), workers_min=int(r["workers_min"]),
                workers_max=int(r["workers_max"]), members=members.get(r["job"], []), end_reason=r["end_reason"],
                generation=int(r["generation"]), endpoint=r["endpoint"], last_ckpt=r["last_ckpt"],
                last_ckpt_at=r["last_ckpt_at"], restarts=int(r["restarts"]), created=float(r["created"]),
                updated=float(r["updated"]))
        return list(self.jobs.values())

    def get(self, job: str) -> MultiRecord | None:
        return self.jobs.get(job)

    # -- writing ---------------------------------------------------------------------------------

    def add(self, rec: MultiRecord) -> MultiRecord:
        """Stores a new record (or replaces this node's record of the same job: a member node
        told again of a job it knows, by a relaunch's hand-over). Makes room by dropping the
        oldest ended records; raises TableFull when ``max_jobs`` live ones are kept."""
        now = time.time()
        rec.created = rec.created or now
        rec.updated = now
        if rec.job not in self.jobs and len(self.jobs) >= self.max_jobs:
            ended = sorted((r for r in self.jobs.values() if r.state is MultiState.ENDED), key=lambda r: r.updated)
            if not ended:
                raise TableFull(f"this node keeps {self.max_jobs} multi-node jobs (members.max_jobs), none of them "
                                "ended: no room for another")
            self._drop(ended[0].job)
        if self.store is not None:
            with self.store.tx() as db:
                db.execute("DELETE FROM multinode_members WHERE job=?", (rec.job,))
                db.execute("INSERT OR REPLACE INTO multinode_jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (
                    rec.job, rec.origin, json.dumps(rec.spec), rec.owner_uid, rec.owner_gid, str(rec.state),
                    rec.end_reason, rec.generation, rec.workers_min, rec.workers_max, rec.endpoint, rec.last_ckpt,
                    rec.last_ckpt_at, rec.restarts, rec.created, rec.updated))
                for m in rec.members:
                    m.updated = now
                    db.execute("INSERT INTO multinode_members VALUES (?, ?, ?, ?, ?, ?, ?)",
                               (rec.job, m.index, m.node, m.addr, str(m.state), m.code, m.updated))
        self.jobs[rec.job] = rec
        return rec

    def _drop(self, job: str) -> None:
        if self.store is not None:
            with self.store.tx() as db:
                db.execute("DELETE FROM multinode_members WHERE job=?", (job,))
                db.execute("DELETE FROM multinode_jobs WHERE job=?", (job,))
        self.jobs.pop(job, None)

    def drop(self, job: str) -> None:
        """The record goes (a placement that never started any member)."""
        self._drop(job)

    def move(self, rec: MultiRecord, event: pm.Event, end_reason: str | None = None) -> tuple[pm.Effect, ...]:
        """Moves the job as ``event`` takes it (laminar.policy.members' table) and stores it;
        returns the effects (UNCHANGED: nothing was written)."""
        new, effects = pm.step(rec.state, event)
        if pm.Effect.UNCHANGED in effects:
            return effects
        rec.state = new
        if end_reason is not None:
            rec.end_reason = end_reason[:400]
        self._store_job(rec)
        return effects

    def follow(self, rec: MultiRecord, state: MultiState, end_reason: str = "") -> None:
        """A member node's record follows its origin's word on the job's state (an answer to
        its report): the origin's table made the move; here it is only told. The origin's own
        record moves only through :meth:`move`."""
        if rec.state is state or rec.state is MultiState.ENDED:
            return
        rec.state = state
        if state is MultiState.ENDED:
            rec.end_reason = end_reason[:400]
        self._store_job(rec)

    def set_job(self, rec: MultiRecord, **values: Any) -> None:
        """Stores the job's other columns (generation, endpoint, restarts, last_ckpt,
        last_ckpt_at, origin-side edits); the state moves only through :meth:`move`."""
        allowed = {"generation", "endpoint", "restarts", "last_ckpt", "last_ckpt_at", "spec"}
        bad = set(values) - allowed
        if bad:
            raise ValueError(f"members table: {sorted(bad)} are not set here")
        for k, v in values.items():
            setattr(rec, k, v)
        self._store_job(rec)

    def _store_job(self, rec: MultiRecord) -> None:
        rec.updated = time.time()
        if self.store is None:
            return
        with self.store.tx() as db:
            db.execute("UPDATE multinode_jobs SET state=?, end_reason=?, generation=?, endpoint=?, last_ckpt=?, "
                       "last_ckpt_at=?, restarts=?, spec=?, updated=? WHERE job=?",
                       (str(rec.state), rec.end_reason, rec.generation, rec.endpoint, rec.last_ckpt, rec.last_ckpt_at,
                        rec.restarts, json.dumps(rec.spec), rec.updated, rec.job))

    def set_member(self, rec: MultiRecord, index: int, state: MemberState, code: int | None = None,
                   node: int | None = None, addr: str | None = None) -> bool:
        """Stores member ``index``'s state (and exit code; its node and address when it moved);
        returns whether anything changed (a repeated report changes nothing)."""
        m = rec.members[index]
        new_node = m.node if node is None else node
        new_addr = m.addr if addr is None else addr
        if (m.state, m.code, m.node, m.addr) == (state, code, new_node, new_addr):
            return False
        m.state, m.code, m.node, m.addr, m.updated = state, code, new_node, new_addr, time.time()
        if self.store is not None:
            with self.store.tx() as db:
                db.execute("UPDATE multinode_members SET state=?, code=?, node=?, addr=?, updated=? WHERE job=? AND idx=?",
                           (str(state), code, new_node, new_addr, m.updated, rec.job, index))
        return True
