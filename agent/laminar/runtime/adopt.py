"""Adopted jobs: a process tree a scheduler started (a Slurm task, a Kubernetes pod), taken as a
Laminar job without launching it (docs/operations.md, *Adopted jobs*).

The scheduler's side asks (``POST /v1/jobs/adopt``: the SPANK plugin for a Slurm task, the
Kubernetes backend for a pod) with an :class:`AdoptRequest` (:func:`parse_adopt` refuses every
bad field naming the value). :class:`Adoption`, the job manager's part (``jobs.adoption``),
checks it and takes the job:

* **the cgroup**, in one of two modes the agent chooses, never the caller:

  - *moved*: the task's cgroup is not under one of ``[adopt] inplace_roots`` (Slurm with
    ``ProctrackType=proctrack/linuxproc``): the agent creates the job's own cgroup
    (``<[cgroups] root>/<class>/job-N``, as for a launched job) and moves the pid into it
    (``cgroup.procs``); it removes that cgroup when the job ends;
  - *in place*: the cgroup is under one of ``[adopt] inplace_roots`` (a pod's cgroup; a
    Slurm step's with ``proctrack/cgroup``): the job's cgroup *is* that cgroup
    (:class:`FixedCgroup`, never created nor removed by the agent). Its processes may live in
    child cgroups (a pod's containers): netguard sees every child's id as the job;

* no limits (pids, memory, cpu) are written: the scheduler sets them (``job.limits`` says so);
* **its GPUs** are what the scheduler gave it, as the scheduler itself says, never what a task
  says: for a Slurm task (asked by its user, not root) whose request names GPUs, or on a node with
  ``[gpus] owner = "scheduler"``, the agent asks slurmctld (``scontrol show job -d``, off the loop,
  bounded: :meth:`Adoption.scheduler_gpus`) and records the GPUs Slurm gave the job on this node.
  A request naming a GPU the job does not hold here is refused, naming both lists; with
  ``[slurm] enabled = false`` (no way to ask) a user's request naming GPUs is refused, naming the
  setting. The task's ``SLURM_STEP_GPUS`` is its environment, which its user sets at will: trusted,
  a user's job could hold another's GPUs in the agent's books (and have that user's real gres
  task refused). Root's requests (the Kubernetes backend, an operator) are trusted as they are;
* its checkpoint directory is ``[adopt] ckpt_root`` / :func:`laminar.policy.sched.ckpt_dir_name`
  (shared storage in a real site: a requeued job finds it on any node), made 0700 for the job's
  user; its newest checkpoint that verifies as that user is the ``LAMINAR_RESUME_FROM`` of the
  answer (:meth:`Adoption.env`);
* it ends when its processes are gone (moved: the task's pidfd, then the cgroup empty; in
  place: ``populated 0``): state ``exited``, reason ``ended by slurm`` (or kubernetes), the
  exit code when the scheduler's side tells it (``POST /v1/jobs/{id}/exit``).

Airlock, netguard's counters, the kill-switch and the checkpoint signal then work on it as on a
launched job (they work off ``jobs.active()``, ``job.cgroup`` and ``job.cgroup_id``); the
checkpoint signal goes to every process of its cgroup that catches it (a task's main process is
often a shell). One job per (scheduler, ref) on a node: a second task of a Slurm job is moved
into the same job's cgroup, and the answer is the same job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pwd
import re
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..airlock.cgroups import CgroupError, Hierarchy, JobCgroup
from ..config import Field, register_section
from ..policy.sched import Scheduler, check_ref, ckpt_dir_name, parse_scheduler
from . import gpus as gpumod
from .ckpt_scan import scan_dir
from .grants import GrantError, Grants
from .provenance import JobOrigin
from .record import Job
from .spec import PRIORITY_MAX, JobError, JobSpec, _brief, parse_signal

if TYPE_CHECKING:
    from .jobs import JobManager

log = logging.getLogger("laminar.jobs")

INPLACE_ROOTS = ["kubepods.slice", "kubepods", "system.slice/slurmstepd.scope"]
CKPT_ROOT = "/var/lib/laminar/adopted"
NAME_MAX = 63  # a job's name (as JobSpec's)
# A pod's containers are child cgroups of its cgroup, one or two levels down: netguard is told
# of at most this many, found by a walk this deep (the pod's owner makes them: bounded).
CHILDREN_MAX = 64
CHILDREN_DEPTH = 3
# How long the newest verified checkpoint is looked for (a listing and up to RESUME_TRIES checks
# as the job's user, off the loop): past it the job starts without LAMINAR_RESUME_FROM.
RESUME_TIMEOUT_S = 20.0
RESUME_TRIES = 3
# How often an adopted job's cgroup is looked at for its end and for new child cgroups.
WATCH_S = 0.5
# What asking slurmctld for a task's GPUs may take at most (within [slurm] timeout_s): the SPANK
# plugin waits 10 s for the agent's whole answer, then fails the task; an answer after that
# would adopt a job whose task is gone.
SLURM_GPUS_TIMEOUT_S = 5.0


def _roots(v: Any) -> str | None:
    if not isinstance(v, list) or len(v) > 32:
        return "expected a list of at most 32 cgroup paths relative to the cgroup2 mount"
    for r in v:
        if (not isinstance(r, str) or not r or r.startswith("/") or len(r) > 1024
                or any(p in ("", ".", "..") for p in r.split("/"))):
            return f"{str(r)[:80]!r}: expected a cgroup path relative to the cgroup2 mount (no '..', no leading '/')"
    return None


CONFIG_FIELDS = {
    "ckpt_root": Field(str, CKPT_ROOT, "where adopted jobs' checkpoint directories are made (one per scheduler job: "
                       "slurm-<id>, kubernetes-<ns>_<pod>); shared storage, so a requeued job finds its checkpoints "
                       "on any node", lambda v: None if v.startswith("/") else "must be an absolute path"),
    "inplace_roots": Field(list, INPLACE_ROOTS, "cgroups (relative to the cgroup2 mount) under which an adopted "
                           "job's cgroup is taken in place (the scheduler's, never created or removed by the agent); "
                           "any other is moved into a cgroup of the agent's", _roots),
}
register_section("adopt", CONFIG_FIELDS)

BODY_FIELDS = ("scheduler", "ref", "pid", "cgroup", "uid", "gid", "class", "priority", "checkpoint", "gpus", "name")


class AdoptRefused(JobError):
    """An adoption the caller may not ask (403 in the API): another uid, beyond the grant."""


@dataclass(frozen=True)
class AdoptRequest:
    """What the scheduler's side asks (``POST /v1/jobs/adopt``; :func:`parse_adopt`)."""

    scheduler: Scheduler
    ref: str
    uid: int  # the job's user (only a root caller may name another uid than its own)
    gid: int
    job_class: str
    priority: int
    checkpoint: str  # the signal the job catches for a checkpoint ("SIGUSR1") or "none"
    gpus: tuple[int, ...]  # what the scheduler assigned (indices; checked against the inventory)
    pid: int | None  # slurm: the task's pid
    cgroup: str | None  # the pod's cgroup, relative to the cgroup2 mount (taken in place)
    name: str | None
    caller_uid: int = 0  # who asked (SO_PEERCRED): a user's pid must be a task of the Slurm job it names


