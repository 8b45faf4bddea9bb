"""Where a job came from, as the agent knows it: kept in the store, never read from the job's environment.

The agent trusts only what it wrote. A job's environment (``spec.env``) is its submitter's: a
local user writes it at ``POST /v1/jobs``, a zone user at ``POST /v1/placements``, so nothing
the agent decides may be read back from it. Before, four of the agent's own records lived only
there (docs/migration.md, *Security*): the migration key a job resumed (``LM_MIGRATED_FROM``:
whether a keeper still resumes a job, whether a replica or an archived copy is still needed),
the placement that started it (``LM_PLACEMENT_ID``: which job answers a repeated hand-over), its
fractional GPU share (``LM_GPU_SHARE``: what a loan query reports), and whether its
``resume_from`` was the agent's (what the archive copies as root). A user who set them
switched off another user's resumption, answered another user's hand-over with their own job,
made the node's loan answers fail, or had root copy another user's checkpoint.

Now:

* **Reserved names** (:func:`reserved_env_error`): a spec whose env sets ``LM_*``,
  ``LAMINAR_*`` or a name the agent sets for the GPUs (``CUDA_VISIBLE_DEVICES``,
  ``CUDA_DEVICE_ORDER``: :func:`laminar.runtime.gpus.cuda_env`) is refused naming it and what to
  use instead; ``JobSpec.validate`` calls it, so every path that builds a spec refuses it (the
  API, a placement's origin, a peer's hand-over, a keeper's take-over, an archived record).
  ``PATH``, ``LANG``, ``HOME``, ``USER`` and ``LOGNAME`` are defaults the agent gives a job and
  the job's owner may override: the agent reads none of them back (``check_paths`` looks the
  command up in the job's ``PATH`` as the owner, on purpose).
* **A job's origin** (:class:`JobOrigin`) is an argument of ``JobManager.submit`` from the
  agent's own code (a hand-over, a take-over, a move, a requeue) and five columns of the
  ``jobs`` table (:data:`COLUMNS`) that only the agent writes. Every reader asks the store by an
  indexed column (``JobManager.table``: ``find_origin``, ``find_placement``, ``resume_users``,
  ``ended_origins``), never ``jobs.list()`` with every spec decoded on the event loop. The agent
  still *sets* ``LM_MIGRATED_FROM``, ``LM_PLACEMENT_ID``, ``LM_GPU_SHARE`` and
  ``LM_REQUEUED_FROM`` in the job's environment from those columns (:meth:`JobOrigin.env`), for
  the job to read; it never reads them back.
* **Peers of an older release** put those names into the specs they send. A spec from a peer
  (:func:`from_peer`) has the agent's own names dropped (counted by name, logged: never trusted,
  a user of that peer could have set them), and the two user knobs that were env names become
  their spec fields (``LM_REMAINING_S`` → ``remaining_s``, ``LM_CKPT_PERIODIC=off`` →
  ``periodic_checkpoints = false``).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from ..policy.sched import Scheduler, check_ref
from . import gpus as gpumod

log = logging.getLogger("laminar.jobs")

RESERVED_PREFIXES = ("LM_", "LAMINAR_")
# the names gpus.cuda_env sets (derived, so a name it adds is reserved with it)
CUDA_NAMES = tuple(sorted(gpumod.cuda_env(gpumod.GpuInventory("none"), [])))
# what the agent sets at spawn from the job's origin (JobOrigin.env); peers of an older release put
# them into the specs they send
AGENT_ENV = ("LM_MIGRATED_FROM", "LM_PLACEMENT_ID", "LM_GPU_SHARE", "LM_REQUEUED_FROM")
# user knobs that were env names: their spec fields
LEGACY_KNOBS = {"LM_REMAINING_S": "remaining_s", "LM_CKPT_PERIODIC": "periodic_checkpoints"}
# What to use instead, said in the refusal.
INSTEAD = {
    "LM_REMAINING_S": "use the spec field remaining_s (laminarctl submit --remaining SECONDS)",
    "LM_CKPT_PERIODIC": "use the spec field periodic_checkpoints = false (laminarctl submit --no-periodic-checkpoints)",
    "LM_MIGRATED_FROM": "drop it: the agent records the job a move or a take-over resumes itself",
    "LM_PLACEMENT_ID": "drop it: the agent records the placement that started a job itself",
    "LM_GPU_SHARE": "use gpus (a count or indices; a share through POST /v1/placements \"gpus\": 0.5)",
    "LM_REQUEUED_FROM": "drop it: the agent records a requeue itself",
    "CUDA_VISIBLE_DEVICES": "use gpus (laminarctl submit --gpus 2, or indices --gpus 0,1): the agent sets it to the "
                            "job's own GPUs",
    "CUDA_DEVICE_ORDER": "drop it: the agent sets it (PCI_BUS_ID, NVML's order)",
}
REMAINING_S_MIN, REMAINING_S_MAX = 1.0, 1e9  # as [loan] elastic_remaining_s
# A migration or requeue key (n<node>-<job id>; a transfer's job id): ASCII, full match.
KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# One GPU share: "<index>:<fraction>", fraction in (0, 1).
_SHARE_RE = re.compile(r"([0-9]{1,4}):([0-9]{1,3}(?:\.[0-9]{1,12})?)")
SHARES_MAX = gpumod.GPUS_MAX


def reserved(name: str) -> bool:
    """Whether a job's environment may not set ``name`` (the module docs)."""
    return name.startswith(RESERVED_PREFIXES) or name in CUDA_NAMES


