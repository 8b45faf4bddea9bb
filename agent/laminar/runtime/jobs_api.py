"""The jobs API of the agent's control socket: ``POST /v1/jobs`` (submit, as the caller),
``GET /v1/jobs`` (pages: ``LIST_PAGE_DEFAULT``), ``GET /v1/jobs/{id}`` and
``POST /v1/jobs/{id}/stop``; who may see a job's env values and stop it
(:class:`~laminar.runtime.jobs.JobManager` does the work)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ..airlock.cgroups import CgroupError
from ..policy import endcause
from .grants import GrantError
from .jobs import JobManager
from .jobtable import LIST_PAGE_DEFAULT, LIST_PAGE_MAX
from .record import Job
from .spec import JobError, JobSpec, QuotaError, _brief, parse_grace_s

if TYPE_CHECKING:
    from ..components import MembersForApi

# The longest stop reason a caller may give: it is kept with the job and in two events, and
# the event log keeps 50,000 of them (a 1 MiB reason per stop would fill the disk).
REASON_MAX = 1000
LIST_SLICE_BYTES = 128 << 10  # a page is encoded this much at a time, a loop round between


def routes(jm: JobManager) -> list[Any]:
    """The routes of the jobs API, served by ``jm``. A multi-node job (docs/jobs.md) is served
    through the agent's members component where it has one (``laminar.members.routes``): its
    view listed and shown with its members, a member's local job with its ``member`` block, its
    stop sent to every member."""
    from ..api import ApiError, RawJson, Request, Route, to_json
    from ..members import routes as mroutes

    def members() -> MembersForApi | None:
        return jm.agent.members if jm.agent is not None else None

    def here() -> int:
        return mroutes.own_node(jm.agent.config) if jm.agent is not None else 1

    def in_control_group(req: Request) -> bool:
        api = jm.agent.api if jm.agent is not None else None
        auth = api.auth if api is not None else None
        return bool(auth and auth.allowed(req.peer))

    def may_manage(req: Request, job: Job) -> bool:
        if req.peer.uid == 0 or req.peer.uid == job.owner_uid:
            return True
        return in_control_group(req)

    def may_read_secrets(req: Request, job: Job) -> bool:
        """A job's env values: its owner and root only (not the control group)."""
        return req.peer.uid == 0 or req.peer.uid == job.owner_uid

    def find(req: Request) -> Job:
        job = jm.get(req.params["id"])
        if job is None:
            raise ApiError(404, f"no job {req.params['id']!r} (see `laminarctl jobs`)")
        return job

    async def submit(req: Request) -> dict[str, Any]:
        try:
            spec = JobSpec.from_dict(req.body)
            if spec.is_multinode():  # members on several nodes: the zone places them (docs/jobs.md)
                raise JobError(f"workers {spec.workers}: a multi-node job is placed through the zone "
                               f"(POST /v1/placements; laminarctl zone submit --workers {spec.workers}), not "
                               "submitted to one node", reason="workers_invalid")
            jm.checks.grant(spec, req.peer.uid, req.peer.gid, req.peer.pid, req.peer.groups)
            jm.checks.resume_from(spec, req.peer.uid)
            job = await jm.submit(spec, owner_uid=req.peer.uid, owner_gid=req.peer.gid, quota=True)
        except GrantError as e:
            raise ApiError(403, str(e), "beyond_grant") from None
        except QuotaError as e:
            raise ApiError(429, str(e), e.reason or "max_per_user") from None
        except JobError as e:
            jm.count_refusal("submit", e)
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
        airlock = jm.agent.airlock if jm.agent is not None else None
        rungs = airlock.rungs if airlock is not None else None
        if rungs is not None:
            r = rungs.get(job.id)
            out["airlock"] = {"rung": r[0], "for_s": round(time.monotonic() - r[1], 2), "hops": r[2]} if r else None
        out["holds"] = jm.holds.reasons(job.id)  # who holds it frozen (runtime/holds.py)
        out.update(mroutes.local_job_extra(members(), job.id, here()))  # a member of a multi-node job
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
        limit = int(text)
        page = jm.table.page(None if before is None else int(before), limit, everything)
        # the multi-node jobs this node originates (and hosts no member of) go into the page by
        # the number reserved for each here: within the page's numbers, or below them on the
        # last page (one not full)
        top = (1 << 63) if before is None else int(before)
        low = page[0].num if page and len(page) >= limit else 0
        views = [v for v in mroutes.origin_views(members(), here(), (j.id for j in page))
                 if low <= v["num"] < top and (everything or v.get("state") != "ended")]
        # encoded a slice at a time, a loop round between slices: eight users' pages of 1 MiB
        # each encoded in one round held root's status 0.19 s
        parts: list[str] = []
        done = 0
        for j in page:
            if done >= LIST_SLICE_BYTES:
                await asyncio.sleep(0)
                done = 0
            parts.append(to_json(with_rung(req, j)))
            done += j.spec_bytes + 1024
        if views:  # in number order among the local jobs'
            keyed = [(j.num, p) for j, p in zip(page, parts, strict=True)] + [(v["num"], to_json(v)) for v in views]
            parts = [p for _, p in sorted(keyed, key=lambda x: x[0])]
        return RawJson(("[" + ",".join(parts) + "]").encode())

    async def show(req: Request) -> dict[str, Any]:
        jid = req.params["id"]
        m = members()
        if m is not None and jm.get(jid) is None:
            v = m.view(jid)
            if v is not None:  # a multi-node job this node originates or knows, with no member here
                return {**v, "kind": "multinode"}
        return with_rung(req, find(req))

    async def stop(req: Request) -> dict[str, Any]:
        jid = req.params["id"]
        m = members()
        if m is not None and m.view(jid) is not None:  # every member, through the origin
            try:
                return await mroutes.stop_members(m, jid, req.peer.uid, in_control_group(req))
            except mroutes.MembersRefused as e:
                raise ApiError(e.status, e.message, e.reason) from None
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
            final = await jm.stop(job.id, reason, grace_s=grace,
                                    cause=endcause.stopped_by(req.peer.uid, job.owner_uid))
            return final.as_dict(reveal=may_read_secrets(req, final)) if final else {}
        except JobError as e:
            raise ApiError(409, str(e)) from None

    from .adopt_api import routes as adopt_routes

    return [
        *adopt_routes(jm),  # POST /v1/jobs/adopt, /v1/jobs/adopt/check, /v1/jobs/{id}/exit
        Route("POST", "/v1/jobs", submit, privileged=False),
        Route("GET", "/v1/jobs", list_jobs),
        Route("GET", "/v1/jobs/{id}", show),
        Route("POST", "/v1/jobs/{id}/stop", stop, privileged=False),
    ]
