"""The kill-switch of a multi-node job (issue 33): ``POST /v1/killswitch`` with scope job and the
id of a job whose member runs here cuts the local member and asks the members component to cut
every other member, whose nodes cut theirs through ``NetGuard.set_job_switch`` (an origin's
ORDER killswitch_on/off). A job of this node alone is cut here only, as before.

netguard is real on two nodes (the stand-in data plane of test_killswitch_dataplane, loaded and
attached on each end of a veth pair, maps pinned); the members component is
``standin_agent.StandInMembers`` (a stand-in until laminar/members/ lands: its fan-out calls the
other node's ``set_job_switch`` directly, where the real one sends an ORDER), and the job manager
a stand-in job index (the cgroup ids are numbers registered in lm_jobs, as in
test_killswitch_race_jobs).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from standin_agent import StandInMember, StandInMembers, standin_agent
from test_killswitch_dataplane import start_dataplane, stop_dataplane

from laminar.api import ApiError, Peer, Request
from laminar.bpf import abi
from laminar.components import NetGuardAgent
from laminar.events import EventBus
from laminar.net.netguard import NetGuard
from laminar.runtime.spec import JobError
from laminar.store import Store

pytestmark = pytest.mark.kernel

JOB = "job-7-n1"  # the multi-node job: a member on each node, one id
ORIGINATED = "job-9-n1"  # a multi-node job node 1 originated, with no member there


class StandInJobs:
    """A stand-in job index (``laminar.components.JobIndex``): jobs by id with their cgroup ids."""

    def __init__(self, **cgroups: int) -> None:
        self.jobs = {jid.replace("_", "-"): SimpleNamespace(id=jid.replace("_", "-"), cgroup_id=cg, state="running")
                     for jid, cg in cgroups.items()}

    def get(self, job_id: str) -> Any:
        return self.jobs.get(job_id)

    def list(self, all_jobs: bool = True, ended_max: int | None = None) -> list[Any]:
        return list(self.jobs.values())


def node(dp: Any, store: Store, jobs: StandInJobs, members: StandInMembers | None) -> NetGuard:
    ng = NetGuard()
    ng.maps = {name: dp.map(name) for name in abi.NETGUARD_MAPS}
    ng.agent = standin_agent(NetGuardAgent, events=EventBus(store), store=store, jobs=jobs, members=members,
                             loop=asyncio.get_running_loop())
    for num, j in enumerate(jobs.jobs.values(), 1):  # each its own number, as the job manager gives
        ng.register_job(j.cgroup_id, num)
    return ng


def cut(ng: NetGuard, cg: int) -> bool:
    entry = ng.job_entry(cg)
    assert entry is not None
    return bool(entry.flags & abi.LM_JOB_KILL)


async def killswitch(ng: NetGuard, **body: Any) -> dict[str, Any]:
    route = next(r for r in ng.routes() if (r.method, r.path) == ("POST", "/v1/killswitch"))
    got: dict[str, Any] = await route.handler(Request("POST", "/v1/killswitch", {}, {}, body, Peer(0, 0, os.getpid())))
    return got


def test_a_multi_node_jobs_killswitch_reaches_every_member(veth_pair: Any, tmp_path: Path) -> None:
    dp_a = start_dataplane(veth_pair.a.argv(), veth_pair.ifname_a, "mksa")
    try:
        dp_b = start_dataplane(veth_pair.b.argv(), veth_pair.ifname_b, "mksb")
        try:
            asyncio.run(scenario(dp_a, dp_b, tmp_path))
        finally:
            stop_dataplane(dp_b)
    finally:
        stop_dataplane(dp_a)


async def scenario(dp_a: Any, dp_b: Any, tmp_path: Path) -> None:
    store_a, store_b = Store(tmp_path / "a.db"), Store(tmp_path / "b.db")
    try:
        # node 2: its member of JOB (cgroup 0x72) and a member of ORIGINATED (0x73); no members fan-out of its own
        b = node(dp_b, store_b, StandInJobs(**{"job-7-n1": 0x72, "job-9-n1": 0x73}), None)
        # node 1: its member of JOB (0x71) and a job of its own (job-3, 0x13); it originated ORIGINATED
        members = StandInMembers(StandInMember(JOB, index=0, count=2), originated=(ORIGINATED,), peers=(b,))
        a = node(dp_a, store_a, StandInJobs(**{"job-7-n1": 0x71, "job-3": 0x13}), members)

        got = await killswitch(a, action="on", scope="job", job=JOB)
        assert cut(a, 0x71) and cut(b, 0x72), "every member's traffic is cut"
        assert members.switched == [(JOB, True, 0)] and got["members"] == {"job": JOB, "on": True, "members": [True]}
        assert "its other members: asked through its origin" in got["message"]
        assert not cut(a, 0x13) and not cut(b, 0x73)
        got = await killswitch(a, action="off", scope="job", job=JOB)
        assert not cut(a, 0x71) and not cut(b, 0x72)
        assert members.switched[-1] == (JOB, False, 0)

        # a job of this node alone: cut here, nobody else asked, the answer as before
        got = await killswitch(a, action="on", scope="job", job="job-3")
        assert cut(a, 0x13) and "members" not in got and len(members.switched) == 2
        assert got["message"] == "kill-switch: traffic of job job-3 cut"
        await killswitch(a, action="off", scope="job", job="job-3")
        assert not cut(a, 0x13)

        # arm reaches the local member only
        got = await killswitch(a, action="arm", scope="job", job=JOB, at_s=600)
        assert len(members.switched) == 2 and "arm reaches this member only" in got["message"]
        await killswitch(a, action="off", scope="job", job=JOB)

        # the origin with no member of the job here: the members are reached, nothing cut here
        got = await killswitch(a, action="on", scope="job", job=ORIGINATED)
        assert cut(b, 0x73) and members.switched[-1] == (ORIGINATED, True, 0)
        assert got["message"].startswith(f"kill-switch: traffic of multi-node job {ORIGINATED} cut")
        with pytest.raises(ApiError) as e:
            await killswitch(a, action="arm", scope="job", job=ORIGINATED, at_s=60)
        assert e.value.status == 409
        await killswitch(a, action="off", scope="job", job=ORIGINATED)
        assert not cut(b, 0x73)

        # the fan-out refused: the local cut stands, the answer says who was not reached
        members.refuse = JobError("the origin, node 1, does not answer")
        got = await killswitch(a, action="on", scope="job", job=JOB)
        assert cut(a, 0x71) and not cut(b, 0x72)
        assert got["members"] is None and got["members_error"] == "the origin, node 1, does not answer"
        assert "not reached: the origin, node 1, does not answer" in got["message"]

        # the receiving side: set_job_switch on a job it does not run is refused, not raised
        assert b.set_job_switch("job-404-n1", True) is False
        assert b.set_job_switch(JOB, True) is True and cut(b, 0x72)
        await asyncio.sleep(0)  # the events are recorded in the next loop round
    finally:
        store_a.close()
        store_b.close()
