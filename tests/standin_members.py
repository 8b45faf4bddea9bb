"""A stand-in members component (the agent's ``members``) for the API's tests while the real
one (laminar/members/component.py) is built beside them: it answers what the routes call
(``laminar.components.MembersForApi``) from views the test gives, and records every call. It
places nothing and starts nothing: a test that needs a placed gang uses the real component."""

from __future__ import annotations

from typing import Any

from laminar.runtime.spec import JobError, JobSpec


def view(job_id: str, origin: int, nodes: list[tuple[int, str]], owner_uid: int = 0, state: str = "running",
         workers_min: int | None = None, workers_max: int | None = None) -> dict[str, Any]:
    """A job's view in the design's shape (docs/jobs.md, "CLI and API")."""
    k = len(nodes)
    return {"id": job_id, "state": state, "end_reason": None, "origin": origin, "workers": k,
            "workers_min": workers_min or k, "workers_max": workers_max or k, "launcher": "torchrun",
            "generation": 0, "restarts": 0, "last_ckpt": None, "last_ckpt_at": None, "owner_uid": owner_uid,
            "members": [{"index": i, "node": n, "addr": a, "state": "running", "code": None}
                        for i, (n, a) in enumerate(nodes)],
            "placement": {"outcome": "placed", "job": job_id, "members": [list(x) for x in nodes]}}


class StandinMembers:
    """The stand-in: ``jobs`` holds the views by id; ``calls`` what the routes asked; a refusal
    set in ``refuse`` is raised (JobError) by the next call."""

    def __init__(self, origin: int = 1) -> None:
        self.origin = origin
        self.jobs: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.refuse: str | None = None
        self.next_num = 7

    def _refused(self) -> None:
        if self.refuse is not None:
            why, self.refuse = self.refuse, None
            raise JobError(why)

    async def submit(self, spec: JobSpec, owner_uid: int, owner_gid: int, *,
                     spread_zones: bool = False) -> dict[str, Any]:
        self.calls.append(("submit", spec, owner_uid, owner_gid, spread_zones))
        self._refused()
        jid = f"job-{self.next_num}-n{self.origin}"
        self.next_num += 1
        assert spec.workers is not None
        v = view(jid, self.origin, [(self.origin + i, f"10.9.0.{self.origin + i}") for i in range(spec.workers)],
                 owner_uid, state="starting", workers_min=spec.workers_min, workers_max=spec.workers_max)
        self.jobs[jid] = v
        return v

    def views(self) -> list[dict[str, Any]]:
        return list(self.jobs.values())

    def view(self, job_id: str) -> dict[str, Any] | None:
        return self.jobs.get(job_id)

    def member_of(self, job_id: str) -> None:
        """No member of any job on this stand-in's node (it originates them only)."""
        return None

    async def stop(self, job_id: str, by_uid: int) -> dict[str, Any]:
        self.calls.append(("stop", job_id, by_uid))
        self._refused()
        v = self.jobs[job_id]
        v.update(state="ended", end_reason=f"stopped by uid {by_uid}")
        for m in v["members"]:
            m["state"] = "stopped"
        return v

    async def killswitch(self, job_id: str, on: bool, by_uid: int) -> dict[str, Any]:
        self.calls.append(("killswitch", job_id, on, by_uid))
        self._refused()
        return {"job": job_id, "on": on, "members": [m["node"] for m in self.jobs[job_id]["members"]],
                "message": f"kill-switch: traffic of every member of {job_id} {'cut' if on else 'restored'}"}