def reserved_env_error(env: dict[str, Any]) -> str | None:
    """The refusal of a spec whose env sets reserved names (naming each, at most 8, and what to
    use instead), or None. ``env`` is a table of strings (checked before)."""
    bad = sorted(k for k in env if reserved(k))
    if not bad:
        return None
    shown = [f"{k[:64]!r} ({INSTEAD[k]})" if k in INSTEAD else repr(k[:64]) for k in bad[:8]]
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    return (f"env {', '.join(shown)}{more}: reserved; the agent sets LM_* and LAMINAR_* names and "
            f"{', '.join(CUDA_NAMES)} in a job's environment itself (its checkpoint contract, its GPUs, where it "
            "came from), so a job's spec may not")


def valid_key(value: Any) -> bool:
    """A migration or requeue key (``n<node>-<job id>``): ASCII letters, digits, ``_.-``, full match."""
    return isinstance(value, str) and KEY_RE.fullmatch(value) is not None


def parse_share(text: Any) -> tuple[tuple[int, float], ...]:
    """``"0:0.5,1:0.25"`` -> ((0, 0.5), (1, 0.25)); ValueError naming the text otherwise (each
    fraction finite, in (0, 1), each index below GPUS_MAX and given once)."""
    if not isinstance(text, str) or not text or len(text) > 32 * SHARES_MAX:
        raise ValueError(f"gpu share {str(text)[:40]!r}: expected index:fraction[,...]")
    out: list[tuple[int, float]] = []
    for part in text.split(","):
        m = _SHARE_RE.fullmatch(part)
        if m is None:
            raise ValueError(f"gpu share {text[:40]!r}: {part[:20]!r} is not index:fraction")
        i, f = int(m.group(1)), float(m.group(2))
        if not (i < SHARES_MAX and 0.0 < f < 1.0 and math.isfinite(f)) or any(i == j for j, _ in out):
            raise ValueError(f"gpu share {text[:40]!r}: {part!r} out of range (index < {SHARES_MAX}, once; "
                             "0 < fraction < 1)")
        out.append((i, f))
    return tuple(out)


def format_share(share: tuple[tuple[int, float], ...]) -> str:
    return ",".join(f"{i}:{f:g}" for i, f in share)