def _int(body: dict[str, Any], key: str, lo: int, hi: int, what: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise JobError(f"{key} {_brief(v)}: expected {what}, {lo} to {hi}", reason="adopt_invalid")
    return v


def parse_adopt(body: Any, caller_uid: int, *, target: bool = True) -> AdoptRequest:
    """The request in ``body`` (a JSON object: :data:`BODY_FIELDS`), asked by ``caller_uid``
    (SO_PEERCRED). JobError naming the value and what is right for a malformed field (400);
    :class:`AdoptRefused` when a caller other than root names another uid (403). With
    ``target`` (``/adopt``, not ``/adopt/check``) exactly one of ``pid`` and ``cgroup`` is
    required (a Kubernetes job by its ``cgroup``), else both are ignored and ``ref`` may be left
    out (srun asks before Slurm gives the job an id; it is "" then). Pure but for the
    user's primary gid, read from the passwd database when ``gid`` is not given."""
    if not isinstance(body, dict):
        raise JobError(f"adopt request {_brief(body)}: expected a JSON object", reason="adopt_invalid")
    extra = sorted(str(k)[:40] for k in body if k not in BODY_FIELDS)
    if extra:
        raise JobError(f"adopt request: unknown field(s) {', '.join(map(repr, extra[:8]))}; expected "
                       f"{', '.join(BODY_FIELDS)}", reason="adopt_invalid")
    try:
        sched = parse_scheduler(body.get("scheduler"))
        # /adopt/check is asked at srun/sbatch, before Slurm has given the job an id: no ref then
        ref = check_ref(sched, body.get("ref")) if target or body.get("ref") is not None else ""
    except ValueError as e:
        raise JobError(str(e), reason="adopt_invalid") from None
    pid = _int(body, "pid", 2, (1 << 22), "the task's process id") if target else None
    cgroup = body.get("cgroup") if target else None
    if target:
        if (pid is None) == (cgroup is None):
            raise JobError(f"adopt request: pid {_brief(pid)} and cgroup {_brief(cgroup)}: expected exactly one (a "
                           "Slurm task by its pid, a pod by its cgroup)", reason="adopt_invalid")
        if cgroup is not None and (not isinstance(cgroup, str) or not cgroup.strip("/") or len(cgroup) > 4096
                                   or "\0" in cgroup or any(p in (".", "..") for p in cgroup.strip("/").split("/"))):
            raise JobError(f"cgroup {_brief(cgroup)}: expected a cgroup path relative to the cgroup2 mount "
                           "(e.g. kubepods.slice/kubepods-pod1234.slice), no '..'", reason="adopt_invalid")
        if sched is Scheduler.SLURM and pid is None:
            raise JobError(f"slurm ref {ref}: expected the task's pid (a Slurm task is adopted by its pid)",
                           reason="adopt_invalid")
    uid = _int(body, "uid", 0, (1 << 32) - 2, "the job's user id")
    uid = caller_uid if uid is None else uid
    if caller_uid != 0 and uid != caller_uid:
        raise AdoptRefused(f"permission denied: uid {uid}: only root may adopt a job for another user (caller uid "
                           f"{caller_uid})", reason="adopt_other_uid")
    gid = _int(body, "gid", 0, (1 << 32) - 2, "the job's group id")
    if gid is None:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            raise JobError(f"gid: not given, and uid {uid} has no passwd entry to take its group from; give gid",
                           reason="adopt_invalid") from None
    elif caller_uid != 0 and gid not in _user_gids(uid, gid):
        raise AdoptRefused(f"permission denied: gid {gid} is not a group of uid {uid}", reason="adopt_other_uid")
    job_class = body.get("class", "standard")
    if not isinstance(job_class, str) or not job_class or len(job_class) > 64:
        raise JobError(f"class {_brief(job_class)}: expected an Airlock class name (long-resident, standard, "
                       "transient)", reason="adopt_invalid")
    priority = _int(body, "priority", 0, PRIORITY_MAX, "a priority")
    ck = body.get("checkpoint", "SIGUSR1")
    if isinstance(ck, str) and ck.lower() == "none":
        checkpoint = "none"
    else:
        checkpoint = parse_signal(ck)  # JobError naming it
    gpus = body.get("gpus", [])
    if (not isinstance(gpus, list) or len(gpus) > gpumod.GPUS_MAX or len(set(map(repr, gpus))) != len(gpus)
            or any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < gpumod.GPUS_MAX for g in gpus)):
        raise JobError(f"gpus {_brief(gpus)}: expected the GPU indices the scheduler assigned, each once, 0 to "
                       f"{gpumod.GPUS_MAX - 1} (e.g. [0, 1])", reason="adopt_invalid")
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > NAME_MAX
                             or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in name)):
        raise JobError(f"name {_brief(name)}: expected 0-{NAME_MAX} letters, digits, '-', '_' or '.'",
                       reason="adopt_invalid")
    return AdoptRequest(scheduler=sched, ref=ref, uid=uid, gid=gid, job_class=job_class,
                        priority=50 if priority is None else priority, checkpoint=checkpoint, gpus=tuple(gpus),
                        pid=pid, cgroup=None if cgroup is None else cgroup.strip("/"), name=name,
                        caller_uid=caller_uid)


