"""The jobs table (``jobs`` in the store, :mod:`laminar.runtime.record`): a job's row written and
read back (:meth:`JobTable.persist`, :meth:`JobTable.from_row`), and the look-ups that answer
from the table alone: a page of GET /v1/jobs (:meth:`JobTable.page`), whether a job's record was
pruned, and where jobs came from (laminar.runtime.provenance: indexed columns, no spec decoded).
The job manager (``jobs.table``) holds the jobs in memory and acts; what it changes in a job is
written here."""

from __future__ import annotations

import heapq
import json
import logging
from typing import TYPE_CHECKING, Any

from ..policy import endcause
from . import provenance
from .provenance import JobOrigin
from .prune import NUM_FLOOR_KEY
from .record import Job
from .spec import JobSpec

if TYPE_CHECKING:
    from .jobs import JobManager

log = logging.getLogger("laminar.jobs")

# GET /v1/jobs answers a page: the jobs numbered below ?before= (all of them: none given), newest
# first, at most ?limit= of them (LIST_PAGE_DEFAULT, at most LIST_PAGE_MAX) and no more than
# LIST_PAGE_BYTES of stored spec text (at least one job), returned oldest first; the next page
# is ?before=<the lowest number of this one>, and an empty page is the end (laminarctl jobs
# follows them). Live jobs are listed where their numbers fall, as ended ones. Unpaged, every
# live job plus up to 100,000 ended ones were decoded, copied and encoded on the event loop for
# each request: 29 s for 16 jobs with 1 MiB envs, 1 s for 10,000 small ones.
LIST_PAGE_DEFAULT = 200
LIST_PAGE_MAX = 1000
LIST_PAGE_BYTES = 1 << 20

# What a job's row changes to as it lives (its spec and origin are written once, at submit).
_PERSIST_SQL = ("UPDATE jobs SET state=?, pid=?, cgroup_id=?, ended=?, exit_code=?, reason=?, work_lost_s=?, "
                "gpus=?, started=?, end_cause=? WHERE id=?")

