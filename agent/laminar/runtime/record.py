"""A job's record: its states (``STATES``; which have ended), the :class:`Job` the agent
holds while it lives and reads back from the store, and the ``jobs`` table (``SCHEMA``, the
columns added since, :func:`upgrade_columns`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..airlock.cgroups import CgroupError, JobCgroup
from ..policy import admission, endcause
from ..policy.endcause import EndCause
from . import provenance
from .provenance import NO_ORIGIN, JobOrigin
from .spec import JobSpec

ACTIVE_STATES = ("running", "suspended")
# A queued job has no cgroup and no process yet: it waits for room under its class's cap
# (`airlock.admission`). Queued, running and suspended jobs are the ones that have not ended.
QUEUED = "queued"
LIVE_STATES = (QUEUED, *ACTIVE_STATES)
STATES = ("queued", "running", "suspended", "exited", "stopped", "reclaimed", "killed", "failed", "lost", "readdressed",
          "requeued", "migrated")

# The reason of a job found ``lost`` at the agent's start whose cgroup was gone (the node rebooted,
# or someone removed it), not merely empty (its processes ended while the agent was down: it may
# have finished by itself). Only such a job is resumed by its keeper elsewhere (migrate: ``needs``).
# Its end_cause is EndCause.LOST_WITH_CGROUP, which is what other code reads (the text is for people).
LOST_WITH_CGROUP = endcause.LOST_WITH_CGROUP_TEXT


# What a job's env values read as to a caller who is neither the job's owner nor root.
REDACTED = "<redacted>"


SCHEMA = [
    """CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        num INTEGER UNIQUE NOT NULL,
        spec TEXT NOT NULL,
        state TEXT NOT NULL,
        pid INTEGER,
        cgroup_id INTEGER,
        owner_uid INTEGER NOT NULL,
        owner_gid INTEGER NOT NULL,
        gpus TEXT NOT NULL,
        created REAL NOT NULL,
        ended REAL,
        exit_code INTEGER,
        reason TEXT,
        work_lost_s REAL)""",
]
# Cgroups of ended jobs that could not be removed yet: retried by the sweep and at every start.
SCHEMA.append("""CREATE TABLE IF NOT EXISTS jobs_leaked_cgroups (
        job_id TEXT PRIMARY KEY,
        job_class TEXT NOT NULL,
        since REAL NOT NULL,
        tries INTEGER NOT NULL,
        error TEXT NOT NULL)""")
# Retention (prune_ended) picks the oldest ended jobs.
SCHEMA.append("CREATE INDEX IF NOT EXISTS jobs_by_ended ON jobs(ended)")
# Columns added after the first release, with their types (added to an existing table at start).
LATER_COLUMNS = {"started": "REAL", "limits": "TEXT"}
# ... why the job ended (laminar.policy.endcause; NULL while it has not): added with the causes
# of the ended records already there (backfill_end_causes), in the same transaction
LATER_COLUMNS["end_cause"] = "TEXT"
# ... and where the job came from, written by the agent only (laminar.runtime.provenance)
LATER_COLUMNS.update(provenance.COLUMNS)


@dataclass
class Job:
    """One job. `state` is one of STATES; `cgroup` its cgroups; `pid` the main process."""

    id: str
    num: int
    spec: JobSpec
    cgroup: JobCgroup
    cgroup_id: int
    state: str = "running"
    pid: int | None = None
    owner_uid: int = 0
    owner_gid: int = 0
    gpus: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    ended: float | None = None
    exit_code: int | None = None
    reason: str = ""
    work_lost_s: float | None = None
    end_cause: EndCause | None = None  # why it ended (None: it has not), set with its end state
    ckpt_dir: Path | None = None
    log_path: Path | None = None
    reattached: bool = False
    started: float | None = None  # when its process started (None while queued)
    wait: admission.Wait | None = None  # why it is queued (in memory; its reason says the same)
    limits: dict[str, Any] | None = None  # what it started with (joblimits.Profile.record; None: queued)
    # its checkpoint directory's modification time at the scanner's last look, None while it is
    # empty or not looked at yet (in memory: laminar.runtime.ckpt_scan sets it)
    ckpt_seen: float | None = field(default=None, compare=False, repr=False)
    # (path, commit time) of its newest checkpoint that verified against its manifest, as the
    # checkpoint driver's check last found it, None while none did (in memory:
    # laminar.migrate.ckpt_driver sets it): what is published as its last checkpoint
    ckpt_verified: tuple[str, float] | None = field(default=None, compare=False, repr=False)
    origin: JobOrigin = NO_ORIGIN  # where it came from, as the agent recorded it (never from its env)
    spec_bytes: int = 0  # the length of its stored spec text (a page of GET /v1/jobs counts it)
    # set by the agent's own code over the spec's env at the spawn (a multi-node member's
    # rendezvous, laminar.members); in memory only: a reattached job runs already
    agent_env: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def active(self) -> bool:
        """Running or suspended: it has a cgroup and processes."""
        return self.state in ACTIVE_STATES

    @property
    def live(self) -> bool:
        """Not ended: queued, running or suspended."""
        return self.state in LIVE_STATES

    @property
    def pids(self) -> list[int]:
        return self.cgroup.pids() if self.active else []

    def last_checkpoint(self) -> float | None:
        """Wall time of the last change to the job's checkpoint directory (every checkpoint
        jobkit commits is renamed into it), or None while it is empty, as the checkpoint scanner
        last saw it (:mod:`laminar.runtime.ckpt_scan`, every CKPT_SCAN_EVERY_S, off the loop).
        O(1): Airlock asks on every tick, for every job, and the job's owner writes that
        directory (a link into hung storage, a million entries: read here, on the loop, they
        held the agent)."""
        return self.ckpt_seen if self.ckpt_dir is not None else None

    def verified_checkpoint(self) -> tuple[str, float] | None:
        """(path, commit time) of the job's newest checkpoint that verified, as last checked
        (O(1)); None while none did. A directory's change (a checkpoint half written, an entry
        named like one, a user's touch) moves :meth:`last_checkpoint`, never this: what the API's
        ``last_ckpt``, the metrics and the schedulers are told."""
        return self.ckpt_verified if self.ckpt_dir is not None else None

    def work_at_risk_s(self, now: float | None = None) -> float:
        """Seconds of work since the last checkpoint (or since the start): what a kill loses."""
        now = time.time() if now is None else now
        if self.state == QUEUED:
            return 0.0
        base = max(self.started or self.created, self.last_checkpoint() or 0.0)
        return max(0.0, now - base)

    def queue_view(self) -> dict[str, Any] | None:
        """Where a queued job stands (position, MiB it needs, free, the cap), None otherwise."""
        if self.state != QUEUED or self.wait is None:
            return None
        return {"position": self.wait.position, "needs_mb": self.wait.need_mb, "free_mb": self.wait.free_mb,
                "cap_mb": self.wait.cap_mb, "never": self.wait.never}

    def as_dict(self, reveal: bool = True) -> dict[str, Any]:
        """The job's record for the API. With ``reveal`` False (a caller who is neither its
        owner nor root) every env value reads `REDACTED` and ``env_redacted`` is true."""
        spec = self.spec.as_dict()
        if not reveal:
            spec["env"] = dict.fromkeys(spec["env"], REDACTED)
        out: dict[str, Any] = {
            "id": self.id, "num": self.num, "name": self.spec.name, "state": self.state, "pid": self.pid,
            "class": self.spec.job_class, "priority": self.spec.priority, "cgroup_id": self.cgroup_id,
            "cgroup": str(self.cgroup.unified), "memory_dir": str(self.cgroup.memory_dir),
            "owner_uid": self.owner_uid, "gpus": self.gpus, "created": self.created, "ended": self.ended,
            "exit_code": self.exit_code, "reason": self.reason, "work_lost_s": self.work_lost_s,
            "end_cause": None if self.end_cause is None else str(self.end_cause),
            "ckpt_dir": str(self.ckpt_dir) if self.ckpt_dir else None,
            "log": str(self.log_path) if self.log_path else None, "reattached": self.reattached,
            "started": self.started, "spec": spec, "env_redacted": not reveal, "limits": self.limits,
            "origin": self.origin.as_dict(),
            # adopted from a scheduler (laminar.runtime.adopt): which, its id there; the last checkpoint
            "scheduler": None if self.origin.scheduler is None else str(self.origin.scheduler),
            "scheduler_ref": self.origin.scheduler_ref,
        }
        verified = self.verified_checkpoint()
        last = None if verified is None else verified[1]
        out["last_ckpt"] = last
        out["last_ckpt_age_s"] = None if last is None else round(max(0.0, time.time() - last), 3)
        queue = self.queue_view()
        if queue is not None:
            out["queue"] = queue
        if self.active:
            try:
                out["pids"] = self.cgroup.pids()
                out["memory_bytes"] = self.cgroup.memory_usage()
                out["frozen"] = self.cgroup.frozen()
                out["pids_limit"] = self.cgroup.pids_limit()
            except CgroupError:
                pass
        return out


def upgrade_columns(store: Any) -> set[str]:
    """Add the LATER_COLUMNS an older agent's ``jobs`` table lacks, each in its own transaction
    (``end_cause`` with the causes of the ended records already there: :func:`backfill_end_causes`),
    and moves Airlock's kills recorded ``reclaimed`` by an older agent to ``killed``. No record is
    lost or changed otherwise. Returns the columns the table had before."""
    have = {r[1] for r in store.db.execute("PRAGMA table_info(jobs)").fetchall()}
    for col, typ in LATER_COLUMNS.items():
        if col not in have:
            with store.tx() as db:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {col} {typ}")
                if col == "end_cause":
                    backfill_end_causes(db)
    with store.tx() as db:  # Airlock's kills, recorded ``reclaimed`` before the state ``killed`` was theirs
        db.execute("UPDATE jobs SET state='killed' WHERE state='reclaimed' AND end_cause=?", (str(EndCause.AIRLOCK_KILL),))
    return have


def backfill_end_causes(db: Any) -> int:
    """Give every stored job that ended (or was being stopped) without a recorded cause the one
    :func:`laminar.policy.endcause.derive` reads from its state, reason and exit code
    (``unknown`` where they do not say); inside the caller's transaction, the one that adds the
    ``end_cause`` column, so an upgrade cut short leaves no ended job without a cause. Returns
    how many it set."""
    rows = db.execute("SELECT id, state, reason, exit_code, owner_uid FROM jobs WHERE end_cause IS NULL AND "
                      "state NOT IN ('queued', 'running', 'suspended', 'starting')").fetchall()
    out = []
    for r in rows:
        cause = endcause.derive(str(r[1]), r[2], r[3], int(r[4]))
        if cause is not None:
            out.append((str(cause), r[0]))
    db.executemany("UPDATE jobs SET end_cause=? WHERE id=?", out)
    return len(out)