def _user_gids(uid: int, gid: int) -> set[int]:
    """The user's primary gid ``gid`` and every group the group database gives it."""
    out = {gid}
    try:
        out.update(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):
        pass
    return out


class FixedCgroup(JobCgroup):
    """An adopted job's cgroup taken in place: the scheduler's, at a fixed path (``rel``,
    relative to the cgroup2 mount). :meth:`create` only checks that it is there and
    :meth:`remove` never removes it: the agent never removes a cgroup it did not create."""

    def __init__(self, hierarchy: Hierarchy, rel: str, job_class: str, job_id: str) -> None:  # noqa: D107
        self.hierarchy = hierarchy
        self.root_name = ""
        self.job_class = job_class
        self.job_id = job_id
        self.rel = rel
        self.unified = hierarchy.unified / rel
        # the v1 directories of the same path, where the scheduler made them (memory on a hybrid host)
        self.v1 = {ctrl: mnt / rel for ctrl, mnt in hierarchy.v1.items() if (mnt / rel).is_dir()}

    def __repr__(self) -> str:
        return f"FixedCgroup({self.unified})"

    @property
    def memory_dir(self) -> Path:
        return self.v1.get("memory", self.unified) if not self.hierarchy.memory_in_v2 else self.unified

    def memory_in_use(self) -> int:
        """As a job's; 0 when the scheduler's cgroup has no memory controller here (a hybrid
        host whose v1 memory hierarchy lacks it): Airlock still sees the job, to hold and release."""
        try:
            return super().memory_in_use()
        except CgroupError:
            if self.hierarchy.memory_in_v2 or "memory" in self.v1:
                raise
            return 0

    def memory_usage(self) -> int:
        try:
            return super().memory_usage()
        except CgroupError:
            if self.hierarchy.memory_in_v2 or "memory" in self.v1:
                raise
            return 0

    def create(self) -> None:
        if not self.unified.is_dir():
            raise CgroupError(f"cgroup {self.unified}: not there (an adopted job's cgroup is the scheduler's)")

    def remove(self) -> None:
        """Never: the scheduler made it, the scheduler removes it."""

    def children(self, limit: int = CHILDREN_MAX, depth: int = CHILDREN_DEPTH) -> list[Path]:
        """Its child cgroups (a pod's containers), at most ``limit``, at most ``depth`` down; no link followed."""
        out: list[Path] = []
        level = [self.unified]
        for _ in range(depth):
            nxt: list[Path] = []
            for d in level:
                try:
                    with os.scandir(d) as it:
                        for e in it:
                            if e.is_dir(follow_symlinks=False):
                                nxt.append(Path(e.path))
                                if len(out) + len(nxt) >= limit:
                                    return out + nxt
                except OSError:
                    continue
            out += nxt
            level = nxt
        return out


def pid_cgroup(pid: int) -> str | None:
    """The cgroup2 path of process ``pid`` relative to the mount (``/proc/<pid>/cgroup``'s
    ``0::`` line), None when it is gone or has none."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()[:65536]
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip("/")
    return None


def pid_uid(pid: int) -> int | None:
    """The real uid of process ``pid`` (``/proc/<pid>/status``), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _still(fd: int | None, pid: int) -> None:
    """JobError unless the process pinned by pidfd ``fd`` still lives, so that the number ``pid``
    written into a cgroup.procs next is still it (not a process that took the number since)."""
    try:
        if fd is None:
            raise ProcessLookupError
        signal.pidfd_send_signal(fd, 0)
    except OSError:
        raise JobError(f"pid {pid}: the process ended before it could be adopted", reason="adopt_pid") from None


# The process title slurmstepd gives itself: "slurmstepd: [1234.0]", "[1234.batch]", "[1234.extern]".
_STEPD_RE = re.compile(r"slurmstepd: \[([0-9]{1,10})\.[A-Za-z0-9_]{1,16}\]")


