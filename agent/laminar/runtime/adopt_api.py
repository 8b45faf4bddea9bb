"""The adoption API of the agent's control socket (laminar.runtime.adopt; docs/operations.md,
*Adopted jobs*): ``POST /v1/jobs/adopt`` (a scheduler's task or pod taken as a job: root, or the
task's own user), ``POST /v1/jobs/adopt/check`` (the same without the task: what ``srun`` asks
before a job is queued) and ``POST /v1/jobs/{id}/exit`` (root: an adopted job's exit code, as its
scheduler's side saw it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..airlock.cgroups import CgroupError
from .adopt import AdoptRefused, parse_adopt
from .grants import GrantError
from .spec import JobError, QuotaError, _brief

if TYPE_CHECKING:
    from .jobs import JobManager


def routes(jm: JobManager) -> list[Any]:
    from ..api import ApiError, Request, Route

    def parsed(req: Request, target: bool) -> Any:
        try:
            out = parse_adopt(req.body, req.peer.uid, target=target)
        except AdoptRefused as e:
            raise ApiError(403, str(e), e.reason or "adopt_refused") from None
        except JobError as e:
            raise ApiError(400, str(e), e.reason or "adopt_invalid") from None
        if out.cgroup is not None and req.peer.uid != 0:
            raise ApiError(403, f"permission denied: cgroup {out.cgroup!r}: only root adopts a cgroup in place (caller "
                                f"uid {req.peer.uid}); a user adopts their own task by its pid", "adopt_refused")
        return out

    async def adopt(req: Request) -> dict[str, Any]:
        r = parsed(req, True)
        try:
            job, env = await jm.adopt(r)
        except GrantError as e:
            raise ApiError(403, str(e), "beyond_grant") from None
        except AdoptRefused as e:  # (a user's pid that is no task of the Slurm job it names)
            raise ApiError(403, str(e), e.reason or "adopt_refused") from None
        except QuotaError as e:
            raise ApiError(429, str(e), e.reason or "max_per_user") from None
        except JobError as e:
            raise ApiError(400, str(e), e.reason or "adopt_invalid") from None
        except CgroupError as e:
            raise ApiError(503, f"cannot take the job's cgroup: {e}") from None
        return {"job": job.as_dict(reveal=req.peer.uid in (0, job.owner_uid)), "env": env}

    async def check(req: Request) -> dict[str, Any]:
        r = parsed(req, False)
        try:
            jm.adoption.check(r)
        except GrantError as e:
            raise ApiError(403, str(e), "beyond_grant") from None
        except JobError as e:
            raise ApiError(400, str(e), e.reason or "adopt_invalid") from None
        return {"ok": True}

    async def told_exit(req: Request) -> dict[str, Any]:
        if req.peer.uid != 0:
            raise ApiError(403, f"permission denied: an adopted job's exit code is told by root (its scheduler's "
                                f"side), not uid {req.peer.uid}")
        job = jm.get(req.params["id"])
        if job is None:
            raise ApiError(404, f"no job {req.params['id']!r} (see `laminarctl jobs`)")
        if job.origin.scheduler is None:
            raise ApiError(409, f"job {job.id} was not adopted from a scheduler: the agent knows its exit code")
        body = req.body if isinstance(req.body, dict) else {}
        code = body.get("code")
        if isinstance(code, bool) or not isinstance(code, int) or not -255 <= code <= 255:
            raise ApiError(400, f"code {_brief(code)}: expected the task's exit code, -255 to 255")
        jm.adoption.told_exit(job, code)
        return {"job": job.id, "exit_code": code}

    return [
        Route("POST", "/v1/jobs/adopt", adopt, privileged=False),
        Route("POST", "/v1/jobs/adopt/check", check, privileged=False),
        Route("POST", "/v1/jobs/{id}/exit", told_exit, privileged=False),
    ]