class JobTable:
    """The jobs table of a job manager ``jm`` (its store, its jobs in memory, its cgroup tree
    and state directory)."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm

    @staticmethod
    def _row(job: Job) -> tuple[Any, ...]:
        return (job.state, job.pid, job.cgroup_id, job.ended, job.exit_code, job.reason, job.work_lost_s,
                json.dumps(job.gpus), job.started, None if job.end_cause is None else str(job.end_cause), job.id)

    def persist(self, job: Job) -> None:
        with self.jm.store.tx() as db:
            db.execute(_PERSIST_SQL, self._row(job))

    def persist_many(self, jobs: list[Job]) -> None:
        """`_persist` for several jobs in one transaction (one commit, one fsync); none: nothing."""
        if not jobs:
            return
        with self.jm.store.tx() as db:
            db.executemany(_PERSIST_SQL, [self._row(j) for j in jobs])

    def from_row(self, row: Any) -> Job:
        spec_d = json.loads(row["spec"])
        spec_d["job_class"] = spec_d.pop("class")
        spec = JobSpec(**spec_d)
        assert self.jm.tree is not None and self.jm.state_dir is not None
        origin = JobOrigin.from_row(row)
        cg = self.jm.adoption.cgroup_for(spec.job_class, row["id"], origin)  # an adopted job's may be in place
        adopted_ckpt = self.jm.adoption.ckpt_dir_of(origin)
        return Job(id=row["id"], num=row["num"], spec=spec, cgroup=cg, cgroup_id=row["cgroup_id"] or 0,
                   state=row["state"], pid=row["pid"], owner_uid=row["owner_uid"], owner_gid=row["owner_gid"],
                   gpus=json.loads(row["gpus"]), created=row["created"], ended=row["ended"],
                   exit_code=row["exit_code"], reason=row["reason"] or "", work_lost_s=row["work_lost_s"],
                   end_cause=endcause.parse(row["end_cause"]),
                   started=row["started"], limits=json.loads(row["limits"]) if row["limits"] else None,
                   origin=origin, spec_bytes=len(row["spec"]),
                   ckpt_dir=adopted_ckpt or self.jm.state_dir / "ckpt" / row["id"],
                   log_path=None if adopted_ckpt else self.jm.state_dir / "logs" / f"{row['id']}.log")

    def insert(self, spec_text: str, owner_uid: int, owner_gid: int, created: float, origin: JobOrigin,
               state: str = "running") -> tuple[str, int]:
        """A new job's row (an adopted one's: laminar.runtime.adopt), with this node's next number;
        its (id, num)."""
        with self.jm.store.tx() as db:
            num = self.jm.next_num(db)
            job_id = f"job-{num}"
            db.execute(f"INSERT INTO jobs(id, num, spec, state, owner_uid, owner_gid, gpus, created, "
                       f"{', '.join(provenance.COLUMNS)}) VALUES(?, ?, ?, ?, ?, ?, '[]', ?"
                       f"{', ?' * len(provenance.COLUMNS)})",
                       (job_id, num, spec_text, state, owner_uid, owner_gid, created, *origin.row()))
        return job_id, num

    def set_limits(self, job: Job) -> None:
        """The job's ``limits`` record (written once, when it starts)."""
        with self.jm.store.tx() as db:
            db.execute("UPDATE jobs SET limits=? WHERE id=?", (json.dumps(job.limits), job.id))

    def find_adopted(self, scheduler: str, ref: str) -> list[str]:
        """The ids of the jobs adopted from ``scheduler``'s job ``ref`` (any state), oldest first."""
        return [str(r[0]) for r in self.jm.store.db.execute(
            "SELECT id FROM jobs WHERE scheduler=? AND scheduler_ref=? ORDER BY num", (scheduler, ref))]

    def pruned(self, job_id: str) -> bool:
        """Whether `job_id` ("job-3" or "3") names a job this node gave and whose record was
        pruned (`prune_ended`): it has no record and its number is at or below the highest one
        pruned (numbers are given in order, never twice, and only ended jobs are pruned), so the
        job ended. False for a job with a record and for a number this node never gave. For
        whoever must tell "ended long ago" from "never heard of" once `get` says None: a keeper
        asking whether its copy of a job that ended is still needed (control op ``needs``)."""
        text = job_id[4:] if job_id.startswith("job-") else job_id
        if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < 1:
            return False
        try:
            floor = int(self.jm.store.get_meta(NUM_FLOOR_KEY, 0) or 0)
        except Exception:  # a store closing under us: cannot tell
            return False
        return int(text) <= floor and self.jm.get(job_id) is None

    def page(self, before: int | None = None, limit: int = LIST_PAGE_DEFAULT, all_jobs: bool = True,
             max_bytes: int = LIST_PAGE_BYTES) -> list[Job]:
        """One page of GET /v1/jobs (see LIST_PAGE_DEFAULT): the jobs numbered below `before`
        (any: None), newest first, at most `limit` and no more than `max_bytes` of spec text (at
        least one), oldest first; only those that have not ended unless `all_jobs`. A job in
        memory is listed as it is there (its state is newer than its row); only the rows of the
        page are decoded."""
        top = ((1 << 63) - 1) if before is None else before
        out: list[Job] = []
        size = 0
        if not all_jobs:
            for j in heapq.nlargest(limit, (j for j in self.jm.jobs.values() if j.num < top), key=lambda j: j.num):
                if out and size + j.spec_bytes > max_bytes:
                    break
                out.append(j)
                size += j.spec_bytes
            return out[::-1]
        want: list[str] = []
        for row in self.jm.store.db.execute("SELECT id, length(spec) AS n FROM jobs WHERE num < ? ORDER BY num DESC "
                                         "LIMIT ?", (top, limit)):
            if want and size + int(row["n"]) > max_bytes:
                break
            want.append(row["id"])
            size += int(row["n"])
        stored = [i for i in want if i not in self.jm.jobs]
        rows = {}
        if stored:
            marks = ",".join("?" * len(stored))
            rows = {r["id"]: r for r in self.jm.store.db.execute(f"SELECT * FROM jobs WHERE id IN ({marks})", stored)}
        for i in want:
            if i in self.jm.jobs:
                out.append(self.jm.jobs[i])
            elif i in rows:
                out.append(self.from_row(rows[i]))
        return sorted(out, key=lambda j: j.num)

    def find_origin(self, key: str) -> str | None:
        """The id of the first job (by number) that a move, a take-over or an archive claim of
        the migration key ``key`` started here, in any state but failed; None when there is none."""
        row = self.jm.store.db.execute("SELECT id FROM jobs WHERE origin_key=? AND state != 'failed' ORDER BY num "
                                    "LIMIT 1", (key,)).fetchone()
        return None if row is None else str(row[0])

    def find_placement(self, placement_id: int) -> str | None:
        """The id of the job placement ``placement_id`` started here (in any state), or None."""
        if isinstance(placement_id, bool) or not isinstance(placement_id, int) or not 0 < placement_id < 1 << 63:
            return None
        row = self.jm.store.db.execute("SELECT id FROM jobs WHERE placement_id=? ORDER BY num LIMIT 1",
                                    (placement_id,)).fetchone()
        return None if row is None else str(row[0])

    def ended_origins(self, states: tuple[str, ...]) -> dict[str, set[str]]:
        """Migration key -> ids of the jobs in ``states`` that resumed it here."""
        marks = ", ".join("?" * len(states))
        out: dict[str, set[str]] = {}
        for key, jid in self.jm.store.db.execute(f"SELECT origin_key, id FROM jobs WHERE origin_key IS NOT NULL "
                                              f"AND state IN ({marks})", states):
            out.setdefault(str(key), set()).add(str(jid))
        return out

    def resume_users(self, states: tuple[str, ...], requeued_since: float) -> list[tuple[str, str]]:
        """(job id, the resume_from the agent gave it) of the jobs in ``states``, and of those
        requeued with no end recorded or ended after ``requeued_since``; never a resume_from
        its user set (laminar.runtime.provenance)."""
        marks = ", ".join("?" * len(states))
        rows = self.jm.store.db.execute(  # (no ORDER BY: sorting by num made SQLite scan the table by num)
            f"SELECT id, resume_given, num FROM jobs WHERE resume_given IS NOT NULL AND (state IN ({marks}) OR "
            "(state = 'requeued' AND (ended IS NULL OR ended > ?)))", (*states, requeued_since)).fetchall()
        return [(str(r[0]), str(r[1])) for r in sorted(rows, key=lambda r: int(r[2]))]

    def backfill_origin(self, job_id: str, **fields: Any) -> bool:
        """At an upgrade: sets the origin columns named in ``fields`` (JobOrigin's) of job
        ``job_id`` that are still empty, from a table the agent wrote (zone_placed,
        migrate_replicas), never from the job's env; True when one was set."""
        cur = self.jm.get(job_id)
        if cur is None:
            return False
        new = JobOrigin(**{**cur.origin.__dict__, **{k: v for k, v in fields.items()
                                                      if getattr(cur.origin, k) in (None, ())}})
        if new == cur.origin:
            return False
        try:
            new.checked()
        except ValueError as e:
            log.warning("jobs: %s: not recording its origin %s: %s", job_id, fields, e)
            return False
        with self.jm.store.tx() as db:
            db.execute(f"UPDATE jobs SET {', '.join(f'{c}=?' for c in provenance.COLUMNS)} WHERE id=?",
                       (*new.row(), job_id))
        if job_id in self.jm.jobs:
            self.jm.jobs[job_id].origin = new
        return True

    def clean_stored_env(self) -> None:
        """Once, when the origin columns are added (an upgrade): the stored specs of the jobs that
        have not ended lose what their env may no longer hold (laminar.runtime.provenance
        .from_store): they are moved, requeued and started from those specs, and a peer now
        refuses the names. The user knobs become their spec fields."""
        rows = self.jm.store.db.execute("SELECT id, spec FROM jobs WHERE ended IS NULL").fetchall()
        for jid, text in rows:
            try:
                spec_d = json.loads(text)
            except ValueError:
                continue
            clean = provenance.from_store(spec_d, where=f"job {jid}'s stored spec")
            if clean is not spec_d:
                with self.jm.store.tx() as db:
                    db.execute("UPDATE jobs SET spec=? WHERE id=?", (json.dumps(clean), jid))