def slurm_job_of(pid: int) -> str | None:
    """The Slurm job id of the task ``pid``: its parent is a root-owned ``slurmstepd`` whose
    title names the job (slurmstepd forks every task, the batch script's too). None otherwise.
    Read from the kernel (the parent's uid, its title), nothing the task's user can set: a user
    must not claim another user's coming Slurm job id for a process of their own (its tasks would
    then be refused here), nor move a process that is no Slurm task out of their own cgroup."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()[:8192]
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    except (OSError, ValueError, StopIteration, IndexError):
        return None
    if ppid <= 1 or pid_uid(ppid) != 0:
        return None
    m = _STEPD_RE.match(" ".join(_cmdline(ppid))[:256])
    return m.group(1) if m else None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:4096]
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a][:64]


class Adoption:
    """The job manager's part that adopts jobs (the module docs). ``jm``: its job manager."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm
        # config [adopt] (set from the agent's at the job manager's start; tests set them)
        self.ckpt_root = Path(CKPT_ROOT)
        self.inplace_roots: tuple[str, ...] = tuple(INPLACE_ROOTS)
        # config [gpus] owner: "scheduler" -> the agent never hands out a GPU
        self.gpu_owner = "laminar"
        # config [slurm]: the scontrol client that asks slurmctld for a Slurm job's GPUs here (None:
        # [slurm] enabled = false) and this node's NodeName; or why there is none (a bad host name)
        self.slurm: Any = None
        self.slurm_node = ""
        self.slurm_broken: str | None = None
        self._asking: dict[str, asyncio.Task[tuple[int, ...]]] = {}  # Slurm job id -> its question in flight
        # the child cgroups of in-place jobs netguard was told of, by job id (their ids)
        self._children: dict[str, set[int]] = {}
        self.counts: dict[str, int] = {}
        self._collector: CheckpointCollector | None = None

    def configure(self, adopt: dict[str, Any] | None, gpus: dict[str, Any] | None,
                  slurm: dict[str, Any] | None = None) -> None:
        """From the config's ``[adopt]``, ``[gpus]`` and ``[slurm]`` sections (None: the defaults)."""
        if adopt:
            self.ckpt_root = Path(adopt.get("ckpt_root", CKPT_ROOT))
            self.inplace_roots = tuple(adopt.get("inplace_roots", INPLACE_ROOTS))
        if gpus:
            self.gpu_owner = str(gpus.get("owner", "laminar"))
        if slurm and slurm.get("enabled"):
            from ..sched.slurm import Slurm, SlurmError, this_node_name

            self.slurm = Slurm(str(slurm.get("scontrol", "scontrol")),
                               min(float(slurm.get("timeout_s", 10.0)), SLURM_GPUS_TIMEOUT_S))
            try:
                self.slurm_node = this_node_name(str(slurm.get("node_name", "")))
            except SlurmError as e:
                self.slurm_broken = str(e)

    def init_metrics(self) -> None:
        """The last-checkpoint gauges (:class:`CheckpointCollector`) in the manager's registry, once."""
        if self._collector is None and self.jm.metrics is not None:
            self._collector = CheckpointCollector(self.jm)
            self.jm.metrics.register(self._collector)

    # -- admission -------------------------------------------------------------------------
    @staticmethod
    def charge_mb(job: Job) -> int | None:
        """What adopted ``job`` counts against its class's cap (policy.admission.charge_mb): the
        memory limit its scheduler set on its cgroup (a pod's, a step's in place), else, having
        none (a task moved under Laminar's class parent), the memory it uses now, since no job
        of Laminar's admission limits it. None (the whole cap) when its cgroup cannot be read.
        Two small cgroup files per adopted job on each admission pass."""
        try:
            limit = job.cgroup.memory_limit()
            used = job.cgroup.memory_in_use() if limit is None else limit
        except (CgroupError, OSError, ValueError):
            return None
        return max(1, -(-used // (1 << 20)))

    # -- what GPUs the agent may hand out --------------------------------------------------
    def gpus_refusal(self, want: Any) -> str | None:
        """Why a job (a submit, a placement) asking for ``want`` GPUs is refused here, or None:
        with ``[gpus] owner = "scheduler"`` Laminar never allocates a GPU."""
        if self.gpu_owner == "scheduler" and want:
            return (f"gpus {_brief(want)}: this node's GPUs are assigned by its scheduler ([gpus] owner = "
                    "\"scheduler\"), never by Laminar; ask the scheduler for them (srun --gres=gpu:N, a pod's "
                    "nvidia.com/gpu limit) and the job is adopted with them")
        return None

    # -- the look-ups --------------------------------------------------------------------------
    def find(self, scheduler: Scheduler | str, ref: str) -> list[Job]:
        """The live jobs adopted here from ``scheduler``'s job ``ref`` (at most one)."""
        sched = parse_scheduler(scheduler)
        return [j for j in self.jm.jobs.values()
                if j.live and j.origin.scheduler is sched and j.origin.scheduler_ref == ref]

    # -- the checks ------------------------------------------------------------------------
    def check(self, req: AdoptRequest) -> None:
        """What ``/adopt/check`` answers and ``/adopt`` checks first: the class is known, the
        class and priority within the job's user's grant (``[grants]``, as submit; root's
        jobs any), the GPUs within the inventory and not held by another live job. JobError
        (GrantError for the grant) naming the value."""
        tree = self.jm.tree
        if tree is not None and req.job_class not in tree.classes:
            raise JobError(f"class {req.job_class!r}: no such Airlock class; expected one of {', '.join(tree.classes)}",
                           reason="adopt_invalid")
        grants = self.jm.grants or Grants.from_config(None)
        why = grants.refusal(req.uid, _user_gids(req.uid, req.gid) if req.uid else {req.gid}, req.job_class,
                             req.priority)
        if why is not None:
            raise GrantError(why)
        self.check_gpus(req)

    def check_gpus(self, req: AdoptRequest, job_id: str | None = None) -> None:
        inv = self.jm.inventory
        have = set(inv.indices) if inv is not None else set()
        missing = [g for g in req.gpus if g not in have]
        if missing:
            raise JobError(f"gpus {list(req.gpus)}: {missing} not on this node (its GPUs: "
                           f"{sorted(have) or 'none'}); the scheduler's GPU list and Laminar's inventory disagree "
                           "([gpus] declared, NVML)", reason="adopt_gpus")
        for j in self.jm.jobs.values():
            if j.active and j.id != job_id:
                both = sorted(set(j.gpus) & set(req.gpus))
                if both:
                    raise JobError(f"gpus {list(req.gpus)}: {both} held by job {j.id}", reason="adopt_gpus")

    def check_cgroup(self, rel: str) -> str:
        """``rel`` (relative to the cgroup2 mount) resolved, when it is a real cgroup directory
        under the mount, not the root, not the agent's own cgroup nor under it, not under the
        agent's ``[cgroups] root``; no link on the way. JobError naming it otherwise."""
        h = self.jm.hierarchy
        assert h is not None
        mount = h.unified.resolve()
        p = h.unified / rel
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError):
            raise JobError(f"cgroup {rel!r}: no such cgroup under {h.unified}", reason="adopt_cgroup") from None
        if real != mount / rel or not real.is_dir() or real == mount or mount not in real.parents:
            raise JobError(f"cgroup {rel!r}: not a cgroup directory under {h.unified} (a link, or the root)",
                           reason="adopt_cgroup")
        mine = pid_cgroup(os.getpid())
        ours = mount / (self.jm.cgroup_root or "laminar")
        for top, what in ((mount / mine if mine else None, "the agent's own cgroup"),
                          (ours, "the agent's [cgroups] root")):
            if top is not None and top != mount and (real == top or top in real.parents):
                raise JobError(f"cgroup {rel!r}: inside {what} ({top}); an adopted job's cgroup is the scheduler's",
                               reason="adopt_cgroup")
        return str(real.relative_to(mount))

    def in_place(self, rel: str) -> bool:
        """Whether the cgroup ``rel`` is taken in place (under one of ``[adopt] inplace_roots``)."""
        return any(rel == r or rel.startswith(r.rstrip("/") + "/") for r in self.inplace_roots)

    # -- the checkpoint directory ---------------------------------------------------------------
    def ckpt_dir(self, scheduler: Scheduler, ref: str) -> Path:
        return self.ckpt_root / ckpt_dir_name(scheduler, ref)

    def make_ckpt_dir(self, d: Path, uid: int, gid: int) -> None:
        """Blocking (shared storage: run it off the loop). Makes ``d`` 0700 for (uid, gid);
        an existing one must be a directory (no link) owned by ``uid``. JobError otherwise."""
        self.ckpt_root.mkdir(parents=True, exist_ok=True, mode=0o711)
        try:
            os.mkdir(d, 0o700)
            os.chown(d, uid, gid)
        except FileExistsError:
            pass
        except OSError as e:
            raise JobError(f"checkpoint directory {d}: {e.strerror}", reason="adopt_ckpt_dir") from None
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise JobError(f"checkpoint directory {d}: not a directory (a link?); refused", reason="adopt_ckpt_dir")
        if st.st_uid != uid:
            raise JobError(f"checkpoint directory {d}: owned by uid {st.st_uid}, not the job's user {uid}; refused",
                           reason="adopt_ckpt_dir")

    async def resume_from(self, job: Job) -> str | None:
        """The newest checkpoint in the job's checkpoint directory that verifies as its user
        (jobkit's check, in a child dropped to the user: laminar.migrate.owner_check), looking
        at no more than RESUME_TRIES of them within RESUME_TIMEOUT_S, off the loop; None when
        there is none."""
        from ..migrate.owner_check import verify_as_owner

        assert job.ckpt_dir is not None

        def look() -> str | None:
            listing = scan_dir(job.ckpt_dir)  # type: ignore[arg-type]
            if listing is None:
                return None
            for p in list(reversed(listing.paths()))[:RESUME_TRIES]:
                try:
                    verify_as_owner(str(p), job.owner_uid, job.owner_gid)
                    return str(p)
                except ValueError as e:
                    log.info("job %s: checkpoint %s does not verify: %s", job.id, p, e)
            return None

        try:
            return await asyncio.wait_for(asyncio.to_thread(look), RESUME_TIMEOUT_S)
        except TimeoutError:
            self.jm._emit("job", f"job {job.id}: its checkpoints could not be looked at within {RESUME_TIMEOUT_S:g} s; "
                          "adopted without LAMINAR_RESUME_FROM", job=job.id)
            return None

    async def env(self, job: Job, checkpoint: str) -> dict[str, str]:
        """The names the task must get (the SPANK plugin sets them; laminar.jobkit reads them)."""
        out = {"LAMINAR_JOB_ID": job.id, "LAMINAR_JOB_NUM": str(job.num), "LAMINAR_CKPT_DIR": str(job.ckpt_dir)}
        if checkpoint != "none":  # (none: the agent never asks; jobkit's default signal is never sent)
            out["LAMINAR_CKPT_SIGNAL"] = checkpoint  # what jobkit reads
        resume = await self.resume_from(job)
        if resume is not None:
            out["LAMINAR_RESUME_FROM"] = resume
        return out

    # -- the adoption --------------------------------------------------------------------------
    async def adopt(self, req: AdoptRequest) -> tuple[Job, dict[str, str]]:
        """Adopt the task or pod ``req`` names (the module docs); the job and the env the task
        must get. The same (scheduler, ref) again: the live job (a moved job's cgroup takes the
        new task's pid too). JobError (GrantError for the grant) naming the value; nothing is
        changed on a refusal."""
        jm = self.jm
        assert jm.tree is not None and jm.hierarchy is not None and jm.store is not None
        fd = None
        try:
            if req.pid is not None:
                try:
                    fd = os.pidfd_open(req.pid)  # the process is pinned: what is looked at below is it
                except OSError:
                    raise JobError(f"pid {req.pid}: no such process", reason="adopt_pid") from None
                owner = pid_uid(req.pid)
                if owner != req.uid:
                    raise JobError(f"pid {req.pid}: runs as uid {owner}, not the job's user {req.uid}",
                                   reason="adopt_pid")
                if req.caller_uid != 0 and req.scheduler is Scheduler.SLURM:
                    of = slurm_job_of(req.pid)
                    if of != req.ref:
                        raise AdoptRefused(
                            f"pid {req.pid}: not a task of Slurm job {req.ref} (its parent is "
                            + ("no slurmstepd run by root" if of is None else f"slurmstepd of job {of}")
                            + "); a user adopts only their Slurm job's tasks (root adopts any process)",
                            reason="adopt_pid")
                rel = pid_cgroup(req.pid)
                if rel is None:
                    raise JobError(f"pid {req.pid}: no cgroup2 cgroup (gone?)", reason="adopt_pid")
            else:
                assert req.cgroup is not None
                rel = req.cgroup
            live = self.find(req.scheduler, req.ref)
            if live:
                job = live[0]
                if job.owner_uid != req.uid:
                    raise JobError(f"{req.scheduler} job {req.ref}: adopted here as job {job.id} of uid {job.owner_uid}, "
                                   f"not uid {req.uid}", reason="adopt_pid")
                if req.pid is not None and not isinstance(job.cgroup, FixedCgroup) and req.pid not in job.cgroup.pids():
                    _still(fd, req.pid)
                    job.cgroup.attach(req.pid)  # a second task of the same Slurm job
                    self._emit_added(job, req.pid)
                return job, await self.env(job, req.checkpoint)
            in_place = self.in_place(rel) if rel else False
            if req.cgroup is not None and not in_place:
                raise JobError(f"cgroup {rel!r}: not under [adopt] inplace_roots ({', '.join(self.inplace_roots)}); a "
                               "pod's cgroup is taken where the kubelet made it", reason="adopt_cgroup")
            if in_place:
                rel = self.check_cgroup(rel)
            else:
                root = (jm.cgroup_root or "laminar").strip("/")
                if rel == root or rel.startswith(root + "/"):
                    raise JobError(f"pid {req.pid}: already in a job's cgroup ({rel}); a process is adopted once",
                                   reason="adopt_pid")
            req = await self.scheduler_gpus(req)
            self.check(req)
            return await self._take(req, rel if in_place else None, fd)
        finally:
            if fd is not None:
                os.close(fd)

    # -- the GPUs, as the scheduler says -----------------------------------------------------
    async def scheduler_gpus(self, req: AdoptRequest) -> AdoptRequest:
        """``req`` with the GPUs its scheduler gave the job on this node (the module docs).
        A Slurm task asked by its user (not root) that names GPUs, or any on a node with
        ``[gpus] owner = "scheduler"``: slurmctld's list (one question per Slurm job at a time,
        bounded by SLURM_GPUS_TIMEOUT_S). Anything else: ``req`` as it is. JobError (400) when
        slurmctld cannot be asked or does not answer, or the request names a GPU slurmctld did not
        give the job here (a step's own subset of the job's GPUs is no lie: the job's are
        recorded); nothing is changed."""
        if req.scheduler is not Scheduler.SLURM or req.caller_uid == 0:
            return req
        if not req.gpus and self.gpu_owner != "scheduler":
            return req
        where = f"slurm job {req.ref}"
        if self.slurm is None:
            if not req.gpus:
                return req  # nothing claimed, nothing to check: adopted holding no GPU
            raise JobError(f"{where}: gpus {list(req.gpus)} (the task's SLURM_STEP_GPUS or SLURM_JOB_GPUS) cannot be "
                           "checked: this node's agent does not ask slurmctld ([slurm] enabled = false), and a task's "
                           "environment is its user's to set. The node's operator sets [slurm] enabled = true in "
                           "laminard.toml so that the agent checks the job's GPUs with slurmctld; refused, nothing "
                           "changed", reason="adopt_gpus")
        if self.slurm_broken:
            raise JobError(f"{where}: its GPUs cannot be checked with slurmctld: {self.slurm_broken}",
                           reason="adopt_gpus")
        from ..sched.slurm import SlurmError

        task = self._asking.get(req.ref)
        if task is None:
            task = asyncio.get_running_loop().create_task(self.slurm.job_gpus(req.ref, self.slurm_node))
            self._asking[req.ref] = task
            task.add_done_callback(self._asked)
        try:
            given = await asyncio.shield(task)
        except SlurmError as e:
            raise JobError(f"{where}: its GPUs could not be checked with slurmctld, so it is not adopted (the "
                           f"task fails; Slurm's requeue policy decides what next): {e}", reason="adopt_gpus") from None
        beyond = sorted(set(req.gpus) - set(given))
        if beyond:
            raise JobError(f"{where}: gpus {list(req.gpus)} (the task's SLURM_STEP_GPUS or SLURM_JOB_GPUS) are not the "
                           f"GPUs slurmctld gave the job on node {self.slurm_node}: {list(given) or 'none'} "
                           f"({beyond} not among them); refused, nothing changed. Ask Slurm for GPUs "
                           "(--gres=gpu:N, --gpus=N) and leave SLURM_STEP_GPUS and SLURM_JOB_GPUS as Slurm sets them",
                           reason="adopt_gpus")
        if tuple(req.gpus) != given:
            log.info("%s: adopted with the GPUs slurmctld gave it on %s, %s (its task named %s)", where,
                     self.slurm_node, list(given), list(req.gpus))
        return dataclasses.replace(req, gpus=given)

    def _asked(self, task: asyncio.Task[tuple[int, ...]]) -> None:
        """A question to slurmctld answered: forgotten (the next task of the job asks again)."""
        for ref, t in list(self._asking.items()):
            if t is task:
                del self._asking[ref]
        if not task.cancelled():
            task.exception()  # (read: a failure nobody awaited any more is not logged as lost)

    def _emit_added(self, job: Job, pid: int) -> None:
        self.jm._emit("job", f"job {job.id}: task pid {pid} of {job.origin.scheduler} job {job.origin.scheduler_ref} "
                      "moved into its cgroup", job=job.id, pid=pid)

    async def _take(self, req: AdoptRequest, rel: str | None, fd: int | None) -> tuple[Job, dict[str, str]]:
        jm = self.jm
        assert jm.tree is not None and jm.hierarchy is not None
        ckpt = self.ckpt_dir(req.scheduler, req.ref)
        await asyncio.to_thread(self.make_ckpt_dir, ckpt, req.uid, req.gid)
        # again after the await: another adoption of the same ref, or of the same GPUs, may have been taken
        live = self.find(req.scheduler, req.ref)
        if live:
            return live[0], await self.env(live[0], req.checkpoint)
        self.check_gpus(req)
        if req.uid:  # as a submission: at most [jobs] max_per_user jobs not ended (QuotaError, 429)
            jm.checks.quota(req.uid)
        command = (_cmdline(req.pid) if req.pid is not None else []) or [f"{req.scheduler}:{req.ref}"]
        spec = JobSpec(command=command, name=req.name or ckpt_dir_name(req.scheduler, req.ref)[:NAME_MAX], job_class=req.job_class,
                       priority=req.priority,
                       checkpoint_signal="SIGUSR1" if req.checkpoint == "none" else req.checkpoint,
                       periodic_checkpoints=req.checkpoint != "none")
        spec.validate()
        origin = JobOrigin(scheduler=req.scheduler, scheduler_ref=req.ref, scheduler_cgroup=rel).checked()
        spec_text = json.dumps(spec.as_dict())
        now = time.time()
        job_id, num = jm.table.insert(spec_text, req.uid, req.gid, now, origin)
        cg = self.cgroup_for(req.job_class, job_id, origin)
        job = Job(id=job_id, num=num, spec=spec, cgroup=cg, cgroup_id=0, state="running", pid=req.pid,
                  owner_uid=req.uid, owner_gid=req.gid, gpus=list(req.gpus), created=now, started=now, origin=origin,
                  spec_bytes=len(spec_text), ckpt_dir=ckpt, log_path=None,
                  limits={"set_by": str(req.scheduler), "note": f"adopted: its limits are {req.scheduler}'s; Laminar "
                          "writes none (pids, memory, cpu)", "mode": "in place" if rel else "moved"})
        try:
            cg.create()
            if rel is None:
                assert req.pid is not None
                _still(fd, req.pid)
                cg.attach(req.pid)
            job.cgroup_id = cg.cgroup_id
        except (CgroupError, OSError) as e:
            if rel is None:
                try:
                    cg.remove()
                except CgroupError as ce:
                    jm.leaks.record(job, str(ce))
            job.state, job.reason, job.ended = "failed", f"adoption failed: {e}", time.time()
            from ..policy.endcause import EndCause

            job.end_cause = EndCause.START_FAILED
            jm.table.persist(job)
            raise JobError(f"{req.scheduler} job {req.ref}: cannot take its cgroup: {e}", reason="adopt_cgroup") from None
        jm.jobs[job_id] = job
        jm.table.persist(job)
        jm.table.set_limits(job)
        self.register_net(job)
        self.watch(job)
        self.counts[str(req.scheduler)] = self.counts.get(str(req.scheduler), 0) + 1
        jm._emit("job", f"job {job_id} adopted from {req.scheduler} job {req.ref} "
                 f"({'in place: ' + rel if rel else 'moved into ' + str(cg.unified)})", job=job_id, num=num,
                 scheduler=str(req.scheduler), scheduler_ref=req.ref, pid=req.pid, cgroup_id=job.cgroup_id,
                 by_uid=req.uid, **{"class": req.job_class}, priority=req.priority, gpus=list(req.gpus))
        return job, await self.env(job, req.checkpoint)

    def cgroup_for(self, job_class: str, job_id: str, origin: JobOrigin) -> JobCgroup:
        """The cgroup of a job (an adopted one's in place: :class:`FixedCgroup`), for the job
        table's read-back too."""
        assert self.jm.tree is not None and self.jm.hierarchy is not None
        if origin.scheduler_cgroup:
            return FixedCgroup(self.jm.hierarchy, origin.scheduler_cgroup, job_class, job_id)
        return self.jm.tree.job(job_class, job_id)

    def ckpt_dir_of(self, origin: JobOrigin) -> Path | None:
        """An adopted job's checkpoint directory (None: not adopted)."""
        if origin.scheduler is None or origin.scheduler_ref is None:
            return None
        return self.ckpt_dir(origin.scheduler, origin.scheduler_ref)

    # -- netguard and the watch -------------------------------------------------------------------
    def register_net(self, job: Job) -> None:
        """netguard sees the job's cgroup, and an in-place one's child cgroups, as the job."""
        ng = self.jm.netguard
        if ng is None:
            return
        ids = [job.cgroup_id]
        if isinstance(job.cgroup, FixedCgroup):
            known = self._children.setdefault(job.id, set())
            for d in job.cgroup.children():
                try:
                    cid = os.stat(d).st_ino
                except OSError:
                    continue
                if cid not in known:
                    known.add(cid)
                    ids.append(cid)
        for cid in ids:
            try:
                ng.register_job(cid, job.num, job.spec.lent)
            except Exception as e:  # the job runs; its traffic is just not identified
                log.warning("job %s: netguard.register_job(%s) failed: %s", job.id, cid, e)

    def ended(self, job: Job) -> None:
        """The job's teardown: netguard forgets its child cgroups (its own: the job manager)."""
        ids = self._children.pop(job.id, set())
        ng = self.jm.netguard
        if ng is None:
            return
        for cid in ids:
            try:
                ng.unregister_job(cid)
            except Exception as e:
                log.debug("job %s: netguard.unregister_job(%s): %s", job.id, cid, e)

    def watch(self, job: Job) -> None:
        """Watch an adopted job for its end: its task's pidfd first where it has one (moved),
        then its cgroup until empty (:meth:`watch_populated`)."""
        if job.pid is not None and not isinstance(job.cgroup, FixedCgroup):
            self.jm.exits.watch(job)  # its pidfd fires: exits.pidfd_ready hands it to watch_populated
        else:
            self.jm._spawn_task(self.watch_populated(job.id))

    async def watch_populated(self, job_id: str) -> None:
        """Until the job's cgroup is empty (every task gone; an in-place job's new child cgroups
        told to netguard each round), then its end. The end of a job of this manager's only."""
        jm = self.jm
        job = jm.jobs.get(job_id)
        while job is not None and jm.jobs.get(job_id) is job and job.cgroup.populated():
            if isinstance(job.cgroup, FixedCgroup):
                self.register_net(job)
            await asyncio.sleep(WATCH_S)
        await jm.exits.on_exit(job_id)

    def end_reason(self, job: Job) -> str:
        return f"ended by {job.origin.scheduler}"

    def told_exit(self, job: Job, code: int) -> None:
        """The scheduler's side tells the job's exit code (``POST /v1/jobs/{id}/exit``): kept
        with it, recorded at its end (or now, for one that has ended)."""
        job.exit_code = code
        if not job.live:
            self.jm.table.persist(job)

    def status(self) -> dict[str, Any]:
        return {"ckpt_root": str(self.ckpt_root), "inplace_roots": list(self.inplace_roots),
                "gpu_owner": self.gpu_owner, "adopted": dict(self.counts),
                "live": sum(1 for j in self.jm.jobs.values() if j.live and j.origin.scheduler is not None)}


class CheckpointCollector:
    """``laminar_job_last_checkpoint_timestamp_seconds`` and
    ``laminar_job_last_checkpoint_age_seconds`` of every live job that has a verified checkpoint
    (its newest one's commit time, as the checkpoint driver last checked: ``Job.verified_checkpoint``),
    labelled job, class, scheduler and scheduler_ref (empty for a job launched here): what a
    scheduler's preemption reads to choose the victim with the least work at risk. Rendered on
    the agent's loop (laminar.metrics), from memory: no file is read."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["job", "class", "scheduler", "scheduler_ref"]
        ts = GaugeMetricFamily("laminar_job_last_checkpoint_timestamp_seconds", "When a live job's last checkpoint "
                               "was committed (wall clock), for jobs with one", labels=labels)
        age = GaugeMetricFamily("laminar_job_last_checkpoint_age_seconds", "Seconds since a live job's last "
                                "checkpoint: the work a kill would lose", labels=labels)
        now = time.time()
        for j in list(self.jm.jobs.values()):
            verified = j.verified_checkpoint() if j.live else None
            if verified is None:
                continue
            last = verified[1]
            values = [j.id, j.spec.job_class, str(j.origin.scheduler or ""), j.origin.scheduler_ref or ""]
            ts.add_metric(values, last)
            age.add_metric(values, max(0.0, now - last))
        yield ts
        yield age

