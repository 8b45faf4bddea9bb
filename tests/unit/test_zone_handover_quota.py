"""A user's placement refused for ``jobs.max_per_user`` takes nothing from anyone first: the node
side of a hand-over (ZoneComponent.on_handover) with a real component on loopback sockets and
real files, jobs from the stand-in job table of test_loan_component (the real JobManager needs
root and cgroups; its quota check is the stand-in's here, the real one is tested in
tests/kernel/test_jobs_per_user_limit_and_retention.py).

Before, the node took the GPUs it had offered back from the elastic jobs granted them (their
workers told to scale in) and only then found, in the job manager's submit, that the owner was
at the limit: every placement of a user at the limit, retried round after round and node after
node, scaled in other users' elastic jobs for a job that never started there.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_loan_component import StandInJob, StandInJobs, make_comp, run

from laminar.policy import placement as pl
from laminar.runtime.provenance import NO_ORIGIN, JobOrigin
from laminar.runtime.spec import JobSpec, QuotaError
from laminar.zone import wire
from laminar.zone.component import HANDOVER_OK, demand_to_probe

AT_LIMIT = 4242  # the uid whose jobs are at jobs.max_per_user on this node


class LimitedChecks:
    """Stand-in submission checks whose owner AT_LIMIT is at the per-user limit
    (SubmitChecks.quota's contract: QuotaError for a user at the limit, nothing for anyone else)."""

    def quota(self, uid: int) -> None:
        if uid == AT_LIMIT:
            raise QuotaError(f"too many jobs: uid {uid} is at the limit (stand-in)")


class LimitedJobs(StandInJobs):
    """Stand-in jobs with those checks (``jobs.checks``)."""

    checks = LimitedChecks()

    async def submit(self, spec: JobSpec, owner_uid: int = 0, owner_gid: int = 0, *, quota: bool = False,
                     origin: JobOrigin = NO_ORIGIN) -> StandInJob:
        if quota:
            self.checks.quota(owner_uid)
        jid = f"j{len(self.jobs) + 1}"
        self.jobs[jid] = StandInJob(jid, spec, list(spec.gpus or []), origin=origin)
        return self.jobs[jid]


def test_a_placement_of_a_user_at_the_limit_sheds_no_elastic_grant(tmp_path: Path) -> None:
    jobs = LimitedJobs(tmp_path / "state")
    jobs.jobs["e"] = StandInJob("e", JobSpec(["sleep", "1"], elastic_min=1, elastic_max=2).validate(), [0])
    comp = make_comp(tmp_path, pool="training", jobs=jobs, gpus=2)
    assert comp._settings is not None
    comp._settings["peer_unknown_uids"] = "allow"  # uids 4242 and 4343 have no account on this machine

    async def check() -> None:
        comp.refresh_inventory()
        assert comp.loan.elastic_round()["e"].gpus == 1 and comp.loan.granted_gpus() == {1}
        pid = 0x5252
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid, 5.0))
        assert isinstance(offer, wire.Offer) and [i for i, _ in offer.gpu_alloc] == [1]
        req = {"spec": {"command": ["sleep", "1"]}, "owner_uid": AT_LIMIT, "owner_gid": AT_LIMIT, "quota": True}
        ack = await comp.on_handover(2, wire.Handover(pid, json.dumps(req).encode()))
        assert ack.status != HANDOVER_OK and "too many jobs" in ack.text, ack
        assert pid not in comp.arbiter.placed
        assert comp.arbiter.view(comp.clock()).gpu_free == (0.0, 1.0)  # GPU 1 free again
        # the elastic job keeps its grant and was never told to scale in
        assert comp.loan.grants == {"e": [1]} and comp.loan.counts["sheds"] == 0

        # another user's placement on the same GPU sheds it as before, and starts
        pid2 = 0x5253
        offer = comp.handle_request(2, demand_to_probe(pl.Demand(gpus=1), pid2, 5.0))
        assert isinstance(offer, wire.Offer)
        req["owner_uid"] = req["owner_gid"] = 4343
        ack = await comp.on_handover(2, wire.Handover(pid2, json.dumps(req).encode()))
        assert ack.status == HANDOVER_OK, ack
        assert comp.loan.grants == {} and comp.loan.counts["sheds"] == 1

    run(comp, check)
