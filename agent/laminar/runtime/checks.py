"""Whether a local user may submit a spec on this node, checked before the job manager takes it
(``jobs.checks``): the caller's grant of the spec's class and priority (:meth:`SubmitChecks.grant`,
config ``[grants]``: 403), the ``resume_from`` it names (:meth:`SubmitChecks.resume_from`: never
a copy in the agent's own trees) and its quota of jobs not yet ended (:meth:`SubmitChecks.quota`,
config ``jobs.max_per_user``: 429). For the paths by which a local user asks for a job, not for a
job arriving from another agent."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .grants import GrantError, Grants, caller_gids
from .spec import JOB_ID_RE, JobSpec, QuotaError, ResumeFromError, _brief

if TYPE_CHECKING:
    from .jobs import JobManager

# Config [jobs] max_per_user's default (laminar.runtime.jobs.CONFIG_FIELDS)
MAX_PER_USER = 256


class SubmitChecks:
    """The checks of a local user's submission, for the job manager ``jm`` (its jobs in memory,
    its store, its state directory, its grants and ``max_per_user``)."""

    def __init__(self, jm: JobManager) -> None:
        self.jm = jm

    def grant(self, spec: JobSpec, uid: int, gid: int, pid: int,
                    groups: frozenset[int] | None = None) -> None:
        """Raise GrantError (403 in the API) when the caller (its SO_PEERCRED uid, gid and pid,
        and the supplementary ``groups`` it had at connect(), SO_PEERGROUPS: ``req.peer.groups``)
        may not submit `spec`'s Airlock class at its priority (config ``[grants]``). For every
        path by which a local user asks for a job (``POST /v1/jobs``, the zone's
        ``POST /v1/placements`` at the origin); not for a job arriving from another agent,
        which keeps the class its origin admitted. Without ``groups`` they are read from
        ``/proc/<pid>/status`` (a pid reused since connect() would lend its groups: callers
        with a socket pass them)."""
        grants = self.jm.grants or Grants.from_config(None)
        gids = ({gid} | set(groups)) if groups is not None else caller_gids(gid, pid)
        why = grants.refusal(uid, gids if uid else {gid}, spec.job_class, spec.priority)
        if why is not None:
            raise GrantError(why)

    def resume_from(self, spec: JobSpec, uid: int) -> None:
        """A local user's own ``resume_from`` (``POST /v1/jobs``) is handed to the job, which
        reads it as its owner; the agent never opens it, nor counts it as one it gave (the
        archive and the replica GC read only those: laminar.runtime.provenance). For a user
        other than root, JobError when it lies in the agent's own trees, where only the agent
        gives a job a checkpoint (a replica or an archived copy, by a move or a take-over, to its
        owner): the state directory but the user's own jobs' checkpoint directories, and the
        archive. Decided from the path's text alone (nothing on the user's storage is read)."""
        rf = spec.resume_from
        if not rf or uid == 0 or self.jm.state_dir is None:
            return
        if not rf.startswith("/"):
            raise ResumeFromError(f"resume_from {_brief(rf)}: expected an absolute path")
        p = Path(os.path.normpath(rf))
        state = Path(os.path.normpath(self.jm.state_dir))
        agent = self.jm.agent
        try:
            archive = str((agent.config.section("migrate") or {}).get("archive_dir") or "") if agent is not None else ""
        except (AttributeError, KeyError):  # a config without the section (a test's)
            archive = ""
        if archive and (p == Path(os.path.normpath(archive)) or Path(os.path.normpath(archive)) in p.parents):
            raise ResumeFromError(f"resume_from {_brief(rf)}: lies in the archive (migrate.archive_dir), whose copies the "
                           "agent gives to their owners itself when it resumes a job; name a checkpoint of your own")
        if p != state and state not in p.parents:
            return
        rel = p.relative_to(state).parts
        if len(rel) >= 2 and rel[0] == "ckpt" and JOB_ID_RE.fullmatch(rel[1]):
            row = self.jm.store.db.execute("SELECT owner_uid FROM jobs WHERE id=?", (rel[1],)).fetchone()
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
        return sum(1 for j in self.jm.jobs.values() if j.owner_uid == uid)

    def quota(self, uid: int) -> None:
        """Raise QuotaError (429 in the API) when `uid` (not root) already has config
        ``jobs.max_per_user`` jobs that have not ended on this node (`live_count`). For every
        path by which a local user asks for a job here (``POST /v1/jobs``); not for a job
        arriving from another agent (a hand-over or a move adds no job to the user's total)."""
        limit = MAX_PER_USER if self.jm.max_per_user is None else self.jm.max_per_user
        if uid == 0 or limit <= 0:
            return
        have = self.live_count(uid)
        if have >= limit:
            raise QuotaError(f"too many jobs: uid {uid} has {have} jobs that have not ended on this node (queued, "
                             f"running, suspended or stopping); the limit is {limit} per user (config "
                             "jobs.max_per_user); stop some (`laminarctl job stop JOB`) or wait for them to end")
