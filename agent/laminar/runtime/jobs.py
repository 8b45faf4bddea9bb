"""Jobs: commands the agent runs in cgroups of its own, that outlive the agent.

A job is submitted with a `JobSpec` (``laminarctl submit --memory 2G --class transient -- cmd``
or ``POST /v1/jobs``). The `JobManager`:

1. validates the spec (clear errors naming the value) and picks GPUs (NVML, else the config's
   declared GPUs; `laminar.runtime.gpus`);
2. creates the job's cgroups under the per-class parent (`laminar.airlock.cgroups`): a cgroup2
   directory (freeze, kill, pressure, the id netguard sees) and the memory limit wherever the
   memory controller lives (v1 ``memory.limit_in_bytes`` on a hybrid host, v2
   ``memory.max``/``memory.high``). A job over its *own* limit meets the kernel OOM killer
   inside its own cgroup; the node budget above it is where Airlock holds the allocator;
3. spawns the command in its own session through a tiny ``/bin/sh`` step that writes its own
   pid into every ``cgroup.procs`` and its ``oom_score_adj`` *before* it execs the command, so
   no instruction of the job runs outside its cgroups; a job submitted by a non-root caller
   runs as that caller (``setpriv``), never as root, and enters its working directory as that
   caller (submit refuses one the caller may not enter); it starts with its owner's limits, not
   the agent's: all sixteen rlimits, nice value and umask of the owner's profile and a
   ``pids.max`` on its cgroup (`laminar.runtime.joblimits`; shown in its record, ``limits``);
4. gives it the checkpoint contract: ``LAMINAR_JOB_ID``, ``LAMINAR_CKPT_DIR`` (state
   dir/ckpt/<job>), ``LAMINAR_CKPT_SIGNAL`` (default SIGUSR1) and, when restarted from a
   checkpoint, ``LAMINAR_RESUME_FROM``; stdout and stderr go to state dir/logs/<job>.log;
5. registers the job with netguard (``register_job(cgroup_id, num, lent)``), stores it in
   SQLite (table ``jobs``), emits ``job`` events, and watches its main process with a pidfd.

When the main process exits, what is left in the cgroup is killed and the cgroups removed, in
a worker thread (a busy cgroup's removal is retried for about a second per directory, which
would hold the event loop). A cgroup that cannot be removed (a process that cannot die yet: in
uninterruptible sleep on hung storage, or frozen by a v1 freezer someone else set) is not
forgotten: it is recorded as leaked (table ``jobs_leaked_cgroups``, a ``job`` event, the
metric ``laminar_jobs_leaked_cgroups``), and a sweep every `LEAK_SWEEP_S` seconds, and the next
agent's start, kills what is left in it and removes it until it is gone.

Jobs survive an agent restart: they run in their own session and cgroups, so a new agent
reattaches every stored job whose cgroup still holds processes (`laminar.runtime.reattach`),
watching it by pidfd (its exit code is then unknown: it is no longer the agent's child) or by
``cgroup.events``.

Who may do what (decided from SO_PEERCRED by the control API): any local user may submit a
job (it runs with the caller's uid and gid) and stop their own jobs; stopping someone else's
job needs root or the control group. A user other than root may have at most config
``jobs.max_per_user`` jobs that have not ended (queued, running, suspended or being stopped);
one more submission is refused (`QuotaError`, 429) and creates nothing. The records of ended
jobs are kept for ``jobs.keep_ended_s`` and at most ``jobs.keep_ended`` of them
(`laminar.runtime.prune`); a job that has not ended, or that another component's table still
names, is never pruned, and no job number is given twice. Every local user may list and show every job, but the
values of a job's environment (``spec.env``, where tokens live) are shown only to the job's
owner and root: anyone else sees the names with each value replaced by `laminar.runtime.record.REDACTED` (and
``"env_redacted": true``). The command line is shown to all, as ``ps`` shows it. A job's files
are its owner's alone: its log (mode 0600, owned by the owner), its checkpoint directory
(0700, owner) and the store holding its spec (``laminar.db``, 0600, root).

What a user's requests cost the agent is bounded: a spec holds at most ``SPEC_BYTES_MAX`` (64
KiB: command, env, cwd and resume_from together, with caps per item; `laminar.runtime.spec.check_spec_size`,
from `JobSpec.validate`, so every path that builds a spec gets it); its numbers are read in linear
time within their ranges (`laminar.runtime.spec.parse_memory_mb`, laminar.inputs); GET /v1/jobs answers pages
(`LIST_PAGE_DEFAULT`); a user keeps at most ``jobs.keep_ended_per_user`` ended records, pruned
first with their files; a user's path probes not yet reaped are bounded (`laminar.runtime.launch.PROBES_PER_UID`); and
the queue's wait reasons are stored in one transaction per admission pass.

The component's parts, each in its own module: `laminar.runtime.spec` (the spec, its checks,
the errors a request is refused with), `laminar.runtime.record` (the states, `Job`, the jobs
table), `laminar.runtime.grants` (who may submit what), `laminar.runtime.checks` (a local
user's submission checked: grant, resume_from, quota; ``jobs.checks``), `laminar.runtime.launch` (the path
probe and the start of a job's process), `laminar.runtime.prune` (ended jobs' records and
files), `laminar.runtime.leaks` (cgroups not removed yet), `laminar.runtime.jobtable` (the jobs
table: rows written and read back, a page of the list, the look-ups by origin; ``jobs.table``),
`laminar.runtime.exits` (the watch on a job's main process and its end: exit code, state, reason
and end cause recorded, cgroups torn down, waiters woken; ``jobs.exits``),
`laminar.runtime.reattach` (what a restarted agent does with the jobs it finds; ``jobs.reattach``),
`laminar.runtime.signals` (the checkpoint signal, sent only to a process that catches it, through
a pidfd; ``jobs.signals``), `laminar.runtime.adopt` (a scheduler's job taken as a job;
``jobs.adoption``) and `laminar.runtime.jobs_api` (the API's routes). The `JobManager` here holds
the jobs and acts: the start of the component, the queries, admission (the queue and its caps),
submit and the start of a job's process, state changes, a multi-node member's freeze and thaw,
and stop.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..airlock.cgroups import CgroupError, CgroupTree, Hierarchy, detect
from ..config import Field, register_section
from ..policy import admission
from ..policy.endcause import EndCause
from ..userbounds import UidSlots
from . import gpus as gpumod
from . import joblimits, provenance
from .adopt import Adoption, AdoptRequest
from .checks import MAX_PER_USER, SubmitChecks
from .ckpt_scan import CkptScanner
from .exits import Exits
from .grants import Grants
from .holds import Hold, Holds
from .jobtable import JobTable
from .launch import PROBES_ALL_USERS, PROBES_PER_UID, check_owner_ids, check_paths, spawn, workers_file
from .leaks import LeakedCgroups
from .provenance import NO_ORIGIN, JobOrigin
from .prune import KEEP_ENDED, KEEP_ENDED_PER_USER, KEEP_ENDED_S, NUM_FLOOR_KEY, NUM_RESERVED_KEY, Pruner
from .reattach import Reattach
from .record import LIVE_STATES, QUEUED, SCHEMA, STATES, Job, upgrade_columns
from .signals import Signals
from .spec import (
    AdmissionError,
    JobError,
    JobSpec,
    ReservedEnvError,
    ResumeFromError,
    _brief,
    is_multinode_id,
)

if TYPE_CHECKING:
    from ..components import JobsAgent, MemberInfo, MembersForJobs

log = logging.getLogger("laminar.jobs")

STOP_GRACE_S = 5.0  # SIGTERM -> cgroup.kill
# How often leaked cgroups (a teardown's removal failed) are killed and removed again. A process
# that could not die (hung storage, a frozen v1 freezer) usually can within minutes; 30 s keeps
# the retry cheap (one query, one rmdir per leaked directory).
LEAK_SWEEP_S = 30.0
# How often every active job's checkpoint directory is looked at (laminar.runtime.ckpt_scan:
# off the loop, bounded; one fstat per job when nothing changed). Airlock's work at risk reads
# the last look: its tick never touches a job's files.
CKPT_SCAN_EVERY_S = 0.5
# Config [jobs]: how many jobs one user may have that have not ended (queued, running,
# suspended or being stopped) on this node, and how long and how many ended jobs' records the
# store keeps (docs/operations.md, "How many jobs a user may have, and how long ended jobs are
# kept").
CONFIG_FIELDS = {
    "max_per_user": Field(int, MAX_PER_USER, "how many jobs not yet ended (queued, running, suspended, "
                          "stopping) one local user may have on this node; root is not limited (0: no limit)",
                          lambda v: None if 0 <= v <= 1_000_000 else "out of range 0..1000000"),
    "keep_ended_s": Field((int, float), KEEP_ENDED_S, "seconds the records of ended jobs are kept "
                          "(GET /v1/jobs, `laminarctl jobs`, `job show`); older ones are pruned",
                          lambda v: None if 0 <= v <= 10 * 365 * 86400 else "out of range 0..315360000"),
    "keep_ended": Field(int, KEEP_ENDED, "at most this many ended jobs' records are kept (the oldest ended "
                        "are pruned first)", lambda v: None if 0 <= v <= 10_000_000 else "out of range 0..10000000"),
    "keep_ended_per_user": Field(int, KEEP_ENDED_PER_USER, "at most this many ended jobs' records of one user "
                                 "other than root are kept, pruned first (a user's oldest first): one user's "
                                 "jobs cannot push out everyone else's history (0: no per-user limit)",
                                 lambda v: None if 0 <= v <= 10_000_000 else "out of range 0..10000000"),
}
register_section("jobs", CONFIG_FIELDS)

def _section(cfg: Any, name: str) -> dict[str, Any] | None:
    """The config's section ``name``, None where it has none (a component's section not registered)."""
    try:
        return dict(cfg.section(name))
    except (AttributeError, KeyError):
        return None


class JobManager:
    """The jobs component (``agent.jobs``). See the module docstring.

    Usable without an agent for tests: ``JobManager(store=..., state_dir=..., hierarchy=...)``
    then ``await start(None)``.
    """

    agent_attr = "jobs"
    status_key = "jobs"

    def __init__(self, *, store: Any = None, state_dir: Path | str | None = None, cgroup_root: str | None = None,
                 hierarchy: Hierarchy | None = None, events: Any = None, netguard: Any = None,
                 gpus_declared: list[int] | None = None, stop_grace_s: float = STOP_GRACE_S,
                 grants: Grants | None = None, leak_sweep_s: float = LEAK_SWEEP_S, metrics: Any = None,
                 max_per_user: int | None = None, keep_ended_s: float | None = None,
                 keep_ended: int | None = None,
                 keep_ended_per_user: int | None = None, job_limits: dict[str, Any] | None = None,
                 members: MembersForJobs | None = None) -> None:
        self.agent: JobsAgent | None = None  # what the job manager reads of it: laminar.components
        # which local jobs are members of multi-node jobs (None: the agent's ``members``, read
        # when asked: that component starts after this one)
        self._members = members
        # config [job_limits] (None: the agent's config, else the defaults): what jobs start with
        self.job_limits_cfg = job_limits
        self.limiter: joblimits.Limiter | None = None
        # config [jobs] (None: the agent's config, else the defaults): see CONFIG_FIELDS
        self.max_per_user = max_per_user
        self.keep_ended_s = keep_ended_s
        self.keep_ended = keep_ended
        self.keep_ended_per_user = keep_ended_per_user
        self.pruner = Pruner(self)  # the records and files of ended jobs (laminar.runtime.prune)
        # who may submit which class and priority through the API (config [grants])
        self.grants = grants
        # whether a local user may submit a spec here: grant, resume_from, quota (laminar.runtime.checks)
        self.checks = SubmitChecks(self)
        self.leak_sweep_s = leak_sweep_s
        self.metrics = metrics  # a prometheus CollectorRegistry (the agent's, else one of its own)
        self.leaks = LeakedCgroups(self)  # cgroups of ended jobs not removed yet (laminar.runtime.leaks)
        self.store = store
        self.state_dir = Path(state_dir) if state_dir else None
        self.cgroup_root = cgroup_root
        self.hierarchy = hierarchy
        self.events = events
        self.netguard = netguard
        self.gpus_declared = gpus_declared
        self.stop_grace_s = stop_grace_s
        self.tree: CgroupTree | None = None
        self.inventory: gpumod.GpuInventory | None = None
        self.jobs: dict[str, Job] = {}
        # the jobs table: rows written and read back, the look-ups by page and origin (laminar.runtime.jobtable)
        self.table = JobTable(self)
        # jobs' checkpoint listings (bounded, off the loop): Airlock and the migrate component read them
        self.ckpt_scan = CkptScanner()
        # who holds which job frozen (Airlock, a move, a fence): frozen while any hold remains
        self.holds = Holds(self, store)
        # the watch on each job's main process, and what is done at its end (laminar.runtime.exits)
        self.exits = Exits(self)
        # the jobs found running at the start (laminar.runtime.reattach)
        self.reattach = Reattach(self)
        # the checkpoint signal and the others sent to jobs' processes (laminar.runtime.signals)
        self.signals = Signals(self)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        # Admission by class capacity: the caps come from Airlock (`set_admission`). Inside an
        # agent, queued jobs wait until Airlock has said which caps hold; a JobManager used on
        # its own (tests) has no caps unless given some.
        self._limits_fn: Callable[[], admission.Limits] | None = None
        # Why the queue is held (no queued job starts here), or None: a reclaim of this node
        # holds it for good (the node is leaving; its queued jobs are placed elsewhere).
        self.held: str | None = None
        # what laminar.runtime.provenance refused or dropped, by path and reason (status "provenance"):
        # "refused.<path>.reserved_env", "refused.submit.resume_from", "env_dropped.<name>"
        self.provenance_counts: dict[str, int] = {}
        # path probes in flight per owner (check_paths; counted until reaped)
        # adopted jobs: a scheduler's tasks and pods taken as jobs (laminar.runtime.adopt)
        self.adoption = Adoption(self)
        self.probes = UidSlots("path probes (a submission's cwd and PATH, checked as its owner) not yet reaped",
                               PROBES_PER_UID, PROBES_ALL_USERS, "uid_path_probes")

    def count_refusal(self, path: str, error: BaseException) -> None:
        """Counts a refused spec by ``path`` (submit, placement, handover, takeover) and reason."""
        reason = ("reserved_env" if isinstance(error, ReservedEnvError) else
                  "resume_from" if isinstance(error, ResumeFromError) else None)
        if reason is not None:
            k = f"refused.{path}.{reason}"
            self.provenance_counts[k] = self.provenance_counts.get(k, 0) + 1

    # -- component life ----------------------------------------------------------------------
    async def start(self, agent: JobsAgent | None) -> None:
        """Detect cgroups, create the per-class parents, open the table, reattach jobs."""
        self.agent = agent
        self.loop = asyncio.get_running_loop()
        if agent is not None:
            cfg = agent.config
            self.store = self.store or agent.store
            self.state_dir = self.state_dir or Path(cfg.state_dir)
            if self.cgroup_root is None:
                try:
                    self.cgroup_root = cfg.cgroups.root
                except AttributeError:
                    self.cgroup_root = "laminar"
            if self.gpus_declared is None:
                self.gpus_declared = getattr(cfg, "gpus_declared", None)
            self.events = self.events or agent.events
            self.netguard = self.netguard or agent.netguard
            self.metrics = self.metrics or agent.metrics
            if self.grants is None:
                try:
                    section = cfg.section("grants")
                except (AttributeError, KeyError):
                    section = None
                self.grants = Grants.from_config(section)
            try:
                jobs_cfg = cfg.section("jobs")
            except (AttributeError, KeyError):
                jobs_cfg = {}
            if self.max_per_user is None:
                self.max_per_user = jobs_cfg.get("max_per_user")
            if self.keep_ended_s is None:
                self.keep_ended_s = jobs_cfg.get("keep_ended_s")
            if self.keep_ended is None:
                self.keep_ended = jobs_cfg.get("keep_ended")
            if self.job_limits_cfg is None:
                try:
                    self.job_limits_cfg = cfg.section("job_limits")
                except (AttributeError, KeyError):
                    pass
            if self.keep_ended_per_user is None:
                self.keep_ended_per_user = jobs_cfg.get("keep_ended_per_user")
            try:
                self.adoption.configure(cfg.section("adopt"), cfg.section("gpus"), _section(cfg, "slurm"))
            except (AttributeError, KeyError):
                pass
        self.max_per_user = MAX_PER_USER if self.max_per_user is None else self.max_per_user
        self.keep_ended_s = KEEP_ENDED_S if self.keep_ended_s is None else self.keep_ended_s
        self.keep_ended = KEEP_ENDED if self.keep_ended is None else self.keep_ended
        self.keep_ended_per_user = KEEP_ENDED_PER_USER if self.keep_ended_per_user is None else self.keep_ended_per_user
        if self.store is None or self.state_dir is None:
            raise RuntimeError("JobManager needs a store and a state dir (an agent, or store=/state_dir=)")
        self.cgroup_root = self.cgroup_root or "laminar"
        self.grants = self.grants or Grants.from_config(None)
        self.hierarchy = self.hierarchy or detect()
        self.tree = CgroupTree(self.hierarchy, self.cgroup_root)
        self.tree.ensure()
        self.limiter = joblimits.configure(self.job_limits_cfg)
        # all jobs together never take the tasks the agent, sshd and root need to fork
        if not self.tree.set_root_pids_max(self.limiter.settings.all_jobs_pids_max):
            self._emit("job", "jobs: this host has no pids controller: a job's tasks are bounded only by its "
                       "owner's RLIMIT_NPROC (never for root's jobs)", pids_controller=None)
        self.inventory = gpumod.discover(self.gpus_declared)
        for sub in ("logs", "ckpt"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            # a job (run as its owner) reaches its own log and checkpoints by their known paths;
            # nobody lists the others'
            os.chmod(self.state_dir / sub, 0o711)
        self._check_reachable()
        self.store.ensure_schema("jobs", SCHEMA)
        self._protect_files()
        have = upgrade_columns(self.store)
        with self.store.tx() as db:
            for index in provenance.INDEXES:
                db.execute(index)
        if any(c not in have for c in provenance.FIRST_COLUMNS):
            self.table.clean_stored_env()
        self.leaks.init_metrics()  # (makes the registry when none was given)
        self.adoption.init_metrics()
        self._emit("job", f"jobs: {self.hierarchy.describe()}; GPUs: {self.inventory.source} "
                   f"{self.inventory.indices} {self.inventory.note}".rstrip(),
                   cgroups=self.hierarchy.mode, gpus=self.inventory.as_dict())
        # a reclaim of this node whose window is still open (an agent restart): held before any admission
        from laminar.migrate.drain import held_at_start

        self.held = self.held or held_at_start(self.store)
        self.reattach.all()
        self.holds.store = self.store
        self.holds.load()  # after the jobs: the holds of jobs that ended meanwhile go
        self._spawn_task(self.leaks.sweep_loop())  # now, then every leak_sweep_s: leaks of the previous agent; pruning
        self._spawn_task(self.ckpt_scan.follow(self.active, CKPT_SCAN_EVERY_S))

    def _check_reachable(self) -> None:
        """Warns (a ``job`` event) when other users may not pass through the state directory or
        a directory above it: the job of a user other than root could then not reach its
        checkpoint directory (``LAMINAR_CKPT_DIR``). A directory that exists keeps the mode its
        operator gave it; the agent makes a missing one 0711 (laminar.store)."""
        assert self.state_dir is not None
        closed = []
        for d in [self.state_dir.resolve(), *self.state_dir.resolve().parents]:
            try:
                if not d.stat().st_mode & 0o001:
                    closed.append(str(d))
            except OSError:
                pass
        if closed:
            self._emit("job", f"jobs: other users may not pass through {', '.join(closed)} (no search permission for "
                       "others): a job of a user other than root cannot reach its checkpoint directory under "
                       f"{self.state_dir}/ckpt; make them 0711 (chmod o+x), as systemd's StateDirectoryMode=0711 "
                       "does", closed=closed)

    def _protect_files(self) -> None:
        """The store holds every job's spec, env included: root's alone (0600). SQLite gives
        its -wal and -shm files the database's mode when it creates them; existing ones are
        set here too. Logs and checkpoint directories left by an older agent (0640, 0755) are
        made their owners' alone (0600, 0700). Best effort: a failure is logged."""
        assert self.state_dir is not None
        path = getattr(self.store, "path", None)
        private: list[tuple[Path, int]] = []
        if path is not None:
            private += [(Path(f"{path}{sfx}"), 0o600) for sfx in ("", "-wal", "-shm")]
        for sub, mode in (("logs", 0o600), ("ckpt", 0o700)):
            try:
                private += [(p, mode) for p in (self.state_dir / sub).iterdir()
                            if (p.is_dir() if sub == "ckpt" else p.is_file())]
            except OSError:
                pass
        for f, mode in private:
            try:
                if f.exists() and not f.is_symlink() and f.stat().st_mode & 0o077:
                    os.chmod(f, mode)
            except OSError as e:
                log.warning("cannot make %s private to its owner: %s", f, e)

    async def shutdown(self) -> None:
        """Stop watching. Jobs keep running in their cgroups; the next start reattaches them."""
        for task in list(self._tasks):
            task.cancel()
        self.exits.unwatch_all()

    def status(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for j in self.jobs.values():
            counts[j.state] = counts.get(j.state, 0) + 1
        return {"cgroups": self.hierarchy.as_dict() if self.hierarchy else None,
                "root": self.cgroup_root, "gpus": self.inventory.as_dict() if self.inventory else None,
                "jobs": counts, "grants": self.grants.as_dict() if self.grants else None,
                "job_limits": self._limits_status(),
                "ckpt_scan": self.ckpt_scan.stats(),
                "provenance": dict(self.provenance_counts), "adopt": self.adoption.status(),
                "leaked_cgroups": self.leaks.rows() if self.store is not None else []}

    def _limits_status(self) -> dict[str, Any] | None:
        """What jobs start with (joblimits), where their task limits live, and how many forks
        all jobs together had refused at the agent's root pids.max."""
        if self.limiter is None or self.tree is None:
            return None
        out = self.limiter.status()
        out["pids_controller"] = str(self.hierarchy.pids_mount) if self.hierarchy and self.hierarchy.pids_mount else None
        out["all_jobs_pids"] = self.tree.root_pids()
        return out

    # -- queries -------------------------------------------------------------------------------
    def get(self, job_id: str) -> Job | None:
        """A job by id ("job-3") or number ("3"), from memory or the store; None when there is
        none (a number no job can have, such as one past SQLite's 64 bits, included)."""
        if job_id in self.jobs:
            return self.jobs[job_id]
        # ASCII digits only ('²'.isdigit() too), and no more than a 64-bit number has
        num = int(job_id) if job_id.isascii() and job_id.isdigit() and len(job_id) <= 18 else -1
        if num >= 0:
            for j in self.jobs.values():
                if j.num == num:
                    return j
        row = self.store.db.execute("SELECT * FROM jobs WHERE id=? OR num=?", (job_id, num)).fetchone()
        return self.table.from_row(row) if row else None

    def list(self, all_jobs: bool = True, ended_max: int | None = None) -> list[Job]:
        """Active jobs in memory plus finished ones from the store (all of them, or the newest
        `ended_max`), oldest first."""
        out = {j.id: j for j in self.jobs.values()}
        if all_jobs:
            if ended_max is None:
                rows = self.store.db.execute("SELECT * FROM jobs ORDER BY num")
            else:  # the newest rows; those of jobs in memory are among them, counted apart
                rows = self.store.db.execute("SELECT * FROM jobs ORDER BY num DESC LIMIT ?",
                                             (ended_max + len(self.jobs),))
            ended = 0
            for row in rows:
                if row["id"] not in out and (ended_max is None or ended < ended_max):
                    out[row["id"]] = self.table.from_row(row)
                    ended += 1
        return sorted(out.values(), key=lambda j: j.num)

    # -- where jobs came from (laminar.runtime.provenance): indexed columns, no spec decoded ------

    def active(self) -> builtins.list[Job]:
        """Running and suspended jobs (those with processes); queued ones are not active."""
        return [j for j in self.jobs.values() if j.active]

    def stopping(self) -> builtins.list[Job]:
        """Jobs being stopped: their stop has begun (state stopped, reclaimed, requeued, ...)
        and their end is not recorded yet (SIGTERM sent, the grace running). Not active, not
        ended: they still hold their cgroup and memory (Airlock cuts the grace under pressure)."""
        return [j for j in self.jobs.values() if j.state not in LIVE_STATES and j.ended is None]

    def queued(self) -> builtins.list[Job]:
        """Queued jobs, in the order they would start within their class."""
        return sorted((j for j in self.jobs.values() if j.state == QUEUED), key=lambda j: (-j.spec.priority, j.num))

    # -- admission -------------------------------------------------------------------------------
    def set_admission(self, limits_fn: Callable[[], admission.Limits] | None, *, admit: bool = True) -> None:
        """Airlock's hook: `limits_fn` returns the class caps and per-job defaults in force.
        Then starts the queued jobs that fit (`admit`)."""
        self._limits_fn = limits_fn
        if admit:
            self.admit()

    def hold_queue(self, reason: str | None) -> None:
        """Hold the queue: while ``reason`` is set no queued job starts here (each one's wait
        reason says why); None releases it and starts what fits. A reclaim of this node holds it:
        the capacity its moved jobs free must not start queued jobs on a node about to go."""
        self.held = reason
        if reason is None:
            self.admit()
            return
        changed = [j for j in self.queued() if j.reason != reason]
        for j in changed:
            j.reason = reason
        self.table.persist_many(changed)

    def limits(self) -> admission.Limits | None:
        """The caps in force; None while an agent's Airlock has not said (queue held)."""
        if self._limits_fn is not None:
            return self._limits_fn()
        return None if self.agent is not None else admission.NO_LIMITS

    def charged_mb(self, limits: admission.Limits) -> dict[str, int]:
        """Per class: the sum of its member jobs' charges (every started job whose cgroup is
        not gone yet, also while it is being stopped or reclaimed; an adopted job by what its
        scheduler gave it or it uses: Adoption.charge_mb)."""
        out: dict[str, int] = {}
        for j in self.jobs.values():
            if j.state != QUEUED:
                c = j.spec.job_class
                mb = j.spec.memory_mb
                if mb is None and j.origin.scheduler is not None and limits.cap(c) is not None:
                    mb = self.adoption.charge_mb(j)
                out[c] = out.get(c, 0) + admission.charge_mb(mb, limits.cap(c))
        return out

    def admit(self, submitted: str | None = None) -> None:
        """Start the queued jobs that fit now (`airlock.admission.plan`), record why the others
        wait. Synchronous (no await between deciding and starting), so two passes never race.
        A job that fails to start is recorded as failed; for `submitted` (the job the caller
        is submitting) the error is raised instead, as from `submit`."""
        if self.tree is None:
            return
        if self.held is not None:
            self.hold_queue(self.held)  # records the reason on every queued job
            return
        limits = self.limits()
        if limits is None:
            return
        error: BaseException | None = None
        waits: dict[str, admission.Wait] = {}
        while True:
            queue = [admission.Queued(j.id, j.num, j.spec.job_class, j.spec.priority, j.spec.memory_mb)
                     for j in self.jobs.values() if j.state == QUEUED]
            if not queue:
                waits = {}
                break
            start, waits = admission.plan(queue, self.charged_mb(limits), limits)
            failed = False
            for jid in start:
                job = self.jobs[jid]
                try:
                    self._start(job)
                except BaseException as e:
                    failed = True
                    if jid == submitted:
                        error = e
                    else:
                        log.warning("job %s: start from the queue failed: %s", jid, e)
            if not failed:
                break
            # a job that failed to start is gone and its room with it: plan again, so the jobs
            # behind it start now (each pass removes a job from the queue, so this ends)
        changed = []
        for jid, w in waits.items():
            job = self.jobs[jid]
            reason = w.reason(job.spec.job_class)
            job.wait = w
            if reason != job.reason:
                job.reason = reason
                changed.append(job)
        # one transaction (one fsync) for every reason that changed: a wait's reason names its
        # queue position and the class's free MiB, which every submit, start and exit moves for
        # every queued job behind it (255 fsyncs per submission of a user with 256 queued jobs)
        self.table.persist_many(changed)
        if error is not None:
            raise error

    # -- submit --------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0, *, quota: bool = False,
                     origin: JobOrigin = NO_ORIGIN, job_id: str | None = None, relaunch: bool = False,
                     agent_env: dict[str, str] | None = None) -> Job:
        """Submit `spec` as a job owned by (owner_uid, owner_gid) and start it if its class has
        room (`airlock.admission`); else it is returned in state ``queued`` (no pid, no cgroup
        yet, cgroup_id 0; its reason says what it waits for) and starts by itself once room
        frees. Raises AdmissionError when its memory limit exceeds its class's cap (it could
        never start), JobError for a bad request (cwd missing, GPUs unavailable, command not
        found) and CgroupError when the cgroups of a job starting now cannot be made; nothing
        is left behind on failure. A job given no memory limit gets its class's default
        (policy ``job_default_mb``) where one is set. With `quota` (a local user's submission)
        it raises QuotaError when the owner has ``jobs.max_per_user`` jobs not yet ended
        (`checks.quota`), checked again with no await before the job is stored, so concurrent
        submissions cannot pass it together. `origin`: where the job came from, from the agent's
        own code only (a hand-over, a take-over; laminar.runtime.provenance), stored with it.
        `job_id`: from the agent's own code only (the members component: a member's local job
        has its multi-node job's id, ``job-7-n3``); JobError unless it is a multi-node id
        (`spec.MULTINODE_ID_RE`) that no job here has (a row of any state, an ended one too),
        but with `relaunch` (the member's next generation, laminar.members): then an ended job
        of that id is replaced (its row gives way), a live one still refused. The job still
        takes this node's next number (`num`), as every job does. `agent_env`: agent code only
        (a member's rendezvous and ``LAMINAR_*`` names, laminar.members.launch): set in the
        job's environment over its spec's and the agent's own contract, never checked against
        the reserved names (the agent writes them) and kept in memory only."""
        assert self.tree is not None and self.state_dir is not None and self.inventory is not None
        check_owner_ids(owner_uid, owner_gid)
        if job_id is not None:
            self._check_given_id(job_id, relaunch)
        if quota:
            self.checks.quota(owner_uid)
        spec.validate()
        refused = self.adoption.gpus_refusal(spec.gpus)
        if refused is not None:
            raise JobError(refused, reason="gpus_scheduler_owned")
        try:
            origin.checked()
        except ValueError as e:
            raise JobError(str(e)) from None
        exe = spec.command[0]
        await check_paths(spec.cwd, None if "/" in exe else exe,
                          spec.env.get("PATH", os.environ.get("PATH") or os.defpath), owner_uid, owner_gid,
                          self.probes)
        limits = self.limits()
        if limits is not None:
            cap = limits.cap(spec.job_class)
            default = limits.job_default_mb.get(spec.job_class)
            if spec.memory_mb is None and default:
                spec.memory_mb = default
            if admission.never_fits(spec.memory_mb, cap):
                raise AdmissionError(f"memory {spec.memory_mb} MiB: more than the {spec.job_class} class's cap of "
                                     f"{cap} MiB, so the job could never start on this node; ask for at most {cap}M "
                                     f"(--memory), or raise the cap (policy class_caps_mb, [airlock] class_budget_mb)")
        # GPUs held by running jobs, and those the queued jobs will take when they start (in
        # their start order): a job is refused now rather than failing when its turn comes
        used = [g for j in self.active() for g in j.gpus]
        for q in self.queued():
            if q.spec.gpus:
                try:
                    used += gpumod.allocate(self.inventory, used, q.spec.gpus)
                except ValueError:
                    pass  # it cannot start as things stand either; it fails at its turn
        try:
            gpumod.allocate(self.inventory, used, spec.gpus)
        except ValueError as e:
            queued = [q.id for q in self.queued() if q.spec.gpus]
            raise JobError(str(e) + (f" (counting the GPUs of queued job(s) {', '.join(queued)})" if queued else "")) from None

        if quota:  # again: other submissions of the owner may have been stored while check_paths ran
            self.checks.quota(owner_uid)
        spec_text = json.dumps(spec.as_dict())
        with self.store.tx() as db:
            num = self.next_num(db)  # past every number given (pruned and reserved ones too)
            if job_id is None:
                job_id = f"job-{num}"
            elif job_id in self.jobs or (not relaunch and db.execute("SELECT 1 FROM jobs WHERE id=?",
                                                                       (job_id,)).fetchone() is not None):
                raise JobError(f"job id {job_id!r}: a job here has it already (ids are never given twice)",
                               reason="job_id_taken")
            elif relaunch:  # a member's earlier generation, ended: its record gives way to this one
                db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
            created = time.time()
            db.execute(f"INSERT INTO jobs(id, num, spec, state, owner_uid, owner_gid, gpus, created, "
                       f"{', '.join(provenance.COLUMNS)}) VALUES(?, ?, ?, 'queued', ?, ?, '[]', ?"
                       f"{', ?' * len(provenance.COLUMNS)})",
                       (job_id, num, spec_text, owner_uid, owner_gid, created, *origin.row()))
        job = Job(id=job_id, num=num, spec=spec, cgroup=self.tree.job(spec.job_class, job_id), cgroup_id=0,
                  state=QUEUED, owner_uid=owner_uid, owner_gid=owner_gid, created=created, origin=origin,
                  spec_bytes=len(spec_text), agent_env=dict(agent_env or {}),
                  ckpt_dir=self.state_dir / "ckpt" / job_id, log_path=self.state_dir / "logs" / f"{job_id}.log")
        self.jobs[job_id] = job
        self.admit(submitted=job_id)  # raises what _start raised for this job (then failed, gone from memory)
        if job.state == QUEUED:
            if job.wait is None and self.held is None:  # the queue is held until Airlock says which caps hold
                job.reason = "waiting for the agent's admission (Airlock) to start"
                self.table.persist(job)
            self._emit("job", f"job {job_id} queued: {job.reason}", job=job_id, num=num, state=QUEUED, by_uid=owner_uid,
                       **{"class": spec.job_class}, priority=spec.priority, memory_mb=spec.memory_mb,
                       queue=job.queue_view())
        return job

    def next_num(self, db: Any) -> int:
        """The next job number (in a transaction of the store): past every number given, the
        highest row, the highest ever pruned and the highest reserved for a multi-node id."""
        floor = int(self.store.get_meta(NUM_FLOOR_KEY, 0) or 0)
        reserved = int(self.store.get_meta(NUM_RESERVED_KEY, 0) or 0)
        return max(int(db.execute("SELECT COALESCE(MAX(num), 0) FROM jobs").fetchone()[0]), floor, reserved) + 1

    def reserve_multinode_id(self, node: int) -> str:
        """A new multi-node job's id on its origin, ``job-<num>-n<node>`` (docs/jobs.md): ``num``
        is taken from this node's job numbers (kept in the store as ``jobs.num_reserved``), so it
        never collides with a ``job-N`` of this node, nor with another reserved id, also after a
        restart. ``node``: this node's zone node id. No job row is made (the members component
        keeps the job's record)."""
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < 10 ** 10:
            raise JobError(f"node {node!r}: expected this node's zone node id, 0 to {10 ** 10 - 1}")
        with self.store.tx() as db:
            num = self.next_num(db)
            db.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (NUM_RESERVED_KEY, json.dumps(num)))
        return f"job-{num}-n{node}"

    def _check_given_id(self, job_id: str, relaunch: bool = False) -> None:
        """JobError unless `job_id` is a multi-node id no job here has (`submit`'s `job_id`);
        with `relaunch`, no job here has that has not ended."""
        if not is_multinode_id(job_id):
            raise JobError(f"job id {_brief(job_id)}: expected a multi-node job's id, job-<num>-n<node> "
                           "(e.g. job-7-n3)", reason="job_id_invalid")
        if job_id in self.jobs or (not relaunch and self.store.db.execute(
                "SELECT 1 FROM jobs WHERE id=?", (job_id,)).fetchone()):
            raise JobError(f"job id {job_id!r}: a job here has it already (ids are never given twice)",
                           reason="job_id_taken")

    def _start(self, job: Job) -> None:
        """Start a queued job now: GPUs, cgroups, the process, netguard, the watch. On failure
        the job is recorded as failed and dropped from memory, and the error raised (OSError
        from the spawn as JobError)."""
        assert self.tree is not None
        spec = job.spec
        cg = job.cgroup
        try:
            used = [g for j in self.active() for g in j.gpus]
            try:
                job.gpus = gpumod.allocate(self.inventory, used, spec.gpus) if self.inventory is not None else []
            except ValueError as e:
                raise JobError(str(e)) from None
            # 'starting' in the store: an agent that dies from here until 'running' is recorded
            # finds the job failed on restart, with whatever it had made removed.
            job.state = "starting"
            self.table.persist(job)
            assert self.limiter is not None
            try:  # the owner's profile on this node, wherever the job came from
                profile = self.limiter.profile(job.owner_uid, job.owner_gid)
            except joblimits.LimitsError as e:
                raise JobError(str(e)) from None
            cg.create()
            job.limits = profile.record()
            if not cg.set_pids_max(profile.pids_max):
                job.limits["pids_max"] = None
                job.limits["clamped"]["pids_max"] = "no pids controller on this host"
            if spec.memory_mb is not None:
                # A job over its own declared limit meets the kernel OOM killer inside its own
                # cgroup (only it can be chosen); the node budget is where Airlock holds the allocator.
                high = int(spec.memory_mb * 0.9) << 20 if self.hierarchy and self.hierarchy.memory_in_v2 else None
                cg.set_memory_limit(spec.memory_mb << 20, oom_kill_disable=False, high_bytes=high)
            if spec.cpus is not None and not cg.set_cpus(spec.cpus):
                log.warning("job %s: no cpu controller on this host; cpus=%s not enforced", job.id, spec.cpus)
            assert job.ckpt_dir is not None
            job.ckpt_dir.mkdir(parents=True, exist_ok=True)
            # the owner's alone: a checkpoint holds the job's memory (its data, its tokens)
            os.chmod(job.ckpt_dir, 0o700)
            if job.owner_uid:
                os.chown(job.ckpt_dir, job.owner_uid, job.owner_gid)
            job.cgroup_id = cg.cgroup_id
            proc = spawn(job, profile, self.inventory,
                         workers_file(self.state_dir, job.id) if self.state_dir is not None else None)
        except BaseException as e:
            try:
                cg.kill()
            except CgroupError:
                pass
            try:
                cg.remove()
            except CgroupError as ce:
                self.leaks.record(job, str(ce))
            job.state, job.reason, job.ended, job.wait = "failed", f"start failed: {e}", time.time(), None
            job.end_cause = EndCause.START_FAILED
            self.table.persist(job)
            self.jobs.pop(job.id, None)
            self._emit("job", f"job {job.id} failed: {job.reason}", job=job.id, state=job.state,
                       end_cause=str(job.end_cause), by_uid=job.owner_uid)
            if isinstance(e, OSError):
                raise JobError(f"command {spec.command[0]!r}: {e.strerror or e}") from None
            raise
        waited = time.time() - job.created
        job.pid = proc.pid
        job.state = "running"
        job.started = time.time()
        job.wait = None
        job.reason = ""
        self.exits.popen[job.id] = proc
        with self.store.tx() as db:
            db.execute("UPDATE jobs SET limits=? WHERE id=?", (json.dumps(job.limits), job.id))
        self.table.persist(job)
        if self.netguard is not None:
            try:
                self.netguard.register_job(job.cgroup_id, job.num, spec.lent)
            except Exception as e:  # the job runs; its traffic is just not identified
                log.warning("job %s: netguard.register_job failed: %s", job.id, e)
        self.exits.watch(job)
        after = f" after {waited:.1f} s queued" if waited >= 0.5 else ""
        self._emit("job", f"job {job.id} started{after}: {' '.join(spec.command)[:200]}", job=job.id, num=job.num,
                   by_uid=job.owner_uid,
                   pid=proc.pid, cgroup_id=job.cgroup_id, **{"class": spec.job_class}, priority=spec.priority,
                   memory_mb=spec.memory_mb, gpus=job.gpus, queued_s=round(waited, 3))

    # -- tasks, and waiting for a job's end (laminar.runtime.exits) ---------------------------
    def _spawn_task(self, coro: Any) -> None:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job | None:
        """Wait until the job has ended (or `timeout`); returns its final record."""
        if job_id in self.jobs:
            ev = self.exits.waiter(job_id)
            await asyncio.wait_for(ev.wait(), timeout)
        return self.get(job_id)

    # -- actions -------------------------------------------------------------------------------
    def set_state(self, job: Job, state: str, reason: str = "", cause: EndCause | None = None) -> None:
        """Record a state change decided elsewhere (Airlock: suspended, running, reclaimed);
        ``cause``: why it ended, for an end state (kept as it was when None)."""
        if state not in STATES:
            raise JobError(f"state {state!r}: expected one of {', '.join(STATES)}")
        job.state = state
        if reason:
            job.reason = reason
        if cause is not None:
            job.end_cause = cause
        self.table.persist(job)

    def member_of(self, job: Job | str) -> MemberInfo | None:
        """The member of a multi-node job that this local job is (``agent.members``), or None: a
        job of this node alone, or no members component."""
        members = self._members if self._members is not None else (
            self.agent.members if self.agent is not None else None)
        if members is None:
            return None
        return members.member_of(job if isinstance(job, str) else job.id)

    def request_checkpoint(self, job: Job) -> bool:
        """Send the job its checkpoint signal where it catches it (:meth:`Signals.request_checkpoint`)."""
        return self.signals.request_checkpoint(job)

    def catches_checkpoint(self, job: Job) -> bool:
        """Whether the job keeps the checkpoint contract now (:meth:`Signals.catches_checkpoint`)."""
        return self.signals.catches_checkpoint(job)

    def signal_catchers(self, job: Job, signame: str) -> builtins.list[int]:
        """``signame`` to every process of the job that catches it (:meth:`Signals.signal_catchers`)."""
        return self.signals.signal_catchers(job, signame)

    def signal_main(self, job: Job, signame: str) -> bool:
        """``signame`` to the job's main process if it catches it (:meth:`Signals.signal_main`)."""
        return self.signals.signal_main(job, signame)

    def freeze_member(self, job_id: str) -> bool:
        """The origin of a multi-node job orders its member here frozen (another member's node
        suspended its own): the job's ``members`` hold (runtime/holds.py), which this node's
        Airlock never releases (its recovery of the job releases its own hold only). The freeze is
        asked, not waited for. False for a job not running here."""
        job = self.get(job_id)
        if job is None or not job.active or job.id not in self.jobs:
            return False
        try:
            self.holds.hold(job, Hold.MEMBERS)
        except CgroupError as e:
            log.warning("job %s: freeze for its multi-node job: %s", job_id, e)
            return False
        if job.state != "suspended":
            self.set_state(job, "suspended", "frozen with its multi-node job (another member is suspended)")
        self._emit("job", f"job {job_id} frozen with its multi-node job", job=job_id, hold=Hold.MEMBERS.value)
        return True

    def thaw_member(self, job_id: str) -> bool:
        """Releases the ``members`` hold :meth:`freeze_member` took; thawed unless another hold
        (Airlock's, a move's, a fence's) keeps it frozen. True when thawed."""
        job = self.get(job_id)
        if job is None or not job.active or job.id not in self.jobs:
            return False
        try:
            thawed = self.holds.release(job, Hold.MEMBERS)
        except CgroupError as e:
            log.warning("job %s: thaw for its multi-node job: %s", job_id, e)
            return False
        if thawed:
            self.set_state(job, "running", "thawed with its multi-node job")
        self._emit("job", f"job {job_id} " + ("thawed with its multi-node job" if thawed else
                   f"released by its multi-node job, still held: {', '.join(self.holds.reasons(job_id))}"),
                   job=job_id, hold=Hold.MEMBERS.value, thawed=thawed)
        return thawed

    async def stop(self, job_id: str | None = None, reason: str = "stopped by request", *,
                   grace_s: float | None = None, state: str = "stopped", work_lost_s: float | None = None,
                   cause: EndCause = EndCause.UNKNOWN) -> Job | None:
        """Stop a job: thaw, SIGTERM, `grace_s`, then cgroup.kill; cgroups removed; returns
        its final record. Raises JobError for an unknown or finished job. ``state`` and
        ``cause`` (why it ended: every caller says) are recorded before the grace, with ``reason``.

        With no `job_id` this is the component's stop (the agent's SIGTERM): it only stops
        watching (`shutdown`), and every job keeps running."""
        if job_id is None:
            await self.shutdown()
            return None
        job = self.get(job_id)
        if job is None:
            raise JobError(f"no job {job_id!r} (see `laminarctl jobs`)")
        if job.state == QUEUED and job.id in self.jobs:
            # Never started: nothing to signal or remove; it leaves the queue.
            job.state, job.reason, job.ended, job.wait = state, reason, time.time(), None
            job.end_cause = cause
            job.work_lost_s = 0.0
            self.table.persist(job)
            self.jobs.pop(job.id, None)
            self._emit("job", f"job {job.id} {state} while queued: {reason}", job=job.id, state=state,
                       end_cause=str(cause), by_uid=job.owner_uid)
            self.exits.wake(job.id)
            self.admit()  # the head of a queue may have left
            self.pruner.prune_ended()
            return job
        if not job.active or job.id not in self.jobs:
            raise JobError(f"job {job.id} is not running (state {job.state})")
        grace = self.stop_grace_s if grace_s is None else grace_s
        job.state = state
        job.reason = reason
        job.end_cause = cause
        job.work_lost_s = work_lost_s if work_lost_s is not None else job.work_at_risk_s()
        self.table.persist(job)
        self._emit("job", f"job {job.id} stopping: {reason}", job=job.id, grace_s=grace, end_cause=str(cause),
                   by_uid=job.owner_uid)
        ev = self.exits.waiter(job.id)
        try:
            if grace > 0 and job.cgroup.freeze_requested():
                # a frozen job takes no SIGTERM until thawed; with no grace it is not thawed (a
                # fenced or superseded copy must not run another step): cgroup.kill kills it frozen
                from ..airlock.cgroups import set_frozen_async

                await set_frozen_async(job.cgroup, False, 0.5)  # waited for without blocking the loop
            if grace > 0:
                job.cgroup.signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(ev.wait(), grace)
                except TimeoutError:
                    pass
            if not ev.is_set():
                job.cgroup.kill()
                await asyncio.wait_for(ev.wait(), 10)
        except CgroupError as e:
            log.warning("job %s: stop: %s", job.id, e)
        except TimeoutError:
            # 10 s after cgroup.kill the main process still lives: it is no longer in the job's
            # cgroup (a root job can move itself out) or sleeps uninterruptibly (hung storage).
            # Kill it by its pidfd (never another process) and tear down without waiting for it.
            fd = self.exits.pidfds.get(job.id)
            if fd is not None:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass
            await self.exits.on_exit(job.id)
        return self.get(job.id) or job

    async def kill(self, job: Job, reason: str, work_lost_s: float | None = None) -> None:
        """Kill now: cgroup.kill with no grace (Airlock's last rung); work lost recorded."""
        await self.stop(job.id, reason, grace_s=0, state="killed", work_lost_s=work_lost_s,
                        cause=EndCause.AIRLOCK_KILL)

    # -- events ----------------------------------------------------------------------------------
    def _emit(self, kind: str, message: str, *, by_uid: int | None = None, **fields: Any) -> None:
        """An event; `by_uid`: the user whose action caused it (charged to their event budget,
        laminar.events), given only where it is a user's (root's are never limited)."""
        if self.events is not None:
            if by_uid:
                self.events.emit(kind, message, by_uid=by_uid, **fields)
            else:
                self.events.emit(kind, message, **fields)
        else:
            log.info("%s: %s", kind, message)

    # -- adopted jobs (laminar.runtime.adopt) ---------------------------------------------------
    async def adopt(self, req: AdoptRequest) -> tuple[Job, dict[str, str]]:
        """Adopt a scheduler's task or pod as a job (:meth:`laminar.runtime.adopt.Adoption.adopt`)."""
        return await self.adoption.adopt(req)

    def find_adopted(self, scheduler: str, ref: str) -> builtins.list[Job]:
        """The live jobs adopted here from ``scheduler``'s job ``ref`` (at most one)."""
        return self.adoption.find(scheduler, ref)

    # -- API -------------------------------------------------------------------------------------
    def routes(self) -> builtins.list[Any]:
        """The jobs API (:mod:`laminar.runtime.jobs_api`)."""
        from .jobs_api import routes

        return routes(self)