# The columns of the jobs table that hold a job's origin (added to an existing table at start,
# as jobs.LATER_COLUMNS), and their indexes: each reader asks by one of them.
COLUMNS = {"origin_key": "TEXT", "placement_id": "INTEGER", "gpu_share": "TEXT", "requeued_from": "TEXT",
           "resume_given": "TEXT", "scheduler": "TEXT", "scheduler_ref": "TEXT",
           "scheduler_cgroup": "TEXT"}
# the first of them: added together, with the stored envs cleaned once (JobTable.clean_stored_env)
FIRST_COLUMNS = ("origin_key", "placement_id", "gpu_share", "requeued_from", "resume_given")
INDEXES = (
    "CREATE INDEX IF NOT EXISTS jobs_by_origin ON jobs(origin_key) WHERE origin_key IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS jobs_by_placement ON jobs(placement_id) WHERE placement_id IS NOT NULL",
    # (on the column itself: one on state was passed over for the num index and a scan of the table)
    "CREATE INDEX IF NOT EXISTS jobs_by_resume_given ON jobs(resume_given) WHERE resume_given IS NOT NULL",
    # an adopted job by its scheduler's id (JobManager.find_adopted; laminar.runtime.adopt)
    "CREATE INDEX IF NOT EXISTS jobs_by_scheduler_ref ON jobs(scheduler, scheduler_ref) WHERE scheduler IS NOT NULL",
)


