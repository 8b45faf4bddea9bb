"""Two reclaims at once, between real ZoneComponents on loopback (real UDP): each asks for one
server of the inference pool back, so two must go back, and each lent job must be requeued
once. Jobs come from stand-in job tables (the real JobManager needs root and cgroups)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from test_loan_component import StandInJob
from test_zone_handover import SubmittingJobs
from test_zone_replay import with_zone

from laminar.policy.endcause import EndCause
from laminar.runtime.spec import JobSpec
from laminar.zone.component import ZoneComponent


class LentJob(StandInJob):
    """A lent job whose work at risk is fixed (its weight in a return plan)."""

    at_risk_s: float = 0.0

    def work_at_risk_s(self, now: float) -> float:
        return self.at_risk_s


class RequeueJobs(SubmittingJobs):
    """Stand-in job table that records checkpoint requests and stops (what a requeue does)."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self.ckpt_requests: list[str] = []
        self.stops: list[str] = []
        self.causes: list[Any] = []  # the end cause each stop was given

    def request_checkpoint(self, job: Any) -> bool:
        self.ckpt_requests.append(job.id)
        return True  # the job writes its checkpoint in a while (here: never; ckpt_wait_s runs out)

    async def stop(self, job_id: str, reason: str, grace_s: float = 0.0, state: str = "stopped",
                   cause: Any = None) -> None:
        self.stops.append(job_id)
        self.causes.append(cause)
        self.jobs[job_id].state = state


def test_two_reclaims_at_once_return_two_servers_and_requeue_each_job_once(tmp_path: Path) -> None:
    tables = {n: RequeueJobs(tmp_path / f"state{n}") for n in (1, 2, 3, 4)}
    for n, risk in ((1, 10.0), (2, 100.0)):  # server 1's job is the cheaper to stop: both plans pick it
        ckpt = tmp_path / f"ckpt{n}"
        ckpt.mkdir()
        job = LentJob(f"lent{n}", JobSpec(["sleep", "1"], lent=True).validate(), [0], ckpt_dir=ckpt,
                      created=time.time())
        job.at_risk_s = risk
        tables[n].jobs[job.id] = job

    async def body(comps: dict[int, ZoneComponent]) -> None:
        a, b = await asyncio.gather(comps[3].loan.return_servers("inference", 1), comps[4].loan.return_servers("inference", 1))
        assert comps[1].loan.returned and comps[2].loan.returned, (a["servers"], b["servers"])
        assert sorted(a["servers"] + b["servers"]) == [1, 2], (a, b)
        for n in (1, 2):
            assert comps[n].loan.counts["returns"] == 1
        # each lent job: one requeue (one checkpoint request, one stop, one new placement)
        await asyncio.sleep(1.5)  # ckpt_wait_s runs out, the jobs stop and are placed again
        for n in (1, 2):
            assert tables[n].ckpt_requests == [f"lent{n}"], tables[n].ckpt_requests
            assert tables[n].stops == [f"lent{n}"], tables[n].stops
            assert tables[n].causes == [EndCause.REQUEUED]
        # each placed again as the requeue of its own key (the origin its hand-over recorded)
        copies = [j for t in tables.values() for j in t.jobs.values() if j.origin.requeued_from]
        assert sorted(j.origin.requeued_from for j in copies) == ["n1-lent1", "n2-lent2"]
        assert all("LM_REQUEUED_FROM" not in j.spec.env for j in copies)  # not the user's env

    asyncio.run(with_zone(tmp_path, {1: "inference", 2: "inference", 3: "training", 4: "training"}, body,
                          jobs=tables.get, loan={"ckpt_wait_s": 0.5}))


def test_the_return_of_a_server_with_many_lent_jobs_is_answered(tmp_path: Path) -> None:
    """The returned server answers with what happens to each lent job. With 80 lent jobs
    (CPU-only or GPU shares: many fit one node) that answer did not fit one datagram: it was
    never sent, and the coordinator reported that the server did not answer, though it had
    returned itself and requeued every job."""
    tables = {n: RequeueJobs(tmp_path / f"state{n}") for n in (1, 2)}
    for i in range(80):
        job = LentJob(f"job-{1000 + i}", JobSpec(["sleep", "1"], lent=True).validate(), [], created=time.time())
        tables[1].jobs[job.id] = job

    async def body(comps: dict[int, ZoneComponent]) -> None:
        out = await comps[2].loan.return_servers("inference", 1)
        assert out["servers"] == [1] and comps[1].loan.returned
        told = out["told"][1]
        assert told.get("returned") is True, told
        assert told.get("jobs_folded", len(told["jobs"])) == 80
        assert comps[1].endpoint.send_errors == 0

    asyncio.run(with_zone(tmp_path, {1: "inference", 2: "training"}, body, jobs=tables.get,
                          loan={"ckpt_wait_s": 0.1}))
