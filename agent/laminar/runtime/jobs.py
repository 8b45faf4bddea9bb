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
re-adopts every stored job whose cgroup still holds processes, watching it by pidfd (its exit
code is then unknown: it is no longer the agent's child) or by ``cgroup.events``.

Who may do what (decided from SO_PEERCRED by the control API): any local user may submit a
job (it runs with the caller's uid and gid) and stop their own jobs; stopping someone else's
job needs root or the control group. A user other than root may have at most config
``jobs.max_per_user`` jobs that have not ended (queued, running, suspended or being stopped);
one more submission is refused (`QuotaError`, 429) and creates nothing. The records of ended
jobs are kept for ``jobs.keep_ended_s`` and at most ``jobs.keep_ended`` of them
(`JobManager.prune_ended`); a job that has not ended, or that another component's table still
names, is never pruned, and no job number is given twice. Every local user may list and show every job, but the
values of a job's environment (``spec.env``, where tokens live) are shown only to the job's
owner and root: anyone else sees the names with each value replaced by `REDACTED` (and
``"env_redacted": true``). The command line is shown to all, as ``ps`` shows it. A job's files
are its owner's alone: its log (mode 0600, owned by the owner), its checkpoint directory
(0700, owner) and the store holding its spec (``laminar.db``, 0600, root).

What a user's requests cost the agent is bounded: a spec holds at most ``SPEC_BYTES_MAX`` (64
KiB: command, env, cwd and resume_from together, with caps per item; `check_spec_size`, from
`JobSpec.validate`, so every path that builds a spec gets it); its numbers are read in linear
time within their ranges (`parse_memory_mb`, laminar.inputs); GET /v1/jobs answers pages
(`LIST_PAGE_DEFAULT`); a user keeps at most ``jobs.keep_ended_per_user`` ended records, pruned
first with their files; a user's path probes not yet reaped are bounded (`PROBES_PER_UID`); and
the queue's wait reasons are stored in one transaction per admission pass.
"""

from __future__ import annotations

import asyncio
import builtins
import grp
import json
import logging
import os
import pwd
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..airlock import admission
from ..airlock.cgroups import LIFECYCLE_CLASSES, CgroupError, CgroupTree, Hierarchy, JobCgroup, detect
from ..config import Field, register_section
from ..inputs import NUMBER_TEXT_MAX, brief, size_mib
from ..policy import endcause
from ..policy.endcause import EndCause
from ..userbounds import Busy, UidSlots
from . import gpus as gpumod
from . import joblimits, provenance
from .ckpt_scan import CkptScanner
from .holds import Holds
from .provenance import NO_ORIGIN, JobOrigin

log = logging.getLogger("laminar.jobs")

PRIORITY_MIN, PRIORITY_MAX, PRIORITY_DEFAULT = 0, 100, 50
MEMORY_MB_MAX = 1 << 30  # 1 PiB in MiB: anything larger is a typo
STOP_GRACE_S = 5.0  # SIGTERM -> cgroup.kill
STOP_GRACE_MAX_S = 3600.0  # a longer grace is a typo (a second stop is refused while one waits)
CPUS_MIN = 0.01  # the kernel's smallest CFS quota: 1 ms per 100 ms period
# A re-adopted job whose main process is gone (but whose cgroup is not empty) is watched by
# polling cgroup.events at this interval; POLLPRI on cgroup.events would do too, this is simpler.
ADOPT_POLL_S = 0.5
# The most ended jobs' records one prune deletes (the rest at the next): a limit lowered by a
# million rows must not hold the event loop in one statement.
PRUNE_BATCH = 5000
# How often leaked cgroups (a teardown's removal failed) are killed and removed again. A process
# that could not die (hung storage, a frozen v1 freezer) usually can within minutes; 30 s keeps
# the retry cheap (one query, one rmdir per leaked directory).
LEAK_SWEEP_S = 30.0
# The longest stop reason a caller may give: it is kept with the job and in two events, and
# the event log keeps 50,000 of them (a 1 MiB reason per stop would fill the disk).
REASON_MAX = 1000
# How often every active job's checkpoint directory is looked at (laminar.runtime.ckpt_scan:
# off the loop, bounded; one fstat per job when nothing changed). Airlock's work at risk reads
# the last look: its tick never touches a job's files.
CKPT_SCAN_EVERY_S = 0.5
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
LIST_SLICE_BYTES = 128 << 10  # a page is encoded this much at a time, a loop round between
# What a job's env values read as to a caller who is neither the job's owner nor root.
REDACTED = "<redacted>"

# Config [jobs]: how many jobs one user may have that have not ended (queued, running,
# suspended or being stopped) on this node, and how long and how many ended jobs' records the
# store keeps (docs/operations.md, "How many jobs a user may have, and how long ended jobs are
# kept").
MAX_PER_USER = 256
KEEP_ENDED_S = 7 * 86400.0
KEEP_ENDED = 10_000
KEEP_ENDED_PER_USER = 1000
# Pruned jobs whose files (log, checkpoint directory) may wait for the removal thread at once.
REMOVE_QUEUE_MAX = 100_000
# The meta key holding the highest job number pruned: numbers (and ids, log and checkpoint
# paths, replica keys) are never given twice, also when the newest rows are pruned.
NUM_FLOOR_KEY = "jobs.num_floor"
# Tables of other components whose rows name a job (column): a job they name is not pruned
# (a buddy guarding its replica asks about it, a replica resumed here finds it by its key).
KEEP_REFERENCED = (("migrate_buddies", "job_id"), ("migrate_replicas", "job_id"), ("net_transfers", "job"),
                   ("zone_placed", "job_id"), ("jobs_leaked_cgroups", "job_id"))
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

ACTIVE_STATES = ("running", "suspended")
# A queued job has no cgroup and no process yet: it waits for room under its class's cap
# (`airlock.admission`). Queued, running and suspended jobs are the ones that have not ended.
QUEUED = "queued"
LIVE_STATES = (QUEUED, *ACTIVE_STATES)
STATES = ("queued", "running", "suspended", "exited", "stopped", "reclaimed", "killed", "failed", "lost", "readdressed",
          "requeued", "migrated")

# The reason of a job found ``lost`` at the agent's start whose cgroup was gone (the node rebooted,
# or someone removed it), not merely empty (its processes ended while the agent was down: it may
# have finished by itself). Only such a job is resumed by its guard elsewhere (migrate: ``needs``).
# Its end_cause is EndCause.LOST_WITH_CGROUP, which is what other code reads (the text is for people).
LOST_WITH_CGROUP = endcause.LOST_WITH_CGROUP_TEXT

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

# The pre-exec step: join every cgroup (exit 127 naming the file if one refuses), set
# oom_score_adj (best effort) and the owner's umask, then exec the rest: the owner's nice value and
# rlimits (joblimits.launch_argv), the drop, the trampoline. $0 is "laminar-job".
ENTER_SH = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do '
    'echo $$ > "$1" || { echo "laminar: cannot join cgroup $1" >&2; exit 127; }; shift; n=$((n-1)); done; '
    'echo "$1" > /proc/self/oom_score_adj 2>/dev/null; umask "$2"; shift 2; exec "$@"'
)

# What runs as root before a job's command (ENTER_SH, setpriv) runs with this environment and
# never with the job's: a user's PATH would pick the 'setpriv' root runs, a user's LD_PRELOAD,
# GCONV_PATH or LOCPATH would load the user's code into root's processes. The job's environment
# is applied by JOB_TRAMPOLINE, after the drop, as the job's owner.
ROOT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
SETPRIV = next((p for p in ("/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv") if os.path.exists(p)),
               "/usr/bin/setpriv")
# The last step before the job's command, already as its owner (``python3 -I -S``: no
# environment variable, site or user directory of anyone reaches it): reads the job's
# environment from the inherited file descriptor argv[1] (JSON; not in argv, which every user can
# read in /proc), enters the working directory argv[3] when not empty (exit 126 naming it if the
# owner may not), then execs the command with that environment (exit 127 if it is not found, 126
# if it cannot be run). Its nice value (not the agent's Nice=-10) and limits were set as root before.
# Before all that it checks that it runs as the owner ids argv[2] names ("uid:gid"), real,
# effective and saved alike (exit 126 naming them otherwise): a drop that did not happen (an id
# setresuid takes for "unchanged") never runs a user's command as root.
JOB_TRAMPOLINE = (
    "import json, os, sys\n"
    "fd, ids, cwd, cmd = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]\n"
    "u, g = (int(x) for x in ids.split(':'))\n"
    "if os.getresuid() != (u, u, u) or os.getresgid() != (g, g, g):\n"
    "    sys.stderr.write(f'laminar: the job should run as uid {u} gid {g}, not as {os.getresuid()} '\n"
    "                     f'{os.getresgid()}: not started\\n')\n"
    "    sys.exit(126)\n"
    "with os.fdopen(fd, 'rb') as f:\n"
    "    env = json.loads(f.read())\n"
    "if cwd:\n"
    "    try:\n"
    "        os.chdir(cwd)\n"
    "    except OSError as e:\n"
    "        sys.stderr.write(f'laminar: cannot enter {cwd} as uid {os.getuid()}: {e.strerror}\\n')\n"
    "        sys.exit(126)\n"
    "try:\n"
    "    os.execvpe(cmd[0], cmd, env)\n"
    "except OSError as e:\n"
    "    sys.stderr.write(f'laminar: cannot execute {cmd[0]!r}: {e.strerror}\\n')\n"
    "    sys.exit(127 if isinstance(e, FileNotFoundError) else 126)\n"
)
TRAMPOLINE_PYTHON = next((p for p in ("/usr/bin/python3", "/bin/python3") if os.path.exists(p)), sys.executable)

def check_owner_ids(uid: Any, gid: Any) -> None:
    """Raises JobError unless `uid` and `gid` are ids a job may run as: integers 0..2**32-2
    (-1, that is 2**32-1, means "leave unchanged" to setresuid: a job "as uid -1" would keep the
    agent's root)."""
    for what, v in (("owner uid", uid), ("owner gid", gid)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 2**32 - 2:
            raise JobError(f"{what} {v!r}: expected an integer 0..{2**32 - 2} (-1 and 4294967295 mean 'unchanged' "
                           "to setresuid, which would leave the job root)")


def drop_privileges_argv(uid: int, gid: int) -> list[str]:
    """The argv prefix that runs what follows as `uid`/`gid` (with the user's groups when the
    uid has a passwd entry, else none). Raises JobError for an id out of range (check_owner_ids)."""
    check_owner_ids(uid, gid)
    try:
        pwd.getpwuid(uid)
        groups = "--init-groups"
    except KeyError:
        groups = "--clear-groups"
    return [SETPRIV, f"--reuid={uid}", f"--regid={gid}", groups, "--"]


# How long the filesystems a submission names (its working directory, its PATH) get to answer
# whether the directory exists and may be entered and where the command is: a hung NFS or FUSE
# mount never answers.
PROBE_S = 10.0
_REAPERS: set[asyncio.Task[Any]] = set()
# Path probes of one user (and of all users) that may exist at once, counted from the spawn
# until the probe is reaped, not until its submission is answered: a probe stuck on its owner's
# own hung mount (a FUSE server that read the request and never answers) is killed at PROBE_S
# but stays in uninterruptible sleep, unreaped, for as long as the mount hangs. Past the bound
# the submission is refused at once (429), so one user cannot leave processes (and, on Python
# 3.11 without the pidfd watcher, threads) piling up at one per submission.
PROBES_PER_UID = 4
PROBES_ALL_USERS = 64

# The probe, as the job's owner: $1 the command to find in $3 (a PATH) when not empty (exit 4 if no
# directory of it holds an executable file of that name, as shutil.which), $2 the working
# directory when not empty (exit 3 if it is not a directory), then exec "$@" (the owner's
# `cd` into it) with the directory as its $0.
PROBE_SH = (
    'exe=$1 dir=$2 path=$3; shift 3; '
    'if [ -n "$exe" ]; then set -f; IFS=:; found=; '
    'for d in $path; do if [ -f "$d/$exe" ] && [ -x "$d/$exe" ]; then found=1; break; fi; done; '
    'unset IFS; set +f; [ -n "$found" ] || exit 4; fi; '
    'if [ -n "$dir" ]; then [ -d "$dir" ] || exit 3; exec "$@" "$dir"; fi; exit 0'
)


async def check_paths(cwd: str | None, exe: str | None, path_env: str, uid: int, gid: int,
                      slots: UidSlots | None = None) -> None:
    """Raises JobError unless `exe` (when given) is an executable file in one of `path_env`'s
    directories, and `cwd` (when given) is a directory that `uid`/`gid` may enter, both asked as
    that user (root when uid is 0): asked as root, the answers told a user whether files exist
    in directories closed to them. The questions go to one child process with PROBE_S to answer,
    never to the agent's own thread: a stat on hung storage blocks until the storage answers,
    which would stop the event loop (every request, the kill-switch included) for as long. The
    child holds the user's limits (`joblimits.helper_argv`), not the agent's. `slots` counts the
    probe against `uid` until it is reaped (PROBES_PER_UID): QuotaError (429) past it."""
    if cwd is None and exe is None:
        return
    try:
        enter = [*joblimits.helper_argv(uid, gid), *(drop_privileges_argv(uid, gid) if uid else [])]
    except joblimits.LimitsError as e:
        raise JobError(str(e)) from None
    if slots is not None:
        try:
            slots.take(uid)
        except Busy as e:
            raise QuotaError(e.message, reason=e.reason) from None
    argv = [*enter, "/bin/sh", "-c", PROBE_SH, "laminar-probe", exe or "", cwd or "", path_env,
            "/bin/sh", "-c", 'cd -- "$0"']
    what = " and ".join([*([f"PATH {path_env!r}"] if exe else []), *([f"cwd {cwd!r}"] if cwd else [])])
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    except OSError as e:
        if slots is not None:
            slots.release(uid)
        raise JobError(f"{what}: cannot check: {e}") from None
    except BaseException:
        if slots is not None:
            slots.release(uid)
        raise
    try:
        code = await asyncio.wait_for(proc.wait(), PROBE_S)
    except TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise JobError(f"{what}: the filesystem did not answer within {PROBE_S:g} s (hung storage?); choose "
                       "directories on storage that answers") from None
    finally:
        if proc.returncode is None:  # reaped once the kill lands (a process in D state: later)
            reaper = asyncio.get_running_loop().create_task(proc.wait())
            _REAPERS.add(reaper)
            reaper.add_done_callback(_REAPERS.discard)
            if slots is not None:  # the owner's probe counts until then
                reaper.add_done_callback(lambda _t: slots.release(uid))
        elif slots is not None:
            slots.release(uid)
    if code == 4:
        raise JobError(f"command {exe!r}: not found in PATH (as uid {uid}, who runs the job)")
    if code not in (0, 2, 3):  # 2, 3: cd or [ -d ] said no; else the check itself could not run as uid
        raise JobError(f"{what}: could not be checked as uid {uid} (exit {code}; a user at its process limit, "
                       "nproc, can start no more processes, nor jobs)")
    if code != 0:
        raise JobError(f"cwd {cwd!r}: no such directory that uid {uid} may enter (the job runs as its owner; a "
                       "directory is entered only with search permission on it and on every directory above it)")


def catches_signal(pid: int, signame: str) -> bool:
    """Whether process ``pid`` has a handler for ``signame`` (``SigCgt`` of /proc/<pid>/status).
    False when the process is gone or the signal is unknown."""
    try:
        num = int(signal.Signals[signame])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (num - 1) & 1)
    except (OSError, KeyError, ValueError):
        return False
    return False


def signal_if_caught(pid: int | None, signame: str) -> bool:
    """Send ``signame`` to process ``pid`` only if it has a handler for it
    (:func:`catches_signal`): the default action of SIGUSR1, SIGUSR2 and most signals kills.
    True when sent; False when the process is gone or does not catch it."""
    if not pid or not catches_signal(int(pid), signame):
        return False
    try:
        os.kill(int(pid), signal.Signals[signame])
        return True
    except ProcessLookupError:
        return False


@dataclass(frozen=True)
class GrantRule:
    """One rule of who may submit what: the classes it allows up to `priority_max`, for the
    uids and gids it names (`everyone`: the default rule)."""

    classes: tuple[str, ...]
    priority_max: int
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    everyone: bool = False
    label: str = "the default for every user"

    def applies(self, uid: int, gids: set[int]) -> bool:
        return self.everyone or uid in self.uids or bool(self.gids & gids)

    def allows(self, job_class: str, priority: int) -> bool:
        return job_class in self.classes and priority <= self.priority_max

    def describe(self) -> str:
        return f"{', '.join(self.classes)} up to priority {self.priority_max} ({self.label})"


@dataclass(frozen=True)
class Grants:
    """Which Airlock classes and priorities a caller may submit (config ``[grants]``). Pure:
    `refusal` decides from the caller's uid and gids alone. Root may submit anything."""

    rules: tuple[GrantRule, ...]

    @classmethod
    def from_config(cls, section: dict[str, Any] | None) -> Grants:
        """From a validated ``[grants]`` section (laminar.config); None: the defaults. User
        and group names are resolved to ids here."""
        from ..config import SCHEMA

        sec = {k: f.default for k, f in SCHEMA["grants"].items()} | dict(section or {})
        rules = [GrantRule(tuple(sec["default_classes"]), int(sec["default_priority_max"]), everyone=True)]
        for g in sec["grant"]:
            uids = frozenset(x if isinstance(x, int) else pwd.getpwnam(x).pw_uid for x in g.get("users", []))
            gids = frozenset(x if isinstance(x, int) else grp.getgrnam(x).gr_gid for x in g.get("groups", []))
            who = [f"user {x}" for x in g.get("users", [])] + [f"group {x}" for x in g.get("groups", [])]
            rules.append(GrantRule(tuple(g["classes"]), int(g["priority_max"]), uids, gids,
                                   label=f"granted to {', '.join(who)}"))
        return cls(tuple(rules))

    def allowed(self, uid: int, gids: set[int]) -> list[GrantRule]:
        """The rules that apply to the caller."""
        return [r for r in self.rules if r.applies(uid, gids)]

    def refusal(self, uid: int, gids: set[int], job_class: str, priority: int) -> str | None:
        """None when the caller (uid, primary and supplementary gids) may submit a job of
        `job_class` at `priority`; else the refusal, naming what was asked and what it may use."""
        if uid == 0:
            return None
        mine = self.allowed(uid, gids)
        if any(r.allows(job_class, priority) for r in mine):
            return None
        may = "; ".join(r.describe() for r in mine) or "nothing"
        return (f"permission denied: class {job_class} at priority {priority} is beyond what uid {uid} may submit; "
                f"it may submit {may}. Ask the node's operator for a grant ([grants] in laminard's config, "
                "docs/operations.md)")

    def as_dict(self) -> list[dict[str, Any]]:
        return [{"classes": list(r.classes), "priority_max": r.priority_max, "who": r.label} for r in self.rules]


def caller_gids(gid: int, pid: int) -> set[int]:
    """The caller's primary gid and its supplementary groups (``/proc/<pid>/status``; only the
    primary one when the process is gone)."""
    out = {gid}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                out.update(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return out


class JobError(ValueError):
    """A job request that cannot be done; the message names the value and what is allowed.
    `reason`: a short stable word for the API's refusal counts (``api.refused_by_reason``)."""

    def __init__(self, message: str = "", reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class GrantError(Exception):
    """A submission beyond the caller's grant (config ``[grants]``); the message names the class
    and priority asked and what the caller may use."""


class ReservedEnvError(JobError):
    """A spec whose env sets a name the agent sets itself (laminar.runtime.provenance)."""


class ResumeFromError(JobError):
    """A local user's ``resume_from`` in the agent's own trees (`JobManager.check_user_resume`)."""


class QuotaError(JobError):
    """The submitting user has as many jobs not yet ended as config ``jobs.max_per_user``
    allows (429 in the API); nothing was created."""


class AdmissionError(JobError):
    """A job that could never start on this node: its memory limit exceeds its class's cap."""


def parse_memory_mb(value: Any) -> int | None:
    """'512M', '2G', '1.5G', '2048' (MiB), 512 (MiB) -> MiB; None/'' -> None (no limit). Read in
    linear time (`laminar.inputs.size_mib`: at most NUMBER_TEXT_MAX characters, checked first);
    JobError naming the value (cut) and the range otherwise, never an OverflowError."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise JobError(f"memory {value!r}: expected a size like 512M or 2G, or MiB as an integer")
    if isinstance(value, int):
        mb = value
    else:
        mb_text = size_mib(str(value)) if isinstance(value, (str, float)) else None
        if mb_text is None:
            raise JobError(f"memory {brief(value)}: expected a size like 512M or 2G, or MiB as an integer "
                           f"(at most {NUMBER_TEXT_MAX} characters)")
        mb = mb_text
    if not 1 <= mb <= MEMORY_MB_MAX:
        raise JobError(f"memory {brief(value)}: must be between 1 MiB and {MEMORY_MB_MAX} MiB")
    return mb


def parse_signal(value: Any) -> str:
    """'SIGUSR1', 'USR1', 10 -> 'SIGUSR1'. SIGKILL and SIGSTOP are refused: no process can
    catch them, so a job could never checkpoint on one (laminar.jobkit fails at its start)."""
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            name = signal.Signals(value).name
        else:
            name = str(value).upper()
            name = signal.Signals[name if name.startswith("SIG") else "SIG" + name].name
    except (KeyError, ValueError):
        raise JobError(f"checkpoint signal {_brief(value)}: expected a signal name like SIGUSR1 or a number") from None
    if name in ("SIGKILL", "SIGSTOP"):
        raise JobError(f"checkpoint signal {_brief(value)}: {name} cannot be caught, so the job could never checkpoint "
                       "on it; use a catchable signal such as SIGUSR1 (the default) or SIGUSR2")
    return name


def parse_grace_s(value: Any) -> float | None:
    """A stop's grace (seconds from SIGTERM to the kill): None (the agent's default) or a
    finite number 0..STOP_GRACE_MAX_S; JobError naming the value otherwise (JSON's
    ``Infinity`` and ``NaN`` included: a grace that never ends would leave the job unstoppable)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= STOP_GRACE_MAX_S:
        raise JobError(f"grace_s {_brief(value)}: expected seconds from 0 to {STOP_GRACE_MAX_S:g}")
    return float(value)


def _has_nul(*texts: Any) -> bool:
    return any(isinstance(t, str) and "\0" in t for t in texts)


def _brief(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (an error names a huge value without quoting it whole;
    `laminar.inputs.brief`: nor builds its whole repr)."""
    return brief(value, limit)


def parse_gpus(value: Any) -> int | list[int]:
    """2 -> 2 (a count); '0,1' or [0, 1] -> [0, 1] (indices); None/'' -> 0. A count above
    ``gpus.GPUS_MAX``, or an index list longer than that or with an index past it, is refused."""
    top = gpumod.GPUS_MAX
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise JobError(f"gpus {value!r}: expected a count (2) or indices (0,1)")
    if isinstance(value, int):
        if not 0 <= value <= top:
            raise JobError(f"gpus {_brief(value)}: a count must be 0 to at most {top}")
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.count(",") >= top:
            raise JobError(f"gpus {_brief(value)}: at most {top} indices")
        # ASCII digits only ('²'.isdigit() is true, and int() refuses it), and no more than a
        # count or an index can have (int() of 5,000 digits raises)
        parts = [x.strip() for x in s.split(",")]
        if not all(x.isascii() and x.isdigit() and len(x) <= 6 for x in parts):
            raise JobError(f"gpus {_brief(value)}: expected a count (2) or indices (0,1)")
        if len(parts) == 1:
            return parse_gpus(int(parts[0]))
        value = [int(x) for x in parts]
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        if len(value) > top:
            raise JobError(f"gpus {_brief(value)}: at most {top} indices (no node has more GPUs)")
        bad = [i for i in value if not 0 <= i < top]
        if bad:
            raise JobError(f"gpus {_brief(value)}: indices must be 0..{top - 1}, not {_brief(bad)}")
        if len(set(value)) != len(value):
            raise JobError(f"gpus {_brief(value)}: indices must be unique")
        return list(value)
    raise JobError(f"gpus {_brief(value)}: expected a count (2) or indices (0,1)")


# What a job spec may hold (docs/operations.md, "What a job spec may hold"). A spec is kept in
# memory while the job lives (256 per user), stored with its record, listed, sent to peers on a
# move: the API's 1 MiB body cap alone let one user hold gigabytes (a 1 MiB env is 8.7 MB of
# Python objects). SPEC_BYTES_MAX bounds what the user writes: command, env, cwd and resume_from
# together, in UTF-8 bytes (an argument and an env entry count one byte more: the NUL execve
# adds; "NAME=value" the '='). A spec at the cap still moves: its hand-over frame (at most
# laminar.zone.wire.MAX_FRAME) carries it whatever it escapes to in JSON.
SPEC_BYTES_MAX = 64 << 10
ARGV_ITEMS_MAX = 4096  # arguments of the command
ARG_BYTES_MAX = 32 << 10  # one argument (the kernel's own limit is 128 KiB)
ENV_NAMES_MAX = 1024  # names in the env
ENV_NAME_BYTES_MAX = 256  # one env name
ENV_VALUE_BYTES_MAX = 32 << 10  # one env value
PATH_BYTES_MAX = 4096  # cwd, resume_from (PATH_MAX)
# Elastic workers: one GPU each, and no node has more than gpus.GPUS_MAX GPUs (the options the
# elastic round builds per job grow with elastic_max - workers; see laminar.policy.elastic).
ELASTIC_MAX = gpumod.GPUS_MAX


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_spec_size(spec: JobSpec) -> None:
    """Raises JobError when `spec` holds more than a spec may (the caps above), naming the size
    and the cap; before anything else reads it. Fields of the wrong type are left to
    `JobSpec.validate` (it names them)."""
    total = 0
    if isinstance(spec.command, list):
        if len(spec.command) > ARGV_ITEMS_MAX:
            raise JobError(f"command: {len(spec.command)} arguments, at most {ARGV_ITEMS_MAX}", reason="spec_too_large")
        for i, a in enumerate(spec.command):
            if isinstance(a, str):
                n = _utf8_len(a)
                if n > ARG_BYTES_MAX:
                    raise JobError(f"command: argument {i} is {n} bytes, at most {ARG_BYTES_MAX}",
                                   reason="spec_too_large")
                total += n + 1
    if isinstance(spec.env, dict):
        if len(spec.env) > ENV_NAMES_MAX:
            raise JobError(f"env: {len(spec.env)} names, at most {ENV_NAMES_MAX}", reason="spec_too_large")
        for k, v in spec.env.items():
            if not isinstance(k, str) or not isinstance(v, str):
                continue
            nk, nv = _utf8_len(k), _utf8_len(v)
            if nk > ENV_NAME_BYTES_MAX:
                raise JobError(f"env: name {_brief(k)} is {nk} bytes, at most {ENV_NAME_BYTES_MAX}",
                               reason="spec_too_large")
            if nv > ENV_VALUE_BYTES_MAX:
                raise JobError(f"env {_brief(k)}: value of {nv} bytes, at most {ENV_VALUE_BYTES_MAX}",
                               reason="spec_too_large")
            total += nk + nv + 2
    for what, path in (("cwd", spec.cwd), ("resume_from", spec.resume_from)):
        if isinstance(path, str):
            n = _utf8_len(path)
            if n > PATH_BYTES_MAX:
                raise JobError(f"{what}: {n} bytes, at most {PATH_BYTES_MAX}", reason="spec_too_large")
            total += n
    if total > SPEC_BYTES_MAX:
        raise JobError(f"job spec: {total} bytes, at most {SPEC_BYTES_MAX} (command, env, cwd and resume_from "
                       "together); pass large data in a file", reason="spec_too_large")


@dataclass
class JobSpec:
    """What to run and with what. Build with `JobSpec.from_dict` (validates) or directly and
    call `validate()`. JSON keys are the field names, with ``class`` for `job_class`."""

    command: list[str]
    name: str = ""
    memory_mb: int | None = None
    cpus: float | None = None
    gpus: int | list[int] = 0
    job_class: str = "standard"
    priority: int = PRIORITY_DEFAULT
    checkpoint_signal: str = "SIGUSR1"
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    lent: bool = False
    elastic_min: int | None = None
    elastic_max: int | None = None
    resume_from: str | None = None
    # the job's own hints, once env names (laminar.runtime.provenance): its expected remaining
    # single-worker seconds (elastic GPUs), and whether the checkpoint driver may ask it for
    # periodic checkpoints
    remaining_s: float | None = None
    periodic_checkpoints: bool = True

    def validate(self) -> JobSpec:
        """Checks every field; raises JobError naming the value and what would be right."""
        check_spec_size(self)
        if not isinstance(self.command, list) or not self.command or not all(isinstance(a, str) for a in self.command):
            raise JobError(f"command {_brief(self.command)}: expected a non-empty list of strings (argv)")
        if not self.command[0]:
            raise JobError("command: argv[0] is empty")
        if _has_nul(*self.command):
            raise JobError(f"command {_brief(self.command)}: an argument holds a NUL byte, which no argv can carry")
        if not isinstance(self.name, str) or len(self.name) > 63 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise JobError(f"name {_brief(self.name)}: 0-63 characters of letters, digits, '-', '_' or '.'")
        self.memory_mb = parse_memory_mb(self.memory_mb)
        if self.cpus is not None:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, int | float) or not CPUS_MIN <= self.cpus <= 4096:
                raise JobError(f"cpus {_brief(self.cpus)}: expected a number of CPUs, at least {CPUS_MIN} (the kernel's "
                               "smallest quota) and at most 4096 (fractions allowed)")
            self.cpus = float(self.cpus)
        self.gpus = parse_gpus(self.gpus)
        if self.job_class not in LIFECYCLE_CLASSES:
            raise JobError(f"class {_brief(self.job_class)}: expected one of {', '.join(LIFECYCLE_CLASSES)}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise JobError(f"priority {_brief(self.priority)}: expected an integer {PRIORITY_MIN}..{PRIORITY_MAX} (higher survives longer)")
        self.checkpoint_signal = parse_signal(self.checkpoint_signal)
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                                     for k, v in self.env.items()):
            raise JobError(f"env {_brief(self.env)}: expected a table of NAME = \"value\" strings")
        if _has_nul(*self.env, *self.env.values()):
            raise JobError(f"env {_brief(self.env)}: a name or value holds a NUL byte, which no environment can carry")
        _check_env_names(self.env)
        if self.cwd is not None and (not isinstance(self.cwd, str) or not self.cwd.startswith("/") or _has_nul(self.cwd)):
            raise JobError(f"cwd {_brief(self.cwd)}: expected an absolute path (with no NUL byte)")
        if not isinstance(self.lent, bool):
            raise JobError(f"lent {_brief(self.lent)}: expected true or false")
        if (self.elastic_min is None) != (self.elastic_max is None):
            raise JobError("elastic: give both elastic_min and elastic_max, or neither")
        if self.elastic_min is not None and self.elastic_max is not None:
            ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (self.elastic_min, self.elastic_max))
            if not ok or not 1 <= self.elastic_min <= self.elastic_max <= ELASTIC_MAX:
                raise JobError(f"elastic min {_brief(self.elastic_min)} / max {_brief(self.elastic_max)}: expected "
                               f"integers with 1 <= min <= max <= {ELASTIC_MAX} (a worker takes a GPU, and no node "
                               "has more)")
        if self.resume_from is not None and (not isinstance(self.resume_from, str) or _has_nul(self.resume_from)):
            raise JobError(f"resume_from {_brief(self.resume_from)}: expected a path (with no NUL byte)")
        if self.remaining_s is not None:
            lo, hi = provenance.REMAINING_S_MIN, provenance.REMAINING_S_MAX
            if isinstance(self.remaining_s, bool) or not isinstance(self.remaining_s, int | float) \
                    or not lo <= self.remaining_s <= hi:  # (NaN and infinity fail it)
                raise JobError(f"remaining_s {_brief(self.remaining_s)}: expected the job's remaining single-worker "
                               f"seconds, {lo:g} to {hi:g}")
            self.remaining_s = float(self.remaining_s)
        if not isinstance(self.periodic_checkpoints, bool):
            raise JobError(f"periodic_checkpoints {_brief(self.periodic_checkpoints)}: expected true or false")
        return self

    @classmethod
    def from_dict(cls, d: Any) -> JobSpec:
        """Validated spec from a JSON object; unknown keys are refused by name."""
        if not isinstance(d, dict):
            raise JobError(f"job spec must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        for short, full in (("class", "job_class"), ("memory", "memory_mb")):
            if short in d and full in d:  # two values for one thing: which one was meant?
                raise JobError(f"job spec: both {short!r} = {_brief(d[short])} and {full!r} = {_brief(d[full])}; "
                               f"give one of them")
        if "class" in d:
            d["job_class"] = d.pop("class")
        if "memory" in d:
            d["memory_mb"] = parse_memory_mb(d.pop("memory"))
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise JobError(f"job spec: unknown keys {_brief(unknown)}; allowed: {sorted(known | {'class', 'memory'})}")
        if "command" not in d:
            raise JobError("job spec: missing 'command' (argv list)")
        return cls(**d).validate()

    def as_dict(self) -> dict[str, Any]:
        """The spec as JSON keys (``class`` for job_class, last). Built by hand: shallow copies
        of the command, env and GPU list (their items are strings and ints), where
        dataclasses.asdict deep-copied everything (0.31 s for an env of 88,000 entries). The
        fields added since (`LATER_FIELDS`) are left out while they hold their defaults: an agent
        of an older release refuses a spec with a key it does not know, so a job that uses none of
        them still moves to it."""
        d = {f: getattr(self, f) for f in _SPEC_FIELDS}
        d["command"] = list(self.command) if isinstance(self.command, list) else self.command
        d["env"] = dict(self.env) if isinstance(self.env, dict) else self.env
        if isinstance(self.gpus, list):
            d["gpus"] = list(self.gpus)
        d["class"] = self.job_class
        for k, default in LATER_FIELDS.items():
            if d.get(k) == default:
                del d[k]
        return d


_SPEC_FIELDS = tuple(f for f in JobSpec.__dataclass_fields__ if f != "job_class")
# JobSpec fields added after a release, with their defaults (JobSpec.as_dict)
LATER_FIELDS: dict[str, Any] = {"remaining_s": None, "periodic_checkpoints": True}


def _check_env_names(env: dict[str, str]) -> None:
    """JobError naming the reserved names ``env`` sets (laminar.runtime.provenance) and what to
    use instead: the agent sets them itself, and never reads a job's environment back."""
    problem = provenance.reserved_env_error(env)
    if problem:
        raise ReservedEnvError(problem)


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
    adopted: bool = False
    started: float | None = None  # when its process started (None while queued)
    wait: admission.Wait | None = None  # why it is queued (in memory; its reason says the same)
    limits: dict[str, Any] | None = None  # what it started with (joblimits.Profile.record; None: queued)
    # its checkpoint directory's modification time at the scanner's last look, None while it is
    # empty or not looked at yet (in memory: laminar.runtime.ckpt_scan sets it)
    ckpt_seen: float | None = field(default=None, compare=False, repr=False)
    origin: JobOrigin = NO_ORIGIN  # where it came from, as the agent recorded it (never from its env)
    spec_bytes: int = 0  # the length of its stored spec text (a page of GET /v1/jobs counts it)

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
            "log": str(self.log_path) if self.log_path else None, "adopted": self.adopted,
            "started": self.started, "spec": spec, "env_redacted": not reveal, "limits": self.limits,
            "origin": self.origin.as_dict(),
        }
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


def oom_score_adj_for(spec: JobSpec) -> int:
    """The kernel's fallback order mirrors Airlock's (see airlock.ladder.oom_score_adj)."""
    try:
        from ..airlock.ladder import oom_score_adj
    except ImportError:  # ladder not present: a plain class-based order
        return {"long-resident": 0, "standard": 500, "transient": 1000}[spec.job_class]
    return oom_score_adj(spec.job_class, spec.priority)


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


def remove_job_files(state_dir: Path, job_id: str) -> None:
    """Removes a pruned job's log (``logs/<id>.log``) and checkpoint directory (``ckpt/<id>``),
    never following a link: ``logs`` and ``ckpt`` are root's (0711), so the names are the agent's;
    what lies below is the job owner's, and shutil.rmtree (file-descriptor based on Linux) removes
    a link in it as a link. Errors are logged, never raised (the next agent leaves the rest)."""
    if not job_id.startswith("job-") or "/" in job_id:
        return
    try:
        os.unlink(state_dir / "logs" / f"{job_id}.log")
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("jobs: cannot remove the log of pruned %s: %s", job_id, e)
    ckpt = state_dir / "ckpt" / job_id
    try:
        st = os.lstat(ckpt)
    except OSError:
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            import shutil

            shutil.rmtree(ckpt)
        else:
            os.unlink(ckpt)
    except OSError as e:
        log.warning("jobs: cannot remove the checkpoint directory of pruned %s: %s", job_id, e)


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
                 keep_ended_per_user: int | None = None, job_limits: dict[str, Any] | None = None) -> None:
        self.agent: Any = None
        # config [job_limits] (None: the agent's config, else the defaults): what jobs start with
        self.job_limits_cfg = job_limits
        self.limiter: joblimits.Limiter | None = None
        # config [jobs] (None: the agent's config, else the defaults): see CONFIG_FIELDS
        self.max_per_user = max_per_user
        self.keep_ended_s = keep_ended_s
        self.keep_ended = keep_ended
        self.keep_ended_per_user = keep_ended_per_user
        self._remover: Any = None  # the queue of the thread that removes pruned jobs' files (_remove_files)
        self._removing = 0  # pruned jobs whose files wait for it
        self._removing_lock = threading.Lock()
        # who may submit which class and priority through the API (config [grants])
        self.grants = grants
        self.leak_sweep_s = leak_sweep_s
        self.metrics = metrics  # a prometheus CollectorRegistry (the agent's, else one of its own)
        self._leak_gauge: Any = None
        self._leak_counter: Any = None
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
        # jobs' checkpoint listings (bounded, off the loop): Airlock and the migrate component read them
        self.ckpt_scan = CkptScanner()
        # who holds which job frozen (Airlock, a move, a fence): frozen while any hold remains
        self.holds = Holds(self, store)
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._pidfds: dict[str, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._exit_waiters: dict[str, asyncio.Event] = {}
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
    async def start(self, agent: Any) -> None:
        """Detect cgroups, create the per-class parents, open the table, re-adopt jobs."""
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
            self.netguard = self.netguard or getattr(agent, "netguard", None)
            self.metrics = self.metrics or getattr(agent, "metrics", None)
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
        if any(c not in have for c in provenance.COLUMNS):
            self._clean_stored_env()
        self._init_metrics()
        self._emit("job", f"jobs: {self.hierarchy.describe()}; GPUs: {self.inventory.source} "
                   f"{self.inventory.indices} {self.inventory.note}".rstrip(),
                   cgroups=self.hierarchy.mode, gpus=self.inventory.as_dict())
        # a reclaim of this node whose window is still open (an agent restart): held before any admission
        from laminar.migrate.drain import held_at_start

        self.held = self.held or held_at_start(self.store)
        self._adopt_all()
        self.holds.store = self.store
        self.holds.load()  # after the jobs: the holds of jobs that ended meanwhile go
        self._spawn_task(self._leak_loop())  # now, then every leak_sweep_s: leaks of the previous agent; pruning
        self._spawn_task(self._ckpt_scan_loop())

    async def _ckpt_scan_loop(self) -> None:
        """Every CKPT_SCAN_EVERY_S: every active job's checkpoint listing (``ckpt_scan``), off the
        loop, one thread per owner; ended jobs' are dropped. Never raises."""
        while True:
            try:
                active = self.active()
                self.ckpt_scan.keep_only(j.id for j in active)
                await self.ckpt_scan.refresh_all(active, max_age_s=CKPT_SCAN_EVERY_S / 2)
            except Exception:
                log.exception("jobs: looking at checkpoint directories")
            await asyncio.sleep(CKPT_SCAN_EVERY_S)

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
        """Stop watching. Jobs keep running in their cgroups; the next start re-adopts them."""
        for task in list(self._tasks):
            task.cancel()
        for jid in list(self._pidfds):
            self._unwatch(jid)
        self._popen.clear()

    def status(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for j in self.jobs.values():
            counts[j.state] = counts.get(j.state, 0) + 1
        return {"cgroups": self.hierarchy.as_dict() if self.hierarchy else None,
                "root": self.cgroup_root, "gpus": self.inventory.as_dict() if self.inventory else None,
                "jobs": counts, "grants": self.grants.as_dict() if self.grants else None,
                "job_limits": self._limits_status(),
                "ckpt_scan": self.ckpt_scan.stats(),
                "provenance": dict(self.provenance_counts),
                "leaked_cgroups": self.leaked_cgroups() if self.store is not None else []}

    def _limits_status(self) -> dict[str, Any] | None:
        """What jobs start with (joblimits), where their task limits live, and how many forks
        all jobs together had refused at the agent's root pids.max."""
        if self.limiter is None or self.tree is None:
            return None
        out = self.limiter.status()
        out["pids_controller"] = str(self.hierarchy.pids_mount) if self.hierarchy and self.hierarchy.pids_mount else None
        out["all_jobs_pids"] = self.tree.root_pids()
        return out

    # -- leaked cgroups ----------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if self._leak_gauge is not None:  # started again (tests): the metrics exist
            return
        if self.metrics is None:
            self.metrics = CollectorRegistry()
        self._leak_gauge = Gauge("laminar_jobs_leaked_cgroups", "Ended jobs whose cgroups could not be removed yet "
                                 "(retried by the sweep)", registry=self.metrics)
        self._leak_counter = Counter("laminar_jobs_cgroups_leaked", "Job cgroups whose removal failed at teardown "
                                     "(each then retried until gone)", registry=self.metrics)
        self._leak_gauge.set(len(self.leaked_cgroups()))  # set on every change (never read from the scrape's thread)

    def leaked_cgroups(self) -> builtins.list[dict[str, Any]]:
        """The leaked cgroups: job_id, job_class, since, tries, error."""
        return [dict(r) for r in self.store.db.execute("SELECT * FROM jobs_leaked_cgroups ORDER BY since")]

    def _record_leak(self, job: Job, error: str) -> None:
        """The job's cgroups could not be removed: remember them for the sweep."""
        with self.store.tx() as db:
            db.execute("INSERT INTO jobs_leaked_cgroups(job_id, job_class, since, tries, error) VALUES(?, ?, ?, 1, ?) "
                       "ON CONFLICT(job_id) DO UPDATE SET tries = tries + 1, error = excluded.error",
                       (job.id, job.spec.job_class, time.time(), error))
        if self._leak_counter is not None:
            self._leak_counter.inc()
            self._leak_gauge.set(len(self.leaked_cgroups()))
        self._emit("job", f"job {job.id}: its cgroup could not be removed ({error}); kept as leaked and retried "
                   f"every {self.leak_sweep_s:g} s until it is gone", job=job.id, leaked_cgroup=str(job.cgroup.unified),
                   error=error)

    async def sweep_leaks(self) -> int:
        """Kill what is left in each leaked cgroup and remove it (in a worker thread); returns
        how many are still leaked. A removed one leaves the table with a ``job`` event."""
        assert self.tree is not None
        for row in self.leaked_cgroups():
            try:
                cg = self.tree.job(row["job_class"], row["job_id"])
            except CgroupError as e:  # a class this agent no longer has: say so, keep the record
                log.warning("leaked cgroup of %s: %s", row["job_id"], e)
                continue
            try:
                await asyncio.to_thread(self._kill_and_remove, cg)
            except CgroupError as e:
                with self.store.tx() as db:
                    db.execute("UPDATE jobs_leaked_cgroups SET tries = tries + 1, error = ? WHERE job_id = ?",
                               (str(e), row["job_id"]))
                continue
            with self.store.tx() as db:
                db.execute("DELETE FROM jobs_leaked_cgroups WHERE job_id = ?", (row["job_id"],))
            self._emit("job", f"job {row['job_id']}: leaked cgroup removed after {row['tries'] + 1} tries "
                       f"({time.time() - row['since']:.0f} s)", job=row["job_id"], leaked_cgroup=str(cg.unified),
                       removed=True)
        left = len(self.leaked_cgroups())
        if self._leak_gauge is not None:
            self._leak_gauge.set(left)
        return left

    @staticmethod
    def _kill_and_remove(cg: JobCgroup) -> None:
        """Blocking (run in a thread): cgroup.kill what is left (a process that could not die
        before may now), then remove the directories. CgroupError while something remains."""
        if cg.populated():
            cg.kill()
            for _ in range(100):
                if not cg.populated():
                    break
                time.sleep(0.01)
        cg.remove()

    async def _leak_loop(self) -> None:
        while True:
            try:
                await self.sweep_leaks()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("leaked cgroup sweep failed")
            self.prune_ended()  # the age rule holds on an idle node too
            await asyncio.sleep(self.leak_sweep_s)

    # -- retention -----------------------------------------------------------------------------
    def prune_ended(self, now: float | None = None) -> int:
        """Delete the records of ended jobs beyond config ``jobs.keep_ended_per_user`` (a user's
        oldest ended first: one user's submissions in a loop must not push out everyone else's
        history), ``jobs.keep_ended_s`` (ended longer ago) and ``jobs.keep_ended`` (the oldest
        ended first); returns how many. Never a job that has not ended (no ``ended`` recorded:
        queued, running, suspended, being stopped, or a stop the previous agent left
        unfinished), nor one another component's table still names (`KEEP_REFERENCED`). At most
        PRUNE_BATCH per call (the rest at the next one), so a lowered limit never holds the event
        loop. The highest number pruned is kept (`NUM_FLOOR_KEY`): no job number is ever given
        twice. A pruned job's log and checkpoint directory are removed with its record, in a
        thread (`_remove_files`). Called when a job ends, at start and every ``leak_sweep_s``;
        a store error is logged, never raised."""
        if self.store is None:
            return 0
        now = time.time() if now is None else now
        keep_s = KEEP_ENDED_S if self.keep_ended_s is None else float(self.keep_ended_s)
        keep_n = KEEP_ENDED if self.keep_ended is None else int(self.keep_ended)
        keep_u = KEEP_ENDED_PER_USER if self.keep_ended_per_user is None else int(self.keep_ended_per_user)
        picked: dict[str, int] = {}  # id -> num, in the order picked

        def add(rows: Any, most: int | None = None) -> None:
            added = 0
            for i, n in rows:
                if len(picked) >= PRUNE_BATCH or (most is not None and added >= most):
                    return
                if i not in picked:
                    picked[i] = int(n)
                    added += 1

        try:
            db = self.store.db
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            where = "ended IS NOT NULL" + "".join(
                f" AND id NOT IN (SELECT {col} FROM {table} WHERE {col} IS NOT NULL)"
                for table, col in KEEP_REFERENCED if table in tables)
            if keep_u > 0:
                over = db.execute(f"SELECT owner_uid, COUNT(*) FROM jobs WHERE {where} AND owner_uid != 0 "
                                  "GROUP BY owner_uid HAVING COUNT(*) > ?", (keep_u,)).fetchall()
                for uid, n in over:
                    add(db.execute(f"SELECT id, num FROM jobs WHERE {where} AND owner_uid = ? ORDER BY ended, num "
                                   "LIMIT ?", (uid, min(int(n) - keep_u, PRUNE_BATCH))).fetchall())
            add(db.execute(f"SELECT id, num FROM jobs WHERE {where} AND ended < ? ORDER BY ended, num LIMIT ?",
                           (now - keep_s, PRUNE_BATCH)).fetchall())
            excess = int(db.execute(f"SELECT COUNT(*) FROM jobs WHERE {where}").fetchone()[0]) - len(picked) - keep_n
            if excess > 0 and len(picked) < PRUNE_BATCH:
                add(db.execute(f"SELECT id, num FROM jobs WHERE {where} ORDER BY ended, num LIMIT ?",
                               (min(excess + len(picked), 2 * PRUNE_BATCH),)).fetchall(), most=excess)
            if not picked:
                return 0
            old = list(picked.items())
            floor = max(int(self.store.get_meta(NUM_FLOOR_KEY, 0) or 0), max(n for _, n in old))
            with self.store.tx() as tx:
                tx.executemany("DELETE FROM jobs WHERE id = ? AND ended IS NOT NULL", [(i,) for i, _ in old])
                tx.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET "
                           "value=excluded.value", (NUM_FLOOR_KEY, json.dumps(floor)))
        except Exception as e:  # sqlite3.Error, a store closing under us: the next call retries
            log.warning("jobs: pruning ended jobs' records failed: %s", e)
            return 0
        log.info("jobs: pruned the records of %d ended job(s) (oldest %s; keep_ended %d, keep_ended_s %g, "
                 "keep_ended_per_user %d)", len(old), old[0][0], keep_n, keep_s, keep_u)
        self._remove_files([i for i, _ in old])
        return len(old)

    def _remove_files(self, job_ids: builtins.list[str]) -> None:
        """Removes the logs and checkpoint directories of pruned jobs, in the job manager's one
        file-removal thread (the directories are their owners': an rmtree of 100,000 files must
        not hold the loop). A directory a job that has not ended resumes from is kept. Never
        follows a link (`remove_job_files`); at most REMOVE_QUEUE_MAX jobs wait, the rest keep
        their files (logged)."""
        if self.state_dir is None or not job_ids:
            return
        root = str(self.state_dir / "ckpt") + "/"
        keep = {os.path.normpath(r)[len(root):].split("/", 1)[0] for r in (j.spec.resume_from for j in self.jobs.values())
                if isinstance(r, str) and os.path.normpath(r).startswith(root)}
        ids = [i for i in job_ids if i not in keep]
        with self._removing_lock:
            room = REMOVE_QUEUE_MAX - self._removing
            if len(ids) > room:
                log.warning("jobs: %d pruned jobs' files left in place (%d removals already waiting)",
                            len(ids) - max(room, 0), self._removing)
                ids = ids[:max(room, 0)]
            self._removing += len(ids)
        if not ids:
            return
        if self._remover is None:
            # a daemon thread of its own (not an executor's, which the interpreter joins at exit:
            # an rmtree stuck on its owner's hung mount would hold the agent's stop)
            import queue

            self._remover = queue.SimpleQueue()
            threading.Thread(target=self._removal_thread, args=(self._remover, self.state_dir),
                             name="lm-jobs-remove", daemon=True).start()
        self._remover.put(ids)

    def _removal_thread(self, todo: Any, state_dir: Path) -> None:
        while True:
            ids = todo.get()
            for i in ids:
                try:
                    remove_job_files(state_dir, i)
                except Exception:  # never let one job's files end the thread
                    log.exception("jobs: removing the files of pruned %s failed", i)
                finally:
                    with self._removing_lock:
                        self._removing -= 1

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
        return self._from_row(row) if row else None

    def pruned(self, job_id: str) -> bool:
        """Whether `job_id` ("job-3" or "3") names a job this node gave and whose record was
        pruned (`prune_ended`): it has no record and its number is at or below the highest one
        pruned (numbers are given in order, never twice, and only ended jobs are pruned), so the
        job ended. False for a job with a record and for a number this node never gave. For
        whoever must tell "ended long ago" from "never heard of" once `get` says None: a buddy
        asking whether the guard of a job that ended is still needed (control op ``needs``)."""
        text = job_id[4:] if job_id.startswith("job-") else job_id
        if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < 1:
            return False
        try:
            floor = int(self.store.get_meta(NUM_FLOOR_KEY, 0) or 0)
        except Exception:  # a store closing under us: cannot tell
            return False
        return int(text) <= floor and self.get(job_id) is None

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
                    out[row["id"]] = self._from_row(row)
                    ended += 1
        return sorted(out.values(), key=lambda j: j.num)

    # -- where jobs came from (laminar.runtime.provenance): indexed columns, no spec decoded ------
    def find_origin(self, key: str) -> str | None:
        """The id of the first job (by number) that a move, a take-over or an archive claim of
        the migration key ``key`` started here, in any state but failed; None when there is none."""
        row = self.store.db.execute("SELECT id FROM jobs WHERE origin_key=? AND state != 'failed' ORDER BY num "
                                    "LIMIT 1", (key,)).fetchone()
        return None if row is None else str(row[0])

    def find_placement(self, placement_id: int) -> str | None:
        """The id of the job placement ``placement_id`` started here (in any state), or None."""
        if isinstance(placement_id, bool) or not isinstance(placement_id, int) or not 0 < placement_id < 1 << 63:
            return None
        row = self.store.db.execute("SELECT id FROM jobs WHERE placement_id=? ORDER BY num LIMIT 1",
                                    (placement_id,)).fetchone()
        return None if row is None else str(row[0])

    def ended_origins(self, states: tuple[str, ...]) -> dict[str, set[str]]:
        """Migration key -> ids of the jobs in ``states`` that resumed it here."""
        marks = ", ".join("?" * len(states))
        out: dict[str, set[str]] = {}
        for key, jid in self.store.db.execute(f"SELECT origin_key, id FROM jobs WHERE origin_key IS NOT NULL "
                                              f"AND state IN ({marks})", states):
            out.setdefault(str(key), set()).add(str(jid))
        return out

    def resume_users(self, states: tuple[str, ...], requeued_since: float) -> builtins.list[tuple[str, str]]:
        """(job id, the resume_from the agent gave it) of the jobs in ``states``, and of those
        requeued with no end recorded or ended after ``requeued_since``; never a resume_from
        its user set (laminar.runtime.provenance)."""
        marks = ", ".join("?" * len(states))
        rows = self.store.db.execute(  # (no ORDER BY: sorting by num made SQLite scan the table by num)
            f"SELECT id, resume_given, num FROM jobs WHERE resume_given IS NOT NULL AND (state IN ({marks}) OR "
            "(state = 'requeued' AND (ended IS NULL OR ended > ?)))", (*states, requeued_since)).fetchall()
        return [(str(r[0]), str(r[1])) for r in sorted(rows, key=lambda r: int(r[2]))]

    def backfill_origin(self, job_id: str, **fields: Any) -> bool:
        """At an upgrade: sets the origin columns named in ``fields`` (JobOrigin's) of job
        ``job_id`` that are still empty, from a table the agent wrote (zone_placed,
        migrate_replicas), never from the job's env; True when one was set."""
        cur = self.get(job_id)
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
        with self.store.tx() as db:
            db.execute(f"UPDATE jobs SET {', '.join(f'{c}=?' for c in provenance.COLUMNS)} WHERE id=?",
                       (*new.row(), job_id))
        if job_id in self.jobs:
            self.jobs[job_id].origin = new
        return True

    def _clean_stored_env(self) -> None:
        """Once, when the origin columns are added (an upgrade): the stored specs of the jobs that
        have not ended lose what their env may no longer hold (laminar.runtime.provenance
        .from_store): they are moved, requeued and started from those specs, and a peer now
        refuses the names. The user knobs become their spec fields."""
        rows = self.store.db.execute("SELECT id, spec FROM jobs WHERE ended IS NULL").fetchall()
        for jid, text in rows:
            try:
                spec_d = json.loads(text)
            except ValueError:
                continue
            clean = provenance.from_store(spec_d, where=f"job {jid}'s stored spec")
            if clean is not spec_d:
                with self.store.tx() as db:
                    db.execute("UPDATE jobs SET spec=? WHERE id=?", (json.dumps(clean), jid))
    def page(self, before: int | None = None, limit: int = LIST_PAGE_DEFAULT, all_jobs: bool = True,
             max_bytes: int = LIST_PAGE_BYTES) -> builtins.list[Job]:
        """One page of GET /v1/jobs (see LIST_PAGE_DEFAULT): the jobs numbered below `before`
        (any: None), newest first, at most `limit` and no more than `max_bytes` of spec text (at
        least one), oldest first; only those that have not ended unless `all_jobs`. A job in
        memory is listed as it is there (its state is newer than its row); only the rows of the
        page are decoded."""
        top = ((1 << 63) - 1) if before is None else before
        out: builtins.list[Job] = []
        size = 0
        if not all_jobs:
            import heapq

            for j in heapq.nlargest(limit, (j for j in self.jobs.values() if j.num < top), key=lambda j: j.num):
                if out and size + j.spec_bytes > max_bytes:
                    break
                out.append(j)
                size += j.spec_bytes
            return out[::-1]
        want: builtins.list[str] = []
        for row in self.store.db.execute("SELECT id, length(spec) AS n FROM jobs WHERE num < ? ORDER BY num DESC "
                                         "LIMIT ?", (top, limit)):
            if want and size + int(row["n"]) > max_bytes:
                break
            want.append(row["id"])
            size += int(row["n"])
        stored = [i for i in want if i not in self.jobs]
        rows = {}
        if stored:
            marks = ",".join("?" * len(stored))
            rows = {r["id"]: r for r in self.store.db.execute(f"SELECT * FROM jobs WHERE id IN ({marks})", stored)}
        for i in want:
            if i in self.jobs:
                out.append(self.jobs[i])
            elif i in rows:
                out.append(self._from_row(rows[i]))
        return sorted(out, key=lambda j: j.num)

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
        self._persist_many(changed)

    def limits(self) -> admission.Limits | None:
        """The caps in force; None while an agent's Airlock has not said (queue held)."""
        if self._limits_fn is not None:
            return self._limits_fn()
        return None if self.agent is not None else admission.NO_LIMITS

    def charged_mb(self, limits: admission.Limits) -> dict[str, int]:
        """Per class: the sum of its member jobs' charges (every started job whose cgroup is
        not gone yet, also while it is being stopped or reclaimed)."""
        out: dict[str, int] = {}
        for j in self.jobs.values():
            if j.state != QUEUED:
                c = j.spec.job_class
                out[c] = out.get(c, 0) + admission.charge_mb(j.spec.memory_mb, limits.cap(c))
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
        self._persist_many(changed)
        if error is not None:
            raise error

    # -- submit --------------------------------------------------------------------------------
    def check_grant(self, spec: JobSpec, uid: int, gid: int, pid: int,
                    groups: frozenset[int] | None = None) -> None:
        """Raise GrantError (403 in the API) when the caller (its SO_PEERCRED uid, gid and pid,
        and the supplementary ``groups`` it had at connect(), SO_PEERGROUPS: ``req.peer.groups``)
        may not submit `spec`'s Airlock class at its priority (config ``[grants]``). For every
        path by which a local user asks for a job (``POST /v1/jobs``, the zone's
        ``POST /v1/placements`` at the origin); not for a job arriving from another agent,
        which keeps the class its origin admitted. Without ``groups`` they are read from
        ``/proc/<pid>/status`` (a pid reused since connect() would lend its groups: callers
        with a socket pass them)."""
        grants = self.grants or Grants.from_config(None)
        gids = ({gid} | set(groups)) if groups is not None else caller_gids(gid, pid)
        why = grants.refusal(uid, gids if uid else {gid}, spec.job_class, spec.priority)
        if why is not None:
            raise GrantError(why)

    def check_user_resume(self, spec: JobSpec, uid: int) -> None:
        """A local user's own ``resume_from`` (``POST /v1/jobs``) is handed to the job, which
        reads it as its owner; the agent never opens it, nor counts it as one it gave (the
        archive and the replica GC read only those: laminar.runtime.provenance). For a user
        other than root, JobError when it lies in the agent's own trees, where only the agent
        gives a job a checkpoint (a replica or an archived copy, by a move or a take-over, to its
        owner): the state directory but the user's own jobs' checkpoint directories, and the
        archive. Decided from the path's text alone (nothing on the user's storage is read)."""
        rf = spec.resume_from
        if not rf or uid == 0 or self.state_dir is None:
            return
        if not rf.startswith("/"):
            raise ResumeFromError(f"resume_from {_brief(rf)}: expected an absolute path")
        p = Path(os.path.normpath(rf))
        state = Path(os.path.normpath(self.state_dir))
        try:
            archive = str((self.agent.config.section("migrate") or {}).get("archive_dir") or "")
        except (AttributeError, KeyError):
            archive = ""
        if archive and (p == Path(os.path.normpath(archive)) or Path(os.path.normpath(archive)) in p.parents):
            raise ResumeFromError(f"resume_from {_brief(rf)}: lies in the archive (migrate.archive_dir), whose copies the "
                           "agent gives to their owners itself when it resumes a job; name a checkpoint of your own")
        if p != state and state not in p.parents:
            return
        rel = p.relative_to(state).parts
        if len(rel) >= 2 and rel[0] == "ckpt" and re.fullmatch(r"job-[0-9]{1,18}", rel[1]):
            row = self.store.db.execute("SELECT owner_uid FROM jobs WHERE id=?", (rel[1],)).fetchone()
            if row is not None and int(row[0]) == uid:
                return  # a checkpoint of one of the user's own jobs here
            raise ResumeFromError(f"resume_from {_brief(rf)}: {rel[1]} is not a job of uid {uid}; a job may resume from "
                           f"the checkpoints of its owner's own jobs ({state}/ckpt/<your job>)")
        raise ResumeFromError(f"resume_from {_brief(rf)}: lies in the agent's state directory, where only the agent gives "
                       "a job a checkpoint (a replica, when it moves or takes over a job); name a checkpoint of your "
                       f"own (one of your jobs' own: {state}/ckpt/<job>/ckpt-<n>)")

    def live_count(self, uid: int) -> int:
        """The jobs of `uid` that have not ended here: queued, running, suspended, or being
        stopped (a stop still in its grace)."""
        return sum(1 for j in self.jobs.values() if j.owner_uid == uid)

    def check_quota(self, uid: int) -> None:
        """Raise QuotaError (429 in the API) when `uid` (not root) already has config
        ``jobs.max_per_user`` jobs that have not ended on this node (`live_count`). For every
        path by which a local user asks for a job here (``POST /v1/jobs``); not for a job
        arriving from another agent (a hand-over or a move adds no job to the user's total)."""
        limit = MAX_PER_USER if self.max_per_user is None else self.max_per_user
        if uid == 0 or limit <= 0:
            return
        have = self.live_count(uid)
        if have >= limit:
            raise QuotaError(f"too many jobs: uid {uid} has {have} jobs that have not ended on this node (queued, "
                             f"running, suspended or stopping); the limit is {limit} per user (config "
                             "jobs.max_per_user); stop some (`laminarctl job stop JOB`) or wait for them to end")

    async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0, *, quota: bool = False,
                     origin: JobOrigin = NO_ORIGIN) -> Job:
        """Submit `spec` as a job owned by (owner_uid, owner_gid) and start it if its class has
        room (`airlock.admission`); else it is returned in state ``queued`` (no pid, no cgroup
        yet, cgroup_id 0; its reason says what it waits for) and starts by itself once room
        frees. Raises AdmissionError when its memory limit exceeds its class's cap (it could
        never start), JobError for a bad request (cwd missing, GPUs unavailable, command not
        found) and CgroupError when the cgroups of a job starting now cannot be made; nothing
        is left behind on failure. A job given no memory limit gets its class's default
        (policy ``job_default_mb``) where one is set. With `quota` (a local user's submission)
        it raises QuotaError when the owner has ``jobs.max_per_user`` jobs not yet ended
        (`check_quota`), checked again with no await before the job is stored, so concurrent
        submissions cannot pass it together. `origin`: where the job came from, from the agent's
        own code only (a hand-over, a take-over; laminar.runtime.provenance), stored with it."""
        assert self.tree is not None and self.state_dir is not None and self.inventory is not None
        check_owner_ids(owner_uid, owner_gid)
        if quota:
            self.check_quota(owner_uid)
        spec.validate()
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
            self.check_quota(owner_uid)
        spec_text = json.dumps(spec.as_dict())
        with self.store.tx() as db:
            # past every number given: the highest row, and the highest ever pruned
            floor = int(self.store.get_meta(NUM_FLOOR_KEY, 0) or 0)
            num = max(int(db.execute("SELECT COALESCE(MAX(num), 0) FROM jobs").fetchone()[0]), floor) + 1
            job_id = f"job-{num}"
            created = time.time()
            db.execute(f"INSERT INTO jobs(id, num, spec, state, owner_uid, owner_gid, gpus, created, "
                       f"{', '.join(provenance.COLUMNS)}) VALUES(?, ?, ?, 'queued', ?, ?, '[]', ?"
                       f"{', ?' * len(provenance.COLUMNS)})",
                       (job_id, num, spec_text, owner_uid, owner_gid, created, *origin.row()))
        job = Job(id=job_id, num=num, spec=spec, cgroup=self.tree.job(spec.job_class, job_id), cgroup_id=0,
                  state=QUEUED, owner_uid=owner_uid, owner_gid=owner_gid, created=created, origin=origin,
                  spec_bytes=len(spec_text),
                  ckpt_dir=self.state_dir / "ckpt" / job_id, log_path=self.state_dir / "logs" / f"{job_id}.log")
        self.jobs[job_id] = job
        self.admit(submitted=job_id)  # raises what _start raised for this job (then failed, gone from memory)
        if job.state == QUEUED:
            if job.wait is None and self.held is None:  # the queue is held until Airlock says which caps hold
                job.reason = "waiting for the agent's admission (Airlock) to start"
                self._persist(job)
            self._emit("job", f"job {job_id} queued: {job.reason}", job=job_id, num=num, state=QUEUED, by_uid=owner_uid,
                       **{"class": spec.job_class}, priority=spec.priority, memory_mb=spec.memory_mb,
                       queue=job.queue_view())
        return job

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
            self._persist(job)
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
            proc = self._spawn(job, profile)
        except BaseException as e:
            try:
                cg.kill()
            except CgroupError:
                pass
            try:
                cg.remove()
            except CgroupError as ce:
                self._record_leak(job, str(ce))
            job.state, job.reason, job.ended, job.wait = "failed", f"start failed: {e}", time.time(), None
            job.end_cause = EndCause.START_FAILED
            self._persist(job)
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
        self._popen[job.id] = proc
        with self.store.tx() as db:
            db.execute("UPDATE jobs SET limits=? WHERE id=?", (json.dumps(job.limits), job.id))
        self._persist(job)
        if self.netguard is not None:
            try:
                self.netguard.register_job(job.cgroup_id, job.num, spec.lent)
            except Exception as e:  # the job runs; its traffic is just not identified
                log.warning("job %s: netguard.register_job failed: %s", job.id, e)
        self._watch(job)
        after = f" after {waited:.1f} s queued" if waited >= 0.5 else ""
        self._emit("job", f"job {job.id} started{after}: {' '.join(spec.command)[:200]}", job=job.id, num=job.num,
                   by_uid=job.owner_uid,
                   pid=proc.pid, cgroup_id=job.cgroup_id, **{"class": spec.job_class}, priority=spec.priority,
                   memory_mb=spec.memory_mb, gpus=job.gpus, queued_s=round(waited, 3))

    def _spawn(self, job: Job, profile: joblimits.Profile) -> subprocess.Popen[bytes]:
        spec = job.spec
        env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8")}
        if job.owner_uid:
            try:
                pw = pwd.getpwuid(job.owner_uid)
                env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
            except KeyError:
                pass
        env.update(spec.env)
        env.update(job.origin.env())  # for the job to read; the agent never reads a job's env back
        env.update(LAMINAR_JOB_ID=job.id, LAMINAR_JOB_NUM=str(job.num), LAMINAR_CKPT_DIR=str(job.ckpt_dir),
                   LAMINAR_CKPT_SIGNAL=spec.checkpoint_signal)
        if spec.resume_from:
            env["LAMINAR_RESUME_FROM"] = spec.resume_from
        if spec.elastic_min is not None and self.state_dir is not None:  # zone.loan writes it on a scale
            env["LAMINAR_WORKERS_FILE"] = str(self._workers_file(job.id))
        if self.inventory is not None:
            # exactly its own GPUs, by UUID in NVML's order; none ("") for a job without GPUs,
            # which would otherwise see every GPU of the node, those of other jobs too
            env.update(gpumod.cuda_env(self.inventory, job.gpus))
        files = [str(f) for f in job.cgroup.procs_files()]
        drop = drop_privileges_argv(job.owner_uid, job.owner_gid) if job.owner_uid else []
        # Another user's job enters its working directory in the trampoline, as the owner, not as
        # root: root may pass through directories the owner may not (a 0700 home), which would open
        # what lies below. Root's own job enters it at the spawn (a directory gone: the start fails).
        cwd = spec.cwd if not job.owner_uid else None
        # as root, after joining the cgroups: the owner's nice value, all its rlimits (nothing of the
        # agent's: LimitMEMLOCK=infinity, LimitNOFILE=65536, Nice=-10), then the drop
        argv = ["/bin/sh", "-c", ENTER_SH, "laminar-job", str(len(files)), *files,
                str(oom_score_adj_for(spec)), f"{profile.umask:04o}", *joblimits.launch_argv(profile), *drop,
                TRAMPOLINE_PYTHON, "-I", "-S", "-c", JOB_TRAMPOLINE,
                "", f"{job.owner_uid}:{job.owner_gid}" if drop else f"{os.getuid()}:{os.getgid()}",
                (spec.cwd or "") if job.owner_uid else "", *spec.command]
        env_fd = os.memfd_create("laminar-job-env", 0)  # inherited by the trampoline (pass_fds)
        try:
            os.write(env_fd, json.dumps(env).encode())
            os.lseek(env_fd, 0, os.SEEK_SET)
            argv[argv.index(JOB_TRAMPOLINE) + 1] = str(env_fd)
            assert job.log_path is not None
            with open(job.log_path, "ab", buffering=0) as logf:
                os.chmod(job.log_path, 0o600)  # what a job prints may be secret: not its group's to read
                if job.owner_uid:
                    os.chown(job.log_path, job.owner_uid, job.owner_gid)
                return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                        cwd=cwd or "/", env=ROOT_ENV, start_new_session=True, close_fds=True,
                                        pass_fds=(env_fd,))
        finally:
            os.close(env_fd)

    # -- watching ------------------------------------------------------------------------------
    def _watch(self, job: Job) -> None:
        assert self.loop is not None and job.pid is not None
        try:
            fd = os.pidfd_open(job.pid)
        except ProcessLookupError:
            self._spawn_task(self._on_exit(job.id))
            return
        except OSError as e:
            log.warning("job %s: pidfd_open failed (%s); watching cgroup.events instead", job.id, e)
            self._spawn_task(self._poll_populated(job.id))
            return
        self._pidfds[job.id] = fd
        self.loop.add_reader(fd, self._pidfd_ready, job.id)

    def _unwatch(self, job_id: str) -> None:
        fd = self._pidfds.pop(job_id, None)
        if fd is not None:
            if self.loop is not None:
                self.loop.remove_reader(fd)
            os.close(fd)

    def _pidfd_ready(self, job_id: str) -> None:
        self._unwatch(job_id)
        self._spawn_task(self._on_exit(job_id))

    def _spawn_task(self, coro: Any) -> None:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll_populated(self, job_id: str) -> None:
        # Until the cgroup empties, also while the job is being stopped: a stop records its state
        # first and then waits its grace, which ending the watch at once (teardown: kill) cut short.
        job = self.jobs.get(job_id)
        while job is not None and self.jobs.get(job_id) is job and job.cgroup.populated():
            await asyncio.sleep(ADOPT_POLL_S)
        await self._on_exit(job_id)

    async def _on_exit(self, job_id: str) -> None:
        """The main process is gone: record the exit code, kill leftovers, remove cgroups."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        self._unwatch(job_id)
        proc = self._popen.pop(job_id, None)
        # Never wait() here: in the event loop that would freeze the agent for as long as a main
        # process the stop's kill could not end lives on (see stop). When its pidfd fired it has
        # exited and poll() reaps it; otherwise its code is unknown.
        code = proc.poll() if proc is not None else None
        if job.active:
            job.state = "exited"
            job.end_cause = endcause.exited(code)
            job.reason = job.reason or (f"exit code {code}" if code is not None else "exited (adopted: exit code unknown)")
            if code == 126 and job.reason == "exit code 126":
                # The shell could not exec the command; with an empty log that is most often
                # ENOMEM at a full memory limit (exec's kernel charges are not held like faults).
                # A class with a cap admits only what fits (airlock.admission), so this is a
                # class without one, overcommitted up to Airlock's usage-based cap.
                job.reason += (" (the command could not be executed; see its log, and whether its class was at its "
                               "memory limit: give the class a cap, policy class_caps_mb, so jobs queue instead)")
        job.exit_code = code
        job.ended = time.time()
        await self._teardown(job)
        self._persist(job)
        self.jobs.pop(job_id, None)
        self._emit("job", f"job {job_id} {job.state}: {job.reason}", job=job_id, state=job.state, exit_code=code,
                   end_cause=None if job.end_cause is None else str(job.end_cause), by_uid=job.owner_uid,
                   work_lost_s=job.work_lost_s)
        ev = self._exit_waiters.pop(job_id, None)
        if ev is not None:
            ev.set()
        self.admit()  # its charge is gone with its cgroup: room for the queue
        self.prune_ended()

    def _workers_file(self, job_id: str) -> Path:
        """An elastic job's worker count (``LAMINAR_WORKERS_FILE``; zone.loan writes it)."""
        assert self.state_dir is not None
        return self.state_dir / "elastic" / f"{job_id}.json"

    async def _teardown(self, job: Job) -> None:
        """Kill what is left in the cgroup, wait for it to empty, remove it, unregister, and
        remove the job's workers file (and a temporary one a crash left) if it has one."""
        try:
            if job.cgroup.exists() and job.cgroup.populated():
                job.cgroup.kill()
                for _ in range(200):
                    if not job.cgroup.populated():
                        break
                    await asyncio.sleep(0.01)
        except CgroupError as e:
            log.warning("job %s: cgroup cleanup: %s", job.id, e)
        try:
            # rmdir of a busy directory is retried for ~1 s (cgroups._rmdir_retry): not on the loop
            await asyncio.to_thread(job.cgroup.remove)
        except CgroupError as e:
            log.warning("job %s: cgroup cleanup: %s", job.id, e)
            self._record_leak(job, str(e))
        if self.netguard is not None:
            try:
                self.netguard.unregister_job(job.cgroup_id)
            except Exception as e:
                log.debug("job %s: netguard.unregister_job: %s", job.id, e)
        if job.spec.elastic_min is not None and self.state_dir is not None:
            workers = self._workers_file(job.id)
            for f in (workers, workers.with_suffix(".tmp")):
                try:
                    f.unlink(missing_ok=True)
                except OSError as e:
                    log.warning("job %s: cannot remove %s: %s", job.id, f, e)

    async def wait(self, job_id: str, timeout: float | None = None) -> Job | None:
        """Wait until the job has ended (or `timeout`); returns its final record."""
        if job_id in self.jobs:
            ev = self._exit_waiters.setdefault(job_id, asyncio.Event())
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
        self._persist(job)

    def request_checkpoint(self, job: Job) -> bool:
        """Send the job its checkpoint signal (main process) if that process catches it
        (:func:`catches_signal`). False if it is gone or does not catch it: the default action
        of SIGUSR1 (and most signals) kills, so a job without a handler (not yet installed,
        or no checkpoint contract) is left running instead of killed."""
        return self.signal_main(job, job.spec.checkpoint_signal)

    def signal_main(self, job: Job, signame: str) -> bool:
        """Send ``signame`` to the job's main process if it catches it; True when sent. Through
        the pidfd the agent watches it by (a pid number may be another process's by then: a
        re-adopted job's main process is not the agent's child, so nothing holds its pid), else
        by number only to the agent's own child not reaped yet (its pid cannot be reused before
        the agent reaps it); never to a pid the agent holds no handle on."""
        pid, fd = job.pid, self._pidfds.get(job.id)
        if not pid or (fd is None and job.id not in self._popen) or not catches_signal(int(pid), signame):
            return False
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.Signals[signame])
            else:
                os.kill(int(pid), signal.Signals[signame])
            return True
        except (ProcessLookupError, KeyError):
            return False

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
            self._persist(job)
            self.jobs.pop(job.id, None)
            self._emit("job", f"job {job.id} {state} while queued: {reason}", job=job.id, state=state,
                       end_cause=str(cause), by_uid=job.owner_uid)
            ev = self._exit_waiters.pop(job.id, None)
            if ev is not None:
                ev.set()
            self.admit()  # the head of a queue may have left
            self.prune_ended()
            return job
        if not job.active or job.id not in self.jobs:
            raise JobError(f"job {job.id} is not running (state {job.state})")
        grace = self.stop_grace_s if grace_s is None else grace_s
        job.state = state
        job.reason = reason
        job.end_cause = cause
        job.work_lost_s = work_lost_s if work_lost_s is not None else job.work_at_risk_s()
        self._persist(job)
        self._emit("job", f"job {job.id} stopping: {reason}", job=job.id, grace_s=grace, end_cause=str(cause),
                   by_uid=job.owner_uid)
        ev = self._exit_waiters.setdefault(job.id, asyncio.Event())
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
            fd = self._pidfds.get(job.id)
            if fd is not None:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass
            await self._on_exit(job.id)
        return self.get(job.id) or job

    async def kill(self, job: Job, reason: str, work_lost_s: float | None = None) -> None:
        """Kill now: cgroup.kill with no grace (Airlock's last rung); work lost recorded."""
        await self.stop(job.id, reason, grace_s=0, state="killed", work_lost_s=work_lost_s,
                        cause=EndCause.AIRLOCK_KILL)

    # -- store -----------------------------------------------------------------------------------
    _PERSIST_SQL = ("UPDATE jobs SET state=?, pid=?, cgroup_id=?, ended=?, exit_code=?, reason=?, work_lost_s=?, "
                    "gpus=?, started=?, end_cause=? WHERE id=?")

    @staticmethod
    def _persist_row(job: Job) -> tuple[Any, ...]:
        return (job.state, job.pid, job.cgroup_id, job.ended, job.exit_code, job.reason, job.work_lost_s,
                json.dumps(job.gpus), job.started, None if job.end_cause is None else str(job.end_cause), job.id)

    def _persist(self, job: Job) -> None:
        with self.store.tx() as db:
            db.execute(self._PERSIST_SQL, self._persist_row(job))

    def _persist_many(self, jobs: builtins.list[Job]) -> None:
        """`_persist` for several jobs in one transaction (one commit, one fsync); none: nothing."""
        if not jobs:
            return
        with self.store.tx() as db:
            db.executemany(self._PERSIST_SQL, [self._persist_row(j) for j in jobs])

    def _from_row(self, row: Any) -> Job:
        spec_d = json.loads(row["spec"])
        spec_d["job_class"] = spec_d.pop("class")
        spec = JobSpec(**spec_d)
        assert self.tree is not None and self.state_dir is not None
        cg = self.tree.job(spec.job_class, row["id"])
        return Job(id=row["id"], num=row["num"], spec=spec, cgroup=cg, cgroup_id=row["cgroup_id"] or 0,
                   state=row["state"], pid=row["pid"], owner_uid=row["owner_uid"], owner_gid=row["owner_gid"],
                   gpus=json.loads(row["gpus"]), created=row["created"], ended=row["ended"],
                   exit_code=row["exit_code"], reason=row["reason"] or "", work_lost_s=row["work_lost_s"],
                   end_cause=endcause.parse(row["end_cause"]),
                   started=row["started"], limits=json.loads(row["limits"]) if row["limits"] else None,
                   origin=JobOrigin.from_row(row), spec_bytes=len(row["spec"]),
                   ckpt_dir=self.state_dir / "ckpt" / row["id"], log_path=self.state_dir / "logs" / f"{row['id']}.log")

    def _adopt_all(self) -> None:
        """Re-adopt stored active jobs whose cgroups still hold processes; mark the rest lost.
        Queued jobs stay queued, in their order (they start once Airlock gives the caps).
        A job the previous process had begun to stop (stopped, reclaimed, ... with no end
        recorded: it died inside the grace) has its stop finished: what is left of it is
        killed, its cgroups removed and its end recorded, keeping the state and reason."""
        rows = self.store.db.execute("SELECT * FROM jobs WHERE state IN ('queued', 'running', 'suspended', 'starting') "
                                     "OR ended IS NULL ORDER BY num").fetchall()
        for row in rows:
            job = self._from_row(row)
            if job.state not in (*LIVE_STATES, "starting"):
                # a stop in progress when the previous process died: finish it (_on_exit keeps
                # the state and reason the stop recorded, kills what is left, removes the cgroups)
                self.jobs[job.id] = job
                self._emit("job", f"job {job.id} was being stopped ({job.state}) when the agent went down; "
                           "finishing the stop", job=job.id, state=job.state)
                self._spawn_task(self._on_exit(job.id))
                continue
            if job.state == QUEUED:
                self.jobs[job.id] = job
                self._emit("job", f"job {job.id} still queued after the restart: {job.reason}", job=job.id,
                           state=QUEUED)
                continue
            if job.state != "starting" and job.cgroup.exists() and job.cgroup.populated():
                job.adopted = True
                # The frozen flag in the kernel is the truth about suspension.
                try:
                    job.state = "suspended" if job.cgroup.frozen() else "running"
                except CgroupError:
                    pass
                self.jobs[job.id] = job
                if self.netguard is not None:
                    try:
                        self.netguard.register_job(job.cgroup_id, job.num, job.spec.lent)
                    except Exception as e:
                        log.warning("job %s: netguard.register_job failed: %s", job.id, e)
                if job.pid is not None and job.pid in job.cgroup.pids():
                    self._watch(job)  # its pidfd pins the process: what is signalled is the job's
                else:
                    # its main process is gone (init reaped it) and its pid is free for any process:
                    # signalled by number, root's checkpoint requests would reach whatever took it
                    job.pid = None
                    self._spawn_task(self._poll_populated(job.id))
                self._persist(job)
                self._emit("job", f"job {job.id} re-adopted ({job.state}, pid {job.pid})", job=job.id,
                           pid=job.pid, cgroup_id=job.cgroup_id)
            else:
                gone = not job.cgroup.exists()
                job.state = "lost" if job.state != "starting" else "failed"
                job.reason = ("agent stopped while the job was starting" if job.state != "lost" else
                              LOST_WITH_CGROUP if gone else endcause.ENDED_WHILE_DOWN_TEXT)
                job.end_cause = (EndCause.START_FAILED if job.state != "lost" else
                                 EndCause.LOST_WITH_CGROUP if gone else EndCause.ENDED_WHILE_DOWN)
                job.ended = time.time()
                try:
                    if job.cgroup.exists():
                        if job.cgroup.populated():
                            job.cgroup.kill()
                        job.cgroup.remove()
                except CgroupError as e:
                    log.warning("job %s: cleanup: %s", job.id, e)
                    self._record_leak(job, str(e))
                self._persist(job)
                self._emit("job", f"job {job.id} {job.state}: {job.reason}", job=job.id, state=job.state,
                           end_cause=str(job.end_cause))

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

    # -- API -------------------------------------------------------------------------------------
    def routes(self) -> builtins.list[Any]:
        from ..api import ApiError, RawJson, Request, Route, to_json

        def may_manage(req: Request, job: Job) -> bool:
            if req.peer.uid == 0 or req.peer.uid == job.owner_uid:
                return True
            auth = getattr(getattr(self.agent, "api", None), "auth", None)
            return bool(auth and auth.allowed(req.peer))

        def may_read_secrets(req: Request, job: Job) -> bool:
            """A job's env values: its owner and root only (not the control group)."""
            return req.peer.uid == 0 or req.peer.uid == job.owner_uid

        def find(req: Request) -> Job:
            job = self.get(req.params["id"])
            if job is None:
                raise ApiError(404, f"no job {req.params['id']!r} (see `laminarctl jobs`)")
            return job

        async def submit(req: Request) -> dict[str, Any]:
            try:
                spec = JobSpec.from_dict(req.body)
                self.check_grant(spec, req.peer.uid, req.peer.gid, req.peer.pid, req.peer.groups)
                self.check_user_resume(spec, req.peer.uid)
                job = await self.submit(spec, owner_uid=req.peer.uid, owner_gid=req.peer.gid, quota=True)
            except GrantError as e:
                raise ApiError(403, str(e), "beyond_grant") from None
            except QuotaError as e:
                raise ApiError(429, str(e), e.reason or "max_per_user") from None
            except JobError as e:
                self.count_refusal("submit", e)
                raise ApiError(400, str(e), e.reason or "job_invalid") from None
            except CgroupError as e:
                hint = ""
                if "Cannot allocate memory" in str(e):  # a memcg's own kernel memory is charged to its parent
                    hint = (f"; the {req.body.get('class', 'standard') if isinstance(req.body, dict) else ''} class is "
                            "at its memory limit (see `laminarctl events --kind airlock`); retry once Airlock has "
                            "relieved the pressure")
                raise ApiError(503, f"cannot create the job's cgroups: {e}{hint}") from None
            return job.as_dict()

        def with_rung(req: Request, job: Job) -> dict[str, Any]:
            """The job's record as the caller may see it, plus Airlock's rung for it
            (suspend/readdress/reclaim, for how long, hops), or None while Airlock leaves it alone,
            and its holds: the reasons it is held frozen (airlock, move, fence; runtime/holds.py)."""
            out = job.as_dict(reveal=may_read_secrets(req, job))
            rungs = getattr(getattr(self.agent, "airlock", None), "rungs", None)
            if isinstance(rungs, dict):
                r = rungs.get(job.id)
                out["airlock"] = {"rung": r[0], "for_s": round(time.monotonic() - r[1], 2), "hops": r[2]} if r else None
            out["holds"] = self.holds.reasons(job.id)  # who holds it frozen (runtime/holds.py)
            return out

        async def list_jobs(req: Request) -> RawJson:
            everything = req.query.get("all", "1") not in ("0", "false", "no")
            text = req.query.get("limit", str(LIST_PAGE_DEFAULT))
            if not (text.isascii() and text.isdigit() and len(text) <= 7 and 1 <= int(text) <= LIST_PAGE_MAX):
                raise ApiError(400, f"limit {text[:40]!r}: expected how many jobs a page lists, 1 to {LIST_PAGE_MAX} "
                                    "(the next page: ?before=<the lowest job number of this one>)", "page_too_large")
            before = req.query.get("before")
            if before is not None and not (before.isascii() and before.isdigit() and len(before) <= 18):
                raise ApiError(400, f"before {before[:40]!r}: expected a job number (the lowest of the last page)")
            page = self.page(None if before is None else int(before), int(text), everything)
            # encoded a slice at a time, a loop round between slices: eight users' pages of 1 MiB
            # each encoded in one round held root's status 0.19 s
            parts: builtins.list[str] = []
            done = 0
            for j in page:
                if done >= LIST_SLICE_BYTES:
                    await asyncio.sleep(0)
                    done = 0
                parts.append(to_json(with_rung(req, j)))
                done += j.spec_bytes + 1024
            return RawJson(("[" + ",".join(parts) + "]").encode())

        async def show(req: Request) -> dict[str, Any]:
            return with_rung(req, find(req))

        async def stop(req: Request) -> dict[str, Any]:
            job = find(req)
            if not may_manage(req, job):
                raise ApiError(403, f"permission denied: job {job.id} belongs to uid {job.owner_uid}; stopping "
                                    f"another user's job needs root or the control group (caller uid {req.peer.uid})")
            body = req.body if isinstance(req.body, dict) else {}
            given = body.get("reason")
            if given is not None and (not isinstance(given, str) or len(given) > REASON_MAX):
                raise ApiError(400, f"reason {_brief(given)}: expected text of at most {REASON_MAX} characters "
                                    "(it is kept with the job and in its events)")
            reason = given or f"stopped by uid {req.peer.uid}"
            try:
                grace = parse_grace_s(body.get("grace_s"))
            except JobError as e:
                raise ApiError(400, str(e)) from None
            try:
                final = await self.stop(job.id, reason, grace_s=grace,
                                        cause=endcause.stopped_by(req.peer.uid, job.owner_uid))
                return final.as_dict(reveal=may_read_secrets(req, final)) if final else {}
            except JobError as e:
                raise ApiError(409, str(e)) from None

        return [
            Route("POST", "/v1/jobs", submit, privileged=False),
            Route("GET", "/v1/jobs", list_jobs),
            Route("GET", "/v1/jobs/{id}", show),
            Route("POST", "/v1/jobs/{id}/stop", stop, privileged=False),
        ]