@dataclass(frozen=True)
class JobOrigin:
    """What the agent knows of where a job came from (the module docs). Given to
    ``JobManager.submit`` by the agent's own code only; stored in the job's row."""

    migrated_from: str | None = None  # the key n<node>-<job> a move, take-over or archive claim resumes
    placement_id: int | None = None  # the zone placement whose hand-over (or fenced take-over) started it
    gpu_share: tuple[tuple[int, float], ...] = ()  # the fractional GPUs its placement gave it
    requeued_from: str | None = None  # the key of the job a requeue placed again as this one
    resume_given: str | None = None  # the resume_from the agent gave it (None: none, or its user's own)
    # the scheduler it was adopted from and its id there (laminar.policy.sched; None: launched here)
    scheduler: Scheduler | None = None
    scheduler_ref: str | None = None
    # an adopted job's cgroup taken in place (relative to the cgroup2 mount; None: the agent's own)
    scheduler_cgroup: str | None = None

    def checked(self) -> JobOrigin:
        """Itself when every field is well formed; ValueError naming the field otherwise."""
        for name in ("migrated_from", "requeued_from"):
            v = getattr(self, name)
            if v is not None and not valid_key(v):
                raise ValueError(f"origin {name} {str(v)[:80]!r}: expected a key n<node>-<job>")
        pid = self.placement_id
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 1 << 63):
            raise ValueError(f"origin placement_id {pid!r}: expected a placement id (1..2^63-1)")
        if self.gpu_share:
            parse_share(format_share(self.gpu_share))
        rf = self.resume_given
        if rf is not None and (not isinstance(rf, str) or not rf.startswith("/") or "\0" in rf or len(rf) > 4096):
            raise ValueError(f"origin resume_given {str(rf)[:80]!r}: expected an absolute path")
        if (self.scheduler is None) != (self.scheduler_ref is None):
            raise ValueError(f"origin scheduler {self.scheduler!r} and scheduler_ref {str(self.scheduler_ref)[:80]!r}: "
                             "expected both or neither")
        sc = self.scheduler_cgroup
        if sc is not None and (self.scheduler is None or not isinstance(sc, str) or not sc or sc.startswith("/")
                               or len(sc) > 4096 or "\0" in sc or ".." in sc.split("/")):
            raise ValueError(f"origin scheduler_cgroup {str(sc)[:80]!r}: expected an adopted job's cgroup, relative "
                             "to the cgroup2 mount")
        if self.scheduler is not None:
            try:
                check_ref(self.scheduler, self.scheduler_ref)
            except ValueError as e:
                raise ValueError(f"origin {e}") from None
        return self

    def env(self) -> dict[str, str]:
        """The names the agent sets in the job's environment for the job to read (never read back)."""
        out: dict[str, str] = {}
        if self.migrated_from:
            out["LM_MIGRATED_FROM"] = self.migrated_from
        if self.placement_id:
            out["LM_PLACEMENT_ID"] = f"{self.placement_id:016x}"
        if self.gpu_share:
            out["LM_GPU_SHARE"] = format_share(self.gpu_share)
        if self.requeued_from:
            out["LM_REQUEUED_FROM"] = self.requeued_from
        return out

    def row(self) -> tuple[Any, ...]:
        """The values of :data:`COLUMNS`, in order."""
        return (self.migrated_from, self.placement_id, format_share(self.gpu_share) or None, self.requeued_from,
                self.resume_given, None if self.scheduler is None else str(self.scheduler), self.scheduler_ref,
                self.scheduler_cgroup)

    @classmethod
    def from_row(cls, row: Any) -> JobOrigin:
        """From a jobs row (columns the agent wrote; a value that does not parse, which only a
        hand-edited store holds, reads as absent)."""
        keys = row.keys() if hasattr(row, "keys") else ()

        def col(name: str) -> Any:
            return row[name] if name in keys else None

        try:
            share = parse_share(col("gpu_share")) if col("gpu_share") else ()
        except ValueError:
            share = ()
        key, req = col("origin_key"), col("requeued_from")
        pid, rf = col("placement_id"), col("resume_given")
        sched: Scheduler | None
        try:
            sched = Scheduler(col("scheduler"))
            sref: str | None = check_ref(sched, col("scheduler_ref"))
        except ValueError:
            sched = sref = None
        scg = col("scheduler_cgroup")
        scg = scg if sched is not None and isinstance(scg, str) and scg and ".." not in scg.split("/") else None
        return cls(migrated_from=key if valid_key(key) else None,
                   placement_id=pid if isinstance(pid, int) and 0 < pid < 1 << 63 else None, gpu_share=share,
                   requeued_from=req if valid_key(req) else None, resume_given=rf if isinstance(rf, str) else None,
                   scheduler=sched, scheduler_ref=sref, scheduler_cgroup=scg)

    def as_dict(self) -> dict[str, Any]:
        return {"migrated_from": self.migrated_from,
                "placement_id": None if self.placement_id is None else f"{self.placement_id:016x}",
                "gpu_share": format_share(self.gpu_share) or None, "requeued_from": self.requeued_from,
                "resume_given": self.resume_given,
                "scheduler": None if self.scheduler is None else str(self.scheduler),
                "scheduler_ref": self.scheduler_ref, "scheduler_cgroup": self.scheduler_cgroup}


NO_ORIGIN = JobOrigin()

# The request field a sender of a job (a move, a keeper's placement, a requeue) names the job's
# origin in: {"migrated_from": key, "requeued_from": key, "resume_given": true}. A peer's word on
# its own agent's behalf: a user's placement carries none (POST /v1/placements builds the request).
REQUEST_FIELD = "origin"


def request_origin(migrated_from: str | None = None, requeued_from: str | None = None,
                   resume_given: bool = False) -> dict[str, Any]:
    """The :data:`REQUEST_FIELD` a sender puts into a hand-over request."""
    out: dict[str, Any] = {}
    if migrated_from:
        out["migrated_from"] = migrated_from
    if requeued_from:
        out["requeued_from"] = requeued_from
    if resume_given:
        out["resume_given"] = True
    return out


def origin_of_request(req: dict[str, Any]) -> tuple[str | None, str | None, bool]:
    """(migrated_from, requeued_from, resume_given) a hand-over request's :data:`REQUEST_FIELD`
    names; ValueError naming a malformed one. No field: (None, None, False)."""
    o = req.get(REQUEST_FIELD)
    if o is None:
        return None, None, False
    if not isinstance(o, dict) or set(o) - {"migrated_from", "requeued_from", "resume_given"}:
        raise ValueError(f"{REQUEST_FIELD} {str(o)[:80]!r}: expected {{migrated_from, requeued_from, resume_given}}")
    mf, rq, given = o.get("migrated_from"), o.get("requeued_from"), o.get("resume_given", False)
    for name, v in (("migrated_from", mf), ("requeued_from", rq)):
        if v is not None and not valid_key(v):
            raise ValueError(f"{REQUEST_FIELD} {name} {str(v)[:80]!r}: expected a key n<node>-<job>")
    if not isinstance(given, bool):
        raise ValueError(f"{REQUEST_FIELD} resume_given {given!r}: expected true or false")
    return mf, rq, given


def from_peer(spec: Any, counts: dict[str, int] | None = None, where: str = "a peer",
              ours: dict[str, str] | None = None) -> Any:
    """A spec (a dict) that a peer, a keeper's stored request or an archived record carries, as
    this agent takes it: the agent's own names (:data:`AGENT_ENV`) an older agent put into its
    env dropped, and the user knobs that were env names (:data:`LEGACY_KNOBS`) made their spec
    fields when the field is not given (dropped when they do not parse). Anything else reserved is
    left for ``JobSpec.validate`` to refuse, naming it. Each name dropped is counted in
    ``counts`` (``env_dropped.<name>``) and logged, but for one equal to what ``ours`` says (the
    sender's request names the same origin: :meth:`JobOrigin.env` of it; a sender of this release
    copies it into the env for an older receiver). Not a dict, or no env table: as given."""
    if not isinstance(spec, dict) or not isinstance(spec.get("env"), dict):
        return spec
    env = dict(spec["env"])
    if not any(k in env for k in (*AGENT_ENV, *LEGACY_KNOBS)):
        return spec
    out = dict(spec)
    dropped = [k for k in AGENT_ENV if k in env and env.pop(k) != (ours or {}).get(k)]
    for name, fld in LEGACY_KNOBS.items():
        if name not in env:
            continue
        text = env.pop(name)
        value: Any = None
        if fld == "remaining_s":
            try:
                f = float(text) if isinstance(text, str) and len(text) <= 32 else math.nan
            except ValueError:
                f = math.nan
            value = f if REMAINING_S_MIN <= f <= REMAINING_S_MAX else None  # (NaN and inf fail it)
        elif isinstance(text, str) and text.lower() in ("off", "0", "no", "false"):
            value = False
        if value is not None and fld not in out:
            out[fld] = value
        elif value is None:
            dropped.append(name)
    out["env"] = env
    for k in dropped:
        if counts is not None:
            counts[f"env_dropped.{k}"] = counts.get(f"env_dropped.{k}", 0) + 1
    if dropped:
        log.info("a job spec from %s carried %s in its env (an agent of an older release, or its user): dropped, "
                 "never trusted", where, ", ".join(dropped))
    return out


def from_store(spec: Any, where: str) -> Any:
    """A spec stored by an agent of an older release (an upgrade), cleaned as :func:`from_peer`
    cleans a peer's, and every other reserved name dropped too (logged): the job keeps running;
    it is moved and started again from this spec, which peers would refuse with them."""
    out = from_peer(spec, where=where)
    if not isinstance(out, dict) or not isinstance(out.get("env"), dict):
        return out
    bad = sorted(k for k in out["env"] if reserved(k))
    if not bad:
        return out
    log.warning("%s sets reserved env names %s: dropped (laminar.runtime.provenance)", where, ", ".join(bad))
    return {**out, "env": {k: v for k, v in out["env"].items() if not reserved(k)}}
